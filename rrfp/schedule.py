"""ScheduleRRFP: the readiness-first pipeline schedule for torch.distributed.pipelining.

Whenever the rank is free it runs the ready action that ranks highest in a hint (any
torch schedule, a CSV, a dict, or the BF/BFW rules); it never waits on an unready action
while another is ready. Gradients and losses are bitwise those of torch's fixed schedule
with the same hint (see ``rrfp.arbiter`` for why).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel
from torch.distributed.pipelining.schedules import (
    _check_torch_compile_compatibility,
    _get_profiler_function_name,
    _PipelineContext,
)
from torch.distributed.pipelining.stage import _DTensorMeta, _PipelineStageBase
from torch.distributed.pipelining.microbatch import _split_tensor, TensorChunkSpec
from torch.profiler import record_function

from rrfp._torch_compat import (check_first_stage_inputs, clear_after_failure,
                                release_sent_outputs)
from rrfp.arbiter import (Arbiter, ByteLimits, check_deadlock_free, check_limits,
                          first_step_limits, fixed_peak_bytes, limits_within_bytes,
                          MemoryLimits)
from rrfp.hints import (
    _Action,
    B,
    build_hint,
    declares_split_backward,
    Edge,
    F,
    Hint,
    HintSource,
    I,
    infer_layout,
    REDUCE_GRAD,
    W,
)
from rrfp.coordination import (COORDINATIONS, CoordinationGroup, make_coordinator,
                               uncovered_sharded_parameter)
from rrfp.device import CudaDevice, EmulatedDevice, HostDevice, Wakeup
from rrfp.loop import Arrival, DEFAULT_LAUNCH_DEPTH, PipelineStallError, StepLoop
from rrfp.memory import ActivationMeter, DEFAULT_METER_EVERY, free_device_bytes
from rrfp.policy import default_policy, History, make_policy
from rrfp.receives import ReceiveRings, shape_header
from rrfp.settings import parse_buffer_limit, parse_launch_depth, parse_policy
from rrfp.stats import Span, StepStats
from rrfp.torch_interface import (IncompatibleStagesError, receive_posted,
                                  TorchRuntimeInterface)
from rrfp.transport import (create_channels, FAILURE_POLL_S, PeerFailedError, ReceiveStreams,
                            SendDelay, Transport)

logger = logging.getLogger(__name__)



class ScheduleRRFP(TorchRuntimeInterface):
    """Runtime-readiness-first pipeline schedule (arXiv 2605.18750).

    A torch ``_PipelineScheduleRuntime`` whose action order is a hint (see
    ``rrfp.torch_interface`` for what of torch's runtime interface it honours).

    Args:
        stages: this rank's ``PipelineStage`` (or a list of them, one per local model chunk,
            in any order: they run in stage order), placed as the hint places them (loop:
            stage s on rank s % pp_size; V for ZBVZeroBubble and DualPipeV).
        n_microbatches: microbatches per step.
        loss_fn: loss of the last stage's output and the target, per microbatch.
        hint: the order to rank ready actions by: a name torch's ``get_schedule_class``
            accepts (1F1B, GPipe, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble,
            ZBVZeroBubble, DualPipeV), a torch schedule class, a path to a CSV in torch's
            compute-only format, a ``{rank: [_Action | None, ...]}`` dict, or the paper's
            rules ``"BF"``/``"BFW"``. ``None``: the fixed schedule torch would use for the
            placement (1F1B, Interleaved1F1B, or ZBVZeroBubble for V).
        buffer_limit: activations held (from a microbatch's F until its last backward
            piece, B or W), per stage and per rank: ``"hint"`` (the fixed schedule's own
            peaks, per stage and per rank: no more activation memory than the hint),
            ``"hint+k"`` (k more microbatches of each), ``"Nx hint"`` (N times them), an
            int n (n microbatches per stage and per rank; ``"n"`` too; see
            ``rrfp.arbiter.resolve_buffer_limits``); or in bytes: ``"busiest"`` (every
            rank may hold the bytes the fixed schedule's busiest rank holds at its peak,
            so the job's peak is unchanged), a per-rank budget such as ``"512MiB"`` or
            ``"12GiB"``, or ``"auto"`` (CUDA: the device's free memory at the second step
            less ``rrfp.memory.AUTO_MARGIN`` of its total). A byte setting runs the first
            training step at ``"hint"``, measures each stage's bytes per microbatch there,
            and from the second step on uses the largest microbatch limits that keep
            every rank within its bytes, never below the hint's own peaks
            (``rrfp.arbiter.limits_within_bytes``; ``ValueError`` on every rank where a
            budget is below what the fixed order itself holds); fixed from then on,
            logged, and in ``StepStats``.
        stall_timeout: seconds without any ready action before the step raises
            ``PipelineStallError`` naming what each stream waits for.
        scale_grads, args_chunk_spec, kwargs_chunk_spec, output_merge_spec: as in torch's
            schedules.
        policy: how to pick among ready actions (see ``rrfp.policy``; names are
            case-insensitive); None: the rule of
            a BF/BFW hint, else ``"lookahead"`` at the hint's memory; with slack
            ``"critical"`` for one stage per rank, ``"hint"`` for ZBVZeroBubble and
            InterleavedZeroBubble, ``"lookahead"`` for other hints with several
            (``rrfp.policy.default_policy``).
        coordination_group: the group of ranks that must run the same action sequence
            because the stage's compute issues collectives on them (the TP group, the EP
            group, or one spanning both), of any backend: RRFP agrees over a private gloo
            twin of it, so agreeing costs no device synchronization. None: no such group.
        coordination: how that group settles on each action: ``"leader"`` (its first rank
            decides) or ``"agree"`` (all-gather proposals, defer on disagreement).
        send_delay: emulated link latency, ``(edge, microbatch) -> seconds`` to hold each
            outgoing message (for studies and tests; messages on a channel stay in order).
        launch_depth: how many launched actions the device may hold before the rank
            decides again (``None``, ``0`` or ``"none"``: no bound). The rank decides what
            to run next when its device is free, so that choices see the latest arrivals; a
            depth above 1 hides the CPU's launch cost behind the device's work, at the price
            of choosing that much earlier. Default ``DEFAULT_LAUNCH_DEPTH``, from
            ``benchmarks/results/launch_depth.md``.
        reorder_ahead: let any ready action be launched onto a busy device (default
            False: ahead of the device only the policy's own next action is launched, the
            hint's next for all policies but ``"critical"``; deviations are chosen when
            the device is idle, on the latest arrivals). With
            ``launch_depth=None`` this decides whenever a launch returns: for studies.
        variable_shapes: microbatches may differ in shape (e.g. in sequence length): each
            activation message is then preceded by a small shape header on its channel,
            and its receive buffers are allocated when the header arrives (on NCCL the
            headers go on a gloo side channel per channel, read on the host). Feed such
            microbatches pre-split: ``step(arg_mbs=..., target_mbs=...)``. Off by
            default: with fixed shapes no header is sent and no side channel is created.
        device: where actions run. ``None``: the stages' CUDA stream for CUDA stages,
            synchronous execution for CPU stages. ``rrfp.device.EmulatedDevice(...)``: an
            emulated asynchronous device for CPU stages (tests and studies).
        meter_activations: measure the bytes of the activations saved for backward
            (``StepStats.peak_activation_bytes``, ``rrfp.memory.ActivationMeter``) in the
            first training step and every ``meter_every``-th step. False leaves autograd's
            saving untouched and reports None (not with a byte ``buffer_limit``, which
            needs the first step's bytes). The memory limit holds either way: it counts
            microbatches.
        meter_every: meter every this-many-th step (and the first training step); 1:
            every step. The meter costs CPU time per saved tensor (docs/memory.md); the
            steps between report ``peak_activation_bytes=None`` and the last metered
            step's bytes per microbatch.
    """

    def __init__(
        self,
        stages: _PipelineStageBase | list[_PipelineStageBase],
        n_microbatches: int,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        *,
        hint: HintSource | None = None,
        buffer_limit: str | int = "hint",
        stall_timeout: float = 300.0,
        args_chunk_spec: tuple[TensorChunkSpec, ...] | None = None,
        kwargs_chunk_spec: dict[str, TensorChunkSpec] | None = None,
        output_merge_spec: dict[str, Any] | tuple[Any] | None = None,
        scale_grads: bool = True,
        policy: str | None = None,
        coordination_group: dist.ProcessGroup | None = None,
        coordination: str = "leader",
        send_delay: SendDelay | None = None,
        launch_depth: int | str | None = DEFAULT_LAUNCH_DEPTH,
        reorder_ahead: bool = False,
        device: EmulatedDevice | None = None,
        variable_shapes: bool = False,
        meter_activations: bool = True,
        meter_every: int = DEFAULT_METER_EVERY,
    ):
        policy = parse_policy(policy)
        launch_depth = parse_launch_depth(launch_depth)
        if coordination not in COORDINATIONS:
            raise ValueError(f"unknown coordination {coordination!r}: use one of {list(COORDINATIONS)}")
        # In stage order, whatever order they come in: torch's first-step shape inference
        # walks the list with blocking receives, so ranks listing their stages in different
        # orders (e.g. [rank + 2, rank]) would each wait on the other before any check.
        stages = sorted(stages, key=lambda stage: stage.stage_index) if isinstance(
            stages, (list, tuple)) else [stages]
        if not stages:
            raise ValueError("ScheduleRRFP needs at least one stage")
        if not stall_timeout > 0:
            raise ValueError(f"stall_timeout must be > 0 seconds, got {stall_timeout}")
        stage_device = torch.device(stages[0].device)  # torch's stages also take a str
        if send_delay is not None and stage_device.type == "cuda":
            raise ValueError(
                "send_delay emulates link latency for CPU studies: its sender thread's "
                "current CUDA stream is not the compute stream, so it could send an output "
                "before the compute stream wrote it; use it with CPU stages")
        limit_spec = parse_buffer_limit(buffer_limit)
        if limit_spec.in_bytes and not meter_activations:
            raise ValueError(
                f"buffer_limit={buffer_limit!r} is counted in bytes, which the first step "
                "measures with the activation meter: leave meter_activations on (it meters "
                "only every meter_every-th step), or give the limit in microbatches")
        if limit_spec.auto and stage_device.type != "cuda":
            raise ValueError(
                f"buffer_limit='auto' reads the free memory of a CUDA device; these stages are "
                f"on {stage_device}: give a byte budget per rank (e.g. '512MiB') or 'busiest'")
        if isinstance(meter_every, bool) or not isinstance(meter_every, int) or meter_every < 1:
            raise ValueError(f"meter_every must be an int >= 1 (1: meter every step), got "
                             f"{meter_every!r}")
        if device is not None and stage_device.type != "cpu":
            raise ValueError(f"the emulated device runs CPU stages; these stages are on "
                             f"{stage_device}: pass device=None to run on their stream")
        super().__init__(
            stages=stages,
            n_microbatches=n_microbatches,
            loss_fn=loss_fn,
            args_chunk_spec=args_chunk_spec,
            kwargs_chunk_spec=kwargs_chunk_spec,
            output_merge_spec=output_merge_spec,
            scale_grads=scale_grads,
        )
        local = sorted(stage.stage_index for stage in stages)
        layout = infer_layout(self.rank, self.pp_group_size, self._num_stages, local)
        if hint is None:
            hint = {"v": "ZBVZeroBubble", "loop": "1F1B" if len(stages) == 1 else "Interleaved1F1B"}.get(layout)
            if hint is None:
                raise ValueError(
                    f"stages {local} on pipeline rank {self.rank} follow neither the loop "
                    "nor the V placement: pass a hint (CSV or dict) that places them"
                )
        self._layout = layout
        self._buffer_limit = buffer_limit
        self._limit_in_bytes = limit_spec.in_bytes
        self._policy_given = policy
        self._fixed_order = policy == "fixed"
        self._history = History()
        if declares_split_backward(hint):  # checked first, as torch's own such schedules do
            _refuse_compiled_stages(stages, hint)
        self._adopt_hint(self._build_hint(hint))
        self.stall_timeout = float(stall_timeout)

        self.stage_index_to_group_rank = dict(self._hint.stage_to_rank)
        for stage in stages:
            stage.stage_index_to_group_rank = self.stage_index_to_group_rank
        if len(stages) == 1:
            self._stage = stages[0]
            """The one stage, as torch's single-stage schedules name it."""
        _check_fsdp_wraps_the_stage(stages)
        _warn_about_shared_parameters(stages)
        self._ddp = self._unwrap_ddp(stages)
        self._stage_by_index = {stage.stage_index: stage for stage in stages}
        self._global_ranks = dist.get_process_group_ranks(stages[0].group or dist.group.WORLD)

        self.launch_depth = math.inf if launch_depth is None else launch_depth
        self.reorder_ahead = bool(reorder_ahead)
        self._device = device if device is not None else (
            CudaDevice(stage_device) if stage_device.type == "cuda" else HostDevice())
        self._wakeup = Wakeup()
        self.variable_shapes = bool(variable_shapes)
        self._receives = ReceiveRings(self.variable_shapes)
        self._meter = ActivationMeter() if meter_activations else None
        self.meter_every = meter_every
        self._step_meter: ActivationMeter | None = None
        """The meter while a step is metered, else None."""
        self.activation_bytes_per_microbatch: dict[int, int] | None = None
        """Per local stage, the most bytes one microbatch's forward saved for backward in
        the last metered training step (None before one)."""
        self._transport = Transport(create_channels(self._hint, stages[0].group, stage_device,
                                                    header_channels=bool(variable_shapes)),
                                    self._wakeup, send_delay=send_delay,
                                    receive_streams=ReceiveStreams(stage_device))
        self._finalize_gradients = True
        self._coordination_group = coordination_group
        self._coordination_twin = (
            CoordinationGroup(coordination_group, self.stall_timeout)
            if coordination_group is not None and dist.get_world_size(coordination_group) > 1
            else None)
        self._collectives_checked = False
        self.coordination = coordination
        self._failure: str | None = None
        self._steps_run = 0
        self.last_step_stats: StepStats | None = None
        local = self._hint.stages_on(self.rank)
        logger.info(
            "ScheduleRRFP on pipeline rank %d: hint %s (policy %s, %s placement), memory "
            "limits %s per stage and %d on the rank (the hint holds %s and %d), launch depth "
            "%s, %s. %s", self.rank, self._hint.name, self.policy, self._hint.layout,
            {s: self.buffer_limits.per_stage[s] for s in local},
            self.buffer_limits.per_rank[self.rank],
            {s: self._hint.peak_in_flight()[s] for s in local},
            self._hint.rank_peaks()[self.rank], self.launch_depth, type(self._device).__name__,
            self.limit_summary,
        )

    def _build_hint(self, source: HintSource, name: str | None = None) -> Hint:
        return build_hint(source, num_ranks=self.pp_group_size, num_stages=self._num_stages,
                          n_microbatches=self._n_microbatches, layout=self._layout,
                          given_name=name)

    def _adopt_hint(self, hint: Hint) -> None:
        """Rank ready actions by ``hint`` (placing this rank's stages) from the next step."""
        local = [stage.stage_index for stage in self._stages]
        expected = list(hint.stages_on(self.rank))
        if expected != local:
            raise ValueError(
                f"hint {hint.name!r} places stages {expected} on pipeline rank "
                f"{self.rank} ({hint.layout} placement), but this rank holds stages "
                f"{local}: build the stages with the hint's placement or pick a hint "
                f"for this placement ({self._layout})"
            )
        if hint.has_split_backward:
            _refuse_compiled_stages(self._stages, hint.name)
        check_deadlock_free(hint)
        self._hint = hint
        self._forward_only_hint = hint.forward_only()
        self.pipeline_order = {r: list(acts) for r, acts in hint.orders.items()}
        # A byte setting's first step runs at the hint's memory: its bytes are unknown yet.
        self.buffer_limits = first_step_limits(self._buffer_limit, hint,
                                               fixed_order=self._fixed_order)
        self.byte_limits: ByteLimits | None = None
        """Where ``buffer_limit`` is in bytes: the microbatch limits derived from the first
        step's bytes (from the second step on), with the budgets they keep."""
        self.policy = self._policy_given or default_policy(hint, self.buffer_limits)
        self.limit_summary = (
            f"buffer_limit={self._buffer_limit!r} is counted in bytes: the first training "
            "step runs at the hint's own limits and measures each stage's bytes per "
            "microbatch; the microbatch limits that keep every rank within its bytes follow "
            "from the second step on (logged then)." if self._limit_in_bytes
            else limit_summary(self._buffer_limit, self.buffer_limits, hint, self.rank))

    def _replace_hint(self, source: HintSource, name: str | None = None) -> None:
        """Make ``source`` the hint from the next step on: the CSV or actions torch's
        runtime would load become the order RRFP ranks by. Call it on every rank of the
        pipeline, between steps; the placement must stay the constructor's (the channels
        are built for it)."""
        hint = self._build_hint(source, name)
        if dict(hint.stage_to_rank) != dict(self._hint.stage_to_rank):
            raise ValueError(
                f"hint {hint.name!r} places stages {dict(hint.stage_to_rank)} on pipeline "
                f"ranks, where this ScheduleRRFP was built for "
                f"{dict(self._hint.stage_to_rank)}: build a ScheduleRRFP with hint="
                f"{hint.name!r} instead")
        self._adopt_hint(hint)
        logger.info("ScheduleRRFP on pipeline rank %d: hint now %s (policy %s), memory limits "
                    "%s per stage. %s", self.rank, hint.name, self.policy,
                    {s: self.buffer_limits.per_stage[s] for s in hint.stages_on(self.rank)},
                    self.limit_summary)

    @property
    def hint(self) -> Hint:
        return self._hint

    @property
    def history(self) -> History:
        """What earlier steps showed this rank (device durations per stage and kind,
        arrival times): what the ``lookahead`` and ``critical`` policies decide by."""
        return self._history

    def _step_microbatches(
        self,
        arg_mbs: list | None = None,
        kwarg_mbs: list | None = None,
        target_mbs: list | None = None,
        losses: list | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
    ):
        if self._failure is not None:
            raise RuntimeError(
                f"this ScheduleRRFP cannot run another step ({self._failure}); its channels "
                "are closed: build a new ScheduleRRFP on every rank of the pipeline, which "
                "connects fresh ones"
            )
        arg_mbs, kwarg_mbs = self._check_inputs(arg_mbs, kwarg_mbs, target_mbs, losses)
        if not self._collectives_checked:
            # Unsharded, a parameter still a DTensor is sharded over an intra-stage group.
            # torch's shape inference reshards FSDP modules again.
            self._prepare_data_parallel()
            self._check_intra_stage_collectives()
        self._initialize_stages(
            arg_mbs[0], kwarg_mbs[0], target_mbs[0] if target_mbs is not None else None,
            loss_kwargs,
        )
        fsdp_modules = self._prepare_data_parallel()
        if not self._collectives_checked:
            self._check_variable_shapes()
            self._collectives_checked = True
        if self._limit_in_bytes and self.byte_limits is None and (
                self.activation_bytes_per_microbatch is not None):
            self._fix_byte_limits()
        for stage in self._stages:
            if stage.is_first:  # a wrong input raises here, before the step communicates
                check_first_stage_inputs(stage, arg_mbs)
        self._step_meter = self._meter if self._meter is not None and (
            self._steps_run % self.meter_every == 0
            or self.activation_bytes_per_microbatch is None) else None
        if self._step_meter is not None:
            self._step_meter.reset(p for stage in self._stages for p in stage.submod.parameters())
        origin = time.perf_counter()

        def clock() -> float:
            return time.perf_counter() - origin

        if self._has_backward:
            hint, limits = self._hint, self.buffer_limits
            policy = make_policy(self.policy, history=self._history, clock=clock)
        else:  # forward only: no memory to balance, plain readiness-first
            hint, limits, policy = self._forward_only_hint, None, make_policy("hint")
        arbiter = Arbiter(hint, self.rank, limits=limits, policy=policy)
        executor = _StageExecutor(self, clock, arg_mbs, kwarg_mbs, target_mbs, return_outputs,
                                  loss_kwargs, losses)
        coordinator = (make_coordinator(self.coordination, self._coordination_twin,
                                        self.stall_timeout)
                       if self._coordination_twin is not None else None)
        loop = StepLoop(
            arbiter, self._device, executor,
            arrivals=lambda: [Arrival(r.edge, r.microbatch, r.seen - origin)
                              for r in self._receives.arrived(self._transport.collect())],
            clock=clock, launch_depth=self.launch_depth, reorder_ahead=self.reorder_ahead,
            stall_timeout=self.stall_timeout,
            describe_rank=f"pipeline rank {self.rank} (global rank {dist.get_rank()})",
            describe_peer=lambda peer: f"global rank {self._global_ranks[peer]}",
            coordinator=coordinator, block=self._wait,
        )
        self._device.begin_step(origin, self._wakeup)
        operations = self._transport.operations
        try:
            self._receives.start(self._transport, hint, self._stage_by_index,
                                 self.buffer_limits.per_stage, training=self._has_backward)
            for timeout in loop.run():
                self._wait(timeout)
            if coordinator is not None:
                coordinator.finish()
            self._transport.finish_sends(self.stall_timeout)
            self._receives.finish()
            if self._has_backward and self._step_meter is not None:
                self.activation_bytes_per_microbatch = {
                    s: executor.saved_per_microbatch.get(s, 0) for s in self._stage_by_index}
        except PeerFailedError as e:
            self._abandon(e)
            raise self._peer_failed(e, loop) from e
        except BaseException as e:
            if self._usable_after_failure(operations, coordinator):
                raise
            # A peer's failure may be what broke this step (a closed gloo connection): say
            # so, naming it; otherwise this rank failed first, and tells the others.
            try:
                self._transport.check_peers(force=True)
            except PeerFailedError as peer:
                self._abandon(peer)
                raise self._peer_failed(peer, loop) from e
            self._transport.publish_failure(
                f"pipeline rank {self.rank} (global rank {dist.get_rank()}) failed its step: "
                f"{type(e).__name__}: {e}")
            self._abandon(e)
            if isinstance(e, TimeoutError):
                raise PipelineStallError(f"pipeline rank {self.rank}: {e}") from e
            raise
        finally:
            self.last_step_stats = _step_stats(self, loop, executor, coordinator, clock(),
                                               self._transport.take_sent())
            self._steps_run += 1
        if self._has_backward:
            loop.teach(self._history)
        else:  # no gradient reduction will reshard them
            for module in fsdp_modules:
                module.reshard()
        if self._loss_fn is not None and any(s.is_last for s in self._stages):
            self._internal_losses = [executor.losses[m] for m in range(self._n_microbatches)]
        self._update_losses(self._stages, losses)

    def _fix_byte_limits(self) -> None:
        """Turn the byte setting into microbatch limits, from the first step's bytes per
        microbatch of every stage (exchanged over the pipeline group: the busiest rank may
        be another): the same limits on every rank, or the same ``ValueError``."""
        spec = parse_buffer_limit(self._buffer_limit)
        group = self._stages[0].group
        stages, ranks = self._num_stages, self.pp_group_size
        exchanged = torch.zeros(stages + ranks, dtype=torch.int64, device=self._stages[0].device)
        for s, nbytes in self.activation_bytes_per_microbatch.items():
            exchanged[s] = nbytes
        if spec.auto:
            exchanged[stages + self.rank] = free_device_bytes(self._stages[0].device)
        elif spec.budget_bytes is not None:
            exchanged[stages + self.rank] = spec.budget_bytes
        dist.all_reduce(exchanged, group=group)
        values = exchanged.tolist()
        per_microbatch = {s: values[s] for s in range(stages)}
        if spec.busiest:
            busiest = max(fixed_peak_bytes(self._hint, per_microbatch).values())
            budgets = {r: busiest for r in range(ranks)}
        else:
            budgets = {r: values[stages + r] for r in range(ranks)}
        try:
            self.byte_limits = limits_within_bytes(self._hint, per_microbatch, budgets)
        except ValueError as e:
            raise ValueError(f"buffer_limit={self._buffer_limit!r}: {e}") from None
        self.buffer_limits = self.byte_limits.limits
        check_limits(self.buffer_limits, self._hint, self._buffer_limit,
                     fixed_order=self._fixed_order)
        self.policy = self._policy_given or default_policy(self._hint, self.buffer_limits)
        local = self._hint.stages_on(self.rank)
        self.limit_summary = byte_limit_summary(self._buffer_limit, self.byte_limits, self.rank,
                                                local)
        logger.info(
            "ScheduleRRFP on pipeline rank %d: from the first step's bytes per microbatch %s, "
            "memory limits %s per stage and %d on the rank (policy %s). %s", self.rank,
            {s: per_microbatch[s] for s in local},
            {s: self.buffer_limits.per_stage[s] for s in local},
            self.buffer_limits.per_rank[self.rank], self.policy, self.limit_summary)
        if self.rank in self.byte_limits.over_budget():
            message = (
                f"buffer_limit={self._buffer_limit!r}: pipeline rank {self.rank} keeps the "
                f"hint's own peaks, which may hold up to "
                f"{self.byte_limits.allowed_bytes[self.rank]} B of activations in a mix other "
                f"than the fixed order's, above its budget of "
                f"{self.byte_limits.budgets[self.rank]} B (the fixed order holds "
                f"{self.byte_limits.fixed_peak_bytes[self.rank]} B): lower limits could "
                "deadlock; give that rank more bytes to be sure")
            warnings.warn(message, stacklevel=3)
            logger.warning(message)

    def _usable_after_failure(self, operations: int, coordinator) -> bool:
        """After this rank's step failed: whether it had issued no receive, send or
        coordination round in it (its transport had issued ``operations`` at the start).
        Then its channels and its peers are as before the step, and the schedule stays
        usable, as torch's schedules do after an error raised before their first send or
        receive: what the step left on the device and in the stages is cleared, and no
        failure is told to the peers (they wait, as for a rank that has not stepped yet).
        Otherwise the step's failure is handled as one mid-step (``_abandon``)."""
        self._device.close(self.stall_timeout)  # nothing launched runs any more
        if self._transport.operations != operations or (
                coordinator is not None and coordinator.rounds):
            return False
        self._let_go_of_the_step()
        return True

    def _peer_failed(self, error: PeerFailedError, loop: StepLoop) -> PeerFailedError:
        """``error``, saying also what this rank was waiting for."""
        return PeerFailedError(
            f"pipeline rank {self.rank} (global rank {dist.get_rank()}) stops its step: "
            f"{error}\nit was waiting for:\n" + "\n".join(loop.waiting()), error.failed_rank)

    def _wait(self, timeout: float) -> None:
        """Wait up to ``timeout`` for an arrival or a completion; meanwhile check, every
        ``FAILURE_POLL_S``, whether another rank of the pipeline failed (then raise
        ``PeerFailedError`` naming it: on NCCL nothing else would tell this rank)."""
        end = time.perf_counter() + timeout
        while True:
            self._transport.check_peers()
            left = end - time.perf_counter()
            if left <= 0 or self._wakeup.wait(min(left, FAILURE_POLL_S)):
                return

    def _abandon(self, error: BaseException) -> None:
        """After a failed step (its failure already published, or a peer's seen): abort
        the channels, all at once, so that pending receives fail (on gloo the peers' too),
        and stop the device; free the unfinished microbatches' activations; refuse
        further steps."""
        self._failure = f"a step failed with {type(error).__name__} on pipeline rank {self.rank}"
        try:
            self._close(failed=True)
        except RuntimeError as e:  # the step's own error is the one to raise
            logger.warning("pipeline rank %d: %s", self.rank, e)
            return  # a thread still running may read the stages' caches
        # Their graphs, and what those saved, go now rather than at the stages' next step.
        self._let_go_of_the_step()

    def _let_go_of_the_step(self) -> None:
        """After a failed step: unbind its receive buffers, drop its losses and what it
        left in the stages."""
        self._receives.finish()
        self._internal_losses.clear()
        for stage in self._stages:
            clear_after_failure(stage)

    def close(self, timeout: float = 10.0) -> None:
        """Stop this schedule's threads and close its channels (idempotent).

        After healthy steps the sends still in flight complete first (within
        ``stall_timeout``: on NCCL a step may return before the peer has received its
        last messages), then the channels are shut down; after a failed step they were
        aborted. Raises ``RuntimeError`` if such a send fails or does not complete (the
        channels are then aborted), or naming any thread still alive after ``timeout``
        seconds.
        """
        self._close(failed=False, timeout=timeout)

    def _close(self, failed: bool, timeout: float = 10.0) -> None:
        self._failure = self._failure or "the schedule was closed"
        try:
            alive = self._transport.close(timeout, failed=failed,
                                          send_timeout=self.stall_timeout)
        finally:
            device_alive = self._device.close(timeout)
        alive += device_alive
        if alive:
            raise RuntimeError(f"threads still running after close(): {[t.name for t in alive]}")

    @staticmethod
    def _unwrap_ddp(stages: list[_PipelineStageBase]) -> dict[int, DistributedDataParallel]:
        """Run DDP-wrapped stages on the wrapped module; return the wrappers by stage.

        DDP talks to its group from inside forward (bucket rebuild, buffer broadcast) and
        backward (gradient all-reduce), at points whose timing differs between replicas
        under RRFP. So RRFP computes on ``ddp.module`` and reduces the gradients itself at
        REDUCE_GRAD, in fixed stage order, as DDP's default hook does.
        """
        wrappers = {}
        for stage in stages:
            if isinstance(stage.submod, DistributedDataParallel):
                ddp = stage.submod
                if ddp.broadcast_buffers and any(True for _ in ddp.module.buffers()):
                    raise ValueError(
                        f"stage {stage.stage_index} is wrapped in DDP with broadcast_buffers="
                        "True and has buffers, which DDP broadcasts in every forward: under "
                        "RRFP replicas run forwards at different times; construct "
                        "DistributedDataParallel(..., broadcast_buffers=False) or use FSDP")
                # DDP keeps hooks registered with register_comm_hook in this list; RRFP
                # reduces the gradients itself and could not run them.
                if ddp._comm_hooks:
                    raise ValueError(
                        f"stage {stage.stage_index} is wrapped in DDP with a communication "
                        "hook, which RRFP cannot run: it reduces DDP gradients itself, at "
                        "REDUCE_GRAD in fixed stage order (DDP's default: average over "
                        "replicas); remove the hook, or use FSDP")
                wrappers[stage.stage_index] = ddp
                stage.submod = ddp.module
        return wrappers

    def _check_intra_stage_collectives(self) -> None:
        """Refuse parameters sharded over a group that no coordination group covers, on
        every rank of the pipeline.

        Called at the first step with FSDP modules unsharded and before torch's shape
        inference, whose forward would run the stages' first intra-stage collectives (an
        expert-parallel all-to-all). A parameter still a DTensor there is sharded over
        a group whose collectives run inside the stage's compute (tensor or expert
        parallel); its ranks must run the same action sequence, which only a
        ``coordination_group`` over them ensures; without one they would interleave
        actions differently and issue mismatched collectives (a hang, or gloo's
        "collective mismatch" abort). The verdicts are exchanged over the pipeline, so a
        rank whose own stages shard nothing (a dense stage next to MoE ones) refuses
        too, rather than waiting in shape inference for a peer that stopped.
        """
        covered = set(dist.get_process_group_ranks(self._coordination_group)
                      if self._coordination_group is not None else [dist.get_rank()])
        uncovered = uncovered_sharded_parameter(
            ((f"stage {stage.stage_index}'s {name!r}", p) for stage in self._stages
             for name, p in stage.submod.named_parameters()), covered)
        verdict = "" if uncovered is None else (
            f"parameter {uncovered[0]} is a DTensor sharded over global ranks "
            f"{uncovered[1]} (tensor or expert parallel), whose collectives run inside the "
            "stage's compute, but "
            + ("no coordination_group is given" if self._coordination_group is None
               else f"the coordination_group covers only {sorted(covered)}")
            + ": pass coordination_group=dist.new_group(<those ranks>, backend='gloo') "
            "(one group spanning every such mesh of the stages) so that they run the "
            "same actions")
        verdicts = self._transport.gather_over_pipeline(
            "intra-stage-collectives", verdict, self.stall_timeout)
        me = dist.get_rank()
        if verdict:
            raise ValueError(verdict)
        refusing = sorted(rank for rank, said in verdicts.items() if said and rank != me)
        if refusing:
            raise ValueError(f"global rank {refusing[0]} of this pipeline refuses its stages, "
                             f"so this rank cannot run either: {verdicts[refusing[0]]}")

    def _check_variable_shapes(self) -> None:
        """Variable shapes: received DTensor activations are rebuilt with the global shape
        found by shape inference, which varies, so they are refused; torch's per-microbatch
        metadata checks (TORCH_DISTRIBUTED_DEBUG=DETAIL) compare every microbatch with the
        first one, so they are turned off, saying so."""
        if not self.variable_shapes:
            return
        for stage in self._stages:
            for infos in (stage.args_recv_info.get(0, ()), stage.grad_recv_info.get(0, ())):
                for info in infos:
                    if isinstance(getattr(info, "tensor_meta", None), _DTensorMeta):
                        raise ValueError(
                            f"variable_shapes: stage {stage.stage_index} receives a DTensor "
                            "activation or gradient, whose global shape torch's stages fix at "
                            "shape inference; use variable_shapes=False (pad to one shape)")
            if stage._runtime_validate:
                logger.warning("stage %d: torch's per-microbatch shape checks are off "
                               "(variable_shapes: microbatches differ from the first)",
                               stage.stage_index)
                stage._runtime_validate = False

    def step(
        self,
        *args,
        target=None,
        losses: list | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
        arg_mbs: list[tuple] | None = None,
        kwarg_mbs: list[dict] | None = None,
        target_mbs: list | None = None,
        finalize_gradients: bool = True,
        **kwargs,
    ):
        """One training step, with torch's contract (torch >= 2.14's, on every version).

        Whole-batch ``args``/``kwargs``/``target`` are split into microbatches; or pass
        microbatches already split: ``arg_mbs[i]`` the tuple of positional inputs of
        microbatch i (first stage), ``kwarg_mbs[i]`` its keyword inputs, ``target_mbs[i]``
        its target (last stage). With ``variable_shapes=True`` pre-split microbatches may
        differ in shape, and the last stage returns its outputs per microbatch (a list:
        they need not merge); otherwise the merged output. ``finalize_gradients=False``
        (as in torch 2.15) leaves FSDP stages' gradients unreduced and their parameters
        unsharded, to accumulate over further calls; the next call with True reduces
        them (with ``scale_grads``, dividing by ``n_microbatches`` only). It has no
        effect on other stages.
        """
        if self._has_backward and not torch.is_grad_enabled():
            raise RuntimeError("step() computes gradients: call it outside torch.no_grad(), "
                               "or use eval()")
        arg_mbs, kwarg_mbs, target_mbs = self._microbatch_inputs(
            args, kwargs, target, arg_mbs, kwarg_mbs, target_mbs)
        self._finalize_gradients = bool(finalize_gradients)
        for stage in self._stages:
            stage.has_backward = self._has_backward
            stage.clear_runtime_states()
        self._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs,
                                loss_kwargs=loss_kwargs)
        for stage in self._stages:
            if stage.is_last and return_outputs:
                chunks = list(stage.output_chunks)
                return chunks if self.variable_shapes else self._merge_outputs(chunks)
        return None

    def eval(self, *args, target=None, losses: list | None = None,
             arg_mbs: list[tuple] | None = None, kwarg_mbs: list[dict] | None = None,
             target_mbs: list | None = None, **kwargs):
        """One forward-only step, with ``step``'s inputs (whole batch or pre-split)."""
        has_backward, self._has_backward = self._has_backward, False
        try:
            return self.step(*args, target=target, losses=losses, arg_mbs=arg_mbs,
                             kwarg_mbs=kwarg_mbs, target_mbs=target_mbs, **kwargs)
        finally:
            self._has_backward = has_backward

    def step_microbatches(
        self,
        arg_mbs: list | None = None,
        target_mbs: list | None = None,
        *,
        kwarg_mbs: list | None = None,
        losses: list | None = None,
        return_outputs: bool = True,
    ) -> Any:
        """``step(arg_mbs=arg_mbs, target_mbs=target_mbs, ...)`` (kept for callers of
        rrfp <= 0.1, which had no pre-split ``step``)."""
        return self.step(arg_mbs=arg_mbs, kwarg_mbs=kwarg_mbs, target_mbs=target_mbs,
                         losses=losses, return_outputs=return_outputs)

    def _microbatch_inputs(self, args: tuple, kwargs: dict, target, arg_mbs, kwarg_mbs,
                           target_mbs) -> tuple[list, list, list | None]:
        """Whole-batch inputs split, or pre-split ones checked, as torch's schedules do."""
        if all(mbs is None for mbs in (arg_mbs, kwarg_mbs, target_mbs)):
            arg_mbs, kwarg_mbs = self._split_inputs(args, kwargs)
            target_mbs = (None if target is None else
                          list(_split_tensor(target, TensorChunkSpec(0), self._n_microbatches)))
            return arg_mbs, kwarg_mbs, target_mbs
        mixed = [name for name, given in (("positional inputs", args), ("keyword inputs", kwargs),
                                          ("target=", target is not None)) if given]
        if mixed:
            raise ValueError(f"pre-split inputs (arg_mbs/kwarg_mbs/target_mbs) and whole-batch "
                             f"{', '.join(mixed)} were both given: pass each microbatch's "
                             "inputs through arg_mbs=, kwarg_mbs= and target_mbs= only")
        for name, mbs, kind in (("arg_mbs", arg_mbs, tuple), ("kwarg_mbs", kwarg_mbs, dict),
                                ("target_mbs", target_mbs, None)):
            if mbs is None:
                continue
            if not isinstance(mbs, list):
                raise TypeError(f"{name} must be a list, one entry per microbatch, not a "
                                f"{type(mbs).__name__}")
            if len(mbs) != self._n_microbatches:
                raise ValueError(f"{name} has {len(mbs)} entries for {self._n_microbatches} "
                                 "microbatches")
            wrong = [i for i, mb in enumerate(mbs) if kind is not None and not isinstance(mb, kind)]
            if wrong:
                raise TypeError(f"{name}[{wrong[0]}] is a {type(mbs[wrong[0]]).__name__}, not a "
                                f"{kind.__name__}")
        return (arg_mbs if arg_mbs is not None else [()] * self._n_microbatches,
                kwarg_mbs if kwarg_mbs is not None else [{}] * self._n_microbatches,
                target_mbs)

    def _prepare_data_parallel(self) -> list[FSDPModule]:
        """Unshard the local stages' FSDP modules now, in stage order; return them.

        Data-parallel replicas of a stage interleave its actions differently, so nothing may
        talk to the DP group at a timing-dependent point. FSDP: every module is unsharded
        here and stays unsharded for the whole step (its pre-forward/backward hooks would
        all-gather); REDUCE_GRAD, in fixed stage order, reduces and reshards.
        """
        fsdp_modules = []
        for stage in sorted(self._stages, key=lambda s: s.stage_index):
            stage_modules = [m for m in stage.submod.modules() if isinstance(m, FSDPModule)]
            for module in stage_modules:
                module.set_reshard_after_forward(False, recurse=False)
            fsdp_modules.extend(stage_modules)
        handles = [module.unshard(async_op=True) for module in fsdp_modules]
        for handle in handles:
            if handle is not None:
                handle.wait()
        return fsdp_modules


