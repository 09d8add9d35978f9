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
# 14 cases x 2 world sizes x 3 = 84 distinct delay seeds, on the emulated asynchronous
# device: 56 with launch depth 1, 28 with no bound.
DELAY_SEEDS_PER_CASE = 3


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
            assert outcome["device"] == ("HostDevice" if run == "plain" else "EmulatedDevice")
            assert all(outcome["peak"][s] <= outcome["limits"][s] for s in outcome["peak"])
            if outcome["most_behind"] is not None:
                assert outcome["most_behind"] < outcome["launch_depth"], f"rank {rank}, {run}"
        # The fixed schedule itself matches the non-pipelined float64 model.
        assert result["grad_err"] < 1e-12
        assert result["loss_err"] < 1e-12
        assert result["n_losses"] == (2 * world_size if result["has_last"] else 0)
    # The runs put "whatever the timing" to the test: some action ran out of the hint's order.
    assert any(outcome["out_of_order"] for result in ranks
               for outcome in result["runs"].values()), (
        {rank: {run: o["out_of_order"] for run, o in r["runs"].items()}
         for rank, r in enumerate(ranks)})


@pytest.mark.parametrize("hint,reference,per_rank,layout", [
    ("Interleaved1F1B", "Interleaved1F1B", 2, "loop"), ("BFW", "ZBVZeroBubble", 2, "v"),
    ("GPipe", "GPipe", 1, "loop"),
])
def test_outputs_and_eval_match_torch(hint, reference, per_rank, layout):
    ranks = run_local_world(2, workers.outputs_and_eval, hint, reference, per_rank, layout, timeout=120)
    # The training step ran actions out of the hint's order (and still matched torch).
    assert any(result["out_of_order"]["train"] for result in ranks), ranks
    for result in ranks:
        assert result["same"]
        if result["has_last"]:
            assert result["n_eval_losses"] == 4
            assert result["eval_error"] < 1e-12
            assert result["output_shape"] == (4 * workers.BATCH_PER_MICROBATCH, workers.DIM)


def test_stages_listed_out_of_order_run_in_stage_order():
    # torch's first-step shape inference walks the stage list with blocking receives:
    # listed in reverse, rank 0 would wait for stage 1's activation and rank 1 for stage
    # 2's, before anything could check the placement. A hang fails on the world timeout.
    ranks = run_local_world(2, workers.stages_listed_in_reverse, timeout=180)
    assert [result["listed"] for result in ranks] == [[2, 0], [3, 1]]
    for rank, result in enumerate(ranks):
        assert result["bitwise"], f"rank {rank}: not bitwise torch's Interleaved1F1B"


def test_slow_microbatch_is_overtaken_on_an_asynchronous_device():
    # GPipe, 2 ranks, 8 microbatches, emulated device time: stage 0's forward of
    # microbatch 4 takes 0.6 s instead of 0.02 s. The fixed schedule leaves stage 1 idle
    # until it arrives; RRFP runs stage 1's (0.15 s) backwards of microbatches 0-3
    # meanwhile. The simulator predicts 1.98 s fixed vs 1.40 s RRFP: the 0.2 s asserted
    # leaves a loaded machine's launch and scheduling delays (0.13 s seen at load 15) room.
    # (Plain readiness-first: the lookahead guard would wait, as earlier steps never saw
    # microbatch 4 late.)
    # RRFP runs on the emulated asynchronous device and decides only when it is idle
    # (launch depth 1): launches return before the work is done, as on CUDA.
    ranks = run_local_world(2, workers.slow_microbatch_comparison, "GPipe", "hint", 8, 4, 0.6, 2,
                            1, timeout=120)
    last = ranks[1]
    assert last["device"] == "EmulatedDevice"
    assert last["realized_order"] != last["hint_order"]
    for rank, result in enumerate(ranks):
        fixed = statistics.median(result["times"]["fixed"])
        rrfp = statistics.median(result["times"]["rrfp"])
        assert rrfp < fixed - 0.2, f"rank {rank}: RRFP {rrfp:.3f} s vs fixed {fixed:.3f} s"
        fixed_wait = statistics.median(result["waits"]["fixed"])
        rrfp_wait = statistics.median(result["waits"]["rrfp"])
        assert rrfp_wait < fixed_wait - 0.2, (
            f"rank {rank}: device idle {rrfp_wait:.3f} s under RRFP vs {fixed_wait:.3f} s")


