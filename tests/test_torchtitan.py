"""torchtitan integration: RRFP schedule names, the CPU main job, fidelity, FSDP, bad configs.

End-to-end tests launch torchrun on CPU/gloo with a hard timeout each.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

pytest.importorskip("torchtitan")

from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.protocols import train_spec  # noqa: E402

from torchtitan_ext.schedules import hint_of, placement_schedule, validate  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "train_configs/llama3_debug_cpu.toml"
LOSS_LINE = re.compile(r"step:\s+(\d+)\s+(?:\x1b\[[0-9;]*m)?loss:\s+(-?[0-9.]+)")


def run_titan(nproc: int, *overrides: str, dump: str, module: str = "torchtitan_ext.train",
              timeout: float = 300) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           "--standalone", "-m", module, "--job.config_file", CONFIG,
           "--job.dump_folder", dump, "--rrfp.trace_folder", "", *overrides]
    # A session of its own, so a hang kills torchrun's workers too.
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"torchrun ran past {timeout} s (a hang?):\n{out[-3000:]}")
    return proc.returncode, out


def logged_losses(output: str) -> dict[int, str]:
    """Step -> the loss string the last pipeline stage logged (other ranks log -1)."""
    losses: dict[int, set[str]] = {}
    for step, loss in LOSS_LINE.findall(output):
        if not loss.startswith("-"):
            losses.setdefault(int(step), set()).add(loss)
    assert all(len(v) == 1 for v in losses.values()), losses
    return {step: v.pop() for step, v in sorted(losses.items())}


def parse(*overrides: str):
    return ConfigManager().parse_args(["--job.config_file", os.path.join(ROOT, CONFIG), *overrides])


def n_layers(config) -> int:
    return train_spec.get_train_spec(config.model.name).model_args[config.model.flavor].n_layers


def test_schedule_names():
    assert hint_of("RRFP") == "BF"
    assert hint_of("rrfp-interleaved1f1b") == "Interleaved1F1B"
    assert hint_of("Interleaved1F1B") is None
    assert placement_schedule("BFW") == "InterleavedZeroBubble"
    with pytest.raises(ValueError, match="unknown RRFP schedule 'RRFP-Zigzag'"):
        hint_of("RRFP-Zigzag")


@pytest.mark.parametrize("overrides,message", [
    (["--parallelism.pipeline_parallel_schedule", "RRFP-Zigzag"], "unknown RRFP schedule"),
    (["--parallelism.pipeline_parallel_schedule", "RRFP-1F1B",
      "--parallelism.pipeline_parallel_layers_per_stage", "2"], "runs one stage per rank"),
    (["--parallelism.pipeline_parallel_schedule", "RRFP-1F1B",
      "--training.local_batch_size", "1"], "at least as many microbatches as stages"),
    (["--parallelism.pipeline_parallel_schedule", "RRFP-DualPipeV",
      "--training.local_batch_size", "2"], "at least as many microbatches as stages"),
    (["--training.local_batch_size", "6", "--parallelism.pipeline_parallel_microbatch_size", "4"],
     "must be a multiple of"),
    (["--rrfp.buffer_limit", "0"], "buffer_limit=0 is below 1"),
    (["--rrfp.buffer_limit", "lots"], "is not understood"),
    (["--rrfp.policy", "eager"], "is not one of"),
    (["--parallelism.pipeline_parallel_degree", "1"], "pipeline_parallel_degree >= 2"),
    (["--rrfp.coordination", "vote"], "is not one of"),
])
def test_bad_rrfp_configs_are_rejected_with_what_to_change(overrides, message):
    config = parse(*overrides)
    with pytest.raises(ValueError, match=message):
        validate(config, n_layers(config))


def test_good_configs_pass_validation():
    for schedule in ("RRFP", "RRFP-Interleaved1F1B", "RRFP-ZBVZeroBubble", "RRFP-BFW"):
        config = parse("--parallelism.pipeline_parallel_schedule", schedule)
        validate(config, n_layers(config))


def test_main_job_trains_on_cpu_and_logs_rrfp_stats(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    code, out = run_titan(2, "--training.steps", "8", dump=str(tmp_path))
    assert code == 0, out[-3000:]
    losses = logged_losses(out)
    assert sorted(losses) == list(range(1, 9))
    assert float(losses[8]) < float(losses[1]) - 2.0
    assert "ScheduleRRFP with hint BF (loop placement), policy BF, buffer limit 'hint'" in out
    assert re.search(r"rrfp step  8: pp0 idle \d+% out-of-hint \d+ backpressure \d+", out)
    (run_dir,) = (tmp_path / "tb").iterdir()
    events = EventAccumulator(str(run_dir))
    events.Reload()
    tags = events.Tags()["scalars"]
    for tag in ("rrfp/idle_fraction/pp0", "rrfp/out_of_hint_order/pp1",
                "rrfp/backpressure_entries/pp0"):
        assert tag in tags
        assert len(events.Scalars(tag)) == 8


@pytest.mark.parametrize("fixed,nproc,steps,parallelism", [
    ("Interleaved1F1B", 2, 4, []),
    ("1F1B", 2, 4, []),
    ("Interleaved1F1B", 4, 3, ["--parallelism.data_parallel_shard_degree", "2"]),
    ("Interleaved1F1B", 4, 3, ["--parallelism.tensor_parallel_degree", "2"]),
], ids=["pp-interleaved", "pp-1f1b", "pp-x-fsdp", "pp-x-tp"])
def test_rrfp_logs_the_same_losses_as_the_fixed_schedule(fixed, nproc, steps, parallelism,
                                                        tmp_path):
    runs = {}
    for schedule in (fixed, f"RRFP-{fixed}"):
        code, out = run_titan(nproc, "--training.steps", str(steps), *parallelism,
                              "--parallelism.pipeline_parallel_schedule", schedule,
                              dump=str(tmp_path / schedule), timeout=400)
        assert code == 0, out[-3000:]
        runs[schedule] = logged_losses(out)
    assert len(runs[fixed]) == steps
    assert runs[fixed] == runs[f"RRFP-{fixed}"]


def test_bad_config_stops_before_training_with_a_clear_message(tmp_path):
    code, out = run_titan(2, "--parallelism.pipeline_parallel_schedule", "RRFP-Zigzag",
                          dump=str(tmp_path))
    assert code != 0
    assert "rrfp: bad configuration: unknown RRFP schedule 'RRFP-Zigzag'" in out
    assert "Training starts" not in out


def test_stock_torchtitan_train_with_custom_import(tmp_path):
    code, out = run_titan(2, "--training.steps", "2",
                          "--parallelism.pipeline_parallel_schedule", "RRFP-ZBVZeroBubble",
                          dump=str(tmp_path), module="torchtitan.train")
    assert code == 0, out[-3000:]
    assert "ScheduleRRFP with hint ZBVZeroBubble (v placement)" in out
    assert sorted(logged_losses(out)) == [1, 2]
