"""torch's runtime-schedule interface beyond ``step()``, as ScheduleRRFP honours it.

ScheduleRRFP is a ``_PipelineScheduleRuntime``, torch's base of schedules that run an
action order (all its multi-stage schedules), so code written for those runs on it
(``TorchRuntimeInterface``):

* **Loaded orders** (``_load_csv``, ``_prepare_schedule_with_comms``) become the hint.

* **Custom functions** (``register_custom_function``): a callback registered for an
  action kind RRFP runs (F, B, I, W, REDUCE_GRAD) replaces that action's compute, as in
  torch's runtime; RRFP still decides when the action runs (once its inputs have
  arrived) and sends its outputs. A callback written for torch's runtime finds what it
  reads there: the stages, the context's microbatches, the losses through
  ``_maybe_compute_loss``/``_maybe_get_loss``, ``backward_counter``, and the action's
  receive in ``fwd_recv_ops``/``bwd_recv_ops`` (already complete: its wait returns at
  once). Kinds RRFP does not run are refused, saying why.
* **Errors**: where RRFP refuses what torch's schedules also refuse, but says more, its
  error is an instance of both exception types (``IncompatibleStagesError``).
"""

from __future__ import annotations

import abc
import contextlib
import os
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.distributed.pipelining.schedules import (_PipelineContext, _PipelineScheduleRuntime,
                                                    RESHARD, UNSHARD)
from torch.distributed.pipelining.stage import _PipelineStageBase

from rrfp._torch_compat import REDUCTION_WAITS
from rrfp.core.actions import _Action, B, OVERLAP_F_B, W
from rrfp.core.hints import compute_actions, Hint, HintSource, read_csv
from rrfp.core.plan import Node


class IncompatibleStagesError(ValueError, RuntimeError):
    """These stages cannot run under this hint. A ``RuntimeError``, as torch's own
    schedules raise for it, and a ``ValueError``, as RRFP's other refusals of a
    configuration."""


_REFUSED = {
    OVERLAP_F_B: (
        "ScheduleRRFP runs the forward and the backward of an overlapped pair (OVERLAP_F_B) "
        "as two actions, each when it is ready, so no callback can run them together: "
        "register FORWARD and FULL_BACKWARD callbacks instead, or use torch's "
        "ScheduleDualPipeV for the overlap"),
    UNSHARD: ("ScheduleRRFP runs no UNSHARD actions: it unshards every FSDP stage at the "
              "step's start, in stage order, and keeps it unsharded for the whole step"),
    RESHARD: ("ScheduleRRFP runs no RESHARD actions: FSDP stages are reduced and resharded "
              "at their REDUCE_GRAD action (a REDUCE_GRAD callback replaces that)"),
    **{kind: (f"ScheduleRRFP runs no {kind.name} actions: its REDUCE_GRAD completes the "
              "reduction within the action (a REDUCE_GRAD callback replaces that)")
       for kind in REDUCTION_WAITS},
}


def refuse_custom_function(computation_type: Any) -> None:
    """Raise ``ValueError`` saying why for an action kind torch's runtime takes a callback
    for but RRFP does not run."""
    if computation_type in _REFUSED:
        raise ValueError(f"cannot register a custom function for {computation_type}: "
                         f"{_REFUSED[computation_type]}")


