"""Variable-shape microbatches with real compute: padding vs RRFP, on both torchtitan data paths.

    python -m benchmarks.variable_shapes_bench     # writes results/variable_shapes.md (~2 min)

With torchtitan 0.3 installed it writes ``results/variable_shapes_0_3.md``: the same
method on torchtitan 0.3's llama3 (``Decoder``; causal SDPA as in the CPU jobs) and its
``rrfp_multimodal`` (``torchtitan_ext.titan_0_3.multimodal``), split by torchtitan 0.3's own
functions, every run called as torchtitan 0.3 calls schedules, with pre-split
microbatches (``step(arg_mbs=..., kwarg_mbs=..., target_mbs=...)``).

**Measured, real compute** (no emulated time): 2 CPU processes, one thread each (pipeline
of 2 ranks x 2 stages, Interleaved1F1B), torchtitan's llama3 debug model split as
torchtitan splits it, batches of 8 samples in 8 microbatches from ``torchtitan_ext.common.data``:

* *documents*: one document per sample (34-102 tokens);
* *multimodal*: the same plus 0-40 image patches per sample, encoded on the first stage
  (``rrfp_multimodal``).

Four ways to run each batch, alternating within every round: torch's
``ScheduleInterleaved1F1B`` on microbatches all padded to one shape, the run's longest
content (what users of fixed-shape pipelines do; torch's stages fix their shapes at the
first step, so a batch's own longest is not an option: a shorter batch then fails);
``ScheduleRRFP(policy="fixed", variable_shapes=True)`` on microbatches each as long as its
content (rounded up to 16); ``ScheduleRRFP`` with its default policy and variable shapes;
the same given each microbatch's size (``step(mb_sizes=...)``, as the torchtitan jobs give
them). Forward and backward only (no optimizer step, so all
three see the same weights). Tokens per second counts valid (non-padding) tokens.
Activation bytes: the most saved-activation bytes alive at once on a rank
(``ActivationMeter``). The message header cost is measured separately: one step of each
variable-shape run with and without headers is not separable, so its cost is the
microbenchmark of ``shape_header`` plus the send, per message.

**Simulated**: the simulator's prediction at 8 and 16 pipeline ranks from the traces of
the RRFP runs (per-microbatch durations of the first, middle and last stages, repeated
for deeper pipelines; the padded baseline takes each stage's longest microbatch for all).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B
from torchtitan.components.loss import IGNORE_INDEX

from benchmarks.pages import write_page
from rrfp import ScheduleRRFP
from rrfp.comm.receives import HEADER_DIMS, shape_header
from rrfp.core.hints import build_hint
from rrfp.core.limits import resolve_buffer_limits
from rrfp.runtime.meter import ActivationMeter, MeteredModule
from rrfp.sim.engine import simulate
from rrfp.sim.workloads import Timing
from rrfp.testing.ab import in_alternating_order
from rrfp.testing.worlds import run_local_world
from torchtitan_ext.common.assets import TOKENIZER_DIR
from torchtitan_ext.common.data import DocumentDataset, MAX_PATCHES, split_by_content
from torchtitan_ext.common.version import torchtitan_version
from rrfp import Settings

TITAN_0_3 = torchtitan_version() == (0, 3)

BATCH, MICROBATCHES, TEXT_LEN = 8, 8, 128
SIZED = "RRFP, sizes given"
VARIANTS = ("padded torch", "RRFP fixed order", "RRFP", SIZED)


def _model(multimodal: bool) -> torch.nn.Module:
    if TITAN_0_3:
        return _model_0_3(multimodal)
    from torchtitan.models.llama3 import llama3_args, Transformer

    from torchtitan_ext.titan_0_2.models import MultimodalArgs, MultimodalTransformer

    args = copy.copy(llama3_args["debugmodel"])
    args.max_seq_len = TEXT_LEN + (MAX_PATCHES if multimodal else 0)
    if multimodal:
        args = MultimodalArgs(**vars(args))
    torch.manual_seed(0)
    model = MultimodalTransformer(args) if multimodal else Transformer(args)
    with torch.no_grad():
        model.init_weights()
    return model


def _model_0_3(multimodal: bool) -> torch.nn.Module:
    from torchtitan.models.llama3 import model_registry

    from torchtitan_ext.config_registry import causal_sdpa
    from torchtitan_ext.titan_0_3.multimodal import multimodal_registry

    spec = causal_sdpa(multimodal_registry() if multimodal else model_registry("debugmodel"))
    torch.manual_seed(0)
    model = spec.model.build()
    with torch.no_grad():
        model.init_weights()
    return model


def _stage_modules(model: torch.nn.Module, rank: int) -> list[tuple[int, torch.nn.Module]]:
    """torchtitan's split into 4 stages, loop placement over 2 ranks."""
    if TITAN_0_3:
        from torchtitan.distributed.pipeline_parallel import (
            _generate_llm_fqn_per_model_part, _split_module)

        names = _generate_llm_fqn_per_model_part(4, 6, 1, 1)
        if getattr(model, "vision_encoder", None) is not None:  # as pipeline_vlm does
            names[0].insert(0, "vision_encoder")
        return [(index, _split_module(model, names[index])) for index in (rank, rank + 2)]
    from torchtitan.distributed.pipeline_parallel import generate_llm_fqn_per_model_part

    from torchtitan_ext.titan_0_2.models import first_stage_modules

    names = first_stage_modules(model, generate_llm_fqn_per_model_part(4, 6, 1, 1))
    stages = []
    for index in (rank, rank + 2):
        part = copy.deepcopy(model)
        keep = set(names[index])
        for name in ("tok_embeddings", "patch_encoder", "norm", "output"):
            if hasattr(part, name) and name not in keep:
                setattr(part, name, None)
        for layer in list(part.layers):
            if f"layers.{layer}" not in keep:
                del part.layers[layer]
        stages.append((index, part))
    return stages


