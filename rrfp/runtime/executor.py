"""What an action does on this rank's stages: its compute, then the sends of its outputs.

The step loop (``rrfp.core.loop``) decides which action runs and launches the executor's work
for it on the device; the executor knows the stages, not the schedule: everything it
uses is handed to it (the step's inputs, the transport, the receive rings, the meter, the
data-parallel reduction, and the custom functions registered as on torch's runtime, which
replace an action's compute: ``rrfp.runtime.torch_interface``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.pipelining.schedules import _get_profiler_function_name
from torch.distributed.pipelining.stage import _PipelineStageBase
from torch.profiler import record_function

from rrfp._torch_compat import OutputsAtInputBackward, release_sent_outputs
from rrfp.comm.receives import ReceiveRings, shape_header
from rrfp.comm.transport import Transport
from rrfp.core.actions import _Action, B, Edge, F, I, REDUCE_GRAD, W
from rrfp.core.plan import Node
from rrfp.devices.platform import Platform
from rrfp.runtime.data_parallel import DataParallel
from rrfp.runtime.meter import ActivationMeter
from rrfp.runtime.torch_interface import CustomFunctions

LossFn = Callable[[Any, Any, dict[str, Any] | None], torch.Tensor]
"""``(output, target, loss_kwargs) -> loss`` of the last stage (the schedule's)."""


@dataclass
class StepInputs:
    """One step's microbatches, as the first and last stages take them."""

    arg_mbs: list
    kwarg_mbs: list
    target_mbs: list | None
    return_outputs: bool
    loss_kwargs: dict[str, Any] | None


@dataclass
class Reduction:
    """How REDUCE_GRAD treats the step's gradients."""

    data_parallel: DataParallel
    finalize: bool
    """Whether FSDP stages reduce and reshard (torch 2.15's ``finalize_gradients``)."""
    divide_by: int
    """What the stages' gradients are divided by (``n_microbatches`` with ``scale_grads``)."""


@dataclass
class StageExecutor:
    """The work of each action on this rank's stages during one step."""

    stages: dict[int, _PipelineStageBase]
    inputs: StepInputs
    loss: LossFn | None
    """The last stage's loss (None: no loss is computed)."""
    reduction: Reduction
    transport: Transport
    receives: ReceiveRings
    platform: Platform
    custom: CustomFunctions
    clock: Callable[[], float]
    meter: ActivationMeter | None = None
    """The byte meter while this step is metered."""
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    saved_per_microbatch: dict[int, int] = field(default_factory=dict)
    """Per stage, the most bytes one forward saved for backward (metered steps)."""
    sends: list[tuple[int, int, int, float]] = field(default_factory=list)
    """(source stage, destination stage, microbatch, seconds after start) per send."""

    outputs: OutputsAtInputBackward = field(default_factory=OutputsAtInputBackward)
    """The forwards' outputs, weakly, until their input-gradient backward detaches them."""

    running: _Action | None = None
    """The action whose work runs now, or failed (None between actions)."""

    def work(self, node: Node) -> Callable[[], None]:
        def run() -> None:
            self.running = node.action
            self.compute(node)
            for edge in node.sends:
                self.send(node.action, edge)
            self.running = None
        return run

    def completed(self, action: _Action) -> None:
        self.receives.completed(action)

    def compute(self, node: Node) -> None:
        action = node.action
        ctype = action.computation_type
        profiled = torch.autograd.profiler._is_profiler_enabled
        function = self.custom.function_for(action)
        with (record_function(_get_profiler_function_name(action)) if profiled
              else contextlib.nullcontext()):
            if function is not None:
                with self._metered(action):
                    loss = self.custom.run(function, node)
                if loss is not None:
                    self.losses[action.microbatch_index] = loss
                return
            if ctype == F:
                self._forward(node)
            elif ctype in (B, I):
                self._backward(node, full=ctype == B)
            elif ctype == W:
                self.stages[action.stage_index].backward_weight_one_chunk(
                    action.microbatch_index, last_backward=False)
            elif ctype == REDUCE_GRAD:
                reduction = self.reduction
                reduction.data_parallel.reduce(self.stages[action.stage_index],
                                               finalize=reduction.finalize,
                                               divide_by=reduction.divide_by)
            else:
                raise AssertionError(f"unexpected action {action}")
            last_forward = ctype == F and self.stages[action.stage_index].is_last
            self.custom.record(action, self.losses.get(action.microbatch_index)
                               if last_forward else None)

    @contextlib.contextmanager
    def _metered(self, action: _Action) -> Iterator[None]:
        """Around a forward of a metered step: the bytes it saves for backward."""
        meter = self.meter
        if action.computation_type != F or meter is None:
            yield
            return
        with meter.saving() as saved:
            yield
        meter.sample()
        s = action.stage_index
        self.saved_per_microbatch[s] = max(self.saved_per_microbatch.get(s, 0), saved.bytes)

    def _forward(self, node: Node) -> None:
        s, mb = node.stage, node.microbatch
        stage, inputs = self.stages[s], self.inputs
        with self._metered(node.action):
            output = stage.forward_one_chunk(mb, inputs.arg_mbs[mb], inputs.kwarg_mbs[mb],
                                             save_forward_output=inputs.return_outputs)
        self.outputs.forwarded(s, mb, output)
        if stage.is_last and self.loss is not None:
            self.losses[mb] = self.loss(output, inputs.target_mbs[mb], inputs.loss_kwargs)
        if node.hands_to is not None:
            self.stages[node.hands_to].set_local_fwd_input(output, mb)

    def _backward(self, node: Node, full: bool) -> None:
        s, mb = node.stage, node.microbatch
        stage = self.stages[s]
        # last_backward=False everywhere: data-parallel gradient reduction happens at
        # REDUCE_GRAD, in the hint's fixed stage order, never inside a backward.
        stage.backward_one_chunk(mb, loss=self.losses.get(mb) if stage.is_last else None,
                                 full_backward=full, last_backward=False)
        self.outputs.backward_done(stage, mb, full)
        if node.hands_to is not None:
            self.stages[node.hands_to].set_local_bwd_input(stage.get_local_bwd_output(mb), mb)

    def send(self, action: _Action, edge: Edge) -> None:
        stage = self.stages[action.stage_index]
        mb = action.microbatch_index
        ops = stage.get_fwd_send_ops(mb) if edge.is_forward else stage.get_bwd_send_ops(mb)
        tensors = [op.tensor for op in ops]
        self.sends.append((edge.src, edge.dst, mb, self.clock()))
        if edge.is_forward:
            self.receives.sent(edge.src, mb, tensors)
            if self.receives.variable_shapes:
                header = shape_header(tensors)
                if not self.transport.headers_on_host:
                    header = self.platform.upload(header)
                self.transport.send(edge, mb, [header], header=True)
        self.transport.send(edge, mb, tensors)
        if edge.is_forward:  # the transport holds the tensors until their send completes
            release_sent_outputs(stage, mb)
