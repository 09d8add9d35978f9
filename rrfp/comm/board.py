"""Failure is told through the store, not the channels, and no rank polls the store.

A rank whose step fails publishes it on the job's board (``rrfp.failure.job``: every rank of every
pipeline, its data-parallel and tensor/expert-parallel replicas) and on its pipeline's,
before it closes its channels; the first failure of the job is the one kept
(``compare_set``). The rank whose failure is kept then wakes every rank of the job at once:
one ``multi_set`` of each rank's wake key, on which each rank's watch thread
(``rrfp.failure.job.JobWatch``) blocks in a wait the store serves (a client of its own: a store
client runs one operation at a time). The watch hands the failure to the board
(``heard``), and a rank's step reads it there while it waits, raising
``PeerFailedError`` naming the failed rank, without a store operation. A board that no
watch feeds (a pipeline's board on its own) reads the store at most every ``interval``
instead. On gloo the closed connections would fail the peers too, but on NCCL an abort is
local: a peer would wait out its ``stall_timeout``.

The store itself gone (its host dead: the watch's connection fails) is told the same way
(``lost``): each step then raises ``StoreLostError`` naming the store, and nothing more is
asked of it.

The same board carries values every rank says once (a refusal to run, the job's settings,
a rank's state for a hang report, that it stopped sending before its gloo channels close):
a rank writes its key and appends its rank to the key's list of tellers; a collector waits
for the keys it needs (one wait the store serves) and reads them in one ``multi_get``, so
that neither costs a rank more operations when the job has more ranks.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch.distributed as dist

from rrfp.comm.store_keys import generation_store
from rrfp.core.errors import PeerFailedError, PipelineStallError, StoreLostError

logger = logging.getLogger(__name__)

FAILURE_POLL_S = 0.1
"""How often a waiting rank looks at its board (a store read only where no watch feeds
the board)."""
QUIET_WAIT_S = 2.0
"""How long a rank that abandons a step waits for the peers of its gloo channels to say
they stopped sending before it aborts the channels (``FailureBoard.stop_sending``)."""


def describe_store(store: dist.Store | None) -> str:
    """The store a board uses, as a user finds it: ``host:port`` of a ``TCPStore`` (under
    any prefixes), else its type."""
    while store is not None and getattr(store, "underlying_store", None) is not None:
        store = store.underlying_store
    if isinstance(store, dist.TCPStore):
        return f"{store.host}:{store.port}"
    return type(store).__name__


def is_timeout(error: BaseException) -> bool:
    """Whether a store's ``wait`` raised because its timeout passed (the store still
    there), not because its connection failed."""
    return not isinstance(error, dist.DistNetworkError) and "timeout" in str(error).lower()


def first_line(error: BaseException) -> str:
    """``error`` as its type and the first line of its text (torch's store errors carry a
    C++ trace)."""
    text = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    return f"{type(error).__name__}: {text}"


def _wait_for(store: dist.Store, keys: list[str], timeout: float) -> bool:
    """Wait at most ``timeout`` seconds until every key of ``keys`` is set; False if the
    timeout passed. A zero timeout would mean none to the store: wait a millisecond."""
    try:
        store.wait(keys, datetime.timedelta(seconds=max(timeout, 1e-3)))
        return True
    except Exception as e:
        if is_timeout(e):
            return False
        raise


@dataclass(frozen=True)
class JobScope:
    """Where the ranks of the job meet in the default store."""

    prefix: str
    store: dist.Store | None
    """The default store under ``prefix`` (None: no process group, a job of one)."""
    ranks: tuple[int, ...]
    """Global ranks of the job."""
    me: int = 0
    """This rank's global rank."""

    @staticmethod
    def new() -> "JobScope":
        """The scope of the next schedule built in this process (a new generation)."""
        if not dist.is_initialized():
            return JobScope("", None, ())
        prefix, store = generation_store("job", ())
        return JobScope(prefix, store, tuple(range(dist.get_world_size())), dist.get_rank())

    @property
    def name(self) -> str:
        """The prefix as a file name part (``attempt-0-job-3``)."""
        return "-".join(part for part in self.prefix.split("/")[1:] if part)


