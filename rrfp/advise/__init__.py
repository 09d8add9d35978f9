"""The advisor: what each setting would buy on a job, predicted from the job's own
measured steps (``python -m rrfp.advise RUN_DIR``; docs/guide/advisor.md)."""

import os
import threading
import time

from rrfp.advise.measured import AdviceError, MeasuredRun, read_run, run_from_trace_events
from rrfp.advise.report import ab_speedups, advise, Advice

__all__ = ["AdviceError", "MeasuredRun", "read_run", "run_from_trace_events", "ab_speedups",
           "advise", "Advice", "child_environment", "end_with_parent", "lower_priority"]


def lower_priority(pid: int = 0, *, idle: bool = True) -> None:
    """Process ``pid`` (0: this one) at a low CPU priority. ``idle``: the lowest,
    ``SCHED_IDLE`` where the OS has it (a process that wakes takes the core from it at
    once, and the load balancer counts its core as idle; beside a busy process it gets
    next to nothing), else ``nice 19``. Otherwise ``nice 19``: beside a busy process of
    priority 0 on its core a small share of it (the kernel weighs them 15 to 1024), all
    of an idle core, so that work the job waits for always progresses."""
    if idle and hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE"):
        os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
    elif hasattr(os, "setpriority"):
        os.setpriority(os.PRIO_PROCESS, pid, 19)


PARENT = "RRFP_PREDICTION_PARENT"
"""The environment variable naming the process that started a prediction process."""
PARENT_CHECK_S = 1.0
"""How often a prediction process looks whether that process is still there."""


def child_environment() -> dict[str, str]:
    """The environment of a prediction process: it imports the rrfp this process runs (a
    checkout on ``PYTHONPATH`` or not), on one thread, and knows this process as its
    parent (``end_with_parent``)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1",
            PARENT: str(os.getpid())}


def end_with_parent() -> None:
    """In a prediction process started with ``child_environment``: exit as soon as the
    process that started it is gone, also if it died before this one started (a killed
    trainer leaves no child predicting for nobody); looked at every ``PARENT_CHECK_S`` on
    a thread of its own. Without the variable (a user's own run): nothing. This process's
    children do not inherit it."""
    parent = os.environ.pop(PARENT, None)
    if parent is None:
        return

    def watch() -> None:
        while os.getppid() == int(parent):
            time.sleep(PARENT_CHECK_S)
        os._exit(1)

    threading.Thread(target=watch, name="rrfp-parent-watch", daemon=True).start()
