"""Channels between pipeline stages: one private 2-rank group per stage edge and direction.

* **One channel per (producer stage, consumer stage, direction)**, each its own 2-rank
  communicator. NCCL matches P2P in posting order per communicator: on a shared one, a
  receive posted ahead would block later sends to the same peer (pytorch#172668). With a
  channel each, receives can be posted ahead safely. On gloo the channels use the
  default group's transport devices (``_gloo_devices``), so they add no I/O thread: a
  a device per channel would run an idle-waking thread per channel.
* **Only the two ranks of a channel create it**, under a deterministic name in the default
  store (``rrfp/<pipeline ranks>/<generation>/<edge>``, ``generation_store``, which the
  coordination groups share), so a rank's set-up cost does not grow with the number of
  pipelines, and a new schedule gets fresh channels (a new generation) that no stale
  receive of an earlier one can consume. ``dist.new_group`` would make every rank of the
  world take part in every channel's creation (and, with a bound NCCL device, run a
  world-wide communicator split for each).
* **Connected before use**: a channel's ranks exchange one message on it right after
  creating it, channel by channel in one order on every rank (``connection_order``: in
  rounds, so that different rank pairs connect in parallel). NCCL creates a
  communicator lazily at its first operation and blocks until the peer joins; if receives
  were posted first, rank 0 would wait on the gradient channel 1->0 while rank 1 waits on
  the activation channel 0->1, each touching the other only when it sends. An order
  cannot cycle.
* **Closing**: after a failure the channels are aborted *concurrently*, with a bounded
  wait (an ``ncclCommAbort`` can block while another communicator's kernel spins,
  pytorch#119797, so aborting one after another can hang); a healthy close shuts them
  down once their sends completed (``rrfp.comm.transport.Transport.close``).
* **NCCL error handling**: torch's default ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3`` makes a
  communicator error terminate the process from torch's watchdog, so a failed step could
  not be followed by a new schedule. Unless the variable is set, rrfp's NCCL channels are
  built with it at 0 (torch reads it when a group is constructed; rrfp's own failure
  protocol, ``rrfp.comm.board``, handles errors, and ``_abort_process_group``'s docstring
  asks for 0).
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rrfp.comm.store_keys import generation_store
from rrfp.comm.threads import concurrently
from rrfp.core.actions import Edge
from rrfp.core.hints import Hint

logger = logging.getLogger(__name__)

GroupFactory = Callable[..., dist.ProcessGroup]
"""``(backend name, store, rank in the channel, timeout, *, group_name, global_ranks) ->``
a 2-rank process group."""
CHANNEL_TIMEOUT = datetime.timedelta(minutes=30)
"""The channels' own timeout; ``stall_timeout`` normally reports a silent peer first."""
ASYNC_ERROR_HANDLING = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING")


@contextlib.contextmanager
def _recoverable_nccl_errors():
    """While NCCL channel groups are constructed: ``TORCH_NCCL_ASYNC_ERROR_HANDLING=0``
    unless the user set it (torch reads it in the group's constructor; its default 3
    would make the watchdog terminate the process on a channel error)."""
    if any(name in os.environ for name in ASYNC_ERROR_HANDLING):
        yield
        return
    os.environ[ASYNC_ERROR_HANDLING[0]] = "0"
    try:
        yield
    finally:
        os.environ.pop(ASYNC_ERROR_HANDLING[0], None)

def _gloo_devices() -> list[dist.ProcessGroupGloo.Device]:
    """The gloo transport devices every gloo channel of this process uses: the default
    group's when it has a gloo backend (its interfaces, e.g. ``GLOO_SOCKET_IFNAME``, and
    its I/O thread), else rrfp's own (``_own_gloo_devices``).

    A gloo device runs an I/O thread that wakes periodically even when idle; a device per
    channel (``ProcessGroupGloo``'s default) would mean one such thread per channel, each
    wake-up taking a core from a rank's compute on a host with few cores. A device serves
    every group's connections, as torch's own group serves all its peers."""
    if dist.is_initialized():
        try:
            backend = dist.distributed_c10d._get_default_group()._get_backend(
                torch.device("cpu"))
        except (RuntimeError, ValueError):  # no CPU backend (an NCCL-only default group)
            backend = None
        if isinstance(backend, dist.ProcessGroupGloo):
            return list(backend.options._devices)
    return _own_gloo_devices()


_own_devices: list[dist.ProcessGroupGloo.Device] = []
_own_devices_lock = threading.Lock()


