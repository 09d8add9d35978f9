"""The transport alone: closing, failure, streams, NCCL settings (in one process), and the
channels' connection order (in a world of 2 ranks).

NCCL's behaviour comes from ``rrfp.testing.nccl_like`` (channels over a store with NCCL's
completion and abort semantics) and from recording fakes of the CUDA stream API and of
``ProcessGroupNCCL``, written against torch 2.13's source (there is no GPU here).
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import threading
import time
import weakref

import pytest
import torch
import torch.distributed as dist

from rrfp import Settings
from rrfp.comm import channels as channels_module
from rrfp.comm.board import FailureBoard
from rrfp.comm.channels import Channel, ChannelMap, make_channel_group
from rrfp.comm.transport import Transport
from rrfp.core.actions import Edge
from rrfp.core.errors import PeerFailedError
from rrfp.core.wakeup import Wakeup
from rrfp.devices.platform import ReceiveStreams
from rrfp.testing import nccl_like
from rrfp.testing.chains import (bitwise_equal, build_stages, loss_fn, make_batch, make_chain,
                                 run_steps, torch_schedule)
from rrfp.testing.emulation import EmulatedDevice
from rrfp.testing.probes import error_chain
from rrfp.testing.study import Study, StudySchedule
from rrfp.testing.worlds import run_local_world


def _pair(store: dist.Store, edge: Edge, **fake) -> tuple[Channel, Channel]:
    """Both ends of one NCCL-like channel, in this process (global ranks 0 -> 1)."""
    prefix = dist.PrefixStore(f"{edge.src}-{edge.dst}/", store)
    return (Channel(edge, 0, 1, 0, "nccl", nccl_like.StoreP2PGroup(prefix, 0, **fake)),
            Channel(edge, 0, 1, 1, "nccl", nccl_like.StoreP2PGroup(prefix, 1, **fake)))


def _transport(channels: list[Channel]) -> Transport:
    return Transport(ChannelMap({c.edge: c for c in channels}), Wakeup(), FailureBoard(None, 0))


def _sequential_abort(channels: list[Channel]) -> None:
    """What ``Transport.close`` did before: each channel's abort, one after another."""
    for channel in channels:
        channel.abort()


def test_aborts_that_block_on_each_other_hang_in_sequence_and_finish_concurrently():
    """An abort that blocks while another communicator has a pending receive (as an
    ``ncclCommAbort`` can): aborting one channel after the other never ends; the
    transport aborts them all at once, within its bound."""
    store = dist.HashStore()
    old = [_pair(store, Edge(0, 1), blocking_abort=True)[1],
           _pair(dist.PrefixStore("b/", store), Edge(2, 1), blocking_abort=True)[1]]
    for channel in old:
        channel.recv(torch.zeros(2))  # a receive the peer never answers
    hung = threading.Thread(target=_sequential_abort, args=(old,), daemon=True)
    hung.start()
    hung.join(2.0)
    assert hung.is_alive(), "the sequential abort should block on the other pending receive"
    old[1].group.abort()  # let it go, so that its group leaves the pending set
    hung.join(10.0)
    assert not hung.is_alive()

    ends = [_pair(dist.PrefixStore("c/", store), Edge(0, 1), blocking_abort=True)[1],
            _pair(dist.PrefixStore("d/", store), Edge(2, 1), blocking_abort=True)[1]]
    transport = _transport(ends)
    for channel in ends:
        transport.post_receive(channel.edge, 0, [torch.zeros(2)])
    alive: list = [None]
    closing = threading.Thread(target=lambda: alive.__setitem__(
        0, transport.close(timeout=30.0, failed=True)), daemon=True)
    closing.start()
    closing.join(60.0)  # its own bound is 30 s; the fakes' aborts take milliseconds
    assert not closing.is_alive(), "the transport's close hung"
    assert alive[0] == []
    assert all(c.group.aborts == 1 and c.group.shutdowns == 0 for c in ends)


def test_a_healthy_close_completes_the_sends_in_flight_before_shutting_down():
    store = dist.HashStore()
    producer, consumer = _pair(store, Edge(0, 1))
    transport = _transport([producer])
    transport.send(Edge(0, 1), 0, [torch.arange(4.0)])
    transport.finish_sends(300.0)  # NCCL: stream-ordered; the send is still in flight
    assert not producer.group.aborted
    received = torch.zeros(4)
    threading.Timer(0.3, lambda: consumer.recv(received)).start()
    assert transport.close(timeout=10.0, send_timeout=300.0) == []
    assert producer.group.shutdowns == 1 and producer.group.aborts == 0
    deadline = time.perf_counter() + 30
    while not torch.equal(received, torch.arange(4.0)) and time.perf_counter() < deadline:
        time.sleep(0.01)
    assert torch.equal(received, torch.arange(4.0)), "the message was dropped"


