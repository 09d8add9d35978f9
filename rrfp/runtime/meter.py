"""A byte meter for activations: what the tensors saved for backward really hold.

Counts the bytes of every tensor autograd saves during the metered forwards (through
``torch.autograd.graph.saved_tensors_hooks``), parameters excluded: the bytes of its
storage that it can reach (a microbatch that torch's schedules split off the input batch
counts its own rows, not the batch), bytes that several saved tensors reach counted once.
A tensor made by an op counts while it, or the alias autograd keeps of it, is alive: the
autograd graph until its last backward piece, a stage's caches, a pending send. A saved
leaf (an input microbatch, a receive buffer) lives on outside the graph, in the step's
list or its ring, so it counts only while autograd holds it for backward. It measures the
tensors themselves, independently of any scheduler's own bookkeeping, so it can meter
torch's fixed schedules (``MeteredModule``) and ``ScheduleRRFP`` (which meters its stages'
forwards itself) alike.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import deque
from collections.abc import Iterable, Iterator

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


class ActivationMeter:
    """Live bytes of saved activations, and their peak."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reached: dict[int, dict[tuple[int, int], int]] = {}
        """Storage address -> the byte ranges of it that live saved objects (saved tensors,
        their aliases) reach, each with how many such objects reach it."""
        self._bytes: dict[int, int] = {}
        """Storage address -> the bytes those ranges cover together."""
        self._refs: dict[int, weakref.ref] = {}
        """A weak reference to each such object, by its id (kept so that its callback
        fires; keyed by id, as references to live tensors compare by their values)."""
        self._holds: dict[int, list[tuple[int, tuple[int, int]]]] = {}
        """The id of each such reference -> the (storage address, byte range) pairs its
        object reaches (ints: little for the garbage collector to walk)."""
        self._died: deque[weakref.ref] = deque()
        """References whose object died, not yet accounted for: appended by the callback,
        which runs on whichever thread drops the object."""
        self._on_death = self._died.append
        self._live = 0
        self._saved = 0
        """Bytes that saving added to the live total since construction (never lowered by
        deaths): a block's saves added the difference of its values around the block."""
        self._parameters: set[int] = set()
        self.peak = 0
        """Most bytes alive at once since construction or ``reset``, at the samples."""

    def reset(self, parameters: Iterable[torch.Tensor] = ()) -> None:
        """Start a new measurement; ``parameters``' storages are never counted."""
        with self._lock:
            self._refs.clear()  # a dropped reference calls back no more
            self._holds.clear()
            self._reached.clear()
            self._bytes.clear()
            self._died.clear()
            self._live = 0
            self._parameters = {address for p in parameters for address, _ in _reach(p)}
            self.peak = 0

    @contextlib.contextmanager
    def saving(self) -> Iterator[SavedBytes]:
        """Count what autograd saves for backward inside this block (on this thread); the
        ``SavedBytes`` it yields holds, after the block, the bytes the block's saves added
        (what a stage's forward of one microbatch holds for its backward)."""
        added = SavedBytes()
        start = self._saved
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            yield added
        added.bytes = self._saved - start

    def _pack(self, tensor: torch.Tensor) -> _Saved | torch.Tensor:
        if tensor.device.type == "meta":
            return tensor
        # Autograd keeps an alias of a tensor made by an op, not the tensor itself: an
        # output saved by the node that made it would hold its own grad_fn, a cycle
        # through the C++ graph that Python's collector cannot break, so a graph dropped
        # before its backward (a failed step) would never free it. Its bytes count
        # while either object lives (a stage's cache or a pending send may hold the
        # output). A leaf is kept as itself, as autograd keeps it (a later ``.data``
        # rebinding must reach backward); it lives on outside the graph (an input
        # microbatch in the step's list, a receive buffer in its ring), so its bytes count
        # only while autograd holds it for backward: while the packed record lives.
        saved = tensor if tensor.is_leaf else tensor.detach()
        packed = _Saved(saved, saved._version)
        holders = (packed,) if saved is tensor else (tensor, saved)
        reach = _reach(tensor)
        with self._lock:
            # Before a storage is looked up by address: a freed storage's address may be
            # reused by the one being saved, and its deaths are queued by then.
            self._account_for_deaths()
            reach = [(address, span) for address, span in reach
                     if address not in self._parameters]
            for holder in holders:
                ref = weakref.ref(holder, self._on_death)
                self._refs[id(ref)] = ref
                self._holds[id(ref)] = reach
            for address, span in reach:
                spans = self._reached.setdefault(address, {})
                count = spans.get(span, 0)
                spans[span] = count + len(holders)
                if not count:  # a range already reached changes nothing
                    self._saved -= self._live
                    self._recount(address)
                    self._saved += self._live
        return packed

    def _account_for_deaths(self) -> None:
        """Under the lock: drop the ranges no live holder reaches any more."""
        while self._died:
            key = id(self._died.popleft())
            if self._refs.pop(key, None) is None:  # held since before the last reset
                continue
            for address, span in self._holds.pop(key):
                spans = self._reached[address]
                spans[span] -= 1
                if spans[span] == 0:  # while another holder reaches it, nothing changes
                    del spans[span]
                    self._recount(address)

    def _recount(self, address: int) -> None:
        """Under the lock: the bytes of the storage at ``address`` that live holders reach
        (idempotent)."""
        spans = self._reached[address]
        if len(spans) == 1:  # the common case: one tensor, or it and its alias
            ((start, stop),) = spans
            covered = stop - start
        else:
            covered, end = 0, 0
            for start, stop in sorted(spans):
                covered += max(0, stop - max(start, end))
                end = max(end, stop)
        self._live += covered - self._bytes.pop(address, 0)
        if covered:
            self._bytes[address] = covered
        if not spans:
            del self._reached[address]

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