# (hint, torch schedule whose memory is the reference, stages per rank, placement)
MEMORY_CASES = [
    ("1F1B", "1F1B", 1, "loop"), ("GPipe", "GPipe", 1, "loop"),
    ("Interleaved1F1B", "Interleaved1F1B", 2, "loop"), ("LoopedBFS", "LoopedBFS", 2, "loop"),
    ("InterleavedZeroBubble", "InterleavedZeroBubble", 2, "loop"),
    ("ZBVZeroBubble", "ZBVZeroBubble", 2, "v"), ("DualPipeV", "DualPipeV", 2, "v"),
    ("BF", "Interleaved1F1B", 2, "loop"), ("BFW", "ZBVZeroBubble", 2, "v"),
]


@pytest.mark.parametrize("case", MEMORY_CASES, ids=lambda c: c[0])
def test_measured_activation_bytes_stay_within_what_the_limit_allows(case):
    """Blocks that save a known number of bytes per microbatch: at "hint" the bytes measured
    on the saved tensors stay within what torch's own fixed schedule (the reference class,
    on this torch, the same blocks, delays and meter) holds, per rank and per stage, and
    so do they, per rank, on blocks whose saves are partly freed at I where the hint
    splits backward; the bytes (per stage and per rank) are exactly the microbatches held
    times that, the microbatches held (recomputed from the realized order) are exactly
    the arbiter's count, and they stay within the limit: at "hint" the hint's own peak
    (recomputed from its order), per stage and per rank; at "hint+2" 2 more; at an int
    n, n."""
    ranks = run_local_world(2, workers.memory_world, *case, timeout=180)
    for rank, result in enumerate(ranks):
        per_mb = result["per_microbatch"]
        torch_rank, torch_stages = result["torch"]["rank_bytes"], result["torch"]["stage_bytes"]
        freed_at_i = result.get("freed_at_i")  # hints that split backward
        assert freed_at_i is None or freed_at_i["rrfp"] <= freed_at_i["torch"], (
            f"rank {rank}, blocks partly freed at I: {freed_at_i['rrfp']} B under RRFP, "
            f"{freed_at_i['torch']} B under torch's {case[1]}")
        for run, outcome in result["runs"].items():
            where = f"rank {rank}, {run}"
            if run.startswith("hint/"):
                assert outcome["rank_bytes"] <= torch_rank, (
                    f"{where}: {outcome['rank_bytes']} B on the rank, torch's {case[1]} "
                    f"{torch_rank} B")
                assert outcome["stage_bytes"] is None or all(
                    b <= torch_stages[s] for s, b in outcome["stage_bytes"].items()), (
                    f"{where}: {outcome['stage_bytes']} B per stage, torch's {torch_stages}")
            assert outcome["bitwise"], f"{where}: not bitwise the fixed schedule's"
            held, rank_held = outcome["held"], outcome["rank_held"]
            assert held == outcome["arbiter_held"], where
            assert rank_held == outcome["arbiter_rank_held"], where
            assert outcome["rank_bytes"] == rank_held * per_mb, (
                f"{where}: {outcome['rank_bytes']} B measured on the rank, held {rank_held}")
            if outcome["stage_bytes"] is not None:
                assert outcome["stage_bytes"] == {s: h * per_mb for s, h in held.items()}, (
                    f"{where}: {outcome['stage_bytes']} B measured per stage, held {held}")
            limit = run.split("/")[0]
            if limit.startswith("hint"):
                extra = int(limit[5:] or 0)
                allowed = {s: h + extra for s, h in outcome["hint_held"].items()}
                rank_allowed = outcome["hint_rank_held"] + extra
            elif limit == "busiest":  # what the fixed order's busiest rank holds, anywhere
                rank_allowed = max(r["runs"]["hint/slow_head"]["hint_rank_held"] for r in ranks)
                allowed = {s: rank_allowed for s in held}
            else:
                allowed, rank_allowed = {s: int(limit) for s in held}, int(limit)
            assert all(held[s] <= allowed[s] for s in held), (
                f"{where}: held {held}, allowed {allowed}")
            assert rank_held <= rank_allowed, f"{where}: held {rank_held}, allowed {rank_allowed}"


