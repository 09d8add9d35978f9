"""Receive buffers in a small ring per channel, reused, instead of one per microbatch.

torch's stages allocate a receive buffer per microbatch for every input and gradient;
posting every receive at the step's start keeps all of them alive, so receive memory grows
with the number of microbatches (a user of torch's pipelining reported such buffers filling
much of the memory of middle stages of a large MoE model). Here each incoming channel owns
``size`` slots. Receives are posted in the channel's message order, each into a free slot, which is
bound to its microbatch in the stage (the stage reads its input or gradient from there). A
slot is free again once the action that last reads it has completed on the device, as
the step's plan (``rrfp.core.plan``) says:

* an activation received by stage s: its microbatch's release point on s (B, or W when
  backward is split, because autograd keeps the input for the weight gradients; in a
  forward-only step, the forward);
* a gradient received by stage s: the backward (B or I) that receives it.

An activation ring holds the stage's memory limit plus one slot: the stage holds at most
that many microbatches, so the next message in channel order (the one its forward stream
needs next) always has a slot. A gradient ring holds the memory limit: gradients only
arrive for microbatches the stage holds. So receive memory grows with the limit.

**Variable shapes.** When microbatches differ in shape, every activation message is
preceded on its channel by a small header (``shape_header``: the shape of each of its
tensors); the receiver posts the header's receive, and when it arrives allocates the
message's buffers and posts their receives, then the next header. Receives on a channel
are thus posted exactly in the order they are sent: header, message, header, ... A
gradient has the shape of the output it answers, which the receiving stage produced: its
receive is posted once that forward has completed (the executor records the shapes it
sent, ``ReceiveRings.sent``). With fixed shapes there is no header. On NCCL channels the
headers travel on a gloo side channel of the same two ranks (``Transport.header_device``
is then the host): no device-to-host copy per message.

The rings own their buffers: the slots are allocated from the stage's receive metadata, a
slot is bound to its microbatch's ``_RecvInfo`` when its receive is posted, and whatever
is still bound is unbound when the step ends or fails (``ReceiveRings.finish``), so that
no buffer of an unfinished step stays reachable from torch's descriptors (see
``rrfp._torch_compat``).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch.distributed.pipelining._utils import _make_tensor_from_meta
from torch.distributed.pipelining.stage import _DTensorMeta, _PipelineStageBase

from rrfp._torch_compat import bind_receive, unbind_receive
from rrfp.comm.transport import Received, Transport
from rrfp.core.actions import _Action, Edge, F
from rrfp.core.plan import Node, RankPlan, StepPlan
from rrfp.devices.platform import Platform

logger = logging.getLogger(__name__)

HEADER_DIMS = 8
"""Most dimensions a header describes per tensor."""


def header_size(tensors: int) -> int:
    """Elements (int64) of the header of a message of ``tensors`` tensors."""
    return 1 + tensors * (1 + HEADER_DIMS)


def shape_header(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The header sent ahead of a message: its tensors' shapes (int64, on the host; the
    platform uploads it where headers travel on the device, ``Platform.upload``)."""
    header = torch.zeros(header_size(len(tensors)), dtype=torch.int64)
    header[0] = len(tensors)
    for i, tensor in enumerate(tensors):
        if tensor.dim() > HEADER_DIMS:
            raise ValueError(f"variable shapes: a {tensor.dim()}-dimensional activation; at "
                             f"most {HEADER_DIMS} dimensions are supported")
        at = 1 + i * (1 + HEADER_DIMS)
        header[at] = tensor.dim()
        header[at + 1:at + 1 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    return header


def header_shapes(values: list[int]) -> list[torch.Size]:
    """The shapes a received header's values (``Platform.read``) describe."""
    shapes = []
    for i in range(values[0]):
        at = 1 + i * (1 + HEADER_DIMS)
        shapes.append(torch.Size(values[at + 1:at + 1 + values[at]]))
    return shapes


@dataclass
class _Ring:
    edge: Edge
    stage: _PipelineStageBase
    size: int
    variable: bool
    sent_shapes: dict[tuple[int, int], list[torch.Size]]
    """Variable shapes: the shapes each (stage, microbatch) sent downstream, which its
    gradients come back in (shared by the rank's rings, filled by the executor)."""
    slots: list[tuple[torch.Tensor | None, ...]] = field(default_factory=list)
    """Fixed shapes: the buffers of each slot. Variable shapes: one slot of dtype/device
    templates. None where the stage expects no tensor (an input without gradient)."""
    source: tuple | None = None
    """The stage's receive descriptors the slots were made for (a re-initialized stage
    makes new ones: then the slots are made again)."""
    headers: list[torch.Tensor] = field(default_factory=list)
    order: list[int] = field(default_factory=list)
    posted: int = 0
    free: deque[int] = field(default_factory=deque)
    in_use: dict[int, int] = field(default_factory=dict)
    bound: dict[int, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)
    """The buffers bound to each microbatch whose receive is posted."""
    awaiting_header: int | None = None
    """Variable shapes: the microbatch whose header is posted, not yet arrived."""
    forwards_done: set[int] = field(default_factory=set)
    """Variable shapes, gradient rings: microbatches whose forward has completed here."""

    def infos(self, mb: int):
        recv = self.stage.args_recv_info if self.edge.is_forward else self.stage.grad_recv_info
        return recv[mb]

    def releases(self, node: Node) -> bool:
        """Whether ``node`` is the last reader of its microbatch's slot."""
        if node.stage != self.edge.dst or node.microbatch not in self.in_use:
            return False
        if self.edge.is_forward:
            return node.releases
        return node.message == (self.edge, node.microbatch)

    def ensure_slots(self, header_device: torch.device | None = None) -> None:
        """Make the slots from the stage's receive metadata, unless they were made for
        the stage's current descriptors (a switch between training and evaluation
        re-initializes the stage); headers on ``header_device`` (default: the stage's)."""
        current = self.infos(0)
        if self.slots and current is self.source:
            return
        self.source = current
        count = 1 if self.variable else self.size
        self.slots = [tuple(None if info.tensor_meta is None
                            else _make_tensor_from_meta(info.tensor_meta, self.stage.device)
                            for info in current)
                      for _ in range(count)]
        tensors = sum(1 for t in self.slots[0] if t is not None)
        device = header_device or self.stage.device  # the host with gloo header channels
        self.headers = [torch.zeros(header_size(tensors), dtype=torch.int64, device=device)
                        for _ in range(self.size)] if self.variable and self.edge.is_forward else []

    def start(self, transport: Transport, order: list[int]) -> None:
        self.ensure_slots(transport.header_device(self.stage.device))
        self.order, self.posted = order, 0
        self.free = deque(range(self.size))
        self.in_use.clear()
        self.awaiting_header = None
        self.forwards_done.clear()
        self.finish()  # e.g. the buffers torch's stages allocate at shape inference (<= 2.14)
        self.post(transport)

    def post(self, transport: Transport) -> None:
        """Post the next receives of the channel, in its message order."""
        while self.free and self.posted < len(self.order) and self.awaiting_header is None:
            mb = self.order[self.posted]
            if self.variable and not self.edge.is_forward and mb not in self.forwards_done:
                return  # its shape is not known yet
            slot = self.free.popleft()
            self.posted += 1
            self.in_use[mb] = slot
            if not self.variable:
                self._bind(mb, self.slots[slot])
                transport.post_receive(self.edge, mb, _present(self.slots[slot]))
            elif self.edge.is_forward:
                self.awaiting_header = mb
                transport.post_receive(self.edge, mb, [self.headers[slot]], header=True)
            else:
                self._post_payload(transport, mb, self.sent_shapes[(self.edge.dst, mb)])

    def header_arrived(self, transport: Transport, platform: Platform, mb: int) -> None:
        """The shapes of microbatch ``mb``'s message came: receive the message itself, then
        the next header."""
        if mb != self.awaiting_header:
            raise AssertionError(f"header of microbatch {mb} on {self.edge} out of order")
        self.awaiting_header = None
        self._post_payload(transport, mb,
                           header_shapes(platform.read(self.headers[self.in_use[mb]])))
        self.post(transport)

    def _post_payload(self, transport: Transport, mb: int, shapes: list[torch.Size]) -> None:
        templates = [t for t in self.slots[0] if t is not None]
        if len(shapes) != len(templates):
            raise ValueError(f"variable shapes: a message of {len(shapes)} tensors on "
                             f"{self.edge}, where shape inference found {len(templates)}")
        # From the transport: on CUDA allocated on its receive stream (``ReceiveStreams``).
        buffers = iter([transport.receive_buffer(shape, t) for shape, t in zip(shapes, templates)])
        slot = tuple(next(buffers) if t is not None else None for t in self.slots[0])
        self._bind(mb, slot)
        transport.post_receive(self.edge, mb, _present(slot))

    def release(self, mb: int) -> None:
        self.free.append(self.in_use.pop(mb))
        self.bound.pop(mb, None)

    def finish(self) -> None:
        """Unbind every microbatch's descriptors: the step ended or failed."""
        for mb in self.order:
            for info in self.infos(mb):
                unbind_receive(info)
        self.bound.clear()

    def _bind(self, mb: int, slot: tuple[torch.Tensor | None, ...]) -> None:
        self.bound[mb] = slot
        for info, buffer in zip(self.infos(mb), slot):
            if buffer is not None:
                buffer.grad = None  # backward accumulates into the input's .grad
                bind_receive(info, buffer)

    @property
    def nbytes(self) -> int:
        """Bytes of the ring's buffers (variable shapes: of the messages it holds now)."""
        held = [self.bound[mb] for mb in self.in_use if mb in self.bound] if self.variable \
            else self.slots
        return sum(t.numel() * t.element_size() for slot in held for t in slot if t is not None)


def _present(slot: tuple[torch.Tensor | None, ...]) -> list[torch.Tensor]:
    return [t for t in slot if t is not None]


class ReceiveRings:
    """The rings of one rank's incoming channels for one step."""

    def __init__(self, variable_shapes: bool, platform: Platform) -> None:
        self.variable_shapes = variable_shapes
        self._platform = platform
        self._rings: dict[tuple[Edge, bool], _Ring] = {}
        self._active: list[_Ring] = []
        self._transport: Transport | None = None
        self._sent_shapes: dict[tuple[int, int], list[torch.Size]] = {}
        self._plan: RankPlan | None = None
        self.peak_bytes = 0
        """Most bytes the rings held at once during the step."""

    def start(self, transport: Transport, plan: StepPlan,
              stages: dict[int, _PipelineStageBase], limits: dict[int, int],
              training: bool) -> None:
        """Bind and post the first receives of every incoming channel of the step, whose
        ``plan`` (of the training or forward-only hint) the rank runs ``stages`` of."""
        self._transport = transport
        self._plan = plan.ranks[plan.stage_to_rank[next(iter(stages))]]
        self._active = []
        self._sent_shapes.clear()
        for edge in transport.channels:
            stage = stages.get(edge.dst)
            if stage is None or (not edge.is_forward and not training):
                continue
            order = list(plan.message_order(edge))
            size = limits[edge.dst] + 1 if edge.is_forward else limits[edge.dst]
            size = max(1, min(size, len(order)))
            key = (edge, training)
            ring = self._rings.get(key)
            if ring is None or ring.size != size or ring.stage is not stage:
                ring = self._rings[key] = _Ring(edge, stage, size, self.variable_shapes,
                                                self._sent_shapes)
            ring.start(transport, order)
            self._active.append(ring)
        self.peak_bytes = self._bytes()

    def arrived(self, arrivals: list[Received]) -> list[Received]:
        """Handle the headers among ``arrivals`` (post their messages' receives); return
        the messages."""
        messages = []
        for arrival in arrivals:
            if not arrival.header:
                messages.append(arrival)
                continue
            ring = next(r for r in self._active if r.edge == arrival.edge)
            ring.header_arrived(self._transport, self._platform,  # type: ignore[arg-type]
                                arrival.microbatch)
            self.peak_bytes = max(self.peak_bytes, self._bytes())
        return messages

    def sent(self, stage: int, microbatch: int, tensors: list[torch.Tensor]) -> None:
        """``stage`` sent ``microbatch``'s activations downstream: with variable shapes, its
        gradients will come back in their shapes."""
        if self.variable_shapes:
            self._sent_shapes[(stage, microbatch)] = [t.shape for t in tensors]

    def finish(self) -> None:
        """The step ended or failed: leave no buffer bound to the stages' descriptors."""
        for ring in self._active:
            ring.finish()

    def completed(self, action: _Action) -> None:
        """``action`` completed on the device: free the slots it was the last to read, and
        post the next receives into them (with variable shapes, a completed forward also
        makes its gradient's shape known)."""
        node = self._plan.node(action)  # type: ignore[union-attr]
        for ring in self._active:
            if ring.releases(node):
                ring.release(action.microbatch_index)
            elif (ring.variable and not ring.edge.is_forward and action.computation_type == F
                  and action.stage_index == ring.edge.dst):
                ring.forwards_done.add(action.microbatch_index)
            else:
                continue
            ring.post(self._transport)  # type: ignore[arg-type]
        if self.variable_shapes:  # fixed shapes: the rings' buffers are those of start()
            self.peak_bytes = max(self.peak_bytes, self._bytes())

    def _bytes(self) -> int:
        return sum(ring.nbytes for ring in self._active)


def check_variable_shapes(stages: Iterable[_PipelineStageBase]) -> None:
    """Variable shapes: received DTensor activations are rebuilt with the global shape
    found by shape inference, which varies, so they are refused; torch's per-microbatch
    metadata checks (TORCH_DISTRIBUTED_DEBUG=DETAIL) compare every microbatch with the
    first one, so they are turned off, saying so."""
    for stage in stages:
        for infos in (stage.args_recv_info.get(0, ()), stage.grad_recv_info.get(0, ())):
            for info in infos:
                if isinstance(getattr(info, "tensor_meta", None), _DTensorMeta):
                    raise ValueError(
                        f"variable_shapes: stage {stage.stage_index} receives a DTensor "
                        "activation or gradient, whose global shape torch's stages fix at "
                        "shape inference; use variable_shapes=False (pad to one shape)")
        if stage._runtime_validate:
            logger.warning("stage %d: torch's per-microbatch shape checks are off "
                           "(variable_shapes: microbatches differ from the first)",
                           stage.stage_index)
            stage._runtime_validate = False
