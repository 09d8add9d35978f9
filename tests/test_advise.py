"""The advisor (``python -m rrfp.advise``): reading a run's traces, predicting each
setting in the simulator, the verdict, refusing what it cannot read; and the in-run A/B
(``ScheduleRRFP(fixed_every=k)``) it is checked against."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import statistics
import subprocess
import sys

import pytest
import torch.distributed as dist

from rrfp import Settings
from rrfp.advise import ab_speedups, advise, read_run, run_from_trace_events
from rrfp.advise.__main__ import main
from rrfp.advise.predict import predict, replay, Setting
from rrfp.advise.report import size
from rrfp.core.hints import build_hint, Hint
from rrfp.core.limits import resolve_buffer_limits
from rrfp.core.policy import default_policy
from rrfp.core.sizes import MicrobatchSize
from rrfp.core.stats import StepStats, write_chrome_trace
from rrfp.sim.engine import simulate
from rrfp.sim.replay import timing_from_trace
from rrfp.sim.workloads import make_timing, Timing
from rrfp.testing.chains import (bitwise_equal, build_stages, loss_fn, make_batch, make_chain,
                                 run_steps, torch_schedule)
from rrfp.testing.emulation import EmulatedDevice, EmulatedDeviceTime
from rrfp.testing.study import Study, StudySchedule
from rrfp.testing.worlds import run_local_world

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BYTES = {0: 3 << 20, 1: 2 << 20, 2: 2 << 20, 3: 4 << 20}
"""Bytes per microbatch per stage of the synthetic runs."""



def simulated_step_stats(hint: Hint, timing: Timing, step: int, *, buffer_limit: str = "hint",
                         policy: str | None = None, bytes_per_microbatch=None,
                         start_unix: float = 1000.0, sizes=None) -> list[StepStats]:
    """Every rank's ``StepStats`` of one step of ``hint`` simulated on ``timing``
    (seconds), as the runtime would report it; ``sizes``: the step's microbatch sizes,
    told its policy."""
    limits = resolve_buffer_limits(buffer_limit, hint)
    policy = policy or default_policy(hint, limits)
    result = simulate(hint, timing.duration, latency=timing.latency, policy=policy,
                      limits=limits, launch_depth=1)
    ends = {(s.stage, s.kind, s.microbatch): s.end
            for spans in result.spans.values() for s in spans}
    sends: dict[int, list] = {r: [] for r in range(hint.num_ranks)}
    arrivals: dict[int, list] = {r: [] for r in range(hint.num_ranks)}
    for rank, plan in hint.plan.ranks.items():
        for node in plan.nodes:
            for edge in node.sends:
                sent = ends[(node.stage, node.action.computation_type.value, node.microbatch)]
                sends[rank].append((edge.src, edge.dst, node.microbatch, sent))
                arrivals[hint.stage_to_rank[edge.dst]].append(
                    (edge.src, edge.dst, node.microbatch, sent + timing.latency(edge, node.microbatch)))
    stats = []
    for rank in range(hint.num_ranks):
        local = hint.stages_on(rank)
        stats.append(StepStats(
            pp_rank=rank, global_rank=rank, hint=hint.name, policy=policy,
            device="HostDevice", launch_depth=2, buffer_limits=dict(limits.per_stage),
            rank_buffer_limit=limits.per_rank[rank],
            hint_peak_in_flight={s: hint.plan.stage_peaks[s] for s in local},
            hint_rank_peak=hint.plan.rank_peaks()[rank],
            hint_busiest_rank_peak=max(hint.plan.rank_peaks().values()),
            peak_in_flight={s: result.peak_in_flight[s] for s in local},
            peak_rank_in_flight=result.rank_peaks[rank], peak_activation_bytes=None,
            receive_buffer_bytes=0, messages_sent=len(sends[rank]), bytes_sent=0,
            backpressure_entries={}, out_of_hint_order=result.out_of_order[rank],
            hint_order=[str(n.action) for n in hint.plan.ranks[rank].nodes],
            realized_order=[str(a) for a in result.realized[rank]],
            step_time=result.makespan, device_busy_time=result.busy[rank], wait_time=0.0,
            decision_time=0.0, launch_time=0.0, start_unix=start_unix + 10 * step,
            activation_bytes_per_microbatch=(None if bytes_per_microbatch is None else
                                             {s: bytes_per_microbatch[s] for s in local}),
            step=step, buffer_limit=buffer_limit, num_stages=hint.num_stages,
            n_microbatches=hint.n_microbatches, placement=hint.layout,
            sizes=sizes, sizes_used=sizes is not None,
            spans=result.spans[rank], sends=sends[rank], arrivals=arrivals[rank]))
    return stats


def write_run(folder, hint_name: str = "1F1B", *, ranks: int = 4, stages_per_rank: int = 1,
              microbatches: int = 8, workload: str = "spikes", steps: int = 6,
              unit_s: float = 0.01, **kwargs) -> Hint:
    """A run folder of ``steps`` step traces (step1.json ...), each step drawn from
    ``workload`` (its time unit ``unit_s`` seconds); returns the hint."""
    hint = build_hint(hint_name, num_ranks=ranks, num_stages=ranks * stages_per_rank,
                      n_microbatches=microbatches)
    os.makedirs(folder, exist_ok=True)
    for step in range(steps):
        drawn = make_timing(workload, hint.num_stages, microbatches, seed=step)
        timing = Timing(*[[[v * unit_s for v in row] for row in table] for table in (
            drawn.forward, drawn.backward_input, drawn.backward_weight,
            drawn.activation_latency, drawn.gradient_latency)])
        write_chrome_trace(simulated_step_stats(hint, timing, step, **kwargs),
                           os.path.join(folder, f"step{step + 1}.json"))
    return hint


@pytest.fixture(scope="module")
def spiky_run(tmp_path_factory):
    """Six steps of 1F1B, 4 ranks x 8 microbatches, latency spikes, at the hint's memory
    under plain readiness-first (which needs no history: each step replays alone)."""
    folder = tmp_path_factory.mktemp("run") / "traces" / "20250101-120000"
    write_run(folder, "1F1B", workload="spikes", policy="hint", bytes_per_microbatch=BYTES)
    return folder


@pytest.fixture(scope="module")
def spiky_advice(spiky_run):
    """The advice on ``spiky_run`` (computed once: every setting replays every step)."""
    return advise(read_run(str(spiky_run))[0], "outputs/job")


def row_of(advice, hint: str, buffer_limit: str, policy: str | None = None):
    (row,) = [r for r in advice.rows if r.setting == Setting(hint, buffer_limit, policy)]
    return row


@pytest.mark.simulator
def test_the_run_is_replayed_exactly_and_each_setting_predicted(spiky_run, spiky_advice):
    run, note = read_run(str(spiky_run.parent.parent))  # the dump folder
    assert note == ""
    assert (run.hint.name, run.buffer_limit, run.policy) == ("1F1B", "hint", "hint")
    assert [s.number for s in run.steps] == [1, 2, 3, 4, 5] and run.left_out == 1
    assert run.bytes_per_microbatch == BYTES
    assert [s.step_time for s in spiky_advice.run.steps] == [s.step_time for s in run.steps]
    advice = spiky_advice
    # The synthetic steps are simulated ones: their replay at the run's own setting
    # reproduces each step's length.
    assert advice.baseline.own == pytest.approx([s.step_time for s in run.steps], rel=1e-9)
    plus2 = row_of(advice, "1F1B", "hint+2")
    assert plus2.policy == "critical"
    assert plus2.speedup > 1.03 > advice.own_speedup
    assert plus2.step_time == pytest.approx(
        statistics.median(s.step_time / p.makespan * r.makespan for s, p, r in zip(
            run.steps, advice.baseline.own_results, plus2.results)))
    # One stage per rank: two more microbatches of that stage's bytes, on every rank.
    assert plus2.extra_bytes == {r: 2 * BYTES[r] for r in range(4)}
    busiest = row_of(advice, "1F1B", "busiest")
    assert busiest.job_peak_extra == 0
    assert max(busiest.allowed_bytes.values()) == max(busiest.fixed_bytes.values())
    assert advice.rows == sorted(advice.rows, key=lambda r: -r.speedup)


@pytest.mark.simulator
def test_the_verdict_names_the_best_within_the_margin_and_the_best_keeping_the_peak(spiky_advice):
    advice = spiky_advice
    best, flat = advice.best(advice.margin * advice.fixed_peak), advice.best(0)
    assert best.job_peak_extra <= advice.margin * advice.fixed_peak
    assert best.speedup >= max(r.speedup for r in advice.rows if not r.even_split
                               and r.job_peak_extra <= advice.margin * advice.fixed_peak)
    assert flat.job_peak_extra <= 0
    verdict = advice.verdict()
    assert verdict.startswith(f"rrfp: timing variability {advice.variability:.0%}; "
                              f"{best.setting.describe('1F1B')} (+")
    assert f"predicts {best.speedup:.2f}x; {flat.setting.describe('1F1B')} (no peak change)" in verdict
    assert verdict.endswith(f"this run (buffer_limit='hint', policy hint) "
                            f"{advice.own_speedup:.2f}x; python -m rrfp.advise outputs/job")
    # With no margin the best is the one keeping the peak.
    assert dataclasses.replace(advice, margin=0).best(0) is not None


@pytest.mark.simulator
def test_too_few_steps_are_said(tmp_path):
    write_run(tmp_path, "1F1B", steps=3, policy="hint")
    run, _ = read_run(str(tmp_path))
    advice = advise(run, "x")
    # Nothing predicted from them is said beside it: no variability, no speedup.
    assert advice.verdict() == ("rrfp: only 2 measured steps after the first: too few to "
                                "predict (3 or more); python -m rrfp.advise x")
    assert any("too few to predict from" in w for w in advice.warnings())


@pytest.mark.simulator
def test_a_verdict_that_names_no_setting_says_why_the_tables_top_row_is_not_it(spiky_advice):
    top = next(r for r in spiky_advice.rows if not r.even_split)
    assert top.speedup >= 1.01 and top.job_peak_extra > 0
    # No margin: the top row grows the peak beyond it, and the only rows kept are below 1.01x.
    advice = dataclasses.replace(spiky_advice, margin=0,
                                 rows=[top, *[r for r in spiky_advice.rows
                                              if r.job_peak_extra <= 0 and r.speedup < 1.01]])
    assert (f"no setting within +0% of the activation peak predicts 1.01x or more (the "
            f"table's top row, {top.speedup:.2f}x, is beyond the margin: "
            f"+{size(top.job_peak_extra)} peak, rank ") in advice.verdict()
    guess = dataclasses.replace(advice, rows=[dataclasses.replace(top, even_split=True),
                                              *advice.rows[1:]])
    assert f"{top.speedup:.2f}x, is a guess from halved backwards, marked ~)" in guess.verdict()


@pytest.mark.simulator
def test_the_command_prints_the_table_and_the_verdict_and_draws_the_charts(spiky_run, tmp_path,
                                                                            capsys, monkeypatch):
    assert main([str(spiky_run), "--out", str(tmp_path), "--rows", "5"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"run: {spiky_run}: 5 training steps")
    start = out.index("") + 1
    table = out[start:out.index("", start)]
    assert table[0].split()[:2] == ["setting", "policy"]
    assert len([line for line in table if "buffer_limit=" in line and "MiB" in line]) == 5
    assert table[-1].startswith("(") and "more settings" in table[-1]
    assert out[-3].startswith("rrfp: timing variability")
    for chart in ("advise_settings.png", "advise_step.png"):
        assert (tmp_path / chart).stat().st_size > 10_000
    # The same advice as JSON, from the steps' events on stdin (what a job sends).
    events = [json.loads(p.read_text())["traceEvents"]
              for p in sorted(spiky_run.glob("step*.json"))]
    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps(events)))
    assert main(["-", "--json", "--source", str(spiky_run)]) == 0
    assert json.loads(capsys.readouterr().out)["verdict"] == out[-3]


def rewrite_steps(folder, step_files, change):
    for name in step_files:
        path = folder / name
        trace = json.loads(path.read_text())
        change(trace)
        path.write_text(json.dumps(trace))


BAD_RUNS = {
    "missing": ("no such file or folder", {}),
    "empty": ("holds no step traces (step<N>.json): run the job with traces on", {}),
    "truncated": ("step4.json: not a whole JSON trace", {}),
    "another hint": ("step5.json is a step of hint GPipe (loop placement, 4 stages) with 8 "
                     "microbatches at buffer_limit='hint', ", dict(hint_name="GPipe")),
    "other microbatches": ("step5.json is a step of hint 1F1B (loop placement, 4 stages) with "
                           "16 microbatches", dict(microbatches=16)),
    "a rank missing": ("the trace holds pipeline ranks [0, 1, 2] of [0, 1, 2, 3]", {}),
    "not rrfp": ("no 'rrfp_step' metadata in the trace", {}),
    "an older rrfp": ("step2.json: its step metadata lacks ['buffer_limit']", {}),
}


@pytest.mark.simulator
@pytest.mark.parametrize("case", list(BAD_RUNS))
def test_a_run_it_cannot_use_is_said_in_one_line(case, tmp_path, capsys):
    folder = tmp_path / "run"
    write_run(folder, "1F1B", steps=5, policy="hint")
    expected, other_run = BAD_RUNS[case]
    if other_run:  # a step of another job in the folder
        write_run(tmp_path / "other", **{"hint_name": "1F1B", **other_run}, steps=5,
                  policy="hint")
        os.replace(tmp_path / "other" / "step5.json", folder / "step5.json")
    elif case == "missing":
        folder = tmp_path / "nowhere"
    elif case == "empty":
        folder = tmp_path / "empty"
        folder.mkdir()
        (folder / "notes.txt").write_text("no traces here")
    elif case == "truncated":
        text = (folder / "step4.json").read_text()
        (folder / "step4.json").write_text(text[:len(text) // 2])
    elif case == "a rank missing":
        rewrite_steps(folder, ["step3.json"], lambda t: t.update(traceEvents=[
            e for e in t["traceEvents"] if e.get("pid") != 3]))
    elif case == "not rrfp":
        rewrite_steps(folder, ["step2.json"], lambda t: t.update(traceEvents=[
            e for e in t["traceEvents"] if e.get("name") != "rrfp_step"]))
    elif case == "an older rrfp":
        rewrite_steps(folder, ["step2.json"], lambda t: [
            e["args"].pop("buffer_limit") for e in t["traceEvents"] if e.get("name") == "rrfp_step"])
    assert main([str(folder), "--no-plots"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and captured.err.startswith("rrfp.advise: "), captured.err
    assert expected in captured.err


@pytest.mark.simulator
def test_the_settings_chart_shows_its_whole_axis_label_and_a_legend_for_the_hatching(
        spiky_advice):
    from rrfp.advise.plots import settings_figure

    figure = settings_figure(spiky_advice)
    figure.canvas.draw()
    label = figure.axes[0].xaxis.label.get_window_extent()
    inside = figure.bbox
    assert inside.x0 <= label.x0 and label.x1 <= inside.x1 and inside.y0 <= label.y0
    legend = [t.get_text() for t in figure.axes[0].get_legend().get_texts()]
    assert "~ a guess: backwards halved" in legend and "grows the job's peak" in legend


def test_help_prints_every_option(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["--help"])
    assert exit.value.code == 0
    assert "(default 25%)" in capsys.readouterr().out


@pytest.mark.simulator
def test_a_bad_run_stops_the_command_without_a_traceback(tmp_path):
    write_run(tmp_path, "1F1B", steps=4, policy="hint")
    (tmp_path / "step2.json").write_text('{"traceEvents": [{"ph": "M"')
    done = subprocess.run([sys.executable, "-m", "rrfp.advise", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 2
    assert done.stdout == "" and "Traceback" not in done.stderr
    assert done.stderr.startswith(f"rrfp.advise: {tmp_path / 'step2.json'}: not a whole JSON trace")


@pytest.mark.simulator
def test_a_trainer_gives_the_steps_on_stdin(tmp_path, monkeypatch, capsys):
    write_run(tmp_path, "1F1B", steps=5, policy="hint")
    steps = [json.loads((tmp_path / f"step{n}.json").read_text())["traceEvents"]
             for n in range(2, 6)]
    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps(steps)))
    assert main(["-", "--json", "--source", "the run"]) == 0
    assert json.loads(capsys.readouterr().out)["verdict"].startswith("rrfp: ")
    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps(steps)[:-2]))
    assert main(["-", "--json"]) == 2
    assert capsys.readouterr().err.startswith(
        "rrfp.advise: stdin: not a whole JSON list of steps' trace events (")


SIZES = (MicrobatchSize(tokens=4, attention=16), MicrobatchSize(tokens=1, attention=1), None,
         MicrobatchSize(tokens=10, attention=100, images=2))
"""A step's microbatch sizes (one unknown) that tell microbatches apart."""