def _tokenizer():
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    if TITAN_0_3:
        return HuggingFaceTokenizer.Config().build(tokenizer_path=TOKENIZER_DIR)
    return HuggingFaceTokenizer(TOKENIZER_DIR)


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(output.flatten(0, 1).float(), target.flatten(0, 1),
                                             reduction="sum", ignore_index=IGNORE_INDEX)


def _batches(multimodal: bool, count: int):
    tokenizer = _tokenizer()
    dataset = iter(DocumentDataset(tokenizer, TEXT_LEN, 0, 1, images=multimodal))
    batches = []
    for _ in range(count):
        samples = [next(dataset) for _ in range(BATCH)]
        inputs = torch.stack([s["input"] for s, _ in samples])
        labels = torch.stack([label for _, label in samples])
        extra = {k: torch.stack([s[k] for s, _ in samples]) for k in samples[0][0] if k != "input"}
        batches.append((inputs, labels, extra))
    return batches


def _header_send_us(rank: int, repeats: int = 500) -> float:
    """One-way microseconds of a header message between the two processes (gloo ping-pong,
    half the round trip)."""
    header = shape_header([torch.empty(1, 112, 256)])
    peer = 1 - rank
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        if rank == 0:
            dist.send(header, peer)
            dist.recv(header, peer)
        else:
            dist.recv(header, peer)
            dist.send(header, peer)
    return (time.perf_counter() - start) / repeats / 2 * 1e6


