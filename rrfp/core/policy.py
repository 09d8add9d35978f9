"""Arbitration policies: which of the ready actions a rank runs.

A policy only ever picks among actions the arbiter found ready (head of their streams,
inputs arrived, within the memory limit), so no policy can break the bitwise-fidelity or
channel-order invariants; they differ only in speed. Policies that may decline to run a
ready action (return None) must not do so forever, or the pipeline would stall.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from rrfp.core.arbiter import ArbiterView, OwnOrder, Policy
from rrfp.core.graph import step_graph
from rrfp.core.history import History
from rrfp.core.limits import MemoryLimits
from rrfp.core.plan import Node
from rrfp.core.settings import add_policy_name, POLICIES, policy_names

if TYPE_CHECKING:
    from rrfp.core.actions import _Action, Edge
    from rrfp.core.hints import Hint

__all__ = ["POLICIES", "Policy", "default_policy", "make_policy", "History", "register_policy"]


class HintLed:
    """Mixin of the policies that launch ahead of a busy device only the hint's next
    action (for BF/BFW too, whose rules pick among ready actions only)."""

    def lead(self, arbiter: ArbiterView) -> int:
        return arbiter.first_undone


class HintOrder(HintLed):
    """Readiness-first: the ready action that ranks highest in the hint."""

    name = "hint"

    def choose(self, ready: Sequence[Node], arbiter: ArbiterView) -> Node | None:
        return ready[0]


class HintThenDrain(HintLed):
    """Readiness-first, as ``hint``, until the rank's hint order reaches its last forward;
    from there on (the drain: the step's last backward pieces) the hint's own order.

    Deviations pay where they fill a wait in the warm-up and the steady state; in the
    drain they only reorder the backward pieces whose order the hint laid out to end the
    step, moving its last chain. It always allows the hint's next action, so it cannot
    deadlock where the fixed schedule does not, and is greedy below the hint's memory
    (where the hint's next action may wait for one that comes later in its order).
    """

    name = "drain"

    def __init__(self) -> None:
        self._drain_from: int | None = None

    def choose(self, ready: Sequence[Node], arbiter: ArbiterView) -> Node | None:
        if self._drain_from is None:
            self._drain_from = max((n.index for n in arbiter.nodes if n.kind == "F"),
                                   default=0)
        first = ready[0]
        if (arbiter.first_undone >= self._drain_from and first.index != arbiter.first_undone
                and not arbiter.below_hint_memory):
            return None
        return first


class FixedOrder(OwnOrder):
    """The fixed schedule itself: only the first not-yet-run action of the hint."""


class ArrivalOrder(HintLed):
    """Readiness-first in the order actions became ready: the ready action whose input
    arrived first (one fed only by this rank's own actions counts as ready from the step
    start); the hint's order breaks ties.

    With one stage per rank and memory slack this is what a runtime launching every action
    as soon as it is ready would do, without freezing a device queue: a forward whose input
    came first is not passed by a backward that arrived after it. Greedy, so it never
    declines a ready action.
    """

    name = "arrival"

    def choose(self, ready: Sequence[Node], arbiter: ArbiterView) -> Node | None:
        def became_ready(node: Node) -> tuple[float, int]:
            if node.message is None:
                return (-1.0, node.index)
            return (arbiter.arrival_times[node.message], node.index)
        return min(ready, key=became_ready)


class BackwardFirst(HintLed):
    """The paper's BF rule, and BFW when the hint splits backward into I and W.

    Each round runs one ready backward, then one ready forward (either kind alone when
    the other is not ready). Backwards prefer the higher model chunk, forwards the lower;
    ties go to the lower microbatch. Weight-gradient (W) actions run only when no
    forward or backward is ready.
    """

    def __init__(self, name: str = "BF"):
        self.name = name

    def choose(self, ready: Sequence[Node], arbiter: ArbiterView) -> Node | None:
        backwards = [n for n in ready if n.kind == "BI"]
        forwards = [n for n in ready if n.kind == "F"]
        # The round's position follows what actually ran (not what was proposed), so
        # ranks that run the same sequence choose alike.
        backward_next = arbiter.last_kind != "BI"
        if backwards and (backward_next or not forwards):
            return min(backwards, key=lambda n: (-n.stage, n.microbatch))
        if forwards:
            return min(forwards, key=lambda n: (n.stage, n.microbatch))
        return ready[0]


class Lookahead(HintLed):
    """Readiness-first with a guard: a ready action ranked below the hint's next action
    runs only if, by duration estimates from earlier steps, it ends before that next
    action's input is expected (its arrival time in an earlier step).

    Without history (the first step) it follows the hint exactly. Like ForwardWindow it
    always allows the hint's next action, and is greedy below the hint's memory.
    """

    name = "lookahead"

    def __init__(self, history: History | None, clock: Callable[[], float]):
        self.history = history
        self.clock = clock

    def choose(self, ready: Sequence[Node], arbiter: ArbiterView) -> Node | None:
        head = arbiter.nodes[arbiter.first_undone]
        if ready[0] is head or arbiter.below_hint_memory:
            return ready[0]
        message = _awaited_message(head, arbiter)
        expected = None if message is None else self.expected_arrival(message, arbiter)
        if expected is None:
            return None
        now = self.clock()
        for node in ready:
            estimate = self.duration(node)
            if estimate is not None and now + estimate <= expected:
                return node
        return None

    def duration(self, node: Node) -> float | None:
        """How long ``node`` is expected to run (None: unknown): from its microbatch's
        size where the step's sizes are known, else its stage and kind's mean."""
        if self.history is None:
            return None
        kind = node.action.computation_type.value
        predicted = self.history.predicted(node.stage, kind, node.microbatch)
        if predicted is not None:
            return predicted
        return self.history.durations.get((node.stage, kind))

    def expected_arrival(self, message: tuple[Edge, int], arbiter: ArbiterView) -> float | None:
        """When ``message``, not yet here, is expected (None: unknown)."""
        history = self.history
        if history is None:
            return None
        expected = history.arrivals.get(message)
        if expected is None:
            return None
        # The step may run ahead of earlier ones: also expect it one shortest-seen gap
        # after the message before it on the same edge, if that one has arrived.
        edge, mb = message
        position = arbiter.hint.plan.message_position(edge, mb)
        if position > 0:
            previous = (edge, arbiter.hint.plan.message_order(edge)[position - 1])
            before = arbiter.arrival_times.get(previous)
            gap = history.gaps.get(message)
            if before is not None and gap is not None:
                expected = min(expected, before + gap)
        # As far ahead of the earlier steps as any message came this step, so early may
        # this one come.
        arrivals = history.arrivals
        lead = max((arrivals[m] - at for m, at in arbiter.arrival_times.items()
                    if m in arrivals), default=0.0)
        return expected - max(lead, 0.0)


def _awaited_message(head: Node, arbiter: ArbiterView) -> tuple[Edge, int] | None:
    """The message the hint's next action waits for (None: none it waits for)."""
    message = head.message
    if message is None or arbiter.has_arrived(message):
        # A forward held by backpressure: it waits for the stage's next backward,
        # which waits for its gradient.
        backward = arbiter.stream_head(head.stage, "BI")
        message = backward.message if backward is not None else None
        if message is None or arbiter.has_arrived(message):
            return None
    return message


DEFAULT_COSTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
"""Durations in forwards before any are measured: a backward takes two forwards, half of it
computing the input gradient (I), half the weight gradient (W), as in the zero-bubble papers."""


class CriticalPath:
    """Readiness-first by criticality: the ready action with the longest chain of work
    still behind it (list scheduling by critical path).

    The chain runs through the step's dependency graph with RRFP's own constraints (each
    stage's streams in hint order; a stage at its memory limit waits for a release before
    its next forward: ``rrfp.core.graph``), costed per kind (F, B, I, W) by this rank's device
    durations in earlier steps, taken to be alike on every stage (a rank measures only its
    own); where the step's microbatch sizes are known (``History.expect_sizes``), each
    action's kind cost is scaled part of the way (``SIZE_WEIGHT``) towards what its size predicts
    over its stage's mean (``rrfp.core.sizes``; the fits of other ranks' stages shared with
    this one). So a forward runs ahead only while the memory it takes will
    not hold up a backward chain that is longer. Ties go to the input that arrived first,
    then to the hint's order. Greedy; ahead of a busy device the step loop launches only
    the most critical action not yet launched.
    """

    name = "critical"

    def __init__(self, history: History | None):
        self.history = history
        self._priority: list[float] = []
        self._ranked_by: dict[_Action, float] | None = None
        self._step_tails: dict[_Action, float] | None = None

    def choose(self, ready: Sequence[Node], arbiter: ArbiterView) -> Node | None:
        return min(ready, key=self._ranking(arbiter))

    def lead(self, arbiter: ArbiterView) -> int:
        # Streams run in order, so the action it would run next is a stream head; with the
        # same ranking as ``choose`` (inputs not yet here count as arriving last), it is
        # what ``choose`` picks whenever it is ready.
        heads = arbiter.stream_heads()
        return min(heads, key=self._ranking(arbiter)).index if heads else len(arbiter.nodes)

    def _ranking(self, arbiter: ArbiterView) -> Callable[[Node], tuple[float, float, int]]:
        priority = self._priorities(arbiter)
        arrivals = arbiter.arrival_times

        def key(node: Node) -> tuple[float, float, int]:
            arrived = -1.0 if node.message is None else arrivals.get(node.message, math.inf)
            return (-priority[node.index], arrived, node.index)
        return key

    def _priorities(self, arbiter: ArbiterView) -> list[float]:
        tails = self._tails(arbiter)
        if tails is not self._ranked_by:
            self._ranked_by = tails
            # Rounded so that equal chains tie whatever the order of the additions.
            # REDUCE_GRAD is not in the graph: the arbiter runs it as soon as it is ready.
            self._priority = [round(tails.get(n.action, -1.0), 6) for n in arbiter.nodes]
        return self._priority

    def _tails(self, arbiter: ArbiterView) -> dict[_Action, float]:
        """The longest chain of work behind each action (a new dict whenever it changes)."""
        if self._step_tails is None:
            hint = arbiter.hint
            costs = self._kind_costs(hint.stages_on(arbiter.rank))
            per_kind = dict(costs)
            sized = _size_scaled_costs(self.history, hint, per_kind)
            if sized is not None:
                self._step_tails = _critical_tails(hint, arbiter.memory_limits,
                                                   tuple(sized.values()), sized.__getitem__)
            else:
                self._step_tails = _critical_tails(hint, arbiter.memory_limits, costs,
                                                   lambda a: per_kind[a.computation_type.value])
        return self._step_tails

    def _kind_costs(self, stages: Sequence[int]) -> tuple[tuple[str, float], ...]:
        """Per kind, in forwards: what this rank measured on ``stages`` (``DEFAULT_COSTS``
        before it has)."""
        costs = _measured_costs(self.history, stages)
        if costs is None:
            return tuple(sorted(DEFAULT_COSTS.items()))
        # Costs near a rounding boundary could flip from step to step, and each change
        # recomputes the chains (O(all actions of the step)): keep the last ones while
        # every kind stays within a quarter forward of them.
        kept = self.history.priority_costs  # type: ignore[union-attr]
        if kept is not None and all(abs(a[1] - b[1]) <= 0.25 for a, b in zip(kept, costs)):
            costs = kept
        self.history.priority_costs = costs  # type: ignore[union-attr]
        return costs


def _measured_costs(history: History | None,
                    stages: Sequence[int]) -> tuple[tuple[str, float], ...] | None:
    """Per kind, the mean duration measured on ``stages``, in forwards and rounded to a
    quarter (``DEFAULT_COSTS`` for kinds not measured); None before any forward is."""
    measured = {}
    for kind in DEFAULT_COSTS:
        seen = [history.durations[(s, kind)] for s in stages
                if (s, kind) in history.durations] if history is not None else []
        if seen:
            measured[kind] = sum(seen) / len(seen)
    forward = measured.get("F")
    if not forward:
        return None
    costs = {**DEFAULT_COSTS, **{kind: seconds / forward for kind, seconds in measured.items()}}
    return tuple(sorted((kind, round(cost * 4) / 4) for kind, cost in costs.items()))


SIZE_WEIGHT = 0.25
"""How far ``critical`` moves an action's cost from its kind's cost towards what its
microbatch's size predicts (relative to its stage's mean). The chains leave out link
latency and the fits' errors; where latency varies, costing actions further towards the
predictions made the default slower told the sizes than not told them, and a quarter of
the way kept what the sizes buy where they drive the durations
(benchmarks/results/sizes_default.md)."""


def _size_scaled_costs(history: History | None, hint: Hint,
                       per_kind: Mapping[str, float]) -> dict[_Action, float] | None:
    """Per compute action of the step, its kind's cost (``per_kind``, as without sizes)
    times ``SIZE_WEIGHT`` of the way from one to its size's prediction over its stage and
    kind's mean (an action without a fit: its kind's cost). None where the sizes tell no
    microbatches apart.

    The sizes only rank a stage's microbatches against each other: every stage keeps the
    same mean cost, as without them. Costing each stage by its own fit made a stage that
    is the pipeline's bottleneck weigh every chain through it, and the default then ran
    slower told the sizes than not (benchmarks/results/sizes_default.md)."""
    if history is None or not history.sizes_tell_apart:
        return None
    fits = history.models.fits
    costs = {}
    for rank_plan in hint.plan.ranks.values():
        for n in rank_plan.nodes:
            if n.kind == "R":
                continue
            kind = n.action.computation_type.value
            fit = fits.get((n.stage, kind))
            predicted = history.predicted(n.stage, kind, n.microbatch)
            relative = (1.0 if fit is None or predicted is None or fit.mean <= 0
                        else predicted / fit.mean)
            costs[n.action] = per_kind[kind] * (SIZE_WEIGHT * relative + 1 - SIZE_WEIGHT)
    return costs


_TAILS: dict[tuple, tuple[Hint, MemoryLimits | None, dict[_Action, float]]] = {}
"""Longest chains behind each action, shared by the ranks of one process (the simulator)
and across steps; keeps its hint and limits so that their ids stay theirs. Only a cache:
what it holds never changes a result."""


def _critical_tails(hint: Hint, limits: MemoryLimits | None, costs: tuple,
                    cost: Callable[[_Action], float]) -> dict[_Action, float]:
    """The chains behind each action of ``hint``'s step, each action costing ``cost``;
    ``costs`` says what ``cost`` is (two calls with equal ``costs`` share the answer)."""
    key = (id(hint), id(limits), costs)
    hit = _TAILS.get(key)
    if hit is None:
        if len(_TAILS) >= 16:
            _TAILS.clear()
        graph = step_graph(hint, limits=limits, stream_order=True)
        _, tails = graph.longest_path(cost)
        _TAILS[key] = hit = (hint, limits, tails)
    return hit[2]


MIN_SLACK = 2
"""Microbatches beyond its own peak every rank needs (a rank whose own peak is 1: one)
before the default leaves lookahead."""


SLACK_POLICIES = {"InterleavedZeroBubble": "hint", "ZBVZeroBubble": "drain"}
"""Hints with several stages per rank whose own order, run readiness-first, stayed above
the fixed schedule with slack on every rank in the sweep of benchmarks/results/limits.md,
where lookahead did not: the default runs that policy there (ZBVZeroBubble's V couples
each rank's two stages in the drain, where reordering fell below the fixed schedule)."""


def default_policy(hint: Hint, limits: MemoryLimits) -> str:
    """The policy ScheduleRRFP uses for ``hint`` within ``limits`` when none is given.

    The rule (each choice is the one that never fell below the fixed schedule in the
    simulator's sweeps, docs/guide/choosing.md and benchmarks/results/limits.md, optimum.md):

    * a BF/BFW hint keeps its own rule;
    * at the hint's own memory, or where some rank has less than ``MIN_SLACK``
      microbatches of slack (a rank whose own peak is 1: none), every rank runs
      ``lookahead``, which follows the hint unless a deviation fits before the hint's next
      input is expected (ranks with slack holding back backwards that a rank without slack
      waits for would lose);
    * with slack on every rank: ``critical`` for one stage per rank; for several stages
      per rank ``SLACK_POLICIES`` (readiness-first in the hint's order, on ZBVZeroBubble
      only until the drain) and ``lookahead`` for the others (Interleaved1F1B, DualPipeV),
      where the greedy orders fell below the fixed schedule.
    """
    if hint.policy != "hint":
        return hint.policy
    peaks, rank_peaks = hint.plan.stage_peaks, hint.plan.rank_peaks()
    below_hint = limits.first_stage_below(peaks) is not None
    if not below_hint and any(limits.per_rank[r] < peak + min(MIN_SLACK, peak)
                              for r, peak in rank_peaks.items()):
        return "lookahead"  # the hint's own memory, or a rank with too little slack
    if hint.num_stages == hint.num_ranks:
        return "critical"
    # lookahead's arrival estimates come from earlier steps: on ZBVZeroBubble and
    # InterleavedZeroBubble a message whose upstream chain had a slow transfer in each of
    # them came sooner than expected, so a forward ran into it; the hint's order guesses
    # nothing there.
    return SLACK_POLICIES.get(hint.name, "lookahead")


def policy_for(given: str | None, hint: Hint, limits: MemoryLimits) -> str:
    """The policy a step of ``hint`` runs within ``limits``: the user's ``given`` one, else
    the default those limits call for (``default_policy``)."""
    return given or default_policy(hint, limits)


SIZE_READING_POLICIES = frozenset({"lookahead", "critical"})
"""The policies that cost actions by the microbatches' predicted sizes where they are
told them (``History.predicted``): for the others, told the sizes or not runs alike."""


PolicyFactory = Callable[["History | None", "Callable[[], float] | None"], Policy]
"""``(history, clock) -> policy``: what a step's policy is made from (``clock``: seconds
since the step start; both may be None where the caller has none)."""

_FACTORIES: dict[str, PolicyFactory] = {
    "hint": lambda history, clock: HintOrder(),
    "drain": lambda history, clock: HintThenDrain(),
    "BF": lambda history, clock: BackwardFirst("BF"),
    "BFW": lambda history, clock: BackwardFirst("BFW"),
    "fixed": lambda history, clock: FixedOrder(),
    "arrival": lambda history, clock: ArrivalOrder(),
    "critical": lambda history, clock: CriticalPath(history),
    "lookahead": lambda history, clock: Lookahead(history, _needs(clock, "lookahead")),
}


def register_policy(name: str, factory: PolicyFactory) -> None:
    """Add a policy: ``Settings(policy=name)``, the torchtitan ``policy`` setting and
    the simulator accept ``name`` from then on (in every process that registered it), and
    ``make_policy`` builds it from ``factory``. A policy picks among the ready actions the
    arbiter gives it (``rrfp.core.arbiter.Policy``), so it cannot break correctness, only speed."""
    add_policy_name(name)
    _FACTORIES[name.strip()] = factory


def _needs(clock: Callable[[], float] | None, policy: str) -> Callable[[], float]:
    if clock is None:
        raise ValueError(f"the {policy} policy needs a clock")
    return clock


def make_policy(name: str, *, history: History | None = None,
                clock: Callable[[], float] | None = None) -> Policy:
    """A fresh policy for one step (``name`` as ``rrfp.core.settings.parse_policy`` returns it).

    ``history`` and ``clock`` (seconds since the step start) feed the policies that decide
    by what earlier steps showed (``"lookahead"``, ``"critical"``).
    """
    factory = _FACTORIES.get(name)
    if factory is None:
        raise ValueError(f"unknown arbitration policy {name!r}: use one of "
                         f"{list(policy_names())}")
    return factory(history, clock)
