"""One rank's side of a pipeline across steps: the step's phases, and what a failure does.

``ScheduleRRFP`` keeps torch's API and builds a ``PipelineRuntime`` from its arguments:
the hint, the platform's device, the transport and receive rings, the memory limits, the
coordination group's twin, the byte meter. ``run`` is one step, in named phases: settle the
limits, choose the meter, build the step's arbiter, executor and loop, run the loop to
its end, and learn from it; a step that fails tells the other ranks (``rrfp.comm.board``),
aborts the channels and leaves the runtime refusing further steps, so no later step
waits on a message the failed one left in flight (docs/design/invariants.md, 8).
"""

from __future__ import annotations

import atexit
import logging
import math
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.pipelining.stage import _PipelineStageBase

from rrfp.comm.board import FAILURE_POLL_S, FailureBoard
from rrfp.comm.coordination import Coordinator, CoordinationGroup, make_coordinator
from rrfp.comm.fit_sharing import FitSharing
from rrfp.comm.receives import ReceiveRings
from rrfp.comm.transport import Transport
from rrfp.core.arbiter import Arbiter
from rrfp.core.hints import Hint
from rrfp.core.history import History
from rrfp.core.loop import Arrival, Device, StepLoop
from rrfp.core.policy import make_policy
from rrfp.core.sizes import StepSizes
from rrfp.core.stats import StepStats
from rrfp.core.tuning import FIXED_ORDER
from rrfp.core.wakeup import Wakeup
from rrfp.devices.platform import Platform
from rrfp.failure.hang_report import HangReport
from rrfp.failure.job import JobGroups, JobWatch
from rrfp.runtime.step_failure import StepFailure
from rrfp.runtime.executor import LossFn, Reduction, StageExecutor, StepInputs
from rrfp.runtime.limit_plan import LimitPlan
from rrfp.runtime.meter import ActivationMeter
from rrfp.runtime.self_driving import SelfDriving, told_sizes
from rrfp.runtime.step_stats import step_stats
from rrfp.runtime.torch_interface import CustomFunctions

logger = logging.getLogger(__name__)


@dataclass
class Metering:
    """When the byte meter runs: the first training step and every ``every``-th."""

    meter: ActivationMeter | None
    """None: never (``meter_activations=False``)."""
    every: int

    def for_step(self, steps_run: int, measured: bool, stages: Iterable[_PipelineStageBase],
                 new_setting: bool = False) -> ActivationMeter | None:
        """The meter, reset for the step after ``steps_run`` steps, where that step is
        metered: the first training step (nothing ``measured`` yet), every ``every``-th,
        and (``new_setting``) the first step of a self-driving setting."""
        if self.meter is None or (steps_run % self.every and not new_setting and measured):
            return None
        self.meter.reset(p for stage in stages for p in stage.submod.parameters())
        return self.meter


@dataclass
class Coordination:
    """How the ranks of an intra-stage collective group settle on each action."""

    kind: str
    """``"leader"`` or ``"agree"`` (``rrfp.comm.coordination.COORDINATIONS``)."""
    twin: CoordinationGroup | None
    """The private twin of the group (None: no group of more than one rank)."""