def _rank_main(rank: int, world: int, multimodal: bool, rounds: int) -> dict:
    header_send_us = _header_send_us(rank)
    model = _model(multimodal)
    batches = _batches(multimodal, rounds + 1)
    content = [split_by_content(inputs, labels, extra, MICROBATCHES)
               for inputs, labels, extra in batches]
    pad_to = (max(a[0].shape[1] for mbs in content for a in mbs.args),
              max(kw["patches"].shape[1] if kw else 0 for mbs in content for kw in mbs.kwargs))
    runs = {}
    for variant in VARIANTS:
        meter = ActivationMeter() if variant == "padded torch" else None
        stages = [PipelineStage(MeteredModule(m, meter) if meter else m, i, 4, torch.device("cpu"))
                  for i, m in _stage_modules(model, rank)]
        if variant == "padded torch":
            schedule = ScheduleInterleaved1F1B(stages, MICROBATCHES, loss_fn=_loss,
                                               scale_grads=False)
        else:
            schedule = ScheduleRRFP(stages, MICROBATCHES, loss_fn=_loss, scale_grads=False,
                                    hint="Interleaved1F1B",
                                    settings=Settings(
                                        variable_shapes=True, meter_every=1,
                                        policy="fixed" if variant == "RRFP fixed order" else None))
        runs[variant] = (schedule, stages, meter)
    times = {v: [] for v in VARIANTS}
    peak = {v: 0 for v in VARIANTS}
    tokens = []
    stats = None
    size_errors: list[float] = []
    for round_ in range(rounds + 1):  # round 0 warms up (shape inference, history)
        inputs, labels, extra = batches[round_]
        for variant in in_alternating_order(VARIANTS, round_ - 1):  # the first measured in order
            schedule, stages, meter = runs[variant]
            padded = variant == "padded torch"
            mbs = split_by_content(inputs, labels, extra, MICROBATCHES,
                                   pad_to=pad_to if padded else None)
            for stage in stages:
                stage.submod.zero_grad(set_to_none=True)
            if meter is not None:
                meter.reset([p for stage in stages for p in stage.submod.parameters()])
            dist.barrier()
            start = time.perf_counter()
            first, last = rank == 0, rank == 1
            if padded and not TITAN_0_3:  # torchtitan 0.2.2 gives torch's schedules the batch
                kwargs = {k: torch.cat([kw[k] for kw in mbs.kwargs]) for k in mbs.kwargs[0]}
                args = (torch.cat([a[0] for a in mbs.args]),) if first else ()
                schedule.step(*args, **(kwargs if first else {}),
                              target=torch.cat(mbs.targets) if last else None,
                              losses=[] if last else None, return_outputs=False)
            else:
                sizes = {"mb_sizes": mbs.sizes} if variant == SIZED else {}
                schedule.step(arg_mbs=mbs.args if first else None,
                              kwarg_mbs=mbs.kwargs if first else [{}] * MICROBATCHES,
                              target_mbs=mbs.targets if last else None,
                              losses=[] if last else None, return_outputs=False, **sizes)
            dist.barrier()
            elapsed = time.perf_counter() - start
            if round_ == 0:
                continue
            times[variant].append(elapsed)
            step_peak = meter.peak if meter else schedule.last_step_stats.peak_activation_bytes
            peak[variant] = max(peak[variant], step_peak)
            if variant == "RRFP":
                stats = schedule.last_step_stats
            if variant == SIZED and schedule.last_step_stats.size_prediction_error:
                size_errors.append(max(schedule.last_step_stats.size_prediction_error.values()))
        if round_ > 0:
            tokens.append(int((labels != IGNORE_INDEX).sum()))
    gathered: list = [None] * world
    dist.all_gather_object(gathered, stats)
    return {"times": times, "peak": peak, "tokens": tokens, "stats": gathered,
            "header_send_us": header_send_us, "size_errors": size_errors}


def _header_cost(repeats: int = 2000) -> tuple[float, int]:
    """Microseconds to build a header of one 3-d activation, and its bytes."""
    activation = torch.empty(1, 112, 256)
    start = time.perf_counter()
    for _ in range(repeats):
        shape_header([activation])
    return (time.perf_counter() - start) / repeats * 1e6, 8 * (1 + (1 + HEADER_DIMS))


