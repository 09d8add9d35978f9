"""The torchtitan main job as a whole job: launched as two torchrun agents (``--nnodes 2``,
c10d rendezvous on localhost, as on two hosts), and with a rank SIGKILLed mid-step that
torchrun restarts (``--max-restarts 1``) from torchtitan's last checkpoint. Slow (several
jobs each): ``-m job``, which ``.ci/run`` runs on every supported torch and torchtitan."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys

import pytest
import torch

from tests.test_torchtitan import (dump_args, failure_excerpt, job_args, LOSS, logged_losses,
                                   ROOT, tensorboard_values, TITAN_0_2)

pytestmark = pytest.mark.job


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


def test_two_torchrun_agents_train_the_main_job_as_one_agent_does(tmp_path):
    """The main job (PP 2) as one agent with 2 processes, and as two agents with one
    process each (``--nnodes 2 --node-rank 0|1``, c10d rendezvous on localhost: the
    multi-host command of docs/torchtitan.md): the same losses at every step, bitwise."""
    steps = ["--training.steps", "4"]
    ((code, one_agent),) = _run([_torchrun(["--standalone", "--nproc-per-node", "2"], *steps,
                                           dump=str(tmp_path / "one"))], timeout=400)
    assert code == 0, failure_excerpt(one_agent)
    port = _free_port()
    agents = _run([_torchrun(["--nnodes", "2", "--node-rank", str(node), "--nproc-per-node",
                              "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                              f"localhost:{port}", "--rdzv-id", "rrfp-two-agents",
                              "--rdzv-conf", f"is_host={1 - node}"],
                             *steps, dump=str(tmp_path / "two"))
                   for node in (0, 1)], timeout=400)
    for code, out in agents:
        assert code == 0, failure_excerpt(out)
    logged = {}
    for _, out in agents:
        logged.update(logged_losses(out))
    assert sorted(logged) == [1, 2, 3, 4]
    assert logged == logged_losses(one_agent)
    one, two = tensorboard_values(tmp_path / "one"), tensorboard_values(tmp_path / "two")
    assert len(one[LOSS]) == 4
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
        tmp_path):
    """6 steps, a checkpoint every 2. Uninterrupted; then with global rank 1 SIGKILLed in
    its step 5 (mid-step), ``--max-restarts 1``: torchrun restarts both ranks, torchtitan
    resumes from step 4 and finishes. The final parameters are bitwise the uninterrupted
    run's; the new attempt's rrfp keys are its own (``attempt-1``) and hold no failure;
    the schedule's threads are its own, once each, and none outlives its close.

    torchrun's default store is shared by its attempts (pytorch#135712, #167288): a
    restarted worker may read the dead attempt's address for torch's own default group and
    fail to connect (2 of 3 restarts here on torch 2.13), so the job opts out
    (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, as docs/torchtitan.md says); rrfp's own
    keys carry the attempt either way."""
    overrides = ["--training.steps", "6", "--checkpoint.enable", "--checkpoint.interval", "2"]
    launcher = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                # The survivor tells its failure within milliseconds of its peer's death;
                # torchrun notices the death within this interval, and then stops it.
                "--monitor-interval", "2"]
    ((code, out),) = _run([_torchrun(launcher, *overrides, dump=str(tmp_path / "whole"))],
                          timeout=600, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    assert code == 0, failure_excerpt(out)
    record = tmp_path / "record"
    record.mkdir()
    ((code, out),) = _run([_torchrun(launcher, *overrides, dump=str(tmp_path / "resumed"),
                                     module="tests.titan_job_hooks")], timeout=900,
                          RRFP_TEST_KILL="1:5", RRFP_TEST_RECORD=str(record),
                          TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    assert code == 0, failure_excerpt(out)
    # Rank 1 of the first attempt stepped, and was killed before its schedule's close.
    assert (record / "0-1-keys.json").exists() and not (record / "0-1-threads.json").exists()
    assert re.search(r"Loading the checkpoint from \S+/step-4", out), out[-3000:]
    assert "Training starts at step 5" in out, out[-3000:]
    whole, resumed = _final_parameters(tmp_path / "whole"), _final_parameters(tmp_path / "resumed")
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
