"""The whole job, not one pipeline: a failure reaches every rank of every pipeline and
their replicas, a stall gets one report, and settings that differ between ranks are
refused before any step (``rrfp.failure.job``, ``rrfp.failure.hang_report``). Worlds of 4 processes on
gloo, or on NCCL-like channels and groups (``rrfp.testing.nccl_like``,
``rrfp.testing.nccl_like_collectives``)."""

from __future__ import annotations

import copy
import datetime
import os
import re
import signal
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage

from rrfp import PipelineStallError, ScheduleRRFP, Settings
from rrfp.comm.board import JobScope
from rrfp.comm.transport import Transport
from rrfp.failure.hang_report import find_holder, HANG_REPORT_WAIT_S, report_text, SILENT, UNSENT
from rrfp.failure.job import agree_on_settings
from rrfp.testing import nccl_like_collectives
from rrfp.testing.chains import loss_fn, make_batch, make_chain, MLPBlock, run_steps
from rrfp.testing.emulation import EmulatedDevice
from rrfp.testing.nccl_like import channels_for
from rrfp.testing.probes import error_chain, rrfp_threads
from rrfp.testing.study import Study, StudySchedule
from rrfp.testing.worlds import run_local_world

M = 4
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=300)


def _test_store() -> dist.Store:
    """Where the planted situations coordinate (apart from everything rrfp uses)."""
    return dist.PrefixStore("test/", dist.distributed_c10d._get_default_store())


def _wait_for(store: dist.Store, keys: list[str]) -> None:
    store.wait(keys, datetime.timedelta(seconds=60))


class _AllReduceForward(torch.autograd.Function):
    """A row-parallel layer's output: summed over the group; its gradient passes as is."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _AllReduceBackward(torch.autograd.Function):
    """A column-parallel layer's input: passed as is; its gradient summed over the group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class HandMadeTensorParallel(torch.nn.Module):
    """``MLPBlock`` split over a group by hand (up by rows, down by columns), its
    collectives issued with ``dist.all_reduce`` on the group inside forward and backward:
    tensor parallel over a group of any backend (the NCCL-like one)."""

    def __init__(self, block: MLPBlock, group: dist.ProcessGroup):
        super().__init__()
        me, size = dist.get_rank(group), dist.get_world_size(group)
        rows = block.up.out_features // size
        self.group = group
        self.up = torch.nn.Linear(block.up.in_features, rows).double()
        self.down = torch.nn.Linear(rows, block.down.out_features, bias=me == 0).double()
        with torch.no_grad():
            self.up.weight.copy_(block.up.weight[me * rows:(me + 1) * rows])
            self.up.bias.copy_(block.up.bias[me * rows:(me + 1) * rows])
            self.down.weight.copy_(block.down.weight[:, me * rows:(me + 1) * rows])
            if me == 0:
                self.down.bias.copy_(block.down.bias)

    def forward(self, x):
        x = _AllReduceBackward.apply(x, self.group)
        return _AllReduceForward.apply(self.down(torch.tanh(self.up(x))), self.group)


class Strike(torch.nn.Module):
    """Runs ``inner``; armed, its ``at``-th forward first waits until ``wait_keys`` are in
    the test store (the peers are inside their collectives), then strikes: ``"raise"`` an
    error, or ``"kill"`` the process (SIGKILL: nothing is published). Saying ``say`` at
    that forward instead marks this rank's own entry into it."""

    def __init__(self, inner: torch.nn.Module, how: str | None, at: int,
                 wait_keys: list[str] = (), say: str | None = None):
        super().__init__()
        self.inner, self.how, self.at = inner, how, at
        self.wait_keys, self.say = list(wait_keys), say
        self.calls, self.armed = 0, False

    def forward(self, x):
        self.calls += 1
        if self.armed and self.calls == self.at:
            store = _test_store()
            if self.say is not None:
                store.set(self.say, "1")
            if self.how is not None:
                _wait_for(store, self.wait_keys)
                time.sleep(0.3)  # the peers are blocked in their collectives by now
                store.set("struck", repr(time.time()))
                if self.how == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError("forward failed on purpose")
        return self.inner(x)


