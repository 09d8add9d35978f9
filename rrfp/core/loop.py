"""The one pick -> launch -> complete loop of a pipeline rank, for any device.

A rank decides what to run next when its *device* is free, not when its CPU returns from a
launch: it is free while fewer than ``launch_depth`` of its launched actions are incomplete
on the device. On CUDA a launch returns once kernels are enqueued, so deciding at launch
time would enqueue every ready action at once and freeze the order long before the device
gets to it. Ahead of a busy device only the policy's own next action may be launched (to
hide the CPU's launch cost, as a fixed schedule does): the hint's next, unless the policy
ranks actions by another order; any other action is chosen only when the device is idle,
on the latest arrivals.

What differs between a CUDA device, the emulated asynchronous device of the CPU tests and
the simulator sits behind two small interfaces: ``Device`` (launch work behind earlier
work; report completions without blocking) and ``Executor`` (the work an action does: its
stage compute and the sends of its outputs). ``StepLoop.run`` is a generator: when nothing
can be launched it yields how long it may wait, and its driver waits for an event (the
runtime: a message or a device completion; the simulator: the next simulated event) and
resumes it. So ``ScheduleRRFP`` and ``rrfp.sim`` run this very code.

Torch-free, like the arbiter.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from rrfp.core.actions import _Action, describe, Edge
from rrfp.core.arbiter import Arbiter
from rrfp.core.errors import PipelineStallError
from rrfp.core.history import History
from rrfp.core.plan import Node
from rrfp.core.settings import DEFAULT_LAUNCH_DEPTH


@dataclass(frozen=True)
class Completion:
    """An action the device finished: when it ran, in seconds from the step start."""

    action: _Action
    start: float
    end: float


class Arrival(NamedTuple):
    """A message that arrived, in seconds from the step start."""

    edge: Edge
    microbatch: int
    at: float


class Device(Protocol):
    """Where a rank's actions run: in launch order, possibly after ``launch`` returned."""

    @property
    def outstanding(self) -> int:
        """Launched actions the device has not completed (as of the last ``completed``)."""
        ...

    def launch(self, action: _Action, work: Callable[[], None]) -> None:
        """Run ``work`` (the action's compute, then its sends) behind everything launched
        before. May return before it runs."""
        ...

    def completed(self) -> list[Completion]:
        """Actions finished since the last call, in launch order; never blocks. Raises
        if launched work failed."""
        ...


class Executor(Protocol):
    """What an action does on this rank."""

    def work(self, node: Node) -> Callable[[], None]:
        """The compute of ``node``'s action, then the messages it sends (``node.sends``)."""
        ...

    def completed(self, action: _Action) -> None:
        """``action`` has completed on the device (e.g. its buffers may be reused)."""
        ...


