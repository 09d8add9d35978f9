"""What the arguments of torch's runtime schedules that torchtitan passes mean under RRFP
(``ScheduleRRFP(..., **torch_arguments)``).

torch's multi-stage runtime schedules take ``max_active_stages`` (how many local stages an
FSDP job keeps unsharded), ``unshard_lookahead`` (how many of them may start their
all-gather ahead of their compute: ``"full"``, ``"auto"`` or one distance per pipeline
rank) and ``defer_pp_recv`` (post each receive only just before the compute that consumes
it); torchtitan passes the first two to every multi-stage schedule class.

RRFP unshards every local FSDP stage at the step's start, in stage order, and keeps them
unsharded until their REDUCE_GRAD (docs/design/invariants.md, 4: an all-gather at a point whose
timing differs between replicas would mismatch them). So it does what a residency window
of all local stages with a full lookahead does, and accepts every value that means the
same for the job's FSDP stages (any value when no stage holds FSDP modules: then torch
gathers nothing either); a smaller window or a shorter lookahead is refused in one line.
It posts each channel's receives ahead (an arrived message is how it sees that an action
is ready), so ``defer_pp_recv=True`` is refused. ``backward_requires_autograd`` means what
it means in torch's schedules (False: a step may run under ``torch.no_grad()``, for custom
functions that compute the backward themselves).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TypedDict

from rrfp.core.hints import Hint

Lookahead = str | tuple[int, ...]


def stages_per_rank(hint: Hint) -> dict[int, int]:
    """How many stages ``hint`` places on each pipeline rank."""
    return {rank: len(hint.stages_on(rank)) for rank in hint.orders}


class TorchArguments(TypedDict, total=False):
    """The keywords ``ScheduleRRFP`` takes from torch's runtime schedules."""

    max_active_stages: int | None
    unshard_lookahead: Lookahead
    defer_pp_recv: bool
    backward_requires_autograd: bool


@dataclass(frozen=True)
class TorchScheduleArguments:
    """The arguments of torch's runtime schedules ScheduleRRFP takes, as given."""

    max_active_stages: int | None = None
    """None: every local stage (what RRFP does)."""
    unshard_lookahead: Lookahead = "full"
    defer_pp_recv: bool = False
    backward_requires_autograd: bool = True
    """False: a step may run under ``torch.no_grad()`` (custom backward functions)."""

    @classmethod
    def of(cls, keywords: Mapping[str, object]) -> TorchScheduleArguments:
        """The arguments in ``keywords``; ``TypeError`` naming one that is none of them."""
        known = {field.name for field in fields(cls)}
        for name in keywords:
            if name not in known:
                raise TypeError(f"ScheduleRRFP() got an unexpected keyword argument {name!r} "
                                f"(torch's schedule arguments it takes: {sorted(known)}; "
                                f"RRFP's own go in settings=rrfp.Settings(...))")
        return cls(**keywords)  # type: ignore[arg-type]

    def check(self, stages_per_rank: Mapping[int, int], fsdp: bool) -> None:
        """``ValueError`` for a value torch would refuse, or one that asks of the job's
        FSDP stages what RRFP does not do (``fsdp``: this rank's stages hold FSDP modules;
        ``stages_per_rank``: the hint's, so every rank gives the same verdict)."""
        if self.defer_pp_recv:
            raise ValueError(
                "defer_pp_recv=True posts each receive only just before the compute that "
                "consumes it; ScheduleRRFP posts each channel's receives ahead (a ring "
                "bounded by buffer_limit), since an arrived message is how it sees which "
                "action is ready: leave defer_pp_recv False")
        for rank, stages in sorted(stages_per_rank.items()):
            window = stages if self.max_active_stages is None else self.max_active_stages
            distance = self.lookahead_of(rank, window, len(stages_per_rank))
            if fsdp and window < stages:
                raise ValueError(
                    f"max_active_stages={self.max_active_stages} keeps {window} of the "
                    f"{stages} FSDP stages of pipeline rank {rank} unsharded; {_RRFP_UNSHARDS}"
                    f": pass max_active_stages >= {stages} (or None)")
            if fsdp and distance < stages:
                raise ValueError(
                    f"unshard_lookahead={self.unshard_lookahead!r} lets pipeline rank {rank} "
                    f"start {distance} of its {stages} FSDP stages' all-gathers ahead; "
                    f"{_RRFP_UNSHARDS}: pass unshard_lookahead='full' (or distances >= "
                    f"{stages})")

    def lookahead_of(self, rank: int, window: int, num_ranks: int) -> int:
        """How many stages pipeline ``rank`` may start unsharding ahead, within a residency
        ``window`` (torch's rules: ``"full"`` the window, ``"auto"`` ``min(rank + 2,
        window)``, a tuple one distance per rank within ``[1, window]``)."""
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"max_active_stages must be a positive integer or None, got "
                             f"{self.max_active_stages!r}")
        lookahead = self.unshard_lookahead
        if lookahead == "full":
            return window
        if lookahead == "auto":
            return min(rank + 2, window)
        if not isinstance(lookahead, tuple) or len(lookahead) != num_ranks:
            raise ValueError(f"unshard_lookahead must be 'full', 'auto' or a tuple of "
                             f"{num_ranks} integers (one per pipeline rank), got {lookahead!r}")
        distance = lookahead[rank]
        if isinstance(distance, bool) or not isinstance(distance, int) or not (
                1 <= distance <= window):
            raise ValueError(f"unshard_lookahead[{rank}] must be an integer within [1, "
                             f"max_active_stages={window}], got {distance!r}")
        return distance


_RRFP_UNSHARDS = ("ScheduleRRFP unshards every local FSDP stage at the step's start, in stage "
                  "order, and keeps it unsharded until its REDUCE_GRAD, so that every replica "
                  "all-gathers at the same points whatever order its actions run in")
