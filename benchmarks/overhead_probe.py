"""What a rank's step loop spends deciding, measured from outside the code under test.

``benchmarks.overhead_ab`` installs this file as the ``sitecustomize`` of every process of
a run (the fork server's too, so every rank inherits it), with the code of either tree it
compares. It wraps ``StepLoop._take_events`` and ``StepLoop._choose`` (together the
decision region of ``StepLoop.run`` but for a few comparisons) and counts
``StepLoop._launch``; at the end of each step it writes, to ``$RRFP_PROBE_DIR/<pid>.json``,
the thread's CPU seconds in the region (``time.thread_time``: waits for a CPU or the GIL
excluded, unlike the stats' wall-clock figure) and the actions launched. Standalone: it
imports nothing from ``benchmarks``, as it runs with the other tree's code.
"""

from __future__ import annotations

import json
import os
import time


class _Totals:
    def __init__(self, directory: str):
        self.directory = directory
        self.cpu_s = 0.0
        self.launches = 0

    def timed(self, method):
        def wrapper(loop, *args):
            start = time.thread_time()
            try:
                return method(loop, *args)
            finally:
                self.cpu_s += time.thread_time() - start
        return wrapper

    def counted(self, method):
        def wrapper(loop, *args):
            self.launches += 1
            return method(loop, *args)
        return wrapper

    def written_after(self, run):
        """``StepLoop.run``, writing the totals when a step ends (a rank may end without
        running atexit)."""
        def wrapper(loop):
            yield from run(loop)
            # Named now: the ranks fork from a process that installed the probe.
            with open(os.path.join(self.directory, f"{os.getpid()}.json"), "w") as f:
                json.dump({"cpu_s": self.cpu_s, "launches": self.launches}, f)
        return wrapper


def install() -> None:
    directory = os.environ.get("RRFP_PROBE_DIR")
    if not directory:
        return
    from rrfp.core.loop import StepLoop
    totals = _Totals(directory)
    StepLoop._take_events = totals.timed(StepLoop._take_events)
    StepLoop._choose = totals.timed(StepLoop._choose)
    StepLoop._launch = totals.counted(StepLoop._launch)
    StepLoop.run = totals.written_after(StepLoop.run)


install()