def _own_gloo_devices() -> list[dist.ProcessGroupGloo.Device]:
    """Devices as torch's ``ProcessGroupGloo(store, rank, size, timeout)`` makes them: one
    per interface in ``GLOO_SOCKET_IFNAME``, else the default one; made once a process.
    Under a lock: channels are made from several threads at once (``concurrently``), and
    only the first call may make devices (each runs an I/O thread)."""
    with _own_devices_lock:
        if not _own_devices:
            interfaces = [i for i in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if i]
            _own_devices.extend(
                [dist.ProcessGroupGloo.create_device(interface=i) for i in interfaces]
                if interfaces else [dist.ProcessGroupGloo.create_default_device()])
        return list(_own_devices)

def make_channel_group(name: str, store: dist.Store, rank: int,
                       timeout: datetime.timedelta, *, group_name: str = "",
                       global_ranks: Sequence[int] = (), size: int = 2) -> dist.ProcessGroup:
    """A gloo or NCCL process group of ``size`` ranks (a channel's 2 by default) over
    ``store`` (all its keys are under it), created by its members alone.

    Built as ``dist.new_group`` builds one, minus the world-wide registration: a backend
    inside a ``ProcessGroup``, whose calls go through the dispatcher, so tensor subclasses
    (e.g. the ``AsyncCollectiveTensor`` a tensor-parallel layer returns) are waited for
    and unwrapped before they are sent. Named (``group_name``, and on NCCL the global
    ranks), so that Flight Recorder and NCCL's logs say which channel they mean.
    """
    group = dist.ProcessGroup(store, rank, size)
    if name == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        if group_name:
            options.group_name = group_name
        options.global_ranks_in_group = list(global_ranks)
        backend_type, device = dist.ProcessGroup.BackendType.NCCL, torch.device("cuda")
        with _recoverable_nccl_errors():
            backend = dist.ProcessGroupNCCL(store, rank, size, options)
    elif name == "gloo":
        backend_type, device = dist.ProcessGroup.BackendType.GLOO, torch.device("cpu")
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = _gloo_devices()
        backend = dist.ProcessGroupGloo(store, rank, size, options)
    else:
        raise ValueError(f"no channel backend {name!r}: rrfp channels use gloo (CPU) or "
                         "nccl (CUDA)")
    group._set_default_backend(backend_type)
    group._register_backend(device, backend_type, backend)
    if group_name:
        group._set_group_name(group_name)
    return group

_MESSAGE_TAG = 0
_CLOSE_TAG = 1  # never sent: a receive on it only serves to close a gloo connection


def break_gloo_group(group: dist.ProcessGroup, peer: int) -> None:
    """Fail every pending operation of a gloo group, here and at its other ranks.

    ``ProcessGroupGloo`` has no abort of its own (``ProcessGroup.abort`` leaves it as it
    is on torch 2.13-2.15) and cannot cancel a receive or a collective. But a receive that
    times out makes gloo signal an error to the group's whole context: every connection
    of the group at this rank closes, which fails every collective or point-to-point
    operation pending on the group, here (gloo: "Application timeout caused pair
    closure") and at each peer ("Connection closed by peer"). The group is not usable
    afterwards. ``peer``: any other rank of the group (its rank in the group)."""
    try:
        work = group.recv([torch.zeros(1)], peer, _CLOSE_TAG)
        work.wait(datetime.timedelta(milliseconds=1))
    except RuntimeError:
        pass

@dataclass(frozen=True)
class Channel:
    """One direction of one stage edge: the producer is rank 0 of its group."""

    edge: Edge
    src_rank: int
    """Global rank of the producer."""
    dst_rank: int
    """Global rank of the consumer."""
    rank: int
    """This process's rank in the channel: 0 producer, 1 consumer."""
    backend_name: str
    """``"gloo"`` or ``"nccl"``: how arrivals are detected and sends completed."""
    group: dist.ProcessGroup
    """The channel's own process group of the two ranks."""
    headers: "Channel | None" = None
    """Variable shapes on NCCL: a gloo channel of the same two ranks for the shape headers,
    so that a header is read on the host without a device-to-host copy per message."""

    def __str__(self) -> str:
        return (f"channel {self.edge.src}->{self.edge.dst} (global rank {self.src_rank} -> "
                f"{self.dst_rank})")

    def send(self, tensor: torch.Tensor) -> dist.Work:
        return self.group.send([tensor], 1, _MESSAGE_TAG)

    def recv(self, tensor: torch.Tensor) -> dist.Work:
        return self.group.recv([tensor], 0, _MESSAGE_TAG)

    def abort(self) -> None:
        """After a failure: fail every pending operation on the channel; not used again.
        NCCL: at this end only (``ncclCommAbort``); gloo: at both ends."""
        if self.headers is not None:
            self.headers.abort()
        if self.backend_name == "nccl":
            self.group.abort()
            return
        break_gloo_group(self.group, 1 - self.rank)

    def shutdown(self) -> None:
        """A healthy end: every operation on the channel has completed. NCCL: the
        communicator is shut down (not aborted); gloo: the connection goes with the group,
        untouched here (closing it would fail a peer still reading its last message)."""
        if self.backend_name == "nccl":
            self.group.shutdown()
        if self.headers is not None:
            self.headers.shutdown()

