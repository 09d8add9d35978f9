"""Message-driven point-to-point transport between pipeline stages.

* **One channel per (producer stage, consumer stage, direction)**, each its own 2-rank
  communicator. NCCL matches P2P in posting order per communicator: on a shared one, a
  receive posted ahead would block later sends to the same peer (pytorch#172668). With a
  channel each, receives can be posted ahead safely.
* **Only the two ranks of a channel create it**, under a deterministic name in the default
  store (``rrfp/<pipeline ranks>/<generation>/<edge>``), so a rank's set-up cost does not
  grow with the number of pipelines, and a new schedule gets fresh channels (a new
  generation) that no stale receive of an earlier one can consume. ``dist.new_group``
  would make every rank of the world take part in every channel's creation (and, with a
  bound NCCL device, run a world-wide communicator split for each).
* **Connected before use**: a channel's ranks exchange one message on it right after
  creating it, channel by channel in one order on every rank (``connection_order``: in
  rounds, so that different rank pairs connect in parallel). NCCL creates a
  communicator lazily at its first operation and blocks until the peer joins; if receives
  were posted first, rank 0 would wait on the gradient channel 1->0 while rank 1 waits on
  the activation channel 0->1, each touching the other only when it sends. An order
  cannot cycle.
* **Arrival detection by backend**, behind one interface (``collect``): gloo's
  ``Work.is_completed()`` stays False until ``wait()`` is called, so a waiter thread per
  channel calls ``wait()`` (it releases the GIL) and wakes the step loop; NCCL's
  ``is_completed()`` is a CUDA event query, so it is polled, and ``wait()`` then only
  orders the compute stream after the receive.
* **Sends** are issued as soon as the producing action has run on the device (on CUDA, as
  soon as it is enqueued: NCCL orders its stream after the compute stream), and a sent
  tensor is let go as soon as its send completes. At step end, gloo sends are waited for
  with a timeout; NCCL sends only order the compute stream after them (a timeout would
  make ``wait`` block the CPU until the send completes).
"""

from __future__ import annotations

import datetime
import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from rrfp.device import Wakeup
from rrfp.hints import Edge, Hint

class Received(NamedTuple):
    """A receive that completed."""

    edge: Edge
    microbatch: int
    seen: float
    """``time.perf_counter()`` when it was seen complete."""
    header: bool = False
    """The shape header sent ahead of a message (variable shapes), not the message."""
SendDelay = Callable[[Edge, int], float]
"""Emulated link latency: seconds to hold the message for ``(edge, microbatch)``."""
GroupFactory = Callable[[str, dist.Store, int, datetime.timedelta], dist.ProcessGroup]
"""``(backend name, store, rank in the channel, timeout) -> a 2-rank process group``."""

CHANNEL_TIMEOUT = datetime.timedelta(minutes=30)
"""The channels' own timeout; ``stall_timeout`` normally reports a silent peer first."""


def make_channel_group(name: str, store: dist.Store, rank: int,
                       timeout: datetime.timedelta) -> dist.ProcessGroup:
    """A 2-rank gloo or NCCL process group over ``store`` (all its keys are under it).

    Built as ``dist.new_group`` builds one, minus the world-wide registration: a backend
    inside a ``ProcessGroup``, whose calls go through the dispatcher, so tensor subclasses
    (e.g. the ``AsyncCollectiveTensor`` a tensor-parallel layer returns) are waited for
    and unwrapped before they are sent.
    """
    group = dist.ProcessGroup(store, rank, 2)
    if name == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        backend_type, device = dist.ProcessGroup.BackendType.NCCL, torch.device("cuda")
        backend = dist.ProcessGroupNCCL(store, rank, 2, options)
    elif name == "gloo":
        backend_type, device = dist.ProcessGroup.BackendType.GLOO, torch.device("cpu")
        backend = dist.ProcessGroupGloo(store, rank, 2, timeout)
    else:
        raise ValueError(f"no channel backend {name!r}: rrfp channels use gloo (CPU) or "
                         "nccl (CUDA)")
    group._set_default_backend(backend_type)
    group._register_backend(device, backend_type, backend)
    return group


_MESSAGE_TAG = 0
_CLOSE_TAG = 1  # never sent: a receive on it only serves to close a gloo connection


