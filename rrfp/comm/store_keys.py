"""Where rrfp's keys live in the job's store: one prefix per torchrun attempt, and a new
generation of keys per schedule (``generation_store``)."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch.distributed as dist

_generations: dict[tuple[str, tuple[int, ...]], int] = {}
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
"""torchrun's count of worker-group restarts: part of every rrfp prefix in the store."""


def attempt_prefix() -> str:
    """``rrfp/attempt-<a>/``, where every rrfp key in the store lives: ``a`` is torchrun's
    restart count (``TORCHELASTIC_RESTART_COUNT``; 0 without torchrun)."""
    return f"rrfp/attempt-{os.environ.get(RESTART_COUNT) or '0'}/"


def generation_store(scope: str, ranks: Sequence[int]) -> tuple[str, dist.PrefixStore]:
    """A new generation's prefix in the default store for groups over ``ranks``
    (``rrfp/attempt-<a>/<scope>/<ranks>/<generation>/``; ``scope`` "" for a pipeline's
    channels; no ranks: ``rrfp/attempt-<a>/<scope>/<generation>/``, for the whole job), and
    the store under it. Every member makes as many generations for the same ranks and
    scope as the others, so they agree on the prefix without talking; a new generation
    starts with keys of its own, which no stale receive or failure of an earlier one
    reaches. ``a`` is torchrun's restart count (``TORCHELASTIC_RESTART_COUNT``, 0 without
    torchrun): restarted workers count generations from 0 again, and torchrun's shared
    store (its default) still holds the dead attempt's keys, among them the addresses its
    channels' groups connected to."""
    key = (scope, tuple(ranks))
    generation = _generations.get(key, 0)
    _generations[key] = generation + 1
    members = "-".join(map(str, ranks))
    prefix = (f"{attempt_prefix()}{scope + '/' if scope else ''}"
              f"{members + '/' if members else ''}{generation}/")
    return prefix, dist.PrefixStore(prefix, dist.distributed_c10d._get_default_store())