def _predict(stats: list, ranks: int) -> dict[str, float]:
    """Simulated makespans at ``ranks`` pipeline ranks (1F1B, 4 microbatches per rank) from
    the measured per-microbatch durations: the fixed order on microbatches padded to the
    longest, the fixed order and RRFP (default policy, having seen one such step) on
    microbatches as long as their content."""
    spans = [s for st in stats for s in st.spans if s.kind in ("F", "B")]
    stages = sorted({s.stage for s in spans})
    table = {(s.stage, s.kind, s.microbatch): s.end - s.start for s in spans}
    n_mb = 4 * ranks

    def stage_of(s: int) -> int:  # the first, a middle and the last measured stage
        return stages[0] if s == 0 else stages[-1] if s == ranks - 1 else stages[1]

    def timing(padded: bool) -> Timing:
        def row(kind: str, s: int, scale: float = 1.0) -> list[float]:
            measured = [table[(stage_of(s), kind, m)] * scale for m in range(MICROBATCHES)]
            return [max(measured) if padded else measured[m % MICROBATCHES] for m in range(n_mb)]
        zero = [[0.0] * n_mb for _ in range(ranks)]
        return Timing([row("F", s) for s in range(ranks)], [row("B", s, 0.5) for s in range(ranks)],
                      [row("B", s, 0.5) for s in range(ranks)], zero, zero)

    hint = build_hint("1F1B", num_ranks=ranks, num_stages=ranks, n_microbatches=n_mb)
    padded, variable = timing(True), timing(False)
    limits = resolve_buffer_limits("hint", hint)
    seen = simulate(hint, variable.duration, policy="fixed").histories
    return {
        "padded fixed": simulate(hint, padded.duration, policy="fixed").makespan,
        "fixed": simulate(hint, variable.duration, policy="fixed").makespan,
        "RRFP": simulate(hint, variable.duration, policy="lookahead", limits=limits,
                         histories=seen).makespan,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=20, help="measured A/B/C rounds per path")
    args = parser.parse_args(argv)
    started = time.time()
    header_us, header_bytes = _header_cost()
    import torchtitan

    versions = (f"torchtitan {torchtitan.__version__}, torch {torch.__version__}"
                + (", every schedule called with pre-split microbatches, "
                   "`step(arg_mbs=..., kwarg_mbs=..., target_mbs=...)`" if TITAN_0_3 else ""))
    lines = [
        "# Variable-shape microbatches: padding vs RRFP (real compute, measured)",
        "",
        f"{versions}. Regenerate with `python -m benchmarks.variable_shapes_bench` ({{elapsed}} "
        "s on this 2-core machine, with that torchtitan installed). See the module docstring "
        "for the method.",
        "",
        "| data path | run | step ms (median) | valid tokens/s | vs padded | peak activations per "
        "rank (KiB) |",
        "|---|---|---|---|---|---|",
    ]
    predictions, header_send, sized = [], [], []
    for multimodal in (False, True):
        path = "multimodal" if multimodal else "documents"
        ranks = run_local_world(2, _rank_main, multimodal, args.rounds, timeout=1200)
        times, tokens = ranks[0]["times"], ranks[0]["tokens"]
        header_send.append(ranks[0]["header_send_us"])
        padded = statistics.median(times["padded torch"])
        for variant in VARIANTS:
            step = statistics.median(times[variant])
            tps = statistics.median(t / s for t, s in zip(tokens, times[variant]))
            peaks = " / ".join(f"{r['peak'][variant] / 1024:.0f}" for r in ranks)
            lines.append(f"| {path} | {variant} | {step * 1e3:.0f} | {tps:.0f} | "
                         f"{padded / step:.2f}x | {peaks} |")
            print(lines[-1], flush=True)
        ratios = [t / s for t, s in zip(times["RRFP"], times[SIZED])]
        errors = [e for r in ranks for e in r["size_errors"]]
        error = (f"; the durations predicted from the sizes fell from the measured ones by a "
                 f"median {statistics.median(errors) * 100:.0f}% (per step, the worst stage of "
                 "either rank; `StepStats.size_prediction_error`)") if errors else ""
        sized.append(f"* {path}: {SIZED} over RRFP not given them, per round: median "
                     f"{statistics.median(ratios):.3f}x (min {min(ratios):.3f}x, max "
                     f"{max(ratios):.3f}x){error}")
        for depth in (8, 16):
            made = _predict(ranks[0]["stats"], depth)
            predictions.append(
                f"{path}, {depth} ranks: over fixed 1F1B on padded microbatches, fixed 1F1B on "
                f"microbatches as long as their content {made['padded fixed'] / made['fixed']:.2f}x, "
                f"RRFP {made['padded fixed'] / made['RRFP']:.2f}x")
    lines += [
        "",
        f"*{SIZED}*: as *RRFP*, each microbatch's size given to the step (`step(mb_sizes=...)`,"
        " `torchtitan_ext.common.data.content_size`, as the torchtitan jobs give them), in the "
        "same rounds; the default `buffer_limit=\"hint\"` (the policy `lookahead`, which "
        "costs its deviations by the predicted durations):",
        "",
        *sized,
        "",
        f"Shape header: {header_bytes} bytes per activation message of one tensor (int64: "
        f"the tensor count, then per tensor its rank and up to {HEADER_DIMS} sizes), built in "
        f"{header_us:.1f} us, sent as one more small message on the channel: "
        f"{statistics.median(header_send):.0f} us one way on gloo between the two processes "
        "(ping-pong, half the round trip, median of the two paths' runs; on a stream-ordered "
        "NCCL channel it rides behind the activation's own launch). None with fixed shapes "
        "(`tests/test_runtime.py` counts the messages).",
        "",
        "**Simulated** from the RRFP runs' traces (per-microbatch durations of the first, a "
        "middle and the last stage, repeated to 8 and 16 ranks, 4 microbatches per rank):",
        "",
        *[f"* {p}" for p in predictions],
    ]
    elapsed = f"{time.time() - started:.0f}"
    page = write_page("variable_shapes_0_3.md" if TITAN_0_3 else "variable_shapes.md",
                      [line.replace("{elapsed}", elapsed) for line in lines])
    print(f"wrote {page}")


if __name__ == "__main__":
    main()
