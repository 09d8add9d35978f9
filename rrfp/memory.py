"""A byte meter for activations: what the tensors saved for backward really hold.

Counts the bytes of every tensor autograd saves during the metered forwards (through
``torch.autograd.graph.saved_tensors_hooks``) for as long as that tensor object is alive,
one count per storage, parameters excluded. A tensor stays counted while anything holds it:
the autograd graph until its last backward piece, a stage's caches, a receive buffer. It
measures the tensors themselves, independently of any scheduler's own bookkeeping, so it
can meter torch's fixed schedules (``MeteredModule``) and ``ScheduleRRFP`` (which meters
its stages' forwards itself) alike.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterable, Iterator

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


class ActivationMeter:
    """Live bytes of saved activations, and their peak."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._saved: dict[int, tuple[int, list[weakref.ref]]] = {}
        """Storage address -> (bytes, weak references to the saved tensors using it)."""
        self._parameters: set[int] = set()
        self.peak = 0
        """Most bytes alive at once since construction or ``reset``, at the samples."""

    def reset(self, parameters: Iterable[torch.Tensor] = ()) -> None:
        """Start a new measurement; ``parameters``' storages are never counted."""
        with self._lock:
            self._saved.clear()
            self._parameters = {storage.data_ptr() for p in parameters
                                for storage in _storages(p)}
            self.peak = 0

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Count what autograd saves for backward inside this block (on this thread)."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            yield

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type == "meta":
            return tensor
        with self._lock:
            for storage in _storages(tensor):
                address = storage.data_ptr()
                if address in self._parameters:
                    continue
                _, refs = self._saved.setdefault(address, (storage.nbytes(), []))
                refs.append(weakref.ref(tensor))
        return tensor

    def live_bytes(self) -> int:
        """Bytes of saved activations still alive now."""
        with self._lock:
            dead = []
            total = 0
            for address, (nbytes, refs) in self._saved.items():
                refs[:] = [r for r in refs if r() is not None]
                if refs:
                    total += nbytes
                else:
                    dead.append(address)
            for address in dead:
                del self._saved[address]
            return total

    def sample(self) -> int:
        """Measure the live bytes now and keep the peak (call after each forward: saved
        bytes only grow during forwards)."""
        live = self.live_bytes()
        self.peak = max(self.peak, live)
        return live


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _storages(tensor: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages holding a tensor's data; a tensor subclass that wraps others (a
    DTensor, a tensor of an async collective) holds its inner tensors'."""
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        inner = (getattr(tensor, name) for name in names)
        return [s for t in inner if isinstance(t, torch.Tensor) for s in _storages(t)]
    return [tensor.untyped_storage()]


class MeteredModule(torch.nn.Module):
    """Wraps a module so that its forwards are metered by ``meter`` (e.g. a stage module
    under one of torch's schedules; several stages of a rank may share one meter)."""

    def __init__(self, inner: torch.nn.Module, meter: ActivationMeter):
        super().__init__()
        self.inner = inner
        self.meter = meter

    def forward(self, *args, **kwargs):
        with self.meter.saving():
            out = self.inner(*args, **kwargs)
        self.meter.sample()
        return out
