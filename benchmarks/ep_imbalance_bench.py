"""Data-driven expert imbalance, PP x EP: python -m benchmarks.ep_imbalance_bench

PP=2 x EP=2 on 4 gloo processes (pipeline rank = global rank // 2, EP rank = global rank % 2;
each EP rank is a data-parallel replica with its own data). Each stage is one residual MoE
block: a real top-1 gate (linear router) over 4 experts, 2 per EP rank, tokens dispatched
to the experts' ranks and combined back with gloo `all_to_all_single_autograd` (uneven
splits, real). The data are mixed-domain documents generated here: each microbatch of each
replica is one document, 3/4 of its tokens from one of 4 domains (a cluster of embeddings)
and the rest from the others, so which experts, hence which EP rank, a microbatch loads
varies per microbatch and per layer. Compute is **emulated device time**: an expert's
forward sleeps a fixed time per token its rank receives (the routing decides it), plus a
fixed dense part per microbatch; backward twice that. The combine all-to-all makes both EP
ranks of a stage wait for the busier one, as on hardware.

Two hints, each in its own run: 1F1B (one stage per rank) and Interleaved1F1B (two stages
per rank, each with half the emulated time, so a rank carries the same work). Schedules,
same data, each in turn every step: torch's own (`Schedule1F1B`, `ScheduleInterleaved1F1B`:
fixed; it runs on the calling thread, synchronously, as torch's schedules do on CPU), and
`ScheduleRRFP` with that hint on the emulated asynchronous device: in the hint's fixed order
(`policy="fixed"`) without and with coordination (what the runtime and the coordination
cost without any reordering), at its default memory `"hint"`, and at `"hint+2"` (2 more
microbatches of activations per stage); coordinated means `coordination_group` = a gloo
twin of the EP group, leader coordination (the default). Each measured step's RRFP trace
(EP rank 0's pipeline) is replayed by the simulator (`rrfp.sim`) at PP 2, beside the
measurement, and, resampled, at PP 8 x 32 microbatches (simulated). Writes
benchmarks/results/ep_imbalance.md and the traces benchmarks/results/ep_imbalance_*.json.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd

from benchmarks.pages import result_path, write_page
from rrfp import Settings, write_chrome_trace
from rrfp.core.hints import build_hint
from rrfp.sim.replay import resample, timing_from_trace
from rrfp.sim.study import compare
from rrfp.testing.emulation import EmulatedDevice
from rrfp.testing.study import Study, StudySchedule
from rrfp.testing.worlds import run_local_world

PP, EP = 2, 2
DIM, EXPERTS, DOMAINS = 32, 4, 4
TOKENS_PER_DOCUMENT = 64
"""One document per microbatch."""
DOMINANT_SHARE = 0.75
HINTS = {"1F1B": 1, "Interleaved1F1B": 2}
"""The hints studied and their stages per rank."""
TORCH = "torch (fixed)"
RRFP_RUNS = {
    # The hint's own order on RRFP's runtime, without and with coordination: what the
    # runtime and the coordination cost without any reordering. Uncoordinated is safe only
    # here: in the fixed order both EP ranks run the same sequence by construction (the
    # experts are plain tensors, so RRFP's check for sharded parameters cannot see the EP).
    "RRFP fixed order, uncoordinated": dict(policy="fixed", coordination_group=None),
    "RRFP fixed order": dict(policy="fixed"),
    "RRFP hint": dict(buffer_limit="hint"),
    "RRFP hint+2": dict(buffer_limit="hint+2"),
}
SCHEDULES = (TORCH, *RRFP_RUNS)
REPLAYED = ("RRFP hint", "RRFP hint+2")
LARGE_PP, LARGE_MICROBATCHES = 8, 32


def trace_name(hint: str) -> str:
    return f"ep_imbalance_trace_{hint.lower()}.json"


@dataclass(frozen=True)
class Config:
    microbatches: int = 16
    steps: int = 6
    expert_ms_per_token: float = 0.2
    """Emulated expert forward time per token a rank receives, for all its stages together;
    a balanced rank receives 64 per microbatch and stage (12.8 ms with one stage)."""
    dense_ms: float = 4.0
    """Emulated forward time of the rest of the rank's blocks (attention, norms) per
    microbatch, for all its stages together."""
    simulated_seeds: int = 5


def _domain_centroids() -> torch.Tensor:
    return torch.randn(DOMAINS, DIM, generator=torch.Generator().manual_seed(7)) * 1.5


def documents(step: int, replica: int, microbatches: int) -> torch.Tensor:
    """One step's input for one replica: ``[microbatches, TOKENS_PER_DOCUMENT, DIM]``, each
    microbatch a document drawn mostly from one domain."""
    rng = random.Random(f"documents/{step}/{replica}")
    gen = torch.Generator().manual_seed(1000 * step + replica)
    centroids = _domain_centroids()
    docs = []
    for _ in range(microbatches):
        dominant = rng.randrange(DOMAINS)
        domain = [dominant if rng.random() < DOMINANT_SHARE else rng.randrange(DOMAINS)
                  for _ in range(TOKENS_PER_DOCUMENT)]
        docs.append(centroids[domain] + 0.3 * torch.randn(TOKENS_PER_DOCUMENT, DIM, generator=gen))
    return torch.stack(docs)


class RoutedMoEBlock(torch.nn.Module):
    """``x + gate_weight * expert(x)``, top-1, experts sharded over the EP group.

    Emulated device time: forward sleeps ``dense_s`` plus ``per_token_s`` per token this
    rank's experts receive; backward twice that (not ``rrfp.testing.emulation.EmulatedDeviceTime``,
    whose times per microbatch are known ahead: here the routing decides them inside the
    forward). Records, per forward, the busiest EP rank's tokens over the mean
    (``imbalance``)."""

    def __init__(self, stage: int, ep_group: dist.ProcessGroup, per_token_s: float,
                 dense_s: float):
        super().__init__()
        torch.manual_seed(100 + stage)  # the same router and experts on every EP rank
        self.gate = torch.nn.Linear(DIM, EXPERTS, bias=False)
        experts = [torch.nn.Sequential(torch.nn.Linear(DIM, 64), torch.nn.Tanh(),
                                       torch.nn.Linear(64, DIM)) for _ in range(EXPERTS)]
        self.ep_group, self.ep_rank = ep_group, dist.get_rank(ep_group)
        self.local = EXPERTS // EP
        self.experts = torch.nn.ModuleList(experts[self.ep_rank * self.local:(self.ep_rank + 1) * self.local])
        self.per_token_s, self.dense_s = per_token_s, dense_s
        self.imbalance: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, DIM)
        probs = torch.softmax(self.gate(tokens), dim=-1)
        weight, expert = probs.max(dim=-1)
        order = torch.argsort(expert, stable=True)
        counts = torch.bincount(expert, minlength=EXPERTS)
        # Every rank's per-expert counts: its receive splits, and the load of every rank.
        gathered = [torch.zeros_like(counts) for _ in range(EP)]
        dist.all_gather(gathered, counts, group=self.ep_group)
        per_rank = torch.stack(gathered).view(EP, EP, self.local)  # [source, dest, local]
        load = per_rank.sum(dim=(0, 2))
        self.imbalance.append(load.max().item() / load.float().mean().item())
        received = all_to_all_single_autograd(
            tokens[order], per_rank[:, self.ep_rank].sum(1).tolist(),
            per_rank[self.ep_rank].sum(1).tolist(), self.ep_group)
        pieces, start = [], 0
        # Received: by source rank, then by local expert within each source.
        chunks = per_rank[:, self.ep_rank].flatten().tolist()
        for i, n in enumerate(chunks):
            pieces.append(self.experts[i % self.local](received[start:start + n]))
            start += n
        out = torch.cat(pieces)
        seconds = self.per_token_s * int(load[self.ep_rank])
        time.sleep(seconds)
        out.register_hook(lambda grad: time.sleep(2 * seconds))
        combined = all_to_all_single_autograd(
            out, per_rank[self.ep_rank].sum(1).tolist(),
            per_rank[:, self.ep_rank].sum(1).tolist(), self.ep_group)
        routed = torch.empty_like(combined).index_copy(0, order, combined)
        time.sleep(self.dense_s)
        y = (tokens + weight.unsqueeze(1) * routed).reshape(x.shape)
        y.register_hook(lambda grad: time.sleep(2 * self.dense_s))
        return y


def _grad_hash(module: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for _, p in sorted(module.named_parameters()):
        h.update(p.grad.numpy().tobytes())
    return h.hexdigest()[:16]


def _rank_main(rank: int, world_size: int, config: Config, hint: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleInterleaved1F1B

    mesh = init_device_mesh("cpu", (PP, EP), mesh_dim_names=("pp", "ep"))
    pp, ep = mesh["pp"].get_local_rank(), mesh["ep"].get_local_rank()
    ep_group = mesh["ep"].get_group()
    # Coordination runs on the compute thread while the device thread's all-to-alls use the
    # EP group: a twin of it, never the group itself (one gloo group, one op at a time).
    twins = [dist.new_group(list(range(p * EP, (p + 1) * EP)), backend="gloo") for p in range(PP)]
    M, per_rank = config.microbatches, HINTS[hint]
    num_stages = PP * per_rank

    def stages() -> list[PipelineStage]:
        return [PipelineStage(RoutedMoEBlock(s, ep_group, config.expert_ms_per_token / 1e3 / per_rank,
                                             config.dense_ms / 1e3 / per_rank),
                              s, num_stages, torch.device("cpu"), group=mesh["pp"].get_group())
                for s in range(pp, num_stages, PP)]

    loss_fn = torch.nn.functional.mse_loss
    built = {name: stages() for name in SCHEDULES}
    torch_class = Schedule1F1B if per_rank == 1 else ScheduleInterleaved1F1B
    schedules = {
        TORCH: torch_class(built[TORCH][0] if per_rank == 1 else built[TORCH], M, loss_fn=loss_fn),
        **{name: StudySchedule(built[name], M, loss_fn=loss_fn, hint=hint,
                               study=Study(device=EmulatedDevice()),
                               coordination_group=kwargs.pop("coordination_group", twins[pp]),
                               settings=Settings(**kwargs))
           for name, kwargs in ((name, dict(run)) for name, run in RRFP_RUNS.items())},
    }
    times = {name: [] for name in SCHEDULES}
    hashes = {name: [] for name in SCHEDULES}
    stats = {name: [] for name in RRFP_RUNS}
    imbalance = []
    for step in range(config.steps + 1):  # step 0 warms up (shape inference)
        x = documents(step, ep, M)
        target = torch.zeros_like(x)
        for name in SCHEDULES:
            for stage in built[name]:
                stage.submod.zero_grad()
                stage.submod.imbalance.clear()
            dist.barrier()
            start = time.perf_counter()
            schedules[name].step(*((x,) if pp == 0 else ()), target=target)
            dist.barrier()
            if step == 0:
                continue
            times[name].append(time.perf_counter() - start)
            hashes[name].append([_grad_hash(stage.submod) for stage in built[name]])
            if name in RRFP_RUNS:
                stats[name].append(schedules[name].last_step_stats)
        if step > 0:
            imbalance += [v for stage in built[TORCH] for v in stage.submod.imbalance]
    for name in RRFP_RUNS:
        schedules[name].close()
    return {"rank": rank, "pp": pp, "ep": ep, "times": times, "hashes": hashes, "stats": stats,
            "imbalance": imbalance, "policy": {n: schedules[n].policy for n in RRFP_RUNS}}


def _median(values) -> float:
    return statistics.median(list(values))


def _study(config: Config, hint: str) -> list[str]:
    """Run one hint's A/B world; its section of the page."""
    started = time.time()
    ranks = run_local_world(PP * EP, _rank_main, config, hint, timeout=900)
    wall = time.time() - started
    M, per_rank = config.microbatches, HINTS[hint]
    tokens_per_step = M * TOKENS_PER_DOCUMENT * EP
    step_ms = {name: _median(ranks[0]["times"][name]) * 1e3 for name in SCHEDULES}
    ratios = {name: _median(f / r for f, r in zip(ranks[0]["times"][TORCH], ranks[0]["times"][name]))
              for name in SCHEDULES}
    bitwise = all(r["hashes"][name] == r["hashes"][TORCH] for r in ranks for name in SCHEDULES)
    imbalance = [v for r in ranks if r["ep"] == 0 for v in r["imbalance"]]

    # The replay: EP rank 0's pipeline (global ranks 0 and 2), each measured step.
    pipeline = [r for r in ranks if r["ep"] == 0]
    measured_hint = build_hint(hint, num_ranks=PP, num_stages=PP * per_rank, n_microbatches=M)
    sim_rows, timings = {}, []
    for name in REPLAYED:
        steps = [timing_from_trace({"traceEvents": [e for r in pipeline
                                                    for e in r["stats"][name][k].chrome_trace_events()]})
                 for k in range(config.steps)]
        timings += steps
        policy, limit = ranks[0]["policy"][name], name.split()[1]
        predicted = [compare(measured_hint, t, 0, limit=limit, policy=policy) for t in steps]
        sim_rows[name] = (_median(p.fixed.makespan for p in predicted) * 1e3,
                          _median(p.rrfp.makespan for p in predicted) * 1e3,
                          _median(p.speedup for p in predicted), policy)
    write_chrome_trace([r["stats"]["RRFP hint"][-1] for r in pipeline], result_path(trace_name(hint)))
    large_hint = build_hint(hint, num_ranks=LARGE_PP, num_stages=LARGE_PP * per_rank,
                            n_microbatches=LARGE_MICROBATCHES)
    large = {}
    for limit in ("hint", "hint+2"):
        rows = [compare(large_hint, resample(timings, LARGE_PP * per_rank, LARGE_MICROBATCHES, seed),
                        0, limit=limit) for seed in range(config.simulated_seeds)]
        large[limit] = ([r.speedup for r in rows], rows[0].policy,
                        _median(r.fixed.makespan for r in rows) * 1e3,
                        _median(r.rrfp.makespan for r in rows) * 1e3)

    def column(name: str, field: str, fmt: str, scale: float = 1.0) -> str:
        return " / ".join(format(_median(getattr(s, field) for s in r["stats"][name]) * scale, fmt)
                          for r in ranks)

    torch_name = "Schedule1F1B" if per_rank == 1 else "ScheduleInterleaved1F1B"
    lines = [
        f"## Hint {hint} ({per_rank} stage{'s' if per_rank > 1 else ''} per rank; torch's "
        f"`{torch_name}`)",
        "",
        f"{wall:.0f} s. Routing imbalance (busiest EP rank's tokens over the mean, per stage "
        f"and microbatch): median {_median(imbalance):.2f}, range {min(imbalance):.2f}-"
        f"{max(imbalance):.2f}. Gradients after each step, every stage on every rank: "
        + (f"**bitwise equal** to torch's `{torch_name}` for every schedule and step." if bitwise
           else f"**differ** from torch's `{torch_name}`: a bug."),
        "",
        "| schedule | policy | median step ms | tokens/s | speedup over torch (median of "
        "per-step ratios) | out-of-hint actions per step (ranks 0-3) | coordination rounds "
        "per step | coordination ms per step (ranks 0-3; 0 and 2 lead) | idle % (ranks 0-3) | "
        "peak activation KiB (ranks 0-3, byte meter) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in SCHEDULES:
        tokens_s = f"{tokens_per_step / (step_ms[name] / 1e3):.0f}"
        if name == TORCH:
            lines.append(f"| torch `{torch_name}` | fixed | {step_ms[name]:.0f} | {tokens_s} | "
                         "1.000 | - | - | - | - | - |")
            continue
        lines.append(
            f"| {name} | {ranks[0]['policy'][name]} | {step_ms[name]:.0f} | {tokens_s} | "
            f"{ratios[name]:.3f} | {column(name, 'out_of_hint_order', '.0f')} | "
            f"{_median(s.coordination_rounds for r in ranks for s in r['stats'][name]):.0f} | "
            f"{column(name, 'coordination_time', '.1f', 1e3)} | "
            f"{column(name, 'idle_fraction', '.0f', 100)} | "
            f"{column(name, 'peak_activation_bytes', '.0f', 1 / 1024)} |")
    lines += [
        "",
        f"Simulated from the measured traces (each measured step of {', '.join(REPLAYED)}: "
        f"EP rank 0's pipeline, global ranks 0 and 2, converted with "
        "`rrfp.sim.replay.timing_from_trace`; fixed order vs RRFP at the same policy and "
        f"limit; medians over the steps). {LARGE_PP} x {LARGE_MICROBATCHES}: {config.simulated_seeds} "
        "steps resampled from all those steps' cells (`resample`). Replay the last step: "
        f"`python -m rrfp.sim.replay benchmarks/results/{trace_name(hint)} -o outputs/ep.json "
        f"&& python -m rrfp.sim --replay outputs/ep.json --hint {hint} --limit hint+2`.",
        "",
        "| ranks x microbatches | limit | policy | sim fixed ms | sim RRFP ms | sim speedup "
        "| measured speedup over RRFP's fixed order (coordinated) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, (fixed, rrfp, speedup, policy) in sim_rows.items():
        own = _median(f / r for f, r in zip(ranks[0]["times"]["RRFP fixed order"], ranks[0]["times"][name]))
        lines.append(f"| {PP} x {M} | {name.split()[1]} | {policy} | {fixed:.0f} | {rrfp:.0f} | "
                     f"{speedup:.3f} | {own:.3f} |")
    for limit, (speedups, policy, fixed, rrfp) in large.items():
        lines.append(
            f"| {LARGE_PP} x {LARGE_MICROBATCHES} (resampled) | {limit} | {policy} | {fixed:.0f} | "
            f"{rrfp:.0f} | {statistics.mean(speedups):.3f} (min {min(speedups):.3f}, max "
            f"{max(speedups):.3f}) | - |")
    return lines + [""]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--microbatches", type=int, default=Config.microbatches)
    parser.add_argument("--steps", type=int, default=Config.steps)
    parser.add_argument("--hints", nargs="+", choices=list(HINTS), default=list(HINTS))
    args = parser.parse_args(argv)
    config = Config(microbatches=args.microbatches, steps=args.steps)
    started = time.time()
    sections = [line for hint in args.hints for line in _study(config, hint)]
    lines = [
        "# Expert imbalance under PP x EP: RRFP vs torch's fixed schedules (measured, emulated device time)",
        "",
        f"Regenerate with `python -m benchmarks.ep_imbalance_bench` ({time.time() - started:.0f} s "
        f"on this 2-core CPU machine, torch {torch.__version__}, gloo, 4 processes).",
        "",
        *[line for paragraph in __doc__.split("\n", 2)[2].split("Writes")[0].strip().split("\n\n")
          for line in (paragraph.replace("\n", " "), "")],
        f"{config.microbatches} microbatches of {TOKENS_PER_DOCUMENT} "
        f"tokens per replica, {config.microbatches * TOKENS_PER_DOCUMENT * EP} "
        f"tokens per step; {config.steps} measured steps after a warm-up step; expert time "
        f"{config.expert_ms_per_token} ms per token a rank receives (emulated), dense part "
        f"{config.dense_ms} ms per microbatch and rank (emulated), backward 2x. Step time: "
        "global rank 0, between world barriers; tokens/s from the median step. Simulated "
        "figures count no coordination and no per-action overhead; the resampled "
        f"{LARGE_PP}-rank steps draw each (stage, microbatch)'s (F, I, W) durations jointly from "
        "one measured cell and each link latency from the measured ones, independently (`python "
        "-m rrfp.sim.replay TRACE --resample 8x32 --seed N`, 16x32 for two stages per rank): "
        "the measured spread of "
        "per-microbatch imbalance at a larger pipeline, assuming layers route independently.",
        "",
        *sections,
    ]
    print(f"wrote {write_page('ep_imbalance.md', lines)}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
