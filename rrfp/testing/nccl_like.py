"""Channel groups with NCCL's failure and completion semantics, for CPU tests.

There is no GPU or NCCL here. These 2-rank groups move tensors through the channel's store
and behave as torch 2.13's ``ProcessGroupNCCL`` does where rrfp depends on it:

* **Completion is polled** (``is_completed()``, as a CUDA event query), and ``wait()``
  without a timeout does not block the CPU (on NCCL it only orders the current stream
  after the work): it returns at once, raising if the work already failed.
* **A send completes only once the peer has posted the matching receive** (its data then
  moves); until then it is in flight, and an ``abort()`` or ``shutdown()`` drops it: the
  peer never gets the message.
* **An abort fails this end's pending works only; it does not reach the peer**, whose
  pending receives on the channel stay pending (``ncclCommAbort`` is local).
* ``blocking_abort``: an abort blocks while another such group of this process has a
  pending receive that is not aborted (an ``ncclCommAbort`` whose device-wide clean-up waits for
  another communicator's spinning kernel, pytorch#119797).
* ``fail_send_at``: the n-th message sent (0-based, after the connection token) completes
  with an error instead of moving (a planted send error).

A progress thread per group moves the data (NCCL's kernels progress without the host).
"""

from __future__ import annotations

import datetime
import threading
import time
from collections import deque
from collections.abc import Callable

import torch
import torch.distributed as dist

from rrfp.comm.channels import ChannelMap, create_channels

POLL_S = 1e-3

_store_lock = threading.Lock()
"""The groups' threads share one store client: one call at a time."""
_live: list["StoreP2PGroup"] = []
_live_cond = threading.Condition()


class FakeWork:
    def __init__(self, what: str) -> None:
        self.what = what
        self._done = threading.Event()
        self._error: str | None = None

    def _finish(self, error: str | None = None) -> None:
        self._error = error
        self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def exception(self):
        return RuntimeError(self._error) if self._error else None

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if timeout is not None and not self._done.wait(timeout.total_seconds()):
            raise RuntimeError(f"{self.what}: timed out after {timeout}")
        if self._done.is_set() and self._error is not None:
            raise RuntimeError(f"{self.what}: {self._error}")
        return True


