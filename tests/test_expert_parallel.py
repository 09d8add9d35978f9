"""RRFP with expert parallelism: PP 2 x EP 2 MoE stages built from torchtitan's MoE.

CPU, gloo, 4 processes, hard timeouts; torchtitan 0.2 or 0.3, whichever is installed
(tests/ep_workers.py). The baseline is torch's own fixed schedule on the
same stages and data, run in the same world.
"""

from __future__ import annotations

import pytest

from rrfp.local import run_local_world
from tests import ep_workers

pytest.importorskip("torchtitan", reason="the MoE stages are torchtitan's")


@pytest.mark.parametrize("coordination", ["leader", "agree"])
@pytest.mark.parametrize("hint", ["1F1B", "Interleaved1F1B"])
def test_expert_parallel_stages_are_bitwise_the_fixed_schedule_in_lockstep(coordination, hint):
    ranks = run_local_world(4, ep_workers.expert_parallel, coordination, hint, (1,),
                            timeout=120)
    for result in ranks:
        assert result["sharded"] and all("experts.w" in n for n in result["sharded"]), result
        for run, outcome in result["runs"].items():
            assert outcome["bitwise"], f"pp {result['pp']} ep {result['ep']} {run}"
    assert any(outcome["out_of_order"] for r in ranks for outcome in r["runs"].values()), (
        "no action ran out of the hint's order: the coordination was not put to the test")
    by_rank = {(r["pp"], r["ep"]): r["runs"] for r in ranks}
    for pp in (0, 1):
        for run in by_rank[(pp, 0)]:
            assert by_rank[(pp, 0)][run]["realized"] == by_rank[(pp, 1)][run]["realized"], (
                f"pipeline rank {pp}, {run}: the EP ranks ran different sequences")


@pytest.mark.parametrize("case,expected", [
    ("none", "no coordination_group is given"),
    ("pp_group", "the coordination_group covers only"),
    ("dense_last", "no coordination_group is given"),
])
def test_uncoordinated_expert_parallel_is_refused_on_every_rank_before_any_all_to_all(
        case, expected):
    ranks = run_local_world(4, ep_workers.uncoordinated_expert_parallel, case, timeout=180)
    for rank, result in enumerate(ranks):
        assert expected in result["error"] and "DTensor" in result["error"], (rank, result)
        assert "experts.w1" in result["error"], (rank, result)
        assert result["dispatches"] == 0, (rank, result)  # refused before the first dispatch
    if case == "dense_last":
        for result in ranks[2:]:  # pipeline rank 1: dense, nothing of its own to refuse
            assert result["dense"]
            assert result["error"].startswith("global rank "), result


def test_the_check_sees_expert_weights_sharded_over_ep_x_tp():
    for result in run_local_world(4, ep_workers.expert_tensor_parallel_detected, timeout=180):
        name, ranks = result["ep_only"]
        assert "experts.w" in name and ranks == [0, 1, 2, 3], result
        assert result["all"] is None, result
