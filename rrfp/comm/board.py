"""Failure is told through the store, not the channels.

A rank whose step fails publishes it twice: under the pipeline's store prefix (its
channels' generation) and under the job's (``rrfp.failure.job``: every rank of every pipeline, its
data-parallel and tensor/expert-parallel replicas), before it closes its channels. Every
rank checks those keys while it waits (at most every ``FAILURE_POLL_S``), raising
``PeerFailedError`` naming the failed rank; a watch thread per schedule reads the job's key
even while its rank is blocked elsewhere (``rrfp.failure.job.JobWatch``). On gloo the closed
connections would fail the peers too, but on NCCL an abort is local: a peer would wait out
its ``stall_timeout``. The same board carries values every rank says once (a refusal to
run, the job's settings, a rank's state for a hang report, that it stopped sending before
its gloo channels close), exchanged before or apart from any stage's data.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch.distributed as dist

from rrfp.comm.channels import generation_store
from rrfp.core.errors import PeerFailedError, PipelineStallError

logger = logging.getLogger(__name__)

FAILURE_POLL_S = 0.1
"""How often a waiting rank reads the pipeline's failure key (one store round trip)."""
QUIET_WAIT_S = 2.0
"""How long a rank that abandons a step waits for the peers of its gloo channels to say
they stopped sending before it aborts the channels (``FailureBoard.stop_sending``); a
peer notices a failure within ``FAILURE_POLL_S`` while it waits."""


@dataclass(frozen=True)
class JobScope:
    """Where the ranks of the job meet in the default store."""

    prefix: str
    store: dist.Store | None
    """The default store under ``prefix`` (None: no process group, a job of one)."""
    ranks: tuple[int, ...]
    """Global ranks of the job."""

    @staticmethod
    def new() -> "JobScope":
        """The scope of the next schedule built in this process (a new generation)."""
        if not dist.is_initialized():
            return JobScope("", None, ())
        prefix, store = generation_store("job", ())
        return JobScope(prefix, store, tuple(range(dist.get_world_size())))

    @property
    def name(self) -> str:
        """The prefix as a file name part (``attempt-0-job-3``)."""
        return "-".join(part for part in self.prefix.split("/")[1:] if part)


