"""Message-driven point-to-point transport between pipeline stages.

* One process group per channel, i.e. per (producer stage, consumer stage, direction),
  created once, in the same order on every rank. NCCL matches P2P in posting order per
  communicator: on a shared communicator a receive posted ahead would block later sends to
  the same peer (pytorch#172668). With a channel each, receives can be posted ahead safely.
* Receives are posted for a whole step at its start, in the order the producer sends
  (fixed by the hint's streams). Arrivals are reported as ``(edge, microbatch)``.
* Arrival detection depends on the backend, behind one interface (``collect``): gloo's
  ``Work.is_completed()`` stays False until ``wait()`` is called, so a waiter thread per
  channel calls ``wait()`` (it releases the GIL); NCCL's ``is_completed()`` is a CUDA
  event query, so it is polled.
* Sends are issued as soon as the producing action has run, and waited for at step end.
"""

from __future__ import annotations

import datetime
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rrfp.hints import Edge, Hint

Arrival = tuple[Edge, int, float]
"""(edge, microbatch, ``time.perf_counter()`` when the message was seen complete)."""
SendDelay = Callable[[Edge, int], float]
"""Emulated link latency: seconds to hold the message for ``(edge, microbatch)``."""


@dataclass(frozen=True)
class Channel:
    edge: Edge
    src_rank: int
    """Global rank of the producer."""
    dst_rank: int
    """Global rank of the consumer."""
    group: dist.ProcessGroup


# Channel groups are reused by later schedules over the same default process group:
# creating groups is a world-wide collective, and every rank builds the same schedules in
# the same order, so all ranks hit or miss this cache alike.
_channel_groups: dict[tuple[int, int, Edge], dist.ProcessGroup] = {}
_channel_groups_world: list[dist.ProcessGroup] = []


def _channel_group(src: int, dst: int, edge: Edge) -> dist.ProcessGroup:
    world = dist.distributed_c10d._get_default_group()
    if _channel_groups_world != [world]:
        _channel_groups.clear()
        _channel_groups_world[:] = [world]
    key = (src, dst, edge)
    if key not in _channel_groups:
        _channel_groups[key] = dist.new_group(ranks=sorted({src, dst}))
    return _channel_groups[key]


def create_channels(hint: Hint, pp_group: dist.ProcessGroup | None) -> dict[Edge, Channel]:
    """This rank's channels, one per remote edge of the hint that touches it.

    Collective over the whole world (it creates process groups): every rank must call it,
    in the same order relative to other group creations. With data or tensor parallelism
    there are several pipeline groups; all ranks create the channels of all of them.
    """
    pp_ranks = tuple(dist.get_process_group_ranks(pp_group or dist.group.WORLD))
    world_size = dist.get_world_size()
    if len(pp_ranks) == world_size:
        all_pp_groups = [pp_ranks]
    else:
        gathered: list = [None] * world_size
        dist.all_gather_object(gathered, pp_ranks)
        all_pp_groups = sorted({tuple(g) for g in gathered})
        if any(len(g) != len(pp_ranks) for g in all_pp_groups):
            raise ValueError(f"pipeline groups differ in size: {all_pp_groups}")
    me = dist.get_rank()
    channels: dict[Edge, Channel] = {}
    for group_ranks in all_pp_groups:
        for edge in hint.remote_edges():
            src = group_ranks[hint.stage_to_rank[edge.src]]
            dst = group_ranks[hint.stage_to_rank[edge.dst]]
            group = _channel_group(src, dst, edge)
            if group_ranks == pp_ranks and me in (src, dst):
                channels[edge] = Channel(edge, src, dst, group)
    return channels


class _WaiterThreads:
    """Arrival detection by waiting: a thread per channel calls ``wait()`` in order."""

    def __init__(self) -> None:
        self._arrived: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs: dict[Edge, queue.SimpleQueue] = {}

    def watch(self, edge: Edge, microbatch: int, works: Sequence[dist.Work]) -> None:
        if edge not in self._jobs:
            self._jobs[edge] = queue.SimpleQueue()
            threading.Thread(
                target=self._wait_in_order, args=(self._jobs[edge],),
                name=f"rrfp-recv-{edge.src}-{edge.dst}", daemon=True,
            ).start()
        self._jobs[edge].put((edge, microbatch, works))

    def _wait_in_order(self, jobs: queue.SimpleQueue) -> None:
        while True:
            edge, microbatch, works = jobs.get()
            try:
                for work in works:
                    work.wait()
            except Exception as e:  # reported to the compute thread, which raises it
                self._arrived.put((edge, microbatch, e))
            else:
                self._arrived.put((edge, microbatch, time.perf_counter()))

    def collect(self, timeout: float) -> list[Arrival]:
        if timeout <= 0 and self._arrived.empty():
            return []
        arrived = []
        try:
            item = self._arrived.get(timeout=timeout) if timeout > 0 else self._arrived.get_nowait()
            while True:
                edge, microbatch, outcome = item
                if isinstance(outcome, BaseException):
                    raise RuntimeError(f"receive of {edge} microbatch {microbatch} failed") from outcome
                arrived.append((edge, microbatch, outcome))
                item = self._arrived.get_nowait()
        except queue.Empty:
            pass
        return arrived