def _open_sockets() -> int:
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the listing's own descriptor, closed by now
            pass
    return sum(target.startswith("socket:") for target in fds)


def test_a_closed_transport_lets_its_channels_groups_go():
    """Once closed with no thread left, the transport holds no channel: a real gloo
    channel's group is destroyed on the closing thread and its connection closes then,
    not whenever the interpreter frees it at exit."""
    store, edge = dist.HashStore(), Edge(0, 1)
    groups: list = [None, None]

    def connect(rank: int) -> None:
        groups[rank] = make_channel_group("gloo", store, rank, datetime.timedelta(seconds=60))
    joining = [threading.Thread(target=connect, args=(rank,)) for rank in (0, 1)]
    for thread in joining:
        thread.start()
    for thread in joining:
        thread.join(60.0)
    transport = _transport([Channel(edge, 0, 1, 0, "gloo", groups[0])])
    consumer = Channel(edge, 0, 1, 1, "gloo", groups[1])
    producer_group = weakref.ref(groups[0])
    groups[0] = None
    transport.send(edge, 0, [torch.arange(4.0)])
    received = torch.zeros(4)
    consumer.recv(received).wait()
    transport.finish_sends(60.0)
    assert torch.equal(received, torch.arange(4.0))
    sockets = _open_sockets()
    assert transport.close(timeout=10.0, send_timeout=60.0) == []
    assert producer_group() is None, "the closed transport still holds its channel's group"
    # The producer's end closes at once (the consumer's, on gloo's I/O thread, soon after).
    assert _open_sockets() <= sockets - 1, "the producer's connection is still open"


def test_a_healthy_close_whose_send_does_not_complete_aborts_and_says_which():
    producer, _ = _pair(dist.HashStore(), Edge(0, 1))
    transport = _transport([producer])
    transport.send(Edge(0, 1), 3, [torch.ones(2)])
    with pytest.raises(RuntimeError, match=r"the send of microbatch 3 on channel 0->1 "
                                           r"\(global rank 0 -> 1\) did not complete"):
        transport.close(timeout=10.0, send_timeout=0.5)
    assert producer.group.aborts == 1 and producer.group.shutdowns == 0


def test_a_closed_delayed_sender_issues_none_of_the_messages_it_still_held():
    """Emulated link latency: a message held when its sender closes (after a failure) is
    never sent, so that a rank that said it stopped sending does not send."""
    from rrfp.comm.link_latency import DelayedSender

    sent, watched = [], []

    class Recording:
        edge = Edge(0, 1)

        def send(self, tensor):
            sent.append(time.perf_counter())
            return None

    class Watcher:
        def watch(self, edge, microbatch, works, tensors):
            watched.append(microbatch)

    sender = DelayedSender(Recording(), Watcher())
    sender.submit(0, [torch.ones(2)], 0.0)
    sender.drain(time.perf_counter() + 10)
    sender.submit(1, [torch.ones(2)], 0.3)
    time.sleep(0.05)  # the thread holds microbatch 1 now
    sender.close()
    sender.thread.join(10.0)
    assert not sender.thread.is_alive()
    assert len(sent) == 1 and watched == [0]


def test_a_send_whose_work_completed_with_an_error_raises_naming_its_channel():
    producer, consumer = _pair(dist.HashStore(), Edge(0, 1), fail_send_at=0)
    transport = _transport([producer])
    producer.send(torch.zeros(1))  # the connection's token: message 0 comes after it
    transport.send(Edge(0, 1), 5, [torch.ones(2)])
    with pytest.raises(RuntimeError, match=r"the send of microbatch 5 on channel 0->1 "
                                           r"\(global rank 0 -> 1\) failed: .*planted"):
        for _ in range(1000):
            transport.collect()
            time.sleep(0.005)
    transport.close(timeout=10.0, failed=True)


def test_the_failure_board_keeps_the_first_failure_and_reads_the_store_at_its_interval():
    store = dist.HashStore()
    now = [0.0]
    first, second = FailureBoard(store, 3), FailureBoard(store, 5)
    watcher = FailureBoard(store, 7, interval=0.1, clock=lambda: now[0])
    watcher.check()  # reads: nothing yet
    first.publish("rank 3 failed its step: boom")
    second.publish("rank 5 failed its step: later")
    now[0] = 0.05
    watcher.check()  # within the interval: not read again
    now[0] = 0.1
    with pytest.raises(PeerFailedError, match="global rank 3 of the pipeline failed: rank 3 "
                                              "failed its step: boom") as info:
        watcher.check()
    assert info.value.failed_rank == 3
    first.check(force=True)  # its own failure is not a peer's
    with pytest.raises(PeerFailedError):
        second.check(force=True)


