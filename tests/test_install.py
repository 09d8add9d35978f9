"""The install a user types: a fresh venv, torch 2.13, then ``pip install -e '.[titan]'``
with no constraints file, runs the README's main job.

Slow (a venv; torchtitan and its dependencies from the registry or pip's cache), so marked
``install``: the default run deselects it (``addopts`` in pyproject.toml), ``.ci/run``
selects it (``pytest -m install``) in its first venv.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.titan_helpers import failure_excerpt, JOBS, logged_losses, ROOT


def run(cmd: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout, **kwargs)


@pytest.mark.install
def test_the_titan_extra_next_to_torch_2_13_runs_the_main_job(tmp_path):
    """torchtitan 0.3 needs torch >= 2.14: the titan extra must resolve torchtitan 0.2.2
    here, whose TOML job then trains its first step."""
    venv = tmp_path / "venv"
    python = str(venv / "bin" / "python")
    # What the user's shell has, less what points into this checkout's environment.
    env = {key: value for key, value in os.environ.items()
           if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    installs = [[sys.executable, "-m", "venv", str(venv)],
                [python, "-m", "pip", "install", "-q", "torch==2.13.0"],
                [python, "-m", "pip", "install", "-q", "-e", f"{ROOT}[titan]"]]
    for cmd in installs:
        done = run(cmd, timeout=900, env=env)
        assert done.returncode == 0, f"{cmd}:\n{done.stdout[-3000:]}"
    versions = run([python, "-c", "from importlib.metadata import version as v; "
                    "print(v('torch'), v('torchtitan'))"], timeout=60, env=env)
    assert versions.stdout.split() == ["2.13.0+cpu", "0.2.2"], versions.stdout

    job = run([str(venv / "bin" / "torchrun"), "--nproc-per-node", "2", "--standalone",
               "-m", "torchtitan_ext.train", "--job.config_file", JOBS["main"][0],
               "--training.steps", "1", "--job.dump_folder", str(tmp_path / "dump"),
               "--rrfp.trace_folder", ""],
              timeout=600, cwd=ROOT, env={**env, "PYTHONUNBUFFERED": "1"})
    assert job.returncode == 0, failure_excerpt(job.stdout)
    assert list(logged_losses(job.stdout)) == [1], failure_excerpt(job.stdout)
