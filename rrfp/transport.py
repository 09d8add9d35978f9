"""Message-driven point-to-point transport between pipeline stages.

* **One channel per (producer stage, consumer stage, direction)**, each its own 2-rank
  communicator. NCCL matches P2P in posting order per communicator: on a shared one, a
  receive posted ahead would block later sends to the same peer (pytorch#172668). With a
  channel each, receives can be posted ahead safely. On gloo the channels use the
  default group's transport devices (``_gloo_devices``), so they add no I/O thread: a
  device per channel ran a thread per channel, each waking about every 10 ms.
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
  make ``wait`` block the CPU until the send completes). A send whose work completed with
  an error raises, naming its channel, when its completion is seen.
* **Failure is told through the store, not the channels** (``FailureBoard``): a rank whose
  step fails publishes it under the pipeline's prefix before it closes its channels, and
  every rank of the pipeline checks that key while it waits (at most every
  ``FAILURE_POLL_S``), raising ``PeerFailedError`` naming the failed rank. On gloo the
  closed connections would fail the peers too, but on NCCL an abort is local: a peer
  would wait out its ``stall_timeout``.
* **Closing**: after a failure the channels are aborted *concurrently*, with a bounded
  wait (an ``ncclCommAbort`` can block while another communicator's kernel spins,
  pytorch#119797, so aborting one after another can hang); a healthy ``close`` first
  completes the sends still in flight (NCCL: the step may return before the peer has
  received its last messages), bounded by the send timeout, then shuts the channels down.
* **NCCL error handling**: torch's default ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3`` makes a
  communicator error terminate the process from torch's watchdog, so a failed step could
  not be followed by a new schedule. Unless the variable is set, rrfp's NCCL channels are
  built with it at 0 (torch reads it when a group is constructed; rrfp's own failure
  protocol above handles errors, and ``_abort_process_group``'s docstring asks for 0).
* **Receives are posted under a side stream** on CUDA (``ReceiveStreams``): NCCL's stream
  waits for the caller's current stream at call time, so a receive posted while the
  compute stream is current would wait for all compute queued so far. A slot is only
  re-posted once its last reader has completed, so nothing queued can still read it;
  variable-shape payload buffers are allocated on the side stream and recorded on the
  compute stream, so the allocator cannot hand out memory queued compute still reads.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import itertools
import logging
import os
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
from rrfp.loop import PipelineStallError

logger = logging.getLogger(__name__)

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
GroupFactory = Callable[..., dist.ProcessGroup]
"""``(backend name, store, rank in the channel, timeout, *, group_name, global_ranks) ->``
a 2-rank process group."""

CHANNEL_TIMEOUT = datetime.timedelta(minutes=30)
"""The channels' own timeout; ``stall_timeout`` normally reports a silent peer first."""
FAILURE_POLL_S = 0.1
"""How often a waiting rank reads the pipeline's failure key (one store round trip)."""
ASYNC_ERROR_HANDLING = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING")


class PeerFailedError(PipelineStallError):
    """Another rank of the pipeline failed its step (it said so through the store)."""

    def __init__(self, message: str, failed_rank: int):
        super().__init__(message)
        self.failed_rank = failed_rank
        """Global rank of the rank that failed first."""


@contextlib.contextmanager
def _recoverable_nccl_errors():
    """While NCCL channel groups are constructed: ``TORCH_NCCL_ASYNC_ERROR_HANDLING=0``
    unless the user set it (torch reads it in the group's constructor; its default 3
    would make the watchdog terminate the process on a channel error)."""
    if any(name in os.environ for name in ASYNC_ERROR_HANDLING):
        yield
        return
    os.environ[ASYNC_ERROR_HANDLING[0]] = "0"
    try:
        yield
    finally:
        os.environ.pop(ASYNC_ERROR_HANDLING[0], None)


