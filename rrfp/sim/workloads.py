"""Seeded timing models for one step: per-(stage, microbatch) durations and latencies, and
for the workloads whose variability comes from the data, each microbatch's size.

Time unit: one mean forward of an LLM stage (1.0). Backward-for-input (I) and
backward-for-weights (W) each take one forward, a full backward (B) their sum, as in the
zero-bubble papers' cost model.
"""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from rrfp.core.actions import _Action, B, Edge, F, I, REDUCE_GRAD, W
from rrfp.core.sizes import MicrobatchSize

SIZE_WORKLOADS = ("documents", "documents-latency", "multimodal-unpacked",
                  "multimodal-unpacked-latency")
"""Workloads whose variability comes from the data, each step with its microbatches'
sizes (``Timing.sizes``). ``documents``: unpacked documents of lognormal length, a
stage's cost linear in tokens (MLP) plus quadratic in each document's length (attention);
``multimodal-unpacked``: samples of text and images, the first stages a vision encoder
costing per image, the language stages costing like ``documents`` with the image tokens
in their sequences; ``-latency``: with the ``latency`` workload's link latencies too."""
WORKLOADS = ("uniform", "jitter", "multimodal", "straggler", "latency", "spikes", "encoder",
             "correlated", "slowrank", "bursty", *SIZE_WORKLOADS)
"""``encoder``: one stage (the first: an encoder) costs ``encoder_slowdown`` times the
others; ``correlated``: a microbatch's cost is alike on every stage (a long sequence is slow
everywhere);
``slowrank``: one stage is slower on every action (a persistent straggler rank);
``bursty``: transfers slow down in bursts spanning consecutive microbatches of a link;
``SIZE_WORKLOADS``: variability from the data. The others have no sizes: their
microbatches are alike (packed), what varies is noise."""


@dataclass(frozen=True)
class Timing:
    """Durations and link latencies of one step (also the replay file format)."""

    forward: list[list[float]]
    """``forward[stage][microbatch]``."""
    backward_input: list[list[float]]
    backward_weight: list[list[float]]
    activation_latency: list[list[float]]
    """``activation_latency[s][mb]``: stage s -> s+1 (last row unused)."""
    gradient_latency: list[list[float]]
    """``gradient_latency[s][mb]``: stage s -> s-1 (first row unused)."""
    sizes: tuple[MicrobatchSize | None, ...] | None = None
    """Each microbatch's size, what a rank knows of it before it runs (None: the
    microbatches are alike; ``SIZE_WORKLOADS`` have sizes; an entry None: that
    microbatch's size is not known)."""

    @property
    def num_stages(self) -> int:
        return len(self.forward)

    @property
    def n_microbatches(self) -> int:
        return len(self.forward[0])

    def duration(self, action: _Action) -> float:
        s, m, ctype = action.stage_index, action.microbatch_index, action.computation_type
        if ctype == F:
            return self.forward[s][m]
        if ctype == B:
            return self.backward_input[s][m] + self.backward_weight[s][m]
        if ctype == I:
            return self.backward_input[s][m]
        if ctype == W:
            return self.backward_weight[s][m]
        if ctype == REDUCE_GRAD:
            return 0.0
        raise ValueError(f"no duration for {action}")

    def latency(self, edge: Edge, microbatch: int) -> float:
        table = self.activation_latency if edge.is_forward else self.gradient_latency
        return table[edge.src][microbatch]

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            json.dump(asdict(self), f)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Timing:
        with open(path) as f:
            data = json.load(f)
        try:
            tables = {k: data[k] for k in TABLES}
        except KeyError as e:
            raise ValueError(f"{path}: replay file lacks {e}; expected fields "
                             f"{list(TABLES)} (and optionally sizes)") from None
        sizes = data.get("sizes")
        try:
            timing = cls(**tables, sizes=None if sizes is None
                         else tuple(None if size is None else MicrobatchSize(**size)
                                    for size in sizes))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: sizes must be a list of {{tokens, attention, images}} "
                             f"(or null) per microbatch: {e}") from None
        shapes = {k: (len(v), {len(r) for r in v}) for k, v in tables.items()}
        if len({sh[0] for sh in shapes.values()}) != 1 or any(len(sh[1]) != 1 for sh in shapes.values()) \
                or len({next(iter(sh[1])) for sh in shapes.values()}) != 1:
            raise ValueError(f"{path}: every table must be [stages][microbatches]; got {shapes}")
        if timing.sizes is not None and len(timing.sizes) != timing.n_microbatches:
            raise ValueError(f"{path}: {len(timing.sizes)} sizes for "
                             f"{timing.n_microbatches} microbatches")
        return timing


