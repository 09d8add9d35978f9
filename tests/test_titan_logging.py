"""What a torchtitan job under RRFP reports: its console (one rank prints; a stats line
per step; the end-of-run summary and verdict), its TensorBoard scalars and texts, and the
stats each rank sends the logging rank through the store."""

from __future__ import annotations

import re

import pytest
import torch.distributed as dist

from rrfp.core.stats import StepStats
from rrfp.testing.stats import made_up_stats
from rrfp.testing.worlds import run_local_world
from tests.titan_helpers import (
    assert_one_rank_prints, failure_excerpt, logged_losses, LOSS, METERED, run_titan,
    STATS_LINE, tensorboard_scalars, tensorboard_texts, tensorboard_values, TITAN_0_2,
    UNMETERED)
from torchtitan_ext.common.log_ranks import log_ranks, print_only_on, warn_if_loss_hidden


def test_main_job_trains_on_cpu_and_logs_rrfp_stats(tmp_path):
    code, out = run_titan(2, "--training.steps", "8", "--rrfp.trace_folder", "traces",
                          dump=str(tmp_path))
    assert code == 0, failure_excerpt(out)
    assert_one_rank_prints(out)
    # torchtitan's start-up lines and Python's warnings too: held until the rank is known.
    assert out.count("torchtitan version") == 1, out[:3000]
    if TITAN_0_2:  # torchtitan 0.3 logs no such line
        assert out.count("Starting job") == 1, out[:3000]
    assert out.count("'set_vital' is deprecated") <= 1, out[:3000]
    losses = logged_losses(out)
    assert sorted(losses) == list(range(1, 9))
    assert float(losses[8]) < float(losses[1]) - 2.0
    assert ("ScheduleRRFP with hint Interleaved1F1B (loop placement), policy lookahead, buffer "
            "limit 'hint'") in out
    # What that limit allows, and where the gains are, once (rrfp.schedule's line).
    assert out.count("buffer_limit='hint' allows no activation memory beyond the fixed "
                     "schedule's (3 microbatches on this rank), so RRFP mostly follows the "
                     "hint") == 1, failure_excerpt(out)
    assert "speed needs memory slack, e.g. buffer_limit='hint+2'" in out
    assert "\x1b[" not in out  # no colour codes: the output is a pipe
    # The trainer's close closed the schedule (the logging rank says so).
    assert out.count("rrfp: closed the pipeline schedule") == 1, failure_excerpt(out)
    # The meter samples (meter_every=100): the first step measures activations, later ones
    # say they did not.
    assert re.search(STATS_LINE.format(step=1, fixed="", label="", activations=METERED), out)
    assert re.search(STATS_LINE.format(step=7, fixed="", label="", activations=UNMETERED), out)
    assert re.search(STATS_LINE.format(step=8, fixed=r" \(fixed order\)", label="",
                                       activations=UNMETERED), out)
    scalars = tensorboard_scalars(tmp_path)
    for tag in ("rrfp/idle_fraction/pp0", "rrfp/out_of_hint_order/pp1",
                "rrfp/backpressure_entries/pp0", "rrfp/peak_in_flight/pp1",
                "rrfp/dispatch_overhead_us/pp0", LOSS):
        assert scalars.get(tag) == 8, (tag, scalars)
    for tag in ("rrfp/peak_activation_bytes/pp0", "rrfp/peak_activation_bytes/pp1"):
        assert scalars.get(tag) == 1, (tag, scalars)
    # Each run's traces go to a folder of their own.
    (run_traces,) = (tmp_path / "traces").iterdir()
    assert re.fullmatch(r"\d{8}-\d{6}", run_traces.name)
    assert sorted(p.name for p in run_traces.iterdir()) == sorted(f"step{n}.json" for n in range(1, 9))
    # 8 steps are too few for a first verdict to cost training under 1% of the CPU: at the
    # end only, the advisor's verdict and the run's summary, in the console and in
    # TensorBoard; the advisor reads the run's own folder.
    assert re.search(r"rrfp: the verdict comes at the end of the run: predicting now would "
                     r"take about \d+ s of CPU, over 1% of the \d+ s the 4 steps left", out)
    verdict = re.search(
        r"rrfp: timing variability \d+%; .*; this run \(buffer_limit='hint', policy lookahead\) "
        rf"\d\.\d\dx, measured \d\.\d\dx by the in-run A/B; python -m rrfp\.advise "
        rf"{re.escape(str(run_traces))}$", out, re.M)
    assert verdict, failure_excerpt(out)
    # Said once, in the summary, after a line that says it is being predicted.
    assert out.count(verdict[0]) == 1, failure_excerpt(out)
    assert re.search(r"rrfp: predicting the verdict from the last \d+ steps \(about \d+ s of "
                     r"CPU\)\n.*rrfp summary", out), failure_excerpt(out)
    summary = out[out.index("rrfp summary: 8 steps, hint Interleaved1F1B, policy lookahead; "
                            "step time "):].splitlines()[:9]
    assert [line.split(" (")[0].split(":")[0] for line in summary[1:]] == [
        "  measured", "  all steps, fixed-order ones included", "  mean idle",
        "  out-of-hint actions", "  microbatches held", "  peak activations", "  advisor cost",
        "  rrfp"], summary
    # The main job's in-run A/B (fixed_every = 2): steps 2, 4, 6, 8 in the fixed order.
    assert re.match(r"  measured \(in-run A/B, 4 steps in the fixed order, each against the RRFP "
                    r"steps beside it\): fixed / RRFP step time \d\.\d\dx \[\d\.\d\d-\d\.\d\d\] "
                    r"over 4 pairs; RRFP ", summary[1]), summary
    assert re.fullmatch(r"  out-of-hint actions: pp0 \d+ of \d+, pp1 \d+ of \d+", summary[4])
    assert summary[5] == ("  microbatches held (every step): pp0 at most 5 (fixed schedule 5), "
                          "pp1 at most 3 (fixed schedule 3)"), summary
    assert re.fullmatch(r"  peak activations: pp0 \d+\.\d MiB \(fixed schedule \d+\.\d MiB\), "
                        r"pp1 .* \(in steps 1-8: the microbatches each held, at the bytes per "
                        r"microbatch metered\); metered in step 1: pp0 \d+\.\d MiB, "
                        r"pp1 \d+\.\d MiB", summary[6]), summary
    assert summary[8] == f"  {verdict[0]}"
    texts = tensorboard_texts(tmp_path)
    assert texts["rrfp/verdict"][-1].strip() == verdict[0]
    assert texts["rrfp/summary"][-1].split("\n")[0].strip() == summary[0].split(" - INFO - ")[-1]
    from rrfp.advise.__main__ import main as advise_main

    assert advise_main([str(tmp_path), "--no-plots"]) == 0


