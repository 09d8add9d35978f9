"""The torchtitan main job as a whole job: launched as two torchrun agents (``--nnodes 2``,
c10d rendezvous on localhost, as on two hosts), and with a rank SIGKILLed mid-step that
torchrun restarts (``--max-restarts 1``) from torchtitan's last checkpoint. Slow (several
jobs each): ``-m job``, which ``.ci/run`` runs.

``python -m tests.test_torchtitan_job <torchtitan_ext.train's arguments>`` is each rank of
the killed job: ``torchtitan_ext.train`` with two test hooks read from the environment:

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
import re
import runpy
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from rrfp import ScheduleRRFP
from rrfp.runtime.executor import StageExecutor
from rrfp.testing.probes import rrfp_threads

from tests.titan_helpers import (dump_args, failure_excerpt, job_args, LOSS, logged_losses,
                                 ROOT, tensorboard_values)

pytestmark = pytest.mark.job

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
        before = rrfp_threads()
        close(self, *args, **kwargs)
        write("threads", {"before_close": before, "after_close": rrfp_threads()})

    ScheduleRRFP.step, ScheduleRRFP.close = recording_step, recording_close


def _environment(**extra: str) -> dict[str, str]:
    environment = {key: value for key, value in os.environ.items() if key != "LOG_RANK"}
    return {**environment, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1",
            "PYTHONPATH": os.pathsep.join([ROOT, *filter(None, [os.environ.get("PYTHONPATH")])]),
            **extra}


def _torchrun(launcher: list[str], *overrides: str, dump: str,
              module: str = "torchtitan_ext.train") -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *launcher, "-m", module,
            *job_args("main"), *dump_args(dump), "--rrfp.trace_folder", "", *overrides]


def _run(commands: list[list[str]], timeout: float, **env: str) -> list[tuple[int, str]]:
    """Run the commands at once (each in a session of its own, so a hang kills its
    workers too); their exit codes and outputs."""
    procs = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True, env=_environment(**env))
             for cmd in commands]
    outcomes = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout)
            outcomes.append((proc.returncode, out))
    except subprocess.TimeoutExpired:
        for proc in procs:
            os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"torchrun ran past {timeout} s (a hang?):\n"
                    + "\n".join(proc.communicate()[0][-3000:] for proc in procs))
    return outcomes


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


STEPS = ["--training.steps", "2"]
"""The fewest steps that show a job go on as another: a loss before and one after an
optimizer step; killed in the second step, a resume from the first one's checkpoint."""
CHECKPOINTS = ["--checkpoint.enable", "--checkpoint.interval", "1"]
ONE_AGENT = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
             # The survivor tells its failure within milliseconds of its peer's death;
             # torchrun notices the death within this interval, and then stops it.
             "--monitor-interval", "2"]
RESTARTS = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
"""torchrun's default store is shared by its attempts (pytorch#135712, #167288): a
restarted worker may read the dead attempt's address for torch's own default group and
fail to connect (2 of 3 restarts here on torch 2.13), so a job that restarts opts out, as
docs/guide/torchtitan.md says; rrfp's own keys carry the attempt either way."""


@pytest.fixture(scope="module")
def one_agent(tmp_path_factory) -> tuple[str, Path]:
    """The main job (PP 2) as one agent with 2 processes, uninterrupted, a checkpoint at
    every step: its output and its dump folder (the reference of both tests)."""
    dump = tmp_path_factory.mktemp("one-agent")
    ((code, out),) = _run([_torchrun(ONE_AGENT, *STEPS, *CHECKPOINTS, dump=str(dump))],
                          timeout=400, **RESTARTS)
    assert code == 0, failure_excerpt(out)
    return out, dump