class PipelineRuntime:
    """One rank's pipeline runtime: everything a step needs that outlives the step."""

    def __init__(self, hint: Hint, rank: int, stages: dict[int, _PipelineStageBase], *,
                 platform: Platform, device: Device, wakeup: Wakeup, transport: Transport,
                 receives: ReceiveRings, limits: LimitPlan, coordination: Coordination,
                 metering: Metering, stall_timeout: float, launch_depth: float,
                 reorder_ahead: bool, job_groups: JobGroups, board: FailureBoard,
                 report: HangReport, fixed_every: int = 0,
                 self_driving: SelfDriving | None = None):
        self.hint, self.rank, self.stages = hint, rank, stages
        self._forward_only = hint.forward_only()
        self.platform, self.device, self.wakeup = platform, device, wakeup
        self.transport, self.receives, self.limits = transport, receives, limits
        self.coordination, self.metering = coordination, metering
        self.stall_timeout, self.launch_depth = stall_timeout, launch_depth
        self.reorder_ahead = reorder_ahead
        self.fixed_every = fixed_every
        """The in-run A/B: every this-many-th training step runs the fixed order (0: none)."""
        self.self_driving = self_driving
        """Self-driving: what each training step runs, as the job's deciding rank says."""
        self.history = History()
        self.fit_sharing = FitSharing(transport.channels.store, dist.get_rank()
                                      if dist.is_initialized() else 0,
                                      transport.channels.global_ranks)
        self.steps_run = 0
        self.training_steps_run = 0
        self.last_step_stats: StepStats | None = None
        self.activation_bytes_per_microbatch: dict[int, int] | None = None
        """Per local stage, the most bytes one microbatch's forward saved for backward in
        the last metered training step (None before one)."""
        self.report, self.board = report, board
        self.failure = StepFailure(rank, stages, device=device, transport=transport,
                                   receives=receives, board=board, report=report,
                                   job_groups=job_groups, stall_timeout=stall_timeout,
                                   close=lambda: self.close(failed=True))
        self._in_step = False
        """Whether a step runs now."""
        self._watch = JobWatch(board, job_groups, wakeup, self._told_by_watch)
        self._close_at_exit = _closing_at_exit(self)

    def follow(self, hint: Hint, limits: LimitPlan) -> None:
        """Rank ready actions by ``hint`` within ``limits`` from the next step on (the same
        placement: the channels were built for it)."""
        self.hint, self._forward_only, self.limits = hint, hint.forward_only(), limits

    def run(self, inputs: StepInputs, *, training: bool, loss: LossFn | None,
            reduction: Reduction, custom: CustomFunctions,
            pp_group: dist.ProcessGroup | None, sizes: StepSizes | None = None) -> dict:
        """One step; returns the last stage's losses by microbatch (empty elsewhere).
        ``sizes``: each microbatch's size, which a training step's policy costs actions by
        (``rrfp.core.sizes``); None: as without."""
        if training and self.limits.waiting_for_bytes and (
                self.activation_bytes_per_microbatch is not None):
            self.limits.settle(self.activation_bytes_per_microbatch, pp_group,
                               self.platform.device, self.platform.free_bytes)
        origin = time.perf_counter()

        def clock() -> float:
            return time.perf_counter() - origin

        tuned, self.limits = (self.self_driving.before_step(self.training_steps_run)
                              if training and self.self_driving else (None, self.limits))
        hint = (self.limits.ranked_by or self.hint) if training else self._forward_only
        told = told_sizes(sizes if training else None, tuned)
        self._expect_sizes(told)
        meter = self.metering.for_step(
            self.steps_run, self.activation_bytes_per_microbatch is not None,
            self.stages.values(),
            tuned is not None and self.self_driving.meters(self.training_steps_run))
        # The in-run A/B's fixed-order steps launch without bound, as torch's schedules do.
        fixed = training and (self.fixed_every > 0 and (
            self.training_steps_run % self.fixed_every == self.fixed_every - 1)
            or tuned is not None and (tuned.ab_fixed or tuned.setting == FIXED_ORDER))
        policy = (make_policy("fixed") if fixed else
                  make_policy(self.limits.policy, history=self.history, clock=clock)
                  if training else make_policy("hint"))  # forward only: plain readiness-first
        arbiter = Arbiter(hint, self.rank, limits=self.limits.limits if training else None,
                          policy=policy)
        executor = StageExecutor(self.stages, inputs, loss, reduction, self.transport,
                                 self.receives, self.platform, custom, clock, meter)
        coordinator = (make_coordinator(self.coordination.kind, self.coordination.twin,
                                        self.stall_timeout)
                       if self.coordination.twin is not None else None)
        loop = StepLoop(
            arbiter, self.device, executor,
            arrivals=_arrivals_since(origin, self.transport, self.receives), clock=clock,
            launch_depth=math.inf if fixed else self.launch_depth,
            reorder_ahead=self.reorder_ahead, stall_timeout=self.stall_timeout,
            describe_rank=f"pipeline rank {self.rank} (global rank {dist.get_rank()})",
            describe_peer=lambda peer: f"global rank {self.transport.channels.global_ranks[peer]}",
            coordinator=coordinator, block=self.wait)
        self._in_step = True
        prediction_error = None
        try:
            self._run_loop(loop, executor, origin, hint, training, coordinator, custom)
            prediction_error = self.history.prediction_errors(loop.device_runs)
            if training and meter is not None:
                self.activation_bytes_per_microbatch = {
                    s: executor.saved_per_microbatch.get(s, 0) for s in self.stages}
        finally:
            self._in_step = False
            self.last_step_stats = step_stats(
                loop, executor, coordinator, clock(), self.transport.take_sent(),
                rank=self.rank, device=self.device, meter=meter, limits=self.limits,
                activation_bytes_per_microbatch=self.activation_bytes_per_microbatch,
                receive_buffer_bytes=self.receives.peak_bytes, step=self.steps_run,
                size_prediction_error=prediction_error,
                setting=self.self_driving.label if self.self_driving else None,
                sizes=sizes if training else None, sizes_used=told is not None)
            self.steps_run += 1
            self.training_steps_run += training
        if tuned is not None:
            self.self_driving.after_step(self.training_steps_run - 1, self.last_step_stats)
        if training and not fixed:
            loop.teach(self.history)
            if told is not None:
                self.fit_sharing.publish(self.history.models.own_fits())
        return executor.losses

    def _expect_sizes(self, sizes: StepSizes | None) -> None:
        """Tell the history the step's sizes; where they tell microbatches apart, take the
        other ranks' latest fits of their stages first."""
        self.history.expect_sizes(sizes)
        if self.history.sizes_tell_apart:
            self.history.models.adopt(self.fit_sharing.latest())

    def _run_loop(self, loop: StepLoop, executor: StageExecutor, origin: float, hint: Hint,
                  training: bool, coordinator: Coordinator | None,
                  custom: CustomFunctions) -> None:
        """Run the step's loop to its end, its sends completed; on failure, hand the error
        to ``StepFailure``, which raises for it."""
        self.device.begin_step(origin, self.wakeup)
        self.transport.ledger.start_step(self.transport.channels)
        operations = self.transport.operations
        try:
            self.receives.start(self.transport, hint.plan, self.stages,
                                self.limits.limits.per_stage, training=training)
            for timeout in loop.run():
                self.wait(timeout)
            if coordinator is not None:
                coordinator.finish()
            self.transport.finish_sends(self.stall_timeout)
            self.receives.finish()
        except BaseException as e:
            self.failure.handle(e, loop=loop, running=executor.running, step=self.steps_run,
                                operations=operations, coordinator=coordinator, custom=custom)

    def _told_by_watch(self, rank: int, message: str) -> None:
        """The watch saw another rank's failure: outside a step nothing else will tell
        this rank's state (in a step, the step's own failure does)."""
        if not self._in_step:
            self.report.tell(self.failure.state(None, self.steps_run))

    def wait(self, timeout: float) -> None:
        """Wait up to ``timeout`` for an arrival or a completion; meanwhile look, every
        ``FAILURE_POLL_S``, at what the watch heard: another rank's failure (then raise
        ``PeerFailedError`` naming it: on NCCL nothing else would tell this rank) or the
        store gone (``StoreLostError``)."""
        end = time.perf_counter() + timeout
        while True:
            self.board.check()
            left = end - time.perf_counter()
            if left <= 0 or self.wakeup.wait(min(left, FAILURE_POLL_S)):
                return

    def close(self, failed: bool = False, timeout: float = 10.0) -> None:
        """Stop the threads and close the channels (see ``ScheduleRRFP.close``)."""
        atexit.unregister(self._close_at_exit)
        if self.self_driving is not None:
            self.self_driving.close()
        self.failure.closed()
        try:
            alive = self.transport.close(timeout, failed=failed,
                                         send_timeout=self.stall_timeout)
        finally:
            device_alive = self.device.close(timeout)
            watch_alive = self._watch.close(timeout)
        alive += device_alive + watch_alive
        if alive:
            raise RuntimeError(f"threads still running after close(): {[t.name for t in alive]}")


