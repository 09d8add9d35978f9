"""The job's watch (``rrfp.failure.job.JobWatch``): on a real ``TCPStore``, in a process of
its own so that its file descriptor 2 can be read, it prints nothing while it watches, also
past its period (until a failure, which it says in one line); a failure still wakes it at
once, and ``close`` ends it promptly. A failed write of its probe says the store is gone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import torch.distributed as dist

from rrfp.comm.board import FailureBoard
from rrfp.core.wakeup import Wakeup
from rrfp.failure.job import JobGroups, JobWatch, PROBE

WATCH = textwrap.dedent("""
    import datetime, json, sys, threading, time
    import torch.distributed as dist
    from rrfp.comm.board import FailureBoard
    from rrfp.core.wakeup import Wakeup
    from rrfp.failure.job import JobGroups, JobWatch

    period, MARK = float(sys.argv[1]), sys.argv[2]
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=60))

    def watched(rank):
        board = FailureBoard(None, rank, job_store=server.clone(), job_ranks=(0, 1))
        told = threading.Event()
        watch = JobWatch(board, JobGroups([]), Wakeup(), lambda r, m: told.set(), period=period)
        return board, watch, told

    # A watch that is closed after several of its periods have passed.
    board, watch, _ = watched(0)
    time.sleep(3.5 * period)
    started = time.perf_counter()
    alive = watch.close(30.0)
    closed_in = time.perf_counter() - started

    # A watch told of another rank's failure after several of its periods.
    board, watch, told = watched(1)
    time.sleep(3.5 * period)
    failing = FailureBoard(None, 0, job_store=server.clone(), job_ranks=(0, 1))
    print(MARK, file=sys.stderr, flush=True)
    started = time.perf_counter()
    failing.publish("planted failure")
    heard = told.wait(30.0)
    heard_in = time.perf_counter() - started
    watch.close(30.0)
    print(json.dumps({"alive": len(alive), "closed_in": closed_in, "heard": heard,
                      "heard_in": heard_in, "failure": board.failure()}))
""")


def test_the_watch_prints_nothing_past_its_period_and_still_hears_a_failure_at_once():
    """Two watches, each kept past three of its periods (a period of half a second): the
    process's file descriptor 2 stays empty until the failure is published (torch's store
    client logs a warning to it whenever a store wait times out), and then holds only the
    watch's one line; ``close`` ends a watch, and another rank's failure
    reaches a watch, each far sooner than the store's timeout."""
    period = 0.5
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    mark = "-- a failure is published --"
    done = subprocess.run([sys.executable, "-c", WATCH, str(period), mark],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    before, _, after = done.stderr.partition(mark + "\n")
    assert before == "", done.stderr
    # Then only the watch's own line saying what it heard.
    assert after.startswith("rrfp: global rank 0 of the job failed (planted failure)") \
        and after.count("\n") == 1, done.stderr
    result = json.loads(done.stdout)
    # Far from the store's timeout (60 s) even on a loaded machine: woken by a write.
    assert result["alive"] == 0 and result["closed_in"] < 20, result
    assert result["heard"] and result["heard_in"] < 20, result
    assert result["failure"] == [0, "planted failure"], result


class ProbeFails(dist.Store):
    """A ``HashStore`` whose writes of the watch's probe key fail as a write on a
    connection that gave up on its host does."""

    def __init__(self):
        super().__init__()
        self.inner = dist.HashStore()

    def set(self, key, value):
        if key.startswith(PROBE):
            raise dist.DistNetworkError("Connection timed out")
        self.inner.set(key, value)

    def clone(self):
        return self.inner

    def check(self, keys):
        return self.inner.check(keys)

    def get(self, key):
        return self.inner.get(key)


def test_a_failed_probe_write_says_the_store_is_gone_and_wakes_the_step_loop():
    """The watch's probe writes its key every period on the rank's own client; when a write
    fails, the board says the store is gone (one line naming it) and the step loop is
    woken, a period or two after the watch started."""
    store = ProbeFails()
    board = FailureBoard(None, 0, job_store=store, job_ranks=(0, 1))
    wakeup = Wakeup()
    watch = JobWatch(board, JobGroups([]), wakeup, lambda r, m: None, period=0.2)
    try:
        assert wakeup.wait(30.0), "the step loop was not woken"
        assert board.lost == ("the job's store at ProbeFails is gone (DistNetworkError: "
                              "Connection timed out)"), board.lost
        # Nothing ends the wait on a vanished host: close neither waits for it nor
        # reports it (the runtime's close would raise, and a failed step keep its state).
        started = time.monotonic()
        assert watch.close(30.0) == []
        assert time.monotonic() - started < 10.0
        assert watch.thread.is_alive()
    finally:
        store.inner.set(board.wake_key, "closed")  # the wait's own client still answers
        watch.thread.join(30.0)


def test_a_closed_watch_leaves_no_key_of_its_own_in_the_store():
    """Once its probe has written its key, a watch closed leaves neither that key nor its
    wake key behind."""
    store = dist.HashStore()
    board = FailureBoard(None, 3, job_store=store, job_ranks=(2, 3))
    watch = JobWatch(board, JobGroups([]), Wakeup(), lambda r, m: None, period=0.05)
    probe_key = f"{PROBE}/3"
    deadline = time.monotonic() + 30.0
    while not store.check([probe_key]) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.check([probe_key]), "the probe never wrote its key"
    assert watch.close(30.0) == []
    assert store.num_keys() == 0, [k for k in (probe_key, board.wake_key) if store.check([k])]
