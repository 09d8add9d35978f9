"""Arbitration policies: which of the ready actions a rank runs.

A policy only ever picks among actions the arbiter found ready (head of their streams,
inputs arrived, within the memory limit), so no policy can break the bitwise-fidelity or
channel-order invariants; they differ only in speed. Policies that may decline to run a
ready action (return None) must not do so forever, or the pipeline would stall.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TYPE_CHECKING

if TYPE_CHECKING:
    from rrfp.arbiter import Arbiter, Node


class Policy(Protocol):
    name: str

    def choose(self, ready: Sequence[Node], arbiter: Arbiter) -> Node | None:
        """Pick one of ``ready`` (sorted by hint position), or None to wait."""
        ...


class HintOrder:
    """Readiness-first: the ready action that ranks highest in the hint."""

    name = "hint"

    def choose(self, ready: Sequence[Node], arbiter: Arbiter) -> Node | None:
        return ready[0]


class FixedOrder:
    """The fixed schedule itself: only the first not-yet-run action of the hint."""

    name = "fixed"

    def choose(self, ready: Sequence[Node], arbiter: Arbiter) -> Node | None:
        return ready[0] if ready[0].index == arbiter.first_undone else None


class BackwardFirst:
    """The paper's BF rule, and BFW when the hint splits backward into I and W.

    Each round runs one ready backward, then one ready forward (either kind alone when
    the other is not ready). Backwards prefer the higher model chunk, forwards the lower;
    ties go to the lower microbatch. Weight-gradient (W) actions run only when no
    forward or backward is ready.
    """

    def __init__(self, name: str = "BF"):
        self.name = name
        self._backward_next = True

    def choose(self, ready: Sequence[Node], arbiter: Arbiter) -> Node | None:
        backwards = [n for n in ready if n.kind == "BI"]
        forwards = [n for n in ready if n.kind == "F"]
        if backwards and (self._backward_next or not forwards):
            self._backward_next = False
            return min(backwards, key=lambda n: (-n.stage, n.microbatch))
        if forwards:
            self._backward_next = True
            return min(forwards, key=lambda n: (n.stage, n.microbatch))
        return ready[0]


def make_policy(name: str) -> Policy:
    """A fresh policy (policies may keep per-step state) for a hint's policy name."""
    if name == "hint":
        return HintOrder()
    if name in ("BF", "BFW"):
        return BackwardFirst(name)
    if name == "fixed":
        return FixedOrder()
    raise ValueError(f"unknown arbitration policy {name!r}: use 'hint', 'BF', 'BFW' or 'fixed'")
