"""gloo sends issued into a connection that the peer has just closed (gloo, CPU processes).

    python -m benchmarks.gloo_closed_peer_bench   # writes results/gloo_closed_peer.md (~1 min)

Two processes and a fresh 2-rank gloo group per trial (``rrfp.comm.channels.make_channel_group``).
The consumer posts ``RECEIVES`` receives and the producer sends one small message every
``SPACING_S`` until a send raises or all are sent; ``CLOSE_AFTER_S`` into the sending the
consumer breaks the group as rrfp aborts a gloo channel (``break_gloo_group``), and so does
the producer once it stops. Then the producer waits for each send it issued, at most
``WAIT_S`` each: a send that neither completed nor failed by then is *pending* (without a
timeout it would wait out the group's). *at once*: the consumer breaks the group while the
producer still sends (a close without ``FailureBoard.stop_sending``). *after the producer
stopped*: the consumer tells the producer to stop, waits until it says it has stopped
sending, then breaks the group (rrfp's close after a failure).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch
import torch.distributed as dist

from benchmarks.pages import write_page
from rrfp.comm.channels import break_gloo_group, make_channel_group
from rrfp.testing.worlds import run_local_world

RECEIVES = 3000
SPACING_S = 20e-6
CLOSE_AFTER_S = 0.02
WAIT_S = 1.0
MODES = ("at once", "after the producer stopped")


def _trial(group: dist.ProcessGroup, store: dist.Store, rank: int,
           quiesce: bool) -> tuple[int, int]:
    """(sends issued, sends pending) at the producer; (0, 0) at the consumer."""
    if rank == 1:
        works = [group.recv([torch.zeros(16)], 0, 7) for _ in range(RECEIVES)]
        store.set("posted", "1")
        store.wait(["sending"])
        time.sleep(CLOSE_AFTER_S)
        if quiesce:
            store.set("stop", "1")
            store.wait(["stopped"])
        break_gloo_group(group, 0)
        store.wait(["counted"])
        del works
        return 0, 0
    store.wait(["posted"])
    store.set("sending", "1")
    sends, message = [], torch.ones(16)
    while len(sends) < RECEIVES and not (quiesce and len(sends) % 10 == 0
                                         and store.check(["stop"])):
        try:
            sends.append(group.send([message], 1, 7))
        except RuntimeError:  # the closed connection seen: no more sends
            break
        time.sleep(SPACING_S)
    store.set("stopped", "1")
    break_gloo_group(group, 1)
    pending = 0
    for work in sends:
        try:
            work.wait(datetime.timedelta(seconds=WAIT_S))
        except RuntimeError as e:
            pending += "Timed out" in str(e)
    store.set("counted", "1")
    return len(sends), pending


def trials(rank: int, world_size: int, count: int) -> dict[str, list[tuple[int, int]]]:
    from torch.distributed.distributed_c10d import _get_default_store

    out: dict[str, list[tuple[int, int]]] = {mode: [] for mode in MODES}
    for index in range(count):
        for mode in MODES:
            store = dist.PrefixStore(f"trial-{index}-{mode}/", _get_default_store())
            group = make_channel_group("gloo", store, rank, datetime.timedelta(seconds=60))
            out[mode].append(_trial(group, store, rank, mode != MODES[0]))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=10)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    producer = run_local_world(2, trials, args.trials, timeout=600)[0]
    lines = [
        "# gloo sends issued into a connection the peer has just closed",
        "",
        f"Regenerate with `python -m benchmarks.gloo_closed_peer_bench --trials {args.trials}` "
        f"({time.perf_counter() - start:.0f} s here; torch {torch.__version__}). See the "
        "module docstring for the method: per trial the consumer closes the group "
        f"{CLOSE_AFTER_S * 1e3:g} ms into the producer's sends (one every "
        f"{SPACING_S * 1e6:g} us, {RECEIVES} receives posted); *pending*: a send that "
        f"neither completed nor failed within {WAIT_S:g} s of its wait (the rest completed "
        "or raised).",
        "",
        "| the consumer closes | trials | sends issued (median) | trials with a pending send "
        "| pending sends (all trials) |",
        "|---|---|---|---|---|",
    ]
    for mode in MODES:
        results = producer[mode]
        lines.append(f"| {mode} | {len(results)} | "
                     f"{statistics.median(n for n, _ in results):.0f} | "
                     f"{sum(1 for _, p in results if p)} | {sum(p for _, p in results)} |")
    print("\n".join(lines))
    print("wrote", write_page("gloo_closed_peer.md", lines))


if __name__ == "__main__":
    main()
