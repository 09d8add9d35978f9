"""Simulator regression checks of the arbiter against closed forms and the fixed order."""

from __future__ import annotations

import pytest

from rrfp.arbiter import resolve_buffer_limits
from rrfp.hints import build_hint, F, HINT_NAMES, REDUCE_GRAD
from rrfp.sim.engine import simulate
from tests.test_arbiter import FITTING


def _uniform(action):
    ctype = action.computation_type
    return 0.0 if ctype == REDUCE_GRAD else 1.0 if ctype in (F,) else 2.0 if ctype.value == "B" else 1.0


@pytest.mark.parametrize("num_ranks,M", [(2, 4), (4, 8), (8, 32)])
def test_fixed_1f1b_makespan_is_the_textbook_formula(num_ranks, M):
    hint = build_hint("1F1B", num_ranks=num_ranks, num_stages=num_ranks, n_microbatches=M)
    result = simulate(hint, _uniform, policy="fixed")
    assert result.makespan == (M + num_ranks - 1) * (1.0 + 2.0)


@pytest.mark.parametrize("name", HINT_NAMES)
def test_uniform_times_readiness_first_at_hint_memory_equals_fixed_schedule(name):
    per_rank, layout = FITTING[name]
    for num_ranks, M in ((2, 4), (4, 8), (4, 16)):
        hint = build_hint(name, num_ranks=num_ranks, num_stages=num_ranks * per_rank,
                          n_microbatches=M, layout=layout)
        fixed = simulate(hint, _uniform, policy="fixed")
        rrfp = simulate(hint, _uniform, policy="hint", limits=resolve_buffer_limits("hint", hint))
        if name == "DualPipeV" and num_ranks == 4:
            # Greedy dispatch runs a ready lower-ranked action that then delays a
            # higher-ranked one arriving just after (compute is not preemptive): one
            # time unit lost in ~50-100. Recorded here so a policy change shows up.
            assert rrfp.makespan == fixed.makespan + 1.0
        else:
            assert rrfp.makespan == fixed.makespan