class _Polling:
    """Arrival detection by polling ``is_completed()`` (NCCL: a CUDA event query)."""

    _POLL_INTERVAL_S = 20e-6

    def __init__(self) -> None:
        self._pending: dict[Edge, deque] = {}

    def watch(self, edge: Edge, microbatch: int, works: Sequence[dist.Work]) -> None:
        self._pending.setdefault(edge, deque()).append((microbatch, works))

    def _poll(self) -> list[Arrival]:
        arrived = []
        for edge, pending in self._pending.items():
            while pending and all(w.is_completed() for w in pending[0][1]):
                microbatch, works = pending.popleft()
                for work in works:
                    work.wait()  # orders the compute stream after the receive
                arrived.append((edge, microbatch, time.perf_counter()))
        return arrived

    def collect(self, timeout: float) -> list[Arrival]:
        deadline = time.perf_counter() + timeout
        while not (arrived := self._poll()) and time.perf_counter() < deadline:
            time.sleep(self._POLL_INTERVAL_S)
        return arrived


class _DelayedSender:
    """Holds each message of one channel for an emulated latency, keeping FIFO order."""

    def __init__(self, channel: Channel) -> None:
        self._channel = channel
        self._queue: deque = deque()
        self._cond = threading.Condition()
        self._works: list[tuple[int, list[dist.Work], list[torch.Tensor]]] = []
        self._last_release = 0.0
        self._busy = False
        self._error: BaseException | None = None
        threading.Thread(target=self._run, daemon=True,
                         name=f"rrfp-send-{channel.edge.src}-{channel.edge.dst}").start()

    def submit(self, microbatch: int, tensors: list[torch.Tensor], delay: float) -> None:
        with self._cond:
            self._last_release = max(time.perf_counter() + delay, self._last_release)
            self._queue.append((self._last_release, microbatch, tensors))
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                release, microbatch, tensors = self._queue[0]
                self._busy = True
            time.sleep(max(0.0, release - time.perf_counter()))
            try:
                works = [dist.isend(t, dst=self._channel.dst_rank, group=self._channel.group)
                         for t in tensors]
            except BaseException as e:  # surfaced by drain()
                works, self._error = [], e
            with self._cond:
                self._queue.popleft()
                self._works.append((microbatch, works, tensors))
                self._busy = False
                self._cond.notify_all()

    def drain(self, deadline: float) -> list[tuple[int, list[dist.Work], list[torch.Tensor]]]:
        with self._cond:
            while self._queue or self._busy:
                if not self._cond.wait(timeout=max(0.0, deadline - time.perf_counter())):
                    raise TimeoutError(
                        f"{len(self._queue)} delayed sends on {self._channel.edge} not issued"
                    )
            if self._error is not None:
                raise RuntimeError(f"send on {self._channel.edge} failed") from self._error
            works, self._works = self._works, []
        return works


class Transport:
    """Sends and receives of one rank's stages over their channels."""

    def __init__(
        self,
        channels: dict[Edge, Channel],
        *,
        poll_completion: bool,
        send_delay: SendDelay | None = None,
    ):
        self.channels = channels
        self._arrivals = _Polling() if poll_completion else _WaiterThreads()
        self._send_delay = send_delay
        self._delayed = (
            {e: _DelayedSender(c) for e, c in channels.items() if c.src_rank == dist.get_rank()}
            if send_delay is not None else {}
        )
        self._sends: list[tuple[Edge, int, list[dist.Work], list[torch.Tensor]]] = []

    def post_receives(self, edge: Edge, microbatch: int, buffers: Sequence[torch.Tensor]) -> None:
        """Post the receive of ``microbatch`` on ``edge`` into ``buffers``.

        Call in the producer's send order: messages on a channel match in posting order.
        """
        channel = self.channels[edge]
        works = [dist.irecv(b, src=channel.src_rank, group=channel.group) for b in buffers]
        self._arrivals.watch(edge, microbatch, works)

    def send(self, edge: Edge, microbatch: int, tensors: list[torch.Tensor]) -> None:
        if self._send_delay is not None:
            self._delayed[edge].submit(microbatch, tensors, self._send_delay(edge, microbatch))
            return
        channel = self.channels[edge]
        works = [dist.isend(t, dst=channel.dst_rank, group=channel.group) for t in tensors]
        self._sends.append((edge, microbatch, works, tensors))

    def collect(self, timeout: float = 0.0) -> list[Arrival]:
        """Messages that arrived since the last call; waits up to ``timeout`` for one."""
        return self._arrivals.collect(timeout)

    def finish_sends(self, timeout: float) -> None:
        """Wait until every send of the step has completed; TimeoutError if one does not."""
        deadline = time.perf_counter() + timeout
        for edge, sender in self._delayed.items():
            self._sends.extend((edge, mb, works, tensors)
                               for mb, works, tensors in sender.drain(deadline))
        sends, self._sends = self._sends, []
        for edge, microbatch, works, _ in sends:
            for work in works:
                left = max(deadline - time.perf_counter(), 1e-3)
                try:
                    work.wait(datetime.timedelta(seconds=left))
                except RuntimeError as e:
                    channel = self.channels[edge]
                    raise TimeoutError(
                        f"the send of {edge} microbatch {microbatch} to global rank "
                        f"{channel.dst_rank} did not complete: {e}"
                    ) from e
