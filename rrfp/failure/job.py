"""The job around one pipeline: every rank of every pipeline, with their data-parallel and
tensor/expert-parallel replicas (the default group's ranks).

* **Its board** (``JobScope``): a prefix in the default store that every rank of the job
  agrees on without talking, also after torchrun restarts the workers:
  ``rrfp/attempt-<TORCHELASTIC_RESTART_COUNT>/job/<generation>/``, a generation per
  ``ScheduleRRFP`` this process built (every rank of the job builds as many as the
  others, as the ranks of a pipeline do for its channels). A failure published there
  (``rrfp.comm.board``) reaches every rank; nothing of an earlier generation or attempt is
  read by a later one.
* **Its groups** (``JobGroups``): the process groups that the stages' collectives use
  beside the pipeline: data parallel (DDP's group, the mesh of FSDP's sharded
  parameters), tensor and expert parallel (the meshes of DTensor parameters), the
  coordination group and rrfp's private twin of it. A rank blocked in a collective on
  one of them waits for peers that may never come: its replicas in a pipeline that
  failed.
* **Aborting them**: NCCL: ``ProcessGroup.abort`` (``ncclCommAbort`` on each of the
  group's communicators: what torch's ``_abort_process_group`` runs for one group, here
  without unregistering the group from a thread that is not the one using it). An NCCL
  abort is local, so every rank aborts its own groups once it learns of a failure: the
  failed rank at once, the others through their watch. gloo has no abort
  (``rrfp.comm.channels.break_gloo_group`` closes the group's connections, failing what is
  pending here and at the peers). The groups are aborted concurrently with a bounded
  wait (an ``ncclCommAbort`` can block while another communicator's kernel spins,
  pytorch#119797). Aborted groups cannot be used again: the job restarts
  (``torchrun --max-restarts``) or builds new ones.
* **The watch** (``JobWatch``): a thread per schedule blocks, on a store client of its
  own (connected when the watch is made, so a rank is armed before its first step), in
  a wait for this rank's wake key (``rrfp.comm.board``: the rank whose failure the
  job keeps sets every rank's): no polling, and the wait makes no store operation while
  nothing happens. It is not re-armed on a period: torch's store client logs a warning to the
  process's standard error whenever a wait's timeout passes, so its timeout is the longest
  a ``TCPStore`` wait takes (``WATCH_WAIT_S``), and it ends when the key is set. When
  another rank failed it aborts this rank's job groups, which makes a collective blocked
  in them raise, and wakes the step loop; when the store's connection fails (its process
  gone: at once) it says so in one line naming the store, and does the same. A second
  thread writes, every ``WATCH_PERIOD_S``, one key on the rank's own client (a write gets
  no answer, so it never holds the client up, and logs nothing): a store host that
  vanished without closing its connections makes a write fail once the connection gives
  up on the unacknowledged ones (TCP's retransmission timeout), and it says so as the
  watch does. ``close`` sets the rank's own wake key to end the wait.
* **Its settings** (``agree_on_settings``): every rank says the settings that must be the
  same everywhere (hint, limit, microbatches, ...) before any channel is built; the job's
  first rank compares them and says one verdict that every rank waits for: a few store
  operations per rank, however many ranks. A disagreement is refused on every rank with
  one message.
"""

from __future__ import annotations

import datetime
import functools
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from rrfp.comm.board import FailureBoard, first_line, is_timeout, JobScope
from rrfp.comm.channels import break_gloo_group
from rrfp.comm.threads import concurrently
from rrfp.core.errors import PipelineStallError
from rrfp.core.wakeup import Wakeup

logger = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 10.0
"""How long aborting the job's groups may take before the rank goes on without them."""
WATCH_PERIOD_S = 30.0
"""How often the watch's probe writes its key (one store operation): a store host that
vanished without closing its connections is found by a write."""
PROBE = "watch-probe"
"""The key (per global rank) the watch's probe writes in the job's store."""
WATCH_WAIT_S = (2**31 - 1) / 1000
"""How long the watch's wait for its wake key lasts before it is re-armed: the longest a
``TCPStore`` wait takes (its client polls the connection for at most an ``int`` of
milliseconds). Only a wait whose timeout passes makes torch's store client log a warning;
this one ends when its key is set (a failure, or ``close``) or its connection fails."""


class JobGroups:
    """The process groups of the stages' collectives beside the pipeline, aborted at most
    once (see the module docstring)."""

    def __init__(self, groups: Iterable[dist.ProcessGroup]):
        default = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None
        unique: dict[int, dist.ProcessGroup] = {}
        for group in groups:
            # The default group is torchrun's and the trainer's, not the stages'.
            if group is not None and group is not default:
                unique.setdefault(id(group), group)
        self.groups = list(unique.values())
        self._lock = threading.Lock()
        self.aborted = False

    def __len__(self) -> int:
        return len(self.groups)

    def describe(self) -> str:
        return ", ".join(_group_name(g) for g in self.groups) or "none"

    def abort(self, timeout: float = ABORT_TIMEOUT_S) -> list[threading.Thread]:
        """Abort every group, concurrently, once; return the abort threads still running
        after ``timeout`` seconds."""
        with self._lock:
            if self.aborted or not self.groups:
                self.aborted = True
                return []
            self.aborted = True
        return concurrently({f"rrfp-abort-{_group_name(g)}": functools.partial(abort_group, g)
                             for g in self.groups}, timeout)


