"""How RRFP's control plane scales with the job: K simulated ranks against one real
TCPStore, no pipeline compute.

Each simulated rank is a thread with its own store client (counted: a ``CountingStore``)
and its own failure board, settings agreement (``agree_on_settings``), job watch
(``JobWatch``: its own thread), duration-fit sharing (``FitSharing``) and hang report
(``HangReport``), in pipelines of ``PP`` ranks; the ranks are spread over ``PROCESSES``
processes, more where a process would hold over ``RANKS_PER_PROCESS`` (a real rank is a
process of its own; here a process's threads queue for the interpreter's lock after every
blocking call they return from at once, such as all its watches waking at a failure, and
the last of them raises late by that queue); the store is served by a process of its own
(``ServedStore``). For each K it measures, in phases the driver starts through the store:

* **start**: every rank agrees on the job's settings, then makes its job watch, which
  connects before it is made (as the runtime's, so that a rank is armed before its first
  step); the time from the go to the last rank agreed and to the last rank armed, and the
  operations (calls, and keys named) each rank made to agree;
* **idle**: ``IDLE_S`` seconds of steady state between steps; each rank's step loop looks
  at its board once a second (the runtime does every ``FAILURE_POLL_S`` while it waits);
* **sized steps**: ``SIZED_STEPS`` steps given sizes, a second apart: each rank writes its
  fits and reads its pipeline's;
* **failure**: one rank publishes a failure, the others' step loops raise
  ``PeerFailedError`` (first and last after the publish) and tell their state; the failed
  rank writes the hang report (its duration).

At each phase's start every worker notes its process's CPU time and the driver the
store's process's: the page says what the failure phase cost this host's CPU, per
simulated rank. It also measures the store's capacity (``check`` operations per second
from 4 processes of 4 client threads, ``PROBE_S`` seconds), from which the page
extrapolates to 16k ranks.

``python -m benchmarks.control_plane_scale --label after`` measures the code of this
checkout and writes ``results/control_plane_scale_after.json`` (the store served on IPv4:
``rrfp.testing.store_ops.SERVE`` says why); the same command in a
checkout of the code before (where this file and ``rrfp/testing/store_ops.py`` are copied
in) with ``--label before`` writes the before figures; ``--page`` writes
``results/control_plane_scale.md`` and its plot from both. The code before read the rank
from torch.distributed in ``agree_on_settings``: there the agreement runs as the
``FailureBoard.gather(..., job=True)`` that function was made of (its store traffic).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch.distributed as dist

from rrfp.testing.store_ops import CountingStore, ServedStore

try:
    from rrfp.comm.board import FailureBoard, JobScope
    from rrfp.comm.fit_sharing import FitSharing
    from rrfp.core.errors import PeerFailedError, PipelineStallError
    from rrfp.core.sizes import DurationFit
    from rrfp.core.wakeup import Wakeup
    from rrfp.failure.hang_report import HangReport, HANG_REPORT_WAIT_S
    from rrfp.failure.job import agree_on_settings, JobGroups, JobWatch
except ImportError:  # the code before: one flat package
    from rrfp.device import Wakeup
    from rrfp.errors import PeerFailedError, PipelineStallError
    from rrfp.failures import FailureBoard
    from rrfp.fit_sharing import FitSharing
    from rrfp.hang_report import HangReport, HANG_REPORT_WAIT_S
    from rrfp.job import agree_on_settings, JobGroups, JobScope, JobWatch
    from rrfp.sizes import DurationFit

RESULTS = Path(__file__).resolve().parent / "results"
RANKS = (64, 256, 1024, 4096)
PROCESSES = 8
RANKS_PER_PROCESS = 128
PP = 8
"""Ranks per pipeline."""
IDLE_S = 35.0
"""Long enough for each watch's probe to write its key once (``WATCH_PERIOD_S`` is 30 s)."""
SIZED_STEPS = 5
STEP_S = 1.0
AGREE_CAP_S = 120.0
"""The longest a start may take before the run of that K is given up."""
PROBE_S = 3.0
SWITCH_INTERVAL_S = 0.5
"""The workers' ``sys.setswitchinterval``. A thread waiting for the interpreter's lock
wakes every interval to ask for it; at a failure every rank's watch and step loop in a
worker (hundreds; a real rank is an interpreter of its own, with a few threads) wait for
it at once, and at CPython's 5 ms their wake-ups alone kept this host's 2 cores busy
(a load of ~2,000 for minutes at K = 4096). The threads here release the lock at every
store call and wait, so a longer interval costs them nothing else."""
SETTINGS = {"hint": "1F1B (orders 3f2a9c0d1b7e)", "n_microbatches": "32",
            "stall_timeout": "300.0", "buffer_limit": "'hint'", "policy": "None",
            "launch_depth": "2", "coordination": "'leader'"}
FITS = {(stage, kind): DurationFit(0.01, 0.002, (1e-6, 0.0, 0.0))
        for stage in range(2) for kind in ("F", "B")}
PHASES = ("agree", "idle", "sized", "fail", "stop")