@dataclass(frozen=True)
class Channel:
    """One direction of one stage edge: the producer is rank 0 of its group."""

    edge: Edge
    src_rank: int
    """Global rank of the producer."""
    dst_rank: int
    """Global rank of the consumer."""
    rank: int
    """This process's rank in the channel: 0 producer, 1 consumer."""
    backend_name: str
    """``"gloo"`` or ``"nccl"``: how arrivals are detected and sends completed."""
    group: dist.ProcessGroup
    """The channel's own process group of the two ranks."""

    def send(self, tensor: torch.Tensor) -> dist.Work:
        return self.group.send([tensor], 1, _MESSAGE_TAG)

    def recv(self, tensor: torch.Tensor) -> dist.Work:
        return self.group.recv([tensor], 0, _MESSAGE_TAG)

    def close(self) -> None:
        """Fail every pending operation on the channel, at both ends; it is not used again."""
        if self.backend_name == "nccl":
            self.group.abort()
            return
        # gloo cannot cancel a receive, but a receive that times out closes the connection,
        # which fails every pending operation on it at once (here and at the peer).
        try:
            work = self.group.recv([torch.zeros(1)], 1 - self.rank, _CLOSE_TAG)
            work.wait(datetime.timedelta(milliseconds=1))
        except RuntimeError:
            pass


_generations: dict[tuple[int, ...], int] = {}


def create_channels(
    hint: Hint,
    pp_group: dist.ProcessGroup | None,
    device: torch.device,
    *,
    group_factory: GroupFactory = make_channel_group,
    connect: bool = True,
    timeout: datetime.timedelta = CHANNEL_TIMEOUT,
) -> dict[Edge, Channel]:
    """Create and connect this rank's channels: one per remote edge of the hint touching it.

    Every rank of the pipeline group calls it when it builds its schedule (each builds as
    many schedules over the group as the others); only the two ranks of a channel
    communicate to create it. ``connect=False`` skips the exchange that connects each
    channel (only to show what happens without it).
    """
    pp_ranks = tuple(dist.get_process_group_ranks(pp_group or dist.group.WORLD))
    generation = _generations.get(pp_ranks, 0)
    _generations[pp_ranks] = generation + 1
    backend_name = "nccl" if device.type == "cuda" else "gloo"
    base = dist.PrefixStore(f"rrfp/{'-'.join(map(str, pp_ranks))}/{generation}/",
                            dist.distributed_c10d._get_default_store())
    me = dist.get_rank()
    channels: dict[Edge, Channel] = {}
    for edge in connection_order(hint):
        src = pp_ranks[hint.stage_to_rank[edge.src]]
        dst = pp_ranks[hint.stage_to_rank[edge.dst]]
        if me not in (src, dst):
            continue
        store = dist.PrefixStore(f"{edge.src}-{edge.dst}/", base)
        rank = 0 if me == src else 1
        channel = Channel(edge, src, dst, rank, backend_name,
                          group_factory(backend_name, store, rank, timeout))
        if connect:
            _connect(channel, device, timeout)
        channels[edge] = channel
    return channels


def connection_order(hint: Hint) -> list[Edge]:
    """The remote edges in the order every rank creates and connects its channels.

    In rounds in which no pipeline rank has two channels (a greedy edge colouring of the
    canonical edge order): channels of different rank pairs then connect in parallel,
    instead of in a chain along the pipeline (rank k would otherwise wait for rank k-1's
    earlier channels). Every rank walks the same order, so the waits cannot cycle: the
    first channel not yet connected has both its ranks waiting for it.
    """
    rounds_of: dict[int, set[int]] = {r: set() for r in range(hint.num_ranks)}
    keyed = []
    for index, edge in enumerate(hint.remote_edges()):
        a, b = hint.stage_to_rank[edge.src], hint.stage_to_rank[edge.dst]
        round_ = next(r for r in itertools.count() if r not in rounds_of[a] | rounds_of[b])
        rounds_of[a].add(round_)
        rounds_of[b].add(round_)
        keyed.append((round_, index, edge))
    return [edge for _, _, edge in sorted(keyed)]


def _connect(channel: Channel, device: torch.device, timeout: datetime.timedelta) -> None:
    """One message from producer to consumer, so the communicator exists before use."""
    token = torch.zeros(1, device=device)
    work = channel.send(token) if channel.rank == 0 else channel.recv(token)
    if channel.backend_name == "nccl":
        work.wait()  # communicator creation blocked the CPU; the transfer is stream-ordered
    else:
        work.wait(timeout)


