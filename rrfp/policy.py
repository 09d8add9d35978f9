"""Arbitration policies: which of the ready actions a rank runs.

A policy only ever picks among actions the arbiter found ready (head of their streams,
inputs arrived, within the memory limit), so no policy can break the bitwise-fidelity or
channel-order invariants; they differ only in speed. Policies that may decline to run a
ready action (return None) must not do so forever, or the pipeline would stall.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TYPE_CHECKING

if TYPE_CHECKING:
    from rrfp.arbiter import Arbiter, Node
    from rrfp.hints import Edge

POLICIES = ("hint", "fixed", "BF", "BFW", "window", "lookahead", "arrival")


class Policy(Protocol):
    name: str

    def choose(self, ready: Sequence[Node], arbiter: Arbiter) -> Node | None:
        """Pick one of ``ready`` (sorted by hint position), or None to wait."""
        ...


class HintOrder:
    """Readiness-first: the ready action that ranks highest in the hint."""

    name = "hint"

    def choose(self, ready: Sequence[Node], arbiter: Arbiter) -> Node | None:
        return ready[0]


class FixedOrder:
    """The fixed schedule itself: only the first not-yet-run action of the hint."""

    name = "fixed"

    def choose(self, ready: Sequence[Node], arbiter: Arbiter) -> Node | None:
        return ready[0] if ready[0].index == arbiter.first_undone else None


class ArrivalOrder:
    """Readiness-first in the order actions became ready: the ready action whose input
    arrived first (one fed only by this rank's own actions counts as ready from the step
    start); the hint's order breaks ties.

    With one stage per rank and memory slack this is what a runtime launching every action
    as soon as it is ready would do, without freezing a device queue: a forward whose input
    came first is not passed by a backward that arrived after it. Greedy, so it never
    declines a ready action.
    """

    name = "arrival"

    def choose(self, ready: Sequence[Node], arbiter: Arbiter) -> Node | None:
        def became_ready(node: Node) -> tuple[float, int]:
            if node.message is None:
                return (-1.0, node.index)
            return (arbiter.arrival_times[node.message], node.index)
        return min(ready, key=became_ready)


class BackwardFirst:
    """The paper's BF rule, and BFW when the hint splits backward into I and W.

    Each round runs one ready backward, then one ready forward (either kind alone when
    the other is not ready). Backwards prefer the higher model chunk, forwards the lower;
    ties go to the lower microbatch. Weight-gradient (W) actions run only when no
    forward or backward is ready.
    """

    def __init__(self, name: str = "BF"):
        self.name = name

    def choose(self, ready: Sequence[Node], arbiter: Arbiter) -> Node | None:
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


@dataclass
class History:
    """What earlier steps showed one rank.

    ``durations[(stage, kind)]``: a running average of that stage and kind's run time
    (seconds; each new run weighs one half). ``arrivals[(edge, microbatch)]``: the earliest
    arrival seen, in seconds after the step start (the cautious side for the guard).
    """

    durations: dict[tuple[int, str], float] = field(default_factory=dict)
    arrivals: dict[tuple[Edge, int], float] = field(default_factory=dict)
    gaps: dict[tuple[Edge, int], float] = field(default_factory=dict)
    """Shortest time seen between a message and the one before it on the same edge."""
    _last: dict[Edge, float] = field(default_factory=dict)

    def start_step(self) -> None:
        self._last.clear()

    def record_duration(self, stage: int, kind: str, seconds: float) -> None:
        previous = self.durations.get((stage, kind))
        self.durations[(stage, kind)] = seconds if previous is None else 0.5 * (seconds + previous)

    def record_arrival(self, edge: Edge, microbatch: int, offset: float) -> None:
        key = (edge, microbatch)
        self.arrivals[key] = min(offset, self.arrivals.get(key, offset))
        if edge in self._last:
            gap = offset - self._last[edge]
            self.gaps[key] = min(gap, self.gaps.get(key, gap))
        self._last[edge] = offset


class ForwardWindow:
    """Readiness-first, but forwards and weight-gradients may not run past the hint's
    next pending backward: they would delay a backward that may arrive right after.

    Backwards run whenever ready. It always allows the hint's next action, so it cannot
    deadlock where the fixed schedule does not; below the hint's memory it is greedy.
    """

    name = "window"

    def choose(self, ready: Sequence[Node], arbiter: Arbiter) -> Node | None:
        if arbiter.below_hint_memory:
            return ready[0]
        pending_backward = arbiter.next_pending_backward()
        for node in ready:
            if node.kind == "BI" or node.index <= pending_backward:
                return node
        return None


class Lookahead:
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

    def choose(self, ready: Sequence[Node], arbiter: Arbiter) -> Node | None:
        head = arbiter.nodes[arbiter.first_undone]
        if ready[0] is head or arbiter.below_hint_memory:
            return ready[0]
        if self.history is None:
            return None
        expected = self._expected_ready(head, arbiter)
        if expected is None:
            return None
        now = self.clock()
        for node in ready:
            estimate = self.history.durations.get((node.stage, node.action.computation_type.value))
            if estimate is not None and now + estimate <= expected:
                return node
        return None

    def _expected_ready(self, head: Node, arbiter: Arbiter) -> float | None:
        """When the hint's next action is expected to become ready (None: unknown)."""
        message = head.message
        if message is None or arbiter.has_arrived(message):
            # A forward held by backpressure: it waits for the stage's next backward,
            # which waits for its gradient.
            backward = arbiter.stream_head(head.stage, "BI")
            message = backward.message if backward is not None else None
            if message is None or arbiter.has_arrived(message):
                return None
        history = self.history
        expected = history.arrivals.get(message)  # type: ignore[union-attr]
        if expected is None:
            return None
        # The step may run ahead of earlier ones: also expect it one shortest-seen gap
        # after the message before it on the same edge, if that one has arrived.
        edge, mb = message
        position = arbiter.hint.message_position(edge, mb)
        if position > 0:
            before = arbiter.arrival_times.get(
                (edge, arbiter.hint.message_order(edge)[position - 1]))
            gap = history.gaps.get(message)  # type: ignore[union-attr]
            if before is not None and gap is not None:
                expected = min(expected, before + gap)
        return expected


