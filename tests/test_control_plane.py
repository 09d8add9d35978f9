"""The control plane's store traffic does not grow with the job (DESIGN.md invariant 19),
and a job whose store dies stops, saying so (``rrfp.failures``, ``rrfp.job``). Counted by
a ``CountingStore`` around each rank's store (``rrfp.testing.store_ops``)."""

from __future__ import annotations

import copy
import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

from rrfp import PeerFailedError, ScheduleRRFP, Settings, StoreLostError
from rrfp.comm.board import FailureBoard, JobScope
from rrfp.core.wakeup import Wakeup
from rrfp.failure.job import agree_on_settings, JobGroups, JobWatch, WATCH_PERIOD_S
from rrfp.testing.chains import loss_fn, make_batch, make_chain, run_steps
from rrfp.testing.emulation import EmulatedDeviceTime
from rrfp.testing.probes import rrfp_threads
from rrfp.testing.store_ops import CountingStore, ops_of, ServedStore
from rrfp.testing.worlds import run_local_world

M = 4
STEPS = 50


def steps_counted(rank: int, world_size: int, steps: int) -> dict:
    """Pipelines of 2 ranks (global ranks {0, 1}, {2, 3}, ...), 1F1B over 4 microbatches
    given sizes that tell them apart (so their duration fits are shared through the store
    every step); after one step, this rank's store operations over ``steps`` more, and how
    long they took."""
    pipelines = [list(range(first, first + 2)) for first in range(0, world_size, 2)]
    group = [dist.new_group(ranks) for ranks in pipelines][rank // 2]
    chain = make_chain(2)
    x, y = make_batch(M)
    # Each forward and backward takes 10 ms: a rank waits for its peer (where a board
    # that read the store would read it) for a few seconds over the steps.
    block = EmulatedDeviceTime(copy.deepcopy(chain[rank % 2]), M, lambda mb: 0.01,
                               lambda mb: 0.01)
    stage = PipelineStage(block, rank % 2, 2, torch.device("cpu"), group=group)
    schedule = ScheduleRRFP(stage, M, loss_fn=loss_fn, hint="1F1B",
                            settings=Settings(stall_timeout=120))
    sizes = [1, 2, 3, 4]

    def step() -> None:
        if stage.is_first:
            schedule.step(x, target=y, mb_sizes=sizes)
        else:
            schedule.step(target=y, mb_sizes=sizes)

    step()
    ops = ops_of(dist.distributed_c10d._get_default_store())
    calls, keys = ops.snapshot()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    elapsed = time.perf_counter() - started
    after_calls, after_keys = ops.snapshot()
    schedule.close()
    # Global rank 0 serves the store: it ends only once no rank's watch waits in it.
    dist.barrier()
    return {"calls": after_calls - calls, "keys": after_keys - keys, "elapsed": elapsed}


def test_a_ranks_store_operations_over_50_steps_do_not_grow_with_the_job():
    """The ranks of the first pipeline, in a job of that one pipeline and in a job of two:
    over 50 steps given sizes, each makes as many store operations, naming as many keys,
    in both (the watch's probe aside): a write and a read of the pipeline's fits a
    step, nothing for the failure board."""
    small = run_local_world(2, steps_counted, STEPS, store="tcp", count_store_ops=True,
                            timeout=240)
    large = run_local_world(4, steps_counted, STEPS, store="tcp", count_store_ops=True,
                            timeout=240)
    for rank in (0, 1):
        few, many = small[rank], large[rank]
        # One probe write per WATCH_PERIOD_S; before every peer has written its fits, a read
        # checks each first.
        slack = 3 + int(max(few["elapsed"], many["elapsed"]) // WATCH_PERIOD_S)
        assert few["calls"] <= 2 * STEPS + slack, (rank, few)
        assert many["calls"] <= few["calls"] + slack, (rank, few, many)
        assert many["keys"] <= few["keys"] + slack, (rank, few, many)


def _agree_as_threads(ranks: int, odd_one: int | None = None) -> tuple[list, list[int]]:
    """``ranks`` ranks as threads, each with its own counted client of one store, agree on
    their settings (``odd_one`` says another ``buffer_limit``); what each raised (None)
    and the keys its store operations named."""
    shared = dist.HashStore()
    stores = [CountingStore(shared) for _ in range(ranks)]
    raised: list = [None] * ranks

    def agree(rank: int) -> None:
        settings = {"buffer_limit": "'hint+1'" if rank == odd_one else "'hint'"}
        try:
            agree_on_settings(JobScope("p/", stores[rank], tuple(range(ranks)), rank),
                              settings, timeout=60)
        except ValueError as e:
            raised[rank] = str(e)

    threads = [threading.Thread(target=agree, args=(rank,)) for rank in range(ranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return raised, [store.ops.snapshot()[1] for store in stores]


def test_the_settings_agreement_costs_a_rank_a_few_operations_whatever_the_job():
    """4 and 16 ranks: every rank but the first (which compares them all) names the same
    few keys in both jobs; a disagreement is refused on every rank with one message naming
    the rank that differs."""
    _, few = _agree_as_threads(4)
    _, many = _agree_as_threads(16)
    assert set(few[1:]) == set(many[1:]) and max(many[1:]) <= 5, (few, many)
    assert many[0] - few[0] == 2 * (16 - 4), (few, many)  # the first waits for, reads each
    raised, _ = _agree_as_threads(16, odd_one=9)
    assert len(set(raised)) == 1 and raised[0] is not None, raised
    assert "buffer_limit is 'hint' on global ranks 0-8, 10-15 but 'hint+1' on global " \
           "ranks 9" in raised[0], raised[0]


def store_killed_mid_run(rank: int, world_size: int, server_pid: int, stall: float) -> dict:
    """A pipeline of ``world_size`` ranks, 1F1B, whose store is served by another process;
    after two steps global rank 0 kills that process; every rank steps on until one raises
    (at most three ``stall`` timeouts)."""
    chain = make_chain(world_size)
    x, y = make_batch(M)
    stage = PipelineStage(copy.deepcopy(chain[rank]), rank, world_size, torch.device("cpu"))
    schedule = ScheduleRRFP(stage, M, loss_fn=loss_fn, hint="1F1B",
                            settings=Settings(stall_timeout=stall))
    run_steps(schedule, [stage], [stage.submod], x, y, 2)
    killed_at = None
    if rank == 0:
        killed_at = time.time()
        os.kill(server_pid, signal.SIGKILL)
    error = None
    end = time.time() + 3 * stall
    while error is None and time.time() < end:
        try:
            run_steps(schedule, [stage], [stage.submod], x, y, 1)
        except Exception as e:
            error = e
    return {"error": None if error is None else f"{type(error).__name__}: {error}",
            "lost": isinstance(error, StoreLostError), "raised_at": time.time(),
            "killed_at": killed_at, "threads": rrfp_threads()}


@pytest.mark.parametrize("stall", [10.0])
def test_a_killed_store_host_stops_every_rank_within_the_stall_timeout_naming_the_store(stall):
    """The process serving the job's store is SIGKILLed mid-run: every rank's step raises
    ``StoreLostError`` within ``stall_timeout``, in one line naming the store's address,
    and leaves no thread running."""
    with ServedStore() as served:
        ranks = run_local_world(4, store_killed_mid_run, served.pid, stall,
                                store=(served.host, served.port), timeout=240)
    killed_at = ranks[0]["killed_at"]
    for rank, result in enumerate(ranks):
        error = result["error"]
        assert result["lost"], (rank, error)
        assert "\n" not in error and f"the job's store at {served.host}:{served.port} is " \
               "gone" in error, (rank, error)
        assert result["raised_at"] - killed_at < stall, (rank, result)
        assert result["threads"] == [], (rank, result)


class SlowToConnect(CountingStore):
    """A counted client whose clones take ``CONNECT_S`` to connect, or fail (``refuse``)."""

    CONNECT_S = 0.5

    def __init__(self, inner: dist.Store, refuse: bool = False):
        super().__init__(inner)
        self.refuse = refuse
        self.connected = 0

    def clone(self) -> CountingStore:
        time.sleep(self.CONNECT_S)
        if self.refuse:
            raise dist.DistNetworkError("Connection refused (planted)")
        self.connected += 1
        return super().clone()


def test_a_watch_connects_before_it_is_made_so_its_rank_is_armed_before_a_step():
    """A ``JobWatch`` has its own connection to the store when its constructor returns
    (however long connecting takes), and hears another rank's failure through it; a watch
    that could not connect makes the rank's next check raise ``StoreLostError`` naming
    the store."""
    with ServedStore() as served:
        store = SlowToConnect(served.client())
        board = FailureBoard(None, 1, job_store=store, job_ranks=range(2))
        wakeup, told = Wakeup(), threading.Event()
        watch = JobWatch(board, JobGroups([]), wakeup, lambda rank, message: told.set())
        assert store.connected == 1, "the watch returned before its connection was made"
        failing = FailureBoard(None, 0, job_store=served.client(), job_ranks=range(2))
        failing.publish("planted failure")
        assert told.wait(10.0), "the watch did not hear the failure"
        with pytest.raises(PeerFailedError, match="global rank 0 of the job failed"):
            board.check()
        assert watch.close(10.0) == []
        refused = SlowToConnect(served.client(), refuse=True)
        lost = FailureBoard(None, 1, job_store=refused, job_ranks=range(2))
        watch = JobWatch(lost, JobGroups([]), Wakeup(), lambda rank, message: None)
        watch.thread.join(10.0)
        with pytest.raises(StoreLostError, match=f"the job's store at {served.host}:"
                                                 f"{served.port} is gone"):
            lost.check()
