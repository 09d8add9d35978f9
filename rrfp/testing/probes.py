"""Readings of a run taken independently of the runtime's own books: the microbatches held,
recounted from an order; whether forwards ran under saved-tensor hooks; an error's chain."""

from __future__ import annotations

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