class _Arrived:
    """A receive that has completed: RRFP runs an action only once its inputs arrived."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


@contextlib.contextmanager
def receive_posted(fwd_recv_ops: dict, bwd_recv_ops: dict, node: Node) -> Iterator[None]:
    """While a custom function runs ``node``'s action: the message it receives (if any),
    complete, where torch's runtime keeps it (``fwd_recv_ops``/``bwd_recv_ops`` by stage
    and microbatch); what the function leaves there is removed after."""
    key = (node.stage, node.microbatch)
    ops = None
    if node.message is not None:
        ops = fwd_recv_ops if node.message[0].is_forward else bwd_recv_ops
    if ops is not None:
        ops[key] = [_Arrived()]
    try:
        yield
    finally:
        if ops is not None:
            ops.pop(key, None)


@dataclass
class CustomFunctions:
    """What torch's runtime gives the custom functions registered on a schedule, for one
    step: the functions by action kind, their context, and the state they read and extend
    (the losses, the backward counter, the receives by stage and microbatch)."""

    functions: Mapping[Any, Callable]
    context: _PipelineContext
    internal_losses: list
    backward_counter: Counter
    fwd_recv_ops: dict
    bwd_recv_ops: dict

    def function_for(self, action: _Action) -> Callable | None:
        return self.functions.get(action.computation_type)

    def run(self, function: Callable, node: Node) -> torch.Tensor | None:
        """``function`` in place of the action's compute, as torch's runtime runs it;
        returns the loss a last stage's forward computed (it is RRFP's loss too)."""
        losses_before = len(self.internal_losses)
        with receive_posted(self.fwd_recv_ops, self.bwd_recv_ops, node):
            function(node.action, self.context)
        if node.kind == "F" and len(self.internal_losses) > losses_before:
            return self.internal_losses[-1]
        return None

    def record(self, action: _Action, loss: torch.Tensor | None) -> None:
        """After RRFP's own compute of ``action``: keep what torch's runtime keeps for
        custom functions to read (a last stage's loss; per stage, its B and W count)."""
        if loss is not None:
            self.internal_losses.append(loss)
        if action.computation_type in (B, W):
            self.backward_counter[action.stage_index] += 1

    def forget_step(self) -> None:
        """After a failed step: the losses it kept go."""
        self.internal_losses.clear()


class TorchRuntimeInterface(_PipelineScheduleRuntime):
    """torch's runtime-schedule methods on a schedule whose order is a hint (``hint``),
    which ``_replace_hint`` replaces."""

    @property
    @abc.abstractmethod
    def hint(self) -> Hint:
        """The order ready actions are ranked by."""

    @abc.abstractmethod
    def _replace_hint(self, source: HintSource, name: str | None = None) -> None:
        """Make ``source`` the hint from the next step on (``name``: what to call it)."""

    def _load_csv(self, filename: str,
                  format: Literal["compute_only", "compute_comms"] = "compute_only") -> None:
        """torch's: load the schedule of a CSV (one row of actions per rank); here it
        becomes the hint. ``"compute_comms"``: its sends, receives and FSDP actions are
        left out, RRFP derives its communication itself."""
        if format == "compute_only":
            self._replace_hint(filename)
        elif format == "compute_comms":
            self._replace_hint(compute_actions(read_csv(filename)), os.path.basename(filename))
        else:
            raise NotImplementedError(f"{format=} is not implemented")

    def _prepare_schedule_with_comms(
        self, actions: dict[int, list[_Action | None]],
        format: Literal["compute_only", "compute_comms"] = "compute_only") -> None:
        """torch's: run ``actions`` (per rank); here they become the hint (as in
        ``_load_csv``)."""
        if format not in ("compute_only", "compute_comms"):
            raise NotImplementedError(f"{format=} is not implemented")
        self._replace_hint(compute_actions(actions) if format == "compute_comms" else actions)

    @property
    def pipeline_order_with_comms(self) -> dict[int, list[_Action]]:
        """The hint as torch's runtime would run it: with torch's sends and receives."""
        return self.hint.with_communication()

    def register_custom_function(self, computation_type, custom_function) -> None:
        """torch's: ``custom_function(action, ctx)`` replaces the compute of every action
        of ``computation_type`` (F, B, I, W or REDUCE_GRAD); other kinds are refused."""
        refuse_custom_function(computation_type)
        super().register_custom_function(computation_type, custom_function)

    def _assert_unsharded(self, stage: _PipelineStageBase) -> None:
        """torch's check before computing on a stage (custom functions call it): RRFP
        keeps every FSDP stage unsharded for the whole step."""