class _WaiterThreads:
    """Arrival detection by waiting: a thread per channel calls ``wait()`` in order."""

    def __init__(self, wakeup: Wakeup) -> None:
        self._wakeup = wakeup
        self._arrived: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs: dict[Edge, queue.SimpleQueue] = {}
        self._threads: list[threading.Thread] = []

    def watch(self, edge: Edge, microbatch: int, works: Sequence[dist.Work],
              header: bool) -> None:
        if edge not in self._jobs:
            self._jobs[edge] = queue.SimpleQueue()
            thread = threading.Thread(target=self._wait_in_order, args=(self._jobs[edge],),
                                      name=f"rrfp-recv-{edge.src}-{edge.dst}", daemon=True)
            thread.start()
            self._threads.append(thread)
        self._jobs[edge].put((edge, microbatch, works, header))

    def _wait_in_order(self, jobs: queue.SimpleQueue) -> None:
        while (job := jobs.get()) is not None:
            edge, microbatch, works, header = job
            try:
                for work in works:
                    work.wait()
            except Exception as e:  # reported to the step loop, which raises it
                self._arrived.put((Received(edge, microbatch, 0.0, header), e))
            else:
                self._arrived.put((Received(edge, microbatch, time.perf_counter(), header), None))
            self._wakeup.notify()

    def collect(self) -> list[Received]:
        arrived = []
        while True:
            try:
                arrival, error = self._arrived.get_nowait()
            except queue.Empty:
                return arrived
            if error is not None:
                raise RuntimeError(f"receive of {arrival.edge} microbatch {arrival.microbatch} "
                                   "failed") from error
            arrived.append(arrival)

    def close(self, timeout: float) -> list[threading.Thread]:
        """Stop the threads once their current wait returns; the ones still alive."""
        for jobs in self._jobs.values():
            jobs.put(None)
        deadline = time.perf_counter() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.perf_counter()))
        return [t for t in self._threads if t.is_alive()]


class _Polling:
    """Arrival detection by polling ``is_completed()`` (NCCL: a CUDA event query)."""

    def __init__(self, wakeup: Wakeup) -> None:
        wakeup.polled = True
        self._pending: dict[Edge, deque] = {}

    def watch(self, edge: Edge, microbatch: int, works: Sequence[dist.Work],
              header: bool) -> None:
        self._pending.setdefault(edge, deque()).append((microbatch, works, header))

    def collect(self) -> list[Received]:
        arrived = []
        for edge, pending in self._pending.items():
            while pending and all(w.is_completed() for w in pending[0][1]):
                microbatch, works, header = pending.popleft()
                for work in works:
                    work.wait()  # orders the compute stream after the receive; no CPU wait
                arrived.append(Received(edge, microbatch, time.perf_counter(), header))
        return arrived

    def close(self, timeout: float) -> list[threading.Thread]:
        self._pending.clear()
        return []