class SavedBytes:
    """The bytes a ``saving`` block's saves added to the live total (set when it ends)."""

    __slots__ = ("bytes",)

    def __init__(self) -> None:
        self.bytes = 0


class _Saved:
    """What autograd holds for a saved tensor until the backward that needs it (or until
    it drops the graph): the tensor, and its version when saved (with saved-tensor hooks
    autograd no longer checks it)."""

    __slots__ = ("tensor", "version", "__weakref__")

    def __init__(self, tensor: torch.Tensor, version: int):
        self.tensor, self.version = tensor, version


def _unpack(packed: _Saved | torch.Tensor) -> torch.Tensor:
    if not isinstance(packed, _Saved):
        return packed
    tensor, version = packed.tensor, packed.version
    if tensor._version != version:
        # The error autograd raises without hooks: gradients from modified inputs are wrong.
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: [{tensor.type()} {list(tensor.shape)}] is at version "
            f"{tensor._version}; expected version {version} instead (saved for backward "
            "inside rrfp's activation meter)")
    return tensor


def _reach(tensor: torch.Tensor) -> list[tuple[int, tuple[int, int]]]:
    """(storage address, (first byte, end byte)) of the bytes a tensor's data can reach in
    each storage that holds it; a tensor subclass that wraps others (a DTensor, a tensor
    of an async collective) reaches what its inner tensors reach."""
    if type(tensor) is not torch.Tensor and is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        inner = (getattr(tensor, name) for name in names)
        return [r for t in inner if isinstance(t, torch.Tensor) for r in _reach(t)]
    storage = tensor.untyped_storage()
    size = tensor.element_size()
    first = tensor.storage_offset() * size
    if tensor.is_contiguous():  # the common case, and cheap
        return [(storage.data_ptr(), (first, first + tensor.nbytes))] if tensor.nbytes else []
    if tensor.numel() == 0:
        return []
    first = last = tensor.storage_offset()
    for extent, stride in zip(tensor.shape, tensor.stride()):
        step = (extent - 1) * stride
        first, last = first + min(step, 0), last + max(step, 0)
    return [(storage.data_ptr(), (first * size, min((last + 1) * size, storage.nbytes())))]


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
