"""Local gloo worlds: run a function on N CPU processes, with a hard timeout.

For the demo, the benchmarks and the tests: one machine, no GPU, no torchrun.
"""

from __future__ import annotations

import datetime
import os
import queue
import signal
import socket
import subprocess
import tempfile
import time
import traceback
from collections.abc import Callable, Collection
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rrfp.testing.store_ops import CountingStore


def run_local_world(world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 120.0,
                    store: str | tuple[str, int] = "file", may_die: Collection[int] = (),
                    count_store_ops: bool = False) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on every rank; return the per-rank results.

    Fails (and kills every rank) if any rank raises or the world runs past ``timeout``.
    Ranks in ``may_die`` may end without reporting (a test that kills one on purpose):
    their result is None.
    ``fn`` must be importable (module level, a test module's own function too: each rank
    imports its module by name): ranks are fresh processes forked from a fork server, which
    sees neither the caller's state nor later changes to its environment. ``store``:
    ``"file"`` (a FileStore in a temporary folder), ``"tcp"`` (a TCPStore on a free
    local port, as torchrun uses) or ``(host, port)`` of a TCPStore served elsewhere
    (``rrfp.testing.store_ops.ServedStore``). ``count_store_ops``: the default group's
    store is a ``CountingStore`` around it (``dist.distributed_c10d._get_default_store()``
    finds it). Ranks run in that temporary folder (their working
    directory), so what a rank writes by a relative path, such as a hang report without a
    ``report_folder``, goes away with the world instead of landing in the caller's folder.
    """
    ctx = _context()
    with tempfile.TemporaryDirectory() as tmp:
        if isinstance(store, tuple):
            init_method = store
        elif store == "tcp":
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                init_method = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
        elif store == "file":
            init_method = f"file://{tmp}/store"
        else:
            raise ValueError(f"store must be 'file' or 'tcp', got {store!r}")
        results: queue.Queue = ctx.Queue()
        procs = [
            ctx.Process(target=_rank_main, daemon=True,
                        args=(rank, world_size, init_method, count_store_ops, tmp, results,
                              fn, args))
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        outcomes: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(outcomes) < world_size:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"world of {world_size} ranks ran past {timeout:.0f} s (a hang?); "
                        f"ranks that finished: {sorted(outcomes)}"
                    )
                try:
                    rank, ok, payload = results.get(timeout=min(left, 1.0))
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs)
                            if r not in outcomes and p.exitcode not in (None, 0)]
                    for r in dead:
                        if r in may_die:
                            outcomes[r] = (True, None)
                    if set(dead) - set(may_die):
                        raise RuntimeError(f"ranks {dead} died without reporting") from None
                    continue
                outcomes[rank] = (ok, payload)
        finally:
            for p in procs:
                p.join(timeout=10)
            for p in procs:
                if p.is_alive():
                    p.kill()
    errors = {r: tb for r, (ok, tb) in outcomes.items() if not ok}
    if errors:
        raise AssertionError("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))
    return [outcomes[r][1] for r in range(world_size)]


PRELOAD = ["torch", "torch.distributed", "torch.distributed.pipelining", "rrfp.runtime.schedule"]
"""Imported once by the fork server: each world's ranks fork from it, already importing
torch, instead of spending seconds each on a fresh interpreter (as spawn would)."""


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _rank_main(rank, world_size, init_method, count_store_ops, folder, results, fn,
               args) -> None:
    try:
        os.chdir(folder)
        torch.set_num_threads(1)
        timeout = datetime.timedelta(seconds=120)
        if isinstance(init_method, tuple) or count_store_ops:
            # Held here while fn runs: torch keeps only the C++ half of a store made in
            # Python (a CountingStore).
            store = _rank_store(init_method, rank, world_size, timeout, count_store_ops)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                    timeout=timeout)
        else:
            dist.init_process_group("gloo", init_method=init_method, rank=rank,
                                    world_size=world_size, timeout=timeout)
        # Every rank has connected before any runs fn: one that fails at once and exits
        # would otherwise cut the mesh of a peer still connecting.
        dist.barrier()
        outcome = (rank, True, fn(rank, world_size, *args))
    except BaseException:
        outcome = (rank, False, traceback.format_exc())
    results.put(outcome)
    results.close()
    results.join_thread()
    # Ranks that stalled on purpose may have waiter threads blocked in gloo: leave at once.
    os._exit(0)


def _rank_store(init_method: str | tuple[str, int], rank: int, world_size: int,
                timeout: datetime.timedelta, counting: bool) -> dist.Store:
    """The rank's store: a client of a store served elsewhere (``(host, port)``) or the
    one ``init_method`` meets at, in a ``CountingStore`` if ``counting``."""
    if isinstance(init_method, tuple):
        store = dist.TCPStore(*init_method, is_master=False, wait_for_workers=False,
                              timeout=timeout)
    else:
        store, _, _ = next(dist.rendezvous(init_method, rank, world_size, timeout=timeout))
    return CountingStore(store) if counting else store


def output_within(proc: "subprocess.Popen[str]", timeout: float) -> tuple[str, bool]:
    """The output of ``proc`` (started with ``start_new_session=True``) and whether it
    ended within ``timeout`` seconds; if not, its whole session is killed (torchrun's
    workers too)."""
    try:
        return proc.communicate(timeout=timeout)[0], True
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.communicate()[0], False