def _arrivals_since(origin: float, transport: Transport, receives: ReceiveRings
                    ) -> Callable[[], list[Arrival]]:
    """The step loop's arrivals: the messages the transport collected since it last
    looked, on the step's clock (from ``origin``)."""
    def arrivals() -> list[Arrival]:
        collected = transport.collect()
        if not collected:
            return []
        return [Arrival(r.edge, r.microbatch, r.seen - origin) for r in receives.arrived(collected)]

    return arrivals


def _closing_at_exit(runtime: PipelineRuntime) -> Callable[[], None]:
    """Close ``runtime`` at interpreter exit unless it was closed before (registered with
    ``atexit``, holding it weakly). A thread of it still waiting in a channel's receive
    (posted ahead for a step that never comes) when the interpreter finalizes is ended
    inside torch's C++ wait, which aborts the process ("terminate called without an
    active exception"); atexit handlers run before that, and a channel closes after
    ``dist.destroy_process_group()`` too (it is a group of its own)."""
    held = weakref.ref(runtime)

    def close() -> None:
        runtime = held()
        if runtime is None:
            return
        try:
            runtime.close()
        except RuntimeError as e:  # the process is exiting: say it, end normally
            logger.warning("rrfp: closing the schedule at exit: %s", e)

    atexit.register(close)
    return close


class ClosedOnLeaving:
    """``with ScheduleRRFP(...) as schedule:`` closes the schedule on leaving the block (a
    schedule never closed closes itself at interpreter exit)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()  # type: ignore[attr-defined]
