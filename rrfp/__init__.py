"""rrfp: the Runtime-Readiness-First Pipeline schedule for torch.distributed.pipelining."""

# Imported first: it refuses, in one line, a torch rrfp cannot drive (``check_torch``).
import rrfp._torch_compat  # noqa: F401

from rrfp.core.errors import PeerFailedError, PipelineStallError, StoreLostError  # noqa: E402
from rrfp.core.hints import build_hint, Hint, HINT_NAMES  # noqa: E402
from rrfp.core.settings import Settings  # noqa: E402
from rrfp.core.stats import merge_chrome_traces, StepStats, write_chrome_trace  # noqa: E402
from rrfp.runtime.schedule import ScheduleRRFP  # noqa: E402
from rrfp.torch_probe import UnsupportedTorchError  # noqa: E402

__all__ = [
    "build_hint",
    "Hint",
    "HINT_NAMES",
    "merge_chrome_traces",
    "PeerFailedError",
    "PipelineStallError",
    "StoreLostError",
    "ScheduleRRFP",
    "Settings",
    "StepStats",
    "UnsupportedTorchError",
    "write_chrome_trace",
]