def test_a_self_driving_job_trains_and_says_what_it_ran(tmp_path):
    """``--rrfp.tune_within hint+2 --rrfp.tune_hints`` on the main job (its A/B reset): the
    schedule is built self-driving (said in its line, with the hints it may rank by), each
    step's setting goes to TensorBoard, and the summary says no decision took effect yet
    and why there is no verdict. In 8 steps none can: the tuner measures the first block,
    and its prediction, wanted at the second, waits for the CPU share it may take (it would
    take seconds, and 8 steps grant a small part of one); the A/B's first fixed-order step,
    the 8th, checks the hint's own setting meanwhile."""
    from torchtitan_ext.common.run_advice import SELF_DRIVING_NO_VERDICT

    code, out = run_titan(2, "--training.steps", "8", "--rrfp.tune_within", "hint+2",
                          "--rrfp.tune_hints", "--rrfp.fixed_every", "0", dump=str(tmp_path))
    assert code == 0, failure_excerpt(out)
    assert ("buffer limit 'hint' (rrfp.buffer_limit), self-driving within 'hint+2' "
            "(rrfp.tune_within: it chooses the limit, policy and interchangeable hint") in out
    # Interleaved1F1B, 2 ranks x 2 stages: the BF rule runs its streams in its orders.
    assert "tune_hints: the self-driving candidates also rank by BF" in out, \
        failure_excerpt(out)
    # Metered in the first step (the first of the hint's own setting), not in the others.
    assert re.search(STATS_LINE.format(step=1, fixed="", label="", activations=METERED),
                     out), failure_excerpt(out)
    assert re.search(STATS_LINE.format(step=7, fixed="", label="", activations=UNMETERED),
                     out), failure_excerpt(out)
    # The in-run A/B checks the hint's own setting while the prediction waits.
    assert re.search(STATS_LINE.format(step=8, fixed=" \\(fixed order\\)", label="",
                                       activations=UNMETERED), out), failure_excerpt(out)
    values = tensorboard_values(tmp_path)
    assert values["rrfp/self_driving/fixed_order"] == [0.0] * 7 + [1.0]
    assert values["rrfp/self_driving/other_hint"] == [0.0] * 8
    # Interleaved1F1B, 2 ranks x 2 stages, 8 microbatches: the hint's own limits ran.
    assert values["rrfp/self_driving/rank_buffer_limit/pp0"] == [5.0] * 8
    assert values["rrfp/self_driving/rank_buffer_limit/pp1"] == [3.0] * 8
    summary = out[out.index("rrfp summary: 8 steps"):].splitlines()
    assert summary[1].startswith(
        "  self-driving within tune_within='hint+2': no decision took effect; the latest "
        "predicting from steps 0-3 waits for the CPU it may take beside training (1% of the "
        "time of "), summary[1]
    assert summary[1].endswith(
        "the running setting goes on meanwhile, checked by the in-run A/B"), summary[1]
    assert out.count("rrfp self-driving: predicting from steps 0-3 waits") == 1, \
        failure_excerpt(out)  # every rank keeps it; the rank that logs says it
    assert f"  {SELF_DRIVING_NO_VERDICT}" in summary[:12], summary
    assert "rrfp: timing variability" not in out  # no verdict was predicted


