"""What the torchtitan tests share: the installed torchtitan's version and the markers
that depend on it, a job launched under torchrun and read back (its console, its
TensorBoard), and a job's configuration parsed as torchtitan parses it, against whichever
torchtitan is installed (0.2.2: TOML jobs, 0.3: config functions; ``JOBS`` names each job
in both).

End-to-end tests launch torchrun on CPU/gloo with a hard timeout each. Losses are compared
at full precision: torchtitan writes them to TensorBoard as float32.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

# torchtitan is a declared test dependency: imported plainly, so that a broken install
# fails these tests instead of skipping them.
import torchtitan  # noqa: F401

from rrfp.testing.worlds import output_within
from torchtitan_ext.common.schedules import validate
from torchtitan_ext.common.version import torchtitan_version

VERSION = torchtitan_version()
TITAN_0_2, TITAN_0_3 = VERSION == (0, 2), VERSION == (0, 3)
only_0_2 = pytest.mark.skipif(not TITAN_0_2, reason="torchtitan 0.2.2's adapter (TOML, "
                              f"custom_import); installed: torchtitan {VERSION}")
only_0_3 = pytest.mark.skipif(not TITAN_0_3, reason="torchtitan 0.3's adapter (config "
                              f"functions, Trainer subclass); installed: torchtitan {VERSION}")
# torchtitan_ext's own handling of a job (settings, entry points, data paths), the same on
# every torch: .ci/run runs these once per torchtitan version, not once per torch.
titan_integration = pytest.mark.titan_integration
# A job on four processes takes about a minute on 2 cores: .ci/run runs these on every torch,
# the default run leaves them out (the runtime's own PP x TP, x FSDP and x EP tests stay in).
four_ranks = pytest.mark.four_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOBS = {
    "main": ("train_configs/llama3_debug_cpu.toml", "rrfp_llama3_debug_cpu"),
    "documents": ("train_configs/documents_cpu.toml", "rrfp_documents_cpu"),
    "multimodal": ("train_configs/multimodal_cpu.toml", "rrfp_multimodal_cpu"),
    "moe": ("train_configs/deepseek_v3_ep_cpu.toml", "rrfp_deepseek_v3_ep_cpu"),
    "moe_16b": ("train_configs/deepseek_v3_16b_rrfp.toml", "rrfp_deepseek_v3_16b"),  # GPUs, not run
}
"""Job -> (its TOML file for torchtitan 0.2.2, its config function for 0.3)."""
LOSS_LINE = re.compile(r"step:\s+(\d+)\s+(?:\x1b\[[0-9;]*m)?loss:\s+(-?[0-9.]+)")


def job_args(job: str) -> list[str]:
    """How torchtitan is told to run ``job``."""
    toml, function = JOBS[job]
    if TITAN_0_2:
        return ["--job.config_file", os.path.join(ROOT, toml)]
    return ["--module", "torchtitan_ext", "--config", function]


def dump_args(dump: str) -> list[str]:
    return ["--job.dump_folder" if TITAN_0_2 else "--dump_folder", dump]


def run_titan(nproc: int, *overrides: str, dump: str, module: str = "torchtitan_ext.train",
              timeout: float = 300, env: dict[str, str] | None = None,
              job: str = "main", config_file: str | None = None) -> tuple[int, str]:
    """torchrun ``job`` (on torchtitan 0.2.2: ``config_file`` instead, if given)."""
    job_given = job_args(job) if config_file is None else ["--job.config_file", config_file]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           "--standalone", "-m", module, *job_given, *dump_args(dump),
           "--rrfp.trace_folder", "", *overrides]
    environment = {key: value for key, value in os.environ.items() if key != "LOG_RANK"}
    # A session of its own, so a hang kills torchrun's workers too.
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True,
                            # A rank that dies of a signal prints every thread's stack.
                            env={**environment, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1",
                                 "PYTHONPATH": os.pathsep.join(
                                     [ROOT, *filter(None, [os.environ.get("PYTHONPATH")])]),
                                 **(env or {})})
    out, ended = output_within(proc, timeout)
    if not ended:
        pytest.fail(f"torchrun ran past {timeout} s (a hang?):\n{out[-3000:]}")
    return proc.returncode, out


ERROR_MARKERS = re.compile(r"Error|error:|what\(\)|Aborted|Segmentation|exitcode|Signal \d+")
CRASH_MARKERS = re.compile(r"Traceback|terminate called|Fatal Python")
"""Lines that say why a rank died, wherever they fall in torchrun's interleaved output; a
crash's (a traceback, a C++ exception, faulthandler's stacks) comes with what follows it."""


def failure_excerpt(output: str, limit: int = 6000) -> str:
    """Why a torchrun launch failed: the lines that name an error or a crash, each with
    what follows it (a rank's own message comes long before torchrun's summary, which
    fills the tail), then the tail."""
    lines = output.splitlines()
    picked: set[int] = set()
    for i, line in enumerate(lines):
        after = 30 if CRASH_MARKERS.search(line) else 1 if ERROR_MARKERS.search(line) else -1
        picked.update(range(i, min(len(lines), i + after + 1)))
    marked = "\n".join(lines[j] for j in sorted(picked))[:limit // 2]
    return f"error lines:\n{marked}\n--- tail:\n{output[-limit // 2:]}"


def logged_losses(output: str) -> dict[int, str]:
    """Step -> the loss string logged; only the rank that has the loss prints it, once."""
    lines = LOSS_LINE.findall(output)
    losses = {int(step): loss for step, loss in lines}
    assert len(losses) == len(lines), f"a step's loss was logged more than once: {lines}"
    assert not any(loss.startswith("-") for loss in losses.values()), losses
    return dict(sorted(losses.items()))


def assert_one_rank_prints(output: str) -> None:
    assert output.count("Training starts at step 1") == 1, output[-3000:]
    assert "run_train.sh" not in output


def parse(*overrides: str, job: str = "main"):
    """The job's configuration, as torchtitan parses it from the command line."""
    return parse_args(*job_args(job), *overrides)


