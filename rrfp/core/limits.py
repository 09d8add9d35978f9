"""Memory limits: how many microbatches of activations a rank may hold, and the arithmetic
that turns a ``buffer_limit`` setting (``rrfp.core.settings.parse_buffer_limit``) into them.

A microbatch's activations on a stage are held from its forward until its release point
(``rrfp.core.plan``: B, or W when backward is split). The hint's own peaks come from its plan;
the arbiter (``rrfp.core.arbiter``) enforces the limits; ``ScheduleRRFP``'s ``LimitPlan``
(``rrfp.runtime.limit_plan``) applies them over a run. Pure Python, like the plan.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rrfp.core.actions import _Action
from rrfp.core.plan import held_through
from rrfp.core.settings import BufferLimit, parse_buffer_limit

if TYPE_CHECKING:
    from rrfp.core.hints import Hint
    from rrfp.core.plan import RankPlan


@dataclass(frozen=True)
class MemoryLimits:
    """Microbatches of activations a rank may hold (see ``resolve_buffer_limits``).

    A microbatch's activations on a stage are held from its F until its release point: B,
    or W when backward is split.
    """

    per_stage: Mapping[int, int]
    """Per stage: microbatches held at once."""
    per_rank: Mapping[int, int]
    """Per pipeline rank: microbatches held at once by all its stages together."""

    def first_stage_below(self, peaks: Mapping[int, int]) -> tuple[int, int, int] | None:
        """The first stage whose limit is below ``peaks`` (a hint's own), as
        ``(stage, limit, peak)``; None if every stage's limit reaches its peak."""
        return next(((s, self.per_stage[s], peak) for s, peak in peaks.items()
                     if self.per_stage[s] < peak), None)


def resolve_buffer_limits(spec: str | int | BufferLimit, hint: Hint, *,
                          fixed_order: bool = False) -> MemoryLimits:
    """Memory limits from ``"hint"``, ``"hint+k"``, ``"Nx hint"``, ``"busiest"``, a byte
    budget, ``"auto"`` or an int (any spelling
    ``rrfp.core.settings.parse_buffer_limit`` takes), in microbatches of activations held (from
    a microbatch's F until its last backward piece, B or W):

    * ``"hint"``: per stage, the fixed schedule's own peak; per rank, its per-rank peak (the
      most the rank's stages hold together at any moment of the fixed order). So RRFP never
      holds more, on any stage or rank, than the fixed schedule holds at some moment.
    * ``"hint+k"``: ``k`` more per stage and ``k`` more per rank; ``"Nx hint"``: N times
      the hint's peaks.
    * ``"busiest"``: per stage and per rank, what the fixed schedule's busiest rank holds
      at once (the largest per-rank peak). No rank then holds more than the fixed
      schedule's busiest rank, the one that sizes the job's memory, so the job's peak is
      unchanged; the other ranks' headroom becomes slack. Counted in microbatches here,
      which is exact where every stage's microbatch saves the same bytes (the
      simulator's model); ``ScheduleRRFP`` counts it in bytes from its second step
      (``first_step_limits``, ``limits_within_bytes``), as it does a byte budget or
      ``"auto"``, which are refused here with ``ValueError``: they need measured bytes.
    * an int ``n``: ``n`` per stage and ``n`` per rank.

    Every limit accepted here is deadlock-free whatever the timing (docs/design/deadlock-freedom.md).
    """
    limit = parse_buffer_limit(spec)
    spec = limit.spec
    if limit.auto or limit.budget_bytes is not None:
        raise ValueError(
            f"buffer_limit={spec!r} is a byte budget, which becomes microbatch limits only "
            "from the bytes per microbatch a first step measures (ScheduleRRFP does this; "
            "see first_step_limits); counted in microbatches, as in the simulator, use "
            "'busiest', 'hint+k' or an int")
    rank_peaks = hint.plan.rank_peaks()
    busiest = max(rank_peaks.values())
    limits = MemoryLimits(
        {s: limit.of(peak, busiest) for s, peak in hint.plan.stage_peaks.items()},
        {r: limit.of(peak, busiest) for r, peak in rank_peaks.items()})
    check_limits(limits, hint, spec, fixed_order=fixed_order)
    return limits


def first_step_limits(spec: str | int | BufferLimit, hint: Hint, *,
                      fixed_order: bool = False) -> MemoryLimits:
    """The limits of ``ScheduleRRFP``'s first training step: ``resolve_buffer_limits``' for
    a microbatch setting; the hint's own peaks for one in bytes (``"busiest"``, a budget,
    ``"auto"``), whose microbatch limits follow from that step's measured bytes
    (``limits_within_bytes``)."""
    limit = parse_buffer_limit(spec)
    return resolve_buffer_limits("hint" if limit.in_bytes else limit, hint,
                                 fixed_order=fixed_order)


def check_limits(limits: MemoryLimits, hint: Hint, spec: object, *,
                 fixed_order: bool | str = False) -> None:
    """``ValueError`` unless ``limits`` are deadlock-free for ``hint`` (see
    ``resolve_buffer_limits``); ``spec``: how the user wrote them (for the message).
    ``fixed_order``: the hint's order runs as it is (``policy="fixed"``, or the setting
    named, e.g. the in-run A/B's ``"fixed_every=4"``), which needs every stage's own
    peak."""
    peaks, rank_peaks = hint.plan.stage_peaks, hint.plan.rank_peaks()
    below = limits.first_stage_below(peaks)
    if fixed_order and below is not None:
        s, got, need = below
        asked = "policy='fixed'" if fixed_order is True else fixed_order
        raise ValueError(
            f"{asked} runs hint {hint.name!r} in its own order, which holds up to "
            f"{need} microbatches on stage {s}, but buffer_limit={spec!r} allows {got}: it "
            f"would stall; use buffer_limit='hint' (or larger) with {asked}")
    for rank, peak in rank_peaks.items():
        stages = hint.stages_on(rank)
        if len(stages) > 1 and limits.per_rank[rank] < peak:
            raise ValueError(
                f"buffer_limit={spec!r} allows {limits.per_rank[rank]} microbatches of "
                f"activations on pipeline rank {rank}, which holds stages {list(stages)}: "
                f"below the {peak} that hint {hint.name!r} itself holds there at once, which "
                "a rank with several stages needs to be deadlock-free; use 'hint', 'hint+k' "
                f"or an int >= {max(rank_peaks.values())}")
    if not hint.plan.streams_share_one_order():
        if below is not None:
            s, got, need = below
            raise ValueError(
                f"buffer_limit={spec!r} allows {got} microbatches in flight on stage {s}, "
                f"but hint {hint.name!r} runs its backwards in a different microbatch order "
                f"than its forwards, which needs its own peak ({need}) to be deadlock-free: "
                "use 'hint', 'hint+k' or a larger int"
            )


def fixed_peak_bytes(hint: Hint, bytes_per_microbatch: Mapping[int, int]) -> dict[int, int]:
    """Per rank, the most activation bytes the hint's fixed order holds at once, where a
    microbatch held on stage s holds ``bytes_per_microbatch[s]`` (held from its F until
    its release point, as ``rrfp.core.plan`` counts microbatches)."""
    return {rank: peak_bytes_held(plan, [node.action for node in plan.nodes],
                                  bytes_per_microbatch)
            for rank, plan in hint.plan.ranks.items()}


def realized_peak_bytes(hint: Hint, rank: int, realized: Iterable[str],
                        bytes_per_microbatch: Mapping[int, int]) -> int:
    """The most activation bytes ``rank`` held at once in a step that ran ``realized``
    (its actions as ``StepStats.realized_order`` writes them), at ``bytes_per_microbatch``:
    counted as ``fixed_peak_bytes`` counts the hint's own order, so the two compare."""
    return peak_bytes_held(hint.plan.ranks[rank], (_Action.from_str(a) for a in realized),
                           bytes_per_microbatch)


def peak_bytes_held(plan: RankPlan, order: Iterable[_Action],
                    bytes_per_microbatch: Mapping[int, int]) -> int:
    """The most activation bytes a rank holds at once running its ``plan``'s actions in
    ``order`` (the hint's own, or one a step realized), a microbatch held on stage s
    holding ``bytes_per_microbatch[s]`` from its F until its release point."""
    return max((during for _, during, _ in held_through(
        (plan.node(action) for action in order),
        amount=lambda node: bytes_per_microbatch[node.stage])), default=0)


def most_bytes_allowed(per_stage: Mapping[int, int], rank_limit: int,
                       bytes_per_microbatch: Mapping[int, int], stages: Iterable[int]) -> int:
    """The most activation bytes a rank holding ``stages`` may hold under these limits: its
    worst mix, the rank limit filled with the microbatches of its largest stages first,
    each stage up to its own limit."""
    room, total = rank_limit, 0
    for s in sorted(stages, key=lambda s: -bytes_per_microbatch[s]):
        take = min(per_stage[s], room)
        total, room = total + take * bytes_per_microbatch[s], room - take
    return total


def byte_budgets(setting: BufferLimit, hint: Hint, bytes_per_microbatch: Mapping[int, int],
                 given: Mapping[int, int]) -> dict[int, int]:
    """Per rank, the activation bytes a byte ``setting`` lets it hold: under ``"busiest"``
    what the fixed schedule's busiest rank holds (``fixed_peak_bytes``), on every rank;
    under a budget or ``"auto"``, the ``given`` bytes of each rank."""
    if setting.busiest:
        busiest = max(fixed_peak_bytes(hint, bytes_per_microbatch).values())
        return dict.fromkeys(range(hint.num_ranks), busiest)
    return {r: given[r] for r in range(hint.num_ranks)}


@dataclass(frozen=True)
class ByteLimits:
    """Microbatch limits derived from byte budgets (``limits_within_bytes``)."""

    limits: MemoryLimits
    budgets: Mapping[int, int]
    """Per rank: the activation bytes it may hold."""
    allowed_bytes: Mapping[int, int]
    """Per rank: the most bytes ``limits`` let its stages hold at once (the worst mix of
    microbatches the per-stage and per-rank limits allow). Within ``budgets`` except where
    the hint's own peaks already exceed them (the floor, kept for deadlock-freedom)."""
    fixed_peak_bytes: Mapping[int, int]
    """Per rank: the bytes the hint's fixed order holds at its peak."""

    def over_budget(self) -> list[int]:
        """Ranks where even the hint's own peaks may exceed the budget."""
        return [r for r, allowed in self.allowed_bytes.items() if allowed > self.budgets[r]]


def limits_within_bytes(hint: Hint, bytes_per_microbatch: Mapping[int, int],
                        budgets: Mapping[int, int]) -> ByteLimits:
    """The largest microbatch limits under which no rank can hold more than its byte
    budget, given each stage's bytes per microbatch; never below the hint's own peaks (per
    stage and per rank), which keep every step deadlock-free (``resolve_buffer_limits``).

    A rank's bytes are bounded by its worst mix: its per-rank limit filled with the
    microbatches of its largest stages first, each stage up to its own limit. From the
    hint's peaks, the rank limit and every stage's limit grow together one microbatch at a
    time while that bound fits the budget ("hint+k" in bytes); then single stages grow,
    smallest bytes first, while it still fits (with the rank limit binding, a stage's
    limit costs nothing more). Limits stop at the step's microbatches (a stage never holds
    more). ``ValueError`` where a budget is below what the fixed order itself holds there:
    no limit can keep that rank within it.
    """
    stage_peaks, rank_peaks = hint.plan.stage_peaks, hint.plan.rank_peaks()
    fixed = fixed_peak_bytes(hint, bytes_per_microbatch)
    per_stage: dict[int, int] = {}
    per_rank: dict[int, int] = {}
    allowed: dict[int, int] = {}
    cap = hint.n_microbatches
    for rank in hint.orders:
        stages = hint.stages_on(rank)
        budget = budgets[rank]
        if fixed[rank] > budget:
            raise ValueError(
                f"pipeline rank {rank}'s activation budget is {budget} B, but hint "
                f"{hint.name!r} itself holds {fixed[rank]} B of activations there at its peak "
                f"(bytes per microbatch per stage, measured in the first step: "
                f"{ {s: bytes_per_microbatch[s] for s in stages} }): give at least "
                f"{fixed[rank]} B on that rank, or use buffer_limit='hint'")
        limit = {s: stage_peaks[s] for s in stages}
        rank_limit = rank_peaks[rank]

        def worst(limit: Mapping[int, int], rank_limit: int) -> int:
            return most_bytes_allowed(limit, rank_limit, bytes_per_microbatch, stages)

        while rank_limit < cap * len(stages):
            wider = {s: min(limit[s] + 1, cap) for s in stages}
            if worst(wider, rank_limit + 1) > budget:
                break
            limit, rank_limit = wider, rank_limit + 1
        for s in sorted(stages, key=lambda s: bytes_per_microbatch[s]):
            while limit[s] < min(cap, rank_limit) and worst({**limit, s: limit[s] + 1},
                                                             rank_limit) <= budget:
                limit[s] += 1
        per_stage.update(limit)
        per_rank[rank] = rank_limit
        allowed[rank] = worst(limit, rank_limit)
    return ByteLimits(MemoryLimits(per_stage, per_rank), dict(budgets), allowed, fixed)
