"""Failure is told through the store, not the channels.

A rank whose step fails publishes it under the pipeline's store prefix (its channels'
generation) before it closes its channels, and every rank of the pipeline checks that key
while it waits (at most every ``FAILURE_POLL_S``), raising ``PeerFailedError`` naming the
failed rank. On gloo the closed connections would fail the peers too, but on NCCL an abort
is local: a peer would wait out its ``stall_timeout``. The same board carries values every
rank says once (a refusal to run, exchanged before any stage's data moves).
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable, Sequence

import torch.distributed as dist

from rrfp.errors import PeerFailedError, PipelineStallError

logger = logging.getLogger(__name__)

FAILURE_POLL_S = 0.1
"""How often a waiting rank reads the pipeline's failure key (one store round trip)."""


class FailureBoard:
    """What the ranks of one pipeline tell each other through the store, apart from the
    channels: the first failure (a failed rank says so, its peers check), and values every
    rank says once (``gather``).

    The channels cannot tell the peers on NCCL (an abort is local) and a gloo peer learns
    only of a closed connection, not who failed or why; the store always works. Keys live
    under the channels' generation prefix, so a new schedule starts with a clean board.
    ``ranks``: the pipeline's global ranks (``gather`` waits for each of them).
    """

    KEY = "failed"

    def __init__(self, store: dist.Store | None, me: int, ranks: Sequence[int] = (),
                 interval: float = FAILURE_POLL_S,
                 clock: Callable[[], float] = time.perf_counter):
        self._store = store
        self._me = me
        self._ranks = tuple(ranks)
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

    def gather(self, key: str, value: str, timeout: float) -> dict[int, str]:
        """Every rank of the pipeline says ``value`` under ``key``; returns what each said,
        by global rank. Backend-agnostic, and apart from the channels, whose first use
        would be a stage's data; waits at most ``timeout`` seconds for the others, then
        raises ``PipelineStallError`` naming them. Each schedule may use a key once."""
        store = self._store
        if store is None or len(self._ranks) < 2:
            return {self._me: value}
        store.set(f"{key}/{self._me}", value)
        keys = [f"{key}/{rank}" for rank in self._ranks]
        try:
            store.wait(keys, datetime.timedelta(seconds=timeout))
        except RuntimeError as e:
            missing = [rank for rank, k in zip(self._ranks, keys) if not store.check([k])]
            raise PipelineStallError(
                f"global ranks {missing} of the pipeline did not say {key!r} within "
                f"stall_timeout ({timeout:g} s): {e}") from e
        return {rank: said.decode() for rank, said in zip(self._ranks, store.multi_get(keys))}