def abort_group(group: dist.ProcessGroup) -> None:
    """Abort ``group`` at this rank: its NCCL communicators (``ProcessGroup.abort``, local)
    and its gloo connections (``break_gloo_group``, here and at the peers)."""
    group.abort()
    if _has_gloo(group) and group.size() > 1:
        break_gloo_group(group, 1 if group.rank() == 0 else 0)


def _has_gloo(group: dist.ProcessGroup) -> bool:
    try:
        return isinstance(group._get_backend(torch.device("cpu")), dist.ProcessGroupGloo)
    except (RuntimeError, ValueError):  # no CPU backend, or a backend of its own in Python
        return False


def _group_name(group: dist.ProcessGroup) -> str:
    try:
        name = group.group_name
    except RuntimeError:  # a group built in Python has none
        name = type(group).__name__
    return f"group {name} of {group.size()} ranks"


def collective_groups(modules: Iterable[torch.nn.Module]) -> list[dist.ProcessGroup]:
    """The groups of the meshes of ``modules``' DTensor parameters (FSDP's shards, tensor
    and expert parallel weights): call before FSDP unshards them."""
    groups = []
    for module in modules:
        for p in module.parameters():
            if isinstance(p, DTensor) and p.device_mesh.size() > 1:
                groups.extend(p.device_mesh.get_all_groups())
    return groups


class JobWatch:
    """A thread that waits for this rank's wake key in the job's store, on a connection
    made before the constructor returns (see the module docstring); when another rank
    failed it aborts ``groups``, wakes the step loop (``wakeup``) and calls
    ``told(rank, message)``, then ends; when the store is gone (or could not be
    connected) it aborts ``groups`` and wakes the step loop, whose next check raises. A
    second thread writes a key every ``period`` seconds, which fails once the store's host
    is gone."""

    def __init__(self, board: FailureBoard, groups: JobGroups, wakeup: Wakeup,
                 told: Callable[[int, str], None], period: float = WATCH_PERIOD_S):
        self._board, self._groups, self._wakeup, self._told = board, groups, wakeup, told
        self._period = period
        self._probe_key = f"{PROBE}/{board.me}"
        self._stop = threading.Event()
        self._ended = threading.Event()
        """Set once the watch is over: closed, a failure heard, or the store gone."""
        self._lock = threading.Lock()
        self._client, self._unreachable = self._connect(board.notice_store)
        board.fed_by_watch()
        self.thread = threading.Thread(target=self._run, name="rrfp-job-watch", daemon=True)
        self.prober = threading.Thread(target=self._probe, name="rrfp-job-watch-probe",
                                       daemon=True)
        self.thread.start()
        self.prober.start()

    def _run(self) -> None:
        try:
            failure = self._wait_for_failure()
        except Exception as e:
            self._store_gone(e)
            return
        finally:
            self._ended.set()
        if failure is None:
            return
        self._board.heard(failure)
        rank, message = failure
        if rank != self._board.me:
            logger.error("rrfp: global rank %d of the job failed (%s); global rank %d "
                         "aborts its groups beside the pipeline (%s)", rank,
                         message.splitlines()[0] if message else "", self._board.me,
                         self._groups.describe())
            self._groups.abort()
            self._wakeup.notify()
            self._told(rank, message)

    def _store_gone(self, error: BaseException) -> None:
        """The wait's connection, or the probe, failed: unless the watch was closed, say
        so once, abort the groups and wake the step loop."""
        with self._lock:
            if self._stop.is_set() or self._board.lost is not None:
                return
            line = self._board.lose(error)
        logger.error("rrfp: global rank %d stops: %s", self._board.me, line)
        self._groups.abort()
        self._wakeup.notify()

    def _probe(self) -> None:
        """Every period, one write on the rank's own store client: it gets no answer, so
        it neither logs (as a wait whose timeout passes does) nor holds up the rank's
        other operations or ``close``; once the connection gave up on a store host that
        vanished without closing it, the write fails."""
        store = self._board.notice_store
        key = self._probe_key
        while store is not None and not self._ended.wait(self._period):
            try:
                store.set(key, "")
            except Exception as e:
                self._store_gone(e)
                return

    @staticmethod
    def _connect(store: dist.Store | None) -> tuple[dist.Store | None, Exception | None]:
        """The watch's own client of ``store`` (a store client runs one operation at a
        time: a wait on the rank's own client would hold up every other operation of the
        rank), or why it could not connect (the watch's thread reports it)."""
        if store is None:
            return None, None
        try:
            return store.clone(), None
        except Exception as e:
            return None, e

    def _wait_for_failure(self) -> tuple[int, str] | None:
        """Block until this rank's wake key is set; the job's first failure then, or None
        if the watch was closed (or the board has no store)."""
        if self._unreachable is not None:
            raise self._unreachable
        # The thread holds the watch's connection alone: it closes when the thread ends.
        client, self._client = self._client, None
        if client is None:
            self._stop.wait()
            return None
        wake, key = [self._board.wake_key], [FailureBoard.KEY]
        while not self._stop.is_set():
            try:
                client.wait(wake, datetime.timedelta(seconds=WATCH_WAIT_S))
            except Exception as e:
                if is_timeout(e):
                    continue
                raise
            if self._stop.is_set() or not client.check(key):
                return None
            return FailureBoard.decode(client.get(FailureBoard.KEY))
        return None

    def close(self, timeout: float) -> list[threading.Thread]:
        """Stop the watch; return its threads still running after ``timeout`` (together).
        With the store gone, the wait's thread is left behind, unreported: nothing can end
        a wait on a connection whose host vanished, and it holds only that connection (a
        daemon thread, ended with the process)."""
        self._stop.set()
        self._ended.set()
        threads = [self.prober]
        if self._board.lost is None:
            self._board.wake_own_watch()
            threads.append(self.thread)
        deadline = time.monotonic() + timeout
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
        alive = [thread for thread in threads if thread.is_alive()]
        if not alive:
            self._forget_keys()
        return alive

    def _forget_keys(self) -> None:
        """Delete the watch's keys (its wake key, its probe's) once its threads ended: the
        store keeps none per rank of a closed schedule."""
        store = self._board.notice_store
        if store is None or self._board.lost is not None:
            return
        try:
            for key in (self._board.wake_key, self._probe_key):
                store.delete_key(key)
        except Exception as e:  # the store gone since, or one that cannot delete keys
            # (torch's PrefixStore over a store written in Python): two small keys are left
            logger.info("global rank %d could not delete its watch's keys: %s",
                        self._board.me, first_line(e))


