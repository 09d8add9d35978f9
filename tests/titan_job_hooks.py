"""``python -m tests.titan_job_hooks <torchtitan_ext.train's arguments>``: the torchtitan
job of ``tests/test_torchtitan_job.py``, with two test hooks read from the environment,
then ``torchtitan_ext.train`` as ``python -m torchtitan_ext.train`` runs it.

* ``RRFP_TEST_KILL="<global rank>:<step>"``: in torchrun's first attempt
  (``TORCHELASTIC_RESTART_COUNT`` 0) that rank SIGKILLs its own process in that training
  step, as its stages start their second action (mid-step: after a forward, before the
  step's last backward).
* ``RRFP_TEST_RECORD=<folder>``: each rank writes every key of the job's store under an
  rrfp prefix after its first step, and the rrfp threads alive before and after the
  schedule's close (``_record``).
"""

from __future__ import annotations

import datetime
import json
import os
import runpy
import signal
import threading

import torch.distributed as dist

from rrfp import ScheduleRRFP
from rrfp.executor import StageExecutor

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def _kill_in(rank: int, step: int) -> None:
    steps, actions = [0], [0]
    schedule_step, compute = ScheduleRRFP.step, StageExecutor.compute

    def counted_step(self, *args, **kwargs):
        steps[0] += 1
        actions[0] = 0
        return schedule_step(self, *args, **kwargs)

    def killing_compute(self, action):
        actions[0] += 1
        if dist.get_rank() == rank and steps[0] == step and actions[0] == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return compute(self, action)

    ScheduleRRFP.step, StageExecutor.compute = counted_step, killing_compute


def _rrfp_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("rrfp-"))


def _record(folder: str) -> None:
    """Each rank writes ``<attempt>-<rank>-keys.json`` after its first step (every rank is
    alive then: the store's server is a worker's) and ``<attempt>-<rank>-threads.json`` as
    the schedule closes."""
    schedule_step, close = ScheduleRRFP.step, ScheduleRRFP.close
    stepped = [False]

    def write(what: str, value) -> None:
        with open(os.path.join(folder, f"{ATTEMPT}-{dist.get_rank()}-{what}.json"), "w") as f:
            json.dump(value, f)

    def recording_step(self, *args, **kwargs):
        result = schedule_step(self, *args, **kwargs)
        if not stepped[0]:
            stepped[0] = True
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                  is_master=False, timeout=datetime.timedelta(seconds=60))
            write("keys", sorted(k for k in store.list_keys() if "rrfp/" in k))
        return result

    def recording_close(self, *args, **kwargs):
        before = _rrfp_threads()
        close(self, *args, **kwargs)
        write("threads", {"before_close": before, "after_close": _rrfp_threads()})

    ScheduleRRFP.step, ScheduleRRFP.close = recording_step, recording_close


if __name__ == "__main__":
    kill = os.environ.get("RRFP_TEST_KILL")
    if kill and ATTEMPT == 0:
        _kill_in(*(int(part) for part in kill.split(":")))
    if os.environ.get("RRFP_TEST_RECORD"):
        _record(os.environ["RRFP_TEST_RECORD"])
    runpy.run_module("torchtitan_ext.train", run_name="__main__", alter_sys=True)