@dataclass
class StepLoop:
    """One rank, one step: pick -> launch -> complete, until every action has completed."""

    arbiter: Arbiter
    device: Device
    executor: Executor
    arrivals: Callable[[], list[Arrival]]
    """Messages that arrived since the last call; never blocks."""
    clock: Callable[[], float]
    """Seconds since the step start."""
    launch_depth: float = DEFAULT_LAUNCH_DEPTH
    """Launched-but-incomplete actions the device may hold (``math.inf``: no bound)."""
    reorder_ahead: bool = False
    """Whether any ready action may be launched onto a busy device. False (what
    ``ScheduleRRFP`` does): ahead of the device only the policy's own next action is
    launched, and deviations are chosen when the device is idle, on the latest arrivals. True with
    no depth bound models a runtime that decides when its launches return (for studies)."""
    stall_timeout: float = math.inf
    """Seconds without a launch, an arrival or a completion before the step raises."""
    describe_rank: str = "rank"
    """How a stall error names this rank (e.g. with its global rank)."""
    describe_peer: Callable[[int], str] = str
    """How a stall error names a peer pipeline rank."""
    coordinator: object | None = None
    """``rrfp.comm.coordination.Coordinator`` of an intra-stage collective group, or None."""
    block: Callable[[float], None] | None = None
    """Blocking wait for events (the runtime's), used by coordination rounds."""

    completions: list[Completion] = field(default_factory=list)
    received: list[Arrival] = field(default_factory=list)
    decision_time: float = 0.0
    """Seconds on the host thread's clock (wall time: waits for the GIL or a CPU included)
    choosing actions and keeping the books (dispatch overhead)."""
    launch_time: float = 0.0
    """Seconds inside ``Device.launch`` (on a synchronous device: the compute too)."""
    wait_time: float = 0.0
    """Seconds waiting for an event with nothing to launch."""
    waits: list[tuple[float, float]] = field(default_factory=list)
    """(start, end) of each stretch of such waits that no launch or event interrupted."""
    _on_device: deque[_Action] = field(default_factory=deque)

    def run(self) -> Iterator[float]:
        arbiter, device, coordinator = self.arbiter, self.device, self.coordinator
        changed = True  # what may run only changes with arrivals and completions
        progress_at = self.clock()  # last launch, arrival or completion
        # Polled sources wake the loop every few microseconds: one idle stretch is one wait.
        extends_wait = False
        while True:
            t0 = self.clock()
            if self._take_events():
                changed, progress_at, extends_wait = True, t0, False
            if arbiter.finished and not device.outstanding:
                return
            free = not arbiter.finished and device.outstanding < self.launch_depth
            action = None
            if free and (changed or coordinator is not None):
                action = self._choose()
                changed = False
            self.decision_time += self.clock() - t0
            if action is not None:
                self._launch(action)
                changed, progress_at, extends_wait = True, self.clock(), False
                continue
            now = self.clock()
            if now - progress_at >= self.stall_timeout:
                raise self._stall_error(now - progress_at)
            if free and coordinator is not None and not coordinator.waits_when_idle:
                changed, extends_wait = True, False  # the next round waited for arrivals itself
                continue
            yield self.stall_timeout - (now - progress_at)
            end = self.clock()
            self.wait_time += end - now
            if extends_wait:
                self.waits[-1] = (self.waits[-1][0], end)
            else:
                self.waits.append((now, end))
            extends_wait = True

    def _take_events(self) -> bool:
        """Hand arrivals to the arbiter, collect completions; whether there were any."""
        arrived = self.arrivals()
        if arrived:
            deliver = self.arbiter.deliver
            for arrival in arrived:
                deliver(arrival.edge, arrival.microbatch, at=arrival.at)
            self.received.extend(arrived)
        done = self.device.completed()
        if not done:
            return bool(arrived)
        self.completions.extend(done)
        for completion in done:
            self._on_device.popleft()
            self.executor.completed(completion.action)
        return True

    def _choose(self) -> _Action | None:
        arbiter, coordinator = self.arbiter, self.coordinator
        proposal = arbiter.choose() if coordinator is None or coordinator.needs_choice else None
        if (proposal is not None and self.device.outstanding and not self.reorder_ahead
                and arbiter.position(proposal) != arbiter.lead()):
            # Ahead of a busy device only the policy's own next action is launched (hiding
            # the launch cost, as a fixed schedule would); a deviation from it waits for an
            # idle device, so that it is chosen on the latest arrivals.
            proposal = None
        if coordinator is None:
            return proposal
        return coordinator.settle(proposal, arbiter, self._block_and_take_events)

    def _block_and_take_events(self, timeout: float) -> None:
        start = self.clock()
        self.block(timeout)  # type: ignore[misc]
        self.wait_time += self.clock() - start
        self._take_events()

    def _launch(self, action: _Action) -> None:
        start = self.clock()
        self.device.launch(action, self.executor.work(self.arbiter.plan.node(action)))
        self.launch_time += self.clock() - start
        self.arbiter.record_launch(action)
        self._on_device.append(action)

    @property
    def on_device(self) -> list[_Action]:
        """Actions launched and not yet completed, in launch order."""
        return list(self._on_device)

    def waiting(self) -> list[str]:
        """What the rank waits for now: a line per launched action and stream head."""
        lines = [f"  {describe(a)} launched, not yet completed by the device"
                 for a in self._on_device]
        for wait in self.arbiter.waits():
            line = f"  {wait}"
            if wait.peer_rank is not None:
                line += f" ({self.describe_peer(wait.peer_rank)})"
            lines.append(line)
        return lines

    def _stall_error(self, waited: float) -> PipelineStallError:
        lines = self.waiting()
        return PipelineStallError(
            f"{self.describe_rank} stalled: nothing launched, arrived or completed for "
            f"{waited:.1f} s "
            f"(stall_timeout) with hint {self.arbiter.hint.name!r}; launched "
            f"{len(self.arbiter.realized)} of {len(self.arbiter.nodes)} actions; waiting:\n"
            + "\n".join(lines))

    # ----------------------------------------------------------------- what it saw
    @property
    def busy_time(self) -> float:
        """Seconds the device spent running this step's actions."""
        return sum(c.end - c.start for c in self.completions)

    @property
    def device_runs(self) -> list[tuple[int, str, int | None, float]]:
        """This step's actions as (stage, kind, microbatch, seconds on the device)."""
        return [(c.action.stage_index, c.action.computation_type.value,
                 c.action.microbatch_index, c.end - c.start) for c in self.completions]

    def teach(self, history: History) -> None:
        """Record this step's device durations (with the sizes the history was told to
        expect) and arrivals for the next step's policy."""
        history.start_step()
        history.record_step(self.device_runs)
        for arrival in self.received:
            history.record_arrival(arrival.edge, arrival.microbatch, arrival.at)