def _client(port: int, timeout: float = 600.0) -> dist.TCPStore:
    return dist.TCPStore(ServedStore.host, port, is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout))


def _state(rank: int) -> dict:
    """A rank's state as a hang report reads it: in a step, waiting for nothing known."""
    return {"rank": rank, "pipeline_rank": rank % PP, "stages": [rank % PP], "step": 3,
            "host": "bench", "pid": os.getpid(), "in_step": True, "error": "", "launched": 4,
            "actions": 8, "last_launched": None, "last_completed": None, "completed": [],
            "on_device": [], "ready": [], "waits": [], "channels": {}}


class Phase:
    """The phase the driver started, as this worker last read it."""

    def __init__(self) -> None:
        self.name = "connect"
        self.changed = threading.Condition()

    def set(self, name: str) -> None:
        with self.changed:
            self.name = name
            self.changed.notify_all()

    def wait_past(self, name: str) -> None:
        with self.changed:
            self.changed.wait_for(lambda: self.name != name)


@dataclasses.dataclass
class SimulatedRank:
    """One rank's control plane (see the module docstring)."""

    me: int
    ranks: int
    port: int
    failing: int
    folder: str
    agree_ops: tuple[int, int] = (0, 0)
    agreed_at: float | None = None
    armed_at: float | None = None
    raised_at: float | None = None
    published_at: float | None = None
    report_s: float | None = None
    sized_steps: int = 0
    error: str | None = None

    def connect(self) -> None:
        self.store = CountingStore(_client(self.port))
        first = self.me - self.me % PP
        pipeline = tuple(range(first, min(first + PP, self.ranks)))
        self.job = dist.PrefixStore(f"bench-{self.ranks}/job", self.store)
        self.board = FailureBoard(dist.PrefixStore(f"bench-{self.ranks}/pp{first}", self.store),
                                  self.me, pipeline, job_store=self.job,
                                  job_ranks=range(self.ranks))
        self.fits = FitSharing(dist.PrefixStore(f"bench-{self.ranks}/pp{first}", self.store),
                               self.me, pipeline)
        self.report = HangReport(self.board, f"bench-{self.ranks}", self.folder,
                                 HANG_REPORT_WAIT_S)
        self.wakeup = Wakeup()
        self.watch: JobWatch | None = None

    def agree(self) -> None:
        if "me" in JobScope.__dataclass_fields__:
            agree_on_settings(JobScope("", self.job, tuple(range(self.ranks)), self.me),
                              SETTINGS, AGREE_CAP_S)
        else:  # the code before: its agree_on_settings was this gather and a comparison
            self.board.gather("settings", json.dumps(SETTINGS, sort_keys=True),
                              AGREE_CAP_S, job=True)

    def run(self, phase: Phase, control: dist.Store) -> None:
        try:
            phase.wait_past("connect")
            before = self.store.ops.snapshot()
            self.agree()
            self.agreed_at = time.time()
            after = self.store.ops.snapshot()
            self.agree_ops = (after[0] - before[0], after[1] - before[1])
            # As the runtime makes its watch: once the settings are agreed, before a step.
            self.watch = JobWatch(self.board, JobGroups([]), self.wakeup, lambda r, m: None)
            self.armed_at = time.time()
            control.add("agreed", 1)
            phase.wait_past("agree")
            self._steps(phase, control)
        except (PipelineStallError, RuntimeError) as e:
            self.error = f"{type(e).__name__}: {str(e).splitlines()[0]}"
            control.add("agreed", 1)

    def _steps(self, phase: Phase, control: dist.Store) -> None:
        while phase.name != "stop":
            self.wakeup.wait(STEP_S)
            try:
                self.board.check()
            except PeerFailedError:
                self.raised_at = time.time()
                self.report.tell(_state(self.me))
                control.add("raised", 1)
                return
            if phase.name == "sized":
                self.fits.publish(FITS)
                self.fits.latest()
                self.sized_steps += 1
            elif phase.name == "fail" and self.me == self.failing:
                self.published_at = time.time()
                self.board.publish(f"global rank {self.me} failed its step: planted")
                started = time.perf_counter()
                self.report.tell(_state(self.me))  # as the runtime does before it writes
                self.report.write(_state(self.me))
                self.report_s = time.perf_counter() - started
                control.set("reported", "1")
                return


def worker(port: int, ranks: int, first: int, count: int, failing: int) -> None:
    """Ranks ``first`` .. ``first + count - 1``; prints what they measured as JSON."""
    threading.stack_size(512 * 1024)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    control = _client(port)
    phase = Phase()
    with tempfile.TemporaryDirectory() as folder:
        simulated = [SimulatedRank(me, ranks, port, failing, folder)
                     for me in range(first, first + count)]
        connecting = [threading.Thread(target=rank.connect) for rank in simulated]
        for thread in connecting:
            thread.start()
        for thread in connecting:
            thread.join()
        threads = [threading.Thread(target=rank.run, args=(phase, control))
                   for rank in simulated]
        for thread in threads:
            thread.start()
        control.add("ready", count)
        snapshots = {}
        while phase.name != "stop":
            name = control.get("phase").decode() if control.check(["phase"]) else "connect"
            if name != phase.name:
                snapshots[name] = (time.time(), [rank.store.ops.snapshot() for rank in simulated],
                                   time.process_time())
                phase.set(name)
            time.sleep(0.05)
        for thread in threads:
            thread.join(60)
        for rank in simulated:
            if rank.watch is not None:
                rank.watch.close(10)
    print(json.dumps({"ranks": [dataclasses.asdict(rank) for rank in simulated],
                      "snapshots": snapshots}))