class FailureBoard:
    """What the ranks of one pipeline, and of the job around it, tell each other through
    the store, apart from the channels: the first failure (a failed rank says so and wakes
    the others' watches), and values every rank says once (``tell``, ``collect``,
    ``gather``).

    The channels cannot tell the peers on NCCL (an abort is local) and a gloo peer learns
    only of a closed connection, not who failed or why; the store always works while it
    lives. Keys live under the channels' generation prefix (``store``, over the pipeline's
    ``ranks``) and the job's (``job_store``, over ``job_ranks``: ``JobScope``),
    so a new schedule starts with a clean board. Without a ``job_store`` the board is the
    pipeline's alone.
    """

    KEY = "failed"
    WAKE = "wake"
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
        self._notice = job_store if job_store is not None else store
        """Where the first failure is kept and the watches are woken."""
        self._interval = interval
        self._clock = clock
        self._next = 0.0
        self._seen: tuple[int, str] | None = None
        self._fed = False
        self.lost: str | None = None
        """Why the store is gone (one line naming it), once a watch found so."""

    @property
    def me(self) -> int:
        return self._me

    @property
    def wake_key(self) -> str:
        """The key this rank's watch waits on."""
        return f"{self.WAKE}/{self._me}"

    @property
    def notice_store(self) -> dist.Store | None:
        """Where the job's first failure is kept and the watches wait (the job's store, or
        the pipeline's without one)."""
        return self._notice

    def wake_own_watch(self) -> None:
        """End this rank's watch's wait (its ``close``)."""
        if self._notice is not None and self.lost is None:
            try:
                self._notice.set(self.wake_key, "closed")
            except Exception as e:  # the store gone: the watch's wait fails by itself
                logger.warning("global rank %d could not wake its watch: %s", self._me,
                               first_line(e))

    def publish(self, message: str) -> None:
        """Say this rank failed (the first failure of the pipeline, and of the job, is the
        one kept); the first of the job wakes every rank's watch."""
        if self._seen is not None or self.lost is not None:
            return
        told = f"{self._me}\n{message}"
        for store in (self._job_store, self._store):
            if store is None:
                continue
            try:
                # compare_set keeps the first writer's value when several ranks fail at once.
                kept = store.compare_set(self.KEY, "", told).decode()
                if self._seen is None:
                    rank, _, text = kept.partition("\n")
                    self._seen = (int(rank), text)
                if kept == told and store is self._notice and self.job_ranks:
                    store.multi_set([f"{self.WAKE}/{rank}" for rank in self.job_ranks],
                                    [self.KEY] * len(self.job_ranks))
            except Exception as e:  # the store itself gone: the peers will stall instead
                logger.warning("global rank %d could not publish its failure: %s", self._me,
                               first_line(e))

    def failure(self) -> tuple[int, str] | None:
        """(global rank, message) of the first failure of the job (or, where the job's
        key is unset, of the pipeline), if any: as a watch heard it, or (a board no watch
        feeds) a store read or two until one is seen."""
        if self._seen is None and not self._fed:
            self._read()
        return self._seen

    def _read(self) -> None:
        for store in (self._job_store, self._store):
            if store is None or self._seen is not None or self.lost is not None:
                continue
            try:
                if store.check([self.KEY]):
                    self._seen = self.decode(store.get(self.KEY))
            except dist.DistNetworkError as e:  # its connection failed: the store is gone
                self.lose(e)
            except Exception as e:
                logger.warning("global rank %d could not read the failure board: %s",
                               self._me, first_line(e))

    @staticmethod
    def decode(said: bytes) -> tuple[int, str]:
        rank, _, message = said.decode().partition("\n")
        return int(rank), message

    def fed_by_watch(self) -> None:
        """From now on a watch hands this board the job's failure (``heard``, ``lost``):
        checks read the store no more, except forced ones."""
        self._fed = True

    def heard(self, failure: tuple[int, str]) -> None:
        """The watch read the job's first failure."""
        if self._seen is None:
            self._seen = failure

    def lose(self, error: BaseException) -> str:
        """The watch found the store gone (``error``); returns the one line that says so."""
        if self.lost is None:
            self.lost = (f"the job's store at {describe_store(self._notice)} is gone "
                         f"({first_line(error)})")
        return self.lost

    def check(self, force: bool = False) -> None:
        """Raise ``PeerFailedError`` if another rank failed (``StoreLostError`` if the
        store is gone); a board no watch feeds reads the store at most every ``interval``
        seconds, and any board when ``force``d (after a receive or send failed)."""
        now = self._clock()
        if force or (not self._fed and now >= self._next):
            self._next = now + self._interval
            self._read()
        if self.lost is not None:
            raise StoreLostError(self.lost)
        failure = self._seen
        if failure is not None and failure[0] != self._me:
            rank, message = failure
            where = "job" if self._job_store is not None and rank not in self._ranks \
                else "pipeline"
            raise PeerFailedError(f"global rank {rank} of the {where} failed: {message}", rank)

    def tell(self, key: str, value: str, *, job: bool = False) -> None:
        """Say ``value`` under ``key`` for this rank (``job``: to the job), without waiting
        for anyone (``collect`` reads what the others said)."""
        store = self._job_store if job else self._store
        if store is not None and self.lost is None:
            store.set(f"{key}/{self._me}", value)
            store.append(f"{key}/told", f"{self._me},")

    def collect(self, key: str, timeout: float, *, job: bool = False,
                ranks: Sequence[int] | None = None) -> dict[int, str]:
        """What each rank of the pipeline (``job``: of the job; ``ranks``: these global
        ranks) said under ``key`` (``tell``) within ``timeout`` seconds, by global rank;
        ranks that said nothing by then are left out. A wait and a read, or, when some
        are silent, the list of those that told and a read."""
        store = self._job_store if job else self._store
        if ranks is None:
            ranks = self.job_ranks if job else self._ranks
        if store is None or self.lost is not None or not ranks:
            return {}
        keys = {rank: f"{key}/{rank}" for rank in ranks}
        present = list(ranks)
        if not _wait_for(store, list(keys.values()), timeout):
            told = (store.get(f"{key}/told").decode().split(",")
                    if store.check([f"{key}/told"]) else [])
            present = [rank for rank in ranks if str(rank) in told]
        said = store.multi_get([keys[rank] for rank in present]) if present else []
        return {rank: value.decode() for rank, value in zip(present, said)}

    def forget(self, key: str, ranks: Sequence[int], *, job: bool = False) -> None:
        """Delete what ``ranks`` said under ``key`` (``tell``), once every reader has
        read it: the store keeps no key of a finished exchange."""
        store = self._job_store if job else self._store
        if store is not None and self.lost is None:
            for name in (*(f"{key}/{rank}" for rank in ranks), f"{key}/told"):
                store.delete_key(name)

    def stop_sending(self, peers: Sequence[int], timeout: float) -> None:
        """Say that this rank issues no more sends on the pipeline's channels, then wait at
        most ``timeout`` seconds until each of ``peers`` (global ranks) has said so too;
        log those that had not by then (outside a step, hung or dead). With the store
        gone, wait ``timeout``: every rank's watch lost it at once, and stops sending."""
        if self.lost is not None:
            time.sleep(timeout)
            return
        self.tell(self.STOPPED_SENDING, "")
        said = self.collect(self.STOPPED_SENDING, timeout, ranks=peers)
        silent = [rank for rank in peers if rank not in said]
        if silent:
            logger.warning("global rank %d closes its channels although global ranks %s did "
                           "not say within %g s that they stopped sending", self._me, silent,
                           timeout)

    def gather(self, key: str, value: str, timeout: float) -> dict[int, str]:
        """Every rank of the pipeline says ``value`` under ``key``; returns what each
        said, by global rank. Backend-agnostic, and apart from the channels, whose first
        use would be a stage's data; waits at most ``timeout`` seconds for the others,
        then raises ``PipelineStallError`` naming them. Each schedule may use a key once."""
        if self._store is None or len(self._ranks) < 2:
            return {self._me: value}
        self.tell(key, value)
        said = self.collect(key, timeout)
        missing = [rank for rank in self._ranks if rank not in said]
        if missing:
            raise PipelineStallError(
                f"global ranks {missing} of the pipeline did not say {key!r} within "
                f"stall_timeout ({timeout:g} s)")
        return said
