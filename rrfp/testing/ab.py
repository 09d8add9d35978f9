"""Alternating rounds for A/B comparisons on a shared machine: the variants run in their
order in one round and in reverse in the next, so that a drift in the machine's load
falls on every variant alike."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

Variant = TypeVar("Variant")


def in_alternating_order(variants: Sequence[Variant], round_: int) -> list[Variant]:
    """``variants`` in their order in even rounds, reversed in odd ones (negative rounds
    too: round -1 is odd)."""
    return list(variants) if round_ % 2 == 0 else list(reversed(variants))
