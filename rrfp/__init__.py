"""rrfp: the Runtime-Readiness-First Pipeline schedule for torch.distributed.pipelining."""

from rrfp.hints import build_hint, Hint, HINT_NAMES
from rrfp.schedule import PipelineStallError, ScheduleRRFP
from rrfp.transport import PeerFailedError
from rrfp.stats import merge_chrome_traces, StepStats, write_chrome_trace

__all__ = [
    "build_hint",
    "Hint",
    "HINT_NAMES",
    "merge_chrome_traces",
    "PeerFailedError",
    "PipelineStallError",
    "ScheduleRRFP",
    "StepStats",
    "write_chrome_trace",
]
