"""A process group whose collectives behave as NCCL's where ``rrfp.failure.job`` depends on them,
for CPU tests (there is no GPU or NCCL here; ``rrfp.testing.nccl_like`` fakes the channels).

As torch's ``ProcessGroupNCCL`` (``torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp``):

* **A collective completes only once every rank of the group has called it**: its kernel
  spins on the device until the peers join. ``wait()`` returns then: on CUDA the stream
  waits and the host blocks at its next synchronisation; on the emulated device
  (``rrfp.devices.device.EmulatedDevice``) the device thread is the stream, and it is the one that
  blocks, not the step loop.
* **``abort()`` is local** (``ncclCommAbort``): this rank's pending collectives end with an
  error; the peers' stay pending, to be aborted by their own ranks.
* Its timeout is the group's (the watchdog's): nothing ends a wait sooner.

Registered as the backend ``"fake_nccl"`` (``register``); data moves through the group's
store, each rank's part of the n-th collective under ``c<n>/<rank>``.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

BACKEND = "fake_nccl"
POLL_S = 2e-3


class CollectiveWork(dist._Work):
    """A collective in flight: ``wait`` blocks until every rank contributed or the group
    was aborted here (then it raises)."""

    def __init__(self, complete: Callable[[], None], what: str):
        super().__init__()
        self._complete, self.what = complete, what
        self._done = False
        self._future = torch.futures.Future()

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if not self._done:
            self._complete()
            self._done = True
            self._future.set_result(None)
        return True

    def is_completed(self) -> bool:
        return self._done

    def get_future(self) -> torch.futures.Future:
        return self._future


class StoreCollectiveGroup(dist.ProcessGroup):
    """all_reduce (sum), all_gather and broadcast over the store, with NCCL's waits and
    local abort (see the module docstring)."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta):
        super().__init__(rank, size)
        self._store, self._timeout = store, timeout
        self._calls = 0
        self._lock = threading.Lock()
        self._aborted = threading.Event()
        self.aborts = 0

    def getBackendName(self) -> str:
        return BACKEND

    def abort(self) -> None:
        self.aborts += 1
        self._aborted.set()

    def _contribute(self, tensor: torch.Tensor) -> tuple[int, Callable[[], list[torch.Tensor]]]:
        """Put this rank's part of the next collective; returns its number and a function
        that waits for every rank's part."""
        with self._lock:
            n = self._calls
            self._calls += 1
            if not self._aborted.is_set():
                data = tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                self._store.set(f"c{n}/{self.rank()}", data)

        def gather() -> list[torch.Tensor]:
            keys = [f"c{n}/{r}" for r in range(self.size())]
            deadline = time.monotonic() + self._timeout.total_seconds()
            while not self._store.check(keys):
                if self._aborted.is_set():
                    raise RuntimeError(f"fake NCCL collective {n}: communicator aborted")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"fake NCCL collective {n}: watchdog timeout "
                                       f"({self._timeout})")
                time.sleep(POLL_S)
            if self._aborted.is_set():
                raise RuntimeError(f"fake NCCL collective {n}: communicator aborted")
            return [torch.frombuffer(bytearray(self._store.get(k)), dtype=torch.uint8)
                    .view(tensor.dtype).view(tensor.shape).clone() for k in keys]

        return n, gather

    def allreduce(self, tensors, opts=None) -> CollectiveWork:
        (tensor,) = tensors
        n, gather = self._contribute(tensor)

        def complete() -> None:
            parts = gather()
            with torch.no_grad():
                tensor.copy_(torch.stack(parts).sum(0))

        return CollectiveWork(complete, f"all_reduce {n}")

    def allgather(self, output_lists, input_tensors, opts=None) -> CollectiveWork:
        (outputs,), (tensor,) = output_lists, input_tensors
        n, gather = self._contribute(tensor)

        def complete() -> None:
            for out, part in zip(outputs, gather()):
                out.copy_(part)

        return CollectiveWork(complete, f"all_gather {n}")

    def broadcast(self, tensors, opts=None) -> CollectiveWork:
        root = opts.rootRank if opts is not None else 0
        works = []
        for tensor in tensors:
            n, gather = self._contribute(tensor)

            def complete(tensor=tensor, gather=gather) -> None:
                part = gather()[root]
                with torch.no_grad():
                    tensor.copy_(part)

            works.append(complete)
        return CollectiveWork(lambda: [w() for w in works], "broadcast")


def register() -> None:
    """Make ``dist.new_group(..., backend="fake_nccl")`` build these groups (once a
    process)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(
            BACKEND, lambda store, rank, size, timeout: StoreCollectiveGroup(
                store, rank, size, timeout), devices=["cpu"])