TABLES = ("forward", "backward_input", "backward_weight", "activation_latency",
          "gradient_latency")
"""The [stages][microbatches] tables of a ``Timing``."""


def _knob(default: float, doc: str) -> float:
    """A WorkloadParams field documented by ``doc`` (also the CLI's help text)."""
    return field(default=default, metadata={"help": doc})


@dataclass(frozen=True)
class WorkloadParams:
    """Knobs of the workload models (defaults are the ones the results page uses)."""

    jitter_sigma: float = _knob(0.3, "lognormal sigma of per-action compute noise (jitter)")
    vision_stage_fraction: float = _knob(
        0.25, "share of the first stages that hold the vision encoder (multimodal)")
    max_images: int = _knob(8, "images per microbatch are uniform in 0..max_images (multimodal)")
    straggler_probability: float = _knob(
        0.2, "chance that an action of the straggling stage is slow (straggler)")
    straggler_slowdown: float = _knob(
        3.0, "how many times longer a slow action of the straggling stage takes (straggler)")
    latency_mean: float = _knob(0.5, "mean P2P latency, in forwards (latency)")
    latency_sigma: float = _knob(
        1.2, "lognormal sigma of the latency (1.2: p95/p5 about 50, as on the paper's PCIe "
             "cards) (latency)")
    spike_probability: float = _knob(
        0.05, "chance that a transfer is slow (spikes; its mean latency stays latency_mean)")
    spike_min_slowdown: float = _knob(5.0, "a slow transfer takes at least this many times "
                                            "longer (spikes)")
    spike_max_slowdown: float = _knob(20.0, "... and at most this many times longer (spikes)")
    encoder_slowdown: float = _knob(
        2.5, "how many times longer the encoder stage's actions take than the others' (encoder)")
    correlated_sigma: float = _knob(
        0.4, "lognormal sigma of a microbatch's cost factor, shared by every stage (correlated)")
    slow_rank_slowdown: float = _knob(
        1.3, "how many times longer every action of the slow stage takes (slowrank)")
    burst_probability: float = _knob(
        0.08, "chance that a link's transfer starts a burst of slow transfers (bursty)")
    burst_length: float = _knob(4.0, "mean microbatches a burst lasts (bursty)")
    burst_slowdown: float = _knob(
        8.0, "how many times longer a transfer in a burst takes (bursty; the mean latency "
             "stays latency_mean)")
    documents_per_microbatch: int = _knob(
        4, "documents (samples) per microbatch (documents, multimodal-unpacked)")
    document_length: float = _knob(
        1024.0, "mean tokens of a document, or of a sample's text (documents, "
                "multimodal-unpacked)")
    document_sigma: float = _knob(
        0.85, "lognormal sigma of a document's length (0.85: a language stage's cost has a "
              "coefficient of variation near 1) (documents, multimodal-unpacked)")
    attention_length: float = _knob(
        4096.0, "sequence length at which a token's attention costs as much as its MLP "
                "(documents, multimodal-unpacked)")
    image_tokens: float = _knob(
        576.0, "tokens an image adds to a sample's sequence in the language stages "
               "(multimodal-unpacked)")
    images_per_sample: int = _knob(
        4, "images per sample are uniform in 0..images_per_sample (multimodal-unpacked)")
    size_noise_sigma: float = _knob(
        0.05, "lognormal sigma of the compute noise that sizes do not explain "
              "(documents, multimodal-unpacked)")