def test_log_rank_chooses_the_ranks_that_print(monkeypatch, caplog):
    import logging

    monkeypatch.delenv("LOG_RANK", raising=False)
    assert log_ranks(3) == {3}
    warn_if_loss_hidden(3)
    assert not caplog.records
    monkeypatch.setenv("LOG_RANK", "0,2")
    assert log_ranks(3) == {0, 2}
    warn_if_loss_hidden(3)
    assert "the loss is logged by rank 3 only, and LOG_RANK=0,2 leaves it out" in caplog.text
    monkeypatch.setenv("LOG_RANK", "last")
    with pytest.raises(ValueError, match="LOG_RANK='last' must list ranks separated by commas"):
        log_ranks(3)

    handler = logging.Handler()
    monkeypatch.setattr(logging.getLogger(), "handlers", [handler])
    print_only_on({0, 2}, 2)
    assert not handler.filters
    print_only_on({0, 2}, 1)
    info, error = (logging.LogRecord("root", level, __file__, 1, "m", None, None)
                   for level in (logging.INFO, logging.ERROR))
    assert not handler.filter(info) and handler.filter(error)


def stats_exchange(rank: int, world_size: int, self_driving: bool = False) -> dict:
    """``StepStatsLog`` over three steps with made-up stats (out-of-hint = 10 x step +
    rank; step 2 in the fixed order; a rank's microbatch limit 5 + step + rank), the last
    logged twice, only the last rank reading: the scalars it returns, and which of this
    rank's keys its store still holds."""
    from torchtitan_ext.common.stats_logging import stats_store, StepStatsLog

    class Schedule:
        last_step_stats: StepStats

    schedule = Schedule()
    log = StepStatsLog(schedule, dist.new_group(list(range(world_size))), replica=None,
                       log_stats=True, trace_folder=None, reads=rank == world_size - 1,
                       self_driving=self_driving)
    scalars = {}
    for step in (1, 2, 3, 3):
        schedule.last_step_stats = made_up_stats(
            rank, peak_activation_bytes=None if step == 2 else 64,
            out_of_hint_order=10 * step + rank, policy="fixed" if step == 2 else "lookahead",
            rank_buffer_limit=5 + step + rank, ranked_by="GPipe" if step == 3 else None)
        scalars[step] = log.log(step)
        dist.barrier()  # what the next training step's pipeline does
    store = stats_store(list(range(world_size)), 0)
    keys = [step for step in (1, 2, 3) if store.check([f"{step}/{rank}"])]
    dist.barrier()  # rank 0, which does not read, hosts the store
    return {"scalars": scalars, "keys": keys}


