"""RRFP with expert parallelism: PP 2 x EP 2 MoE stages built from torchtitan's MoE.

CPU, gloo, 4 processes, hard timeouts; torchtitan 0.2 or 0.3, whichever is installed
(``rrfp.testing.moe``). The baseline is torch's own fixed schedule on the
same stages and data, run in the same world.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import Shard

from rrfp import ScheduleRRFP
from rrfp.testing.chains import coordinated_runs, loss_fn, run_steps, torch_schedule
from rrfp.testing.timing import random_device_time
from rrfp.testing.worlds import run_local_world

pytest.importorskip("torchtitan", reason="the MoE stages are torchtitan's")

from rrfp.testing.moe import (DIM, distribute_parameters, experts_of, make_batch,  # noqa: E402
                              make_moe_block, shard_experts, TORCHTITAN_0_2, use_cpu_moe_paths)
from rrfp import Settings


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    use_cpu_moe_paths()
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "ep"))


def _local_grads(history):
    return [([g.to_local() if hasattr(g, "to_local") else g for g in grads], losses)
            for grads, losses in history]


def expert_parallel(rank: int, world_size: int, coordination: str, hint: str,
                    delay_seeds: tuple[int, ...]) -> dict:
    """RRFP vs torch's fixed ``hint`` on the same MoE stages and data, in one run: the
    fixed schedule first, then RRFP without delays and with random delays per rank
    (stage compute and messages), which reorder actions."""
    mesh = _mesh()
    pp, ep = mesh["pp"].get_local_rank(), mesh["ep"].get_local_rank()
    per_rank = 2 if hint == "Interleaved1F1B" else 1
    num_stages, M, steps = 2 * per_rank, 4, 2
    chain = [make_moe_block(seed=s) for s in range(num_stages)]
    local = [pp + 2 * k for k in range(per_rank)]
    x, y = make_batch(ep, M)

    def build(seed: int | None):
        blocks, stages = [], []
        for s in local:
            block = shard_experts(copy.deepcopy(chain[s]), mesh["ep"])
            module = block if seed is None else random_device_time(seed * 10 + ep, s, M, 0.003)(block)
            blocks.append(block)
            stages.append(PipelineStage(module, s, num_stages, torch.device("cpu"),
                                        group=mesh["pp"].get_group()))
        return stages, blocks

    stages, blocks = build(None)
    fixed = _local_grads(run_steps(torch_schedule(hint, stages, M), stages, blocks, x, y, steps))
    runs = coordinated_runs(rank, build, _local_grads, fixed, hint, M, mesh["ep"].get_group(),
                            coordination, delay_seeds, x, y, steps)
    return {"pp": pp, "ep": ep, "runs": runs,
            "sharded": [n for b in blocks for n, p in b.named_parameters() if hasattr(p, "to_local")]}


@pytest.mark.parametrize("coordination", ["leader", "agree"])
@pytest.mark.parametrize("hint", ["1F1B", "Interleaved1F1B"])
def test_expert_parallel_stages_are_bitwise_the_fixed_schedule_in_lockstep(coordination, hint):
    ranks = run_local_world(4, expert_parallel, coordination, hint, (1,),
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


def uncoordinated_expert_parallel(rank: int, world_size: int, case: str) -> dict:
    """PP 2 x EP 2 that RRFP must refuse at its first step, before any all-to-all:
    ``"none"``: MoE stages, no coordination group; ``"pp_group"``: a coordination group
    that does not cover the EP ranks (the PP group); ``"dense_last"``: MoE on pipeline
    rank 0 only, the last stage a dense block that shards nothing, no coordination group
    (pipeline rank 1's ranks must refuse as well, not wait for their peers)."""
    mesh = _mesh()
    pp, ep = mesh["pp"].get_local_rank(), mesh["ep"].get_local_rank()
    dense = case == "dense_last" and pp == 1
    block = (torch.nn.Sequential(torch.nn.Linear(DIM, DIM)) if dense
             else shard_experts(make_moe_block(seed=pp), mesh["ep"]))
    dispatches = []
    if not dense:
        experts_of(block).register_forward_pre_hook(lambda *_: dispatches.append(1))
    group = mesh["pp"].get_group() if case == "pp_group" else None
    stage = PipelineStage(block, pp, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = ScheduleRRFP(stage, 2, loss_fn=loss_fn, hint="1F1B", coordination_group=group,
                            settings=Settings(stall_timeout=30))
    x, y = make_batch(ep, 2)
    try:
        run_steps(schedule, [stage], [block], x, y, 1)
    except ValueError as e:
        return {"error": str(e), "dispatches": len(dispatches), "dense": dense}
    raise AssertionError("no ValueError")


@pytest.mark.parametrize("case,expected", [
    ("none", "no coordination_group is given"),
    ("pp_group", "the coordination_group covers only"),
    ("dense_last", "no coordination_group is given"),
])
def test_uncoordinated_expert_parallel_is_refused_on_every_rank_before_any_all_to_all(
        case, expected):
    ranks = run_local_world(4, uncoordinated_expert_parallel, case, timeout=180)
    for rank, result in enumerate(ranks):
        assert expected in result["error"] and "DTensor" in result["error"], (rank, result)
        assert "experts.w1" in result["error"], (rank, result)
        assert result["dispatches"] == 0, (rank, result)  # refused before the first dispatch
    if case == "dense_last":
        for result in ranks[2:]:  # pipeline rank 1: dense, nothing of its own to refuse
            assert result["dense"]
            assert result["error"].startswith("global rank "), result


def expert_tensor_parallel_detected(rank: int, world_size: int) -> dict:
    """Expert weights sharded over a 2 x 2 (ep, etp) mesh as torchtitan's EP x TP shards
    them (``Shard(0)`` over EP, the hidden dimension over TP; 0.2: its
    ``ExpertTensorParallel`` style): which ranks RRFP's check says they are sharded over,
    and whether a group of the EP ranks alone, or of all four, covers them."""
    from torch.distributed.device_mesh import init_device_mesh

    from rrfp.comm.coordination import uncovered_sharded_parameter

    use_cpu_moe_paths()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "etp"))
    block = make_moe_block(seed=0)
    if TORCHTITAN_0_2:
        from torch.distributed.tensor.parallel import parallelize_module
        from torchtitan.distributed.expert_parallel import ExpertTensorParallel

        parallelize_module(block.moe.experts, mesh, ExpertTensorParallel())
    else:
        distribute_parameters(experts_of(block), mesh, [Shard(0), Shard(1)])
    ep_ranks = set(dist.get_process_group_ranks(mesh["ep"].get_group()))
    return {"ep_only": uncovered_sharded_parameter(block.named_parameters(), ep_ranks),
            "all": uncovered_sharded_parameter(block.named_parameters(), set(range(4)))}


def test_the_check_sees_expert_weights_sharded_over_ep_x_tp():
    for result in run_local_world(4, expert_tensor_parallel_detected, timeout=180):
        name, ranks = result["ep_only"]
        assert "experts.w" in name and ranks == [0, 1, 2, 3], result
        assert result["all"] is None, result