def test_a_trace_with_sizes_replays_with_them_and_one_without_has_none(tmp_path):
    hint = write_run(tmp_path / "sized", ranks=2, microbatches=4, steps=3, sizes=list(SIZES))
    run, _ = read_run(str(tmp_path / "sized"))
    assert all(step.timing.sizes == SIZES and step.sizes_used for step in run.steps)
    run.steps[0].timing.save(tmp_path / "timings.json")  # the replay file keeps them
    assert Timing.load(tmp_path / "timings.json").sizes == SIZES
    # Traces without sizes read as before.
    write_run(tmp_path / "plain", ranks=2, microbatches=4, steps=3)
    plain, _ = read_run(str(tmp_path / "plain"))
    assert all(step.timing.sizes is None and not step.sizes_used for step in plain.steps)
    # Steps of different sizes in one trace (their timings averaged) have none.
    timing = plain.steps[0].timing
    events = [e for step, sizes in enumerate((SIZES, SIZES[::-1]))
              for stats in simulated_step_stats(hint, timing, step, sizes=list(sizes))
              for e in stats.chrome_trace_events()]
    assert timing_from_trace({"traceEvents": events}).sizes is None
    assert timing_from_trace({"traceEvents": events[:len(events) // 2]}).sizes == SIZES


def test_the_replay_tells_a_settings_policy_the_sizes_unless_it_says_not(tmp_path):
    write_run(tmp_path, ranks=2, microbatches=4, steps=3, sizes=list(SIZES))
    run, _ = read_run(str(tmp_path))
    baseline = replay(run)
    # Each simulated rank fits durations against size only where its policy was told them.
    assert baseline.own_results[-1].histories[0].models.fits  # as the run's steps were
    told = Setting("1F1B", "hint+1", "critical")
    not_told = dataclasses.replace(told, use_sizes=False)
    assert predict(run, told, baseline).results[-1].histories[0].models.fits
    assert not predict(run, not_told, baseline).results[-1].histories[0].models.fits
    assert not_told.describe("1F1B") == ("buffer_limit='hint+1', policy='critical', "
                                         "sizes not used")


@pytest.mark.simulator
def test_the_ab_pairs_each_fixed_step_with_its_neighbours():
    steps = [(False, 1.0), (True, 1.5), (False, 2.0), (False, 9.0), (True, 3.0)]
    assert ab_speedups(steps) == [1.5 / 1.5, 3.0 / 9.0]



def in_run_ab(rank: int, world_size: int, steps: int, fixed_every: int) -> dict:
    """GPipe on 2 ranks, emulated device time with one slow forward (stage 0, microbatch
    4: 0.6 s against 0.02 s; the last stage's backwards 0.1 s): ``steps`` training steps of
    ScheduleRRFP (plain readiness-first at the hint's memory) with ``fixed_every``, and
    the same steps under torch's GPipe. Returns every rank's trace events per step, and
    whether gradients and losses were bitwise torch's at every step."""
    n_microbatches = 8
    chain = make_chain(world_size)
    x, y = make_batch(n_microbatches)

    def device_time(stage: int, block):
        backward = 0.1 if stage == world_size - 1 else 0.02
        return EmulatedDeviceTime(block, n_microbatches,
                                  lambda mb: 0.6 if (stage == 0 and mb == 4) else 0.02,
                                  lambda mb: backward)

    stages, blocks = build_stages(chain, rank, world_size, "loop", wrap=device_time)
    schedule = StudySchedule(stages, n_microbatches, loss_fn=loss_fn, hint="GPipe",
                             settings=Settings(policy="hint", launch_depth=1,
                                               fixed_every=fixed_every),
                             study=Study(device=EmulatedDevice()))
    traces = []
    history = []
    for _ in range(steps):
        for stage in stages:
            stage.submod.reset()
        dist.barrier()
        history += run_steps(schedule, stages, blocks, x, y, steps=1)
        gathered: list = [None] * world_size
        dist.all_gather_object(gathered, schedule.last_step_stats)
        traces.append([e for stats in gathered for e in stats.chrome_trace_events()])
    schedule.close()
    fixed_stages, fixed_blocks = build_stages(chain, rank, world_size, "loop")
    reference = run_steps(torch_schedule("GPipe", fixed_stages, n_microbatches), fixed_stages,
                          fixed_blocks, x, y, steps=steps)
    return {"traces": traces, "bitwise": bitwise_equal(history, reference)}


def test_in_run_ab_measures_what_the_advisor_predicts_and_stays_bitwise():
    """Every second step in the fixed order: those steps follow the hint exactly, the
    others overtake the slow microbatch; every step's gradients and losses are torch's
    GPipe's; the measured A/B and the advisor's prediction from the same steps agree."""
    # Ten steps: five pairs, so that one RRFP step slowed by the machine (it moves the two
    # pairs beside it; at load 8, 0.85x once with three pairs) leaves the median standing.
    ranks = run_local_world(2, in_run_ab, 10, 2, timeout=300)
    assert all(r["bitwise"] for r in ranks)
    run = run_from_trace_events(ranks[0]["traces"], "in-run A/B")
    assert [s.fixed_order for s in run.steps] == [True, False] * 4 + [True]
    for step in run.steps:
        for meta in step.ranks.values():
            assert (meta["launch_depth"] is None) == step.fixed_order
        if step.fixed_order:
            assert all(m["out_of_hint_order"] == 0 for m in step.ranks.values())
    assert sum(m["out_of_hint_order"] for s in run.own_steps for m in s.ranks.values()) > 0
    advice = advise(run, "x")
    measured = statistics.median(advice.measured_ab)
    assert measured > 1.2
    # Each pair's ratio moves with the machine's load (1.11-1.34 at load 5-7): the
    # prediction must fall within the measured pairs' range, widened by 0.1.
    low, high = min(advice.measured_ab) - 0.1, max(advice.measured_ab) + 0.1
    assert low < advice.own_speedup < high, (advice.own_speedup, advice.measured_ab)
    assert f"measured {measured:.2f}x by the in-run A/B" in advice.verdict()
