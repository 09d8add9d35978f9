"""``ScheduleRRFP`` with emulation and study knobs, for the tests, the benchmarks and the
demo: an emulated asynchronous device, emulated link latency, launching any ready action
onto a busy device. Users' schedules have none of them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rrfp.advise.cost import CPU_SHARE
from rrfp.comm.channels import ChannelMap
from rrfp.comm.link_latency import SendDelay
from rrfp.devices.platform import Platform
from rrfp.runtime.schedule import ScheduleRRFP, Wiring
from rrfp.runtime.self_driving import Predictor
from rrfp.testing.emulation import EmulatedDevice


@dataclass(frozen=True, kw_only=True)
class Study:
    """The knobs a study sets on a schedule's wiring (CPU stages only)."""

    device: EmulatedDevice | None = None
    """An emulated asynchronous device for the stages' compute (None: the platform's own,
    synchronous on the CPU)."""
    send_delay: SendDelay | None = None
    """Emulated link latency, ``(edge, microbatch) -> seconds`` to hold each outgoing
    message (messages on a channel stay in order)."""
    reorder_ahead: bool = False
    """Let any ready action be launched onto a busy device (default: ahead of the device
    only the policy's own next action is launched; deviations are chosen when it is
    idle)."""
    predict_inline: Predictor | None = None
    """Self-driving (``Settings.tune_within``): predict in this process as soon as the
    measured steps ran (``rrfp.advise.tuning.predict_candidates``), so that decisions
    come at known steps (None: in a child process at `nice 19`, as in a job)."""
    prediction_cpu_share: float = CPU_SHARE
    """Self-driving in a child process: the most of the host's CPU time since the first
    step its predictions may take (``rrfp.advise.cost``; ``math.inf``: no bound, for a
    study whose emulated device leaves the CPU idle, and its results must say so)."""
    channels: Callable[..., ChannelMap] | None = None
    """How the channels are made, e.g. ``rrfp.testing.nccl_like.channels_for("nccl-like")``
    (None: rrfp's own, over the platform's backend)."""


class StudySchedule(ScheduleRRFP):
    """``ScheduleRRFP(...)`` whose wiring takes ``study``'s knobs."""

    def __init__(self, *args: object, study: Study, **kwargs: object):
        self.study = study
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def _wiring(self, platform: Platform) -> Wiring:
        study = self.study
        if not platform.on_host and (study.device is not None or study.send_delay is not None):
            raise ValueError(
                f"the emulated device and send delays run CPU stages (a sender thread's CUDA "
                f"stream is not the compute stream); these stages are on {platform.device}")
        device = study.device if study.device is not None else platform.step_device()
        return Wiring(device, study.send_delay, study.reorder_ahead, study.predict_inline,
                      study.prediction_cpu_share, study.channels)
