"""Policies the simulator studies beside the runtime's own, registered on import through
the public ``register_policy`` (so a study names them as it names any policy). The
runtime's default never picks them."""

from __future__ import annotations

from collections.abc import Sequence

from rrfp.core.arbiter import ArbiterView
from rrfp.core.plan import Node
from rrfp.core.policy import HintLed, register_policy


class ForwardWindow(HintLed):
    """Readiness-first, but forwards and weight-gradients may not run past the hint's
    next pending backward: they would delay a backward that may arrive right after.

    Backwards run whenever ready. It always allows the hint's next action, so it cannot
    deadlock where the fixed schedule does not; below the hint's memory it is greedy.
    """

    name = "window"

    def choose(self, ready: Sequence[Node], arbiter: ArbiterView) -> Node | None:
        if arbiter.below_hint_memory:
            return ready[0]
        pending_backward = arbiter.next_pending_backward()
        for node in ready:
            if node.kind == "BI" or node.index <= pending_backward:
                return node
        return None


register_policy("window", lambda history, clock: ForwardWindow())
