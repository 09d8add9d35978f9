"""The workload families the self-driving study runs (``rrfp.sim.selfdriving``): each a
hint, a memory budget and a seeded sequence of step timings.

Three where RRFP gains (documents of variable length with their sizes known, bursty link
latency, stragglers), two where nothing can gain (uniform, a compute jitter too small to
matter), three where a static rule loses (a vision encoder on the first stage whose cost
follows the image count, mean-balanced and as the bottleneck; ZBVZeroBubble at
``hint+2`` on documents), and one whose timings change regime half way. A caller's own
family is any function of (seed, steps) returning a list of ``Timing``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from rrfp.core.sizes import MicrobatchSize
from rrfp.sim.workloads import make_timing, Timing, WorkloadParams

MAX_IMAGES = 8
"""Images per microbatch in the encoder families: uniform in 0..MAX_IMAGES."""
ENCODER_RANGE = (1.0, 5.0)
"""The encoder stage's cost, in forwards of another stage, from no images to the most."""


@dataclass(frozen=True)
class Family:
    hint: str
    num_ranks: int
    num_stages: int
    n_microbatches: int
    budget: str
    timings: Callable[[int, int], list[Timing]]
    """(seed, steps) -> one ``Timing`` per step."""
    kind: str
    """``"gains"``, ``"no gain"``, ``"static loses"`` or ``"regime change"``."""


def drawn(workload: str, num_stages: int, n_microbatches: int,
          params: WorkloadParams = WorkloadParams()) -> Callable[[int, int], list[Timing]]:
    """Steps of one of ``rrfp.sim.workloads.WORKLOADS``, each drawn afresh."""
    def timings(seed: int, steps: int) -> list[Timing]:
        return [make_timing(workload, num_stages, n_microbatches, seed * 100_000 + step, params)
                for step in range(steps)]
    return timings


def encoder(num_stages: int, n_microbatches: int, *, balanced: bool
            ) -> Callable[[int, int], list[Timing]]:
    """The first stage a vision encoder whose cost grows linearly over ``ENCODER_RANGE``
    with the microbatch's images; the other stages constant with a little noise.
    ``balanced``: the encoder stage's mean cost is the others' (the model split was
    rebalanced for it); otherwise it is the bottleneck, ``ENCODER_RANGE``'s mean times
    theirs. The sizes give each microbatch's images."""
    return sized_stage(num_stages, n_microbatches, stage=0, balanced=balanced)


def sized_stage(num_stages: int, n_microbatches: int, *, stage: int, balanced: bool,
                size_noise: float = 0.0) -> Callable[[int, int], list[Timing]]:
    """As ``encoder``, with the image-driven stage at ``stage``; ``size_noise``: the
    sigma of a lognormal factor on that stage's cost that the images do not predict."""
    low, high = ENCODER_RANGE
    scale = 2 / (low + high) if balanced else 1.0
    tag = (f"encoder/{balanced}" if (stage, size_noise) == (0, 0.0)
           else f"sized/{stage}/{balanced}/{size_noise}")

    def sized_cost(images: int, rng: random.Random) -> float:
        noise = math.exp(rng.gauss(0, size_noise)) if size_noise else 1.0
        return (low + (high - low) * images / MAX_IMAGES) * scale * noise

    def step(rng: random.Random) -> Timing:
        images = [rng.randint(0, MAX_IMAGES) for _ in range(n_microbatches)]
        cost = [[sized_cost(n, rng) if s == stage else math.exp(rng.gauss(0, 0.05))
                 for n in images] for s in range(num_stages)]
        zero = [[0.0] * n_microbatches for _ in range(num_stages)]
        return Timing(forward=cost, backward_input=[row[:] for row in cost],
                      backward_weight=[row[:] for row in cost], activation_latency=zero,
                      gradient_latency=[row[:] for row in zero],
                      sizes=tuple(MicrobatchSize(tokens=1.0, images=n) for n in images))

    def timings(seed: int, steps: int) -> list[Timing]:
        return [step(random.Random(f"{tag}/{seed}/{k}")) for k in range(steps)]
    return timings


def regime_change(before: Callable[[int, int], list[Timing]],
                  after: Callable[[int, int], list[Timing]], at: int
                  ) -> Callable[[int, int], list[Timing]]:
    """``before``'s steps up to step ``at``, ``after``'s from there."""
    def timings(seed: int, steps: int) -> list[Timing]:
        return before(seed, min(at, steps)) + after(seed, steps)[at:]
    return timings


RANKS, MICROBATCHES = 4, 16
"""The study's pipeline: 4 ranks, 16 microbatches per step (1F1B: one stage per rank)."""
REGIME_CHANGE_AT = 100


def _loop(workload_timings: Callable[[int, int], list[Timing]], kind: str,
          hint: str = "1F1B", budget: str = "hint+2") -> Family:
    return Family(hint, RANKS, RANKS, MICROBATCHES, budget, workload_timings, kind)


FAMILIES: dict[str, Family] = {
    "documents": _loop(drawn("documents", RANKS, MICROBATCHES), "gains"),
    "bursty": _loop(drawn("bursty", RANKS, MICROBATCHES), "gains"),
    "straggler": _loop(drawn("straggler", RANKS, MICROBATCHES), "gains"),
    "uniform": _loop(drawn("uniform", RANKS, MICROBATCHES), "no gain"),
    "tiny-jitter": _loop(drawn("jitter", RANKS, MICROBATCHES,
                               WorkloadParams(jitter_sigma=0.02)), "no gain"),
    "encoder-balanced": _loop(encoder(RANKS, MICROBATCHES, balanced=True), "static loses"),
    "encoder-bottleneck": _loop(encoder(RANKS, MICROBATCHES, balanced=False), "static loses"),
    "zbv-documents": Family("ZBVZeroBubble", RANKS, 2 * RANKS, MICROBATCHES, "hint+2",
                            drawn("documents", 2 * RANKS, MICROBATCHES), "static loses"),
    "regime-change": _loop(regime_change(drawn("uniform", RANKS, MICROBATCHES),
                                         drawn("bursty", RANKS, MICROBATCHES),
                                         REGIME_CHANGE_AT), "regime change"),
}