def _gloo_devices() -> list[dist.ProcessGroupGloo.Device]:
    """The gloo transport devices every gloo channel of this process uses: the default
    group's when it has a gloo backend (its interfaces, e.g. ``GLOO_SOCKET_IFNAME``, and
    its I/O thread), else rrfp's own (``_own_gloo_devices``).

    A gloo device runs an I/O thread that wakes about every 10 ms even when idle; a
    device per channel (``ProcessGroupGloo``'s default) meant one such thread per channel
    (6 on each rank of PP 2 x 2 stages), each waking to take a core from the compute of a
    rank (torchtitan's llama3 debug model, PP 2 x 2 stages on 2 CPUs: 8 gloo I/O threads
    per process, ~6,300 voluntary context switches per process over 12 steps against
    ~1,800 under torch's schedule). A device serves every group's connections, as torch's
    own group serves all its peers."""
    if dist.is_initialized():
        try:
            backend = dist.distributed_c10d._get_default_group()._get_backend(
                torch.device("cpu"))
        except (RuntimeError, ValueError):  # no CPU backend (an NCCL-only default group)
            backend = None
        if isinstance(backend, dist.ProcessGroupGloo):
            return list(backend.options._devices)
    return _own_gloo_devices()


@functools.cache
def _own_gloo_devices() -> list[dist.ProcessGroupGloo.Device]:
    """Devices as torch's ``ProcessGroupGloo(store, rank, size, timeout)`` makes them: one
    per interface in ``GLOO_SOCKET_IFNAME``, else the default one; made once a process."""
    interfaces = [i for i in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if i]
    if interfaces:
        return [dist.ProcessGroupGloo.create_device(interface=i) for i in interfaces]
    return [dist.ProcessGroupGloo.create_default_device()]


def make_channel_group(name: str, store: dist.Store, rank: int,
                       timeout: datetime.timedelta, *, group_name: str = "",
                       global_ranks: Sequence[int] = (), size: int = 2) -> dist.ProcessGroup:
    """A gloo or NCCL process group of ``size`` ranks (a channel's 2 by default) over
    ``store`` (all its keys are under it), created by its members alone.

    Built as ``dist.new_group`` builds one, minus the world-wide registration: a backend
    inside a ``ProcessGroup``, whose calls go through the dispatcher, so tensor subclasses
    (e.g. the ``AsyncCollectiveTensor`` a tensor-parallel layer returns) are waited for
    and unwrapped before they are sent. Named (``group_name``, and on NCCL the global
    ranks), so that Flight Recorder and NCCL's logs say which channel they mean.
    """
    group = dist.ProcessGroup(store, rank, size)
    if name == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        if group_name:
            options.group_name = group_name
        options.global_ranks_in_group = list(global_ranks)
        backend_type, device = dist.ProcessGroup.BackendType.NCCL, torch.device("cuda")
        with _recoverable_nccl_errors():
            backend = dist.ProcessGroupNCCL(store, rank, size, options)
    elif name == "gloo":
        backend_type, device = dist.ProcessGroup.BackendType.GLOO, torch.device("cpu")
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = _gloo_devices()
        backend = dist.ProcessGroupGloo(store, rank, size, options)
    else:
        raise ValueError(f"no channel backend {name!r}: rrfp channels use gloo (CPU) or "
                         "nccl (CUDA)")
    group._set_default_backend(backend_type)
    group._register_backend(device, backend_type, backend)
    if group_name:
        group._set_group_name(group_name)
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
    headers: "Channel | None" = None
    """Variable shapes on NCCL: a gloo channel of the same two ranks for the shape headers,
    so that a header is read on the host without a device-to-host copy per message."""

    def __str__(self) -> str:
        return (f"channel {self.edge.src}->{self.edge.dst} (global rank {self.src_rank} -> "
                f"{self.dst_rank})")

    def send(self, tensor: torch.Tensor) -> dist.Work:
        return self.group.send([tensor], 1, _MESSAGE_TAG)

    def recv(self, tensor: torch.Tensor) -> dist.Work:
        return self.group.recv([tensor], 0, _MESSAGE_TAG)

    def abort(self) -> None:
        """After a failure: fail every pending operation on the channel; not used again.
        NCCL: at this end only (``ncclCommAbort``); gloo: at both ends."""
        if self.headers is not None:
            self.headers.abort()
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

    def shutdown(self) -> None:
        """A healthy end: every operation on the channel has completed. NCCL: the
        communicator is shut down (not aborted); gloo: the connection goes with the group,
        untouched here (closing it would fail a peer still reading its last message)."""
        if self.backend_name == "nccl":
            self.group.shutdown()
        if self.headers is not None:
            self.headers.shutdown()


