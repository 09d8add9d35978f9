"""RRFP inside PP x DP (FSDP2, DDP), PP x TP (DTensor) and with torch.compile'd stages.

CPU, gloo, 4 processes per world (2 for compile), hard timeouts.
"""

from __future__ import annotations

import pytest
import torch

from rrfp.local import run_local_world
from tests import workers


@pytest.mark.parametrize("wrapper", ["fsdp", "ddp"])
@pytest.mark.parametrize("hint,layout", [("Interleaved1F1B", "loop"), ("ZBVZeroBubble", "v")])
def test_pipeline_x_data_parallel_is_bitwise_fixed_when_replicas_interleave_differently(
        wrapper, hint, layout):
    ranks = run_local_world(4, workers.data_parallel, wrapper, hint, hint, layout, (1, 2, 3),
                            timeout=240)
    for result in ranks:
        for run, outcome in result["runs"].items():
            assert outcome["bitwise"], f"dp {result['dp']} pp {result['pp']} {run}"
        assert result["ref_error"] < 1e-12
    by_replica = {(r["dp"], r["pp"]): r["runs"] for r in ranks}
    assert any(by_replica[(0, pp)][run]["realized"] != by_replica[(1, pp)][run]["realized"]
               for pp in (0, 1) for run in ("seed1", "seed2", "seed3")), (
        "the replicas never interleaved differently: the test did not exercise ordering")


def test_gradients_accumulate_over_steps_that_do_not_finalize_them():
    """``step(finalize_gradients=False)`` (torch 2.15's argument, on every version): FSDP
    parameters stay unsharded and gradients unreduced until the finalizing step, whose
    gradients are those of both batches: bitwise torch's own schedule where torch has the
    argument, and within 1e-12 of the non-pipelined model (the only baseline on 2.13/2.14)."""
    ranks = run_local_world(4, workers.gradient_accumulation, timeout=240)
    for result in ranks:
        assert result["rrfp"] == {"unsharded_between": True}, result
        assert result["error"] < 1e-12, result
        if "torch" in result:
            assert result["torch"] == result["rrfp"], result
            assert result["bitwise"], result
    assert any(r["out_of_order"] for r in ranks), "the delays never reordered an action"


def test_agreement_settles_when_the_ranks_policies_rank_actions_differently():
    for result in run_local_world(2, workers.agree_when_policies_differ, timeout=60):
        assert result["agreed"] == result["hint_next"], result
        assert result["rounds"] == 2, result  # one disagreement, then the hint's next


@pytest.mark.parametrize("coordination", ["leader", "agree"])
@pytest.mark.parametrize("hint", ["Interleaved1F1B", "BF"])
def test_pipeline_x_tensor_parallel_coordinates_the_tp_ranks(coordination, hint):
    # torch 2.13's own ZBV schedule fails on DTensor TP stages (an in-place detach of a
    # view in its backward-input path), so the V layout has no fixed schedule to compare.
    ranks = run_local_world(4, workers.tensor_parallel, coordination, hint, "Interleaved1F1B",
                            "loop", (1, 2), timeout=240)
    for result in ranks:
        assert result["ref_error"] < 1e-12
        for run, outcome in result["runs"].items():
            assert outcome["bitwise"], f"pp {result['pp']} tp {result['tp']} {run}"
            assert outcome["rounds"] >= 18  # at least one settlement per action
            if coordination == "leader":
                assert outcome["deferrals"] == 0
    assert any(outcome["out_of_order"] for r in ranks for outcome in r["runs"].values()), (
        "no action ran out of the hint's order: the coordination was not put to the test")
    by_rank = {(r["pp"], r["tp"]): r["runs"] for r in ranks}
    for pp in (0, 1):
        for run in by_rank[(pp, 0)]:
            assert by_rank[(pp, 0)][run]["realized"] == by_rank[(pp, 1)][run]["realized"]


@pytest.mark.parametrize("hint,reference,per_rank", [
    ("Interleaved1F1B", "Interleaved1F1B", 2), ("BF", "1F1B", 1),
])
def test_compiled_stages_match_the_uncompiled_fixed_schedule_without_recompiling(
        hint, reference, per_rank):
    ranks = run_local_world(2, workers.compiled_stages, hint, reference, per_rank, "loop",
                            timeout=300)
    assert any(result["out_of_order"] for result in ranks), ranks  # the order was put to the test
    for result in ranks:
        assert result["bitwise"]
        assert result["after_first"][0] > 0
        assert result["after_all"] == result["after_first"]  # no frame compiled after step 1
        assert result["after_all"][1] == 0  # no recompilation at all