@pytest.mark.parametrize("hint,per_rank,layout,limit", [
    ("1F1B", 1, "loop", 2), ("Interleaved1F1B", 2, "loop", "hint"),
    ("ZBVZeroBubble", 2, "v", "hint")])
def test_receive_buffers_grow_with_the_limit_not_the_microbatch_count(hint, per_rank, layout,
                                                                      limit):
    """A ring per incoming channel: the same bytes at 4 and at 16 microbatches under one
    limit, within (limit + 1) activations plus ``limit`` gradients per channel."""
    ranks = run_local_world(2, workers.receive_buffers, hint, per_rank, layout, limit,
                            timeout=120)
    for rank, result in enumerate(ranks):
        few, many = result[4], result[16]
        assert 0 < few["bytes"] == many["bytes"], (rank, result)
        assert many["bytes"] <= many["bound"] == few["bound"], (rank, result)
        assert many["bytes"] < many["per_microbatch"], (rank, result)


def test_busiest_keeps_the_job_peak_of_the_fixed_schedule_on_four_ranks():
    """buffer_limit="busiest": on blocks that save a known number of bytes per microbatch,
    the busiest rank's activation bytes (measured by the meter, emulated device) stay
    within what the fixed 1F1B's busiest rank holds (its own order recounted, times those
    bytes), while a rank that holds less under 1F1B may hold more than it did there."""
    ranks = run_local_world(4, workers.memory_world, "1F1B", "1F1B", 1, "loop", timeout=240)
    per_mb = ranks[0]["per_microbatch"]
    busiest_fixed = max(r["runs"]["hint/slow_head"]["hint_rank_held"] for r in ranks) * per_mb
    runs = [r["runs"]["busiest/slow_head"] for r in ranks]
    assert all(run["bitwise"] for run in runs)
    assert all(run["rank_limit"] == 4 for run in runs)  # rank 0's 1F1B peak, on every rank
    assert max(run["rank_bytes"] for run in runs) <= busiest_fixed, (runs, busiest_fixed)
    # The ranks that hold less under 1F1B get the headroom (whether a step uses it depends
    # on timing, so it is not asserted here).
    assert [run["rank_limit"] - run["hint_rank_peak"] for run in runs] == [0, 1, 2, 3]


def test_microbatches_split_off_one_batch_count_their_own_bytes_while_held():
    """The first stage's microbatches are views of the input batch, which the step keeps
    whole; the last stage's inputs are receive buffers, which the ring keeps. Each counts
    its own bytes, while its graph holds it: every rank reports the microbatches it holds
    times one microbatch's saved bytes (the Linear's input and the Tanh's output), at every
    limit (rank 1 holds one at each)."""
    limits = [1, 2, 4]
    ranks = run_local_world(2, workers.chunked_input_bytes, limits, timeout=120)
    per_microbatch = 2 * workers.BATCH_PER_MICROBATCH * workers.DIM * 8
    held = [ranks[0][limit][1] for limit in limits]
    # Rank 0 holds its 1F1B warm-up (2) wherever the limit allows it; whether it runs more
    # forwards before a gradient arrives depends on timing (a loaded machine held 3 at 4).
    assert held[:2] == [1, 2] and 2 <= held[2] <= 4, held
    assert [ranks[1][limit][1] for limit in limits] == [1, 1, 1]
    for rank, result in enumerate(ranks):
        for limit, (measured, held) in result.items():
            assert measured == held * per_microbatch, (rank, limit, measured)


