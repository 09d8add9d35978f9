"""Coordination cost: python -m benchmarks.coordination_bench [--save-before]

Two measurements on 4 gloo processes, CPU only:

1. **Per action** (the coordinators alone): every rank of a coordination group of 2 or 4
   members settles the 2M actions of a one-stage GPipe hint (M = 32, every action ready)
   and "runs" each for 1 ms of **emulated device time** (a sleep), under "leader" and
   "agree". Reported: the median over ranks of the settle time per action, the leader
   and the followers apart (the leader's includes nothing it waits for; a follower's
   includes waiting for the leader's decision, which the leader publishes while the
   follower is still running the previous action).
2. **Per step** (end to end): PP 2 x TP 2 (a DTensor column/row-parallel MLP per stage)
   and PP 2 x EP 2 (torchtitan's MoE, its experts sharded over the EP group), hint
   Interleaved1F1B, 8 microbatches, stage compute **emulated**: 10 ms forward, 20 ms
   backward per microbatch, lognormal jitter (sigma 0.3) drawn separately on each rank of
   a TP/EP group; torch's fixed Interleaved1F1B vs ScheduleRRFP (plain readiness-first,
   limit hint+1) under "leader" (now and before, see below) and "agree", alternating
   per step, 6 steps after a warm-up.

Before/after in one run: ``--before <commit>`` (default ``BEFORE_COMMIT``, the code before
the follower posted its receives ahead on a private group) loads that commit's
``rrfp/comm/coordination.py`` (``git show``) and runs its "leader" next to the current one,
interleaved, on the same machine load; in the per-step runs the schedule then builds that
coordinator over the user's group, as that code did. Writes
benchmarks/results/coordination.md.
"""

from __future__ import annotations

import math
import os
import random
import statistics
import subprocess
import sys
import time
import types

import torch
import torch.distributed as dist

from benchmarks.pages import write_page
import rrfp.runtime.pipeline
from rrfp import ScheduleRRFP, Settings
from rrfp.comm.coordination import make_coordinator
from rrfp.core.arbiter import Arbiter
from rrfp.core.hints import build_hint
from rrfp.core.policy import make_policy
from rrfp.testing.emulation import EmulatedDeviceTime
from rrfp.testing.worlds import run_local_world

M, STEPS, UNIT = 8, 6, 0.01
ACTION_S, PER_ACTION_MICROBATCHES, REPEATS = 0.001, 32, 3
BEFORE_COMMIT = "045456b"
KINDS = ("leader", "leader@before", "agree")


def _coordination_at(commit: str) -> types.ModuleType:
    """``rrfp/comm/coordination.py`` as it was at ``commit``, as a module of its own."""
    source = subprocess.run(["git", "show", f"{commit}:rrfp/comm/coordination.py"], check=True,
                            capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.abspath(__file__))).stdout
    module = types.ModuleType(f"rrfp_coordination_{commit}")
    exec(compile(source, f"{commit}:rrfp/comm/coordination.py", "exec"), module.__dict__)
    return module


def _coordinator(kind: str, group: dist.ProcessGroup, before: types.ModuleType):
    if kind.endswith("@before"):
        return before.make_coordinator(kind.split("@")[0], group, 60)
    return make_coordinator(kind, group, 60)


def _settle_all(coordinator) -> float:
    """Settle every action of a one-stage GPipe hint; seconds per action."""
    hint = build_hint("GPipe", num_ranks=1, num_stages=1, n_microbatches=PER_ACTION_MICROBATCHES)
    arbiter = Arbiter(hint, 0, policy=make_policy("hint"))
    settling = 0.0
    while not arbiter.finished:
        start = time.perf_counter()
        choice = arbiter.choose() if coordinator.needs_choice else None
        action = coordinator.settle(choice, arbiter, time.sleep)
        settling += time.perf_counter() - start
        if action is not None:
            time.sleep(ACTION_S)  # the action's emulated device time
            arbiter.record_launch(action)
    coordinator.finish()
    return settling / len(arbiter.nodes)


