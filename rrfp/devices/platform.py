"""What differs between device types, chosen once per schedule: a ``Platform``.

A platform says where actions run (the step loop's ``Device``), which backend the
channels use (``rrfp.comm.channels``), under which stream receives are posted
(``ReceiveStreams``), how a small tensor of integers (a shape header) goes to the device
and is read back without waiting for queued compute, and how much memory the device can
still give activations (``buffer_limit="auto"``). Supporting a new device type is one
class here and its entry in ``PLATFORMS``; how arrivals are detected follows from the
channels' backend (``rrfp.comm.transport``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import torch

from rrfp.core.loop import Device
from rrfp.devices.device import CudaDevice, HostDevice

AUTO_MARGIN = 0.10
"""``buffer_limit="auto"`` leaves this fraction of the device's total memory unbudgeted:
for what grows after the measurement besides activations (allocator fragmentation,
temporary buffers inside a forward or backward, other processes on the device)."""


class Platform(Protocol):
    device: torch.device
    channel_backend: str
    """``"gloo"`` or ``"nccl"``: the process-group backend of the channels."""
    on_host: bool
    """Whether the stages compute on the host (CPU): launches complete before they return,
    so emulated devices and emulated link latency (``send_delay``) apply."""

    def step_device(self) -> Device:
        """Where the step loop launches actions when no emulated device is given."""
        ...

    def receive_streams(self) -> ReceiveStreams: ...

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        """``host`` (a small CPU tensor) on the device, behind the work already queued,
        without the CPU waiting for it."""
        ...

    def read(self, tensor: torch.Tensor) -> list:
        """The values of a small tensor whose producer has completed, without waiting for
        the compute stream."""
        ...

    free_bytes: Callable[[], int] | None
    """The bytes the device can still give activations (``buffer_limit="auto"``); None
    where the device cannot tell."""


class HostPlatform:
    """CPU stages: synchronous compute, gloo channels."""

    channel_backend = "gloo"
    on_host = True

    def __init__(self, device: torch.device):
        self.device = device

    def step_device(self) -> Device:
        return HostDevice()

    def receive_streams(self) -> ReceiveStreams:
        return ReceiveStreams(None)

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        return host

    def read(self, tensor: torch.Tensor) -> list:
        return tensor.tolist()

    free_bytes = None


class CudaPlatform:
    """CUDA stages: actions launched on the current stream, NCCL channels."""

    channel_backend = "nccl"
    on_host = False

    def __init__(self, device: torch.device, cuda: Any = None):
        self.device = device
        self._cuda = cuda if cuda is not None else torch.cuda
        self._copy_stream = None

    def step_device(self) -> Device:
        return CudaDevice(self.device, self._cuda)

    def receive_streams(self) -> ReceiveStreams:
        return ReceiveStreams(self.device, self._cuda)

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        # From pinned memory without blocking: a blocking copy would wait for the work
        # already on the stream.
        return host.pin_memory().to(self.device, non_blocking=True)

    def read(self, tensor: torch.Tensor) -> list:
        if tensor.device.type != "cuda":
            return tensor.tolist()
        # On a stream of its own: its producer (a receive) has completed, and the compute
        # stream may hold queued work the read need not wait for.
        if self._copy_stream is None:
            self._copy_stream = self._cuda.Stream(self.device)
        with self._cuda.stream(self._copy_stream):
            return tensor.to("cpu").tolist()

    def free_bytes(self) -> int:
        return free_device_bytes(self.device, self._cuda)


PLATFORMS: dict[str, Callable[[torch.device], Platform]] = {
    "cpu": HostPlatform, "cuda": CudaPlatform}
"""The platform of each supported device type."""


def platform_for(device: torch.device | str) -> Platform:
    """The platform of ``device`` (a ``torch.device`` or its name, as torch's stages take
    it); ``ValueError`` naming the supported types otherwise."""
    device = torch.device(device)
    if device.type not in PLATFORMS:
        raise ValueError(f"ScheduleRRFP runs stages on {sorted(PLATFORMS)} devices, not "
                         f"{device.type!r}")
    return PLATFORMS[device.type](device)


def free_device_bytes(device: torch.device, cuda: Any = torch.cuda,
                      margin: float = AUTO_MARGIN) -> int:
    """The bytes ``device`` can still give activations: what the driver reports free
    (``torch.cuda.mem_get_info``) plus what torch's caching allocator holds reserved but
    unused, less ``margin`` of the device's total memory. Called at the start of the second
    step, when the first step's activations are gone and the optimizer's state (created
    by its first step) is allocated. ``cuda``: the module to ask (tests pass a fake)."""
    free, total = cuda.mem_get_info(device)
    cached = cuda.memory_reserved(device) - cuda.memory_allocated(device)
    return max(0, int(free + cached - margin * total))


class ReceiveStreams:
    """Which CUDA stream receives are posted under, and where their buffers come from.

    NCCL makes its stream wait for the caller's *current* stream when a receive is posted
    (``pointToPoint``'s ``syncStream``). Posted while the compute stream is current, a
    receive would wait for every action queued on it — about one action at launch depth
    2 — and its sender's send with it: arrivals would come that much late. So receives are
    posted under a side stream on which nothing is queued. That is safe because a ring
    slot is only re-posted once the last action that reads it has *completed* (an event
    query), so no queued compute can still read it; NCCL records the buffer on its own
    stream. Fresh buffers (variable shapes) are allocated on the side stream — a block
    the compute stream freed while kernels queued on it may still read it is reused only
    on the compute stream — and recorded on the compute stream, which reads them once the
    receive completes (``wait()`` orders it after the receive), so they are not handed out
    again before that reading is done.

    torch draws streams from a small round-robin pool per priority; a high-priority
    stream may still be shared with another user of that pool (FSDP2's all-gather and
    reduce-scatter streams are high priority): a receive would then also wait for their
    queued work. Not seen on hardware (none was available); ``benchmarks/gpu_check.py``
    measures arrival latency with compute queued.

    ``cuda``: the ``torch.cuda`` API (a recording fake in the tests); ``None``: CPU.
    """

    def __init__(self, device: torch.device | None, cuda=None,
                 empty: Callable[..., torch.Tensor] = torch.empty):
        self._cuda = None
        self._empty = empty
        self.side = None
        if device is not None and device.type == "cuda":
            self._cuda = cuda if cuda is not None else torch.cuda
            self._device = device
            # High priority: from the other pool than the low-priority streams NCCL gives
            # its communicators, so the side stream is never a channel's own NCCL stream
            # (a receive posted under another channel's stream would wait for its kernel).
            self.side = self._cuda.Stream(device, priority=-1)

    def posting(self):
        """Context under which a receive is posted."""
        if self._cuda is None:
            return contextlib.nullcontext()
        return self._cuda.stream(self.side)

    def empty(self, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if self._cuda is None:
            return self._empty(shape, dtype=dtype, device=device)
        compute = self._cuda.current_stream(self._device)
        with self._cuda.stream(self.side):
            buffer = self._empty(shape, dtype=dtype, device=device)
        buffer.record_stream(compute)
        return buffer
