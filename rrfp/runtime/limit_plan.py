"""A ``buffer_limit`` over a run of ``ScheduleRRFP``: parsed once, applied from the first
step, settled from measured bytes where it is counted in bytes, and said in the log.

Microbatch settings (``"hint"``, ``"hint+k"``, ``"Nx hint"``, an int) give the limits of
every step at once. Byte settings (``"busiest"``, a budget, ``"auto"``) run the first
training step at the hint's own limits; once that step has measured each stage's bytes per
microbatch, the ranks of the pipeline exchange them (and their budgets) and every rank
derives the same microbatch limits (``rrfp.core.limits.limits_within_bytes``), fixed from then
on.
Figures on what each setting buys live on the results pages the log line points at
(docs/guide/choosing.md), not in the line itself.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist

from rrfp.core.hints import Hint
from rrfp.core.limits import (byte_budgets, ByteLimits, check_limits, first_step_limits,
                              limits_within_bytes, MemoryLimits)
from rrfp.core.policy import policy_for
from rrfp.core.settings import BufferLimit, parse_buffer_limit
from rrfp.core.text import counted

logger = logging.getLogger(__name__)

GAINS_PAGE = "docs/guide/choosing.md"
"""Where the log line sends a reader for what memory slack buys."""


class LimitPlan:
    """One rank's memory limits over a run.

    ``policy``: the user's (parsed), or None for the default at each limit; the fixed
    order's limits are checked as such. ``ranked_by``: a hint ``interchangeable`` with
    ``hint`` that ranks the steps' ready actions at the limits counted on ``hint``
    (self-driving's candidates); None: ``hint`` itself.
    """

    def __init__(self, spec: object, hint: Hint, rank: int, policy: str | None,
                 ranked_by: Hint | None = None):
        self.setting: BufferLimit = parse_buffer_limit(spec)
        self.hint, self.ranked_by = hint, ranked_by
        self._rank, self._policy_given = rank, policy
        self.limits: MemoryLimits = first_step_limits(self.setting, hint,
                                                      fixed_order=policy == "fixed")
        """The limits of the next step."""
        if ranked_by is not None:
            if self.setting.in_bytes:
                raise ValueError(f"buffer_limit={self.setting.spec!r}: a hint other than the "
                                 "run's ranks at limits counted in microbatches only")
            check_limits(self.limits, ranked_by, self.setting.spec,
                         fixed_order=policy == "fixed")
        self.byte_limits: ByteLimits | None = None
        """Where the setting is in bytes: the microbatch limits derived from the first
        step's bytes (from the second step on), with the budgets they keep."""
        self.summary = (
            f"buffer_limit={self.setting.spec!r} is counted in bytes: the first training step "
            "runs at the hint's own limits and measures each stage's bytes per microbatch; "
            "the microbatch limits that keep every rank within its bytes follow from the "
            "second step on (logged then)." if self.setting.in_bytes
            else limit_summary(self.setting.spec, self.limits, hint, rank))
        """One sentence for the log: what the limits allow on this rank."""

    @property
    def policy(self) -> str:
        """The policy of a step at these limits (``rrfp.core.policy.policy_for``)."""
        return policy_for(self._policy_given, self.ranked_by or self.hint, self.limits)

    @property
    def waiting_for_bytes(self) -> bool:
        """Whether the limits still wait for a step's measured bytes per microbatch."""
        return self.setting.in_bytes and self.byte_limits is None

    def settle(self, bytes_per_microbatch: Mapping[int, int], group: dist.ProcessGroup | None,
               device: torch.device, free_bytes: Callable[[], int] | None) -> None:
        """The byte setting's microbatch limits, from this rank's stages' measured bytes per
        microbatch, exchanged over the pipeline ``group`` (the busiest rank may be
        another): the same limits on every rank, or the same ``ValueError``.
        ``free_bytes``: the device's free bytes (``buffer_limit="auto"``)."""
        hint, setting, rank = self.hint, self.setting, self._rank
        stages, ranks = hint.num_stages, hint.num_ranks
        exchanged = torch.zeros(stages + ranks, dtype=torch.int64, device=device)
        for s, nbytes in bytes_per_microbatch.items():
            exchanged[s] = nbytes
        if setting.auto:
            exchanged[stages + rank] = free_bytes()  # type: ignore[misc]
        elif setting.budget_bytes is not None:
            exchanged[stages + rank] = setting.budget_bytes
        dist.all_reduce(exchanged, group=group)
        values = exchanged.tolist()
        per_microbatch = {s: values[s] for s in range(stages)}
        budgets = byte_budgets(setting, hint, per_microbatch,
                               {r: values[stages + r] for r in range(ranks)})
        try:
            self.byte_limits = limits_within_bytes(hint, per_microbatch, budgets)
        except ValueError as e:
            raise ValueError(f"buffer_limit={setting.spec!r}: {e}") from None
        self.limits = self.byte_limits.limits
        check_limits(self.limits, hint, setting.spec, fixed_order=self._policy_given == "fixed")
        local = hint.stages_on(rank)
        self.summary = byte_limit_summary(setting.spec, self.byte_limits, rank, local)
        logger.info(
            "ScheduleRRFP on pipeline rank %d: from the first step's bytes per microbatch %s, "
            "memory limits %s per stage and %d on the rank (policy %s). %s", rank,
            {s: per_microbatch[s] for s in local}, {s: self.limits.per_stage[s] for s in local},
            self.limits.per_rank[rank], self.policy, self.summary)
        self._warn_if_over_budget()

    def _warn_if_over_budget(self) -> None:
        limits, rank = self.byte_limits, self._rank
        if rank not in limits.over_budget():  # type: ignore[union-attr]
            return
        message = (
            f"buffer_limit={self.setting.spec!r}: pipeline rank {rank} keeps the hint's own "
            f"peaks, which may hold up to {limits.allowed_bytes[rank]} B of activations in a "
            f"mix other than the fixed order's, above its budget of {limits.budgets[rank]} B "
            f"(the fixed order holds {limits.fixed_peak_bytes[rank]} B): lower limits could "
            "deadlock; give that rank more bytes to be sure")
        warnings.warn(message, stacklevel=5)
        logger.warning(message)


def limit_summary(spec: str | int, limits: MemoryLimits, hint: Hint, rank: int) -> str:
    """One sentence for the log: what ``buffer_limit=spec`` allows on ``rank``, and where
    to read what memory slack buys; then one on the job's peak (the busiest rank's), in
    microbatches held."""
    rank_peaks = hint.plan.rank_peaks()
    allowed, held = limits.per_rank[rank], rank_peaks[rank]
    busiest, most = max(rank_peaks.values()), max(limits.per_rank.values())
    job = (f" No rank may hold more than the fixed schedule's busiest rank "
           f"({counted(busiest, 'microbatch')}), so the job's peak is unchanged."
           if most <= busiest else
           f" The busiest rank may hold {counted(most, 'microbatch')}, {most - busiest} more "
           "than the fixed schedule's busiest rank ('busiest' keeps the job's peak).")
    if allowed == held:
        return (f"buffer_limit={spec!r} allows no activation memory beyond the fixed "
                f"schedule's ({counted(held, 'microbatch')} on this rank), so RRFP mostly "
                f"follows the hint; speed needs memory slack, e.g. buffer_limit='hint+2' (measured "
                f"gains: {GAINS_PAGE}).{job}")
    if allowed > held:
        return (f"buffer_limit={spec!r} allows {counted(allowed, 'microbatch')} of activations "
                f"on this rank, {allowed - held} more than the fixed schedule holds, to run ready "
                f"work out of hint order (measured gains: {GAINS_PAGE}).{job}")
    return (f"buffer_limit={spec!r} allows {counted(allowed, 'microbatch')} of activations "
            f"on this rank, fewer than the {held} the fixed schedule holds: less memory, and "
            f"usually slower than the fixed schedule.{job}")


def byte_limit_summary(spec: str | int, byte_limits: ByteLimits, rank: int,
                       local: tuple[int, ...]) -> str:
    """One sentence for the log: what a byte ``buffer_limit`` became on ``rank`` (holding
    stages ``local``)."""
    limits = byte_limits.limits
    allowed, budget = byte_limits.allowed_bytes[rank], byte_limits.budgets[rank]
    busiest = max(byte_limits.fixed_peak_bytes.values())
    most = max(byte_limits.allowed_bytes.values())
    job = (f" No rank's limits allow more than the {busiest} B the fixed schedule's busiest "
           "rank holds, so the job's peak activation bytes are unchanged." if most <= busiest
           else f" The busiest rank's limits allow {most} B, {most - busiest} B more than the "
           "fixed schedule's busiest rank holds ('busiest' keeps the job's peak).")
    return (f"buffer_limit={spec!r} allows {counted(limits.per_rank[rank], 'microbatch')} "
            f"on this rank ({ {s: limits.per_stage[s] for s in local} } per stage): at most "
            f"{allowed} B of activations, within its {budget} B "
            f"(the fixed order holds {byte_limits.fixed_peak_bytes[rank]} B here).{job}")