def make_timing(workload: str, num_stages: int, n_microbatches: int, seed: int,
                params: WorkloadParams = WorkloadParams()) -> Timing:
    """Draw one step's timings from a workload model."""
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}: use one of {list(WORKLOADS)} or a replay file")
    draws = _Draws(random.Random(f"{workload}/{num_stages}/{n_microbatches}/{seed}"),
                   num_stages, n_microbatches)
    if workload in SIZE_WORKLOADS:
        return _sized_timing(workload, draws, params)
    cost = _compute_cost(workload, draws, params)
    latency, gradient_latency = _link_latency(workload, draws, params)
    # I and W of a microbatch scale like its forward (same tokens, same images), with
    # their own noise under jitter.
    scale = ((lambda: draws.noise(params.jitter_sigma)) if workload == "jitter"
             else (lambda: 1.0))
    return Timing(
        forward=cost,
        backward_input=[[c * scale() for c in row] for row in cost],
        backward_weight=[[c * scale() for c in row] for row in cost],
        activation_latency=latency,
        gradient_latency=gradient_latency,
    )


class _Draws:
    """A step's random draws, in one order (the pages regenerate only if it stays)."""

    def __init__(self, rng: random.Random, num_stages: int, n_microbatches: int):
        self.rng, self.S, self.M = rng, num_stages, n_microbatches

    def table(self, value: Callable[[int, int], float]) -> list[list[float]]:
        return [[value(s, m) for m in range(self.M)] for s in range(self.S)]

    def noise(self, sigma: float) -> float:  # mean-1 lognormal
        return math.exp(self.rng.gauss(-sigma * sigma / 2, sigma))


def _compute_cost(workload: str, draws: _Draws, params: WorkloadParams) -> list[list[float]]:
    """Each (stage, microbatch)'s forward, in mean forwards (1 where compute is uniform)."""
    rng, S, M, table, noise = draws.rng, draws.S, draws.M, draws.table, draws.noise
    if workload == "jitter":
        return table(lambda s, m: noise(params.jitter_sigma))
    if workload == "multimodal":
        vision = max(1, round(S * params.vision_stage_fraction))
        images = [rng.randint(0, params.max_images) for _ in range(M)]
        mean_images = params.max_images / 2
        # Vision stages scale with the images of the microbatch (mean cost 1); text stages
        # carry a little noise of their own.
        return table(lambda s, m: (0.1 + 0.9 * images[m] / mean_images) if s < vision
                     else noise(0.1))
    if workload == "straggler":
        slow_stage = rng.randrange(S)
        return table(lambda s, m: params.straggler_slowdown
                     if s == slow_stage and rng.random() < params.straggler_probability else 1.0)
    if workload == "encoder":
        # Stage 0 holds the encoder; each stage's actions carry a little noise of their own.
        return table(lambda s, m: (params.encoder_slowdown if s == 0 else 1.0) * noise(0.1))
    if workload == "correlated":
        length = [noise(params.correlated_sigma) for _ in range(M)]
        return table(lambda s, m: length[m] * noise(0.1))
    if workload == "slowrank":
        slow_stage = rng.randrange(S)
        return table(lambda s, m: (params.slow_rank_slowdown if s == slow_stage else 1.0)
                     * noise(0.1))
    return table(lambda s, m: 1.0)


def _link_latency(workload: str, draws: _Draws, params: WorkloadParams
                  ) -> tuple[list[list[float]], list[list[float]]]:
    """(activation, gradient) latency of each (stage, microbatch)'s message, in mean
    forwards (0 where links are not modelled)."""
    rng, S, M, table, noise = draws.rng, draws.S, draws.M, draws.table, draws.noise
    if workload == "latency":
        def drawn(s: int, m: int) -> float:
            return params.latency_mean * noise(params.latency_sigma)
        return table(drawn), table(drawn)
    if workload == "spikes":
        low, high = params.spike_min_slowdown, params.spike_max_slowdown
        p = params.spike_probability
        base = params.latency_mean / (1 - p + p * (low + high) / 2)

        def spiky(s: int, m: int) -> float:
            slow = rng.uniform(low, high) if rng.random() < p else 1.0
            return base * slow * noise(0.3)
        return table(spiky), table(spiky)
    if workload == "bursty":
        p, length, slow = params.burst_probability, params.burst_length, params.burst_slowdown
        # Share of transfers in a burst: bursts start at rate p and last `length` on average.
        share = p * length / (1 + p * length)
        base = params.latency_mean / (1 - share + share * slow)

        def bursts() -> list[list[float]]:
            rows = []
            for _ in range(S):
                row, left = [], 0
                for _ in range(M):
                    if left == 0 and rng.random() < p:
                        left = 1 + int(rng.expovariate(1 / max(length - 1, 1e-9)))
                    row.append(base * (slow if left > 0 else 1.0) * noise(0.3))
                    left = max(left - 1, 0)
                rows.append(row)
            return rows
        return bursts(), bursts()
    zero = table(lambda s, m: 0.0)
    return zero, zero


