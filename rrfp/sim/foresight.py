"""Yardstick policies that see what no rank can (simulator only)."""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import TYPE_CHECKING

from rrfp.core.actions import _Action, Edge, F
from rrfp.core.graph import Latency, step_graph, StepGraph
from rrfp.core.policy import CriticalPath, DEFAULT_COSTS, Lookahead

if TYPE_CHECKING:
    from rrfp.core.arbiter import ArbiterView
    from rrfp.core.limits import MemoryLimits
    from rrfp.core.plan import Node
    from rrfp.core.hints import Hint

Transit = Callable[[tuple[Edge, int], float], float]
"""When a message sent at the given time arrives."""


class ClairvoyantFit(Lookahead):
    """``lookahead``'s rule with perfect foresight: a ready action ranked below the hint's
    next runs only if it ends before that next action's input arrives, by its true
    duration and the input's true arrival time; for an input not yet sent, the earliest it
    could arrive (its sender's chain of dependencies, back to what is launched or in
    flight, with nothing not yet launched starting before now). What that rule captures
    when its estimates are exact: not a bound on other rules, and exact only where an
    action starts when it is chosen (no launch cost, deviations chosen on an idle device:
    the simulator's defaults). Not a policy a rank could run.
    """

    name = "clairvoyant"

    def __init__(self, clock: Callable[[], float], duration: Callable[[_Action], float],
                 arrival: Callable[[tuple[Edge, int]], float]):
        """``arrival``: when a message not yet here is foreseen to arrive."""
        super().__init__(None, clock)
        self._duration, self._arrival = duration, arrival

    def duration(self, node: Node) -> float | None:
        return self._duration(node.action)

    def expected_arrival(self, message: tuple[Edge, int], arbiter: ArbiterView) -> float | None:
        return self._arrival(message)


class InformedFit(ClairvoyantFit):
    """The same rule knowing all that has happened on every rank (each launch, send and
    arrival, so how long each message in flight has been on its way), every action's true
    duration, and the step's latencies as an unordered set, not which message draws which:
    a message in flight is expected at the median of the latencies at least as long as its
    time on the way so far; one not yet sent, the median latency after the earliest end of
    its sender's chain. What the rule can capture when latencies cannot be foreseen (under
    compute noise alone, with no latency, it is ``clairvoyant``). Not a policy a rank
    could run.
    """

    name = "informed"


def median_transit(latencies: Iterable[float], clock: Callable[[], float]) -> Transit:
    """Arrivals by the median latency (the upper one of an even count), given how long a
    message has already been on its way (``clock()`` minus its send time): the median of
    the ``latencies`` at least that long, or the time on the way itself if none is."""
    ordered = sorted(latencies)
    typical = statistics.median_high(ordered) if ordered else 0.0

    def arrival(message: tuple[Edge, int], sent_at: float) -> float:
        on_the_way = clock() - sent_at
        if on_the_way <= 0:
            return sent_at + typical
        longer = ordered[bisect.bisect_left(ordered, on_the_way):]
        return sent_at + (statistics.median_high(longer) if longer else on_the_way)
    return arrival


class EstimatedChains:
    """The longest chain of work behind each action of a step, costed by estimates that
    may change as the step runs (re-costed when ``revision()`` changes). One per
    simulation, shared by its ranks: the estimates are the same on every rank."""

    def __init__(self, estimate: Callable[[_Action], float], latency: Latency | None,
                 revision: Callable[[], Hashable]):
        self._estimate, self._latency, self._revision = estimate, latency, revision
        self._graph: StepGraph | None = None
        self._costed_at: Hashable = object()
        self._tails: dict[_Action, float] = {}

    def tails(self, hint: Hint, limits: MemoryLimits) -> dict[_Action, float]:
        """A new dict whenever it is re-costed."""
        if self._graph is None:
            self._graph = step_graph(hint, self._latency, limits=limits, stream_order=True)
        revision = self._revision()
        if revision != self._costed_at:
            self._costed_at = revision
            self._tails = self._graph.longest_path(self._estimate)[1]
        return self._tails


class EstimatedCritical(CriticalPath):
    """``critical``'s ranking, its chains costed by ``chains`` instead of the rank's own
    per-kind means. Not a policy a rank could run."""

    def __init__(self, name: str, chains: EstimatedChains):
        super().__init__(None)
        self.name = name
        self._chains = chains

    def _tails(self, arbiter: ArbiterView) -> dict[_Action, float]:
        return self._chains.tails(arbiter.hint, arbiter.memory_limits)


FORESIGHT_CRITICAL = "foresight-critical"
"""``critical``'s ranking by the step's true durations and link latencies, all known from
its start."""
INFORMED_CRITICAL = "informed-critical"
"""``critical``'s ranking by all that has happened on every rank: an action not yet run
whose microbatch has ended its forward on that stage is expected to take that forward's
true duration times its kind's cost (the workload models scale a microbatch's I and W like
its forward), any other its kind's cost (a mean forward is the models' time unit)."""


def foresight_chains(duration: Callable[[_Action], float],
                     latency: Latency | None) -> EstimatedChains:
    return EstimatedChains(duration, latency, revision=lambda: None)


def informed_chains(forwards_ran: Mapping[_Action, float]) -> EstimatedChains:
    """``forwards_ran``: a live view of the run time of each forward that has ended (on any
    rank); it only grows during a step, so its size says when it changed."""
    def estimate(action: _Action) -> float:
        forward = _Action(action.stage_index, F, action.microbatch_index)
        return DEFAULT_COSTS[action.computation_type.value] * forwards_ran.get(forward, 1.0)
    return EstimatedChains(estimate, None, revision=lambda: len(forwards_ran))
