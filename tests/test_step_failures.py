"""A failed step on CPU/gloo and on NCCL-like channels: every rank raises promptly, naming
the rank that failed; nothing of the step is held afterwards; a new schedule recovers; a
clean close lets the peer finish its step (each world has a hard timeout)."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
import torch.distributed as dist

from rrfp import PipelineStallError, ScheduleRRFP, Settings
from rrfp._torch_compat import forward_states_held
from rrfp.comm.channels import create_channels, make_channel_group
from rrfp.testing.chains import (bitwise_equal, build_stages, local_stage_indices, loss_fn,
                                 make_batch, make_chain, run_steps, torch_schedule)
from rrfp.testing.emulation import EmulatedDevice, EmulatedDeviceTime
from rrfp.testing.nccl_like import channels_for
from rrfp.testing.probes import error_chain, rrfp_threads
from rrfp.testing.study import Study, StudySchedule
from rrfp.testing.worlds import run_local_world


def silent_first_rank(rank: int, world_size: int, stall_timeout: float) -> dict:
    """After one normal step, rank 0 stops stepping: every rank downstream must raise.

    (The first step's shape inference uses torch's blocking P2P, so the silence starts
    in the second step.)
    """
    chain = make_chain(world_size)
    x, y = make_batch(world_size)
    stages, blocks = build_stages(chain, rank, world_size, "loop")
    schedule = ScheduleRRFP(stages, world_size, loss_fn=loss_fn, hint="1F1B",
                            settings=Settings(stall_timeout=stall_timeout))
    run_steps(schedule, stages, blocks, x, y, steps=1)
    outcome: dict = {}
    if rank > 0:
        start = time.perf_counter()
        try:
            run_steps(schedule, stages, blocks, x, y, steps=1)
        except PipelineStallError as e:
            outcome = {"error": str(e), "elapsed": time.perf_counter() - start}
    dist.barrier()
    return outcome


def test_every_waiting_rank_raises_when_a_peer_never_sends():
    ranks = run_local_world(4, silent_first_rank, 2.0, timeout=120)
    assert ranks[0] == {}
    for rank in (1, 2, 3):
        outcome = ranks[rank]
        assert 2.0 <= outcome["elapsed"] < 15.0
        message = outcome["error"]
        assert f"pipeline rank {rank}" in message
        assert f"stage {rank} F microbatch 0" in message
        assert f"input activation from stage {rank - 1} on pipeline rank {rank - 1}" in message


class FailingLoss:
    """mse, but raises at one microbatch of one step once armed."""

    def __init__(self, fail_at_call: int):
        self.calls, self.fail_at_call, self.armed = 0, fail_at_call, False

    def __call__(self, output, target):
        self.calls += 1
        if self.armed and self.calls == self.fail_at_call:
            raise RuntimeError("loss failed on purpose")
        return loss_fn(output, target)


def receive_buffers_bound(stages) -> int:
    """Receive descriptors of the stages that still point at a buffer."""
    return sum(info.buffer is not None for stage in stages
               for infos in (*stage.args_recv_info.values(), *stage.grad_recv_info.values())
               for info in infos if not info.is_root_arg)


class HeldSends:
    """A gloo channel group whose sends, once ``armed``, deliver their data but do not
    complete until ``released`` is set: a send that gloo leaves pending (issued into a
    connection its peer has just closed, it neither completes nor fails until the
    channel's timeout), so a failed step's close finds its send thread still waiting."""

    def __init__(self, group: dist.ProcessGroup, released: threading.Event):
        self.group, self.released, self.armed = group, released, False

    def send(self, tensors, peer: int, tag: int):
        work = self.group.send(tensors, peer, tag)
        return HeldWork(work, self.released) if self.armed else work

    def __getattr__(self, name: str):
        return getattr(self.group, name)


class HeldWork:
    def __init__(self, work, released: threading.Event):
        self.work, self.released = work, released

    def is_completed(self) -> bool:
        return self.work.is_completed() and self.released.is_set()

    def wait(self, timeout=None) -> bool:
        self.work.wait()
        self.released.wait()
        return True


def channels_with_held_sends(released: threading.Event):
    """A study's channel maker (``Study(channels=...)``): rrfp's gloo channels, each
    group a ``HeldSends`` armed once the channels are connected."""
    groups: list[HeldSends] = []

    def make_group(*args, **kwargs):
        groups.append(HeldSends(make_channel_group(*args, **kwargs), released))
        return groups[-1]

    def make(hint, group, device, backend, **options):
        channels = create_channels(hint, group, device, backend, group_factory=make_group,
                                   **options)
        for held in groups:
            held.armed = True
        return channels

    return make


def split_backward_failure(rank: int, world_size: int, sends_held: bool) -> dict:
    """ZBVZeroBubble (backward split into I and W) over the emulated device; the loss of
    the third microbatch raises on the rank that holds the last stage. What each rank's
    stages still hold for unfinished microbatches once the step has failed
    (``sends_held``: every send stays pending until then, ``HeldSends``)."""
    M = 4
    chain = make_chain(2 * world_size)
    x, y = make_batch(M)
    failing_loss = FailingLoss(fail_at_call=3)
    stages, blocks = build_stages(chain, rank, world_size, "v")
    failing_loss.armed = any(stage.is_last for stage in stages)
    released = threading.Event()
    schedule = StudySchedule(stages, M, loss_fn=failing_loss, hint="ZBVZeroBubble",
                             settings=Settings(stall_timeout=30, launch_depth=1),
                             study=Study(device=EmulatedDevice(), channels=(
                                 channels_with_held_sends(released) if sends_held else None)))
    error = None
    try:
        run_steps(schedule, stages, blocks, x, y, 1)
    except Exception as e:
        error = error_chain(e)
    held = {name: sum(len(getattr(stage, name)) for stage in stages)
            for name in ("backward_state", "dw_runner", "bwd_cache")}
    held["forward_states"] = sum(forward_states_held(stage) for stage in stages)
    released.set()
    return {"error": error, "held": held, "bound": receive_buffers_bound(stages)}


@pytest.mark.parametrize("sends_held", [False, True], ids=["sends-complete", "sends-held"])
def test_a_failed_step_under_split_backward_leaves_no_unfinished_microbatch_held(sends_held):
    """With I and W split, a microbatch between its I and its W keeps its graph in the
    stage's backward state: a failed step must let go of that too, not only of the
    forward caches; also while a send of the step is still pending at close (its thread
    holds the sent data, not the stages' state)."""
    for rank, result in enumerate(run_local_world(2, split_backward_failure, sends_held,
                                                  timeout=120)):
        assert result["error"] is not None, f"rank {rank} did not fail"
        assert result["held"] == {"forward_states": 0, "backward_state": 0, "dw_runner": 0,
                                  "bwd_cache": 0}, (rank, result)
        assert result["bound"] == 0, (rank, result)


def recovers_as_gpipe(chain, snapshot, rank: int, world_size: int, M: int, x, y,
                      channels=None) -> bool:
    """Whether a new ScheduleRRFP, on fresh stages with the parameters ``snapshot`` holds
    (this rank's blocks), steps bitwise as torch's GPipe (``channels``: ``channels_for``'s
    maker; None: rrfp's own)."""
    full = list(chain)
    for s, saved in zip(local_stage_indices(rank, world_size, world_size, "loop"), snapshot):
        full[s] = saved
    stages, blocks = build_stages(full, rank, world_size, "loop")
    recovered = StudySchedule(stages, M, loss_fn=loss_fn, hint="GPipe",
                              settings=Settings(stall_timeout=300, launch_depth=1),
                              study=Study(device=EmulatedDevice(), channels=channels))
    got = run_steps(recovered, stages, blocks, x, y, 1)
    recovered.close()
    fixed_stages, fixed_blocks = build_stages(full, rank, world_size, "loop")
    expected = run_steps(torch_schedule("GPipe", fixed_stages, M), fixed_stages, fixed_blocks,
                         x, y, 1)
    return bitwise_equal(got, expected)


class ArmedThirdForward(torch.nn.Module):
    """A stage's block whose third forward, once ``armed``, first calls ``strike``."""

    def __init__(self, inner: torch.nn.Module, strike):
        super().__init__()
        self.inner, self.strike, self.calls, self.armed = inner, strike, 0, False

    def forward(self, inp):
        self.calls += 1
        if self.armed and self.calls == 3:
            self.strike()
        return self.inner(inp)


def armed_step(schedule, stages, blocks, x, y) -> tuple[str | None, float]:
    """One step with the stages' ``ArmedThirdForward`` blocks armed: the error it raised
    (with its causes), if any, and how long it took."""
    for stage in stages:
        if isinstance(stage.submod, ArmedThirdForward):
            stage.submod.calls, stage.submod.armed = 0, True
    start = time.perf_counter()
    try:
        run_steps(schedule, stages, blocks, x, y, 1)
    except Exception as e:
        return error_chain(e), time.perf_counter() - start
    return None, time.perf_counter() - start


def failure_and_recovery(rank: int, world_size: int, failing_rank: int) -> dict:
    """GPipe over the emulated device; the second step fails on ``failing_rank`` (rank 0:
    stage 0's forward of microbatch 2 raises; the last rank: its loss raises). Every rank
    must raise promptly; then each builds a new ScheduleRRFP in the same process and steps:
    bitwise what torch's GPipe computes from the same parameters."""
    M = 4
    chain = make_chain(world_size)
    x, y = make_batch(M)
    failing_loss = FailingLoss(fail_at_call=2)

    def fail():
        raise RuntimeError("forward failed on purpose")

    wrap = (lambda s, b: ArmedThirdForward(b, fail)) if rank == failing_rank == 0 else None
    stages, blocks = build_stages(chain, rank, world_size, "loop", wrap=wrap)
    schedule = StudySchedule(stages, M, loss_fn=failing_loss, hint="GPipe",
                             settings=Settings(stall_timeout=30, launch_depth=1),
                             study=Study(device=EmulatedDevice()))
    run_steps(schedule, stages, blocks, x, y, 1)
    snapshot = [copy.deepcopy(b) for b in blocks]
    failing_loss.armed, failing_loss.calls = rank == failing_rank, 0
    error, elapsed = armed_step(schedule, stages, blocks, x, y)
    threads_after_failure = rrfp_threads()
    # Microbatches forwarded but never backwarded: their graphs must not outlive the failure.
    cached_after_failure = sum(forward_states_held(stage) for stage in stages)
    bound_after_failure = receive_buffers_bound(stages)
    try:
        run_steps(schedule, stages, blocks, x, y, 1)
        refused = None
    except RuntimeError as e:
        refused = str(e)

    # A new schedule on the parameters as they were before the failed step (which ran no
    # optimizer step), on fresh stages.
    bitwise = recovers_as_gpipe(chain, snapshot, rank, world_size, M, x, y)
    return {"error": error, "elapsed": elapsed, "refused": refused,
            "threads_after_failure": threads_after_failure, "threads_at_end": rrfp_threads(),
            "cached_after_failure": cached_after_failure,
            "bound_after_failure": bound_after_failure,
            "bitwise": bitwise}


@pytest.mark.parametrize("failing_rank", [0, 1])
def test_a_failed_step_fails_every_rank_promptly_and_a_new_schedule_recovers(failing_rank):
    ranks = run_local_world(2, failure_and_recovery, failing_rank, timeout=120)
    for rank, result in enumerate(ranks):
        assert result["error"] is not None, f"rank {rank} did not fail"
        if rank == failing_rank:
            assert "failed on purpose" in result["error"], result["error"]
        else:  # told through the store, naming the failed rank, not a 30 s stall
            assert result["error"].startswith("PeerFailedError"), result["error"]
            assert f"global rank {failing_rank} of the pipeline failed" in result["error"]
        assert result["elapsed"] < 10, result
        assert "cannot run another step" in result["refused"]
        assert result["threads_after_failure"] == [], result["threads_after_failure"]
        assert result["cached_after_failure"] == 0
        assert result["bound_after_failure"] == 0, "a receive buffer stays bound to torch's infos"
        assert result["threads_at_end"] == []
        assert result["bitwise"], f"rank {rank}: the recovered step differs from torch's GPipe"


FAILED_AT: list[float] = []
"""``time.time()`` when a planted failure struck in this process."""


class ClosesCounted(EmulatedDevice):
    """The emulated device, with the timeout of each ``close`` kept in ``closes``."""

    def __init__(self) -> None:
        super().__init__()
        self.closes: list[float] = []

    def close(self, timeout: float) -> list[threading.Thread]:
        self.closes.append(timeout)
        return super().close(timeout)


def _strike(what: str):
    FAILED_AT.append(time.time())
    raise RuntimeError(f"{what} failed on purpose")


def failure_reaches_every_rank(rank: int, world_size: int, kind: str, how: str) -> dict:
    """GPipe over ``world_size`` ranks on the emulated device, ``stall_timeout`` 300 s;
    in the second step one rank fails mid-step (``how``): ``"forward"`` (rank 0, stage 0's
    forward of microbatch 2), ``"loss"`` (the last rank, microbatch 2's loss), ``"send"``
    (rank 1's second activation send: on ``"nccl-like"`` channels its work completes with
    an error, on gloo the send call raises). Channels: ``kind`` (``channels_for``). Every
    rank records what it raised and when; then each builds a new schedule in the same
    process, whose step must be bitwise torch's GPipe."""
    from rrfp.comm.channels import Channel

    M = 6
    failing = {"forward": 0, "loss": world_size - 1, "send": 1}[how]
    plant = how == "send" and rank == failing
    # The second activation of the second step (the first step sent M).
    channels = channels_for(kind, fail_send_at={(1, 2): M + 1} if plant and kind == "nccl-like"
                            else None)
    if plant and kind == "gloo":
        real_send, sent = Channel.send, []

        def send(self, tensor):
            if self.edge.src == 1 and self.edge.dst == 2 and tensor.numel() > 1:
                sent.append(1)
                if len(sent) == 2 and armed:
                    _strike("send")
            return real_send(self, tensor)

        Channel.send = send
    armed = False
    chain = make_chain(world_size)
    x, y = make_batch(M)

    class Failing(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner, self.calls = inner, 0

        def forward(self, inp):
            self.calls += 1
            if armed and self.calls == 3:
                _strike("forward")
            return self.inner(inp)

    calls = [0]

    def loss(output, target):
        calls[0] += 1
        if armed and calls[0] == 3:
            _strike("loss")
        return loss_fn(output, target)

    wrap = (lambda s, b: Failing(b)) if how == "forward" and rank == failing else None
    stages, blocks = build_stages(chain, rank, world_size, "loop", wrap=wrap)
    device = ClosesCounted()
    schedule = StudySchedule(stages, M, loss_fn=loss if how == "loss" and rank == failing
                            else loss_fn, hint="GPipe",
                             settings=Settings(stall_timeout=300, launch_depth=1),
                             study=Study(device=device, channels=channels))
    run_steps(schedule, stages, blocks, x, y, 1)
    snapshot = [copy.deepcopy(b) for b in blocks]
    armed, calls[0] = True, 0
    for stage in stages:
        if isinstance(stage.submod, Failing):
            stage.submod.calls = 0
    if plant and kind == "gloo":
        sent.clear()
    error, failed_rank = None, None
    device.closes.clear()
    try:
        run_steps(schedule, stages, blocks, x, y, 1)
    except Exception as e:
        error = error_chain(e)
        failed_rank = getattr(e, "failed_rank", None)
    raised_at = time.time()
    armed = False
    if plant and kind == "gloo":
        Channel.send = real_send
    bitwise = recovers_as_gpipe(chain, snapshot, rank, world_size, M, x, y, channels_for(kind))
    return {"error": error, "failed_rank": failed_rank, "raised_at": raised_at,
            "failed_at": FAILED_AT[0] if FAILED_AT else None,
            "bitwise": bitwise, "threads_at_end": rrfp_threads(),
            "stall_closes": device.closes.count(300)}


@pytest.mark.parametrize("how", ["forward", "loss", "send"])
@pytest.mark.parametrize("kind", ["gloo", "nccl-like"])
def test_a_rank_failing_mid_step_makes_every_rank_raise_within_2_s_naming_it(kind, how):
    """3 ranks, ``stall_timeout`` 300 s. One rank fails mid-step: a forward (rank 0), the
    loss (rank 2), a send (rank 1; on the NCCL-like channels its work completes with an
    error). Every other rank raises ``PeerFailedError`` naming it within 2 s — on gloo,
    whose closed connections would also fail the neighbours, and on channels whose abort
    does not reach the peer (``rrfp.testing.nccl_like``), where only the store tells them. Then a
    new schedule in the same process steps bitwise as torch's GPipe. A rank waits for its
    device at most once for ``stall_timeout`` (not again after a first wait)."""
    ranks = run_local_world(3, failure_reaches_every_rank, kind, how, timeout=150)
    failing = {"forward": 0, "loss": 2, "send": 1}[how]
    own = ranks[failing]
    assert own["error"] is not None and own["failed_rank"] is None, own
    assert ("failed on purpose" if kind == "gloo" or how != "send" else "planted send error") \
        in own["error"], own["error"]
    if how == "send" and kind == "nccl-like":  # a send's work that completed with an error
        assert "on channel 1->2 (global rank 1 -> 2)" in own["error"], own["error"]
    struck = own["failed_at"] or own["raised_at"]
    for rank, result in enumerate(ranks):
        assert result["bitwise"], f"rank {rank}: the new schedule's step differs from GPipe"
        assert result["threads_at_end"] == [], result["threads_at_end"]
        assert result["stall_closes"] == 1, (rank, result["stall_closes"])
        if rank == failing:
            continue
        assert result["error"].startswith("PeerFailedError"), result["error"]
        assert result["failed_rank"] == failing
        assert f"global rank {failing} of the pipeline failed" in result["error"]
        assert f"pipeline rank {rank} (global rank {rank}) stops its step" in result["error"]
        assert result["raised_at"] - struck < 2.0, (rank, result["raised_at"] - struck)


def clean_close_then_peer_steps(rank: int, world_size: int, kind: str) -> dict:
    """An eval step (forwards only) of 1F1B over 6 microbatches; rank 1's forwards are slow
    (0.2 s), so its activation ring (2 slots) has not posted the receives of the last
    microbatches when rank 0 has sent everything. Rank 0 closes its schedule right after
    its step; rank 1 must still complete its own (no message of rank 0's dropped)."""
    channels = channels_for(kind)
    M = 6
    chain = make_chain(world_size)
    x, y = make_batch(M)
    wrap = ((lambda s, b: EmulatedDeviceTime(b, M, lambda mb: 0.2, lambda mb: 0.0))
            if rank == 1 else None)
    stages, blocks = build_stages(chain, rank, world_size, "loop", wrap=wrap)
    schedule = StudySchedule(stages, M, loss_fn=loss_fn, hint="1F1B",
                             settings=Settings(stall_timeout=300, launch_depth=1),
                             study=Study(device=EmulatedDevice(), channels=channels))
    run_steps(schedule, stages, blocks, x, y, 1)  # shape inference: torch's blocking P2P
    inputs = (x,) if rank == 0 else ()
    error = None
    start = time.perf_counter()
    try:
        with torch.no_grad():
            schedule.eval(*inputs, target=y)
        if rank == 0:
            schedule.close()
    except Exception as e:
        error = error_chain(e)
    elapsed = time.perf_counter() - start
    if rank == 1:
        schedule.close()
    return {"error": error, "elapsed": elapsed}


@pytest.mark.parametrize("kind", ["gloo", "nccl-like"])
def test_after_a_clean_step_and_close_the_peer_completes_its_step(kind):
    """Rank 0 closes right after its step while its last messages still wait for rank 1's
    receives (on the NCCL-like channels its sends are then still in flight: a close that
    shut the channels down at once would drop them, and rank 1 would wait 300 s)."""
    ranks = run_local_world(2, clean_close_then_peer_steps, kind, timeout=120)
    assert ranks[0]["error"] is None and ranks[1]["error"] is None, ranks
    # Rank 0's close waited for rank 1's slow forwards to take its messages.
    assert ranks[0]["elapsed"] >= 0.2, ranks[0]


def sends_and_breaks_around_a_failure(rank: int, world_size: int) -> dict:
    """GPipe over 2 ranks on the CPU (its compute on the main thread), with an emulated
    link latency: the activation of microbatch 0 is held 0.2 s, that of microbatch 1
    0.9 s. In the second step rank 1's loss fails at once, while rank 0's main thread
    runs a 1.2 s forward (microbatch 2), so its sender thread issues microbatch 1's
    activation after rank 1's failure. Each rank records when it issued each send and
    when it broke each gloo channel (``time.time()``)."""
    import rrfp.comm.channels
    from rrfp.comm.channels import Channel

    M = 4
    chain = make_chain(world_size)
    x, y = make_batch(M)
    events: list[tuple[str, float, int, int]] = []
    real_send, real_break = Channel.send, rrfp.comm.channels.break_gloo_group

    def send(self, tensor):
        if tensor.numel() > 1:  # not the connection's token
            events.append(("send", time.time(), self.edge.src, self.edge.dst))
        return real_send(self, tensor)

    def break_group(group, peer):
        events.append(("break", time.time(), -1, -1))
        real_break(group, peer)

    failing_loss = FailingLoss(fail_at_call=1)
    wrap = (lambda s, b: ArmedThirdForward(b, lambda: time.sleep(1.2))) if rank == 0 else None
    stages, blocks = build_stages(chain, rank, world_size, "loop", wrap=wrap)
    schedule = StudySchedule(stages, M, loss_fn=failing_loss, hint="GPipe",
                             settings=Settings(stall_timeout=30),
                             study=Study(send_delay=lambda edge, mb: {0: 0.2, 1: 0.9}.get(mb, 0.0)))
    run_steps(schedule, stages, blocks, x, y, 1)
    failing_loss.armed, failing_loss.calls = rank == 1, 0
    Channel.send, rrfp.comm.channels.break_gloo_group = send, break_group
    try:
        error, elapsed = armed_step(schedule, stages, blocks, x, y)
    finally:
        Channel.send, rrfp.comm.channels.break_gloo_group = real_send, real_break
    return {"error": error, "elapsed": elapsed, "events": events,
            "threads": rrfp_threads()}


def test_no_rank_breaks_a_gloo_channel_its_peer_still_sends_on():
    """gloo leaves a send issued into a connection that its peer has just closed pending,
    neither completed nor failed, until the channel's timeout (30 min): the sender's close
    would wait for it and leave its thread behind. So a failed rank aborts its channels
    only once its peers have said they stopped sending: here rank 1 fails while rank 0
    still has a send to issue (0.7 s later); rank 1's break of their channel must come
    after it."""
    ranks = run_local_world(2, sends_and_breaks_around_a_failure, timeout=120)
    assert "loss failed on purpose" in ranks[1]["error"], ranks[1]["error"]
    assert ranks[0]["error"].startswith("PeerFailedError"), ranks[0]["error"]
    sends = [t for kind, t, src, dst in ranks[0]["events"] if kind == "send" and src == 0]
    breaks = [t for kind, t, _, _ in ranks[1]["events"] if kind == "break"]
    assert len(sends) >= 2 and breaks, ranks  # microbatches 0 and 1 at least
    assert min(breaks) > max(sends), (min(breaks) - max(sends), ranks)
    for result in ranks:
        assert result["threads"] == [] and result["elapsed"] < 10, result
