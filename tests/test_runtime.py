"""Multi-process tests of ScheduleRRFP on CPU/gloo (each world has a hard timeout)."""

from __future__ import annotations

import statistics

import pytest
from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble

from tests import workers
from rrfp.local import run_local_world

# (hint given to ScheduleRRFP, torch schedule compared bitwise, stages per rank, placement)
HINT_CASES = [
    ("1F1B", "1F1B", 1, "loop"),
    ("GPipe", "GPipe", 1, "loop"),
    ("Interleaved1F1B", "Interleaved1F1B", 2, "loop"),
    ("LoopedBFS", "LoopedBFS", 2, "loop"),
    ("InterleavedZeroBubble", "InterleavedZeroBubble", 2, "loop"),
    ("ZBVZeroBubble", "ZBVZeroBubble", 2, "v"),
    ("DualPipeV", "DualPipeV", 2, "v"),
    ("BF", "1F1B", 1, "loop"),
    ("BF", "Interleaved1F1B", 2, "loop"),
    ("BFW", "InterleavedZeroBubble", 1, "loop"),
    ("BFW", "ZBVZeroBubble", 2, "v"),
    (ScheduleInterleavedZeroBubble, "InterleavedZeroBubble", 2, "loop"),
    ("csv", "Interleaved1F1B", 2, "loop"),
    ("dict", "ZBVZeroBubble", 2, "v"),
]
DELAY_SEEDS_PER_CASE = 3  # 14 cases x 2 world sizes x 3 = 84 distinct delay seeds


def _case_id(case) -> str:
    hint, reference, per_rank, layout = case
    name = hint if isinstance(hint, str) else hint.__name__
    return f"{name}-vs-{reference}-{per_rank}x{layout}"


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("case", HINT_CASES, ids=_case_id)
def test_bitwise_equal_to_torch_schedule_with_and_without_delays(case, world_size, tmp_path):
    hint, reference, per_rank, layout = case
    index = HINT_CASES.index(case) * 2 + (world_size == 4)
    seeds = tuple(range(index * DELAY_SEEDS_PER_CASE + 1, (index + 1) * DELAY_SEEDS_PER_CASE + 1))
    fidelity_case = workers.FidelityCase(
        hint=hint, reference=reference, stages_per_rank=per_rank, layout=layout,
        n_microbatches=2 * world_size, delay_seeds=seeds,
    )
    ranks = run_local_world(world_size, workers.fidelity, fidelity_case, str(tmp_path), timeout=180)
    for rank, result in enumerate(ranks):
        assert set(result["runs"]) == {"plain", *(f"seed{s}" for s in seeds)}
        for run, outcome in result["runs"].items():
            assert outcome["bitwise"], f"rank {rank}, {run}: gradients or losses differ from {reference}"
            assert all(outcome["peak"][s] <= outcome["limits"][s] for s in outcome["peak"])
        # The fixed schedule itself matches the non-pipelined float64 model.
        assert result["grad_err"] < 1e-12
        assert result["loss_err"] < 1e-12
        assert result["n_losses"] == (2 * world_size if result["has_last"] else 0)


@pytest.mark.parametrize("hint,reference,per_rank,layout", [
    ("Interleaved1F1B", "Interleaved1F1B", 2, "loop"), ("BFW", "ZBVZeroBubble", 2, "v"),
    ("GPipe", "GPipe", 1, "loop"),
])
def test_outputs_and_eval_match_torch(hint, reference, per_rank, layout):
    ranks = run_local_world(2, workers.outputs_and_eval, hint, reference, per_rank, layout, timeout=120)
    for result in ranks:
        assert result["same"]
        if result["has_last"]:
            assert result["n_eval_losses"] == 4
            assert result["eval_error"] < 1e-12
            assert result["output_shape"] == (4 * workers.BATCH_PER_MICROBATCH, workers.DIM)


def test_slow_microbatch_is_overtaken_and_step_is_faster():
    # GPipe, 2 ranks, 8 microbatches, emulated device time: stage 0's forward of
    # microbatch 4 takes 0.6 s instead of 0.02 s. The fixed schedule leaves stage 1 idle
    # until it arrives; RRFP runs stage 1's (0.1 s) backwards of microbatches 0-3
    # meanwhile. The simulator predicts 1.58 s fixed vs 1.18 s RRFP. (Plain readiness-first:
    # the lookahead guard would wait, as earlier steps never saw microbatch 4 late.)
    ranks = run_local_world(2, workers.slow_microbatch_comparison, "GPipe", "hint", 8, 4, 0.6, 2,
                      timeout=120)
    last = ranks[1]
    assert last["realized_order"] != last["hint_order"]
    for rank, result in enumerate(ranks):
        fixed = statistics.median(result["times"]["fixed"])
        rrfp = statistics.median(result["times"]["rrfp"])
        assert rrfp < fixed - 0.2, f"rank {rank}: RRFP {rrfp:.3f} s vs fixed {fixed:.3f} s"


@pytest.mark.parametrize("buffer_limit", ["hint", "hint+2", 1, 2])
@pytest.mark.parametrize(
    "hint,per_rank,layout", [("1F1B", 1, "loop"), ("Interleaved1F1B", 2, "loop"), ("BFW", 2, "v")]
)
def test_in_flight_forwards_never_exceed_the_limit(hint, per_rank, layout, buffer_limit):
    ranks = run_local_world(2, workers.memory_bound, hint, per_rank, layout, 8, buffer_limit, timeout=120)
    ran_ahead = False
    for result in ranks:
        for stage in result["stages"]:
            limit = result["limits"][stage]
            expected = {"hint": result["hint_peak"][stage],
                        "hint+2": result["hint_peak"][stage] + 2}.get(buffer_limit, buffer_limit)
            assert limit == expected
            assert result["peak"][stage] <= limit
            ran_ahead |= result["peak"][stage] > result["hint_peak"][stage]
    if buffer_limit == "hint+2":
        assert ran_ahead, "slow backwards should have let forwards run past the hint's peak"


def test_every_waiting_rank_raises_when_a_peer_never_sends():
    ranks = run_local_world(4, workers.silent_first_rank, 2.0, timeout=120)
    assert ranks[0] == {}
    for rank in (1, 2, 3):
        outcome = ranks[rank]
        assert 2.0 <= outcome["elapsed"] < 15.0
        message = outcome["error"]
        assert f"pipeline rank {rank}" in message
        assert f"stage {rank} F microbatch 0" in message
        assert f"input activation from stage {rank - 1} on pipeline rank {rank - 1}" in message


BAD_INPUTS = {
    "unknown_hint": ["unknown hint 'OneFOneB'", "Interleaved1F1B"],
    "single_stage_hint_two_stages": ["runs one stage per rank", "2 stages per rank"],
    "v_hint_loop_stages": ["places stages [0, 3] on pipeline rank 0", "holds stages [0, 2]"],
    "loop_hint_v_stages": ["places stages [0, 2]", "holds stages [0, 3]"],
    "limit_zero": ["buffer_limit=0 is below 1"],
    "limit_malformed": ["buffer_limit='hint-1' is not understood"],
    "limit_below_reversed_order": ["LoopedBFS", "needs its own peak (4)"],
    "too_few_microbatches": ["at least as many microbatches as stages", "got 1 microbatches"],
    "too_few_microbatches_dualpipev": ["DualPipeV", "at least as many microbatches as stages"],
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_raises_value_error_before_any_communication(case):
    # Only rank 0 builds a schedule; if it communicated before raising it would hang.
    message = run_local_world(2, workers.bad_input, case, timeout=60)[0]
    for expected in BAD_INPUTS[case]:
        assert expected in message, message