class _SendCompletion:
    """Keeps each sent tensor alive until its send has completed, and no longer (torch's
    schedules keep every sent tensor until the step ends: with many microbatches, that is
    a whole step's outputs). gloo: a thread waits for the sends in the order they were
    issued; NCCL: completion is polled (a CUDA event query)."""

    def __init__(self, polled: bool) -> None:
        self._polled = polled
        self._cond = threading.Condition()
        self._pending: deque[tuple[Edge, int, list[dist.Work], list[torch.Tensor]]] = deque()
        """Sends issued and not yet completed, in issue order (gloo: the thread's queue)."""
        self._error: BaseException | None = None
        self._closed = False
        self.thread: threading.Thread | None = None
        if not polled:
            self.thread = threading.Thread(target=self._wait_in_order, daemon=True,
                                           name="rrfp-send-completion")
            self.thread.start()

    def watch(self, edge: Edge, microbatch: int, works: list[dist.Work],
              tensors: list[torch.Tensor]) -> None:
        # Their data, not the tensors: a stage's output holds its graph, which must go with
        # the step when it fails (NCCL sends are not waited for after a failure).
        data = [t.detach() for t in tensors]
        with self._cond:
            self._pending.append((edge, microbatch, works, data))
            self._cond.notify_all()

    def _wait_in_order(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if not self._pending:
                    return
                works = self._pending[0][2]
            try:
                for work in works:
                    work.wait()
            except Exception as e:  # raised by finish()
                self._error = self._error or e
            with self._cond:
                self._pending.popleft()
                self._cond.notify_all()

    def poll(self) -> None:
        """Release the tensors of completed sends (NCCL)."""
        if self._polled:
            with self._cond:
                while self._pending and all(w.is_completed() for w in self._pending[0][2]):
                    self._pending.popleft()

    def finish(self, deadline: float, describe: Callable[[Edge, int], str]) -> None:
        """Every send issued so far has completed: gloo, within ``deadline``
        (``TimeoutError`` otherwise); NCCL, on the stream (``wait()`` orders the current
        stream after the sends, without blocking the CPU as a timeout would)."""
        if self._polled:
            with self._cond:
                pending, self._pending = self._pending, deque()
            for _, _, works, _ in pending:
                for work in works:
                    work.wait()
            return
        with self._cond:
            while self._pending:
                if not self._cond.wait(timeout=max(0.0, deadline - time.perf_counter())):
                    edge, microbatch, _, _ = self._pending[0]
                    raise TimeoutError(f"{describe(edge, microbatch)} did not complete")
        if self._error is not None:
            raise RuntimeError("a send failed") from self._error

    def close(self) -> None:
        """Let the thread end once the sends issued so far are done (closing the channels
        first makes them fail at once)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class _DelayedSender:
    """Holds each message of one channel for an emulated latency, keeping FIFO order."""

    def __init__(self, channel: Channel, completion: _SendCompletion) -> None:
        self._channel = channel
        self._completion = completion
        self._queue: deque = deque()
        self._cond = threading.Condition()
        self._last_release = 0.0
        self._busy = False
        self._closed = False
        self._error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name=f"rrfp-send-{channel.edge.src}-{channel.edge.dst}")
        self.thread.start()

    def submit(self, microbatch: int, tensors: list[torch.Tensor], delay: float) -> None:
        with self._cond:
            self._last_release = max(time.perf_counter() + delay, self._last_release)
            self._queue.append((self._last_release, microbatch, tensors))
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                release, microbatch, tensors = self._queue[0]
                self._busy = True
            time.sleep(max(0.0, release - time.perf_counter()))
            try:
                works = [self._channel.send(t) for t in tensors]
                self._completion.watch(self._channel.edge, microbatch, works, tensors)
            except BaseException as e:  # surfaced by drain()
                self._error = e
            with self._cond:
                self._queue.popleft()
                self._busy = False
                self._cond.notify_all()

    def drain(self, deadline: float) -> None:
        """Wait until every message submitted so far has been sent."""
        with self._cond:
            while self._queue or self._busy:
                if not self._cond.wait(timeout=max(0.0, deadline - time.perf_counter())):
                    raise TimeoutError(
                        f"{len(self._queue)} delayed sends on {self._channel.edge} not issued"
                    )
            if self._error is not None:
                raise RuntimeError(f"send on {self._channel.edge} failed") from self._error

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class Transport:
    """Sends and receives of one rank's stages over their channels."""

    def __init__(self, channels: dict[Edge, Channel], wakeup: Wakeup, *,
                 send_delay: SendDelay | None = None):
        self.channels = channels
        polled = any(c.backend_name == "nccl" for c in channels.values())
        self._arrivals = _Polling(wakeup) if polled else _WaiterThreads(wakeup)
        self._send_delay = send_delay
        self._sends = _SendCompletion(polled)
        self._messages_sent = 0
        self._bytes_sent = 0
        self._delayed = ({e: _DelayedSender(c, self._sends) for e, c in channels.items()
                          if c.rank == 0} if send_delay is not None else {})

    def post_receive(self, edge: Edge, microbatch: int, buffers: Sequence[torch.Tensor], *,
                     header: bool = False) -> None:
        """Post the receive of ``microbatch`` on ``edge`` into ``buffers`` (``header``: of
        the shape header sent ahead of it).

        Call in the producer's send order: messages on a channel match in posting order.
        """
        channel = self.channels[edge]
        self._arrivals.watch(edge, microbatch, [channel.recv(b) for b in buffers], header)

    def send(self, edge: Edge, microbatch: int, tensors: list[torch.Tensor]) -> None:
        self._messages_sent += len(tensors)
        self._bytes_sent += sum(t.nbytes for t in tensors)
        if self._send_delay is not None:
            self._delayed[edge].submit(microbatch, tensors, self._send_delay(edge, microbatch))
            return
        self._sends.watch(edge, microbatch, [self.channels[edge].send(t) for t in tensors],
                          tensors)

    def take_sent(self) -> tuple[int, int]:
        """(messages, bytes) sent since the last call (each tensor of a message counts once)."""
        sent = (self._messages_sent, self._bytes_sent)
        self._messages_sent = self._bytes_sent = 0
        return sent

    def collect(self) -> list[Received]:
        """Messages that arrived since the last call; never blocks."""
        self._sends.poll()
        return self._arrivals.collect()

    def finish_sends(self, timeout: float) -> None:
        """Complete every send of the step; TimeoutError if a gloo send does not."""
        deadline = time.perf_counter() + timeout
        for sender in self._delayed.values():
            sender.drain(deadline)
        self._sends.finish(deadline, lambda edge, microbatch: (
            f"the send of {edge} microbatch {microbatch} to global rank "
            f"{self.channels[edge].dst_rank}"))

    def close(self, timeout: float = 10.0) -> list[threading.Thread]:
        """Close the channels (pending receives fail, here and at the peers) and stop the
        helper threads; return the threads still alive after ``timeout`` seconds."""
        for channel in self.channels.values():
            channel.close()
        for sender in self._delayed.values():
            sender.close()
        self._sends.close()
        alive = self._arrivals.close(timeout)
        threads = [s.thread for s in self._delayed.values()] + [self._sends.thread]
        for thread in threads:
            if thread is not None:
                thread.join(timeout)
        return alive + [t for t in threads if t is not None and t.is_alive()]