def limit_summary(spec: str | int, limits: MemoryLimits, hint: Hint, rank: int) -> str:
    """One sentence for the log: what ``buffer_limit=spec`` allows on ``rank`` and where
    the measured gains are (docs/defaults.md): at the hint's memory
    RRFP mostly follows the hint, so speed needs memory slack; then one on the job's peak
    (the busiest rank's), in microbatches held."""
    allowed, held = limits.per_rank[rank], hint.rank_peaks()[rank]
    busiest, most = max(hint.rank_peaks().values()), max(limits.per_rank.values())
    job = (f" No rank may hold more than the fixed schedule's busiest rank ({busiest} "
           "microbatches), so the job's peak is unchanged." if most <= busiest else
           f" The busiest rank may hold {most} microbatches, {most - busiest} more than the "
           "fixed schedule's busiest rank ('busiest' keeps the job's peak).")
    where = ("measured 1.03-1.17x over the fixed order at 'hint+2' with 1F1B on 4-8 ranks; "
             "docs/defaults.md")
    if allowed == held:
        return (f"buffer_limit={spec!r} allows no activation memory beyond the fixed "
                f"schedule's ({held} microbatches on this rank), so RRFP mostly follows the "
                f"hint (measured 1.000-1.004x); speed needs memory slack, e.g. "
                f"buffer_limit='hint+2' ({where}).{job}")
    if allowed > held:
        return (f"buffer_limit={spec!r} allows {allowed} microbatches of activations on this "
                f"rank, {allowed - held} more than the fixed schedule holds, to run ready "
                f"work out of hint order ({where}).{job}")
    return (f"buffer_limit={spec!r} allows {allowed} microbatches of activations on this "
            f"rank, fewer than the {held} the fixed schedule holds: less memory, and "
            f"usually slower than the fixed schedule.{job}")


