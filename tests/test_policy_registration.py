"""Adding a policy is one class and its registration (the architecture page's example)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from rrfp.core.arbiter import ArbiterView
from rrfp.core.hints import build_hint
from rrfp.core.limits import resolve_buffer_limits
from rrfp.core.plan import Node
from rrfp.core.policy import make_policy, register_policy
from rrfp.core.settings import parse_policy, policy_names
from rrfp.sim.engine import simulate

NAME = "Newest-First"


class NewestFirst:
    """Among the ready actions, the one of the latest microbatch (ties: hint order)."""

    name = NAME

    def choose(self, ready: Sequence[Node], arbiter: ArbiterView) -> Node | None:
        return max(ready, key=lambda node: (node.microbatch or 0, -node.index))

    def lead(self, arbiter: ArbiterView) -> int:
        return arbiter.first_undone  # ahead of a busy device: the hint's next action


def _registered() -> None:
    if NAME not in policy_names():
        register_policy(NAME, lambda history, clock: NewestFirst())


def test_a_registered_policy_is_accepted_where_policies_are_named_and_runs_the_step():
    _registered()
    assert parse_policy("newest-first") == NAME  # as ScheduleRRFP and torchtitan parse it
    assert isinstance(make_policy(NAME), NewestFirst)
    hint = build_hint("1F1B", num_ranks=4, num_stages=4, n_microbatches=8)
    limits = resolve_buffer_limits("hint+2", hint)

    def duration(action) -> float:  # the last stage is slow: upstream ranks have slack
        return 3.0 if action.stage_index == 3 else 1.0

    mine = simulate(hint, duration, policy=NAME, limits=limits)
    ordered = simulate(hint, duration, policy="hint", limits=limits)
    assert mine.realized != ordered.realized  # it chose, and the step completed
    assert all(peak <= limits.per_stage[s] for s, peak in mine.peak_in_flight.items())


def test_a_policy_name_is_registered_once():
    _registered()
    with pytest.raises(ValueError, match="already taken"):
        register_policy("newest-FIRST", lambda history, clock: NewestFirst())
    with pytest.raises(ValueError, match="already taken"):
        register_policy("critical", lambda history, clock: NewestFirst())