def _per_action(rank: int, world_size: int, commit: str) -> dict:
    before = _coordination_at(commit)
    pairs = [dist.new_group([0, 1], backend="gloo"), dist.new_group([2, 3], backend="gloo")]
    everyone = dist.new_group(list(range(world_size)), backend="gloo")
    samples: dict[str, list[float]] = {}
    for size, group in ((2, pairs[rank // 2]), (4, everyone)):
        role = "leader" if dist.get_group_rank(group, rank) == 0 else "follower"
        coordinators = {kind: _coordinator(kind, group, before) for kind in KINDS}
        for _ in range(REPEATS):
            for kind, coordinator in coordinators.items():
                dist.barrier()
                samples.setdefault(f"{kind}/{size}/{role}", []).append(_settle_all(coordinator))
                # A coordinator serves one step; a fresh one of the same group for the next.
                coordinators[kind] = _coordinator(kind, coordinator.group if not kind.endswith(
                    "@before") else group, before)
    return {key: statistics.median(values) for key, values in samples.items()}


def _tp_stages(mesh, pp: int, jitter):
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, parallelize_module, RowwiseParallel)

    built = []
    for s in (pp, pp + 2):
        torch.manual_seed(s)
        block = torch.nn.Sequential()
        block.add_module("up", torch.nn.Linear(64, 128))
        block.add_module("act", torch.nn.Tanh())
        block.add_module("down", torch.nn.Linear(128, 64))
        block = parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        timed = EmulatedDeviceTime(block, M, lambda mb: UNIT * jitter(), lambda mb: 2 * UNIT * jitter())
        built.append(PipelineStage(timed, s, 4, torch.device("cpu"), group=mesh["pp"].get_group()))
    return built


def _ep_stages(mesh, pp: int, jitter):
    from torch.distributed.pipelining import PipelineStage
    from rrfp.testing.moe import make_moe_block, shard_experts

    built = []
    for s in (pp, pp + 2):
        block = shard_experts(make_moe_block(seed=s), mesh["tp"])
        timed = EmulatedDeviceTime(block, M, lambda mb: UNIT * jitter(), lambda mb: 2 * UNIT * jitter())
        built.append(PipelineStage(timed, s, 4, torch.device("cpu"), group=mesh["pp"].get_group()))
    return built


def _per_step(rank: int, world_size: int, parallel: str, commit: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B

    if parallel == "ep":
        from rrfp.testing.moe import make_batch, use_cpu_moe_paths

        use_cpu_moe_paths()
    # The intra-stage dimension is named "tp" for both; for EP it carries the experts.
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pp, inner = mesh["pp"].get_local_rank(), mesh["tp"].get_local_rank()
    group = mesh["tp"].get_group()
    rng = random.Random(rank)

    def jitter() -> float:
        return math.exp(rng.gauss(-0.045, 0.3))

    build = _tp_stages if parallel == "tp" else _ep_stages
    loss_fn = torch.nn.functional.mse_loss
    before = _coordination_at(commit)
    runs = {"fixed": (s := build(mesh, pp, jitter), ScheduleInterleaved1F1B(s, M, loss_fn=loss_fn))}
    for mode in KINDS:
        s = build(mesh, pp, jitter)
        runs[mode] = (s, ScheduleRRFP(s, M, loss_fn=loss_fn, hint="Interleaved1F1B",
                                      coordination_group=group,
                                      settings=Settings(buffer_limit="hint+1", policy="hint",
                                                        coordination=mode.split("@")[0])))
    if parallel == "tp":
        x, y = torch.randn(M * 2, 64), torch.randn(M * 2, 64)
    else:
        x, y = make_batch(inner, M)
    times = {k: [] for k in runs}
    per_step = {k: [] for k in runs if k != "fixed"}
    for step in range(STEPS + 1):
        for name, (st, schedule) in runs.items():
            # The code before built its coordinator over the user's group at each step.
            rrfp.runtime.pipeline.make_coordinator = (
                (lambda kind, _twin, timeout: before.make_coordinator(kind, group, timeout))
                if name.endswith("@before") else make_coordinator)
            dist.barrier()
            start = time.perf_counter()
            schedule.step(*((x,) if pp == 0 else ()), target=y)
            dist.barrier()
            if step == 0:
                for stage in st:
                    stage.submod.reset()
                continue
            times[name].append(time.perf_counter() - start)
            if name != "fixed":
                stats = schedule.last_step_stats
                per_step[name].append((stats.coordination_rounds, stats.coordination_deferrals,
                                       stats.coordination_time, stats.dispatched))
    return {"inner": inner, "times": times, "per_step": per_step}


def measure(commit: str) -> dict:
    figures: dict = {"per_action": {}, "per_step": {}}
    ranks = run_local_world(4, _per_action, commit, timeout=600)
    for key in {k for r in ranks for k in r}:
        figures["per_action"][key] = statistics.median(r[key] for r in ranks if key in r) * 1e6
    for parallel in ("tp", "ep"):
        ranks = run_local_world(4, _per_step, parallel, commit, timeout=900)
        rows = {"fixed": {"step_ms": statistics.median(ranks[0]["times"]["fixed"]) * 1e3}}
        for mode in KINDS:
            leaders = [r for r in ranks if r["inner"] == 0]
            followers = [r for r in ranks if r["inner"] == 1]

            def median(group, index):
                return statistics.median(s[index] for r in group for s in r["per_step"][mode])

            rows[mode] = {
                "step_ms": statistics.median(ranks[0]["times"][mode]) * 1e3,
                "rounds": median(ranks, 0), "deferrals": median(ranks, 1),
                "settle_ms": (median(leaders, 2) * 1e3, median(followers, 2) * 1e3),
            }
        figures["per_step"][parallel] = rows
    return figures


def _label(kind: str, commit: str) -> str:
    return (f"{kind.split('@')[0]}, before (commit {commit})" if kind.endswith("@before")
            else f"{kind}, now")


def page(figures: dict, commit: str, seconds: float) -> list[str]:
    lines = [
        "# Coordination cost: leader-decides vs agree-on-proposals (measured, emulated device time)",
        "",
        __doc__.split("\n", 2)[2].split("Before/after in one run")[0].strip(),
        "",
        f"Before/after in one run: \"before\" is the leader coordinator of commit {commit} "
        "(a follower posts the receive of a decision only when it needs it, over the user's "
        "group), \"now\" this code's (posted ahead, over a private twin); they alternate "
        f"on the same machine load. Machine: this CPU box (2 shared cores), gloo; "
        f"{seconds:.0f} s in all (`python -m benchmarks.coordination_bench --before {commit}`).",
        "",
        f"## Per action (us of settle time per action, median of {REPEATS} runs x ranks; "
        f"{ACTION_S * 1e3:g} ms emulated compute per action)",
        "",
        "| coordination | members | leader | followers |",
        "|---|---|---|---|",
    ]
    for kind in KINDS:
        for size in ("2", "4"):
            cells = [f"{figures['per_action'][f'{kind}/{size}/{role}']:.0f}"
                     for role in ("leader", "follower")]
            lines.append(f"| {_label(kind, commit)} | {size} | {cells[0]} | {cells[1]} |")
    for parallel, title in (("tp", "PP 2 x TP 2"), ("ep", "PP 2 x EP 2 (torchtitan MoE)")):
        rows = figures["per_step"][parallel]
        lines += [
            "",
            f"## Per step, {title}",
            "",
            "| schedule | median step ms | settlements per step | deferrals per step | settle ms per step (leader / followers) |",
            "|---|---|---|---|---|",
            f"| torch Interleaved1F1B | {rows['fixed']['step_ms']:.0f} | - | - | - |",
        ]
        for mode in KINDS:
            row = rows[mode]
            lines.append(
                f"| RRFP, {_label(mode, commit)} | {row['step_ms']:.0f} | {row['rounds']:.0f} | "
                f"{row['deferrals']:.0f} | {row['settle_ms'][0]:.1f} / {row['settle_ms'][1]:.1f} |")
    lines += [
        "",
        "Settle time counts everything spent settling an action: the collective, and for a "
        "follower (or after a deferral) the wait until the leader decides or new input "
        "arrives; it is not all overhead. Step times on a shared 2-core machine vary by a "
        "few percent between runs.",
    ]
    return lines


def main() -> None:
    commit = sys.argv[sys.argv.index("--before") + 1] if "--before" in sys.argv else BEFORE_COMMIT
    started = time.time()
    figures = measure(commit)
    lines = page(figures, commit, time.time() - started)
    write_page("coordination.md", lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