@pytest.mark.parametrize("case,expected", [
    ("ddp_buffers", "broadcast_buffers=False"),
    ("ddp_comm_hook", "communication hook"),
    ("fsdp_inner_only", "apply fully_shard to the stage module too"),
])
def test_data_parallel_set_ups_rrfp_cannot_keep_in_lockstep_are_refused(case, expected):
    for message in run_local_world(2, workers.refused_data_parallel, case, timeout=60):
        assert expected in message, message


def test_ddp_gradients_are_reduced_in_buckets_of_at_most_the_cap():
    from rrfp.data_parallel import gradient_buckets

    grads = [torch.zeros(n) for n in (10, 20, 30, 100, 5, 5)]  # float32: 4 bytes each
    buckets = gradient_buckets(grads, cap_bytes=160)
    assert [[g.numel() for g in b] for b in buckets] == [[10, 20], [30], [100], [5, 5]]
    assert [g for b in buckets for g in b] == grads


def test_ddp_reduces_in_buckets_no_larger_than_its_bucket_cap():
    """The extra memory of DDP's reduction is one bucket: every tensor all_reduce sees is at
    most DDP's bucket_bytes_cap (several buckets here), and the gradients are the
    replicas' mean."""
    for result in run_local_world(2, workers.ddp_buckets, timeout=60):
        assert result["cap"] == workers.DDP_BUCKET_CAP_BYTES
        assert len(result["reduced"]) >= 2, result
        assert max(result["reduced"]) <= result["cap"] < result["gradient_bytes"], result
        assert sum(result["reduced"]) == result["gradient_bytes"], result
        assert result["error"] < 1e-12, result


def test_fsdp_unshards_for_the_whole_step_and_reduce_scatters_at_reduce_grad_in_stage_order():
    """The data-parallel collectives of a step, in order: the stages' all-gathers before
    any forward, none during the step; reduce-scatters only inside REDUCE_GRAD, whose stage
    order is the hint's on every replica; replicas that interleave their actions
    differently."""
    ranks = run_local_world(4, workers.fsdp_collectives, timeout=180)
    gathers = ("all_gather_single", "all_gather_into_tensor")
    scatters = ("reduce_scatter_single", "reduce_scatter_tensor")
    for result in ranks:
        log = result["log"]
        first_forward = next(i for i, e in enumerate(log) if e[0] == "F")
        assert [e for e in log[first_forward:] if e[0] in gathers] == [], log
        assert sum(e[0] in gathers for e in log[:first_forward]) == 2, log  # one per stage
        assert [e[1] for e in log if e[0] == "REDUCE_GRAD"] == result["reduce_order"]
        inside = False
        for event in log:
            if event[0] == "REDUCE_GRAD":
                inside, scattered = True, 0
            elif event[0] == "REDUCE_GRAD done":
                assert scattered >= 1, log
                inside = False
            elif event[0] in scatters:
                assert inside, log
                scattered += 1
    by_replica = {(r["dp"], r["pp"]): r["realized"] for r in ranks}
    assert any(by_replica[(0, pp)] != by_replica[(1, pp)] for pp in (0, 1)), (
        "the replicas did not interleave differently: the order was not put to the test")


@pytest.mark.parametrize("coordination", ["leader", "agree"])
def test_tensor_parallel_ranks_raise_within_the_stall_timeout_when_a_peer_stops(coordination):
    ranks = run_local_world(4, workers.tensor_parallel_peer_stops, coordination, timeout=120)
    assert ranks[0] == {}
    for rank in (1, 2, 3):
        outcome = ranks[rank]
        assert outcome["error"].startswith(("PipelineStallError", "PeerFailedError",
                                            "RuntimeError")), outcome
        assert outcome["elapsed"] < 15.0, outcome
    # The TP follower of the stopped leader names it: by its own stall, or through the first
    # failure of the job (a receive from global rank 0 that failed as its process ended).
    assert ranks[1]["error"].startswith(("PipelineStallError", "PeerFailedError"))
    assert "global rank 0" in ranks[1]["error"], ranks[1]["error"]


def test_dtensor_stages_without_a_coordination_group_are_refused_on_every_rank():
    for message in run_local_world(4, workers.tensor_parallel_without_coordination, timeout=60):
        assert "no coordination_group is given" in message and "DTensor" in message


def test_variable_shapes_refuse_dtensor_activations():
    """Received DTensors are rebuilt with the global shape fixed at shape inference, so
    variable shapes cannot hold: every rank refuses at its first step, saying why."""
    for rank, message in enumerate(run_local_world(4, workers.dtensor_variable_shapes,
                                                   timeout=120)):
        assert message.startswith("ValueError: variable_shapes: stage "), (rank, message)
        assert "receives a DTensor activation or gradient" in message, (rank, message)


def test_parameters_shared_by_a_ranks_stages_are_reported():
    rank0, rank1 = run_local_world(2, workers.shared_parameters, timeout=60)
    assert len(rank0) == 1 and "stages 0 and 3" in rank0[0]
    assert rank1 == []