def test_stopping_to_send_waits_for_the_peers_that_say_so_and_no_longer_than_its_bound(caplog):
    store = dist.HashStore()
    quick, slow = FailureBoard(store, 0, (0, 1, 2)), FailureBoard(store, 1, (0, 1, 2))
    said_at = []

    def slow_says() -> None:
        said_at.append(time.perf_counter())
        slow.stop_sending([0], 30.0)

    threading.Timer(0.3, slow_says).start()
    start = time.perf_counter()
    quick.stop_sending([1], 30.0)
    returned = time.perf_counter()
    # Until rank 1 said it (an order, not a timer's exact delay), not its 30 s bound.
    assert said_at and said_at[0] <= returned < start + 10.0, (said_at, start, returned)
    start = time.perf_counter()
    with caplog.at_level("WARNING", logger="rrfp.comm.board"):
        quick.stop_sending([1, 2], 0.5)  # rank 2 never says it
    assert 0.5 <= time.perf_counter() - start < 10.0
    assert "global ranks [2] did not say within 0.5 s" in caplog.text


class _Stream:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


class RecordingCuda:
    """The part of ``torch.cuda`` the transport uses: streams, the current stream, and a
    record of what happened under which current stream."""

    def __init__(self):
        self.compute = _Stream("compute")
        self.current = self.compute
        self.log: list[tuple[str, str]] = []
        self.streams: list[_Stream] = []
        self.priorities: list[int] = []

    def Stream(self, device, priority=0):
        stream = _Stream(f"side{len(self.streams)}")
        self.priorities.append(priority)
        self.streams.append(stream)
        return stream

    def current_stream(self, device=None):
        return self.current

    def stream(self, stream):
        cuda = self

        class _Guard:
            def __enter__(self):
                self.saved, cuda.current = cuda.current, stream

            def __exit__(self, *exc):
                cuda.current = self.saved

        return _Guard()


class _Buffer:
    def __init__(self, cuda: RecordingCuda, shape):
        self.cuda, self.shape, self.recorded = cuda, shape, []
        cuda.log.append(("allocate", cuda.current.name))

    def record_stream(self, stream):
        self.recorded.append(stream.name)


class _RecordingGroup:
    def __init__(self, cuda: RecordingCuda):
        self.cuda = cuda

    def recv(self, tensors, peer, tag):
        self.cuda.log.append(("recv", self.cuda.current.name))
        return nccl_like.FakeWork("recv")


def test_receives_and_their_buffers_are_posted_under_a_side_stream_not_the_compute_stream():
    """NCCL's stream waits for the caller's current stream when a receive is posted: under
    the compute stream, a receive would wait for all compute queued so far."""
    cuda = RecordingCuda()
    streams = ReceiveStreams(torch.device("cuda", 0), cuda=cuda,
                             empty=lambda shape, **kw: _Buffer(cuda, shape))
    edge = Edge(0, 1)
    transport = Transport(ChannelMap({edge: Channel(edge, 0, 1, 1, "nccl",
                                                    _RecordingGroup(cuda))}), Wakeup(),
                          FailureBoard(None, 0), receive_streams=streams)
    template = torch.zeros(1)
    buffers = [transport.receive_buffer(torch.Size([4, 2]), template) for _ in range(2)]
    transport.post_receive(edge, 0, buffers)
    transport.post_receive(edge, 1, [torch.zeros(1)])
    assert cuda.current is cuda.compute  # restored after each
    (side,) = cuda.streams
    assert cuda.priorities == [-1]  # not from the pool NCCL's communicators draw from
    assert cuda.log == [("allocate", side.name)] * 2 + [("recv", side.name)] * 3
    # The compute stream reads them once their receives completed: not reused before.
    assert all(b.recorded == ["compute"] for b in buffers)


def test_cpu_receives_use_no_stream():
    streams = ReceiveStreams(torch.device("cpu"))
    assert streams.side is None
    with streams.posting():
        pass
    assert streams.empty(torch.Size([2]), torch.float32, torch.device("cpu")).shape == (2,)