def _layout(rank: int, parallel: str) -> tuple[int, int, list[list[int]], list[list[int]]]:
    """(pipeline rank, replica, pipelines, replica groups) of PP 2 x DP 2 (pipelines {0, 1}
    and {2, 3}) or PP 2 x TP 2 (pipelines {0, 2} and {1, 3}, TP groups {0, 1}, {2, 3})."""
    if parallel == "dp":
        return rank % 2, rank // 2, [[0, 1], [2, 3]], [[0, 2], [1, 3]]
    return rank // 2, rank % 2, [[0, 2], [1, 3]], [[0, 1], [2, 3]]


WRAPPERS = {("dp", "gloo"): "fsdp", ("dp", "nccl-like"): "ddp", ("tp", "gloo"): "dtensor",
            ("tp", "nccl-like"): "by hand"}
"""How each test makes replicas: FSDP and DTensor need a gloo group; DDP and the hand-made
split run on the NCCL-like one too."""


def _replicated(module: torch.nn.Module, wrapper: str, group: dist.ProcessGroup):
    """``module`` as a data-parallel (``"fsdp"``, ``"ddp"``) or tensor-parallel replica
    (``"dtensor"``: its ``up``/``down`` pair, found anywhere in it, as DTensors;
    ``"by hand"``: an ``MLPBlock`` split by ``HandMadeTensorParallel``)."""
    if wrapper == "fsdp":
        from torch.distributed.fsdp import fully_shard

        fully_shard(module, mesh=DeviceMesh.from_group(group, "cpu"))
        return module
    if wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(module, process_group=group)
    if wrapper == "dtensor":
        from torch.distributed.tensor.parallel import (
            ColwiseParallel, parallelize_module, RowwiseParallel)

        return parallelize_module(module, DeviceMesh.from_group(group, "cpu"),
                                  {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return HandMadeTensorParallel(module, group)


def _groups(rank: int, parallel: str, kind: str):
    """This rank's pipeline group (gloo) and replica group (gloo or NCCL-like, with the
    300 s collective timeout); every rank creates every group, in one order."""
    _, _, pipelines, replicas = _layout(rank, parallel)
    backend = nccl_like_collectives.BACKEND if kind == "nccl-like" else "gloo"
    if kind == "nccl-like":
        nccl_like_collectives.register()
    pp = [dist.new_group(ranks) for ranks in pipelines]
    rep = [dist.new_group(ranks, backend=backend, timeout=COLLECTIVE_TIMEOUT) for ranks in replicas]
    return (next(g for g, r in zip(pp, pipelines) if rank in r),
            next(g for g, r in zip(rep, replicas) if rank in r))


def _say_when_reducing(key: str) -> None:
    """From now on, this rank's stages say ``key`` in the test store as they start their
    gradient reduction (a data-parallel collective)."""
    from rrfp.runtime.data_parallel import DataParallel

    reduce = DataParallel.reduce

    def reducing(self, stage, **kwargs):
        _test_store().set(key, "1")
        return reduce(self, stage, **kwargs)

    DataParallel.reduce = reducing


def job_failure(rank: int, world_size: int, kind: str, parallel: str, how: str,
                stall_timeout: float, folder: str) -> dict:
    """PP 2 x DP 2 or PP 2 x TP 2 (``parallel``), 1F1B over 4 microbatches, on gloo or on
    NCCL-like channels and groups (``kind``). On gloo, and on NCCL-like groups with data
    parallelism, the stages run on the host: a rank blocked in a collective blocks its step
    loop (on NCCL-like groups as a host blocks at a CUDA synchronization behind a hung
    NCCL kernel; their abort is local, so only the rank's own watch can release it). With
    tensor parallelism on NCCL-like groups they run on the emulated asynchronous device:
    its thread blocks, as a CUDA stream would, and the step loop goes on. Step 1 runs; in
    step 2 global rank 0's forward of microbatch 2 strikes (``how``: raises, or SIGKILLs
    its process) once the other ranks are blocked in collectives that need rank 0's
    pipeline: DP, the other pipeline's gradient reductions; TP, its TP peer's forward
    all-reduce. Each rank returns what it raised and when; a hang report goes to
    ``folder``."""
    pp, replica, pipelines, _ = _layout(rank, parallel)
    channels = channels_for(kind)
    pp_group, replica_group = _groups(rank, parallel, kind)
    torch.manual_seed(0)
    chain = [MLPBlock().double() for _ in range(2)]
    x, y = make_batch(M, seed=1 + replica if parallel == "dp" else 1)
    if parallel == "dp":  # rank 0 strikes once the other pipeline reduces its gradients
        waits, say = [f"reducing/{r}" for r in pipelines[1]], None
    else:  # rank 0 strikes once its TP peer runs the same forward
        waits, say = ["forward/1"], "forward/1" if rank == 1 else None
    wrapper = WRAPPERS[(parallel, kind)]
    block = copy.deepcopy(chain[pp])
    if parallel == "dp":
        strike = Strike(block, how if rank == 0 else None, 3, waits, say)
        module = _replicated(strike, wrapper, replica_group)
    else:
        strike = module = Strike(_replicated(block, wrapper, replica_group),
                                 how if rank == 0 else None, 3, waits, say)
    stage = PipelineStage(module, pp, 2, torch.device("cpu"), group=pp_group)
    schedule = StudySchedule(stage, M, loss_fn=loss_fn, hint="1F1B",
                             coordination_group=replica_group if parallel == "tp" else None,
                             settings=Settings(stall_timeout=stall_timeout, report_folder=folder),
                             study=Study(device=EmulatedDevice()
                                         if (kind, parallel) == ("nccl-like", "tp") else None,
                                         channels=channels))
    run_steps(schedule, [stage], [strike], x, y, 1)
    strike.calls, strike.armed = 0, True  # the third forward of step 2: microbatch 2
    if parallel == "dp" and rank in pipelines[1]:
        _say_when_reducing(f"reducing/{rank}")
    error, failed_rank = None, None
    try:
        run_steps(schedule, [stage], [strike], x, y, 1)
    except Exception as e:
        error, failed_rank = error_chain(e), getattr(e, "failed_rank", None)
    raised_at = time.time()
    store = _test_store()
    struck_at = float(store.get("struck").decode())
    # No process ends before every living rank has raised: an ending process closes its
    # gloo connections, which would release its peers whatever rrfp did.
    store.set(f"raised/{rank}", "1")
    _wait_for(store, [f"raised/{r}" for r in range(world_size) if r or how != "kill"])
    return {"error": error, "failed_rank": failed_rank, "raised_at": raised_at,
            "struck_at": struck_at, "threads": rrfp_threads()}


def planted_stall(rank: int, world_size: int, folder: str) -> dict:
    """1F1B over a pipeline of ``world_size`` ranks, one stage each, ``stall_timeout``
    5 s (a loaded machine may take 2 s over a first step's set-up); global rank 1 never
    sends its activation of microbatch 1 to stage 2. Each rank returns what it raised; the
    hang report goes to ``folder``."""
    if rank == 1:
        send = Transport.send

        def dropping(self, edge, microbatch, tensors, *, header=False):
            if (edge.src, edge.dst, microbatch) == (1, 2, 1):
                return None
            return send(self, edge, microbatch, tensors, header=header)

        Transport.send = dropping
    chain = make_chain(world_size)
    x, y = make_batch(M)
    stage = PipelineStage(copy.deepcopy(chain[rank]), rank, world_size, torch.device("cpu"))
    schedule = ScheduleRRFP(stage, M, loss_fn=loss_fn, hint="1F1B",
                            settings=Settings(stall_timeout=5.0, report_folder=folder))
    start = time.perf_counter()
    try:
        run_steps(schedule, [stage], [stage.submod], x, y, 1)
        error = None
    except Exception as e:
        error = error_chain(e)
    return {"error": error, "elapsed": time.perf_counter() - start, "threads": rrfp_threads()}


def settings_disagree(rank: int, world_size: int, setting: str) -> dict:
    """PP 2 x DP 2 (DDP, gloo): the second pipeline (global ranks 2 and 3) is given another
    ``setting`` (``"hint"``: GPipe instead of 1F1B; ``"buffer_limit"``: hint+1). Each rank
    returns the error its ScheduleRRFP raised and whether any step ran."""
    pp, replica, _, _ = _layout(rank, "dp")
    pp_group, replica_group = _groups(rank, "dp", "gloo")
    chain = make_chain(2)
    module = _replicated(copy.deepcopy(chain[pp]), "ddp", replica_group)
    stage = PipelineStage(module, pp, 2, torch.device("cpu"), group=pp_group)
    settings = {"hint": "1F1B", "buffer_limit": "hint"}
    if replica == 1:
        settings[setting] = {"hint": "GPipe", "buffer_limit": "hint+1"}[setting]
    try:
        ScheduleRRFP(stage, M, loss_fn=loss_fn, hint=settings["hint"],
                     settings=Settings(stall_timeout=60, buffer_limit=settings["buffer_limit"]))
    except ValueError as e:
        return {"error": str(e), "threads": rrfp_threads()}
    return {"error": None}


SCENARIOS = [("gloo", "dp"), ("nccl-like", "dp")]
"""In the default run: PP 2 x FSDP 2 on gloo, PP 2 x DDP 2 on NCCL-like groups (the host
blocked in the collective: only the rank's own watch releases it)."""
MORE = [("gloo", "tp"), ("nccl-like", "tp")]
"""PP 2 x DTensor TP 2 on gloo, PP 2 x hand-made TP 2 on NCCL-like groups (the emulated
device blocked in the collective): ``-m job``."""


def _check_every_rank_names_rank_0(ranks: list[dict], bound: float) -> None:
    own = ranks[0]
    assert "forward failed on purpose" in own["error"], own["error"]
    for rank, result in enumerate(ranks[1:], start=1):
        error = result["error"]
        assert error is not None and error.startswith("PeerFailedError"), (rank, error)
        assert result["failed_rank"] == 0, (rank, error)
        # The first failed rank, the action it ran (its stage) and the cause.
        assert "(global rank 0) failed its step in stage 0 F microbatch 2" in error, error
        assert "forward failed on purpose" in error, error
        assert result["raised_at"] - result["struck_at"] < bound, (rank, result)
    for rank, result in enumerate(ranks):
        assert result["threads"] == [], (rank, result["threads"])


def _failure(kind: str, parallel: str, folder) -> None:
    """``stall_timeout`` and the collective timeout 300 s; the other pipeline's ranks are
    blocked in collectives when rank 0 fails: every rank raises within 5 s naming it."""
    ranks = run_local_world(4, job_failure, kind, parallel, "raise", 300.0, str(folder),
                            timeout=240)
    _check_every_rank_names_rank_0(ranks, bound=5.0)
    assert list(folder.iterdir()) == []  # a failure, not a stall: no hang report


@pytest.mark.parametrize("kind,parallel", SCENARIOS)
def test_a_failure_in_one_pipeline_makes_every_rank_of_the_job_raise_naming_it(
        kind, parallel, tmp_path):
    _failure(kind, parallel, tmp_path)


@pytest.mark.job
@pytest.mark.parametrize("kind,parallel", MORE)
def test_a_failure_reaches_the_replicas_on_the_other_parallelisms(kind, parallel, tmp_path):
    _failure(kind, parallel, tmp_path)


@pytest.mark.job
@pytest.mark.parametrize("kind,parallel", SCENARIOS + MORE)
def test_a_rank_killed_mid_step_makes_every_other_rank_raise_never_hang(
        kind, parallel, tmp_path):
    """Global rank 0 is SIGKILLed where the previous test makes it raise: nothing is
    published. On gloo its closed connections fail its peers at once; on NCCL-like
    channels its pipeline peer stalls (``stall_timeout`` 5 s) and says so; every other
    rank learns it from the board. The rank that reports the stall first waits for the
    others' states (at most ``HANG_REPORT_WAIT_S``), and names the dead rank silent."""
    stall = 5.0
    ranks = run_local_world(4, job_failure, kind, parallel, "kill", stall, str(tmp_path),
                            timeout=240, may_die={0})
    assert ranks[0] is None
    survivors = ranks[1:]
    waited = [r["raised_at"] - r["struck_at"] for r in survivors]
    # A loaded machine (load 11 here) detects the stall up to ~1.2 s late, and tells the
    # others up to ~0.6 s after that.
    late = 2.5
    assert all(w < stall + HANG_REPORT_WAIT_S + late for w in waited), waited
    assert sorted(waited)[-2] < stall + late, waited  # all but the reporter without its wait
    for result in survivors:
        assert result["error"] is not None and result["threads"] == [], result
    if kind == "nccl-like":
        (report,) = list(tmp_path.iterdir())
        text = report.read_text()
        assert text.startswith("rrfp hang report: global rank 0 on channel 0->1 holds the "
                               "others: it said nothing (silent"), text
        assert "3 of 4 ranks told their state; silent (said nothing within the report's " \
               "wait): [0]" in text, text


def test_a_planted_stall_gives_one_report_naming_the_rank_and_channel_that_hold_the_others(
        tmp_path):
    """A pipeline of 4; global rank 1 never sends its activation of microbatch 1 to stage
    2. Every rank stalls or learns of the stall; exactly one report is written, by the
    first rank to stall, and the others' errors point at it."""
    ranks = run_local_world(4, planted_stall, str(tmp_path), timeout=120)
    (report,) = list(tmp_path.iterdir())
    first = report.read_text().splitlines()[0]
    assert first.startswith("rrfp hang report: global rank 1 on channel 1->2 holds the others: "
                            "it ran stage 1 F microbatch 1 but never sent microbatch 1"), first
    assert "4 of 4 ranks told their state; silent (said nothing within the report's wait): none" \
        in report.read_text()
    for rank, result in enumerate(ranks):
        assert "PipelineStallError" in result["error"], result["error"]
        assert f"hang report: {report}" in result["error"], (rank, result["error"])
        assert result["threads"] == []


@pytest.mark.parametrize("setting,message", [
    ("hint", r"hint is 1F1B \(orders \w+\) on global ranks 0-1 but GPipe \(orders \w+\) on "
             r"global ranks 2-3"),
    ("buffer_limit", r"buffer_limit is 'hint' on global ranks 0-1 but 'hint\+1' on global "
                     r"ranks 2-3")])
def test_ranks_that_disagree_on_the_hint_or_the_limit_are_refused_on_every_rank(setting, message):
    """PP 2 x DP 2, the second pipeline given another setting (a TOML edited on one node):
    every rank's ScheduleRRFP refuses with the same message, before any channel or step."""
    ranks = run_local_world(4, settings_disagree, setting, timeout=120)
    errors = {result["error"] for result in ranks}
    assert len(errors) == 1, errors
    (error,) = errors
    assert error is not None and re.search(message, error), error
    assert error.startswith("the ranks of this job disagree on RRFP's settings")
    assert all(result["threads"] == [] for result in ranks)


def _state(rank: int, waits=(), channels=None, completed=(), on_device=()) -> dict:
    return {"rank": rank, "pipeline_rank": rank, "stages": [rank], "step": 0, "host": "h",
            "pid": 1, "in_step": True, "error": "", "launched": 1, "actions": 2,
            "last_launched": None, "last_completed": None, "completed": list(completed),
            "on_device": list(on_device), "ready": [], "waits": list(waits),
            "channels": channels or {}}


def _wait(action: str, peer: int, channel: str, mb: int) -> dict:
    src = int(channel.split("->")[0])
    kind = "F" if int(channel.split("->")[1]) > src else "B"
    return {"action": action, "reason": "its input", "peer": peer, "channel": channel,
            "microbatch": mb, "producer": f"stage {src} {kind} microbatch {mb}"}


def test_the_holder_is_the_silent_rank_the_waits_lead_to_before_a_cycle_among_the_others():
    """Ranks 1 and 2 wait on each other (neither produced); rank 3 waits on rank 0, which
    said nothing: the silent rank is named, with the channel rank 3 waits on."""
    states = {
        1: _state(1, [_wait("stage 1 B microbatch 0", 2, "2->1", 0)]),
        2: _state(2, [_wait("stage 2 F microbatch 0", 1, "1->2", 0)]),
        3: _state(3, [_wait("stage 3 F microbatch 0", 0, "0->3", 0)]),
    }
    holder, led = find_holder(states, [0, 1, 2, 3])
    assert (holder.rank, holder.channel, holder.kind, led) == (0, "0->3", SILENT, [3])
    text = report_text(states, [0, 1, 2, 3], reporter=1, job="attempt-0-job-0")
    assert text.splitlines()[0].startswith("rrfp hang report: global rank 0 on channel 0->3 "
                                           "holds the others: it said nothing (silent")
    assert "3 of 4 ranks told their state; silent (said nothing within the report's wait): [0]" \
        in text


def test_a_message_sent_and_never_received_names_its_sender_and_channel():
    states = {
        0: _state(0, channels={"0->1": {"peer": 1, "receives": False, "sent": [0, 1],
                                        "arrived": [], "outstanding": []}},
                  completed=["stage 0 F microbatch 0", "stage 0 F microbatch 1"]),
        1: _state(1, [_wait("stage 1 F microbatch 1", 0, "0->1", 1)],
                  channels={"0->1": {"peer": 0, "receives": True, "sent": [],
                                     "arrived": [0], "outstanding": [1]}}),
    }
    holder, led = find_holder(states, [0, 1])
    assert (holder.rank, holder.channel, holder.kind, led) == (0, "0->1", UNSENT, [1])
    assert "it sent microbatch 1, which never arrived" in holder.why


def test_settings_are_compared_over_every_rank_of_the_job():
    """Ranks' settings as they said them in the store (ranks 1 and 2 said theirs before
    rank 0): one message naming each setting that differs and who holds which value."""
    store = dist.HashStore()
    job = JobScope("rrfp/attempt-0/job/0/", store, (0, 1, 2))
    store.set("settings/1", '{"buffer_limit": "\'hint\'", "policy": "None"}')
    store.set("settings/2", '{"buffer_limit": "\'hint+2\'", "policy": "None"}')
    with pytest.raises(ValueError, match=r"buffer_limit is 'hint' on global ranks 0-1 but "
                                         r"'hint\+2' on global ranks 2\. Give every rank"):
        agree_on_settings(job, {"buffer_limit": "'hint'", "policy": "None"}, timeout=5)
    agree_on_settings(JobScope("p/", dist.HashStore(), (0,)), {"a": "1"}, timeout=5)  # alone
    with pytest.raises(PipelineStallError,
                       match=r"global ranks \[1\] of the job did not say 'settings'"):
        agree_on_settings(JobScope("p/", dist.HashStore(), (0, 1)), {"a": "1"}, timeout=0.5)
