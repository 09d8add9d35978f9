"""Readings of a run taken independently of the runtime's own books: the microbatches held,
recounted from an order; the bytes autograd holds for backward; whether forwards ran under
saved-tensor hooks; an error's chain."""

from __future__ import annotations

import threading

import torch


def held_from_order(actions) -> tuple[dict[int, int], int]:
    """Peak microbatches held per stage and by all the stages together, recomputed from an
    order of actions (``_Action`` s or their strings): +1 at F, -1 at the last backward
    piece (B, or W when backward is split). Independent of the arbiter's counters."""
    from torch.distributed.pipelining.schedules import _Action as Action

    held: dict[int, int] = {}
    peaks: dict[int, int] = {}
    total = peak = 0
    for action in actions:
        if isinstance(action, str):
            action = Action.from_str(action)
        kind, stage = action.computation_type.value, action.stage_index
        change = {"F": 1, "B": -1, "W": -1}.get(kind, 0)
        if change == 0:
            continue
        held[stage] = held.get(stage, 0) + change
        total += change
        assert held[stage] >= 0, f"{action}: stage {stage} releases a microbatch it never held"
        peaks[stage] = max(peaks.get(stage, 0), held[stage])
        peak = max(peak, total)
    assert total == 0 and all(h == 0 for h in held.values()), "microbatches still held at the end"
    return peaks, peak


class SavedTensorBytes:
    """The bytes autograd holds for backward on this process, as a user would meter them:
    saved-tensor hooks entered around each watched module's forward (a pre/post forward
    hook pair) wrap every saved tensor that is not a parameter in a record that adds its
    bytes to a live count and subtracts them when the record is collected (a tensor saved
    by two nodes counts twice: autograd holds it twice). ``peak``: the most bytes alive at
    once since ``reset_peak``. Unlike ``rrfp.runtime.meter.ActivationMeter`` the record holds the
    saved tensor itself, as simple hooks do, and nothing of the scheduler is consulted."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._parameters: set[int] = set()
        self._contexts: list = []
        self.live = 0
        self.peak = 0

    def watch(self, module: torch.nn.Module) -> None:
        """Meter what ``module``'s forwards save (its parameters' storages excluded)."""
        self._parameters.update(p.untyped_storage().data_ptr() for p in module.parameters())
        module.register_forward_pre_hook(self._enter)
        module.register_forward_hook(self._exit)

    def reset_peak(self) -> None:
        """Take the peak anew from what is alive now (at a step's start: what earlier steps
        left alive still counts, as it still takes memory)."""
        with self._lock:
            self.peak = self.live

    def _enter(self, module, args) -> None:
        context = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack_record)
        context.__enter__()
        self._contexts.append(context)

    def _exit(self, module, args, output) -> None:
        self._contexts.pop().__exit__(None, None, None)

    def _pack(self, tensor: torch.Tensor):
        if tensor.untyped_storage().data_ptr() in self._parameters:
            return tensor
        size = tensor.nelement() * tensor.element_size()
        with self._lock:
            self.live += size
            self.peak = max(self.peak, self.live)
        return _SavedRecord(tensor, lambda: self._collected(size))

    def _collected(self, size: int) -> None:
        with self._lock:
            self.live -= size


class _SavedRecord:
    """A saved tensor, and what to do when autograd lets go of it."""

    def __init__(self, tensor: torch.Tensor, on_collection) -> None:
        self.tensor = tensor
        self._on_collection = on_collection

    def __del__(self) -> None:
        self._on_collection()


def _unpack_record(record):
    return record.tensor if isinstance(record, _SavedRecord) else record


class HookProbe(torch.nn.Module):
    """A block that records, at each forward, whether saved-tensor hooks are installed."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner
        self.hooked: list[bool] = []

    def forward(self, x):
        self.hooked.append(torch._C._autograd._top_saved_tensors_default_hooks(False) is not None)
        return self.inner(x)


def error_chain(error: BaseException | None) -> str:
    """An exception and its causes, as one line each."""
    lines = []
    while error is not None:
        lines.append(f"{type(error).__name__}: {error}")
        error = error.__cause__ or error.__context__
    return " <- ".join(lines)


def rrfp_threads() -> list[str]:
    """The names of this process's rrfp threads (each is named ``rrfp-...``), sorted."""
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("rrfp-"))
