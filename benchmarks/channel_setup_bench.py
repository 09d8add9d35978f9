"""Channel set-up time against world size (gloo, CPU processes on one machine).

    python -m benchmarks.channel_setup_bench     # writes results/channel_setup.md (~2 min)

Every pipeline edge and direction gets a channel of its own (a 2-rank communicator).
*rrfp* (now): only a channel's two ranks create it, under a deterministic name, and
connect it with one message, in one canonical order (``rrfp.comm.channels.create_channels``).
*new_group* (before): every rank of the world called ``dist.new_group`` for every channel
of every pipeline, members or not. Measured per rank (maximum over ranks) with one
pipeline of the whole world (PP = world) and with pipelines of 2 ranks (PP 2 x DP world/2),
on a TCPStore as under torchrun. Larger worlds are extrapolated from the per-call costs
measured here, and labelled so.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from benchmarks.pages import write_page
from rrfp.comm.channels import create_channels
from rrfp.core.hints import build_hint
from rrfp.testing.worlds import run_local_world



def _rank_main(rank: int, world_size: int, pp: int) -> dict:
    pipelines = [list(range(start, start + pp)) for start in range(0, world_size, pp)]
    groups = [dist.new_group(ranks) for ranks in pipelines]
    mine = groups[rank // pp]
    hint = build_hint("1F1B", num_ranks=pp, num_stages=pp, n_microbatches=pp)

    dist.barrier()
    start = time.perf_counter()
    seconds = {True: [], False: []}  # per call, by whether this rank is a member
    for ranks in pipelines:
        for edge in hint.plan.remote_edges:
            members = sorted({ranks[edge.src], ranks[edge.dst]})
            call = time.perf_counter()
            dist.new_group(members)
            seconds[rank in members].append(time.perf_counter() - call)
    old = time.perf_counter() - start

    dist.barrier()
    start = time.perf_counter()
    channels = create_channels(hint, mine, torch.device("cpu"), "gloo")
    new = time.perf_counter() - start
    dist.barrier()
    for channel in channels.values():
        channel.shutdown()
    return {"old": old, "old_calls": len(seconds[True]) + len(seconds[False]),
            "member_s": seconds[True], "non_member_s": seconds[False],
            "new": new, "new_channels": len(channels)}


def measure(world_size: int, pp: int) -> dict:
    ranks = run_local_world(world_size, _rank_main, pp, timeout=600, store="tcp")
    return {
        "world": world_size, "pp": pp, "pipelines": world_size // pp,
        "old_s": max(r["old"] for r in ranks), "old_calls": ranks[0]["old_calls"],
        "new_s": max(r["new"] for r in ranks),
        "new_channels": max(r["new_channels"] for r in ranks),
        "new_per_channel_s": statistics.median(r["new"] / max(1, r["new_channels"]) for r in ranks),
        "member_s": [s for r in ranks for s in r["member_s"]],
        "non_member_s": [s for r in ranks for s in r["non_member_s"]],
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", type=int, nargs="*", default=[4, 8, 16])
    args = parser.parse_args(argv)
    started = time.time()
    rows = []
    for world in args.worlds:
        for pp in sorted({world, 2}):
            row = measure(world, pp)
            rows.append(row)
            print(f"world {world:3d}, PP {pp:3d} x {row['pipelines']:2d} pipelines: new_group "
                  f"{row['old_s'] * 1e3:7.1f} ms ({row['old_calls']} calls per rank), rrfp "
                  f"{row['new_s'] * 1e3:7.1f} ms ({row['new_channels']} channels per rank)",
                  flush=True)
    member = statistics.median(s for r in rows for s in r["member_s"])
    non_member = statistics.median(s for r in rows for s in r["non_member_s"])
    per_channel = statistics.median(r["new_per_channel_s"] for r in rows)
    # PP 64 x DP 8, one stage per rank: 126 channels per pipeline, 4 with a given rank.
    old_extrapolated = 4 * member + (8 * 126 - 4) * non_member
    lines = [
        "# Channel set-up time against world size (gloo, measured)",
        "",
        f"Regenerate with `python -m benchmarks.channel_setup_bench` ({time.time() - started:.0f} s "
        "on this 2-core machine; up to 16 processes share its 2 cores, so the figures are "
        "upper bounds). See the module docstring for the method. Times: the slowest rank.",
        "",
        "| world | PP x pipelines | new_group (before): calls per rank | ms | rrfp (now): "
        "channels per rank | ms |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['world']} | {r['pp']} x {r['pipelines']} | {r['old_calls']} | "
                     f"{r['old_s'] * 1e3:.1f} | {r['new_channels']} | {r['new_s'] * 1e3:.1f} |")
    lines += [
        "",
        f"Per call, median over all runs: `new_group` {member * 1e3:.2f} ms for a channel of "
        f"the rank's own, {non_member * 1e3:.3f} ms for one it is not in (gloo only records "
        "it; with a bound NCCL device every such call is a world-wide `ncclCommSplit`); every "
        "rank makes 2 (PP - 1) calls per pipeline. rrfp: "
        f"{per_channel * 1e3:.2f} ms per channel of the rank's own (median; creation and the "
        "connecting message), at most 4 channels per rank with one stage per rank, created "
        "in rounds in which no rank has two (so neighbouring pairs connect in parallel, not "
        "in a chain along the pipeline). Reading it: on gloo a call for a channel the rank "
        "is not in costs little, so both ways take tens of milliseconds at these sizes; the "
        "slowest rank's time grows with the number of processes sharing the 2 cores. What "
        "changes is the growth: before, every rank made a call per channel of every "
        "pipeline (linear in the number of pipelines, and each a world-wide collective "
        "under NCCL with a bound device); now a rank creates its own channels only.",
        "",
        "**Extrapolated** (not measured) to PP 64 x DP 8 with one stage per rank: before, "
        f"{8 * 126} `new_group` calls per rank, about {old_extrapolated * 1e3:.0f} ms on "
        "gloo; now 4 channels, about "
        f"{4 * per_channel * 1e3:.0f} ms, the same for any number of pipelines.",
    ]
    print(f"wrote {write_page('channel_setup.md', lines)}")


if __name__ == "__main__":
    main()