def test_two_torchrun_agents_train_the_main_job_as_one_agent_does(one_agent, tmp_path):
    """The main job as two agents with one process each (``--nnodes 2 --node-rank 0|1``,
    c10d rendezvous on localhost: the multi-host command of docs/guide/torchtitan.md): the same
    losses as one agent at every step, bitwise."""
    port = _free_port()
    agents = _run([_torchrun(["--nnodes", "2", "--node-rank", str(node), "--nproc-per-node",
                              "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                              f"localhost:{port}", "--rdzv-id", "rrfp-two-agents",
                              "--rdzv-conf", f"is_host={1 - node}"],
                             *STEPS, dump=str(tmp_path))
                   for node in (0, 1)], timeout=400)
    for code, out in agents:
        assert code == 0, failure_excerpt(out)
    logged = {}
    for _, out in agents:
        logged.update(logged_losses(out))
    assert sorted(logged) == [1, 2]
    assert logged == logged_losses(one_agent[0])
    one, two = tensorboard_values(one_agent[1]), tensorboard_values(tmp_path)
    assert len(one[LOSS]) == 2
    assert one[LOSS] == two[LOSS]


def _final_parameters(dump) -> dict[str, torch.Tensor]:
    """The model of the last checkpoint under ``dump`` (torchtitan's DCP folder)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder = dump / "checkpoint"
    last = max(folder.iterdir(), key=lambda p: int(p.name.split("-")[-1]))
    dcp_to_torch_save(str(last), str(dump / "final.pt"))
    state = torch.load(dump / "final.pt", weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def test_a_rank_killed_mid_step_resumes_from_the_last_checkpoint_and_ends_bitwise_equal(
        one_agent, tmp_path):
    """2 steps, a checkpoint at each, ``--max-restarts 1``; global rank 1 SIGKILLed in its
    step 2 (mid-step): torchrun restarts both ranks, torchtitan resumes from step 1 and
    finishes. The final parameters are bitwise the uninterrupted run's; the new attempt's
    rrfp keys are its own (``attempt-1``) and hold no failure; the schedule's threads are
    its own, once each, and none outlives its close."""
    record = tmp_path / "record"
    record.mkdir()
    ((code, out),) = _run([_torchrun(ONE_AGENT, *STEPS, *CHECKPOINTS,
                                     dump=str(tmp_path / "resumed"),
                                     module="tests.test_torchtitan_job")], timeout=600,
                          RRFP_TEST_KILL="1:2", RRFP_TEST_RECORD=str(record), **RESTARTS)
    assert code == 0, failure_excerpt(out)
    # Rank 1 of the first attempt stepped, and was killed before its schedule's close.
    assert (record / "0-1-keys.json").exists() and not (record / "0-1-threads.json").exists()
    assert re.search(r"Loading the checkpoint from \S+/step-1", out), out[-3000:]
    assert "Training starts at step 2" in out, out[-3000:]
    whole, resumed = _final_parameters(one_agent[1]), _final_parameters(tmp_path / "resumed")
    assert whole.keys() == resumed.keys() and whole
    different = [k for k in whole if not torch.equal(whole[k], resumed[k])]
    assert not different, different
    for rank in (0, 1):
        threads = json.loads((record / f"1-{rank}-threads.json").read_text())
        assert threads["after_close"] == [], threads
        assert "rrfp-job-watch" in threads["before_close"], threads
        assert len(set(threads["before_close"])) == len(threads["before_close"]), threads
        keys = json.loads((record / f"1-{rank}-keys.json").read_text())
        assert keys and all("rrfp/attempt-1/" in k for k in keys), keys
        assert not any(k.endswith("/failed") for k in keys), keys


if __name__ == "__main__":
    kill = os.environ.get("RRFP_TEST_KILL")
    if kill and ATTEMPT == 0:
        _kill_in(*(int(part) for part in kill.split(":")))
    if os.environ.get("RRFP_TEST_RECORD"):
        _record(os.environ["RRFP_TEST_RECORD"])
    runpy.run_module("torchtitan_ext.train", run_name="__main__", alter_sys=True)