def test_step_stats_are_gathered_through_the_store():
    """A reading rank gets the whole pipeline's stats in rank order (the others get no
    scalars), a metric not measured is left out of the scalars, a step logged twice does
    not lose its keys, and only the last step's keys stay in the store. (A
    collective there, the last one before exit, let a gloo worker release its tensors
    after the interpreter had started to shut down: an abort at exit in 2 of 32 runs of a
    two-step torchtitan job.)"""
    ranks = run_local_world(2, stats_exchange, timeout=120, store="tcp")
    assert all(scalars == {} for scalars in ranks[0]["scalars"].values())
    for rank, result in enumerate(ranks):
        assert result["keys"] == [3], (rank, result["keys"])
    for step, scalars in ranks[1]["scalars"].items():
        assert {k: v for k, v in scalars.items() if "out_of_hint" in k} == {
            "rrfp/out_of_hint_order/pp0": 10 * step, "rrfp/out_of_hint_order/pp1": 10 * step + 1}
        activations = {k for k in scalars if "peak_activation_bytes" in k}
        assert activations == (set() if step == 2 else {
            "rrfp/peak_activation_bytes/pp0", "rrfp/peak_activation_bytes/pp1"})
        assert not any("self_driving" in k for k in scalars)  # rrfp.tune_within off


def test_a_self_driving_run_logs_the_setting_each_step_ran():
    """With ``rrfp.tune_within``, the reading rank's scalars say per step whether it ran
    the hint's fixed order, whether another hint ranked it (``rrfp.tune_hints``) and each
    rank's microbatch limit (what the tuner chose)."""
    ranks = run_local_world(2, stats_exchange, True, timeout=120, store="tcp")
    for step, scalars in ranks[1]["scalars"].items():
        assert {k: v for k, v in scalars.items() if "self_driving" in k} == {
            "rrfp/self_driving/fixed_order": float(step == 2),
            "rrfp/self_driving/other_hint": float(step == 3),
            "rrfp/self_driving/rank_buffer_limit/pp0": 5 + step,
            "rrfp/self_driving/rank_buffer_limit/pp1": 6 + step}, step


@pytest.mark.parametrize("seed", range(3))
def test_the_console_s_a_b_pairs_taken_step_by_step_are_the_a_b_s_pairs(seed):
    """Each step's A/B note (``RunAdvice._ab_pair``) reads pairs kept as the steps come,
    not recomputed over the whole run at every step: the same pairs, the same note."""
    import random

    from rrfp.advise import ab_speedups
    from torchtitan_ext.common.run_advice import PairsSoFar

    rng, steps, pairs = random.Random(seed), [], PairsSoFar()
    for _ in range(300):
        # fixed-order steps now and then, twice in a row at times
        steps.append((rng.random() < 0.3, rng.uniform(0.5, 2)))
        before = ab_speedups(steps[:-1])
        after = ab_speedups(steps)
        made = pairs.add(*steps[-1])
        assert made == (after[-1] if len(after) > len(before) else None)
        assert pairs.ordered == sorted(after)


def test_the_summary_names_the_steps_that_held_more_than_the_fixed_schedule():
    from torchtitan_ext.common.run_advice import ab_lines, held_line, StepRecord

    def record(step, held, fixed_order=False, seconds=1.0):
        return StepRecord(step, fixed_order, seconds, {}, {}, {}, {}, held=held,
                          fixed_held={"pp0": 5, "pp1": 3})

    records = [record(s, {"pp0": 6 if s in (2, 3, 7) else 5, "pp1": 3}) for s in range(1, 9)]
    assert held_line(records, ["pp0", "pp1"]) == (
        "pp0 at most 6 (fixed schedule 5; more in steps 2, 3, 7), pp1 at most 3 (fixed schedule 3)")
    # The A/B: each fixed-order step against the RRFP steps beside it.
    steps = [record(s, {}, fixed_order=s % 2 == 0, seconds=1.2 if s % 2 == 0 else 1.0)
             for s in range(2, 9)]
    assert ab_lines(steps)[0] == (
        "  measured (in-run A/B, 4 steps in the fixed order, each against the RRFP steps beside "
        "it): fixed / RRFP step time 1.20x [1.20-1.20] over 4 pairs; RRFP faster in every pair")


AHEAD = ["0F0", "0F1", "0F2", "0B0", "0F3", "0B1", "0B2", "0B3", "0REDUCE_GRAD"]
"""Rank 0 of 1F1B (2 ranks, 4 microbatches) running its forwards ahead: three held at once."""
MIB = 2**20


