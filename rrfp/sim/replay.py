"""Turn a runtime trace into a replay file: "what would RRFP gain on my timings?"

    python -m rrfp.sim.replay rrfp_demo_trace.json -o outputs/timings.json
    python -m rrfp.sim --replay outputs/timings.json --hint GPipe
    python -m rrfp.sim.replay TRACE.json -o outputs/t8x32.json --resample 8x32 --seed N

The trace is the Chrome trace ``ScheduleRRFP`` writes (``rrfp.write_chrome_trace`` of all
ranks' ``last_step_stats``, or ``rrfp.merge_chrome_traces`` of per-rank files). Durations
come from the compute spans; a fused backward (B) is split evenly into I and W. Latencies
are arrival minus send time of each message, so the ranks' clocks must agree (one host,
or synchronized hosts). Several occurrences of one action (several steps) are averaged.
The microbatch sizes (``Timing.sizes``) are those the ranks' step metadata recorded
(``StepStats.sizes``), where they all say the same; a trace without them (no sizes given,
or steps of different sizes averaged) has none.

``--resample SxM`` scales measured timings to a larger pipeline: each of S stages and M
microbatches draws its (F, I, W) durations jointly from one measured (stage, microbatch)
cell, and each link latency from the measured ones of its direction, independently. It
keeps the measured spread of per-action costs, not their correlation across stages or
microbatches (e.g. a long sequence slow on every stage): a model, to be labelled simulated.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
from collections import defaultdict
from collections.abc import Sequence

from rrfp.core.sizes import MicrobatchSize
from rrfp.core.stats import STEP_METADATA
from rrfp.sim.workloads import Timing


def sizes_from_trace(trace: dict) -> tuple[MicrobatchSize | None, ...] | None:
    """The microbatch sizes the trace's step metadata recorded, where every rank (and
    step) that recorded any recorded the same ones; else None."""
    said = {json.dumps(event["args"]["sizes"]) for event in trace["traceEvents"]
            if event.get("ph") == "M" and event.get("name") == STEP_METADATA
            and event.get("args", {}).get("sizes") is not None}
    if len(said) != 1:
        return None
    return tuple(None if size is None else MicrobatchSize(**size)
                 for size in json.loads(said.pop()))


def timing_from_trace(trace: dict) -> Timing:
    """The step's timings (see the module's docstring), its sizes included where the
    trace recorded them."""
    spans: dict[tuple[str, int, int], list[float]] = defaultdict(list)
    sends: dict[tuple[int, int, int], list[float]] = defaultdict(list)
    recvs: dict[tuple[int, int, int], list[float]] = defaultdict(list)
    for event in trace["traceEvents"]:
        args = event.get("args", {})
        if event.get("ph") == "X" and event.get("cat") in ("F", "B", "I", "W"):
            spans[(event["cat"], args["stage"], args["microbatch"])].append(event["dur"] / 1e6)
        elif event.get("ph") == "X" and event.get("cat") in ("send", "recv"):
            table = sends if event["cat"] == "send" else recvs
            table[(args["src"], args["dst"], args["microbatch"])].append(event["ts"] / 1e6)
    if not spans:
        raise ValueError("the trace has no compute spans: is it a ScheduleRRFP trace?")
    num_stages = 1 + max(s for _, s, _ in spans)
    n_microbatches = 1 + max(m for _, _, m in spans)

    def table() -> list[list[float]]:
        return [[0.0] * n_microbatches for _ in range(num_stages)]

    forward, backward_input, backward_weight = table(), table(), table()
    for (kind, s, m), durations in spans.items():
        d = statistics.mean(durations)
        if kind == "F":
            forward[s][m] = d
        elif kind == "B":
            backward_input[s][m] = backward_weight[s][m] = d / 2
        elif kind == "I":
            backward_input[s][m] = d
        else:
            backward_weight[s][m] = d
    activation, gradient = table(), table()
    for key, sent in sends.items():
        if key in recvs:
            src, dst, m = key
            latency = max(0.0, statistics.mean(r - t for r, t in zip(sorted(recvs[key]), sorted(sent))))
            (activation if dst > src else gradient)[src][m] = latency
    sizes = sizes_from_trace(trace)
    if sizes is not None and len(sizes) != n_microbatches:
        raise ValueError(f"the trace records {len(sizes)} microbatch sizes for "
                         f"{n_microbatches} microbatches: is it one job's?")
    return Timing(forward, backward_input, backward_weight, activation, gradient, sizes)


def resample(timings: Sequence[Timing], num_stages: int, n_microbatches: int,
             seed: int) -> Timing:
    """A step of ``num_stages`` x ``n_microbatches`` drawn from the cells of ``timings``
    (see the module's ``--resample``); the same seed draws the same step."""
    if not timings:
        raise ValueError("resample needs at least one measured timing")
    rng = random.Random(f"resample/{num_stages}/{n_microbatches}/{seed}")
    cells = [(t.forward[s][m], t.backward_input[s][m], t.backward_weight[s][m])
             for t in timings for s in range(t.num_stages) for m in range(t.n_microbatches)]
    # The last stage sends no activation and the first no gradient: their zeros are no sample.
    activation = [v for t in timings for row in t.activation_latency[:-1] for v in row] or [0.0]
    gradient = [v for t in timings for row in t.gradient_latency[1:] for v in row] or [0.0]
    drawn = [[rng.choice(cells) for _ in range(n_microbatches)] for _ in range(num_stages)]

    def latencies(pool: list[float]) -> list[list[float]]:
        return [[rng.choice(pool) for _ in range(n_microbatches)] for _ in range(num_stages)]

    return Timing(forward=[[c[0] for c in row] for row in drawn],
                  backward_input=[[c[1] for c in row] for row in drawn],
                  backward_weight=[[c[2] for c in row] for row in drawn],
                  activation_latency=latencies(activation), gradient_latency=latencies(gradient))


def _shape(text: str) -> tuple[int, int]:
    try:
        stages, microbatches = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected STAGESxMICROBATCHES, e.g. 8x32; got {text!r}") from None
    if stages < 1 or microbatches < 1:
        raise argparse.ArgumentTypeError(f"stages and microbatches must be >= 1; got {text!r}")
    return stages, microbatches


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Convert a ScheduleRRFP trace to a replay file.")
    parser.add_argument("trace", help="Chrome trace JSON written by rrfp")
    parser.add_argument("-o", "--output", default="timings.json")
    parser.add_argument("--resample", type=_shape, metavar="STAGESxMICROBATCHES",
                        help="draw a step of this size from the trace's (stage, microbatch) "
                             "cells instead of converting it as it is (simulated scale-up)")
    parser.add_argument("--seed", type=int, default=0, help="the draw of --resample (default: 0)")
    args = parser.parse_args(argv)
    with open(args.trace) as f:
        timing = timing_from_trace(json.load(f))
    if args.resample:
        timing = resample([timing], *args.resample, seed=args.seed)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    timing.save(args.output)
    print(f"{args.output}: {timing.num_stages} stages x {timing.n_microbatches} microbatches "
          "(seconds)")


if __name__ == "__main__":
    main()
