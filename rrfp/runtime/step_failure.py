"""What a failed step does on one rank: tell the job, abandon the step, raise one error.

A step fails on a rank in one of three ways: another rank failed first (``PeerFailedError``,
told by the job's watch or met as a broken channel), the job's store is gone
(``StoreLostError``), or this rank failed first (any other exception). ``StepFailure.handle``
sorts the error, and for each way does what invariant 8 (docs/design/invariants.md) asks:
the failure is told to every rank of the job, the groups and channels a peer may wait in
are aborted, the step's activations are freed, and the runtime refuses further steps, so
no later step waits on a message the failed one left in flight. One exception: a step that
failed before this rank communicated leaves its channels and peers as before the step, so
the runtime stays usable, as torch's schedules do after an error raised before their first
send or receive.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import NoReturn

import torch.distributed as dist
from torch.distributed.pipelining.stage import _PipelineStageBase

from rrfp._torch_compat import clear_after_failure
from rrfp.comm.board import FailureBoard
from rrfp.comm.coordination import Coordinator
from rrfp.comm.receives import ReceiveRings
from rrfp.comm.transport import Transport
from rrfp.core.actions import _Action, describe
from rrfp.core.errors import PeerFailedError, PipelineStallError, StoreLostError
from rrfp.core.loop import Device, StepLoop
from rrfp.failure.hang_report import HangReport, rank_state
from rrfp.failure.job import JobGroups
from rrfp.runtime.torch_interface import CustomFunctions

logger = logging.getLogger(__name__)


class StepFailure:
    """One rank's handling of its failed steps, and whether it may run another."""

    def __init__(self, rank: int, stages: Mapping[int, _PipelineStageBase], *, device: Device,
                 transport: Transport, receives: ReceiveRings, board: FailureBoard,
                 report: HangReport, job_groups: JobGroups, stall_timeout: float,
                 close: Callable[[], None]):
        self.rank, self.stages = rank, stages
        self.device, self.transport, self.receives = device, transport, receives
        self.board, self.report, self.job_groups = board, report, job_groups
        self.stall_timeout = stall_timeout
        self._close = close
        """Closes the runtime's threads and channels, as after a failure."""
        self.refusal: str | None = None
        """Why no further step may run (None: steps may run)."""

    def refuse_if_failed(self) -> None:
        if self.refusal is not None:
            raise RuntimeError(
                f"this ScheduleRRFP cannot run another step ({self.refusal}); its channels "
                "are closed: build a new ScheduleRRFP on every rank of the pipeline, which "
                "connects fresh ones")

    def closed(self) -> None:
        """The runtime was closed: no further step (a failure's reason stays)."""
        self.refusal = self.refusal or "the schedule was closed"

    def handle(self, error: BaseException, *, loop: StepLoop, running: _Action | None,
               step: int, operations: int, coordinator: Coordinator | None,
               custom: CustomFunctions) -> NoReturn:
        """Raise for the step that failed with ``error``; ``running``: the action this
        rank ran then, ``step``: the step's number, ``operations``: what its transport had
        issued at the step's start."""
        if isinstance(error, PeerFailedError):
            self._stop_for_peer(error, loop, step, custom, error, computing=None)
        if isinstance(error, StoreLostError):
            self._stop_for_store(error, custom, error, computing=None)
        computing = bool(self.device.close(self.stall_timeout))
        if self._usable(operations, coordinator, custom, computing):
            raise error
        # A peer's failure may be what broke this step (a closed gloo connection, an
        # aborted collective): say so, naming it; otherwise this rank failed first, and
        # tells the others.
        try:
            self.board.check(force=True)
        except PeerFailedError as peer:
            self._stop_for_peer(peer, loop, step, custom, error, computing)
        except StoreLostError as lost:
            self._stop_for_store(lost, custom, error, computing)
        self._fail(error, loop, running, step, custom, computing)

    def state(self, error: BaseException | None, step: int,
              loop: StepLoop | None = None) -> dict:
        """What this rank tells a hang report now (``loop``: the step running, if any)."""
        return rank_state(rank=dist.get_rank(), pipeline_rank=self.rank,
                          stages=sorted(self.stages),
                          step=step, error=error, loop=loop, transport=self.transport)

    def _describe_rank(self) -> str:
        return f"pipeline rank {self.rank} (global rank {dist.get_rank()})"

    def _stop_for_peer(self, error: PeerFailedError, loop: StepLoop, step: int,
                       custom: CustomFunctions, cause: BaseException,
                       computing: bool | None) -> NoReturn:
        """Another rank failed first: tell this rank's state (for a hang report), abandon
        the step, raise ``error`` saying what this rank was waiting for."""
        self.report.tell(self.state(error, step, loop))
        self._abandon(error, custom, computing)
        raise PeerFailedError(
            f"{self._describe_rank()} stops its step: {error}\nit was waiting for:\n"
            + "\n".join(loop.waiting()), error.failed_rank) from cause

    def _stop_for_store(self, error: StoreLostError, custom: CustomFunctions,
                        cause: BaseException, computing: bool | None) -> NoReturn:
        """The job's store is gone: abandon the step (nothing more is asked of the store)
        and raise one line naming it."""
        self._abandon(error, custom, computing)
        raise StoreLostError(f"{self._describe_rank()} stops its step: {error}") from cause

    def _fail(self, error: BaseException, loop: StepLoop, running: _Action | None, step: int,
              custom: CustomFunctions, computing: bool) -> NoReturn:
        """This rank failed first: tell every rank of the job, naming the action it ran;
        abandon the step. A stall also gets the job's hang report, written here if this
        rank's failure is the one the board kept (the others' errors point at it)."""
        stalled = isinstance(error, (PipelineStallError, TimeoutError))
        board = self.board
        board.publish(
            f"{self._describe_rank()} failed its step"
            + (f" in {describe(running)}" if running is not None else "")
            + f": {_with_causes(error)}"
            + (f"\nhang report: {self.report.path}" if stalled else ""))
        first = board.failure()
        state = self.state(error, step, loop)
        self.report.tell(state)
        self._abandon(error, custom, computing)
        report = ""
        if stalled and first is not None and first[0] == board.me:
            report = f"\nhang report: {self.report.write(state)}"
        elif stalled and first is not None:  # another rank's stall came first: its report
            report = "".join(f"\n{line} (by global rank {first[0]}, whose failure came first)"
                             for line in first[1].splitlines()[-1:]
                             if line.startswith("hang report: "))
        if isinstance(error, TimeoutError):
            raise PipelineStallError(f"pipeline rank {self.rank}: {error}{report}") from error
        if report:
            raise PipelineStallError(f"{error}{report}") from error
        raise error

    def _usable(self, operations: int, coordinator: Coordinator | None,
                custom: CustomFunctions, computing: bool) -> bool:
        """After this rank's step failed and its device closed (``computing``: its thread
        still runs): whether nothing it launched still runs and it had issued no receive,
        send or coordination round (its transport had issued ``operations`` at the start).
        Then what the step left goes, and no failure is told to the peers (they wait, as
        for a rank that has not stepped yet)."""
        if computing or self.transport.operations != operations or (
                coordinator is not None and coordinator.rounds):
            return False
        self._let_go_of_the_step(custom)
        return True

    def _abandon(self, error: BaseException, custom: CustomFunctions,
                 computing: bool | None) -> None:
        """After a failed step (its failure already published, or a peer's seen): abort
        the groups a replica may be blocked in with this rank, then the channels, so that
        pending collectives and receives fail (on gloo the peers' too); stop the device
        (``computing`` None: not closed yet); free the unfinished microbatches'
        activations (unless the device's thread, which may read them, still runs);
        refuse further steps."""
        self.refusal = f"a step failed with {type(error).__name__} on pipeline rank {self.rank}"
        self.job_groups.abort()
        if computing is None:
            computing = bool(self.device.close(self.stall_timeout))
        try:
            self._close()
        except RuntimeError as e:  # e.g. a send gloo left pending: it holds no stage state
            logger.warning("pipeline rank %d: %s", self.rank, e)
        if not computing:
            self._let_go_of_the_step(custom)

    def _let_go_of_the_step(self, custom: CustomFunctions) -> None:
        """After a failed step: unbind its receive buffers, drop its losses and what it left
        in the stages (their graphs, and what those saved, go now rather than at the
        stages' next step)."""
        self.receives.finish()
        custom.forget_step()
        for stage in self.stages.values():
            clear_after_failure(stage)


def _with_causes(error: BaseException, most: int = 4) -> str:
    """``error`` and what caused it (torch wraps a stage's error in one that names the
    stage), each as its type and first line, the full text of the first."""
    text = f"{type(error).__name__}: {' '.join(str(error).split())}"
    cause = error.__cause__ or error.__context__
    for _ in range(most - 1):
        if cause is None:
            break
        line = next((line.strip() for line in str(cause).splitlines() if line.strip()), "")
        text += f" <- caused by {type(cause).__name__}: {line}"
        cause = cause.__cause__ or cause.__context__
    return text