def test_without_the_meter_forwards_run_unhooked_and_match_torch():
    """``meter_activations=False``: no saved-tensor hooks around the forwards, no bytes
    reported, gradients and losses still bitwise torch's Schedule1F1B (the metered run is
    the control: its forwards are hooked and it reports bytes)."""
    ranks = run_local_world(2, workers.unmetered, timeout=120)
    for rank, result in enumerate(ranks):
        metered, unmetered = result[True], result[False]
        assert metered["bitwise"] and unmetered["bitwise"], f"rank {rank}"
        # 2 steps x 4 microbatches; the shape inference's forward runs unmetered in both.
        assert metered["hooked"].count(True) == 8
        assert len(unmetered["hooked"]) == len(metered["hooked"])
        assert not any(unmetered["hooked"])
        assert metered["bytes"] > 0
        assert unmetered["bytes"] is None
        assert "peak activations not measured" in unmetered["summary"]


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
    "fixed_below_hint": ["policy='fixed'", "holds up to 2 microbatches", "buffer_limit=1 allows 1"],
    "launch_depth_negative": ["launch_depth must be an int >= 1, or None, 0 or 'none'"],
    "unknown_policy": ["unknown policy 'eager'", "case-insensitive"],
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_raises_value_error_before_any_communication(case):
    # Only rank 0 builds a schedule; if it communicated before raising it would hang.
    message = run_local_world(2, workers.bad_input, case, timeout=180)[0]
    for expected in BAD_INPUTS[case]:
        assert expected in message, message


def test_lazily_connected_channels_deadlock_unless_connected_first():
    # Without a bound device NCCL creates a channel's communicator at its first operation
    # and blocks until the peer's first operation on it. Posting receives first deadlocks:
    # rank 0 waits on the gradient channel 1->0, rank 1 on the activation channel 0->1.
    stuck = run_local_world(2, workers.lazily_connected_channels, False, timeout=120)
    for result in stuck:
        assert "error" in result, result
        assert "first operation on a lazily connected channel timed out" in result["error"]
        assert result["elapsed"] < 20
    # rrfp's connection step touches every channel once, in one order on every rank.
    connected = run_local_world(2, workers.lazily_connected_channels, True, timeout=120)
    assert all(result.get("bitwise") for result in connected), connected


@pytest.mark.parametrize("hint, stages_per_rank", [("1F1B", 1), ("Interleaved1F1B", 2)])
def test_pre_split_step_is_bitwise_torchs_schedule_on_the_same_microbatches(hint,
                                                                           stages_per_rank):
    """``step(arg_mbs=..., target_mbs=...)`` (torch's pre-split call, on every torch
    version) and ``step_microbatches``: gradients, losses and outputs bitwise those of
    torch's fixed schedule, with random delays that reorder actions; bad pre-split inputs
    are refused saying what is wrong, before any communication."""
    ranks = run_local_world(2, workers.pre_split, hint, stages_per_rank, timeout=180)
    for rank, result in enumerate(ranks):
        for call in ("step", "step_microbatches"):
            run = result[call]
            assert run["bitwise"], (rank, call, "differs from torch's " + hint)
            assert run["outputs"], (rank, call, "outputs differ from torch's")
            assert [e.split(":")[0] for e in run["errors"]] == \
                ["ValueError", "TypeError", "ValueError"], run["errors"]
    assert sum(r[c]["out_of_order"] for r in ranks for c in ("step", "step_microbatches")) > 0


def test_a_failed_step_under_split_backward_leaves_no_unfinished_microbatch_held():
    """With I and W split, a microbatch between its I and its W keeps its graph in the
    stage's backward state: a failed step must let go of that too, not only of the
    forward caches."""
    for rank, result in enumerate(run_local_world(2, workers.split_backward_failure,
                                                  timeout=120)):
        assert result["error"] is not None, f"rank {rank} did not fail"
        assert result["held"] == {"forward_states": 0, "backward_state": 0, "dw_runner": 0,
                                  "bwd_cache": 0}, (rank, result)
        assert result["bound"] == 0, (rank, result)