class _RecordingNCCL:
    """Stands in for ``dist.ProcessGroupNCCL`` (absent from a CPU build): records the
    environment and options a channel group is constructed with."""

    made: list[dict] = []

    class Options:
        def __init__(self):
            self._timeout = None
            self.group_name = ""
            self.global_ranks_in_group = []

    def __init__(self, store, rank, size, options):
        _RecordingNCCL.made.append({
            "handling": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"),
            "name": options.group_name, "ranks": list(options.global_ranks_in_group),
            "timeout": options._timeout})


class _Group:
    class BackendType:
        NCCL = "nccl"

    def __init__(self, *args):
        self.names: list[str] = []

    def _set_default_backend(self, backend_type):
        pass

    def _register_backend(self, device, backend_type, backend):
        pass

    def _set_group_name(self, name):
        self.names.append(name)


@pytest.mark.parametrize("preset", [None, "3"])
def test_nccl_channels_are_named_and_built_with_recoverable_error_handling(monkeypatch, preset):
    """torch reads ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` in the group's constructor; its
    default (3) makes the watchdog end the process on a channel error. rrfp builds its
    channels with 0 unless the user chose a value, and leaves the variable as it was."""
    _RecordingNCCL.made.clear()
    monkeypatch.setattr(dist, "ProcessGroupNCCL", _RecordingNCCL, raising=False)
    monkeypatch.setattr(dist, "ProcessGroup", _Group)
    for name in channels_module.ASYNC_ERROR_HANDLING:
        monkeypatch.delenv(name, raising=False)
    if preset is not None:
        monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", preset)
    group = make_channel_group("nccl", dist.HashStore(), 0, datetime.timedelta(seconds=7),
                               group_name="rrfp/0-1/0/0-1", global_ranks=(4, 5))
    (made,) = _RecordingNCCL.made
    assert made == {"handling": "0" if preset is None else preset, "name": "rrfp/0-1/0/0-1",
                    "ranks": [4, 5], "timeout": datetime.timedelta(seconds=7)}
    assert group.names == ["rrfp/0-1/0/0-1"]
    assert os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING") == preset


