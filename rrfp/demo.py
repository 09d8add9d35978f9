"""Demo: torch's fixed schedule vs ScheduleRRFP with one slow microbatch, on CPU/gloo.

    python -m rrfp.demo                      # 2 ranks, GPipe hint, microbatch 4 slow
    python -m rrfp.demo --hint 1F1B --ranks 4 --limit hint+2

Stage compute is *emulated device time* (each forward/backward sleeps), so the figures
show the schedules, not this machine's cores. Writes a Chrome/Perfetto trace of the last
RRFP step of every rank.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping
from torch.distributed.pipelining.schedules import get_schedule_class, PipelineScheduleSingle

from rrfp import ScheduleRRFP, write_chrome_trace
from rrfp.core.hints import build_hint, infer_layout, rule_reference
from rrfp.core.settings import BUFFER_LIMIT_HELP, Settings
from rrfp.core.text import counted
from rrfp.testing.emulation import EmulatedDeviceTime
from rrfp.testing.worlds import run_local_world

DIM = 64


def _build(args, rank: int, world_size: int, layout: str):
    num_stages = world_size * args.stages_per_rank
    mapping = generate_stage_to_rank_mapping(world_size, num_stages, style=layout)
    stages = []
    for s in (s for s in range(num_stages) if mapping[s] == rank):
        torch.manual_seed(s)
        block = torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.Tanh())

        def forward_time(mb: int, s=s) -> float:
            return args.slow_s if (s == 0 and mb == args.slow_mb) else args.forward_s

        backward_s = args.head_backward_s if s == num_stages - 1 else args.forward_s
        timed = EmulatedDeviceTime(block, args.microbatches, forward_time,
                                   lambda mb, b=backward_s: b)
        stages.append(PipelineStage(timed, s, num_stages, torch.device("cpu")))
    return stages


def _rank_main(rank: int, world_size: int, args):
    num_stages = world_size * args.stages_per_rank
    layout = "v" if args.hint in ("ZBVZeroBubble", "DualPipeV") else "loop"
    torch.manual_seed(0)
    x = torch.randn(args.microbatches * 4, DIM)
    y = torch.randn(args.microbatches * 4, DIM)
    loss_fn = torch.nn.functional.mse_loss

    fixed_stages = _build(args, rank, world_size, layout)
    hint = build_hint(args.hint, num_ranks=world_size, num_stages=num_stages,
                      n_microbatches=args.microbatches,
                      layout=infer_layout(rank, world_size, num_stages,
                                          [s.stage_index for s in fixed_stages]))
    fixed_class = (get_schedule_class(hint.name) if hint.policy == "hint"
                   else rule_reference(hint.name, layout, args.stages_per_rank))
    fixed = fixed_class(fixed_stages[0] if issubclass(fixed_class, PipelineScheduleSingle)
                        else fixed_stages, args.microbatches, loss_fn=loss_fn)
    rrfp_stages = _build(args, rank, world_size, layout)
    # Plain readiness-first for schedule hints (the default lookahead guard would not bet
    # on a microbatch that was never slow before); the rules keep their own policy.
    policy = args.policy or ("hint" if hint.policy == "hint" else hint.policy)
    rrfp = ScheduleRRFP(rrfp_stages, args.microbatches, loss_fn=loss_fn, hint=args.hint,
                        settings=Settings(buffer_limit=args.limit, policy=policy))
    times: dict[str, list[float]] = {"fixed": [], "rrfp": []}
    for step in range(args.steps + 1):  # step 0 warms up (shape inference)
        for name, schedule, stages in (("fixed", fixed, fixed_stages), ("rrfp", rrfp, rrfp_stages)):
            dist.barrier()
            start = time.perf_counter()
            if any(s.is_first for s in stages):
                schedule.step(x, target=y)
            else:
                schedule.step(target=y)
            if step == 0:
                for stage in stages:
                    stage.submod.reset()  # shape inference ran one extra forward
            else:
                times[name].append(time.perf_counter() - start)
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, rrfp.last_step_stats)
    return fixed_class.__name__, rrfp.policy, times, gathered


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--stages-per-rank", type=int, default=1)
    parser.add_argument("--hint", default="GPipe")
    parser.add_argument("--limit", default="hint", help=f"buffer_limit: {BUFFER_LIMIT_HELP}")
    parser.add_argument("--policy", default="",
                        help="arbitration policy (default here: plain readiness-first, or the "
                             "rule of a BF/BFW hint)")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--forward-s", type=float, default=0.02,
                        help="emulated forward (and backward) time per microbatch and stage")
    parser.add_argument("--head-backward-s", type=float, default=0.1,
                        help="emulated backward time of the last stage (a heavy head)")
    parser.add_argument("--slow-mb", type=int, default=4)
    parser.add_argument("--slow-s", type=float, default=0.6,
                        help="emulated forward time of the slow microbatch on stage 0")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--trace", default="rrfp_demo_trace.json")
    args = parser.parse_args(argv)

    fixed_name, policy, times, stats = run_local_world(args.ranks, _rank_main, args, timeout=600)[0]
    write_chrome_trace(stats, args.trace)
    fixed_s, rrfp_s = statistics.median(times["fixed"]), statistics.median(times["rrfp"])
    print(f"{counted(args.ranks, 'rank')} x {counted(args.stages_per_rank, 'stage')}, "
          f"{counted(args.microbatches, 'microbatch')}, "
          f"stage 0 forward of microbatch {args.slow_mb} takes {args.slow_s} s "
          f"(emulated device time; median of {args.steps} steps)")
    print(f"  torch {fixed_name:<28} {fixed_s * 1e3:8.1f} ms")
    print(f"  ScheduleRRFP(hint={args.hint!r}, settings=Settings(buffer_limit={args.limit!r}, "
          f"policy={policy!r}))"
          f" {rrfp_s * 1e3:8.1f} ms   speedup {fixed_s / rrfp_s:.2f}x")
    for s in stats:
        print("  " + s.summary())
    print(f"trace of the last RRFP step: {os.path.abspath(args.trace)} (open in ui.perfetto.dev)")


if __name__ == "__main__":
    main()
