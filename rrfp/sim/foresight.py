"""Yardstick policies that see what no rank can (simulator only)."""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from rrfp.hints import _Action, Edge
from rrfp.policy import Lookahead

if TYPE_CHECKING:
    from rrfp.arbiter import ArbiterView, Node

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