def one_f_one_b_advice():
    """A ``RunAdvice`` of 5 steps over 1F1B on 2 ranks, and each rank's own order."""
    from rrfp.core.hints import build_hint
    from torchtitan_ext.common.run_advice import RunAdvice

    class Schedule:
        hint = build_hint("1F1B", num_ranks=2, num_stages=2, n_microbatches=4)
        policy = "lookahead"

    own = {rank: [str(node.action) for node in plan.nodes]
           for rank, plan in Schedule.hint.plan.ranks.items()}
    return RunAdvice(Schedule(), source="traces", label=lambda s: f"pp{s.pp_rank}",
                     advise=False, total_steps=5, tensorboard_folder=None), own


def test_the_peak_activations_count_every_step_and_name_those_above_the_fixed_schedule():
    """``hint+2``, metered in the first step only (``meter_every``): rank 0 runs its
    forwards ahead of the hint in steps 2 and 4, holding three microbatches where the
    fixed schedule holds two. The summary's peak activations count every step's realized
    order at the metered bytes per microbatch, above the fixed schedule's on rank 0, naming
    those steps, and say apart what the meter measured and in which step."""
    advice, own = one_f_one_b_advice()
    for step in range(1, 6):
        metered = step == 1
        advice.add(step, [made_up_stats(
            rank, realized_order=AHEAD if rank == 0 and step in (2, 4) else own[rank],
            peak_rank_in_flight=3 if rank == 0 and step in (2, 4) else 2 - rank,
            hint_rank_peak=2 - rank,
            peak_activation_bytes=(2 - rank) * 10 * MIB if metered else None,
            activation_bytes_per_microbatch={rank: 10 * MIB}) for rank in (0, 1)])
    lines = advice.summary(None)
    held = next(line for line in lines if line.startswith("  microbatches held"))
    assert held.endswith("pp0 at most 3 (fixed schedule 2; more in steps 2, 4), pp1 at most "
                         "1 (fixed schedule 1)"), held
    peaks = next(line for line in lines if line.startswith("  peak activations"))
    assert peaks == (
        "  peak activations: pp0 30.0 MiB (fixed schedule 20.0 MiB; more in steps 2, 4), "
        "pp1 10.0 MiB (fixed schedule 10.0 MiB) (in steps 1-5: the microbatches each held, "
        "at the bytes per microbatch metered); metered in step 1: pp0 20.0 MiB, "
        "pp1 10.0 MiB"), peaks


def test_each_step_s_peak_is_compared_with_the_fixed_schedule_s_at_that_step_s_bytes():
    """The bytes per microbatch metered change during the run (10 MiB, then 20 MiB from
    step 3): rank 0's run ahead in step 2 held more than the fixed order at step 2's bytes,
    though less than the fixed order at the later bytes; step 4, in the hint's own order,
    held no more than it."""
    advice, own = one_f_one_b_advice()
    for step in range(1, 6):
        per_microbatch = (10 if step < 3 else 20) * MIB
        advice.add(step, [made_up_stats(
            rank, realized_order=AHEAD if rank == 0 and step == 2 else own[rank],
            peak_rank_in_flight=3 if rank == 0 and step == 2 else 2 - rank,
            hint_rank_peak=2 - rank,
            peak_activation_bytes=(2 - rank) * per_microbatch if step in (1, 3) else None,
            activation_bytes_per_microbatch={rank: per_microbatch}) for rank in (0, 1)])
    peaks = next(line for line in advice.summary(None)
                 if line.startswith("  peak activations"))
    assert peaks.startswith(
        "  peak activations: pp0 40.0 MiB (fixed schedule 40.0 MiB; more in step 2), "
        "pp1 20.0 MiB (fixed schedule 20.0 MiB) (in steps 1-5"), peaks


DECISIONS = [
    "from step 8: buffer_limit='hint+2', the default policy (switch; predicted 1.100x the "
    "fixed schedule)",
    "from step 16: the hint's fixed order (fall back; measured 0.950x by the in-run A/B)"]


