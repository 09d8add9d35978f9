"""What went over each channel in the current step, by microbatch: the receives a rank
posted, the messages that arrived, the messages it sent. Kept by the transport, read by a
hang report (``rrfp.failure.hang_report``)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from rrfp.core.actions import Edge


@dataclass
class ChannelLedger:
    """One channel's messages in the current step, by microbatch."""

    posted: list[int] = field(default_factory=list)
    """Receives posted (this rank consumes the channel)."""
    arrived: list[int] = field(default_factory=list)
    sent: list[int] = field(default_factory=list)
    """Messages sent (this rank produces on the channel)."""

    @property
    def outstanding(self) -> list[int]:
        """Receives posted whose message has not arrived."""
        arrived = set(self.arrived)
        return [mb for mb in self.posted if mb not in arrived]


class Ledger(dict):
    """``ChannelLedger`` by edge, for the channels of one rank (empty until a step starts)."""

    def start_step(self, edges: Iterable[Edge]) -> None:
        """A step begins: an empty ledger per channel of ``edges``."""
        self.clear()
        self.update({edge: ChannelLedger() for edge in edges})

    def posted(self, edge: Edge, microbatch: int) -> None:
        if edge in self:
            self[edge].posted.append(microbatch)

    def arrived(self, edge: Edge, microbatch: int) -> None:
        if edge in self:
            self[edge].arrived.append(microbatch)

    def sent(self, edge: Edge, microbatch: int) -> None:
        if edge in self:
            self[edge].sent.append(microbatch)
