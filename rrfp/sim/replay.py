"""Turn a runtime trace into a replay file: "what would RRFP gain on my timings?"

    python -m rrfp.sim.replay rrfp_demo_trace.json -o outputs/timings.json
    python -m rrfp.sim --replay outputs/timings.json --hint GPipe

The trace is the Chrome trace ``ScheduleRRFP`` writes (``rrfp.write_chrome_trace`` of all
ranks' ``last_step_stats``, or ``rrfp.merge_chrome_traces`` of per-rank files). Durations
come from the compute spans; a fused backward (B) is split evenly into I and W. Latencies
are arrival minus send time of each message, so the ranks' clocks must agree (one host,
or synchronized hosts). Several occurrences of one action (several steps) are averaged.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections import defaultdict

from rrfp.sim.workloads import Timing


def timing_from_trace(trace: dict) -> Timing:
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
    return Timing(forward, backward_input, backward_weight, activation, gradient)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Convert a ScheduleRRFP trace to a replay file.")
    parser.add_argument("trace", help="Chrome trace JSON written by rrfp")
    parser.add_argument("-o", "--output", default="timings.json")
    args = parser.parse_args(argv)
    with open(args.trace) as f:
        timing = timing_from_trace(json.load(f))
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    timing.save(args.output)
    print(f"{args.output}: {timing.num_stages} stages x {timing.n_microbatches} microbatches "
          "(seconds)")


if __name__ == "__main__":
    main()