class ChannelMap(dict):
    """This rank's channels by edge, and the store prefix of their generation."""

    def __init__(self, channels: dict[Edge, Channel], store: dist.Store | None = None,
                 global_ranks: Sequence[int] = ()):
        super().__init__(channels)
        self.store = store
        """The generation's store prefix (the failure board lives under it)."""
        self.global_ranks = tuple(global_ranks)
        """Global ranks of the pipeline, by pipeline rank."""


class FailureBoard:
    """The pipeline's failure key in the store: a failed rank says so, its peers check.

    The channels cannot tell the peers on NCCL (an abort is local) and a gloo peer learns
    only of a closed connection, not who failed or why; the store always works. Keys live
    under the channels' generation prefix, so a new schedule starts with a clean board.
    """

    KEY = "failed"

    def __init__(self, store: dist.Store | None, me: int, interval: float = FAILURE_POLL_S,
                 clock: Callable[[], float] = time.perf_counter):
        self._store = store
        self._me = me
        self._interval = interval
        self._clock = clock
        self._next = 0.0
        self._seen: tuple[int, str] | None = None

    def publish(self, message: str) -> None:
        """Say this rank failed (the first failure of the pipeline is the one kept)."""
        if self._store is None or self.failure() is not None:
            return
        try:
            # compare_set keeps the first writer's value when several ranks fail at once.
            self._store.compare_set(self.KEY, "", f"{self._me}\n{message}")
        except Exception as e:  # the store itself gone: the peers will stall instead
            logger.warning("global rank %d could not publish its failure: %s", self._me, e)

    def failure(self) -> tuple[int, str] | None:
        """(global rank, message) of the pipeline's first failure, if any (one store read)."""
        if self._seen is None and self._store is not None:
            try:
                if self._store.check([self.KEY]):
                    rank, _, message = self._store.get(self.KEY).decode().partition("\n")
                    self._seen = (int(rank), message)
            except Exception as e:
                logger.warning("global rank %d could not read the failure board: %s",
                               self._me, e)
        return self._seen

    def check(self, force: bool = False) -> None:
        """Raise ``PeerFailedError`` if another rank failed; reads the store at most every
        ``interval`` seconds unless ``force``."""
        now = self._clock()
        if not force and now < self._next:
            return
        self._next = now + self._interval
        failure = self.failure()
        if failure is not None and failure[0] != self._me:
            rank, message = failure
            raise PeerFailedError(f"global rank {rank} of the pipeline failed: {message}", rank)


def concurrently(calls: dict[str, Callable[[], None]], timeout: float) -> list[threading.Thread]:
    """Run each call on its own thread; wait for all of them together for at most
    ``timeout`` seconds; return the threads still running (errors are logged)."""
    def run(name: str, call: Callable[[], None]) -> None:
        try:
            call()
        except Exception as e:
            logger.warning("%s: %s", name, e)

    threads = [threading.Thread(target=run, args=(name, call), name=name, daemon=True)
               for name, call in calls.items()]
    for thread in threads:
        thread.start()
    deadline = time.perf_counter() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.perf_counter()))
    return [t for t in threads if t.is_alive()]


_generations: dict[tuple[int, ...], int] = {}


