"""What would RRFP buy on this job? ``python -m rrfp.advise RUN_DIR``.

    python -m rrfp.advise outputs/llama3_debug_cpu        # a torchtitan dump folder
    python -m rrfp.advise outputs/llama3_debug_cpu/traces/STEP_DIR --margin PERCENT
    python -m rrfp.advise - --json --source NAME < steps.json   # steps' trace events

Reads the run's step traces, replays its measured steps in the simulator under every
setting the job could take without changing its model split, and prints them ranked by
predicted speedup over the fixed schedule, with the activation bytes each lets the ranks
hold, then the one-line verdict; writes two charts beside the traces (``--out``): the
ranked settings (advise_settings.png) and one measured step beside its simulated replays
(advise_step.png). A run it cannot read is said in one line (exit status 2).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from rrfp.advise import end_with_parent, lower_priority
from rrfp.advise.measured import AdviceError, read_run, run_from_trace_events
from rrfp.advise.report import advise, DEFAULT_MARGIN


def _margin(text: str) -> float:
    try:
        value = float(text.strip().removesuffix("%")) / 100
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a percentage such as 25%, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"the margin must be >= 0%, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rrfp.advise",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("run", help="the run's folder (a torchtitan dump folder, or the "
                        "folder of one run's step<N>.json traces), a trace file, or - for "
                        "a JSON list of the steps' trace events on stdin")
    parser.add_argument("--margin", type=_margin, default=DEFAULT_MARGIN,
                        help="how much the verdict may grow the job's peak activation bytes, "
                             # argparse formats help with %: a literal one is written %%.
                             f"as a percentage of it (default {DEFAULT_MARGIN * 100:.0f}%%)")
    parser.add_argument("--out", help="where the charts go (default: the traces' folder)")
    parser.add_argument("--no-plots", dest="plots", action="store_false")
    parser.add_argument("--rows", type=int, default=25,
                        help="settings shown, best first (0: all; default 25)")
    parser.add_argument("--json", action="store_true", help="print the advice as JSON")
    parser.add_argument("--source", help="how the verdict names the run (default: its path)")
    parser.add_argument("--low-priority", action="store_true",
                        help="once started, run at the lowest CPU priority (Linux's "
                             "SCHED_IDLE, else nice 19): beside a training job")
    args = parser.parse_args(argv)
    end_with_parent()
    if args.low_priority:
        lower_priority()
    try:
        if args.run == "-":
            steps = _stdin_steps()
            run, note = run_from_trace_events(steps, args.source or "stdin"), ""
        else:
            run, note = read_run(args.run)
        advice = advise(run, args.source or run.source, margin=args.margin,
                        notes=[note] if note else [])
    except AdviceError as e:
        print(f"rrfp.advise: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**advice.as_json(), "cpu_seconds": time.process_time()}))
        return 0
    print("\n".join(advice.table(args.rows or None)))
    print()
    print(advice.verdict())
    if args.plots and args.run != "-":
        _plot(advice, args.out or run.source)
    return 0


def _stdin_steps() -> list[list[dict]]:
    try:
        steps = json.load(sys.stdin)
    except json.JSONDecodeError as e:
        raise AdviceError(f"stdin: not a whole JSON list of steps' trace events ({e.msg})") from None
    if not isinstance(steps, list) or not all(isinstance(s, list) for s in steps):
        raise AdviceError("stdin: expected a JSON list with one list of trace events per step")
    return steps


def _plot(advice, folder: str) -> None:
    from rrfp.advise.plots import plot_predictions, plot_step

    os.makedirs(folder, exist_ok=True)
    for name, draw in (("advise_settings.png", plot_predictions), ("advise_step.png", plot_step)):
        path = os.path.join(folder, name)
        try:
            draw(advice, path)
        except ImportError as e:  # matplotlib: rrfp's [sim] extra
            print(f"charts not drawn: {e} (pip install matplotlib)")
            return
        print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