def _cpu_seconds(pid: int) -> float:
    """The CPU time process ``pid`` has used (user and system), from ``/proc``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _drive(driver: dist.Store, ranks: int, idle_s: float, store_pid: int
           ) -> tuple[dict[str, float], dict[str, float]]:
    """Start each phase in turn; when each started, and the store's CPU seconds then."""
    started, store_cpu = {}, {}

    def until(condition, limit: float) -> None:
        end = time.time() + limit
        while not condition() and time.time() < end:
            time.sleep(0.2)

    until(lambda: driver.add("ready", 0) >= ranks, 600)
    for name in PHASES:
        started[name] = time.time()
        store_cpu[name] = _cpu_seconds(store_pid)
        driver.set("phase", name)
        if name == "agree":
            until(lambda: driver.add("agreed", 0) >= ranks, AGREE_CAP_S + 30)
        elif name == "idle":
            time.sleep(idle_s)
        elif name == "sized":
            time.sleep(SIZED_STEPS * STEP_S + 0.5 * STEP_S)
        elif name == "fail":
            until(lambda: driver.add("raised", 0) >= ranks - 1 and driver.check(["reported"]),
                  60)
    return started, store_cpu


def measure(ranks: int, processes: int, idle_s: float = IDLE_S) -> dict:
    """One run of ``ranks`` simulated ranks: the raw per-rank figures and phase starts."""
    failing = ranks // 2 + 1
    share = -(-ranks // processes)
    with ServedStore() as served:
        driver = _client(served.port)
        # torch's client looks up the name of the store's address (``::ffff:127.0.0.1``)
        # as it connects, until a lookup fails in the process; this sandbox's name server
        # drops queries sent at once, and one second bounds the wait for each.
        env = dict(os.environ, RES_OPTIONS="timeout:1 attempts:1")
        workers = [subprocess.Popen(
            [sys.executable, "-m", "benchmarks.control_plane_scale", "--worker",
             str(served.port), str(ranks), str(first), str(min(share, ranks - first)),
             str(failing)], stdout=subprocess.PIPE, text=True, env=env)
            for first in range(0, ranks, share)]
        started, store_cpu = _drive(driver, ranks, idle_s, served.pid)
        outputs = [json.loads(w.communicate(timeout=300)[0].splitlines()[-1]) for w in workers]
    return {"ranks": ranks, "processes": len(workers), "failing": failing, "started": started,
            "store_cpu": store_cpu, "cores": os.cpu_count(), "workers": outputs}


def probe(seconds: float = PROBE_S, processes: int = 4, threads: int = 4) -> float:
    """The store's capacity: ``check`` operations per second, many clients at once."""
    with ServedStore() as served:
        runs = [subprocess.Popen(
            [sys.executable, "-m", "benchmarks.control_plane_scale", "--probe",
             str(served.port), str(seconds), str(threads)], stdout=subprocess.PIPE, text=True)
            for _ in range(processes)]
        return sum(float(run.communicate(timeout=120)[0]) for run in runs) / seconds


def probe_worker(port: int, seconds: float, threads: int) -> None:
    counts = [0] * threads

    def hammer(index: int) -> None:
        store = _client(port)
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            store.check(["probe"])
            counts[index] += 1

    running = [threading.Thread(target=hammer, args=(i,)) for i in range(threads)]
    for thread in running:
        thread.start()
    for thread in running:
        thread.join()
    print(sum(counts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", choices=("before", "after"), default="after")
    parser.add_argument("--ranks", type=int, nargs="+", default=list(RANKS))
    parser.add_argument("--processes", type=int, default=PROCESSES)
    parser.add_argument("--idle", type=float, default=IDLE_S, help="seconds of steady state")
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="where the run's JSON goes (and the page reads both)")
    parser.add_argument("--page", action="store_true", help="write the page from both runs")
    parser.add_argument("--worker", nargs=5, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--probe", nargs=3, type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(*args.worker)
    if args.probe:
        return probe_worker(int(args.probe[0]), args.probe[1], int(args.probe[2]))
    if args.page:
        from benchmarks.control_plane_page import write_page

        return write_page(args.results)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    capacity = probe()
    print(f"store capacity: {capacity:.0f} check/s", flush=True)
    runs = []
    for ranks in args.ranks:
        run = measure(ranks, max(args.processes, -(-ranks // RANKS_PER_PROCESS)), args.idle)
        runs.append(run)
        print(f"K={ranks} done", flush=True)
        (args.results / f"control_plane_scale_{args.label}.json").write_text(json.dumps(
            {"label": args.label, "commit": commit, "capacity": capacity, "runs": runs}))


if __name__ == "__main__":
    main()
