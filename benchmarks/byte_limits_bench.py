"""What ``buffer_limit="busiest"`` (in bytes) gains, measured on the emulated device, and its bytes.

    python -m benchmarks.byte_limits_bench      # writes results/byte_limits.md (~1 min)

**Measured, emulated device time** (``rrfp.devices.device.EmulatedDevice``: launches return at
once, a worker thread sleeps each action's time): 1F1B on 4 gloo ranks x 16 microbatches,
one stage per rank saving 2 / 4 / 2 / 2 KiB per microbatch
(``rrfp/testing/byte_limits_world.py``: stage 1 twice as wide, so its rank is the busiest
in bytes while rank 0 is in microbatches), every action 20 ms and one in five 4x longer
(long enough for the sleeps to stand out of a loaded machine's scheduling delays), drawn
per (stage, step, microbatch, kind) so every run sees the same times. Per seed: ScheduleRRFP with
``policy="fixed"`` at ``"hint"`` (torch's 1F1B order on the same emulated device: the
baseline; torch's own Schedule1F1B runs the same work synchronously, so its wall clock is
not comparable), the default policy at ``"hint"`` (the control: the same memory as the
baseline), the default policy at ``"busiest"``, and ``policy="hint"`` (readiness-
first, which uses every slack microbatch) at ``"busiest"``; 6 steps, the median step time
of steps 3-6 (step 1 runs at the hint's limits and measures the bytes; step 2 is the first
at the derived limits). Bytes: the most saved-activation bytes alive on each rank in the
last step (the meter), against torch's Schedule1F1B metered the same way.
"""

from __future__ import annotations

import statistics
import time

from benchmarks.pages import write_page
from rrfp.testing.byte_limits_world import byte_limits_world
from rrfp.testing.worlds import run_local_world

RUNS = [("hint", "fixed"), ("hint", None), ("busiest", None), ("busiest", "hint")]
STEPS = 6
BASE_S = 0.02


def main() -> None:
    started = time.time()
    KiB = 1024
    lines = [
        "# `buffer_limit=\"busiest\"` in bytes: speed and peak bytes (emulated device time)",
        "",
        "Regenerate with `python -m benchmarks.byte_limits_bench` (the module docstring has "
        "the method). Speedup: median step time of steps 3-6 of `policy=\"fixed\"` at "
        "`\"hint\"` over the run's. Bytes: KiB per rank 0 / 1 / 2 / 3, last step.",
        "",
        "| seed | torch 1F1B peak KiB | run | microbatch limits | peak KiB | speedup |",
        "|---|---|---|---|---|---|",
    ]
    for seed in range(3):
        ranks = run_local_world(4, byte_limits_world, RUNS, STEPS, seed, BASE_S,
                                timeout=600)
        fixed_bytes = " / ".join(f"{r['fixed_bytes'] / KiB:.0f}" for r in ranks)

        def median_time(key: str) -> float:
            # Each rank's step ends when its last action does; the pipeline's step is the
            # slowest rank's.
            return statistics.median(max(r[key]["times"][s] for r in ranks)
                                     for s in range(2, STEPS))

        base = median_time("hint/fixed")
        for limit, policy in RUNS:
            key = f"{limit}/{policy}"
            limits = " / ".join(str(r[key]["rank_limit"]) for r in ranks)
            peaks = " / ".join(f"{r[key]['peak_bytes'] / KiB:.0f}" for r in ranks)
            name = f"`{limit}`, policy {policy or 'default (' + ranks[0][key]['policy'] + ')'}"
            lines.append(f"| {seed} | {fixed_bytes} | {name} | {limits} | {peaks} | "
                         f"{base / median_time(key):.3f}x |")
            print(lines[-1], flush=True)
    lines += ["", f"({time.time() - started:.0f} s on a shared 2-core machine.)"]
    print(f"wrote {write_page('byte_limits.md', lines)}")


if __name__ == "__main__":
    main()