class StoreP2PGroup:
    """One rrfp channel: rank 0 sends, rank 1 receives (see the module docstring)."""

    def __init__(self, store: dist.Store, rank: int, *, blocking_abort: bool = False,
                 fail_send_at: int | None = None) -> None:
        self._store, self._rank = store, rank
        self.blocking_abort = blocking_abort
        self._fail_send_at = fail_send_at
        self._sent = 0
        self._received = 0
        self._sends: deque[tuple[int, torch.Tensor, FakeWork]] = deque()
        self._recvs: deque[tuple[int, torch.Tensor, FakeWork]] = deque()
        self._cond = threading.Condition()
        self.aborted = False
        self.shutdowns = 0
        self.sent_dtypes: list[torch.dtype] = []
        self.aborts = 0
        self._thread = threading.Thread(target=self._progress, daemon=True,
                                        name="fake-nccl-progress")
        self._thread.start()
        with _live_cond:
            _live.append(self)

    # ------------------------------------------------------------------ the group API
    def send(self, tensors, peer: int, tag: int) -> FakeWork:
        (tensor,) = tensors
        self.sent_dtypes.append(tensor.dtype)
        work = FakeWork(f"fake NCCL send {self._sent}")
        with self._cond:
            n = self._sent
            self._sent += 1
            if self.aborted:
                work._finish("communicator aborted")
            elif self._fail_send_at is not None and n - 1 == self._fail_send_at:
                work._finish("planted send error")
            else:
                self._sends.append((n, tensor.detach().clone(), work))
            self._cond.notify_all()
        return work

    def recv(self, tensors, peer: int, tag: int) -> FakeWork:
        (tensor,) = tensors
        work = FakeWork(f"fake NCCL recv {self._received}")
        with self._cond:
            n = self._received
            self._received += 1
            if self.aborted:
                work._finish("communicator aborted")
            else:
                with _store_lock:
                    self._store.set(f"posted/{n}", b"1")
                self._recvs.append((n, tensor, work))
            self._cond.notify_all()
        return work

    def abort(self) -> None:
        self.aborts += 1
        self._drop("communicator aborted")
        if self.blocking_abort:
            with _live_cond:
                while any(g is not self and g.blocking_abort and g.pending_receives()
                          for g in _live):
                    _live_cond.wait(0.05)

    def shutdown(self) -> None:
        self.shutdowns += 1
        self._drop("communicator shut down")

    # ------------------------------------------------------------------ inside
    def pending_receives(self) -> int:
        with self._cond:
            return 0 if self.aborted else len(self._recvs)

    def _drop(self, why: str) -> None:
        with self._cond:
            self.aborted = True
            for _, _, work in list(self._sends) + list(self._recvs):
                work._finish(why)
            self._sends.clear()
            self._recvs.clear()
            self._cond.notify_all()
        with _live_cond:
            _live_cond.notify_all()

    def _check(self, key: str) -> bool:
        with _store_lock:
            return self._store.check([key])

    def _progress(self) -> None:
        try:
            self._move()
        except BaseException as e:  # fail loudly: every pending work gets the error
            self._drop(f"fake NCCL progress failed: {type(e).__name__}: {e}")
            raise

    def _move(self) -> None:
        while True:
            with self._cond:
                while not self.aborted and not self._sends and not self._recvs:
                    self._cond.wait()
                if self.aborted:
                    return
                send = self._sends[0] if self._sends else None
                recv = self._recvs[0] if self._recvs else None
            moved = False
            if send is not None and self._check(f"posted/{send[0]}"):
                n, tensor, work = send
                data = tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                with _store_lock:
                    self._store.set(f"data/{n}", data)
                with self._cond:
                    if self._sends and self._sends[0][2] is work:
                        self._sends.popleft()
                        work._finish()
                moved = True
            if recv is not None and self._check(f"data/{recv[0]}"):
                n, tensor, work = recv
                with _store_lock:
                    data = bytearray(self._store.get(f"data/{n}"))
                flat = torch.frombuffer(data, dtype=torch.uint8).view(tensor.dtype)
                with self._cond:
                    if self._recvs and self._recvs[0][2] is work:
                        with torch.no_grad():  # a stage's input buffer requires grad
                            tensor.copy_(flat.view(tensor.shape))
                        self._recvs.popleft()
                        work._finish()
                with _live_cond:
                    _live_cond.notify_all()
                moved = True
            if not moved:
                time.sleep(POLL_S)


def factory(blocking_abort: bool = False, fail_send_at: dict | None = None):
    """A ``group_factory`` for ``rrfp.comm.channels.create_channels`` making these groups;
    ``fail_send_at``: ``{(global src, global dst): n}`` plants a send error on a channel."""
    made: list[StoreP2PGroup] = []

    def make(name, store, rank, timeout, **naming):
        ranks = tuple(naming.get("global_ranks", ()))
        group = StoreP2PGroup(store, rank, blocking_abort=blocking_abort,
                              fail_send_at=(fail_send_at or {}).get(ranks))
        made.append(group)
        return group

    make.made = made
    return make


def channels_for(kind: str, **fake) -> Callable[..., ChannelMap] | None:
    """How a study's schedule builds its channels (``Study(channels=...)``): ``"gloo"``,
    rrfp's own (None); ``"nccl-like"``, these groups (polled, local abort, sends that
    complete only once the peer receives), whose factory is the maker's ``groups`` (its
    ``made`` lists them)."""
    if kind == "gloo":
        return None
    groups = factory(**fake)

    def nccl_like_channels(hint, group, device, backend, **options):
        return create_channels(hint, group, device, "nccl", group_factory=groups, **options)

    nccl_like_channels.groups = groups
    return nccl_like_channels
