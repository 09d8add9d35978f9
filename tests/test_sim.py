"""Simulator regression checks of the arbiter against closed forms and the fixed order."""

from __future__ import annotations

import dataclasses
import re

import pytest

from rrfp.core.actions import F, REDUCE_GRAD
from rrfp.core.hints import build_hint, HINT_NAMES
from rrfp.core.limits import resolve_buffer_limits
from rrfp.sim.engine import simulate
from rrfp.testing.stats import made_up_stats
from tests.test_arbiter import FITTING

# The simulator depends on torch only through the hints (tested on every torch in
# tests/test_hints.py): .ci/run runs these tests on the first torch only.
pytestmark = pytest.mark.simulator


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


def test_lower_bounds_hold_and_are_tight_where_they_should_be():
    from rrfp.sim.engine import lower_bounds
    from rrfp.sim.workloads import make_timing, WORKLOADS

    hint = build_hint("1F1B", num_ranks=4, num_stages=4, n_microbatches=8)
    uniform = make_timing("uniform", 4, 8, 0)
    bounds = lower_bounds(hint, uniform.duration, uniform.latency)
    assert bounds.busiest_rank == simulate(hint, uniform.duration, policy="fixed").makespan == 33
    assert bounds.critical_path == 12  # 4 forwards + 4 backwards of 2
    for workload in WORKLOADS:
        for seed in range(3):
            t = make_timing(workload, 4, 8, seed)
            bound = lower_bounds(hint, t.duration, t.latency).tighter
            for limit in ("hint", 32):
                result = simulate(hint, t.duration, latency=t.latency, policy="hint",
                                  limits=resolve_buffer_limits(limit, hint))
                assert result.makespan >= bound - 1e-9


def test_workloads_are_seeded_and_shaped():
    from rrfp.sim.workloads import make_timing, WORKLOADS

    for workload in WORKLOADS:
        a, b = make_timing(workload, 4, 6, 7), make_timing(workload, 4, 6, 7)
        assert a == b
        if workload != "uniform":
            assert a != make_timing(workload, 4, 6, 8)
        assert a.num_stages == 4 and a.n_microbatches == 6
    with pytest.raises(ValueError, match="unknown workload"):
        make_timing("no-such-workload", 4, 6, 0)


