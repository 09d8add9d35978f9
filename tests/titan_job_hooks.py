"""``python -m tests.titan_job_hooks <torchtitan_ext.train's arguments>``: the torchtitan
job of ``tests/test_torchtitan_job.py``, with two test hooks read from the environment,
then ``torchtitan_ext.train`` as ``python -m torchtitan_ext.train`` runs it.

* ``RRFP_TEST_KILL="<global rank>:<step>"``: in torchrun's first attempt
  (``TORCHELASTIC_RESTART_COUNT`` 0) that rank SIGKILLs its own process in that training
  step, as its stages start their second action (mid-step: after a forward, before the
  step's last backward).
* ``RRFP_TEST_RECORD=<folder>``: as the trainer closes the schedule, each rank writes
  ``<attempt>-<rank>.json``: the rrfp threads alive before and after the close, and every
  key of torchrun's store (the agent's, which every attempt shares) under an rrfp prefix.
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


def _record_at_close(folder: str) -> None:
    close = ScheduleRRFP.close

    def recording_close(self, *args, **kwargs):
        before = _rrfp_threads()
        close(self, *args, **kwargs)
        agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                    is_master=False, timeout=datetime.timedelta(seconds=60))
        keys = sorted(k for k in agent_store.list_keys() if "rrfp/" in k)
        with open(os.path.join(folder, f"{ATTEMPT}-{dist.get_rank()}.json"), "w") as f:
            json.dump({"threads_before_close": before, "threads_after_close": _rrfp_threads(),
                       "keys": keys}, f)

    ScheduleRRFP.close = recording_close


if __name__ == "__main__":
    kill = os.environ.get("RRFP_TEST_KILL")
    if kill and ATTEMPT == 0:
        _kill_in(*(int(part) for part in kill.split(":")))
    if os.environ.get("RRFP_TEST_RECORD"):
        _record_at_close(os.environ["RRFP_TEST_RECORD"])
    runpy.run_module("torchtitan_ext.train", run_name="__main__", alter_sys=True)