class ChannelMap(dict):
    """This rank's channels by edge, and the store prefix of their generation."""

    def __init__(self, channels: dict[Edge, Channel], store: dist.Store | None = None,
                 global_ranks: Sequence[int] = ()):
        super().__init__(channels)
        self.store = store
        """The generation's store prefix (the failure board lives under it: ``rrfp.comm.board``)."""
        self.global_ranks = tuple(global_ranks)
        """Global ranks of the pipeline, by pipeline rank."""

def create_channels(
    hint: Hint,
    pp_group: dist.ProcessGroup | None,
    device: torch.device,
    backend: str,
    *,
    group_factory: GroupFactory = make_channel_group,
    connect: bool = True,
    timeout: datetime.timedelta = CHANNEL_TIMEOUT,
    header_channels: bool = False,
) -> ChannelMap:
    """Create and connect this rank's channels: one per remote edge of the hint touching it.

    Every rank of the pipeline group calls it when it builds its schedule (each builds as
    many schedules over the group as the others); only the two ranks of a channel
    communicate to create it. ``connect=False`` skips the exchange that connects each
    channel (only to show what happens without it). ``backend``: how the channels are
    driven (``"gloo"`` or ``"nccl"``: the platform's, ``rrfp.devices.platform``); ``device``:
    where the connecting message lives.
    ``header_channels`` (variable shapes): NCCL channels get a gloo channel each for the
    shape headers (``Channel.headers``); with fixed shapes none is created.
    """
    pp_ranks = tuple(dist.get_process_group_ranks(pp_group or dist.group.WORLD))
    backend_name = backend
    prefix, base = generation_store("", pp_ranks)
    me = dist.get_rank()
    channels: dict[Edge, Channel] = {}
    for edge in connection_order(hint):
        src = pp_ranks[hint.stage_to_rank[edge.src]]
        dst = pp_ranks[hint.stage_to_rank[edge.dst]]
        if me not in (src, dst):
            continue
        store = dist.PrefixStore(f"{edge.src}-{edge.dst}/", base)
        rank = 0 if me == src else 1
        group = group_factory(backend_name, store, rank, timeout,
                              group_name=f"{prefix}{edge.src}-{edge.dst}",
                              global_ranks=(src, dst))
        headers = None
        if header_channels and backend_name == "nccl":
            # A real gloo group: its construction connects it (both ranks, in this order).
            headers = Channel(edge, src, dst, rank, "gloo", make_channel_group(
                "gloo", dist.PrefixStore("headers/", store), rank, timeout,
                group_name=f"{prefix}{edge.src}-{edge.dst}/headers", global_ranks=(src, dst)))
        channel = Channel(edge, src, dst, rank, backend_name, group, headers)
        if connect:
            _connect(channel, device, timeout)
        channels[edge] = channel
    return ChannelMap(channels, base, pp_ranks)

def connection_order(hint: Hint) -> list[Edge]:
    """The remote edges in the order every rank creates and connects its channels.

    In rounds in which no pipeline rank has two channels (a greedy edge colouring of the
    canonical edge order): channels of different rank pairs then connect in parallel,
    instead of in a chain along the pipeline (rank k would otherwise wait for rank k-1's
    earlier channels). Every rank walks the same order, so the waits cannot cycle: the
    first channel not yet connected has both its ranks waiting for it.
    """
    rounds_of: dict[int, set[int]] = {r: set() for r in range(hint.num_ranks)}
    keyed = []
    for index, edge in enumerate(hint.plan.remote_edges):
        a, b = hint.stage_to_rank[edge.src], hint.stage_to_rank[edge.dst]
        round_ = next(r for r in itertools.count() if r not in rounds_of[a] | rounds_of[b])
        rounds_of[a].add(round_)
        rounds_of[b].add(round_)
        keyed.append((round_, index, edge))
    return [edge for _, _, edge in sorted(keyed)]

def _connect(channel: Channel, device: torch.device, timeout: datetime.timedelta) -> None:
    """One message from producer to consumer, so the communicator exists before use."""
    token = torch.zeros(1, device=device)
    work = channel.send(token) if channel.rank == 0 else channel.recv(token)
    if channel.backend_name == "nccl":
        work.wait()  # communicator creation blocked the CPU; the transfer is stream-ordered
    else:
        work.wait(timeout)
