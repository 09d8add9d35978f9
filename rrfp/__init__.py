"""rrfp: the Runtime-Readiness-First Pipeline schedule for torch.distributed.pipelining."""

from rrfp._torch_compat import check_supported

check_supported()

from rrfp.core.errors import PeerFailedError, PipelineStallError, StoreLostError  # noqa: E402
from rrfp.core.hints import build_hint, Hint, HINT_NAMES  # noqa: E402
from rrfp.runtime.schedule import ScheduleRRFP  # noqa: E402
from rrfp.core.stats import merge_chrome_traces, StepStats, write_chrome_trace  # noqa: E402

__all__ = [
    "build_hint",
    "Hint",
    "HINT_NAMES",
    "merge_chrome_traces",
    "PeerFailedError",
    "PipelineStallError",
    "StoreLostError",
    "ScheduleRRFP",
    "StepStats",
    "write_chrome_trace",
]
