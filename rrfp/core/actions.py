"""The IR every pass reads: torch's own ``_Action`` (stage, kind, microbatch), its kinds,
and the stage-to-stage edges messages travel on.

rrfp keeps torch's action type so that any hint torch can express (a schedule class, a CSV,
a ``{rank: [_Action, ...]}`` dict) is read without translation.
"""

from __future__ import annotations

from typing import NamedTuple

from torch.distributed.pipelining.schedules import _Action, _ComputationType

__all__ = ["_Action", "_ComputationType", "B", "describe", "Edge", "F", "I",
           "INPUT_GRAD_KINDS", "Kind", "kind_of", "OVERLAP_F_B", "REDUCE_GRAD", "W",
           "WEIGHT_GRAD_KINDS"]

F = _ComputationType.FORWARD
B = _ComputationType.FULL_BACKWARD
I = _ComputationType.BACKWARD_INPUT  # noqa: E741 (torch's own name for it)
W = _ComputationType.BACKWARD_WEIGHT
REDUCE_GRAD = _ComputationType.REDUCE_GRAD
OVERLAP_F_B = _ComputationType.OVERLAP_F_B

#: Kinds that send an input gradient upstream; they share one stream per stage.
INPUT_GRAD_KINDS = frozenset({B, I})
#: Kinds that accumulate into parameter ``.grad``; they share one stream per stage so the
#: accumulation order (and so every gradient bit) matches the fixed schedule.
WEIGHT_GRAD_KINDS = frozenset({B, W})

Kind = str
"""How the arbiter groups actions: ``"F"``, ``"BI"`` (B or I), ``"W"``, ``"R"`` (REDUCE_GRAD)."""


def kind_of(action: _Action) -> Kind:
    ctype = action.computation_type
    if ctype == F:
        return "F"
    if ctype in INPUT_GRAD_KINDS:
        return "BI"
    if ctype == W:
        return "W"
    if ctype == REDUCE_GRAD:
        return "R"
    raise ValueError(f"rrfp does not run {action}: give compute actions (F, B, I, W)")


class Edge(NamedTuple):
    """A directed stage-to-stage link: activations go up (src < dst), gradients down."""

    src: int
    dst: int

    @property
    def is_forward(self) -> bool:
        return self.dst > self.src

    def __str__(self) -> str:
        kind = "activation" if self.is_forward else "gradient"
        return f"{kind} {self.src}->{self.dst}"


def describe(action: _Action) -> str:
    """``stage 1 F microbatch 0``: how errors and logs name an action."""
    text = f"stage {action.stage_index} {action.computation_type.value}"
    if action.microbatch_index is not None:
        text += f" microbatch {action.microbatch_index}"
    return text
