"""The advisor: what each setting would buy on a job, predicted from the job's own
measured steps (``python -m rrfp.advise RUN_DIR``; docs/guide/advisor.md)."""

from rrfp.advise.measured import AdviceError, MeasuredRun, read_run, run_from_trace_events
from rrfp.advise.report import ab_speedups, advise, Advice

__all__ = ["AdviceError", "MeasuredRun", "read_run", "run_from_trace_events", "ab_speedups",
           "advise", "Advice"]