def advice_over_steps(tmp_path, tune_within: str, decisions: list[str], caplog,
                      advise: bool = True) -> tuple:
    """``RunAdvice`` on the rank that logs the loss, as ``log_step_stats`` makes it (by
    default the advisor on, a long run: a first verdict would fit its CPU share), over 20 made-up
    steps of two ranks, each eighth in the fixed order, the schedule's decisions taking
    effect at steps 9 and 17 (torchtitan's numbers); then the trainer's close. Returns the
    advice, the summary's lines and the TensorBoard texts."""
    from torch.utils.tensorboard import SummaryWriter

    from rrfp.core.hints import build_hint
    from torchtitan_ext.common.run_advice import RunAdvice

    class Schedule:
        hint = build_hint("1F1B", num_ranks=2, num_stages=2, n_microbatches=4)
        policy = "lookahead"
        tuning_decisions: list[str] = []
        tuning_waiting: str | None = None

    schedule = Schedule()
    torchtitan_writer = SummaryWriter(str(tmp_path / "tb" / "run"))  # torchtitan's, this process
    advice = RunAdvice(schedule, source="traces", label=lambda s: f"pp{s.pp_rank}",
                       advise=advise, total_steps=10**6, tensorboard_folder=str(tmp_path / "tb"),
                       tune_within=tune_within)
    started = []
    for step in range(1, 21):
        schedule.tuning_decisions = decisions[:(step - 1) // 8]
        advice.add(step, [made_up_stats(rank, policy="fixed" if step % 8 == 0 else "lookahead",
                                        step_time=1.0 + step % 8 / 100) for rank in (0, 1)])
        started.append(advice.first_verdict is not None)
    with caplog.at_level("INFO"):
        advice.finish()
    torchtitan_writer.close()
    summary = caplog.text[caplog.text.index("rrfp summary"):].splitlines()
    texts = tensorboard_texts(tmp_path) if (tmp_path / "tb").exists() else {}
    return advice, started, summary, texts


def test_a_self_driving_run_lists_its_decisions_in_place_of_the_verdict(tmp_path, caplog):
    """Self-driving (``rrfp.tune_within``): each decision that took effect is kept once
    (TensorBoard text ``rrfp/self_driving``, however often the schedule lists it) and
    listed in the summary; the advisor, whose run is one setting's, starts no verdict, and
    the summary says why in one line."""
    from torchtitan_ext.common.run_advice import SELF_DRIVING_NO_VERDICT

    advice, started, summary, texts = advice_over_steps(tmp_path, "hint+2", DECISIONS, caplog)
    assert not any(started) and not advice.events
    assert [text.strip() for text in texts["rrfp/self_driving"]] == DECISIONS
    assert summary[1:4] == [
        "  self-driving within tune_within='hint+2', the decisions that took effect (rrfp "
        "counts steps from 0, torchtitan from 1):", f"    {DECISIONS[0]}", f"    {DECISIONS[1]}"]
    assert summary[4].startswith("  measured (in-run A/B, 2 steps in the fixed order")
    assert summary[-1] == f"  {SELF_DRIVING_NO_VERDICT}"
    assert texts["rrfp/summary"][-1].strip().endswith(SELF_DRIVING_NO_VERDICT)


def test_a_self_driving_run_without_decisions_says_so(tmp_path, caplog):
    _, _, summary, _ = advice_over_steps(tmp_path, "busiest", [], caplog)
    assert summary[1] == ("  self-driving within tune_within='busiest': no decision took "
                          "effect; the hint's own setting ran while the tuner measured it")


def test_without_tune_within_the_summary_has_no_self_driving_lines(tmp_path, caplog):
    from torchtitan_ext.common.run_advice import RunAdvice, SELF_DRIVING_NO_VERDICT

    # The advisor stays on (its verdicts: test_main_job_trains_on_cpu_and_logs_rrfp_stats).
    assert RunAdvice(None, source="", label=str, advise=True, total_steps=1,
                     tensorboard_folder=None, tune_within="").advise
    _, _, summary, texts = advice_over_steps(tmp_path, "", [], caplog, advise=False)
    assert not any("self-driving" in line or SELF_DRIVING_NO_VERDICT in line
                   for line in summary), summary
    assert "rrfp/self_driving" not in texts


def test_importing_the_adapter_leaves_logging_alone():
    """Only a training process holds its log lines until the logging rank is known: a
    library import (a notebook, a test) keeps every record flowing to its handlers."""
    import importlib
    import logging

    importlib.import_module("torchtitan_ext.register" if TITAN_0_2
                            else "torchtitan_ext.config_registry")
    assert not logging.getLogger().filters and not logging.getLogger("py.warnings").filters
