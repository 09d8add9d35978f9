"""Memory a rank really holds: receive buffers and activations, torch's schedules vs RRFP.

    python -m benchmarks.memory_bench        # writes results/memory.md (~1 min)

4 CPU processes (gloo). Stage blocks: a copy of the input (which saves nothing), Linear 256
x 256 and Tanh, float32, 32 rows per microbatch: each message is 32 KiB and each
microbatch holds 64 KiB of activations per stage. **Receive buffers**: torch's stages
allocate one per microbatch for every input and gradient they receive (counted from the
stages after a step); ScheduleRRFP keeps a ring per incoming channel
(``StepStats.receive_buffer_bytes``). **Activations**: bytes of saved tensors alive at once,
measured on the tensors (``rrfp.runtime.meter.ActivationMeter``: around torch's stage modules,
inside ScheduleRRFP for RRFP), the most over two steps, per rank. **What the meter costs**
(one process, one thread): forwards of a chain of Linear + Tanh blocks with 16 microbatches
in flight, then their backwards, with plain autograd and under the meter (sampled after each
forward, as ScheduleRRFP does), alternating, median of 15 rounds each after a warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping
from torch.distributed.pipelining.schedules import get_schedule_class, PipelineScheduleSingle

from benchmarks.pages import write_page
from rrfp import ScheduleRRFP, Settings
from rrfp.runtime.meter import ActivationMeter, MeteredModule
from rrfp.testing.worlds import run_local_world

DIM, ROWS = 256, 32


class _CopyThen(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(torch.clone(x))


def _stages(rank: int, world: int, per_rank: int, meter: ActivationMeter | None):
    num_stages = world * per_rank
    mapping = generate_stage_to_rank_mapping(world, num_stages, style="loop")
    stages = []
    for s in (s for s in range(num_stages) if mapping[s] == rank):
        torch.manual_seed(s)
        block = _CopyThen(torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.Tanh()))
        module = MeteredModule(block, meter) if meter is not None else block
        stages.append(PipelineStage(module, s, num_stages, torch.device("cpu")))
    return stages


def _torch_receive_bytes(stages) -> int:
    seen: dict[int, int] = {}
    for stage in stages:
        for table in (stage.args_recv_info, stage.grad_recv_info):
            for infos in table.values():
                for info in infos:
                    if getattr(info, "buffer", None) is not None:
                        seen[id(info.buffer)] = info.buffer.numel() * info.buffer.element_size()
    return sum(seen.values())


def _rank_main(rank: int, world: int, hint: str, per_rank: int, M: int) -> dict:
    x = torch.randn(M * ROWS, DIM)
    y = torch.randn(M * ROWS, DIM)
    first = rank == 0

    def run(schedule, steps=2):
        for _ in range(steps):
            schedule.step(*((x,) if first else ()), target=y, return_outputs=False)

    meter = ActivationMeter()
    stages = _stages(rank, world, per_rank, meter)
    cls = get_schedule_class(hint)
    fixed = cls(stages[0] if issubclass(cls, PipelineScheduleSingle) else stages, M,
                loss_fn=torch.nn.functional.mse_loss)
    run(fixed)
    result = {"torch_receive": _torch_receive_bytes(stages), "torch_activations": meter.peak}
    for limit in ("hint", "hint+2"):
        rrfp = ScheduleRRFP(_stages(rank, world, per_rank, None), M,
                            loss_fn=torch.nn.functional.mse_loss, hint=hint,
                            settings=Settings(buffer_limit=limit, meter_every=1))
        peaks = []
        for _ in range(2):
            run(rrfp, 1)
            peaks.append(rrfp.last_step_stats.peak_activation_bytes)
        result[f"rrfp_receive {limit}"] = rrfp.last_step_stats.receive_buffer_bytes
        result[f"rrfp_activations {limit}"] = max(peaks)
        rrfp.close()
    dist.barrier()
    return result


def _meter_cost(rows: int, width: int, depth: int, in_flight: int = 16,
                rounds: int = 15) -> tuple[float, float, int]:
    """(plain, metered) seconds per forward + backward, and the tensors saved per forward."""
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh())
              for _ in range(depth)]
    chain = torch.nn.Sequential(*blocks)
    inputs = [torch.randn(rows, width) for _ in range(in_flight)]
    counted = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: counted.append(1) or t, lambda t: t):
        chain(inputs[0])
    meter = ActivationMeter()
    meter.reset(chain.parameters())

    def one_round(metered: bool) -> float:
        start = time.perf_counter()
        losses = []
        for x in inputs:
            if metered:
                with meter.saving():
                    losses.append(chain(x).sum())
                meter.sample()
            else:
                losses.append(chain(x).sum())
        for loss in losses:
            loss.backward()
        return (time.perf_counter() - start) / in_flight

    one_round(False), one_round(True)
    plain, metered = [], []
    for _ in range(rounds):
        plain.append(one_round(False))
        metered.append(one_round(True))
    return statistics.median(plain), statistics.median(metered), len(counted)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--microbatches", type=int, nargs="*", default=[8, 32, 64])
    args = parser.parse_args(argv)
    started = time.time()
    KiB = 1024
    lines = [
        "# Memory per rank: torch's fixed schedule vs ScheduleRRFP (measured)",
        "",
        "Regenerate with `python -m benchmarks.memory_bench`. See the module docstring for "
        "the method. KiB per rank, ranks 0-3 separated by slashes.",
        "",
        "| hint | ranks x stages | microbatches | receive buffers: torch | RRFP hint | RRFP "
        "hint+2 | activations: torch | RRFP hint | RRFP hint+2 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for hint, per_rank in (("1F1B", 1), ("Interleaved1F1B", 2)):
        for M in args.microbatches:
            ranks = run_local_world(4, _rank_main, hint, per_rank, M, timeout=600)

            def col(key: str) -> str:
                return " / ".join(f"{r[key] / KiB:.0f}" for r in ranks)

            lines.append(
                f"| {hint} | 4 x {per_rank} | {M} | {col('torch_receive')} | "
                f"{col('rrfp_receive hint')} | {col('rrfp_receive hint+2')} | "
                f"{col('torch_activations')} | {col('rrfp_activations hint')} | "
                f"{col('rrfp_activations hint+2')} |")
            print(lines[-1], flush=True)
    lines += [
        "",
        "torch's receive buffers grow with the number of microbatches (one per microbatch "
        "and input or gradient); RRFP's with the memory limit (the stage's limit + 1 "
        "activation slots and as many gradient slots as the limit, per channel). torch's "
        "schedules also keep every sent activation until the step ends, which its measured "
        "activation bytes include; RRFP lets a sent tensor go when its send completes.",
        "",
        "## What the meter costs (CPU time per microbatch, forward and backward)",
        "",
        "| blocks x rows x width | tensors saved per forward | plain autograd | under the "
        "meter | difference | per saved tensor |",
        "|---|---|---|---|---|---|",
    ]
    torch.set_num_threads(1)
    for rows, width, depth in ((8, 64, 200), (32, 1024, 16)):
        plain, metered, saved = _meter_cost(rows, width, depth)
        lines.append(f"| {depth} x {rows} x {width} | {saved} | {plain * 1e3:.2f} ms | "
                     f"{metered * 1e3:.2f} ms | {metered / plain - 1:+.0%} | "
                     f"{(metered - plain) / saved * 1e6:+.1f} us |")
        print(lines[-1], flush=True)
    lines += ["", f"({time.time() - started:.0f} s on this 2-core machine.)"]
    print(f"wrote {write_page('memory.md', lines)}")


if __name__ == "__main__":
    main()