def test_widened_workloads_have_the_shape_they_name():
    import statistics
    from rrfp.sim.workloads import make_timing

    S, M = 8, 64
    encoder = make_timing("encoder", S, M, 0)
    means = [statistics.mean(row) for row in encoder.forward]
    assert 2.0 <= means[0] / statistics.mean(means[1:]) <= 3.0  # an encoder stage 2-3x
    # Correlated: a microbatch slow on one stage is slow on every stage.
    corr = make_timing("correlated", S, M, 0)
    assert statistics.correlation(corr.forward[0], corr.forward[S - 1]) > 0.8
    jitter = make_timing("jitter", S, M, 0)
    assert abs(statistics.correlation(jitter.forward[0], jitter.forward[S - 1])) < 0.5
    # A persistent straggler: one stage slower on every microbatch, the others not.
    slow = make_timing("slowrank", S, M, 0)
    slowest = max(range(S), key=lambda s: statistics.mean(slow.forward[s]))
    for half in (slice(0, M // 2), slice(M // 2, M)):
        others = [statistics.mean(slow.forward[s][half]) for s in range(S) if s != slowest]
        assert statistics.mean(slow.forward[slowest][half]) > 1.2 * max(others)
    # Bursty: slow transfers come in runs on a link (the next transfer is more likely slow
    # after a slow one than overall), the mean latency stays about latency_mean.
    after_slow, slow_count, total = 0, 0, 0
    for seed in range(5):
        rows = make_timing("bursty", S, M, seed).activation_latency
        flat = [x for row in rows for x in row]
        cut = 3 * statistics.median(flat)
        for row in rows:
            for a, b in zip(row, row[1:]):
                total += 1
                if a > cut:
                    slow_count += 1
                    after_slow += b > cut
    assert slow_count and after_slow / slow_count > 3 * slow_count / total


def test_replay_file_round_trip_and_trace_conversion(tmp_path):
    from rrfp.sim.replay import timing_from_trace
    from rrfp.sim.workloads import make_timing, Timing
    from rrfp.core.stats import merge_chrome_traces, Span, write_chrome_trace

    timing = make_timing("latency", 2, 3, 0)
    timing.save(tmp_path / "t.json")
    assert Timing.load(tmp_path / "t.json") == timing
    (tmp_path / "bad.json").write_text('{"forward": [[1.0]]}')
    with pytest.raises(ValueError, match="lacks"):
        Timing.load(tmp_path / "bad.json")

    def stats(rank, spans, sends, arrivals):
        return made_up_stats(rank, device_busy_time=0.6, start_unix=100.0, spans=spans,
                             arrivals=arrivals, sends=sends)
    ranks = [
        stats(0, [Span("0F0", 0.0, 0.2, 0, "F", 0), Span("0B0", 0.5, 0.9, 0, "B", 0)],
              sends=[(0, 1, 0, 0.2)], arrivals=[(1, 0, 0, 0.45)]),
        stats(1, [Span("1F0", 0.25, 0.3, 1, "F", 0), Span("1B0", 0.3, 0.4, 1, "B", 0)],
              sends=[(1, 0, 0, 0.4)], arrivals=[(0, 1, 0, 0.25)]),
    ]
    # Per-rank files merged into one trace read the same as a trace written at once.
    for s in ranks:
        s.write_chrome_trace(tmp_path / f"rank{s.pp_rank}.json")
    merge_chrome_traces([tmp_path / "rank0.json", tmp_path / "rank1.json"], tmp_path / "merged.json")
    write_chrome_trace(ranks, tmp_path / "trace.json")
    import json
    assert json.loads((tmp_path / "merged.json").read_text()) == json.loads((tmp_path / "trace.json").read_text())
    timing = timing_from_trace(json.loads((tmp_path / "trace.json").read_text()))
    from rrfp.sim.replay import main as replay_main

    replay_main([str(tmp_path / "trace.json"), "-o", str(tmp_path / "outputs" / "timings.json")])
    assert Timing.load(tmp_path / "outputs" / "timings.json") == timing
    assert [row[0] for row in timing.forward] == pytest.approx([0.2, 0.05])
    assert [row[0] for row in timing.backward_input] == pytest.approx([0.2, 0.05])  # B / 2
    assert timing.activation_latency[0][0] == pytest.approx(0.05)
    assert timing.gradient_latency[1][0] == pytest.approx(0.05)


def test_resample_draws_whole_measured_cells_and_real_latencies(tmp_path):
    from rrfp.sim.replay import main as replay_main, resample
    from rrfp.sim.workloads import make_timing, Timing
    from rrfp.core.stats import Span, write_chrome_trace

    def measured_step(seed):  # jittered compute and random link latencies
        compute, links = make_timing("jitter", 2, 4, seed), make_timing("latency", 2, 4, seed)
        return dataclasses.replace(compute, activation_latency=links.activation_latency,
                                   gradient_latency=links.gradient_latency)

    measured = [measured_step(seed) for seed in (0, 1)]
    cells = {(t.forward[s][m], t.backward_input[s][m], t.backward_weight[s][m])
             for t in measured for s in range(2) for m in range(4)}
    activations = {v for t in measured for v in t.activation_latency[0]}
    gradients = {v for t in measured for v in t.gradient_latency[1]}
    big = resample(measured, 8, 32, seed=3)
    assert (big.num_stages, big.n_microbatches) == (8, 32)
    drawn = {(big.forward[s][m], big.backward_input[s][m], big.backward_weight[s][m])
             for s in range(8) for m in range(32)}
    assert drawn <= cells and len(drawn) > 8  # F, I and W of one cell stay together
    # The rows that carry no message (last stage's activation, first stage's gradient) are
    # not sampled: every drawn latency is one a message took.
    assert {v for row in big.activation_latency for v in row} <= activations
    assert {v for row in big.gradient_latency for v in row} <= gradients
    assert resample(measured, 8, 32, seed=3) == big != resample(measured, 8, 32, seed=4)
    with pytest.raises(ValueError, match="at least one"):
        resample([], 8, 32, seed=0)

    trace = tmp_path / "trace.json"
    write_chrome_trace([made_up_stats(0, device_busy_time=0.2, start_unix=100.0, arrivals=[],
                                      sends=[], spans=[Span("0F0", 0.0, 0.2, 0, "F", 0)])], trace)
    replay_main([str(trace), "-o", str(tmp_path / "big.json"), "--resample", "4x6", "--seed", "1"])
    big = Timing.load(tmp_path / "big.json")
    assert (big.num_stages, big.n_microbatches) == (4, 6)
    assert [v for row in big.forward for v in row] == pytest.approx([0.2] * 24)
    with pytest.raises(SystemExit):
        replay_main([str(trace), "--resample", "4by6"])



def test_trace_links_each_send_to_its_receive_with_a_flow(tmp_path):
    """Each message is a slice on its rank's message track at each end, and a flow arrow
    runs from the send's slice to the receive's (the flow event inside each slice, so
    Perfetto binds it there), in one trace of the ranks' steps."""
    import json

    from rrfp.core.stats import MESSAGE_TRACK, Span, write_chrome_trace

    # Two steps of two ranks, in one file: each step's messages have flows of their own.
    messages = {0: dict(sends=[(0, 1, 0, 0.2), (0, 1, 1, 0.3)], arrivals=[(1, 0, 0, 0.65)]),
                1: dict(sends=[(1, 0, 0, 0.6)], arrivals=[(0, 1, 0, 0.25), (0, 1, 1, 0.4)])}
    ranks = [made_up_stats(rank, start_unix=100.0 + 10 * step, step=step,
                           spans=[Span("x", 0.0, 1.0)], **messages[rank])
             for step in range(2) for rank in (0, 1)]
    write_chrome_trace(ranks, tmp_path / "trace.json")
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    slices = [e for e in events if e["ph"] == "X" and e.get("cat") in ("send", "recv")]
    starts = sorted((e for e in events if e["ph"] == "s"), key=lambda e: e["ts"])
    ends = sorted((e for e in events if e["ph"] == "f"), key=lambda e: e["ts"])
    assert len(slices) == 12 and len(starts) == len(ends) == 6
    for start in starts:
        (end,) = [e for e in ends if e["id"] == start["id"]]
        assert 0 < end["ts"] - start["ts"] < 1e6  # the same step's receive
        assert end["bp"] == "e" and (end["name"], end["cat"]) == (start["name"], start["cat"])
        for flow, cat in ((start, "send"), (end, "recv")):
            (enclosing,) = [e for e in slices if e["cat"] == cat and e["pid"] == flow["pid"]
                            and e["ts"] < flow["ts"] < e["ts"] + e["dur"]]
            assert enclosing["tid"] == flow["tid"] == MESSAGE_TRACK
            assert enclosing["name"] == f"{cat} {flow['name']}"
        src, dst = map(int, start["name"].split()[0].split("->"))
        assert (start["pid"], end["pid"]) == (src, dst)  # stage s is on rank s here
    assert len({e["id"] for e in starts}) == 6


def test_cli_prints_a_table_and_draws_charts(tmp_path, capsys, monkeypatch):
    import rrfp.sim.plot
    from rrfp.sim.__main__ import main
    from rrfp.sim.plot import kinds_shown

    drawn = {}
    plot_timelines = rrfp.sim.plot.plot_timelines

    def recording(results, path, **kwargs):
        drawn.update(labels=list(results), kinds=kinds_shown(results), **kwargs)
        plot_timelines(results, path, **kwargs)

    monkeypatch.setattr(rrfp.sim.plot, "plot_timelines", recording)

    charts = tmp_path / "outputs" / "charts"  # made by the CLI
    main(["--pp", "4", "--microbatches", "8", "--hint", "BFW", "--workload", "latency",
          "--limit", "32", "--seeds", "2", "--plot", str(charts / "t.png"),
          "--sweep", str(charts / "s.png")])
    out = capsys.readouterr().out
    assert "speedup mean" in out and "policy BFW" in out and "limit       32" in out
    assert (charts / "t.png").stat().st_size > 10_000
    assert (charts / "s.png").stat().st_size > 10_000
    # A rule has no fixed form: the fixed panel names its reference; a split backward
    # shows I and W, never B.
    assert drawn["labels"] == ["fixed InterleavedZeroBubble (the BFW rule's reference)",
                               "RRFP (BFW, limit 32)"]
    assert drawn["kinds"] == ["F", "I", "W"]
    assert drawn["time_unit"] == "forward = 1"


def test_cli_replays_measured_timings(tmp_path, capsys):
    from rrfp.sim.__main__ import main
    from rrfp.sim.workloads import make_timing

    from rrfp.sim.study import compare

    timing = make_timing("latency", 2, 8, 0)
    timing.save(tmp_path / "timings.json")
    # The pipeline's shape comes from the timings file.
    main(["--replay", str(tmp_path / "timings.json"), "--hint", "GPipe", "--policy", "hint"])
    out = capsys.readouterr().out
    assert (f"GPipe: 2 ranks x 1 stage (loop), 8 microbatches, replay "
            f"{tmp_path / 'timings.json'}, limit 'hint', policy hint") in out
    assert "for 1 seeds" in out
    # Replayed timings are seconds: makespans are shown in ms.
    hint = build_hint("GPipe", num_ranks=2, num_stages=2, n_microbatches=8)
    row = compare(hint, timing, 0, policy="hint")
    assert "fixed ms" in out and "rrfp ms" in out and "bound ms" in out
    assert f"   0 {row.fixed.makespan * 1e3:9.2f} {row.rrfp.makespan * 1e3:9.2f} " in out


def _cli_error(argv: list[str], capsys) -> str:
    from rrfp.sim.__main__ import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m rrfp.sim ")
    return err.splitlines()[-1]


@pytest.mark.parametrize("argv,message", [
    (["--pp", "0"], "argument --pp: must be an integer >= 1, got 0"),
    (["--microbatches", "-1"], "argument --microbatches: must be an integer >= 1, got -1"),
    (["--seeds", "0"], "argument --seeds: must be an integer >= 1, got 0"),
    (["--stages-per-rank", "two"], "argument --stages-per-rank: must be an integer >= 1, got 'two'"),
    (["--hint", "Zigzag"], "unknown hint 'Zigzag'"),
    (["--hint", "ZBVZeroBubble", "--layout", "loop"],
     "--layout loop does not fit hint ZBVZeroBubble, which places its stages in a v layout: "
     "drop --layout (only the BF and BFW rules take a placement)"),
    (["--hint", "DualPipeV", "--layout", "loop"], "--layout loop does not fit hint DualPipeV"),
    (["--hint", "1F1B", "--layout", "v"], "--layout v does not fit hint 1F1B"),
    (["--limit", "lots"], "argument --limit: buffer_limit='lots' is not understood"),
    (["--policy", "eager"], "argument --policy: unknown policy 'eager'"),
    (["--launch-depth", "-1"], "argument --launch-depth: launch_depth must be an int >= 1"),
    (["--replay", "{tmp}/timings.json", "--seeds", "3"],
     "--replay simulates one measured step, so --seeds would be ignored: drop them, or drop "
     "--replay to simulate a workload"),
    (["--replay", "{tmp}/timings.json", "--workload", "jitter", "--jitter-sigma", "0.5"],
     "so --workload, --jitter-sigma would be ignored"),
    (["--replay", "{tmp}/missing.json"],
     "--replay {tmp}/missing.json: no such file; write one from a run's trace with "
     "python -m rrfp.sim.replay TRACE_JSON -o {tmp}/missing.json"),
    (["--replay", "{tmp}/timings.json", "--pp", "4", "--microbatches", "8"],
     "replayed timings are for 2 stages x 8 microbatches, the hint has 4 x 8"),
])
def test_cli_refuses_bad_or_contradictory_options_saying_what_to_change(argv, message, tmp_path,
                                                                         capsys):
    from rrfp.sim.workloads import make_timing

    make_timing("uniform", 2, 8, 0).save(tmp_path / "timings.json")
    argv = [arg.format(tmp=tmp_path) for arg in argv]
    assert message.format(tmp=tmp_path) in _cli_error(argv, capsys)


def test_cli_gives_a_result_or_a_usage_error_for_every_limit_and_policy(capsys):
    """Every hint on 2-4 ranks, every limit from 1 to the hint's largest stage peak and the
    hint-relative ones, every policy: a table where ScheduleRRFP's own check accepts the
    limit for that policy, else a usage error; never a traceback (a warm-up step in the
    fixed order under a limit below the hint's peaks once stalled)."""
    from rrfp.sim.__main__ import main, TWO_CHUNK_HINTS, V_HINTS
    from rrfp.sim.engine import SIM_POLICIES

    outcomes = set()
    for name in HINT_NAMES:
        per_rank = 2 if name.lower() in TWO_CHUNK_HINTS else 1
        for pp in (2, 3, 4):
            hint = build_hint(name, num_ranks=pp, num_stages=pp * per_rank, n_microbatches=8,
                              layout="v" if name.lower() in V_HINTS else "loop")
            top = max(hint.plan.stage_peaks.values())
            for limit in [*map(str, range(1, top + 1)), "hint", "hint+1", "2x hint"]:
                for policy in SIM_POLICIES:
                    try:
                        resolve_buffer_limits(limit, hint, fixed_order=policy == "fixed")
                        accepted = True
                    except ValueError:
                        accepted = False
                    argv = ["--hint", name, "--pp", str(pp), "--microbatches", "8",
                            "--limit", limit, "--policy", policy, "--seeds", "1"]
                    try:
                        main(argv)
                        printed = True
                    except SystemExit as e:
                        assert e.code == 2, argv
                        printed = False
                    out, err = capsys.readouterr()
                    assert printed == accepted, (argv, err.splitlines()[-1:])
                    assert ("speedup mean" in out) == printed, argv
                    outcomes.add((accepted, policy == "fixed"))
    # Below the hint's peaks: results for the policies that may deviate, usage errors for
    # the fixed order (and for limits ScheduleRRFP refuses whatever the policy).
    assert outcomes == {(True, True), (True, False), (False, True), (False, False)}


def test_cli_documents_every_option(capsys):
    from rrfp.sim.__main__ import main
    from rrfp.sim.workloads import WorkloadParams

    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    assert help_text.startswith("usage: python -m rrfp.sim ")
    lines = help_text.splitlines()
    entries = [i for i, line in enumerate(lines) if line.startswith("  -")]
    usage = help_text.split("\n\n")[0]
    assert {lines[i].split()[0] for i in entries} >= set(re.findall(r"\[(--[\w-]+)", usage))
    for i in entries:
        # "  --opt METAVAR   help", or the help on the next, indented line.
        _, _, same_line_help = lines[i].strip().partition("  ")
        assert same_line_help.strip() or lines[i + 1].startswith(" " * 20), lines[i]
    for field in dataclasses.fields(WorkloadParams):
        assert " ".join(field.metadata["help"].split()) in " ".join(help_text.split())


def test_sixty_four_ranks_and_256_microbatches_simulate_quickly():
    import time

    hint = build_hint("1F1B", num_ranks=64, num_stages=64, n_microbatches=256)
    # CPU time of this process: other processes on the cores do not count (wall time on a
    # loaded machine ran past the bound).
    start = time.process_time()
    result = simulate(hint, _uniform, policy="hint", limits=resolve_buffer_limits("hint", hint))
    assert time.process_time() - start < 10.0
    assert result.makespan == (256 + 63) * 3.0


@pytest.mark.parametrize("name", ["1F1B", "GPipe", "Interleaved1F1B", "LoopedBFS",
                                  "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"])
def test_default_policy_at_default_limit_matches_the_fixed_schedule_on_uniform_times(name):
    from rrfp.sim.study import compare

    per_rank, layout = FITTING[name]
    for num_ranks, M in ((2, 4), (4, 8), (8, 32)):
        hint = build_hint(name, num_ranks=num_ranks, num_stages=num_ranks * per_rank,
                          n_microbatches=M, layout=layout)
        comparison = compare(hint, "uniform", 0)  # limit "hint", policy as ScheduleRRFP picks
        assert comparison.policy == "lookahead"
        assert comparison.speedup == 1.0


def test_with_slack_one_stage_per_rank_runs_the_most_critical_ready_action():
    """The default with memory slack: the critical-path order for one stage per rank, which
    must beat the other candidates on the mean (8 ranks, 32 microbatches, compute jitter,
    hint+2); lookahead for several, where the hint's order fell below 0.995x of the fixed
    schedule (Interleaved1F1B, correlated costs, seed 4) and lookahead must not."""
    from rrfp.sim.study import compare

    hint = build_hint("1F1B", num_ranks=8, num_stages=8, n_microbatches=32)
    assert compare(hint, "jitter", 0, limit="hint+2").policy == "critical"
    mean = {policy: sum(compare(hint, "jitter", seed, limit="hint+2", policy=policy).speedup
                        for seed in range(3)) / 3
            for policy in ("critical", "hint", "arrival")}
    assert mean["critical"] == max(mean.values()), mean
    hint = build_hint("Interleaved1F1B", num_ranks=8, num_stages=16, n_microbatches=32)
    assert compare(hint, "correlated", 4, limit="hint+2", policy="hint").speedup < 0.995
    default = compare(hint, "correlated", 4, limit="hint+2")
    assert default.policy == "lookahead" and default.speedup >= 0.995


def test_with_slack_a_zero_bubble_hint_runs_its_own_order():
    """ZBVZeroBubble 8 x 32 at "2x hint" under latency spikes, seed 9: lookahead expected a
    message later than it came (its estimates are earlier steps' arrivals) and ran 0.994x of
    the fixed schedule; the default (the hint's order, readiness-first until the drain)
    must not lose."""
    from rrfp.sim.study import compare

    hint = build_hint("ZBVZeroBubble", num_ranks=8, num_stages=16, n_microbatches=32,
                      layout="v")
    assert compare(hint, "spikes", 9, limit="2x hint", policy="lookahead").speedup < 0.995
    default = compare(hint, "spikes", 9, limit="2x hint")
    assert default.policy == "drain" and default.speedup >= 1.1, default.speedup


def _drains_in_hint_order(hint, realized) -> bool:
    """Whether every rank, once it has run all of its hint up to the last forward, ran the
    rest in the hint's order."""
    for rank, actions in realized.items():
        position = {a: i for i, a in enumerate(a for a in hint.orders[rank] if a is not None)}
        last_forward = max(i for a, i in position.items() if a.computation_type == F)
        done: set[int] = set()
        for k, action in enumerate(actions):
            done.add(position[action])
            if done.issuperset(range(last_forward + 1)):
                rest = [position[a] for a in actions[k + 1:]]
                if rest != sorted(rest):
                    return False
                break
    return True


def test_with_slack_zbv_runs_readiness_first_until_the_drain_then_the_hint_s_order():
    """ZBVZeroBubble 8 x 32 at "hint+2", documents, seed 6: readiness-first to the end of
    the step reordered the drain's backward pieces and ran 0.993x of the fixed schedule;
    the default deviates before the drain, follows the hint in it and must not lose."""
    from rrfp.sim.study import compare

    hint = build_hint("ZBVZeroBubble", num_ranks=8, num_stages=16, n_microbatches=32,
                      layout="v")
    greedy = compare(hint, "documents", 6, limit="hint+2", policy="hint")
    assert greedy.speedup < 0.995 and not _drains_in_hint_order(hint, greedy.rrfp.realized)
    default = compare(hint, "documents", 6, limit="hint+2")
    assert default.policy == "drain" and default.speedup >= 0.995, default.speedup
    assert _drains_in_hint_order(hint, default.rrfp.realized)
    assert sum(default.rrfp.out_of_order.values()) > 0


@pytest.mark.parametrize("name", ["1F1B", "GPipe", "Interleaved1F1B", "ZBVZeroBubble"])
def test_critical_path_order_loses_nothing_when_nothing_varies(name):
    """With uniform times and memory slack the critical-path order must not fall behind
    the fixed schedule (it may run forwards ahead, never so as to delay a backward chain)."""
    from rrfp.sim.study import compare

    per_rank, layout = FITTING[name]
    hint = build_hint(name, num_ranks=4, num_stages=4 * per_rank, n_microbatches=16,
                      layout=layout)
    for limit in ("hint+1", "hint+2", "2x hint"):
        assert compare(hint, "uniform", 0, limit=limit, policy="critical").speedup >= 1.0


@pytest.mark.parametrize("name", ["1F1B", "Interleaved1F1B", "ZBVZeroBubble", "BFW"])
def test_clairvoyant_yardstick_never_foresees_an_arrival_later_than_the_true_one(
        name, monkeypatch):
    """For a message not yet sent the yardstick foresees the earliest it could arrive:
    never later than it does (split backward, local edges and V placement included)."""
    from rrfp.sim import engine
    from rrfp.sim.study import compare

    foreseen = []  # (simulation, message, foreseen arrival)
    earliest_arrival = engine._Simulation.earliest_arrival

    def recorded(sim, message):
        foreseen.append((sim, message, earliest_arrival(sim, message)))
        return foreseen[-1][-1]

    monkeypatch.setattr(engine._Simulation, "earliest_arrival", recorded)
    per_rank, layout = FITTING[name]
    hint = build_hint(name, num_ranks=4, num_stages=4 * per_rank, n_microbatches=16,
                      layout=layout)
    for seed in range(2):
        compare(hint, "spikes", seed, policy="clairvoyant", limit="hint+1")
    assert foreseen
    for sim, message, when in foreseen:
        assert when <= sim.delivered[message] + 1e-9, message


def test_clairvoyant_yardstick_runs_a_backward_early_only_where_it_ends_before_the_late_input():
    """At the hint's memory under latency spikes the simulator-only yardstick must deviate
    (lookahead's rule without foresight, on a first step, cannot), and each deviation must
    end before the postponed forward's input came, so it never loses."""
    from rrfp.core.actions import Edge
    from rrfp.sim.study import compare, timing_for

    hint = build_hint("1F1B", num_ranks=8, num_stages=8, n_microbatches=32)
    deviations = 0
    for seed in range(3):
        comparison = compare(hint, "spikes", seed, policy="clairvoyant")
        assert comparison.speedup >= 1.0
        spans = comparison.rrfp.spans
        arrivals = {}  # when each forward's input arrived: one latency after the send
        timing = timing_for(hint, "spikes", seed)
        for rank in range(1, 8):
            for span in spans[rank - 1]:
                if span.kind == "F":
                    arrivals[(rank, span.microbatch)] = span.end + timing.latency(
                        Edge(rank - 1, rank), span.microbatch)
        for rank in range(1, 8):
            done: set = set()
            hint_order = [(a.computation_type.value, a.microbatch_index)
                          for a in hint.orders[rank]]
            for span in spans[rank]:
                action = (span.kind, span.microbatch)
                head = next(a for a in hint_order if a not in done)
                done.add(action)
                if action != head and head[0] == "F" and arrivals[(rank, head[1])] > span.start:
                    deviations += 1
                    assert span.end <= arrivals[(rank, head[1])] + 1e-9
    assert deviations > 0


def test_informed_yardstick_expects_the_median_latency_given_the_time_already_on_the_way():
    from rrfp.sim.foresight import median_transit

    now = [0.0]
    transit = median_transit([20.0, 3.0, 1.0, 10.0, 2.0, 4.0], lambda: now[0])
    message = None  # the median does not depend on which message it is
    assert transit(message, 0.0) == 4.0  # sent just now: the (upper) median
    assert transit(message, 4.0) == 8.0  # not yet sent
    now[0] = 2.5
    assert transit(message, 0.0) == 10.0  # 2.5 on the way: the median of 3, 4, 10 and 20
    now[0] = 3.0
    assert transit(message, 0.0) == 10.0  # one as long as 3 counts
    now[0] = 25.0
    assert transit(message, 0.0) == 25.0  # longer than any: it may come at any moment


def test_informed_yardstick_is_clairvoyant_without_latency_and_not_with_it(monkeypatch):
    """Knowing everything but the latencies to come, the informed yardstick foresees what
    the clairvoyant one does when no message takes time, and never expects a message
    that has not come to arrive before now; under latency spikes it does not know which
    transfer is slow, so it foresees some arrivals wrong."""
    from rrfp.sim import engine
    from rrfp.sim.study import compare

    hint = build_hint("1F1B", num_ranks=8, num_stages=8, n_microbatches=32)
    for seed in range(2):
        assert (compare(hint, "jitter", seed, policy="informed").rrfp.makespan
                == compare(hint, "jitter", seed, policy="clairvoyant").rrfp.makespan)
    foreseen = []  # (simulation, when asked, message, foreseen arrival)
    earliest_arrival = engine._Simulation.earliest_arrival

    def recorded(sim, message, transit=None):
        foreseen.append((sim, sim.now, message, earliest_arrival(sim, message, transit)))
        return foreseen[-1][-1]

    monkeypatch.setattr(engine._Simulation, "earliest_arrival", recorded)
    compare(hint, "spikes", 0, policy="informed")
    assert foreseen
    assert all(when >= now - 1e-9 for _, now, _, when in foreseen)
    wrong = [when - sim.delivered[message] for sim, _, message, when in foreseen
             if abs(when - sim.delivered[message]) > 1e-6]
    assert any(miss < 0 for miss in wrong) and any(miss > 0 for miss in wrong)


def test_history_durations_are_step_means_that_earlier_steps_temper():
    from rrfp.core.policy import History

    history = History()
    history.record_durations([(0, "F", 1.0), (0, "F", 1.0), (0, "F", 1.0), (0, "F", 3.0),
                              (0, "B", 2.0)])
    # The step's mean: its last run weighs no more than the others.
    assert history.durations == {(0, "F"): 1.5, (0, "B"): 2.0}
    history.record_durations([(0, "F", 2.5), (1, "F", 4.0)])
    assert history.durations == {(0, "F"): 2.0, (0, "B"): 2.0, (1, "F"): 4.0}


def test_critical_priorities_follow_measured_costs_and_keep_them_while_they_stay_close():
    from rrfp.core.arbiter import Arbiter
    from rrfp.core.policy import History, make_policy
    hint = build_hint("1F1B", num_ranks=4, num_stages=4, n_microbatches=8)
    limits = resolve_buffer_limits("hint+2", hint)
    history = History()

    def rank_by_costs() -> dict | None:
        policy = make_policy("critical", history=history)
        Arbiter(hint, 1, limits=limits, policy=policy).lead()
        return None if history.priority_costs is None else dict(history.priority_costs)

    assert rank_by_costs() is None  # nothing measured yet: the default costs, not kept
    history.record_durations([(1, "F", 0.010), (1, "B", 0.0225)])
    assert rank_by_costs() == {"F": 1.0, "B": 2.25, "I": 1.0, "W": 1.0}  # in forwards
    history.durations[(1, "B")] = 0.0250  # 2.5 forwards: close, the costs stay
    assert rank_by_costs()["B"] == 2.25
    history.durations[(1, "B")] = 0.040
    assert rank_by_costs()["B"] == 4.0


def test_the_default_does_not_lose_where_a_rank_has_no_slack():
    """1F1B 8 x 32 under compute jitter at "busiest" (rank 0 at its own peak, the others
    with slack) and at "hint+1": the critical order ran 0.961x (seed 2) and 0.993x (seed 2)
    of the fixed schedule there; the default (lookahead) must stay at or above 0.995x."""
    from rrfp.sim.study import compare

    hint = build_hint("1F1B", num_ranks=8, num_stages=8, n_microbatches=32)
    for limit in ("busiest", "hint+1"):
        assert compare(hint, "jitter", 2, limit=limit, policy="critical").speedup < 0.995
        result = compare(hint, "jitter", 2, limit=limit)
        assert result.policy == "lookahead" and result.speedup >= 0.995, (limit, result.speedup)


def test_informed_critical_costs_the_chains_by_the_forwards_that_have_ended():
    """The yardstick re-costs its chains when a forward ends: that microbatch's actions on
    that stage cost the forward's duration times their kind's cost, all others the kind's
    cost, as critical's first step does."""
    from rrfp.core.graph import step_graph
    from rrfp.core.policy import DEFAULT_COSTS
    from rrfp.sim.foresight import informed_chains

    hint = build_hint("1F1B", num_ranks=4, num_stages=4, n_microbatches=8)
    limits = resolve_buffer_limits("hint+2", hint)
    graph = step_graph(hint, limits=limits, stream_order=True)
    ran: dict = {}
    chains = informed_chains(ran)

    def chains_by(forward_of: dict) -> dict:
        def cost(a):
            scale = forward_of.get((a.stage_index, a.microbatch_index), 1.0)
            return DEFAULT_COSTS[a.computation_type.value] * scale
        return graph.longest_path(cost)[1]

    before = chains.tails(hint, limits)
    assert before == chains_by({})
    assert chains.tails(hint, limits) is before  # nothing ended: not re-costed
    slow = next(a for a in hint.orders[2] if a.computation_type == F and a.microbatch_index == 1)
    ran[slow] = 3.0
    after = chains.tails(hint, limits)
    assert after == chains_by({(2, 1): 3.0}) != before


def test_critical_ranked_by_foresight_gains_on_compute_jitter_and_not_without_it():
    """Where every duration is the default cost (uniform), critical's ranking by the true
    durations or by what has happened is critical's own; under compute jitter, knowing the
    durations to come gains (1F1B 8 x 32, hint+2, seeds 0-2)."""
    from rrfp.sim.study import compare

    hint = build_hint("1F1B", num_ranks=8, num_stages=8, n_microbatches=32)
    critical = compare(hint, "uniform", 0, limit="hint+2", policy="critical").rrfp
    for yardstick in ("foresight-critical", "informed-critical"):
        assert compare(hint, "uniform", 0, limit="hint+2",
                       policy=yardstick).rrfp.realized == critical.realized

    def mean_speedup(policy: str) -> float:
        return sum(compare(hint, "jitter", seed, limit="hint+2", policy=policy).speedup
                   for seed in range(3)) / 3
    assert mean_speedup("foresight-critical") > mean_speedup("critical") + 0.005
