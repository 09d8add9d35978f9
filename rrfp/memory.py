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

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


class ActivationMeter:
    """Live bytes of saved activations, and their peak."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes: dict[int, int] = {}
        """Storage address -> its bytes, while an object holding it for autograd lives."""
        self._holders: dict[int, int] = {}
        """Storage address -> how many such objects (saved tensors, their aliases) live."""
        self._refs: dict[int, weakref.ref] = {}
        """A weak reference to each such object, by its id (kept so that its callback
        fires; keyed by id, as references to live tensors compare by their values)."""
        self._addresses: dict[int, int] = {}
        """The id of each such reference -> the storage address its object holds (ints:
        little for the garbage collector to walk)."""
        self._died: deque[weakref.ref] = deque()
        """References whose object died, not yet accounted for: appended by the callback,
        which runs on whichever thread drops the object."""
        self._on_death = self._died.append
        self._live = 0
        self._parameters: set[int] = set()
        self.peak = 0
        """Most bytes alive at once since construction or ``reset``, at the samples."""

    def reset(self, parameters: Iterable[torch.Tensor] = ()) -> None:
        """Start a new measurement; ``parameters``' storages are never counted."""
        with self._lock:
            self._refs.clear()  # a dropped reference calls back no more
            self._addresses.clear()
            self._bytes.clear()
            self._holders.clear()
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
        saved = tensor if tensor.is_leaf else tensor.detach()
        holders = (tensor,) if saved is tensor else (tensor, saved)
        with self._lock:
            # Before a storage is looked up by address: a freed storage's address may be
            # reused by the one being saved, and its deaths are queued by then.
            self._account_for_deaths()
            for storage in _storages(tensor):
                address = storage.data_ptr()
                if address in self._parameters:
                    continue
                if address not in self._bytes:
                    self._bytes[address] = storage.nbytes()
                    self._holders[address] = 0
                    self._live += self._bytes[address]
                for holder in holders:
                    self._holders[address] += 1
                    ref = weakref.ref(holder, self._on_death)
                    self._refs[id(ref)] = ref
                    self._addresses[id(ref)] = address
        return _Saved(saved, saved._version)

    def _account_for_deaths(self) -> None:
        """Under the lock: drop the storages no live holder uses any more."""
        while self._died:
            key = id(self._died.popleft())
            if self._refs.pop(key, None) is None:  # held since before the last reset
                continue
            address = self._addresses.pop(key)
            self._holders[address] -= 1
            if self._holders[address] == 0:
                del self._holders[address]
                self._live -= self._bytes.pop(address)

    def live_bytes(self) -> int:
        """Bytes of saved activations still alive now."""
        with self._lock:
            self._account_for_deaths()
            return self._live

    def sample(self) -> int:
        """Measure the live bytes now and keep the peak (call after each forward: saved
        bytes only grow during forwards)."""
        with self._lock:
            self._account_for_deaths()
            self.peak = max(self.peak, self._live)
            return self._live


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
