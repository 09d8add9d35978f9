"""Emulated link latency for CPU studies (``rrfp.testing.study.Study(send_delay=...)``):
each message of a channel is held for a given time before its send is issued, in FIFO
order, by a thread per channel."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist

from rrfp.comm.channels import Channel
from rrfp.core.actions import Edge

SendDelay = Callable[[Edge, int], float]
"""Emulated link latency: seconds to hold the message for ``(edge, microbatch)``."""


class SendWatcher(Protocol):
    """What completes the sends once they are issued (``rrfp.comm.transport``)."""

    def watch(self, edge: Edge, microbatch: int, works: list[dist.Work],
              tensors: list[torch.Tensor]) -> None: ...


class DelayedSender:
    """Holds each message of one channel for an emulated latency, keeping FIFO order."""

    def __init__(self, channel: Channel, completion: SendWatcher) -> None:
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
            with self._cond:  # issued under the lock: once close() returns, none is
                if self._closed:
                    return
                try:
                    works = [self._channel.send(t) for t in tensors]
                    self._completion.watch(self._channel.edge, microbatch, works, tensors)
                except BaseException as e:  # surfaced by drain()
                    self._error = e
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
        """Issue no more sends (those still held are dropped); the thread ends."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
