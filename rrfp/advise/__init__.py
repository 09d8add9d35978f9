"""The advisor: what each setting would buy on a job, predicted from the job's own
measured steps (``python -m rrfp.advise RUN_DIR``; docs/guide/advisor.md)."""

import os

from rrfp.advise.measured import AdviceError, MeasuredRun, read_run, run_from_trace_events
from rrfp.advise.report import ab_speedups, advise, Advice

__all__ = ["AdviceError", "MeasuredRun", "read_run", "run_from_trace_events", "ab_speedups",
           "advise", "Advice", "child_environment", "lower_priority"]


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


def child_environment() -> dict[str, str]:
    """The environment of a prediction process: it imports the rrfp this process runs (a
    checkout on ``PYTHONPATH`` or not), on one thread."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
