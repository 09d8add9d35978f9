"""The data plane: one rank's sends and receives over its channels (``rrfp.comm.channels``).

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
* **Receives are posted under a side stream** on CUDA (``rrfp.devices.platform.ReceiveStreams``):
  NCCL's stream waits for the caller's current stream at call time, so a receive posted
  while the compute stream is current would wait for all compute queued so far.
* **Failure** is told through the store (``rrfp.comm.board``): the transport checks the
  pipeline's board while it waits, and a receive or send that fails is explained by a
  peer's published failure where there is one.
* **Closing**: a healthy ``close`` first completes the sends still in flight (NCCL: the
  step may return before the peer has received its last messages), bounded by the send
  timeout, then shuts the channels down; after a failure they are aborted, concurrently,
  on gloo once the peers have said they stopped sending (or ``QUIET_WAIT_S`` passed).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from rrfp.comm.board import FAILURE_POLL_S, FailureBoard, QUIET_WAIT_S
from rrfp.comm.channels import ChannelMap
from rrfp.comm.threads import concurrently
from rrfp.comm.ledger import Ledger
from rrfp.comm.link_latency import DelayedSender, SendDelay
from rrfp.core.actions import Edge
from rrfp.core.errors import PeerFailedError
from rrfp.core.wakeup import Wakeup
from rrfp.devices.platform import ReceiveStreams

class Received(NamedTuple):
    """A receive that completed."""

    edge: Edge
    microbatch: int
    seen: float
    """``time.perf_counter()`` when it was seen complete."""
    header: bool = False
    """The shape header sent ahead of a message (variable shapes), not the message."""


class _WaiterThreads:
    """Arrival detection by waiting: a thread per channel calls ``wait()`` in order."""

    def __init__(self, wakeup: Wakeup, describe: Callable[[Edge], str] = str) -> None:
        self._wakeup = wakeup
        self._describe = describe
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
        arrived: list[Received] = []
        queued = self._arrived
        while not queued.empty():  # the step loop is the only consumer
            arrival, error = queued.get_nowait()
            if error is not None:
                raise RuntimeError(f"receive of microbatch {arrival.microbatch} on "
                                   f"{self._describe(arrival.edge)} failed") from error
            arrived.append(arrival)
        return arrived

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

class Transport:
    """Sends and receives of one rank's stages over their channels."""

    def __init__(self, channels: ChannelMap, wakeup: Wakeup, failures: FailureBoard, *,
                 send_delay: SendDelay | None = None,
                 receive_streams: "ReceiveStreams | None" = None):
        self.channels = channels
        polled = any(c.backend_name == "nccl" for c in channels.values())
        self._arrivals = _Polling(wakeup) if polled else _WaiterThreads(
            wakeup, lambda edge: str(channels[edge]))
        self._send_delay = send_delay
        self._sends = _SendCompletion(polled, self._describe_send)
        self._messages_sent = 0
        self._bytes_sent = 0
        self.operations = 0
        """Receives posted and messages sent so far (never reset): a step that failed
        before it issued any has left its channels as its peers expect them."""
        self._delayed = ({e: DelayedSender(c, self._sends) for e, c in channels.items()
                          if c.rank == 0} if send_delay is not None else {})
        headed = [c for c in channels.values() if c.headers is not None]
        self.headers_on_host = bool(headed)
        """Whether shape headers travel on the host (gloo side channels)."""
        self._header_arrivals = _WaiterThreads(wakeup) if headed else None
        self._header_sends = _SendCompletion(False, self._describe_send) if headed else None
        self.receive_streams = receive_streams or ReceiveStreams(None)
        self._failures = failures
        """Checked while waiting on sends; where the rank says it stopped sending."""
        self.ledger = Ledger()
        """This step's messages per channel (``Ledger.start_step`` clears it)."""
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
        if not header:
            self.ledger.posted(edge, microbatch)
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
        if not header:
            self.ledger.sent(edge, microbatch)
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
            for received in arrived:
                if not received.header:
                    self.ledger.arrived(received.edge, received.microbatch)
            return arrived
        except RuntimeError as e:
            try:
                self._failures.check(force=True)
            except PeerFailedError as peer:
                raise peer from e
            raise

    def finish_sends(self, timeout: float) -> None:
        """Complete every send of the step; TimeoutError if a gloo send does not."""
        deadline = time.perf_counter() + timeout
        for sender in self._delayed.values():
            sender.drain(deadline)
        self._sends.finish(deadline, self._failures.check)
        if self._header_sends is not None:
            self._header_sends.finish(deadline, self._failures.check)

    def _stop_sending(self) -> None:
        """Before gloo channels are aborted: this rank says it sends no more and waits (at
        most ``QUIET_WAIT_S``) until the peers of its channels say so too. gloo leaves a
        send issued into a connection its peer has just closed pending until the channel
        timeout, neither completed nor failed (a pair that closes fails only the sends
        that have not begun to write), so no end closes a channel the other still sends on."""
        if not any(c.backend_name == "gloo" or c.headers is not None
                   for c in self.channels.values()):
            return  # NCCL's abort is local
        me = self._failures.me
        peers = {r for c in self.channels.values() for r in (c.src_rank, c.dst_rank)} - {me}
        self._failures.stop_sending(sorted(peers), QUIET_WAIT_S)

    def close(self, timeout: float = 10.0, *, failed: bool = False,
              send_timeout: float | None = None) -> list[threading.Thread]:
        """Close the channels and stop the helper threads; return the threads still alive
        after ``timeout`` seconds.

        Healthy (``failed=False``): first every send still in flight completes (within
        ``send_timeout``, default ``timeout``; NCCL sends may still be waiting for the
        peer's receive when a step returns), then the channels are shut down. After a
        failure, or if those sends do not complete: no more sends are issued, and the
        channels are aborted, all at once (pending receives fail; on gloo at the peers
        too, once they have said they stopped sending: ``_stop_sending``). Either way the
        channels' calls run concurrently, waited for together for at most ``timeout``
        seconds. Raises the error of a send that did not complete or failed (after
        aborting). Once no thread is left, the transport lets its channels go (their
        groups are destroyed then)."""
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
                self._sends.drain(deadline, self._failures.check)
                if self._header_sends is not None:
                    self._header_sends.drain(deadline, self._failures.check)
            except Exception as e:  # raised once the channels are aborted
                error, failed = e, True
        for sender in self._delayed.values():
            sender.close()
        if failed:
            self._stop_sending()
        how = "abort" if failed else "shutdown"
        alive = concurrently({f"rrfp-{how}-{e.src}-{e.dst}": getattr(c, how)
                              for e, c in self.channels.items()}, timeout)
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