def test_stats_and_history_hold_device_durations_not_launch_times():
    ranks = run_local_world(2, workers.device_durations, 0.005, timeout=120)
    for result in ranks:
        expected = result["targets"]
        # A span runs from the device starting the action to its end: never shorter than
        # the emulated time (a sleep does not end early), and, on a loaded machine too, far
        # from what a span measured from the launch would be (up to a queued backward
        # more: +200% for a forward). On busy cores a sleeping device thread wakes late
        # (the median span 23 ms over its time at load 15): within 40% of 100 ms.
        for kind, target in expected.items():
            measured = [seconds for step in result["steps"] for k, seconds in step if k == kind]
            assert all(m >= 0.97 * target for m in measured), (kind, measured)
            assert statistics.median(measured) <= 1.4 * target, (kind, measured)
        # What the schedule learned is those spans: each step's mean weighing one half
        # against the steps before it (a mean, so one stall of a loaded machine moves it:
        # it is checked against the spans, which are checked against the emulated time).
        assert {"F", "B"} <= set(result["history"])
        for kind in expected:
            learned = None
            for step in result["steps"]:
                mean = statistics.fmean(seconds for k, seconds in step if k == kind)
                learned = mean if learned is None else 0.5 * (mean + learned)
            assert result["history"][kind] == pytest.approx(learned, rel=1e-9), kind
        # Launches return after the emulated launch cost, long before the work is done.
        assert result["launch_time"] < 0.25 * result["busy"]
        assert result["launch_time"] >= 0.005 * result["dispatched"]


@pytest.mark.parametrize("failing_rank", [0, 1])
def test_a_failed_step_fails_every_rank_promptly_and_a_new_schedule_recovers(failing_rank):
    ranks = run_local_world(2, workers.failure_and_recovery, failing_rank, timeout=120)
    for rank, result in enumerate(ranks):
        assert result["error"] is not None, f"rank {rank} did not fail"
        if rank == failing_rank:
            assert "failed on purpose" in result["error"], result["error"]
        else:  # told through the store, naming the failed rank, not a 30 s stall
            assert result["error"].startswith("PeerFailedError"), result["error"]
            assert f"global rank {failing_rank} of the pipeline failed" in result["error"]
        assert result["elapsed"] < 10, result
        assert "cannot run another step" in result["refused"]
        assert result["threads_after_failure"] == [], result["threads_after_failure"]
        assert result["cached_after_failure"] == 0
        assert result["bound_after_failure"] == 0, "a receive buffer stays bound to torch's infos"
        assert result["threads_at_end"] == []
        assert result["bitwise"], f"rank {rank}: the recovered step differs from torch's GPipe"


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("hint,per_rank,layout", [
    ("1F1B", 1, "loop"), ("Interleaved1F1B", 2, "loop"), ("ZBVZeroBubble", 2, "v"),
    ("BFW", 2, "v")])
def test_microbatches_of_different_shapes(hint, per_rank, layout, world_size):
    seed = 17 * world_size + per_rank + len(hint)
    ranks = run_local_world(world_size, workers.variable_shapes, hint, per_rank, layout, seed,
                            timeout=180)
    assert any(result["out_of_order"] for result in ranks), ranks  # the order was put to the test
    for rank, result in enumerate(ranks):
        assert result["bitwise"], f"rank {rank}: differs from the fixed order on the same data"
        assert result["error"] < 1e-12, f"rank {rank}: {result['error']} from the float64 model"


def test_a_microbatch_whose_shape_breaks_the_model_fails_every_rank():
    ranks = run_local_world(2, workers.variable_shape_that_breaks_the_model, timeout=120)
    assert "mat1 and mat2 shapes cannot be multiplied" in ranks[0]["error"], ranks[0]
    assert "global rank 0 of the pipeline failed" in ranks[1]["error"], ranks[1]
    assert all(r["elapsed"] < 20 for r in ranks)