def _sized_timing(workload: str, draws: _Draws, params: WorkloadParams) -> Timing:
    """A step of a ``SIZE_WORKLOADS`` workload: sizes first, then each (stage,
    microbatch)'s cost from its size with a little noise; I and W scale like F."""
    if workload.startswith("documents"):
        sizes, cost = _documents(draws, params)
    else:
        sizes, cost = _unpacked_multimodal(draws, params)
    if workload.endswith("-latency"):
        latency, gradient_latency = _link_latency("latency", draws, params)
    else:
        latency, gradient_latency = _link_latency("uniform", draws, params)
    return Timing(forward=cost, backward_input=[row[:] for row in cost],
                  backward_weight=[row[:] for row in cost], activation_latency=latency,
                  gradient_latency=gradient_latency, sizes=tuple(sizes))


def _language_cost(size: MicrobatchSize, params: WorkloadParams) -> float:
    """A language stage's work on a microbatch: its tokens through the MLP, and each
    sequence's attention, quadratic in its length."""
    return size.tokens + size.attention / params.attention_length


def _documents(draws: _Draws, params: WorkloadParams
               ) -> tuple[list[MicrobatchSize], list[list[float]]]:
    k, length, sigma = params.documents_per_microbatch, params.document_length, \
        params.document_sigma
    sizes = []
    for _ in range(draws.M):
        lengths = [max(1, round(length * draws.noise(sigma))) for _ in range(k)]
        sizes.append(MicrobatchSize(tokens=sum(lengths), attention=sum(n * n for n in lengths)))
    # Expected work of a microbatch (lognormal: E[n^2] = mean^2 e^(sigma^2)): the time unit.
    mean = k * (length + length * length * math.exp(sigma * sigma) / params.attention_length)
    return sizes, draws.table(lambda s, m: _language_cost(sizes[m], params) / mean
                              * draws.noise(params.size_noise_sigma))


def _unpacked_multimodal(draws: _Draws, params: WorkloadParams
                         ) -> tuple[list[MicrobatchSize], list[list[float]]]:
    k, length, sigma = params.documents_per_microbatch, params.document_length, \
        params.document_sigma
    n, image = params.images_per_sample, params.image_tokens
    sizes = []
    for _ in range(draws.M):
        samples = [(max(1, round(length * draws.noise(sigma))), draws.rng.randint(0, n))
                   for _ in range(k)]
        sequences = [text + image * images for text, images in samples]
        sizes.append(MicrobatchSize(tokens=sum(sequences),
                                    attention=sum(q * q for q in sequences),
                                    images=sum(images for _, images in samples)))
    vision = max(1, round(draws.S * params.vision_stage_fraction))
    mean_images = k * n / 2
    # Expected language work of a sample: E[q] and E[q^2] of text + image * images, with
    # text lognormal and images uniform in 0..n, independent.
    mean_sequence = length + image * n / 2
    mean_square = (length * length * math.exp(sigma * sigma) + length * image * n
                   + image * image * n * (2 * n + 1) / 6)
    mean_language = k * (mean_sequence + mean_square / params.attention_length)

    def cost(s: int, m: int) -> float:
        work = (0.1 + 0.9 * sizes[m].images / mean_images if s < vision
                else _language_cost(sizes[m], params) / mean_language)
        return work * draws.noise(params.size_noise_sigma)
    return sizes, draws.table(cost)