def default_policy(hint_policy: str, at_hint_memory: bool, stages_per_rank: int) -> str:
    """The policy ScheduleRRFP uses when none is given.

    Measured in the simulator (benchmarks/results): at the hint's own memory the
    lookahead guard loses at most ~1% where plain readiness-first loses up to ~5% (1F1B,
    compute jitter). With memory slack, one stage per rank: taking ready actions in the
    order they became ready gained 1.5-2.5 points more than the hint's order (1F1B, 8
    ranks); several stages per rank: the hint's order, as the arrival order then lost up
    to 4 points (Interleaved1F1B, ZBVZeroBubble). The BF/BFW rules keep their own policy.
    """
    if hint_policy != "hint":
        return hint_policy
    if at_hint_memory:
        return "lookahead"
    return "arrival" if stages_per_rank == 1 else "hint"


def make_policy(name: str, *, history: History | None = None,
                clock: Callable[[], float] | None = None) -> Policy:
    """A fresh policy for one step.

    ``history`` and ``clock`` (seconds since the step start) feed ``"lookahead"``.
    """
    if name == "hint":
        return HintOrder()
    if name in ("BF", "BFW"):
        return BackwardFirst(name)
    if name == "fixed":
        return FixedOrder()
    if name == "window":
        return ForwardWindow()
    if name == "arrival":
        return ArrivalOrder()
    if name == "lookahead":
        if clock is None:
            raise ValueError("the lookahead policy needs a clock")
        return Lookahead(history, clock)
    raise ValueError(f"unknown arbitration policy {name!r}: use one of {list(POLICIES)}")