def byte_limit_summary(spec: str | int, byte_limits: ByteLimits, rank: int,
                       local: tuple[int, ...]) -> str:
    """One sentence for the log: what a byte ``buffer_limit`` became on ``rank`` (holding
    stages ``local``)."""
    limits = byte_limits.limits
    allowed, budget = byte_limits.allowed_bytes[rank], byte_limits.budgets[rank]
    busiest = max(byte_limits.fixed_peak_bytes.values())
    most = max(byte_limits.allowed_bytes.values())
    job = (f" No rank's limits allow more than the {busiest} B the fixed schedule's busiest "
           "rank holds, so the job's peak activation bytes are unchanged." if most <= busiest
           else f" The busiest rank's limits allow {most} B, {most - busiest} B more than the "
           "fixed schedule's busiest rank holds ('busiest' keeps the job's peak).")
    return (f"buffer_limit={spec!r} allows {limits.per_rank[rank]} microbatches on this rank "
            f"({ {s: limits.per_stage[s] for s in local} } per "
            f"stage): at most {allowed} B of activations, within its {budget} B "
            f"(the fixed order holds {byte_limits.fixed_peak_bytes[rank]} B here).{job}")


def _all_reduce_gradients(module: DistributedDataParallel) -> None:
    """What DDP's default hook does (divide by the replica count, then sum), bucket by
    bucket of at most DDP's ``bucket_bytes_cap``: the extra memory is one bucket."""
    params = [p for p in module.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:  # unused here, maybe used on another replica: sizes must match
            p.grad = torch.zeros_like(p)
    group = module.process_group
    replicas = dist.get_world_size(group)
    for bucket in gradient_buckets([p.grad for p in params], module.bucket_bytes_cap):
        flat = torch._utils._flatten_dense_tensors(bucket)
        flat.div_(replicas)
        dist.all_reduce(flat, group=group)
        for grad, reduced in zip(bucket, torch._utils._unflatten_dense_tensors(flat, bucket)):
            grad.copy_(reduced)


def gradient_buckets(grads: list[torch.Tensor], cap_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive gradients in buckets of at most ``cap_bytes`` (a larger gradient alone),
    in parameter order: the same buckets on every replica."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for grad in grads:
        nbytes = grad.numel() * grad.element_size()
        if not buckets or size + nbytes > cap_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(grad)
        size += nbytes
    return buckets


def _refuse_compiled_stages(stages: list[_PipelineStageBase], hint: HintSource) -> None:
    """torch's stages cannot split backward (I/W) through a compiled module."""
    name = hint if isinstance(hint, str) else getattr(hint, "__name__", "custom")
    try:
        _check_torch_compile_compatibility(stages, f"RRFP with hint {name}")
    except RuntimeError as e:
        raise IncompatibleStagesError(f"{e}; use a hint without split backward (I/W)") from None


def _check_fsdp_wraps_the_stage(stages: list[_PipelineStageBase]) -> None:
    """FSDP modules inside a stage need the stage module itself to be one.

    RRFP reduces and reshards a stage's FSDP modules at its REDUCE_GRAD through the stage
    module (as torch's stages do); inner FSDP modules under a plain root would
    reduce-scatter inside every backward, at points whose timing differs between
    replicas: mismatched collectives.
    """
    for stage in stages:
        if not isinstance(stage.submod, FSDPModule) and any(
                isinstance(m, FSDPModule) for m in stage.submod.modules()):
            raise ValueError(
                f"stage {stage.stage_index} holds FSDP modules but is not one itself: apply "
                "fully_shard to the stage module too (after its blocks, as torchtitan does), "
                "so that its gradients are reduced once, at REDUCE_GRAD")


def _warn_about_shared_parameters(stages: list[_PipelineStageBase]) -> None:
    """Parameters shared by two stages of this rank (tied embeddings under V placement)
    accumulate gradients from both, in an order that depends on timing under RRFP."""
    owner: dict[int, int] = {}
    for stage in stages:
        for p in stage.submod.parameters():
            first = owner.setdefault(id(p), stage.stage_index)
            if first != stage.stage_index:
                message = (
                    f"stages {first} and {stage.stage_index} on this rank share parameters: "
                    "their gradient contributions add up in an order that depends on "
                    "timing, so gradients are not bitwise those of the fixed schedule "
                    "(still correct up to floating-point rounding)")
                warnings.warn(message, stacklevel=3)
                logger.warning(message)
                return


class _StageExecutor:
    """What an action does on this rank's stages: compute, then send its outputs."""

    def __init__(self, schedule: ScheduleRRFP, clock: Callable[[], float], arg_mbs, kwarg_mbs,
                 target_mbs, return_outputs: bool, loss_kwargs, losses_out: list | None):
        self.schedule = schedule
        self.clock = clock
        self.arg_mbs, self.kwarg_mbs, self.target_mbs = arg_mbs, kwarg_mbs, target_mbs
        self.return_outputs = return_outputs
        self.loss_kwargs = loss_kwargs
        self.context = _PipelineContext(schedule, arg_mbs, kwarg_mbs, target_mbs, losses_out)
        """What a custom function gets (see ``rrfp.torch_interface``)."""
        # As in torch's runtime: custom functions read and extend these.
        schedule._internal_losses.clear()
        schedule.backward_counter.clear()
        self.losses: dict[int, torch.Tensor] = {}
        self.saved_per_microbatch: dict[int, int] = {}
        """Per stage, the most bytes one forward saved for backward (metered steps)."""
        self.sends: list[tuple[int, int, int, float]] = []
        """(source stage, destination stage, microbatch, seconds after start) per send."""

    def work(self, action: _Action, sends: list[Edge]) -> Callable[[], None]:
        def run() -> None:
            self.compute(action)
            for edge in sends:
                self.send(action, edge)
        return run

    def completed(self, action: _Action) -> None:
        self.schedule._receives.completed(action)

    def compute(self, action: _Action) -> None:
        custom = self.schedule._comp_type_to_function_map.get(action.computation_type)
        with (record_function(_get_profiler_function_name(action))
              if torch.autograd.profiler._is_profiler_enabled else contextlib.nullcontext()):
            if custom is None:
                self._compute(action)
                return
            with self._metered(action):
                self._compute_custom(custom, action)

    @contextlib.contextmanager
    def _metered(self, action: _Action):
        """Around a forward of a metered step: the bytes it saves for backward."""
        meter = self.schedule._step_meter
        if action.computation_type != F or meter is None:
            yield
            return
        with meter.saving() as saved:
            yield
        meter.sample()
        s = action.stage_index
        self.saved_per_microbatch[s] = max(self.saved_per_microbatch.get(s, 0), saved.bytes)

    def _compute_custom(self, function, action: _Action) -> None:
        """A registered custom function in place of the action's compute, as torch's
        runtime runs it (the loss a last stage's forward computes is RRFP's too)."""
        schedule = self.schedule
        losses_before = len(schedule._internal_losses)
        with receive_posted(schedule.fwd_recv_ops, schedule.bwd_recv_ops, action,
                            schedule._stage_by_index):
            function(action, self.context)
        if action.computation_type == F and len(schedule._internal_losses) > losses_before:
            self.losses[action.microbatch_index] = schedule._internal_losses[-1]

    def _compute(self, action: _Action) -> None:
        schedule = self.schedule
        stage = schedule._stage_by_index[action.stage_index]
        mb = action.microbatch_index
        ctype = action.computation_type
        if ctype == F:
            with self._metered(action):
                output = stage.forward_one_chunk(
                    mb, self.arg_mbs[mb], self.kwarg_mbs[mb],
                    save_forward_output=self.return_outputs,
                )
            if stage.is_last and schedule._loss_fn is not None:
                self.losses[mb] = schedule._compute_loss(
                    output, self.target_mbs[mb], self.loss_kwargs
                )
                schedule._internal_losses.append(self.losses[mb])  # as torch's runtime keeps them
            if action.stage_index + 1 in schedule._stage_by_index:
                schedule._stage_by_index[action.stage_index + 1].set_local_fwd_input(output, mb)
        elif ctype in (B, I):
            # last_backward=False everywhere: data-parallel gradient reduction happens
            # at REDUCE_GRAD, in the hint's fixed stage order, never inside a backward.
            stage.backward_one_chunk(
                mb,
                loss=self.losses.get(mb) if stage.is_last else None,
                full_backward=ctype == B,
                last_backward=False,
            )
            if action.stage_index - 1 in schedule._stage_by_index:
                schedule._stage_by_index[action.stage_index - 1].set_local_bwd_input(
                    stage.get_local_bwd_output(mb), mb
                )
        elif ctype == W:
            stage.backward_weight_one_chunk(mb, last_backward=False)
        elif ctype == REDUCE_GRAD:
            if action.stage_index in schedule._ddp:
                _all_reduce_gradients(schedule._ddp[action.stage_index])
            if schedule._finalize_gradients or not isinstance(stage.submod, FSDPModule):
                stage.perform_reduce_grad(
                    schedule._n_microbatches if schedule.scale_grads else 1)
        else:
            raise AssertionError(f"unexpected action {action}")
        if ctype in (B, W):  # as torch's runtime counts them, for custom functions to read
            schedule.backward_counter[action.stage_index] += 1

    def send(self, action: _Action, edge: Edge) -> None:
        schedule = self.schedule
        stage = schedule._stage_by_index[action.stage_index]
        mb = action.microbatch_index
        ops = stage.get_fwd_send_ops(mb) if edge.is_forward else stage.get_bwd_send_ops(mb)
        tensors = [op.tensor for op in ops]
        self.sends.append((edge.src, edge.dst, mb, self.clock()))
        if edge.is_forward:
            schedule._receives.sent(edge.src, mb, tensors)
            if schedule.variable_shapes:
                header = shape_header(tensors, schedule._transport.header_device(stage.device))
                schedule._transport.send(edge, mb, [header], header=True)
        schedule._transport.send(edge, mb, tensors)
        if edge.is_forward:  # the transport holds the tensors until their send completes
            release_sent_outputs(stage, mb)


def _step_stats(schedule: ScheduleRRFP, loop: StepLoop, executor: _StageExecutor,
                coordinator, end: float, sent: tuple[int, int]) -> StepStats:
    arbiter = loop.arbiter
    local = schedule.hint.stages_on(schedule.rank)
    hint_peaks = arbiter.hint.peak_in_flight()
    byte_limits = schedule.byte_limits
    spans = [Span(str(c.action), c.start, c.end, c.action.stage_index,
                  c.action.computation_type.value, c.action.microbatch_index)
             for c in loop.completions]
    spans += [Span("wait", start, stop, kind="wait") for start, stop in loop.waits]
    return StepStats(
        pp_rank=schedule.rank,
        global_rank=dist.get_rank(),
        hint=arbiter.hint.name,
        policy=arbiter.policy.name,
        device=type(schedule._device).__name__,
        launch_depth=schedule.launch_depth,
        arrivals=[(a.edge.src, a.edge.dst, a.microbatch, a.at) for a in loop.received],
        sends=list(executor.sends),
        buffer_limits=dict(arbiter.limits) if arbiter.limits else None,
        rank_buffer_limit=arbiter.rank_limit,
        hint_peak_in_flight={s: hint_peaks[s] for s in local},
        hint_rank_peak=arbiter.hint.rank_peaks()[schedule.rank],
        hint_busiest_rank_peak=max(arbiter.hint.rank_peaks().values()),
        peak_in_flight=dict(arbiter.peak_in_flight),
        peak_rank_in_flight=arbiter.peak_held,
        peak_activation_bytes=None if schedule._step_meter is None else schedule._step_meter.peak,
        activation_bytes_per_microbatch=(
            None if schedule.activation_bytes_per_microbatch is None
            else {s: schedule.activation_bytes_per_microbatch[s] for s in local}),
        rank_budget_bytes=None if byte_limits is None else byte_limits.budgets[schedule.rank],
        rank_limit_bytes=None if byte_limits is None else byte_limits.allowed_bytes[schedule.rank],
        busiest_rank_peak_bytes=(None if byte_limits is None
                                 else max(byte_limits.fixed_peak_bytes.values())),
        receive_buffer_bytes=schedule._receives.peak_bytes,
        messages_sent=sent[0],
        bytes_sent=sent[1],
        backpressure_entries=dict(arbiter.backpressure_entries),
        out_of_hint_order=arbiter.out_of_order,
        hint_order=[str(n.action) for n in arbiter.nodes],
        realized_order=[str(a) for a in arbiter.realized],
        step_time=end,
        device_busy_time=loop.busy_time,
        wait_time=loop.wait_time,
        decision_time=loop.decision_time,
        launch_time=loop.launch_time,
        coordination=coordinator.name if coordinator else None,
        coordination_rounds=coordinator.rounds if coordinator else 0,
        coordination_deferrals=coordinator.deferrals if coordinator else 0,
        coordination_time=coordinator.seconds if coordinator else 0.0,
        start_unix=time.time() - end,
        step=schedule._steps_run,
        spans=spans,
    )
