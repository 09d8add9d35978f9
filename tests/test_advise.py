"""The advisor (``python -m rrfp.advise``): reading a run's traces, predicting each
setting in the simulator, the verdict, refusing what it cannot read; and the in-run A/B
(``ScheduleRRFP(fixed_every=k)``) it is checked against."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest

from rrfp.advise import ab_speedups, advise, read_run, run_from_trace_events
from rrfp.advise.__main__ import main
from rrfp.advise.predict import Setting
from rrfp.local import run_local_world
from tests import advise_workers
from tests.advise_traces import write_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BYTES = {0: 3 << 20, 1: 2 << 20, 2: 2 << 20, 3: 4 << 20}
"""Bytes per microbatch per stage of the synthetic runs."""


@pytest.fixture(scope="module")
def spiky_run(tmp_path_factory):
    """Six steps of 1F1B, 4 ranks x 8 microbatches, latency spikes, at the hint's memory
    under plain readiness-first (which needs no history: each step replays alone)."""
    folder = tmp_path_factory.mktemp("run") / "traces" / "20250101-120000"
    write_run(folder, "1F1B", workload="spikes", policy="hint", bytes_per_microbatch=BYTES)
    return folder


def row_of(advice, hint: str, buffer_limit: str, policy: str | None = None):
    (row,) = [r for r in advice.rows if r.setting == Setting(hint, buffer_limit, policy)]
    return row


def test_the_run_is_replayed_exactly_and_each_setting_predicted(spiky_run):
    run, note = read_run(str(spiky_run.parent.parent))  # the dump folder
    assert note == ""
    assert (run.hint.name, run.buffer_limit, run.policy) == ("1F1B", "hint", "hint")
    assert [s.number for s in run.steps] == [1, 2, 3, 4, 5] and run.left_out == 1
    assert run.bytes_per_microbatch == BYTES
    advice = advise(run, "the run")
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


def test_the_verdict_names_the_best_within_the_margin_and_the_best_keeping_the_peak(spiky_run):
    run, _ = read_run(str(spiky_run))
    advice = advise(run, "outputs/job")
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
    assert advise(run, "x", margin=0).best(0) is not None


def test_too_few_steps_are_said(tmp_path):
    write_run(tmp_path, "1F1B", steps=3, policy="hint")
    run, _ = read_run(str(tmp_path))
    advice = advise(run, "x")
    assert "only 2 measured step(s): too few to predict" in advice.verdict()
    assert any("too few to predict from" in w for w in advice.warnings())


def test_the_command_prints_the_table_and_the_verdict_and_draws_the_charts(spiky_run, tmp_path,
                                                                            capsys):
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
    done = subprocess.run([sys.executable, "-m", "rrfp.advise", "-", "--json", "--source", "job"],
                          input=json.dumps(events), capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT}, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["verdict"] == advise(
        run_from_trace_events(events, "job"), "job").verdict()


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


def test_a_bad_run_stops_the_command_without_a_traceback(tmp_path):
    write_run(tmp_path, "1F1B", steps=4, policy="hint")
    (tmp_path / "step2.json").write_text('{"traceEvents": [{"ph": "M"')
    done = subprocess.run([sys.executable, "-m", "rrfp.advise", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 2
    assert done.stdout == "" and "Traceback" not in done.stderr
    assert done.stderr.startswith(f"rrfp.advise: {tmp_path / 'step2.json'}: not a whole JSON trace")


def test_the_ab_pairs_each_fixed_step_with_its_neighbours():
    steps = [(False, 1.0), (True, 1.5), (False, 2.0), (False, 9.0), (True, 3.0)]
    assert ab_speedups(steps) == [1.5 / 1.5, 3.0 / 9.0]


def test_in_run_ab_measures_what_the_advisor_predicts_and_stays_bitwise():
    """Every second step in the fixed order: those steps follow the hint exactly, the
    others overtake the slow microbatch; every step's gradients and losses are torch's
    GPipe's; the measured A/B and the advisor's prediction from the same steps agree."""
    ranks = run_local_world(2, advise_workers.in_run_ab, 6, 2, timeout=300)
    assert all(r["bitwise"] for r in ranks)
    run = run_from_trace_events(ranks[0]["traces"], "in-run A/B")
    assert [s.fixed_order for s in run.steps] == [True, False, True, False, True]
    for step in run.steps:
        for meta in step.ranks.values():
            assert (meta["launch_depth"] is None) == step.fixed_order
        if step.fixed_order:
            assert all(m["out_of_hint_order"] == 0 for m in step.ranks.values())
    assert sum(m["out_of_hint_order"] for s in run.own_steps for m in s.ranks.values()) > 0
    advice = advise(run, "x")
    measured = statistics.median(advice.measured_ab)
    assert measured > 1.2  # about 1.34 (1.58 s against 1.18 s)
    assert abs(advice.own_speedup - measured) < 0.1, (advice.own_speedup, advice.measured_ab)
    assert f"measured {measured:.2f}x by the in-run A/B" in advice.verdict()