def parse_args(*args: str):
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(list(args))


def toml_with_rrfp_lines(*lines: str) -> str:
    """The main job's TOML file (0.2.2), its ``[rrfp]`` table's ``buffer_limit`` line
    replaced by ``lines``."""
    with open(os.path.join(ROOT, JOBS["main"][0])) as f:
        text = f.read()
    assert 'buffer_limit = "hint"\n' in text
    return text.replace('buffer_limit = "hint"\n', "".join(f"{line}\n" for line in lines))


def n_layers(config) -> int:
    if TITAN_0_2:
        from torchtitan.protocols import train_spec

        return train_spec.get_train_spec(config.model.name).model_args[config.model.flavor].n_layers
    return len(config.model_spec.model.layers)


def check(config) -> None:
    """What the trainer checks before it builds anything (ValueError: what to change)."""
    if TITAN_0_2:
        validate(config, n_layers(config))
    else:
        from torchtitan_ext.titan_0_3.trainer import check as check_0_3

        check_0_3(config)


def tensorboard_values(dump) -> dict[str, list[float]]:
    """Tag -> its values by step (float32, as torchtitan wrote them), of the one
    TensorBoard run under ``dump``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run_dir,) = (dump / "tb").iterdir()
    events = EventAccumulator(str(run_dir))
    events.Reload()
    return {tag: [event.value for event in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


def tensorboard_scalars(dump) -> dict[str, int]:
    """Tag -> number of values, of the one TensorBoard run under ``dump``."""
    return {tag: len(values) for tag, values in tensorboard_values(dump).items()}


def tensorboard_texts(dump) -> dict[str, list[str]]:
    """Tag -> its texts by step, of the one TensorBoard run under ``dump``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run_dir,) = (dump / "tb").iterdir()
    events = EventAccumulator(str(run_dir))
    events.Reload()
    return {tag.removesuffix("/text_summary"): [
        event.tensor_proto.string_val[0].decode() for event in events.Tensors(tag)]
        for tag in events.Tags()["tensors"]}


LOSS, GRAD_NORM = "loss_metrics/global_avg_loss", "grad_norm"
STATS_LINE = (r"rrfp step {step:2}{fixed}: \d+ ms \| {label}pp0 idle \d+% out-of-hint \d+ held \d+"
              r"{activations} \| {label}pp1 idle \d+% out-of-hint \d+ held \d+{activations}"
              r"( \| A/B [^\n]*)?\n")
METERED = r" activations \d+\.\d MiB"
UNMETERED = ""