def test_fixed_shapes_send_no_header_and_variable_shapes_one_per_activation():
    """Sends counted on the channels' own groups: with fixed shapes only the tensors
    themselves; with variable shapes an 80-byte header (1 + 9 int64) ahead of each
    activation and none ahead of a gradient; the step's stats report the same."""
    message = workers.BATCH_PER_MICROBATCH * workers.DIM * 8  # one float64 tensor
    fixed = run_local_world(2, workers.messages_per_step, False, timeout=180)
    variable = run_local_world(2, workers.messages_per_step, True, timeout=180)
    for result in fixed + variable:
        assert result["reported"] == result["counted"], result
        assert result["reported_bytes"] == result["counted_bytes"], result
    # rank 0: 4 activations; rank 1: 4 gradients
    assert [(r["counted"], r["counted_bytes"], r["headers"]) for r in fixed] == [
        (4, 4 * message, 0), (4, 4 * message, 0)]
    assert [(r["counted"], r["counted_bytes"], r["headers"]) for r in variable] == [
        (8, 4 * message + 4 * 80, 4), (4, 4 * message, 0)]
    assert variable[0]["header_bytes"] == [80]


@pytest.mark.parametrize("how", ["forward", "loss", "send"])
@pytest.mark.parametrize("kind", ["gloo", "nccl-like"])
def test_a_rank_failing_mid_step_makes_every_rank_raise_within_2_s_naming_it(kind, how):
    """3 ranks, ``stall_timeout`` 300 s. One rank fails mid-step: a forward (rank 0), the
    loss (rank 2), a send (rank 1; on the NCCL-like channels its work completes with an
    error). Every other rank raises ``PeerFailedError`` naming it within 2 s — on gloo,
    whose closed connections would also fail the neighbours, and on channels whose abort
    does not reach the peer (``tests.nccl_like``), where only the store tells them. Then a
    new schedule in the same process steps bitwise as torch's GPipe."""
    ranks = run_local_world(3, workers.failure_reaches_every_rank, kind, how, timeout=150)
    failing = {"forward": 0, "loss": 2, "send": 1}[how]
    own = ranks[failing]
    assert own["error"] is not None and own["failed_rank"] is None, own
    assert ("failed on purpose" if kind == "gloo" or how != "send" else "planted send error") \
        in own["error"], own["error"]
    if how == "send" and kind == "nccl-like":  # a send's work that completed with an error
        assert "on channel 1->2 (global rank 1 -> 2)" in own["error"], own["error"]
    struck = own["failed_at"] or own["raised_at"]
    for rank, result in enumerate(ranks):
        assert result["bitwise"], f"rank {rank}: the new schedule's step differs from GPipe"
        assert result["threads_at_end"] == [], result["threads_at_end"]
        if rank == failing:
            continue
        assert result["error"].startswith("PeerFailedError"), result["error"]
        assert result["failed_rank"] == failing
        assert f"global rank {failing} of the pipeline failed" in result["error"]
        assert f"pipeline rank {rank} (global rank {rank}) stops its step" in result["error"]
        assert result["raised_at"] - struck < 2.0, (rank, result["raised_at"] - struck)


@pytest.mark.parametrize("kind", ["gloo", "nccl-like"])
def test_after_a_clean_step_and_close_the_peer_completes_its_step(kind):
    """Rank 0 closes right after its step while its last messages still wait for rank 1's
    receives (on the NCCL-like channels its sends are then still in flight: a close that
    shut the channels down at once would drop them, and rank 1 would wait 300 s)."""
    ranks = run_local_world(2, workers.clean_close_then_peer_steps, kind, timeout=120)
    assert ranks[0]["error"] is None and ranks[1]["error"] is None, ranks
    # Rank 0's close waited for rank 1's slow forwards to take its messages.
    assert ranks[0]["elapsed"] >= 0.2, ranks[0]


def test_variable_shapes_on_nccl_channels_send_their_headers_on_the_host():
    """On NCCL channels each channel gets a gloo side channel for the shape headers, so a
    header is read on the host, with no device-to-host copy per message: the (NCCL-like)
    data channels carry only the connection token and the payloads, never an int64
    header; results are bitwise the fixed order's on the same data."""
    ranks = run_local_world(2, workers.variable_shapes, "1F1B", 1, "loop", 5, "nccl-like",
                            timeout=180)
    for rank, result in enumerate(ranks):
        assert result["bitwise"], f"rank {rank}: differs from the fixed order on the same data"
        assert result["error"] < 1e-12
        assert result["data_dtypes"] == ["torch.float32", "torch.float64"], result
