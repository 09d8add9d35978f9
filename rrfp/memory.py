"""A byte meter for activations: what the tensors saved for backward really hold.

Counts the bytes of every tensor autograd saves during the metered forwards (through
``torch.autograd.graph.saved_tensors_hooks``) for as long as that tensor object, or the
alias autograd keeps of it, is alive, one count per storage, parameters excluded. A tensor
stays counted while anything holds it: the autograd graph until its last backward piece, a
stage's caches, a receive buffer. It measures the tensors themselves, independently of any
scheduler's own bookkeeping, so it can meter torch's fixed schedules (``MeteredModule``)
and ``ScheduleRRFP`` (which meters its stages' forwards itself) alike.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import deque
from collections.abc import Iterable, Iterator
from typing import NamedTuple
from functools import partial

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


class _Storage:
    """A metered storage: its bytes and how many of the objects holding it for autograd
    (saved tensors and the aliases autograd keeps) live."""

    __slots__ = ("address", "nbytes", "live", "refs")

    def __init__(self, address: int, nbytes: int) -> None:
        self.address, self.nbytes, self.live = address, nbytes, 0
        self.refs: list[weakref.ref] = []
        """Weak references to those objects, kept so that their callbacks fire."""


class ActivationMeter:
    """Live bytes of saved activations, and their peak."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._storages: dict[int, _Storage] = {}
        """Storage address -> the storage while a saved tensor using it lives."""
        self._died: deque[_Storage] = deque()
        """One entry per holder that died and is not yet accounted for: appended by
        weak-reference callbacks, which run on whichever thread drops the holder."""
        self._live = 0
        self._parameters: set[int] = set()
        self.peak = 0
        """Most bytes alive at once since construction or ``reset``, at the samples."""

    def reset(self, parameters: Iterable[torch.Tensor] = ()) -> None:
        """Start a new measurement; ``parameters``' storages are never counted."""
        with self._lock:
            self._storages.clear()
            self._died.clear()
            self._live = 0
            self._parameters = {storage.data_ptr() for p in parameters
                                for storage in _storages(p)}
            self.peak = 0

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Count what autograd saves for backward inside this block (on this thread)."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            yield

    def _pack(self, tensor: torch.Tensor) -> _Saved | torch.Tensor:
        if tensor.device.type == "meta":
            return tensor
        # Autograd keeps an alias of a tensor made by an op, not the tensor itself: an
        # output saved by the node that made it would hold its own grad_fn, a cycle
        # through the C++ graph that Python's collector cannot break, so a graph dropped
        # before its backward (a failed step) would never free it. The storage counts
        # while either object lives. A leaf is kept as itself, as autograd keeps it (a
        # later ``.data`` rebinding must reach backward).
        saved = tensor if tensor.grad_fn is None else tensor.detach()
        holders = (tensor,) if saved is tensor else (tensor, saved)
        with self._lock:
            # Before a storage is looked up by address: a freed storage's address may be
            # reused by the one being saved, and its deaths are queued by then.
            self._account_for_deaths()
            for storage in _storages(tensor):
                address = storage.data_ptr()
                if address in self._parameters:
                    continue
                metered = self._storages.get(address)
                if metered is None:
                    metered = self._storages[address] = _Storage(address, storage.nbytes())
                    self._live += metered.nbytes
                for holder in holders:
                    metered.live += 1
                    metered.refs.append(weakref.ref(holder, partial(_died, self._died, metered)))
        return _Saved(saved, saved._version)

    def _account_for_deaths(self) -> None:
        """Under the lock: drop the storages no live holder uses any more."""
        while self._died:
            metered = self._died.popleft()
            metered.live -= 1
            # A storage metered before the last reset is not counted any more.
            if metered.live == 0 and self._storages.get(metered.address) is metered:
                del self._storages[metered.address]
                self._live -= metered.nbytes

    def live_bytes(self) -> int:
        """Bytes of saved activations still alive now."""
        with self._lock:
            self._account_for_deaths()
            return self._live

    def sample(self) -> int:
        """Measure the live bytes now and keep the peak (call after each forward: saved
        bytes only grow during forwards)."""
        live = self.live_bytes()
        self.peak = max(self.peak, live)
        return live


def _died(queue: deque[_Storage], metered: _Storage, _: weakref.ref) -> None:
    queue.append(metered)  # atomic: no lock in a callback that may run inside a locked block


class _Saved(NamedTuple):
    tensor: torch.Tensor
    version: int
    """Its version when saved: with saved-tensor hooks autograd no longer checks it."""


def _unpack(packed: _Saved | torch.Tensor) -> torch.Tensor:
    if not isinstance(packed, _Saved):
        return packed
    tensor, version = packed
    if tensor._version != version:
        # The error autograd raises without hooks: gradients from modified inputs are wrong.
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: [{tensor.type()} {list(tensor.shape)}] is at version "
            f"{tensor._version}; expected version {version} instead (saved for backward "
            "inside rrfp's activation meter)")
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
