"""A yardstick policy that sees what no rank can (simulator only)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from rrfp.hints import _Action, Edge
from rrfp.policy import Lookahead

if TYPE_CHECKING:
    from rrfp.arbiter import Arbiter, Node


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
        super().__init__(None, clock)
        self._duration, self._arrival = duration, arrival

    def duration(self, node: Node) -> float | None:
        return self._duration(node.action)

    def expected_arrival(self, message: tuple[Edge, int], arbiter: Arbiter) -> float | None:
        return self._arrival(message)