def create_channels(
    hint: Hint,
    pp_group: dist.ProcessGroup | None,
    device: torch.device,
    *,
    group_factory: GroupFactory = make_channel_group,
    connect: bool = True,
    timeout: datetime.timedelta = CHANNEL_TIMEOUT,
    backend: str | None = None,
    header_channels: bool = False,
) -> ChannelMap:
    """Create and connect this rank's channels: one per remote edge of the hint touching it.

    Every rank of the pipeline group calls it when it builds its schedule (each builds as
    many schedules over the group as the others); only the two ranks of a channel
    communicate to create it. ``connect=False`` skips the exchange that connects each
    channel (only to show what happens without it). ``backend``: how the channels are
    driven (``"gloo"`` or ``"nccl"``); by default NCCL for CUDA devices.
    ``header_channels`` (variable shapes): NCCL channels get a gloo channel each for the
    shape headers (``Channel.headers``); with fixed shapes none is created.
    """
    pp_ranks = tuple(dist.get_process_group_ranks(pp_group or dist.group.WORLD))
    generation = _generations.get(pp_ranks, 0)
    _generations[pp_ranks] = generation + 1
    backend_name = backend or ("nccl" if device.type == "cuda" else "gloo")
    prefix = f"rrfp/{'-'.join(map(str, pp_ranks))}/{generation}/"
    base = dist.PrefixStore(prefix, dist.distributed_c10d._get_default_store())
    me = dist.get_rank()
    channels: dict[Edge, Channel] = {}
    for edge in connection_order(hint):
        src = pp_ranks[hint.stage_to_rank[edge.src]]
        dst = pp_ranks[hint.stage_to_rank[edge.dst]]
        if me not in (src, dst):
            continue
        store = dist.PrefixStore(f"{edge.src}-{edge.dst}/", base)
        rank = 0 if me == src else 1
        group = group_factory(backend_name, store, rank, timeout,
                              group_name=f"{prefix}{edge.src}-{edge.dst}",
                              global_ranks=(src, dst))
        headers = None
        if header_channels and backend_name == "nccl":
            # A real gloo group: its construction connects it (both ranks, in this order).
            headers = Channel(edge, src, dst, rank, "gloo", make_channel_group(
                "gloo", dist.PrefixStore("headers/", store), rank, timeout,
                group_name=f"{prefix}{edge.src}-{edge.dst}/headers", global_ranks=(src, dst)))
        channel = Channel(edge, src, dst, rank, backend_name, group, headers)
        if connect:
            _connect(channel, device, timeout)
        channels[edge] = channel
    return ChannelMap(channels, base, pp_ranks)


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
    issued; NCCL: completion is polled (a CUDA event query). A send that completed with an
    error raises, naming its channel (``describe``), when that is seen."""

    def __init__(self, polled: bool, describe: Callable[[Edge, int], str] = (
            lambda edge, microbatch: f"the send of microbatch {microbatch} on {edge}")) -> None:
        self._polled = polled
        self._describe = describe
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
                # Not the data: this frame outlives the send while the thread waits.
                edge, microbatch, works = self._pending[0][:3]
            try:
                for work in works:
                    work.wait()
            except Exception as e:  # raised by finish()
                if self._error is None:
                    self._error = RuntimeError(f"{self._describe(edge, microbatch)} failed: {e}")
                    self._error.__cause__ = e
            with self._cond:
                self._pending.popleft()
                self._cond.notify_all()

    def poll(self) -> None:
        """NCCL: release the tensors of completed sends; raise if one completed with an
        error (``wait()`` on a completed work returns at once, or raises its error)."""
        if self._polled:
            with self._cond:
                while self._pending and all(w.is_completed() for w in self._pending[0][2]):
                    edge, microbatch, works, _ = self._pending.popleft()
                    self._raise_failed(edge, microbatch, works)

    def _raise_failed(self, edge: Edge, microbatch: int, works: list[dist.Work]) -> None:
        try:
            for work in works:
                work.wait()
        except Exception as e:
            raise RuntimeError(f"{self._describe(edge, microbatch)} failed: {e}") from e

    def finish(self, deadline: float, check: Callable[[], None] = lambda: None) -> None:
        """At step end, every send issued so far has completed: gloo, within ``deadline``
        (``TimeoutError`` otherwise); NCCL, on the stream (``wait()`` orders the current
        stream after the sends, without blocking the CPU as a timeout would; they stay
        watched until they complete, see ``drain``). ``check`` is called while waiting
        (it raises if a peer failed)."""
        if self._polled:
            self.poll()
            with self._cond:
                pending = list(self._pending)
            for _, _, works, _ in pending:
                for work in works:
                    work.wait()
            return
        self._wait_until_empty(deadline, check)
        if self._error is not None:
            raise self._error

    def drain(self, deadline: float, check: Callable[[], None] = lambda: None) -> None:
        """Before a healthy close: wait (on the CPU) until every send has completed,
        within ``deadline`` (``TimeoutError`` naming the first one that did not)."""
        if not self._polled:
            self._wait_until_empty(deadline, check)
            if self._error is not None:
                raise self._error
            return
        while True:
            self.poll()
            with self._cond:
                if not self._pending:
                    return
                edge, microbatch, _, _ = self._pending[0]
            check()
            if time.perf_counter() >= deadline:
                raise TimeoutError(f"{self._describe(edge, microbatch)} did not complete")
            time.sleep(Wakeup.POLL_INTERVAL_S * 50)

    def _wait_until_empty(self, deadline: float, check: Callable[[], None]) -> None:
        with self._cond:
            while self._pending:
                left = deadline - time.perf_counter()
                if left <= 0:
                    edge, microbatch, _, _ = self._pending[0]
                    raise TimeoutError(f"{self._describe(edge, microbatch)} did not complete")
                if not self._cond.wait(timeout=min(left, FAILURE_POLL_S)):
                    self._cond.release()
                    try:
                        check()
                    finally:
                        self._cond.acquire()

    @property
    def pending(self) -> int:
        with self._cond:
            return len(self._pending)

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
                 send_delay: SendDelay | None = None,
                 receive_streams: "ReceiveStreams | None" = None):
        self.channels = channels
        polled = any(c.backend_name == "nccl" for c in channels.values())
        self._arrivals = _Polling(wakeup) if polled else _WaiterThreads(wakeup)
        self._send_delay = send_delay
        self._sends = _SendCompletion(polled, self._describe_send)
        self._messages_sent = 0
        self._bytes_sent = 0
        self.operations = 0
        """Receives posted and messages sent so far (never reset): a step that failed
        before it issued any has left its channels as its peers expect them."""
        self._delayed = ({e: _DelayedSender(c, self._sends) for e, c in channels.items()
                          if c.rank == 0} if send_delay is not None else {})
        headed = [c for c in channels.values() if c.headers is not None]
        self.headers_on_host = bool(headed)
        """Whether shape headers travel on the host (gloo side channels)."""
        self._header_arrivals = _WaiterThreads(wakeup) if headed else None
        self._header_sends = _SendCompletion(False, self._describe_send) if headed else None
        self.receive_streams = receive_streams or ReceiveStreams(None)
        self.failures = FailureBoard(getattr(channels, "store", None), dist.get_rank()
                                     if dist.is_initialized() else 0)
        self._closed = False

    def _describe_send(self, edge: Edge, microbatch: int) -> str:
        return f"the send of microbatch {microbatch} on {self.channels[edge]}"

    def post_receive(self, edge: Edge, microbatch: int, buffers: Sequence[torch.Tensor], *,
                     header: bool = False) -> None:
        """Post the receive of ``microbatch`` on ``edge`` into ``buffers`` (``header``: of
        the shape header sent ahead of it), under the receive stream (see
        ``ReceiveStreams``).

        Call in the producer's send order: messages on a channel match in posting order.
        """
        channel = self.channels[edge]
        self.operations += 1
        if header and channel.headers is not None:
            works = [channel.headers.recv(b) for b in buffers]
            self._header_arrivals.watch(edge, microbatch, works, header)
            return
        with self.receive_streams.posting():
            works = [channel.recv(b) for b in buffers]
        self._arrivals.watch(edge, microbatch, works, header)

    def header_device(self, device: torch.device) -> torch.device:
        """Where the shape headers of ``device``'s messages live: the host when they travel
        on gloo side channels (no device-to-host copy per message), else ``device``."""
        return torch.device("cpu") if self.headers_on_host else device

    def receive_buffer(self, shape: torch.Size, like: torch.Tensor) -> torch.Tensor:
        """A fresh buffer of ``shape`` (``like``'s dtype and device) to receive into."""
        return self.receive_streams.empty(shape, like.dtype, like.device)

    def send(self, edge: Edge, microbatch: int, tensors: list[torch.Tensor], *,
             header: bool = False) -> None:
        """Send ``tensors`` (``header``: the shape header of the message to follow)."""
        self.operations += 1
        self._messages_sent += len(tensors)
        self._bytes_sent += sum(t.nbytes for t in tensors)
        headers = self.channels[edge].headers
        if header and headers is not None:
            self._header_sends.watch(edge, microbatch, [headers.send(t) for t in tensors],
                                     tensors)
            return
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
        """Messages that arrived since the last call; never blocks. Raises if a send or
        receive completed with an error: ``PeerFailedError`` if a peer's published failure
        explains it (on gloo a failed peer's closed connections fail them)."""
        try:
            self._sends.poll()
            arrived = self._arrivals.collect()
            if self._header_arrivals is not None:
                arrived += self._header_arrivals.collect()
            return arrived
        except RuntimeError as e:
            try:
                self.failures.check(force=True)
            except PeerFailedError as peer:
                raise peer from e
            raise

    def check_peers(self, force: bool = False) -> None:
        """Raise ``PeerFailedError`` if another rank of the pipeline published a failure
        (reads the store at most every ``FAILURE_POLL_S`` unless ``force``)."""
        self.failures.check(force)

    def publish_failure(self, message: str) -> None:
        self.failures.publish(message)

    def gather_over_pipeline(self, key: str, value: str, timeout: float) -> dict[int, str]:
        """Every rank of the pipeline says ``value`` under ``key``; returns what each said,
        by global rank. Goes through the generation's store (backend-agnostic, and apart
        from the channels, whose first use would be a stage's data); waits at most
        ``timeout`` seconds for the others, then raises ``PipelineStallError`` naming them.
        Each schedule may use a key once."""
        store = getattr(self.channels, "store", None)
        ranks = getattr(self.channels, "global_ranks", ())
        me = dist.get_rank()
        if store is None or len(ranks) < 2:
            return {me: value}
        store.set(f"{key}/{me}", value)
        keys = [f"{key}/{rank}" for rank in ranks]
        try:
            store.wait(keys, datetime.timedelta(seconds=timeout))
        except RuntimeError as e:
            missing = [rank for rank, k in zip(ranks, keys) if not store.check([k])]
            raise PipelineStallError(
                f"global ranks {missing} of the pipeline did not say {key!r} within "
                f"stall_timeout ({timeout:g} s): {e}") from e
        return {rank: said.decode() for rank, said in zip(ranks, store.multi_get(keys))}

    def finish_sends(self, timeout: float) -> None:
        """Complete every send of the step; TimeoutError if a gloo send does not."""
        deadline = time.perf_counter() + timeout
        for sender in self._delayed.values():
            sender.drain(deadline)
        self._sends.finish(deadline, self.check_peers)
        if self._header_sends is not None:
            self._header_sends.finish(deadline, self.check_peers)

    def close(self, timeout: float = 10.0, *, failed: bool = False,
              send_timeout: float | None = None) -> list[threading.Thread]:
        """Close the channels and stop the helper threads; return the threads still alive
        after ``timeout`` seconds.

        Healthy (``failed=False``): first every send still in flight completes (within
        ``send_timeout``, default ``timeout``; NCCL sends may still be waiting for the
        peer's receive when a step returns), then the channels are shut down. After a
        failure, or if those sends do not complete: the channels are aborted, all at once
        (pending receives fail; on gloo at the peers too). Either way the channels' calls
        run concurrently, waited for together for at most ``timeout`` seconds. Raises the
        error of a send that did not complete or failed (after aborting). Once no thread
        is left, the transport lets its channels go (their groups are destroyed then)."""
        if self._closed:
            return []
        self._closed = True
        error: BaseException | None = None
        if not failed:
            try:
                deadline = time.perf_counter() + (timeout if send_timeout is None
                                                  else send_timeout)
                for sender in self._delayed.values():
                    sender.drain(deadline)
                self._sends.drain(deadline, self.check_peers)
                if self._header_sends is not None:
                    self._header_sends.drain(deadline, self.check_peers)
            except Exception as e:  # raised once the channels are aborted
                error, failed = e, True
        how = "abort" if failed else "shutdown"
        alive = concurrently({f"rrfp-{how}-{e.src}-{e.dst}": getattr(c, how)
                              for e, c in self.channels.items()}, timeout)
        for sender in self._delayed.values():
            sender.close()
        self._sends.close()
        alive += self._arrivals.close(timeout)
        threads = [s.thread for s in self._delayed.values()] + [self._sends.thread]
        if self._header_sends is not None:
            self._header_sends.close()
            alive += self._header_arrivals.close(timeout)
            threads.append(self._header_sends.thread)
        for thread in threads:
            if thread is not None:
                thread.join(timeout)
        alive += [t for t in threads if t is not None and t.is_alive()]
        if not alive:
            # The channels' groups go now, on this thread, not whenever the interpreter
            # frees them at exit, while torch destroys its own groups and gloo's I/O
            # thread still serves their connections. Not while a thread may still be
            # inside one of their calls.
            self.channels.clear()
            self._delayed.clear()
        if error is not None:
            raise RuntimeError(f"close(): {error}; the channels were aborted") from error
        return alive


class ReceiveStreams:
    """Which CUDA stream receives are posted under, and where their buffers come from.

    NCCL makes its stream wait for the caller's *current* stream when a receive is posted
    (``pointToPoint``'s ``syncStream``). Posted while the compute stream is current, a
    receive would wait for every action queued on it — about one action at launch depth
    2 — and its sender's send with it: arrivals would come that much late. So receives are
    posted under a side stream on which nothing is queued. That is safe because a ring
    slot is only re-posted once the last action that reads it has *completed* (an event
    query), so no queued compute can still read it; NCCL records the buffer on its own
    stream. Fresh buffers (variable shapes) are allocated on the side stream — a block
    the compute stream freed while kernels queued on it may still read it is reused only
    on the compute stream — and recorded on the compute stream, which reads them once the
    receive completes (``wait()`` orders it after the receive), so they are not handed out
    again before that reading is done.

    torch draws streams from a small round-robin pool per priority; a high-priority
    stream may still be shared with another user of that pool (FSDP2's all-gather and
    reduce-scatter streams are high priority): a receive would then also wait for their
    queued work. Not seen on hardware (none was available); ``benchmarks/gpu_check.py``
    measures arrival latency with compute queued.

    ``cuda``: the ``torch.cuda`` API (a recording fake in the tests); ``None``: CPU.
    """

    def __init__(self, device: torch.device | None, cuda=None,
                 empty: Callable[..., torch.Tensor] = torch.empty):
        self._cuda = None
        self._empty = empty
        self.side = None
        if device is not None and device.type == "cuda":
            self._cuda = cuda if cuda is not None else torch.cuda
            self._device = device
            # High priority: from the other pool than the low-priority streams NCCL gives
            # its communicators, so the side stream is never a channel's own NCCL stream
            # (a receive posted under another channel's stream would wait for its kernel).
            self.side = self._cuda.Stream(device, priority=-1)

    def posting(self):
        """Context under which a receive is posted."""
        if self._cuda is None:
            return contextlib.nullcontext()
        return self._cuda.stream(self.side)

    def empty(self, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if self._cuda is None:
            return self._empty(shape, dtype=dtype, device=device)
        compute = self._cuda.current_stream(self._device)
        with self._cuda.stream(self.side):
            buffer = self._empty(shape, dtype=dtype, device=device)
        buffer.record_stream(compute)
        return buffer
