"""Launching the CPU main job (torchtitan llama3 debug, 2 processes x 1 thread) with
whichever torchtitan this Python has, for the benchmarks that compare settings on it."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from torchtitan_ext.common.version import torchtitan_version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VERSION = torchtitan_version()
STEP_LINE = re.compile(r"step:\s*(\d+)\s.*?tps:\s*([\d,]+)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def version_label() -> str:
    """The installed torchtitan's version, e.g. ``0.2.2``."""
    from importlib import metadata

    return metadata.version("torchtitan")


def job_args(dump: str) -> list[str]:
    """The main job and its dump folder, as this torchtitan takes them."""
    if VERSION == (0, 2):
        return ["-m", "torchtitan_ext.train", "--job.config_file",
                "train_configs/llama3_debug_cpu.toml", "--job.dump_folder", dump,
                "--metrics.no-enable-tensorboard"]
    return ["-m", "torchtitan.train", "--module", "torchtitan_ext", "--config",
            "rrfp_llama3_debug_cpu", "--dump_folder", dump, "--metrics.no-enable-tensorboard"]


def activation_checkpoint_args(mode: str) -> list[str]:
    """torchtitan's activation checkpointing: ``none``, ``full``, ``selective`` (0.2.2:
    every second layer; 0.3: per op) or, on 0.2.2, ``selective-op`` (per op). On 0.3 a
    subcommand: it goes after every other option."""
    if VERSION == (0, 2):
        if mode == "selective-op":
            return ["--activation_checkpoint.mode", "selective",
                    "--activation_checkpoint.selective_ac_option", "op"]
        return ["--activation_checkpoint.mode", mode]
    return [f"activation-checkpoint:{mode}"]


def run_job(dump: str, *options: str, steps: int, timeout: float = 900,
            job: list[str] | None = None) -> str:
    """Train the main job (``job``: another job's arguments, its dump folder included)
    ``steps`` steps with ``options``; its console output."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
               "--standalone", *(job_args(dump) if job is None else job),
               "--training.steps", str(steps), *options]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    env.pop("LOG_RANK", None)
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    out = ANSI.sub("", done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(options)}: the job failed ({done.returncode}):\n{out[-3000:]}")
    return out


def tokens_per_second(out: str) -> dict[int, float]:
    """Step -> torchtitan's logged tokens per second."""
    return {int(step): float(value.replace(",", "")) for step, value in STEP_LINE.findall(out)}
