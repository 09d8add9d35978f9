"""ScheduleRRFP: the readiness-first pipeline schedule for torch.distributed.pipelining.

Whenever the rank is free it runs the ready action that ranks highest in a hint (any
torch schedule, a CSV, a dict, or the BF/BFW rules); it never waits on an unready action
while another is ready. Gradients and losses are bitwise those of torch's fixed schedule
with the same hint (see ``rrfp.core.arbiter`` for why).

This class keeps torch's schedule API and the wiring: it checks the arguments, builds the
hint, the platform's channels and device, the data-parallel handling and the memory
limits, and hands them to the ``PipelineRuntime`` (``rrfp.runtime.pipeline``) that runs each step.
It is one of torch's runtime schedules (``rrfp.runtime.torch_interface``): loaded orders become
the hint, and registered custom functions replace an action's compute.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Unpack

import torch
import torch.distributed as dist
from torch.distributed.pipelining.microbatch import TensorChunkSpec
from torch.distributed.pipelining.schedules import (_check_torch_compile_compatibility,
                                                    _PipelineContext)
from torch.distributed.pipelining.stage import _PipelineStageBase

from rrfp._torch_compat import check_first_stage_inputs, check_torch
from rrfp.advise.cost import CPU_SHARE, CpuBudget
from rrfp.comm.board import FailureBoard, JobScope
from rrfp.comm.channels import ChannelMap, create_channels
from rrfp.comm.coordination import CoordinationGroup, refuse_uncovered_sharding
from rrfp.comm.link_latency import SendDelay
from rrfp.comm.receives import check_variable_shapes, ReceiveRings
from rrfp.comm.transport import Transport
from rrfp.core.arbiter import check_deadlock_free
from rrfp.core.checks import check_settings, CheckedSettings
from rrfp.core.hints import (build_hint, declares_split_backward, Hint, HintSource, infer_layout,
                             interchangeable_hints, Layout)
from rrfp.core.loop import Device
from rrfp.core.settings import Settings
from rrfp.core.sizes import MicrobatchSize, step_sizes
from rrfp.core.wakeup import Wakeup
from rrfp.devices.platform import Platform, platform_for
from rrfp.failure.hang_report import HANG_REPORT_WAIT_S, HangReport
from rrfp.failure.job import agree_on_settings, collective_groups, JobGroups
from rrfp.runtime.data_parallel import DataParallel
from rrfp.runtime.executor import Reduction, StepInputs
from rrfp.runtime.inputs import microbatch_inputs
from rrfp.runtime.limit_plan import LimitPlan
from rrfp.runtime.meter import ActivationMeter
from rrfp.runtime.pipeline import ClosedOnLeaving, Coordination, Metering, PipelineRuntime
from rrfp.runtime.readout import RuntimeReadout
from rrfp.runtime.self_driving import Predictor, SelfDriving
from rrfp.runtime.schedule_arguments import (stages_per_rank, TorchArguments,
                                             TorchScheduleArguments)
from rrfp.runtime.torch_interface import (CustomFunctions, IncompatibleStagesError,
                                          TorchRuntimeInterface)

logger = logging.getLogger(__name__)


class ScheduleRRFP(TorchRuntimeInterface, RuntimeReadout, ClosedOnLeaving):
    """Runtime-readiness-first pipeline schedule (arXiv 2605.18750).

    Every argument in full: docs/reference/api.md.

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
        settings: what the user chooses of RRFP (``rrfp.Settings``: the memory limit, the
            policy, the stall timeout, ...), the same on every rank of the job; None: the
            defaults.
        coordination_group: the group of ranks that must run the same action sequence
            because the stage's compute issues collectives on them (the TP group, the EP
            group, or one spanning both), of any backend: RRFP agrees over a private gloo
            twin of it, so agreeing costs no device synchronization. None: no such group.
        args_chunk_spec, kwargs_chunk_spec, output_merge_spec, scale_grads: as in torch's
            schedules.
        **torch_arguments: torch's runtime-schedule arguments as torchtitan passes them
            (``max_active_stages``, ``unshard_lookahead``, ``defer_pp_recv``,
            ``backward_requires_autograd``): ``rrfp.runtime.schedule_arguments``.
    """

    def __init__(
        self,
        stages: _PipelineStageBase | list[_PipelineStageBase],
        n_microbatches: int,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        *,
        hint: HintSource | None = None,
        settings: Settings | None = None,
        coordination_group: dist.ProcessGroup | None = None,
        args_chunk_spec: tuple[TensorChunkSpec, ...] | None = None,
        kwargs_chunk_spec: dict[str, TensorChunkSpec] | None = None,
        output_merge_spec: dict[str, Any] | tuple[Any] | None = None,
        scale_grads: bool = True,
        **torch_arguments: Unpack[TorchArguments],
    ):
        check_torch()
        torch_schedule = TorchScheduleArguments.of(torch_arguments)
        stages = _in_stage_order(stages)
        platform = platform_for(stages[0].device)
        wiring = self._wiring(platform)
        super().__init__(stages=stages, n_microbatches=n_microbatches, loss_fn=loss_fn,
                         args_chunk_spec=args_chunk_spec, kwargs_chunk_spec=kwargs_chunk_spec,
                         output_merge_spec=output_merge_spec, scale_grads=scale_grads,
                         backward_requires_autograd=torch_schedule.backward_requires_autograd)
        if declares_split_backward(hint):  # checked first, as torch's own such schedules do
            _refuse_compiled_stages(stages, str(getattr(hint, "__name__", hint)))
        self._layout = infer_layout(self.rank, self.pp_group_size, self._num_stages,
                                    [stage.stage_index for stage in stages])
        self._hint = placed_hint(hint, stages, self.rank, self._layout, n_microbatches)
        self._platform = platform
        self._settings = self._checked(Settings() if settings is None else settings,
                                       self._hint)
        checked = self._settings
        limits = LimitPlan(checked.buffer_limit, self._hint, self.rank, checked.policy)
        if len(stages) == 1:
            self._stage = stages[0]
            """The one stage, as torch's single-stage schedules name it."""
        self.stall_timeout = checked.stall_timeout
        self.stage_index_to_group_rank = dict(self._hint.stage_to_rank)
        for stage in stages:
            stage.stage_index_to_group_rank = self.stage_index_to_group_rank
        self.pipeline_order = {r: list(acts) for r, acts in self._hint.orders.items()}
        self._data_parallel = DataParallel(stages)
        torch_schedule.check(stages_per_rank(self._hint), fsdp=self._data_parallel.uses_fsdp)
        self.variable_shapes = checked.given.variable_shapes
        self.coordination = checked.given.coordination
        self._coordination_group = coordination_group
        self._set_up_checked = False
        self._finalize_gradients = True
        job = _joined_job(self._hint, n_microbatches, checked)
        twin = (CoordinationGroup(coordination_group, self.stall_timeout)
                if coordination_group is not None
                and dist.get_world_size(coordination_group) > 1 else None)
        self._runtime = _wired_runtime(
            self._hint, self.rank, self._stages, platform, limits, checked, wiring, job=job,
            beside=[*self._data_parallel.groups(), coordination_group],
            coordination=Coordination(self.coordination, twin))

    @property
    def settings(self) -> Settings:
        """The settings this schedule runs with, as given."""
        return self._settings.given

    def _wiring(self, platform: Platform) -> Wiring:
        """The device actions run on, and how messages leave: the platform's own.
        (``rrfp.testing.study.StudySchedule`` overrides it for emulated studies.)"""
        return Wiring(platform.step_device())

    def _checked(self, settings: Settings, hint: Hint) -> CheckedSettings:
        return check_settings(settings, hint,
                              free_memory_known=self._platform.free_bytes is not None,
                              device=self._platform.device)

    def _replace_hint(self, source: HintSource, name: str | None = None) -> None:
        """Make ``source`` the hint from the next step on (torch's ``_load_csv``,
        ``_prepare_schedule_with_comms``). Call it on every rank of the pipeline, between
        steps; the placement must stay the constructor's (the channels are built for it)."""
        hint = placed_hint(source, self._stages, self.rank, self._layout,
                           self._n_microbatches, name, placement=self._hint.stage_to_rank)
        checked = self._checked(self._settings.given, hint)
        limits = LimitPlan(checked.buffer_limit, hint, self.rank, checked.policy)
        self._hint = hint
        self.pipeline_order = {r: list(acts) for r, acts in hint.orders.items()}
        self._runtime.follow(hint, limits)
        logger.info("ScheduleRRFP on pipeline rank %d: hint now %s (policy %s), memory limits "
                    "%s per stage. %s", self.rank, hint.name, self.policy,
                    {s: self.buffer_limits.per_stage[s] for s in hint.stages_on(self.rank)},
                    self.limit_summary)

    @property
    def hint(self) -> Hint:
        return self._hint

    def _step_microbatches(self, arg_mbs: list | None = None, kwarg_mbs: list | None = None,
                           target_mbs: list | None = None, losses: list | None = None,
                           return_outputs: bool = True,
                           loss_kwargs: dict[str, Any] | None = None,
                           sizes: list[MicrobatchSize | None] | None = None):
        self._runtime.failure.refuse_if_failed()
        arg_mbs, kwarg_mbs = self._check_inputs(arg_mbs, kwarg_mbs, target_mbs, losses)
        self._set_up_stages(arg_mbs[0], kwarg_mbs[0],
                            target_mbs[0] if target_mbs is not None else None, loss_kwargs)
        for stage in self._stages:
            if stage.is_first:  # a wrong input raises here, before the step communicates
                check_first_stage_inputs(stage, arg_mbs)
        fsdp_modules = self._data_parallel.unshard()
        # As in torch's runtime: custom functions read and extend these.
        self._internal_losses.clear()
        self.backward_counter.clear()
        step_losses = self._runtime.run(
            StepInputs(arg_mbs, kwarg_mbs, target_mbs, return_outputs, loss_kwargs),
            training=self._has_backward,
            loss=self._compute_loss if self._loss_fn is not None else None,
            reduction=Reduction(self._data_parallel, self._finalize_gradients,
                                self._n_microbatches if self.scale_grads else 1),
            custom=CustomFunctions(
                self._comp_type_to_function_map,
                _PipelineContext(self, arg_mbs, kwarg_mbs, target_mbs, losses),
                self._internal_losses, self.backward_counter, self.fwd_recv_ops,
                self.bwd_recv_ops),
            pp_group=self._stages[0].group, sizes=sizes)
        if not self._has_backward:  # no gradient reduction will reshard them
            for module in fsdp_modules:
                module.reshard()
        if self._loss_fn is not None and any(s.is_last for s in self._stages):
            self._internal_losses = [step_losses[m] for m in range(self._n_microbatches)]
        self._update_losses(self._stages, losses)

    def _set_up_stages(self, args, kwargs, target, loss_kwargs) -> None:
        """torch's first-step shape inference, and before it, once, the checks that need
        the stages' parameters unsharded; after it, once, those of the shapes found."""
        if not self._set_up_checked:
            # Unsharded, a parameter still a DTensor is sharded over an intra-stage group.
            # torch's shape inference reshards FSDP modules again.
            self._data_parallel.unshard()
            refuse_uncovered_sharding(self._stages, self._coordination_group,
                                      self._runtime.board, self.stall_timeout)
        self._initialize_stages(args, kwargs, target, loss_kwargs)
        if not self._set_up_checked:
            if self.variable_shapes:
                check_variable_shapes(self._stages)
            self._set_up_checked = True

    def close(self, timeout: float = 10.0) -> None:
        """Stop this schedule's threads and close its channels (idempotent).

        After healthy steps the sends still in flight complete first (within
        ``stall_timeout``: on NCCL a step may return before the peer has received its
        last messages), then the channels are shut down; after a failed step they were
        aborted. Raises ``RuntimeError`` if such a send fails or does not complete (the
        channels are then aborted), or naming any thread still alive after ``timeout``
        seconds.
        """
        self._runtime.close(failed=False, timeout=timeout)

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
        mb_sizes: list[MicrobatchSize | float | None] | None = None,
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

        ``mb_sizes``: what each microbatch's cost follows from (one entry per microbatch,
        the same on every rank: a ``rrfp.core.sizes.MicrobatchSize``, a number of tokens, or
        None), checked before the step communicates; what policies make of it: docs/reference/api.md.
        """
        sizes = step_sizes(mb_sizes, self._n_microbatches)
        needs_autograd = self._has_backward and self._backward_requires_autograd
        if needs_autograd and not torch.is_grad_enabled():
            raise RuntimeError("step() computes gradients: call it outside torch.no_grad(), "
                               "or use eval()")
        arg_mbs, kwarg_mbs, target_mbs = microbatch_inputs(
            self._split_inputs, self._n_microbatches, args, kwargs, target, arg_mbs,
            kwarg_mbs, target_mbs)
        self._finalize_gradients = bool(finalize_gradients)
        for stage in self._stages:
            stage.has_backward = self._has_backward
            stage.clear_runtime_states()
        self._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs,
                                loss_kwargs=loss_kwargs, sizes=sizes)
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


def placed_hint(source: HintSource | None, stages: list[_PipelineStageBase], rank: int,
                layout: Layout, n_microbatches: int, name: str | None = None, *,
                placement: Mapping[int, int] | None = None) -> Hint:
    """The hint built for the pipeline of ``stages`` (this rank's, in stage order), checked
    against the stages this rank holds and deadlock-free (``None``: the fixed schedule
    torch would use for their placement; ``name``: what to call it). ``placement``: the
    stage-to-rank placement it must keep (a built schedule's channels are made for it)."""
    local = [stage.stage_index for stage in stages]
    if source is None:
        source = {"v": "ZBVZeroBubble",
                  "loop": "1F1B" if len(local) == 1 else "Interleaved1F1B"}.get(layout)
        if source is None:
            raise ValueError(
                f"stages {local} on pipeline rank {rank} follow neither the loop nor the V "
                "placement: pass a hint (CSV or dict) that places them")
    first = stages[0]
    hint = build_hint(source, num_ranks=first.group_size, num_stages=first.num_stages,
                      n_microbatches=n_microbatches, layout=layout, given_name=name)
    if placement is not None and dict(hint.stage_to_rank) != dict(placement):
        raise ValueError(
            f"hint {hint.name!r} places stages {dict(hint.stage_to_rank)} on pipeline ranks, "
            f"where this ScheduleRRFP was built for {dict(placement)}: build a ScheduleRRFP "
            f"with hint={hint.name!r} instead")
    _check_placement(hint, rank, local, layout)
    if hint.has_split_backward:
        _refuse_compiled_stages(stages, hint.name)
    check_deadlock_free(hint)
    return hint


def _check_placement(hint: Hint, rank: int, local: list[int], layout: Layout) -> None:
    expected = list(hint.stages_on(rank))
    if expected != local:
        raise ValueError(
            f"hint {hint.name!r} places stages {expected} on pipeline rank {rank} "
            f"({hint.layout} placement), but this rank holds stages {local}: build the "
            f"stages with the hint's placement or pick a hint for this placement ({layout})")


def _refuse_compiled_stages(stages: list[_PipelineStageBase], hint_name: str) -> None:
    """torch's stages cannot split backward (I/W) through a compiled module."""
    try:
        _check_torch_compile_compatibility(stages, f"RRFP with hint {hint_name}")
    except RuntimeError as e:
        raise IncompatibleStagesError(f"{e}; use a hint without split backward (I/W)") from None


def _in_stage_order(stages: _PipelineStageBase | list[_PipelineStageBase]
                    ) -> list[_PipelineStageBase]:
    """The stages in stage order, whatever order they come in: torch's first-step shape
    inference walks the list with blocking receives, so ranks listing their stages in
    different orders (e.g. [rank + 2, rank]) would each wait on the other before any check."""
    stages = sorted(stages, key=lambda stage: stage.stage_index) if isinstance(
        stages, (list, tuple)) else [stages]
    if not stages:
        raise ValueError("ScheduleRRFP needs at least one stage")
    return stages


def _joined_job(hint: Hint, n_microbatches: int, checked: CheckedSettings) -> JobScope:
    """A new schedule's job scope, once every rank of the job said the same hint (its name
    and a digest of its orders), microbatches and settings; ``ValueError`` on every rank
    where they differ."""
    orders = repr(sorted((rank, [str(a) for a in actions])
                         for rank, actions in hint.orders.items()))
    digest = hashlib.sha1(orders.encode()).hexdigest()[:12]
    given = checked.given
    agreed = {"buffer_limit": given.buffer_limit, "policy": checked.policy,
              "coordination": given.coordination, "launch_depth": checked.launch_depth,
              "variable_shapes": given.variable_shapes, "fixed_every": checked.fixed_every,
              "tune_within": given.tune_within, "tune_hints": checked.tune_hints}
    job = JobScope.new()
    agree_on_settings(job, {
        "hint": f"{hint.name} (orders {digest})", "n_microbatches": str(n_microbatches),
        "stall_timeout": repr(checked.stall_timeout),
        **{name: repr(value) for name, value in agreed.items()}}, checked.stall_timeout)
    return job


def _wired_runtime(hint: Hint, rank: int, stages: list[_PipelineStageBase], platform: Platform,
                   limits: LimitPlan, checked: CheckedSettings, wiring: Wiring, *,
                   job: JobScope, beside: list[dist.ProcessGroup | None],
                   coordination: Coordination) -> PipelineRuntime:
    """The channels (created and connected now, in one order on every rank of the
    pipeline), the device and the receive rings, wired into the runtime with the job's
    groups (``beside``, the coordination twin, the meshes of the stages' DTensor
    parameters); logs the set-up."""
    given, stall_timeout = checked.given, checked.stall_timeout
    launch_depth = math.inf if checked.launch_depth is None else checked.launch_depth
    wakeup = Wakeup()
    make_channels = wiring.channels or create_channels
    channels = make_channels(hint, stages[0].group, platform.device, platform.channel_backend,
                             header_channels=given.variable_shapes)
    board = FailureBoard(channels.store, job.me, channels.global_ranks, job_store=job.store,
                         job_ranks=job.ranks)
    transport = Transport(channels, wakeup, board, send_delay=wiring.send_delay,
                          receive_streams=platform.receive_streams())
    local, peaks = hint.stages_on(rank), hint.plan.stage_peaks
    logger.info(
        "ScheduleRRFP on pipeline rank %d: hint %s (policy %s, %s placement), memory "
        "limits %s per stage and %d on the rank (the hint holds %s and %d), launch depth "
        "%s, %s. %s", rank, hint.name, limits.policy, hint.layout,
        {s: limits.limits.per_stage[s] for s in local}, limits.limits.per_rank[rank],
        {s: peaks[s] for s in local}, hint.plan.rank_peaks()[rank], launch_depth,
        type(wiring.device).__name__, limits.summary)
    meter = ActivationMeter() if given.meter_activations else None
    self_driving = (SelfDriving(checked.tune_within, hint, rank, job,
                                transport.channels.global_ranks, stall_timeout,
                                predict_inline=wiring.predict_inline,
                                cpu_budget=CpuBudget(wiring.prediction_cpu_share),
                                hints=tuned_hints(hint, rank) if checked.tune_hints else None)
                    if checked.tune_within is not None else None)
    return PipelineRuntime(
        hint, rank, {stage.stage_index: stage for stage in stages}, platform=platform,
        device=wiring.device, wakeup=wakeup, transport=transport,
        receives=ReceiveRings(given.variable_shapes, platform), limits=limits,
        coordination=coordination, metering=Metering(meter, given.meter_every),
        stall_timeout=stall_timeout, launch_depth=launch_depth,
        reorder_ahead=wiring.reorder_ahead, fixed_every=checked.fixed_every,
        self_driving=self_driving,
        job_groups=JobGroups([*collective_groups(s.submod for s in stages), *beside,
                              coordination.twin.group if coordination.twin else None]),
        board=board, report=HangReport(board, job.name, given.report_folder,
                          min(HANG_REPORT_WAIT_S, stall_timeout)))


def tuned_hints(hint: Hint, rank: int) -> dict[str, Hint]:
    """The hints self-driving may rank by beside ``hint`` (``Settings.tune_hints``), said
    in the log."""
    hints = interchangeable_hints(hint)
    logger.info("ScheduleRRFP on pipeline rank %d: tune_hints: the self-driving candidates "
                "also rank by %s", rank, ", ".join(hints) if hints else
                f"nothing else: no named hint runs {hint.name}'s streams in its orders")
    return hints


@dataclass(frozen=True)
class Wiring:
    """How a schedule's steps meet the hardware: the device its actions run on, and
    (in studies) how long each outgoing message is held, whether any ready action may be
    launched onto a busy device, whether self-driving predicts in this process or, in a
    child, within which share of the host's CPU, and how the channels are made."""

    device: Device
    send_delay: SendDelay | None = None
    reorder_ahead: bool = False
    predict_inline: Predictor | None = None
    prediction_cpu_share: float = CPU_SHARE
    channels: Callable[..., ChannelMap] | None = None
    """None: ``rrfp.comm.channels.create_channels`` over the platform's backend."""