def test_gloo_channels_carry_their_name():
    # A 2-rank gloo group needs its peer to connect: build both ends on threads.
    store, groups = dist.HashStore(), [None, None]

    def build(rank):
        groups[rank] = make_channel_group("gloo", store, rank, datetime.timedelta(seconds=30),
                                          group_name="rrfp/0-1/0/0-1", global_ranks=(0, 1))

    threads = [threading.Thread(target=build, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(g.group_name == "rrfp/0-1/0/0-1" for g in groups)


def _gloo_io_threads() -> int:
    """gloo transport devices alive in this process: each runs one ``gloo_tcp_loop`` thread."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                names.append(comm.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return names.count("gloo_tcp_loop")


_MAKE_CHANNELS = """
import datetime, os, sys, threading, time
import torch.distributed as dist
from rrfp.comm.channels import make_channel_group
from tests.test_transport import _gloo_io_threads
if sys.argv[1] == "world":
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    deadline = time.monotonic() + 30
    while _gloo_io_threads() < 1 and time.monotonic() < deadline:
        time.sleep(0.01)  # a gloo I/O thread names itself once it runs
else:  # widen the window in which the channels' threads all ask for rrfp's device
    make_device = dist.ProcessGroupGloo.create_default_device
    def slow_device(*args, **kwargs):
        time.sleep(0.2)
        return make_device(*args, **kwargs)
    dist.ProcessGroupGloo.create_default_device = slow_device
before, store, groups = _gloo_io_threads(), dist.HashStore(), {}
def build(rank, channel):
    groups[rank, channel] = make_channel_group(
        "gloo", dist.PrefixStore(f"{channel}/", store), rank, datetime.timedelta(seconds=30))
threads = [threading.Thread(target=build, args=(r, c)) for r in (0, 1) for c in range(3)]
for t in threads:
    t.start()
for t in threads:
    t.join(60)
assert len(groups) == 6
for channel in range(3):  # each channel carries its own messages
    import torch
    sent, received = torch.full((4,), float(channel)), torch.zeros(4)
    works = [groups[0, channel].send([sent], 1, 0), groups[1, channel].recv([received], 0, 0)]
    for work in works:
        work.wait(datetime.timedelta(seconds=30))
    assert torch.equal(received, sent)
print(_gloo_io_threads() - before)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
@pytest.mark.parametrize("world, io_threads", [("world", 0), ("alone", 1)])
def test_gloo_channels_add_at_most_one_io_thread(world, io_threads):
    """gloo channels use the default group's transport device (no I/O thread of their
    own), or without a gloo default group one device of rrfp's: a device per channel ran
    an I/O thread per channel, each waking about every 10 ms to take a core from compute.
    The channels are made from six threads at once, rrfp's device made slowly, so that
    they all ask for it before it exists (only one may make it). In a fresh process, so
    that no earlier test's device is counted."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", _MAKE_CHANNELS, world], cwd=root,
                          env={**os.environ, "PYTHONPATH": root}, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) == io_threads


@pytest.mark.parametrize("knob", ["send_delay", "device"])
def test_study_knobs_are_refused_for_cuda_stages(knob):
    """A send delay's sender thread has the default stream current, not the compute
    stream: it could send an output before the compute stream wrote it; the emulated
    device runs CPU work."""
    class CudaStage:  # what the check reads of a stage, before anything else is built
        device = torch.device("cuda", 0)
        stage_index = 0

    study = (Study(send_delay=lambda edge, mb: 0.0) if knob == "send_delay"
             else Study(device=EmulatedDevice()))
    with pytest.raises(ValueError, match="the emulated device and send delays run CPU stages"):
        StudySchedule([CudaStage()], 4, study=study)


class LazilyConnectedGroup:
    """A gloo channel group that connects at its first operation, as NCCL creates a
    communicator lazily (no bound device): the first operation on the channel blocks until
    the peer's first operation on the same channel (here for at most ``timeout_s``, then
    raises: a deadlock made visible)."""

    def __init__(self, store: dist.Store, rank: int, timeout_s: float):
        self._store, self._rank, self._timeout_s = store, rank, timeout_s
        self._group: dist.ProcessGroup | None = None
        self._failed = False

    def _connected(self, tag: int) -> dist.ProcessGroup:
        if self._group is None:
            if self._failed or tag != 0:  # after a failed connection, or rrfp closing it
                raise RuntimeError("lazily connected channel was never connected")
            self._store.set(f"first-op/{self._rank}", b"1")
            try:
                self._store.wait([f"first-op/{1 - self._rank}"],
                                 datetime.timedelta(seconds=self._timeout_s))
            except RuntimeError as e:
                self._failed = True
                raise RuntimeError(f"first operation on a lazily connected channel timed out "
                                   f"after {self._timeout_s} s: the peer never used it") from e
            self._group = make_channel_group("gloo", self._store, self._rank,
                                             datetime.timedelta(seconds=60))
        return self._group

    def send(self, tensors, peer: int, tag: int) -> dist.Work:
        return self._connected(tag).send(tensors, peer, tag)

    def recv(self, tensors, peer: int, tag: int) -> dist.Work:
        return self._connected(tag).recv(tensors, peer, tag)


def lazily_connected_channels(rank: int, world_size: int, connect: bool) -> dict:
    """1F1B over channels that connect at their first operation; with or without rrfp's
    connection step (one exchange per channel, in one order, at construction)."""
    import functools

    from rrfp.comm.channels import create_channels

    def lazy(name, store, channel_rank, timeout, **naming):
        return LazilyConnectedGroup(store, channel_rank, timeout_s=3.0)

    M = 4
    chain = make_chain(world_size)
    x, y = make_batch(M)
    stages, blocks = build_stages(chain, rank, world_size, "loop")
    fixed = run_steps(torch_schedule("1F1B", stages, M), stages, blocks, x, y, 2)
    stages, blocks = build_stages(chain, rank, world_size, "loop")
    schedule = StudySchedule(stages, M, loss_fn=loss_fn, hint="1F1B",
                             settings=Settings(stall_timeout=30),
                             study=Study(channels=functools.partial(
                                 create_channels, group_factory=lazy, connect=connect)))
    start = time.perf_counter()
    try:
        history = run_steps(schedule, stages, blocks, x, y, 2)
    except Exception as e:
        return {"error": error_chain(e), "elapsed": time.perf_counter() - start}
    schedule.close()
    return {"bitwise": bitwise_equal(history, fixed), "elapsed": time.perf_counter() - start}


def test_lazily_connected_channels_deadlock_unless_connected_first():
    # Without a bound device NCCL creates a channel's communicator at its first operation
    # and blocks until the peer's first operation on it. Posting receives first deadlocks:
    # rank 0 waits on the gradient channel 1->0, rank 1 on the activation channel 0->1.
    stuck = run_local_world(2, lazily_connected_channels, False, timeout=120)
    for result in stuck:
        assert "error" in result, result
        assert "first operation on a lazily connected channel timed out" in result["error"]
        assert result["elapsed"] < 20
    # rrfp's connection step touches every channel once, in one order on every rank.
    connected = run_local_world(2, lazily_connected_channels, True, timeout=120)
    assert all(result.get("bitwise") for result in connected), connected