class FailureBoard:
    """What the ranks of one pipeline, and of the job around it, tell each other through
    the store, apart from the channels: the first failure (a failed rank says so, its peers
    check), and values every rank says once (``gather``).

    The channels cannot tell the peers on NCCL (an abort is local) and a gloo peer learns
    only of a closed connection, not who failed or why; the store always works. Keys live
    under the channels' generation prefix (``store``, over the pipeline's ``ranks``) and
    the job's (``job_store``, over ``job_ranks``: ``rrfp.failure.job.job_store``), so a new
    schedule starts with a clean board. Without a ``job_store`` the board is the
    pipeline's alone.
    """

    KEY = "failed"
    STOPPED_SENDING = "stopped-sending"

    def __init__(self, store: dist.Store | None, me: int, ranks: Sequence[int] = (),
                 interval: float = FAILURE_POLL_S,
                 clock: Callable[[], float] = time.perf_counter, *,
                 job_store: dist.Store | None = None, job_ranks: Sequence[int] = ()):
        self._store = store
        self._me = me
        self._ranks = tuple(ranks)
        self._job_store = job_store
        self.job_ranks = tuple(job_ranks) if job_store is not None else self._ranks
        """Global ranks of the job (the pipeline's, without a job store)."""
        self._interval = interval
        self._clock = clock
        self._next = 0.0
        self._seen: tuple[int, str] | None = None

    @property
    def me(self) -> int:
        return self._me

    def publish(self, message: str) -> None:
        """Say this rank failed (the first failure of the pipeline, and of the job, is the
        one kept)."""
        if self.failure() is not None:
            return
        for store in (self._job_store, self._store):
            if store is None:
                continue
            try:
                # compare_set keeps the first writer's value when several ranks fail at once.
                store.compare_set(self.KEY, "", f"{self._me}\n{message}")
            except Exception as e:  # the store itself gone: the peers will stall instead
                logger.warning("global rank %d could not publish its failure: %s", self._me, e)

    def failure(self, job_only: bool = False) -> tuple[int, str] | None:
        """(global rank, message) of the first failure of the job (or, where the job's
        key is unset, of the pipeline), if any: a store read or two until one is seen.
        ``job_only``: read the job's key alone (one store read)."""
        if self._seen is None:
            stores = (self._job_store,) if job_only else (self._job_store, self._store)
            for store in stores:
                if store is None:
                    continue
                try:
                    if store.check([self.KEY]):
                        rank, _, message = store.get(self.KEY).decode().partition("\n")
                        self._seen = (int(rank), message)
                        break
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
            where = "job" if self._job_store is not None and rank not in self._ranks \
                else "pipeline"
            raise PeerFailedError(f"global rank {rank} of the {where} failed: {message}", rank)

    def tell(self, key: str, value: str, *, job: bool = False) -> None:
        """Say ``value`` under ``key`` for this rank (``job``: to the job), without waiting
        for anyone (``collect`` reads what the others said)."""
        store = self._job_store if job else self._store
        if store is not None:
            store.set(f"{key}/{self._me}", value)

    def collect(self, key: str, timeout: float, *, job: bool = False,
                ranks: Sequence[int] | None = None) -> dict[int, str]:
        """What each rank of the pipeline (``job``: of the job; ``ranks``: these global
        ranks) said under ``key`` (``tell``) within ``timeout`` seconds, by global rank;
        ranks that said nothing by then are left out."""
        store = self._job_store if job else self._store
        if ranks is None:
            ranks = self.job_ranks if job else self._ranks
        if store is None:
            return {}
        said: dict[int, str] = {}
        deadline = time.perf_counter() + timeout
        while True:
            for rank in ranks:
                if rank not in said and store.check([f"{key}/{rank}"]):
                    said[rank] = store.get(f"{key}/{rank}").decode()
            if len(said) == len(ranks) or time.perf_counter() >= deadline:
                return said
            time.sleep(min(self._interval, max(0.0, deadline - time.perf_counter())))

    def stop_sending(self, peers: Sequence[int], timeout: float) -> None:
        """Say that this rank issues no more sends on the pipeline's channels, then wait at
        most ``timeout`` seconds until each of ``peers`` (global ranks) has said so too;
        log those that had not by then (outside a step, hung or dead)."""
        self.tell(self.STOPPED_SENDING, "")
        said = self.collect(self.STOPPED_SENDING, timeout, ranks=peers)
        silent = [rank for rank in peers if rank not in said]
        if silent:
            logger.warning("global rank %d closes its channels although global ranks %s did "
                           "not say within %g s that they stopped sending", self._me, silent,
                           timeout)

    def gather(self, key: str, value: str, timeout: float, *, job: bool = False) -> dict[int, str]:
        """Every rank of the pipeline (``job``: of the job) says ``value`` under ``key``;
        returns what each said, by global rank. Backend-agnostic, and apart from the
        channels, whose first use would be a stage's data; waits at most ``timeout``
        seconds for the others, then raises ``PipelineStallError`` naming them. Each
        schedule may use a key once."""
        store = self._job_store if job else self._store
        ranks = self.job_ranks if job else self._ranks
        where = "job" if job else "pipeline"
        if store is None or len(ranks) < 2:
            return {self._me: value}
        store.set(f"{key}/{self._me}", value)
        keys = [f"{key}/{rank}" for rank in ranks]
        try:
            store.wait(keys, datetime.timedelta(seconds=timeout))
        except RuntimeError as e:
            missing = [rank for rank, k in zip(ranks, keys) if not store.check([k])]
            raise PipelineStallError(
                f"global ranks {missing} of the {where} did not say {key!r} within "
                f"stall_timeout ({timeout:g} s): {e}") from e
        return {rank: said.decode() for rank, said in zip(ranks, store.multi_get(keys))}