SETTINGS, VERDICT = "settings", "settings-verdict"
"""The keys of the settings agreement in the job's store."""


def agree_on_settings(job: JobScope, settings: dict[str, str], timeout: float) -> None:
    """Every rank of the job says ``settings``; if any differ, every rank raises the same
    ``ValueError`` naming each setting that differs and which ranks have which value
    (before any channel is built or step runs). The job's first rank compares what every
    rank said (waiting at most ``timeout`` seconds for them: then every rank raises
    ``PipelineStallError`` naming the ranks that said nothing) and says the verdict the
    others wait for: a few store operations a rank, however many ranks."""
    if job.store is None or len(job.ranks) < 2:
        return
    board = FailureBoard(None, job.me, job_store=job.store, job_ranks=job.ranks)
    board.tell(SETTINGS, json.dumps(settings, sort_keys=True), job=True)
    leader = job.ranks[0]
    if job.me == leader:
        verdict = _settings_verdict(board.collect(SETTINGS, timeout, job=True), job.ranks,
                                    timeout)
        job.store.set(VERDICT, verdict)
    else:
        verdict = _awaited_verdict(job.store, leader, timeout)
    kind, _, message = verdict.partition("\n")
    if kind == "ValueError":
        raise ValueError(message)
    if kind == "PipelineStallError":
        raise PipelineStallError(message)


def _awaited_verdict(store: dist.Store, leader: int, timeout: float) -> str:
    """The leader's verdict, waited for up to twice ``timeout`` (the leader waits up to
    ``timeout`` for the last rank, which may start up to ``timeout`` after this one)."""
    try:
        store.wait([VERDICT], datetime.timedelta(seconds=2 * timeout))
    except Exception as e:
        if not is_timeout(e):
            raise
        return (f"PipelineStallError\nglobal rank {leader}, which compares the job's settings, "
                f"gave no verdict within twice stall_timeout ({2 * timeout:g} s): {e}")
    return store.get(VERDICT).decode()


def _settings_verdict(said: dict[int, str], ranks: tuple[int, ...], timeout: float) -> str:
    """``ok``, or the error every rank raises, its type on the first line."""
    missing = [rank for rank in ranks if rank not in said]
    if missing:
        return (f"PipelineStallError\nglobal ranks {missing} of the job did not say "
                f"{SETTINGS!r} within stall_timeout ({timeout:g} s)")
    if len(set(said.values())) <= 1:
        return "ok"
    by_rank = {rank: json.loads(value) for rank, value in sorted(said.items())}
    differences = []
    for name in sorted({name for values in by_rank.values() for name in values}):
        holders: dict[str, list[int]] = {}
        for rank, values in by_rank.items():
            holders.setdefault(str(values.get(name)), []).append(rank)
        if len(holders) > 1:
            differences.append(f"{name} is " + " but ".join(
                f"{value} on global ranks {_ranges(held)}" for value, held in holders.items()))
    return ("ValueError\nthe ranks of this job disagree on RRFP's settings (a configuration "
            f"edited on one node?): {'; '.join(differences)}. Give every rank the same "
            "settings")


def _ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2, 5``."""
    parts: list[list[int]] = []
    for rank in ranks:
        if parts and rank == parts[-1][-1] + 1:
            parts[-1].append(rank)
        else:
            parts.append([rank])
    return ", ".join(f"{p[0]}-{p[-1]}" if len(p) > 1 else f"{p[0]}" for p in parts)
