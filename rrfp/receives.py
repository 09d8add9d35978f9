"""Receive buffers in a small ring per channel, reused, instead of one per microbatch.

torch's stages allocate a receive buffer per microbatch for every input and gradient;
posting every receive at the step's start keeps all of them alive, so receive memory grows
with the number of microbatches (a user of torch's pipelining reported ~52 GiB of such
buffers on middle stages of a large MoE model). Here each incoming channel owns ``size``
buffer sets (slots). Receives are posted in the channel's message order, each into a free
slot, which is bound to its microbatch in the stage (the stage reads its input or
gradient from there). A slot is free again once the action that last reads it has
completed on the device:

* an activation received by stage s: its microbatch's last backward piece on s (B, or W
  when backward is split), because autograd keeps the input for the weight gradients; in
  a forward-only step, the forward;
* a gradient received by stage s: the backward (B or I) that consumes it.

An activation ring holds the stage's memory limit plus one slot: the stage holds at most
that many microbatches, so the next message in channel order (the one its forward stream
needs next) always has a slot. A gradient ring holds the memory limit: gradients only
arrive for microbatches the stage holds. So receive memory grows with the limit.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
from torch.distributed.pipelining.stage import _PipelineStageBase

from rrfp.hints import _Action, Edge, F, Hint, INPUT_GRAD_KINDS, WEIGHT_GRAD_KINDS
from rrfp.transport import Transport


@dataclass
class _Ring:
    edge: Edge
    stage: _PipelineStageBase
    size: int
    training: bool
    slots: list[tuple[torch.Tensor | None, ...]] = field(default_factory=list)
    order: list[int] = field(default_factory=list)
    posted: int = 0
    free: deque[int] = field(default_factory=deque)
    in_use: dict[int, int] = field(default_factory=dict)

    def infos(self, mb: int):
        recv = self.stage.args_recv_info if self.edge.is_forward else self.stage.grad_recv_info
        return recv[mb]

    def releases(self, action: _Action) -> bool:
        """Whether ``action`` is the last reader of its microbatch's slot."""
        if action.stage_index != self.edge.dst or action.microbatch_index not in self.in_use:
            return False
        ctype = action.computation_type
        if not self.edge.is_forward:
            return ctype in INPUT_GRAD_KINDS
        return ctype in WEIGHT_GRAD_KINDS if self.training else ctype == F

    def ensure_slots(self) -> None:
        """(Re)take the slots from the stage's own buffers of its first microbatches; drop
        the rest. The stage re-creates its buffers when it is re-initialized (a switch
        between training and evaluation): then the slots are taken again."""
        ours = {id(t) for slot in self.slots for t in slot if t is not None}
        current = self.infos(0)
        if self.slots and all(info.buffer is None or id(info.buffer) in ours for info in current):
            return
        self.slots = [tuple(info.buffer for info in self.infos(mb)) for mb in range(self.size)]

    def start(self, transport: Transport, order: list[int]) -> None:
        self.ensure_slots()
        self.order, self.posted = order, 0
        self.free = deque(range(len(self.slots)))
        self.in_use.clear()
        for mb in order:  # until bound, every microbatch points at a slot, not its own buffer
            self._bind(mb, 0)
        self.post(transport)

    def post(self, transport: Transport) -> None:
        """Post the next receives of the channel into free slots."""
        while self.free and self.posted < len(self.order):
            mb, slot = self.order[self.posted], self.free.popleft()
            self.posted += 1
            self.in_use[mb] = slot
            self._bind(mb, slot)
            transport.post_receive(self.edge, mb, [t for t in self.slots[slot] if t is not None])

    def release(self, mb: int) -> None:
        self.free.append(self.in_use.pop(mb))

    def _bind(self, mb: int, slot: int) -> None:
        for info, buffer in zip(self.infos(mb), self.slots[slot]):
            if buffer is not None:
                buffer.grad = None  # backward accumulates into the input's .grad
                info.buffer = buffer

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for slot in self.slots for t in slot
                   if t is not None)


class ReceiveRings:
    """The rings of one rank's incoming channels for one step."""

    def __init__(self) -> None:
        self._rings: dict[tuple[Edge, bool], _Ring] = {}
        self._active: list[_Ring] = []
        self._transport: Transport | None = None

    def start(self, transport: Transport, hint: Hint, stages: dict[int, _PipelineStageBase],
              limits: dict[int, int], training: bool) -> None:
        """Bind and post the first receives of every incoming channel of the step."""
        self._transport = transport
        self._active = []
        for edge in transport.channels:
            stage = stages.get(edge.dst)
            if stage is None or (not edge.is_forward and not training):
                continue
            order = hint.message_order(edge)
            size = limits[edge.dst] + 1 if edge.is_forward else limits[edge.dst]
            size = max(1, min(size, len(order)))
            key = (edge, training)
            ring = self._rings.get(key)
            if ring is None or ring.size != size or ring.stage is not stage:
                ring = self._rings[key] = _Ring(edge, stage, size, training)
            ring.start(transport, order)
            self._active.append(ring)

    def completed(self, action: _Action) -> None:
        """``action`` completed on the device: free the slots it was the last to read, and
        post the next receives into them."""
        for ring in self._active:
            if ring.releases(action):
                ring.release(action.microbatch_index)
                ring.post(self._transport)  # type: ignore[arg-type]

    @property
    def nbytes(self) -> int:
        """Bytes of the receive buffers of this step's channels."""
        return sum(ring.nbytes for ring in self._active)
