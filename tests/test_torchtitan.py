"""torchtitan integration: RRFP schedule names, the CPU main job, fidelity, FSDP, TP, bad
configs, the data paths, against whichever torchtitan is installed (0.2.2: TOML jobs,
0.3: config functions; ``JOBS`` names each job in both).

End-to-end tests launch torchrun on CPU/gloo with a hard timeout each. Losses are compared
at full precision: torchtitan writes them to TensorBoard as float32.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import subprocess
import sys

import pytest
import torch.distributed as dist

# torchtitan is a declared test dependency: imported plainly, so that a broken install
# fails these tests instead of skipping them.
import torchtitan  # noqa: F401

from torchtitan_ext.common.log_ranks import log_ranks, print_only_on, warn_if_loss_hidden  # noqa: E402
from rrfp import ScheduleRRFP, Settings  # noqa: E402
from rrfp.core.hints import HINT_NAMES  # noqa: E402
from rrfp.core.settings import BufferLimit, parse_buffer_limit  # noqa: E402
from rrfp.core.stats import StepStats  # noqa: E402
from rrfp.testing.chains import build_stages, loss_fn, make_chain  # noqa: E402
from rrfp.testing.stats import made_up_stats  # noqa: E402
from rrfp.testing.worlds import output_within, run_local_world  # noqa: E402
from torchtitan_ext.common.schedules import (  # noqa: E402
    hint_of, placement_schedule, schedule_settings, validate)
from torchtitan_ext.common.version import torchtitan_version  # noqa: E402

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


def test_schedule_names():
    assert hint_of("RRFP") == "Interleaved1F1B"
    assert hint_of("RRFP-BF") == "BF"
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
      "--training.local_batch_size", "1"],
     r"at least as many microbatches as stages.*; here microbatches = "
     r"training.local_batch_size \(1\) / parallelism.pipeline_parallel_microbatch_size "
     r"\(1\): raise the first or lower the second"),
    (["--parallelism.pipeline_parallel_schedule", "RRFP-DualPipeV",
      "--training.local_batch_size", "2"], "at least as many microbatches as stages"),
    (["--rrfp.buffer_limit", "0"], "rrfp.buffer_limit: buffer_limit=0 is below 1"),
    (["--rrfp.buffer_limit", "lots"], "rrfp.buffer_limit: buffer_limit='lots' is not understood"),
    (["--rrfp.policy", "eager"], "rrfp.policy: unknown policy 'eager'"),
    (["--rrfp.launch_depth", "-1"], "rrfp.launch_depth: launch_depth must be an int >= 1"),
    (["--rrfp.policy", "fixed", "--rrfp.buffer_limit", "1"], "policy='fixed' runs hint"),
    (["--parallelism.pipeline_parallel_degree", "1"], "pipeline_parallel_degree >= 2"),
    (["--rrfp.coordination", "vote"], r"rrfp.coordination: coordination='vote' is not one of "
                                      r"\['leader', 'agree'\]"),
    (["--rrfp.stall_timeout", "-5"],
     "rrfp.stall_timeout: stall_timeout must be a number of seconds > 0, got -5.0"),
    (["--rrfp.stall_timeout", "0"], "rrfp.stall_timeout: stall_timeout must be a number"),
    (["--rrfp.meter_every", "0"], r"rrfp.meter_every: meter_every must be an int >= 1"),
    (["--rrfp.buffer_limit", "1GiB", "--rrfp.no-meter-activations"],
     "rrfp.buffer_limit: buffer_limit='1GiB' is counted in bytes, .* leave meter_activations on"),
    (["--parallelism.context_parallel_degree", "2"],
     r"cannot run with parallelism.context_parallel_degree=2: .* set "
     r"parallelism.context_parallel_degree = 1, or use torch's fixed schedule "
     r"pipeline_parallel_schedule = 'Interleaved1F1B'"),
    (["--parallelism.pipeline_parallel_schedule", "RRFP-ZBVZeroBubble",
      "--parallelism.context_parallel_degree", "2"],
     r"cannot run with parallelism.context_parallel_degree=2: .* set "
     r"parallelism.context_parallel_degree = 1, or use torch's fixed schedule "
     r"pipeline_parallel_schedule = 'ZBVZeroBubble'"),
])
def test_bad_rrfp_configs_are_rejected_with_what_to_change(overrides, message):
    config = parse(*overrides)
    with pytest.raises(ValueError, match=message):
        check(config)


def test_a_batch_that_does_not_split_into_microbatches_is_rejected(capsys):
    overrides = ["--training.local_batch_size", "6",
                 "--parallelism.pipeline_parallel_microbatch_size", "4"]
    if TITAN_0_2:
        with pytest.raises(ValueError, match="must be a multiple of"):
            check(parse(*overrides))
    else:  # torchtitan 0.3 checks it itself, while it parses
        with pytest.raises(SystemExit):
            parse(*overrides)
        assert "must be evenly divisible" in capsys.readouterr().err


def test_fewer_microbatches_than_stages_warn_as_torchtitan_does(caplog):
    config = parse("--parallelism.pipeline_parallel_schedule", "RRFP-GPipe",
                   "--training.local_batch_size", "1")
    with caplog.at_level("WARNING"):
        validate(config, n_layers(config))
    assert ("Number of microbatches (1) is less than the total number of stages (2) which "
            "may result in a bubble in the pipeline.") in caplog.text
    caplog.clear()
    config = parse("--parallelism.pipeline_parallel_schedule", "RRFP-GPipe")
    with caplog.at_level("WARNING"):
        validate(config, n_layers(config))
    assert "Number of microbatches" not in caplog.text


def test_good_configs_pass_validation():
    for schedule in ("RRFP", "RRFP-Interleaved1F1B", "RRFP-ZBVZeroBubble", "RRFP-BFW"):
        check(parse("--parallelism.pipeline_parallel_schedule", schedule))
    # Expert parallelism is coordinated (tests/test_torchtitan_moe.py); context
    # parallelism stays available to torch's fixed schedules.
    check(parse("--parallelism.expert_parallel_degree", "2", job="moe"))
    check(parse("--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
                "--parallelism.context_parallel_degree", "2"))


def test_every_rrfp_setting_is_checked_before_anything_is_built():
    """Each field of ``RRFP`` given a value of no accepted kind (as a TOML file can: its
    values are not converted) is refused naming the field and what it accepts; and the
    checks ScheduleRRFP makes of its device: 'auto' reads a CUDA device's free memory."""
    import dataclasses

    from rrfp.core.hints import build_hint
    from torchtitan_ext.config import RRFP
    from torchtitan_ext.common.schedules import check_settings

    hint = build_hint("Interleaved1F1B", num_ranks=2, num_stages=4, n_microbatches=8)
    check_settings(RRFP(), hint, "cpu")
    accepted = {"buffer_limit": "use 'hint'", "policy": "one of", "coordination": "not one of",
                "launch_depth": "an int >= 1", "variable_shapes": "true or false",
                "meter_activations": "true or false", "meter_every": "an int >= 1",
                "stall_timeout": "a number of seconds > 0", "log_stats": "true or false",
                "trace_folder": "a folder", "advise": "true or false",
                "fixed_every": "an int >= 2"}
    assert set(accepted) == {f.name for f in dataclasses.fields(RRFP)}
    for name, says in accepted.items():
        with pytest.raises(ValueError) as refused:
            check_settings(dataclasses.replace(RRFP(), **{name: 1.5j}), hint, "cuda")
        assert str(refused.value).startswith(f"rrfp.{name}: "), refused.value
        assert says in str(refused.value), refused.value
    with pytest.raises(ValueError, match="rrfp.buffer_limit: buffer_limit='auto' reads the "
                       "free memory of a CUDA device; these stages are on cpu"):
        check_settings(RRFP(buffer_limit="auto"), hint, "cpu")
    check_settings(RRFP(buffer_limit="auto"), hint, "cuda")


@only_0_2
@pytest.mark.parametrize("line,message", [
    ('meter_every = "5"', "rrfp.meter_every: meter_every must be an int >= 1 (1: meter every "
                          "step), got '5'"),
    ('variable_shapes = "no"', "rrfp.variable_shapes: variable_shapes must be true or false, "
                               "got 'no'"),
])
def test_toml_values_of_the_wrong_kind_are_refused(line, message, tmp_path):
    config_file = tmp_path / "train.toml"
    config_file.write_text(toml_with_rrfp_lines(line))
    with pytest.raises(ValueError, match=re.escape(message)):
        check(parse_args("--job.config_file", str(config_file)))


def test_unknown_setting_names_are_named_with_the_nearest_setting(tmp_path):
    from torchtitan_ext.common.setting_names import unknown_options, unknown_toml_keys

    assert unknown_options(["--rrfp.buffer_limit", "4", "--rrfp.no-meter-activations",
                            "--rrfp.stall-timeout=9", "--training.steps", "2"]) is None
    assert unknown_options(["--rrfp.bufer_limit", "4"]).startswith(
        "unknown option --rrfp.bufer_limit (did you mean --rrfp.buffer_limit?); the rrfp "
        "settings are buffer_limit, policy, coordination, launch_depth, variable_shapes, "
        "meter_activations, meter_every, stall_timeout, log_stats, trace_folder, advise, "
        "fixed_every")
    assert unknown_options(["--rrfp.no-meter-activation", "--rrfp.xyz=1"]).startswith(
        "unknown options --rrfp.no-meter-activation (did you mean "
        "--rrfp.no-meter-activations?), --rrfp.xyz;")
    config_file = tmp_path / "train.toml"
    config_file.write_text(toml_with_rrfp_lines('bufer_limit = "hint"'))
    assert unknown_toml_keys(["--job.config_file", str(config_file)]) == (
        f"unknown setting 'bufer_limit' (did you mean 'buffer_limit'?) in the [rrfp] table "
        f"of {config_file}; the settings are buffer_limit, policy, coordination, "
        "launch_depth, variable_shapes, meter_activations, meter_every, stall_timeout, "
        "log_stats, trace_folder, advise, fixed_every")
    assert unknown_toml_keys([f"--job.config-file={os.path.join(ROOT, JOBS['main'][0])}"]) is None


def test_a_torchtitan_that_cannot_run_here_says_what_to_install():
    from torchtitan_ext.train import launch_problem
    from torchtitan_ext.common.version import torch_mismatch

    assert torch_mismatch("0.3.0", "2.13.0+cpu") == (
        "rrfp: torchtitan 0.3.0 needs torch >= 2.14, and torch 2.13.0+cpu is installed: pip "
        "install 'torch>=2.14' (rrfp's titan03 extra), or pip install 'torchtitan==0.2.2' "
        "(rrfp's titan extra: TOML jobs, which run on this torch)")
    for titan, torch in (("0.3.0", "2.14.1"), ("0.3.0", "2.15.0"), ("0.2.2", "2.13.0+cpu")):
        assert torch_mismatch(titan, torch) is None
    toml = ["--job.config_file", "train.toml"]
    config_function = ["--module", "torchtitan_ext", "--config", "rrfp_llama3_debug_cpu"]
    assert launch_problem((0, 2), toml) is None and launch_problem((0, 3), config_function) is None
    assert "--module torchtitan_ext --config rrfp_llama3_debug_cpu" in launch_problem((0, 3), toml)
    assert "--job.config_file train_configs/" in launch_problem((0, 2), config_function)
    assert "titan extra" in launch_problem(None, toml)


def test_the_rrfp_settings_have_the_same_names_and_defaults_in_both_versions():
    """The main job's ``rrfp`` settings: the TOML's ``[rrfp]`` section (0.2.2) and the
    config function's ``rrfp`` field (0.3) give the same ``RRFP``."""
    from torchtitan_ext.config import RRFP

    assert parse().rrfp == RRFP(buffer_limit="hint", stall_timeout=300, log_stats=True,
                                trace_folder="traces", fixed_every=2)
    assert parse(job="documents").rrfp.variable_shapes is True
    assert parse(job="multimodal").rrfp.variable_shapes is True


# (The main config's pipeline needs at least 5 microbatches per rank: its own peak.)
@pytest.mark.parametrize("cli_value,expected", [("6", BufferLimit(6)), ("hint", BufferLimit(None)),
                                                ("hint+1", BufferLimit(None, extra=1))])
def test_buffer_limit_is_an_int_or_a_string_on_the_command_line(cli_value, expected):
    config = parse("--rrfp.buffer_limit", cli_value)
    assert parse_buffer_limit(config.rrfp.buffer_limit) == expected
    check(config)


@only_0_2
@pytest.mark.parametrize("toml_value,cli_value,expected", [
    ("6", None, BufferLimit(6)),
    ('"6"', None, BufferLimit(6)),
    ('"hint+2"', None, BufferLimit(None, extra=2)),
    (None, "6", BufferLimit(6)),
    (None, "hint", BufferLimit(None)),
    (None, "2x hint", BufferLimit(None, factor=2)),
    ("3", "hint", BufferLimit(None)),
])
def test_buffer_limit_is_an_int_or_a_string_in_toml(toml_value, cli_value, expected, tmp_path):
    from torchtitan.config import ConfigManager

    with open(os.path.join(ROOT, JOBS["main"][0])) as f:
        text = f.read()
    assert 'buffer_limit = "hint"' in text
    if toml_value is not None:
        text = text.replace('buffer_limit = "hint"', f"buffer_limit = {toml_value}")
    config_file = tmp_path / "train.toml"
    config_file.write_text(text)
    args = ["--job.config_file", str(config_file)]
    if cli_value is not None:
        args += ["--rrfp.buffer_limit", cli_value]
    config = ConfigManager().parse_args(args)
    assert parse_buffer_limit(config.rrfp.buffer_limit) == expected
    check(config)


# One setting per row, as a Python caller, train.toml's [rrfp] section and the simulator's
# command line write it. (The main config's pipeline: Interleaved1F1B, 2 ranks x 2 stages,
# 8 microbatches; a rank holds up to 5 at the hint's memory.)
SPELLINGS = [
    (dict(buffer_limit=6, policy="Critical", launch_depth=None),
     dict(buffer_limit="6", policy='"Critical"', launch_depth="0"),
     ["--limit", "6", "--policy", "Critical", "--launch-depth", "none"]),
    (dict(buffer_limit="6", policy="HINT", launch_depth=3),
     dict(buffer_limit='"6"', policy='"hint"', launch_depth='"3"'),
     ["--limit", "6", "--policy", "Hint", "--launch-depth", "3"]),
    (dict(buffer_limit="2x hint", policy=None, launch_depth=0),
     dict(buffer_limit='"2x hint"', policy='""', launch_depth='"none"'),
     ["--limit", "2x hint", "--launch-depth", "0"]),
    (dict(buffer_limit="Hint+1", policy="window", launch_depth="none"),
     dict(buffer_limit='"hint+1"', policy='"Window"', launch_depth='"NONE"'),
     ["--limit", "HINT + 1", "--policy", "WINDOW", "--launch-depth", "NONE"]),
    (dict(buffer_limit="hint", policy="fixed", launch_depth=2),
     dict(buffer_limit='"hint"', policy='"FIXED"', launch_depth="2"),
     ["--policy", "Fixed"]),
]


def settings_as_built(rank: int, world_size: int, arguments: list[dict]) -> list[tuple]:
    """What ScheduleRRFP (Interleaved1F1B, 2 stages per rank, 8 microbatches) makes of each
    set of keyword arguments: its limits per stage and per rank, policy and launch depth."""
    chain = make_chain(2 * world_size)
    built = []
    for kwargs in arguments:
        stages, _ = build_stages(chain, rank, world_size, "loop")
        schedule = ScheduleRRFP(stages, 8, loss_fn=loss_fn, hint="Interleaved1F1B",
                                settings=Settings(**kwargs))
        schedule.close()
        built.append((dict(schedule.buffer_limits.per_stage), dict(schedule.buffer_limits.per_rank),
                      schedule.policy, schedule.launch_depth))
    return built


@titan_integration
@only_0_2
def test_each_setting_means_the_same_from_python_toml_and_the_simulator(tmp_path):
    """buffer_limit, policy and launch_depth, each spelled as a Python caller, train.toml
    and ``python -m rrfp.sim`` would: the same limits per stage and per rank, the same
    policy and launch depth (no bound: ``inf``), from ScheduleRRFP itself (Python and
    TOML, the latter through ``validate`` and the arguments torchtitan_ext passes) and
    from the simulator's comparison."""
    import math

    from torchtitan.config import ConfigManager

    from rrfp.core.hints import build_hint
    from rrfp.sim.__main__ import build_parser
    from rrfp.sim.study import compare

    with open(os.path.join(ROOT, JOBS["main"][0])) as f:
        text = f.read()
    toml_arguments = []
    for i, (_, toml, _) in enumerate(SPELLINGS):
        lines = "".join(f"{key} = {value}\n" for key, value in toml.items())
        config_file = tmp_path / f"train{i}.toml"
        config_file.write_text(text.replace('buffer_limit = "hint"\n', lines))
        config = ConfigManager().parse_args(["--job.config_file", str(config_file)])
        validate(config, n_layers(config))
        toml_arguments.append(dataclasses.asdict(schedule_settings(config.rrfp)))
    python_arguments = [python for python, _, _ in SPELLINGS]
    built = run_local_world(2, settings_as_built, python_arguments + toml_arguments,
                            timeout=120)
    hint = build_hint("Interleaved1F1B", num_ranks=2, num_stages=4, n_microbatches=8)
    for i, (python, toml, cli) in enumerate(SPELLINGS):
        args = build_parser().parse_args(["--pp", "2", "--microbatches", "8",
                                          "--hint", "Interleaved1F1B", *cli])
        row = compare(hint, "uniform", 0, limit=args.limit, policy=args.policy,
                      launch_depth=args.launch_depth)
        simulated = (dict(row.limits.per_stage), dict(row.limits.per_rank), row.policy,
                     args.launch_depth)
        for rank in (0, 1):
            from_python, from_toml = built[rank][i], built[rank][len(SPELLINGS) + i]
            assert from_python == from_toml == simulated, (python, toml, cli)
    limits = [built[0][i][1] for i in range(len(SPELLINGS))]
    assert limits == [{0: 6, 1: 6}, {0: 6, 1: 6}, {0: 10, 1: 6}, {0: 6, 1: 4}, {0: 5, 1: 3}]
    assert [built[0][i][2:] for i in range(len(SPELLINGS))] == [
        ("critical", math.inf), ("hint", 3), ("lookahead", math.inf), ("window", math.inf),
        ("fixed", 2)]


@only_0_3
def test_variable_shapes_refuse_attention_masks_of_the_padded_length():
    from torchtitan.models.llama3 import model_registry

    config = parse(job="documents")
    config.model_spec = model_registry("debugmodel")  # torchtitan's default: flex attention
    with pytest.raises(ValueError, match="build the model with attn_backend='sdpa'"):
        check(config)
    config.parallelism.pipeline_parallel_schedule = "Interleaved1F1B"  # not RRFP: no cutting
    check(config)
    packed = parse("--rrfp.variable-shapes")  # the main job: torchtitan's packed text
    with pytest.raises(ValueError, match="torchtitan's text dataloader packs documents"):
        check(packed)


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
              r"{activations} \| {label}pp1 idle \d+% out-of-hint \d+ held \d+{activations}\n")
METERED = r" activations \d+\.\d MiB"
UNMETERED = ""


def test_main_job_trains_on_cpu_and_logs_rrfp_stats(tmp_path):
    code, out = run_titan(2, "--training.steps", "8", "--rrfp.trace_folder", "traces",
                          dump=str(tmp_path))
    assert code == 0, failure_excerpt(out)
    assert_one_rank_prints(out)
    # torchtitan's start-up lines and Python's warnings too: held until the rank is known.
    assert out.count("torchtitan version") == 1 and out.count("Starting job") == 1, out[:3000]
    assert out.count("'set_vital' is deprecated") <= 1, out[:3000]
    losses = logged_losses(out)
    assert sorted(losses) == list(range(1, 9))
    assert float(losses[8]) < float(losses[1]) - 2.0
    assert ("ScheduleRRFP with hint Interleaved1F1B (loop placement), policy lookahead, buffer "
            "limit 'hint'") in out
    # What that limit allows, and where the gains are, once (rrfp.schedule's line).
    assert out.count("buffer_limit='hint' allows no activation memory beyond the fixed "
                     "schedule's (3 microbatches on this rank), so RRFP mostly follows the "
                     "hint") == 1, failure_excerpt(out)
    assert "speed needs memory slack, e.g. buffer_limit='hint+2'" in out
    assert "\x1b[" not in out  # no colour codes: the output is a pipe
    # The trainer's close closed the schedule (the logging rank says so).
    assert out.count("rrfp: closed the pipeline schedule") == 1, failure_excerpt(out)
    # The meter samples (meter_every=100): the first step measures activations, later ones
    # say they did not.
    assert re.search(STATS_LINE.format(step=1, fixed="", label="", activations=METERED), out)
    assert re.search(STATS_LINE.format(step=7, fixed="", label="", activations=UNMETERED), out)
    assert re.search(STATS_LINE.format(step=8, fixed=r" \(fixed order\)", label="",
                                       activations=UNMETERED), out)
    scalars = tensorboard_scalars(tmp_path)
    for tag in ("rrfp/idle_fraction/pp0", "rrfp/out_of_hint_order/pp1",
                "rrfp/backpressure_entries/pp0", "rrfp/peak_in_flight/pp1",
                "rrfp/dispatch_overhead_us/pp0", LOSS):
        assert scalars.get(tag) == 8, (tag, scalars)
    for tag in ("rrfp/peak_activation_bytes/pp0", "rrfp/peak_activation_bytes/pp1"):
        assert scalars.get(tag) == 1, (tag, scalars)
    # Each run's traces go to a folder of their own.
    (run_traces,) = (tmp_path / "traces").iterdir()
    assert re.fullmatch(r"\d{8}-\d{6}", run_traces.name)
    assert sorted(p.name for p in run_traces.iterdir()) == sorted(f"step{n}.json" for n in range(1, 9))
    # 8 steps are too few for a first verdict to cost training under 1% of the CPU: at the
    # end only, the advisor's verdict and the run's summary, in the console and in
    # TensorBoard; the advisor reads the run's own folder.
    assert re.search(r"rrfp: the verdict comes at the end of the run: predicting now would "
                     r"take about \d+ s of CPU, over 1% of the \d+ s the 4 steps left", out)
    verdict = re.search(
        r"rrfp: timing variability \d+%; .*; this run \(buffer_limit='hint', policy lookahead\) "
        rf"\d\.\d\dx, measured \d\.\d\dx by the in-run A/B; python -m rrfp\.advise "
        rf"{re.escape(str(run_traces))}$", out, re.M)
    assert verdict, failure_excerpt(out)
    # Said once, in the summary, after a line that says it is being predicted.
    assert out.count(verdict[0]) == 1, failure_excerpt(out)
    assert re.search(r"rrfp: predicting the verdict from the last \d+ steps \(about \d+ s of "
                     r"CPU\)\n.*rrfp summary", out), failure_excerpt(out)
    summary = out[out.index("rrfp summary: 8 steps, hint Interleaved1F1B, policy lookahead; "
                            "step time "):].splitlines()[:9]
    assert [line.split(" (")[0].split(":")[0] for line in summary[1:]] == [
        "  measured", "  all steps, fixed-order ones included", "  mean idle",
        "  out-of-hint actions", "  microbatches held", "  peak activations", "  advisor cost",
        "  rrfp"], summary
    # The main job's in-run A/B (fixed_every = 2): steps 2, 4, 6, 8 in the fixed order.
    assert re.match(r"  measured \(in-run A/B, 4 steps in the fixed order, each against the RRFP "
                    r"steps beside it\): fixed / RRFP step time \d\.\d\dx \[\d\.\d\d-\d\.\d\d\] "
                    r"over 4 pairs; RRFP ", summary[1]), summary
    assert re.fullmatch(r"  out-of-hint actions: pp0 \d+ of \d+, pp1 \d+ of \d+", summary[4])
    assert summary[5] == ("  microbatches held (every step): pp0 at most 5 (fixed schedule 5), "
                          "pp1 at most 3 (fixed schedule 3)"), summary
    assert re.match(r"  peak activations: pp0 \d+\.\d MiB \(fixed schedule \d+\.\d MiB\), "
                    r"pp1 .* \(metered in step 1; ", summary[6])
    assert summary[8] == f"  {verdict[0]}"
    texts = tensorboard_texts(tmp_path)
    assert texts["rrfp/verdict"][-1].strip() == verdict[0]
    assert texts["rrfp/summary"][-1].split("\n")[0].strip() == summary[0].split(" - INFO - ")[-1]
    from rrfp.advise.__main__ import main as advise_main

    assert advise_main([str(tmp_path), "--no-plots"]) == 0


@pytest.mark.parametrize("fixed,nproc,steps,parallelism,rrfp", [
    pytest.param("Interleaved1F1B", 2, 4, [], ["--rrfp.fixed_every", "2"],
                 id="pp-interleaved-with-in-run-ab"),
    pytest.param("1F1B", 2, 4, [], [], id="pp-1f1b"),
    pytest.param("Interleaved1F1B", 4, 3, ["--parallelism.data_parallel_shard_degree", "2"], [],
                 id="pp-x-fsdp", marks=four_ranks),
    pytest.param("Interleaved1F1B", 4, 3, ["--parallelism.tensor_parallel_degree", "2"], [],
                 id="pp-x-tp", marks=four_ranks),
])
def test_rrfp_trains_exactly_as_the_fixed_schedule(fixed, nproc, steps, parallelism, rrfp,
                                                   tmp_path):
    """Losses and gradient norms at every step, bitwise (float32), RRFP against torch's
    fixed schedule of its hint under torchtitan; with the in-run A/B (``rrfp`` options),
    its fixed-order steps too, and its measured ratio beside the advisor's prediction."""
    runs = {}
    for schedule in (fixed, f"RRFP-{fixed}"):
        code, out = run_titan(nproc, "--training.steps", str(steps), *parallelism,
                              "--parallelism.pipeline_parallel_schedule", schedule,
                              *(rrfp if schedule.startswith("RRFP") else []),
                              dump=str(tmp_path / schedule), timeout=400)
        assert code == 0, f"{schedule}: {failure_excerpt(out)}"
        assert sorted(logged_losses(out)) == list(range(1, steps + 1))
        assert (f"ScheduleRRFP with hint {fixed}" in out) == schedule.startswith("RRFP")
        values = tensorboard_values(tmp_path / schedule)
        runs[schedule] = {tag: values[tag] for tag in (LOSS, GRAD_NORM)}
    if "--parallelism.data_parallel_shard_degree" in parallelism:
        # Each replica's line; step 1 is the metered one (meter_every=100).
        assert re.search(STATS_LINE.format(step=1, fixed="", label="dp0/", activations=METERED), out), out[-3000:]
    if rrfp:  # steps 2 and 4 in the fixed order, each against the RRFP steps beside it
        for step in (2, 4):
            assert re.search(STATS_LINE.format(step=step, fixed=" \\(fixed order\\)", label="",
                                               activations=UNMETERED), out), failure_excerpt(out)
        assert re.search(r"rrfp A/B: fixed order / RRFP step time \d\.\d+x; so far "
                         r"\d\.\d\dx \[\d\.\d\d-\d\.\d\d\] over 2 pairs", out), failure_excerpt(out)
        assert re.search(r"  rrfp: timing variability .*; this run \(buffer_limit='hint', policy "
                         r"lookahead\) \d\.\d\dx, measured \d\.\d\dx by the in-run A/B", out)
        assert len(tensorboard_values(tmp_path / schedule)["rrfp/ab_speedup"]) == 2
    assert len(runs[fixed][LOSS]) == steps
    assert runs[fixed] == runs[f"RRFP-{fixed}"]


@only_0_3
def test_validation_under_rrfp_equals_the_fixed_schedules(tmp_path):
    """torchtitan 0.3's validator calls ``pp_schedule.eval(arg_mbs=...)`` (the config
    functions point it at the generated corpus)."""
    runs = {}
    for schedule in ("Interleaved1F1B", "RRFP"):
        code, out = run_titan(2, "--training.steps", "2", "--validator.enable",
                              "--validator.freq", "1", "--validator.steps", "2",
                              "--parallelism.pipeline_parallel_schedule", schedule,
                              dump=str(tmp_path / schedule))
        assert code == 0, failure_excerpt(out)
        values = tensorboard_values(tmp_path / schedule)
        runs[schedule] = values["validation_metrics/loss"] + values[LOSS]
    assert len(runs["RRFP"]) == 4
    assert runs["RRFP"] == runs["Interleaved1F1B"]


def assert_stopped_with_one_line(code: int, out: str, line: str) -> None:
    """The job stopped before anything was built, ``line`` printed once in all (by rank
    0) and no traceback of a rank (torchrun's own report of the failed worker remains)."""
    assert code != 0
    assert [printed for printed in out.splitlines() if printed.startswith("rrfp")] == [line], (
        failure_excerpt(out))
    assert "Building" not in out  # neither the device mesh nor the model
    # One traceback: torchrun's, raising its report.
    assert out.count("Traceback (most recent call last)") == 1, failure_excerpt(out)
    assert "ChildFailedError" in out.split("Traceback (most recent call last)")[1]


@titan_integration
@pytest.mark.parametrize("module", ["torchtitan_ext.train", "torchtitan.train"])
def test_bad_config_stops_before_training_with_a_clear_message(module, tmp_path):
    code, out = run_titan(2, "--parallelism.pipeline_parallel_schedule", "RRFP-Zigzag",
                          dump=str(tmp_path), module=module)
    assert_stopped_with_one_line(code, out, (
        "rrfp: bad configuration: unknown RRFP schedule 'RRFP-Zigzag': use 'RRFP' (the "
        f"Interleaved1F1B hint) or one of {[f'RRFP-{name}' for name in HINT_NAMES]}"))


SETTINGS_LIST = ("buffer_limit, policy, coordination, launch_depth, variable_shapes, "
                 "meter_activations, meter_every, stall_timeout, log_stats, trace_folder, advise, "
        "fixed_every")


@titan_integration
def test_a_bad_setting_value_stops_the_job_with_one_line(tmp_path):
    code, out = run_titan(2, "--rrfp.stall_timeout", "-5", dump=str(tmp_path))
    assert_stopped_with_one_line(code, out, (
        "rrfp: bad configuration: rrfp.stall_timeout: stall_timeout must be a number of "
        "seconds > 0, got -5.0"))


@titan_integration
def test_an_unknown_rrfp_option_stops_the_job_naming_the_nearest(tmp_path):
    code, out = run_titan(2, "--rrfp.bufer_limit", "4", dump=str(tmp_path),
                          module="torchtitan.train" if TITAN_0_3 else "torchtitan_ext.train")
    assert_stopped_with_one_line(code, out, (
        "rrfp: bad configuration: unknown option --rrfp.bufer_limit (did you mean "
        f"--rrfp.buffer_limit?); the rrfp settings are {SETTINGS_LIST}"))


@titan_integration
@only_0_2
def test_an_unknown_rrfp_key_in_the_toml_stops_the_job_naming_the_nearest(tmp_path):
    config_file = tmp_path / "train.toml"
    config_file.write_text(toml_with_rrfp_lines('bufer_limit = "hint"'))
    code, out = run_titan(2, dump=str(tmp_path), config_file=str(config_file))
    assert_stopped_with_one_line(code, out, (
        "rrfp: bad configuration: unknown setting 'bufer_limit' (did you mean "
        f"'buffer_limit'?) in the [rrfp] table of {config_file}; the settings are "
        f"{SETTINGS_LIST}"))


@titan_integration
@only_0_2
def test_a_mistyped_toml_file_stops_the_job_in_one_line_naming_the_nearest(tmp_path):
    from torchtitan_ext.common.setting_names import missing_toml_file

    assert missing_toml_file(["--job.config_file", "train_configs/llama3_debug_cpu.toml"]) is None
    code, out = run_titan(2, dump=str(tmp_path), config_file="train_configs/llama3_debug.toml")
    assert_stopped_with_one_line(code, out, (
        "rrfp: bad configuration: --job.config_file train_configs/llama3_debug.toml: no such "
        "file (did you mean train_configs/llama3_debug_cpu.toml?)"))


@titan_integration
def test_stock_torchtitan_train_runs_rrfp(tmp_path):
    """``torchrun -m torchtitan.train``: with the TOML's ``custom_import`` (0.2.2), with
    ``--module torchtitan_ext`` (0.3). A V placement, whose loss (and TensorBoard) is on
    rank 0; also without the activation meter: the metric shows as not measured."""
    code, out = run_titan(2, "--training.steps", "2",
                          "--parallelism.pipeline_parallel_schedule", "RRFP-ZBVZeroBubble",
                          "--rrfp.trace_folder", "traces", "--rrfp.no-meter-activations",
                          dump=str(tmp_path), module="torchtitan.train")
    assert code == 0, failure_excerpt(out)
    assert_one_rank_prints(out)
    assert "ScheduleRRFP with hint ZBVZeroBubble (v placement)" in out
    # RRFP's line alone (torchtitan 0.3 also logs one for the placement schedule it builds).
    assert out.count("Using pipeline schedule") == 1, failure_excerpt(out)
    assert sorted(logged_losses(out)) == [1, 2]
    assert re.search(STATS_LINE.format(step=2, fixed=r" \(fixed order\)", label="",
                                       activations=UNMETERED), out)
    assert "peak activations: not measured (rrfp.meter_activations off)" in out
    scalars = tensorboard_scalars(tmp_path)
    assert scalars.get("rrfp/dispatch_overhead_us/pp1") == 2
    # TensorBoard is written by the rank with the loss (others have -1).
    assert len(tensorboard_values(tmp_path)[LOSS]) == 2
    assert min(tensorboard_values(tmp_path)[LOSS]) > 0
    assert not any("peak_activation_bytes" in tag for tag in scalars)
    (run_traces,) = (tmp_path / "traces").iterdir()
    assert sorted(p.name for p in run_traces.iterdir()) == ["step1.json", "step2.json"]


def test_log_rank_chooses_the_ranks_that_print(monkeypatch, caplog):
    import logging

    monkeypatch.delenv("LOG_RANK", raising=False)
    assert log_ranks(3) == {3}
    warn_if_loss_hidden(3)
    assert not caplog.records
    monkeypatch.setenv("LOG_RANK", "0,2")
    assert log_ranks(3) == {0, 2}
    warn_if_loss_hidden(3)
    assert "the loss is logged by rank 3 only, and LOG_RANK=0,2 leaves it out" in caplog.text
    monkeypatch.setenv("LOG_RANK", "last")
    with pytest.raises(ValueError, match="LOG_RANK='last' must list ranks separated by commas"):
        log_ranks(3)

    handler = logging.Handler()
    monkeypatch.setattr(logging.getLogger(), "handlers", [handler])
    print_only_on({0, 2}, 2)
    assert not handler.filters
    print_only_on({0, 2}, 1)
    info, error = (logging.LogRecord("root", level, __file__, 1, "m", None, None)
                   for level in (logging.INFO, logging.ERROR))
    assert not handler.filter(info) and handler.filter(error)


@titan_integration
@pytest.mark.parametrize("job", ["documents", "multimodal"])
def test_variable_shape_data_paths_train_and_their_loss_falls(job, tmp_path):
    code, out = run_titan(2, "--training.steps", "6", "--rrfp.meter_every", "1",
                          dump=str(tmp_path), job=job)
    assert code == 0, failure_excerpt(out)
    losses = logged_losses(out)
    assert sorted(losses) == list(range(1, 7))
    assert float(losses[6]) < float(losses[1]) - 2.0
    # Microbatches differ in length, so what a stage holds differs from step to step.
    values = tensorboard_values(tmp_path)
    assert len(set(values["rrfp/peak_activation_bytes/pp0"])) > 1, values
    # Each microbatch's size went to the schedule: from the second step on, every stage's
    # durations were predicted from them, and the error is logged per stage.
    for stage in range(4):
        errors = values[f"rrfp/size_prediction_error/stage{stage}"]
        assert len(errors) == 5 and all(0 <= e < 10 for e in errors), (stage, errors)
    assert re.search(r"rrfp step  6: .* pp0 .* size-predicted ±\d+%", out), failure_excerpt(out)


def test_variable_length_microbatches_train_as_the_fixed_schedule_on_padded_ones(tmp_path):
    """Documents: RRFP on microbatches cut to their own length gives the losses and
    gradient norms of torch's fixed schedule on microbatches padded to ``seq_len``
    (padding comes last and is ignored by the loss, which torchtitan divides by the
    number of valid tokens; causal attention never looks at it)."""
    runs = {}
    for schedule in ("Interleaved1F1B", "RRFP"):
        code, out = run_titan(2, "--training.steps", "3",
                              "--parallelism.pipeline_parallel_schedule", schedule,
                              "--rrfp.meter_every", "1",
                              dump=str(tmp_path / schedule), job="documents")
        assert code == 0, failure_excerpt(out)
        values = tensorboard_values(tmp_path / schedule)
        runs[schedule] = values[LOSS] + values[GRAD_NORM]
    assert len(set(values["rrfp/peak_activation_bytes/pp0"])) > 1, values  # RRFP's run
    assert len(runs["RRFP"]) == 6
    assert runs["RRFP"] == pytest.approx(runs["Interleaved1F1B"], rel=1e-6)


def test_microbatches_are_cut_to_their_own_content():
    import torch
    from torchtitan.components.loss import IGNORE_INDEX

    from torchtitan_ext.common.data import split_by_content

    lengths = [20, 70, 33, 5]
    inputs = torch.zeros(4, 128, dtype=torch.long)
    labels = torch.full((4, 128), IGNORE_INDEX)
    for row, length in enumerate(lengths):
        labels[row, :length] = 1
    counts = torch.tensor([0, 8, 3, 40])
    extra = {"patches": torch.randn(4, 40, 48), "patch_counts": counts}
    mbs = split_by_content(inputs, labels, extra, 2)
    # Microbatch 0 holds rows 0-1: 70 tokens -> 80, 8 patches; microbatch 1: 33 -> 48, 40.
    assert [a[0].shape for a in mbs.args] == [(2, 80), (2, 48)]
    assert [kw["patches"].shape[1] for kw in mbs.kwargs] == [8, 40]
    assert mbs.shapes == [(2, 88), (2, 88)]
    assert (mbs.targets[0][:, :8] == IGNORE_INDEX).all()
    padded = split_by_content(inputs, labels, extra, 2, pad_to=(96, 40))
    assert [a[0].shape for a in padded.args] == [(2, 96), (2, 96)]
    assert padded.shapes == [(2, 136), (2, 136)]
    with pytest.raises(ValueError, match=r"needs at least \(80, 40\)"):
        split_by_content(inputs, labels, extra, 2, pad_to=(64, 40))


def stats_exchange(rank: int, world_size: int) -> dict:
    """``StepStatsLog`` over three steps with made-up stats (out-of-hint = 10 x step +
    rank), the last logged twice, only the last rank reading: the scalars it returns, and
    which of this rank's keys its store still holds."""
    from torchtitan_ext.common.stats_logging import stats_store, StepStatsLog

    class Schedule:
        last_step_stats: StepStats

    schedule = Schedule()
    log = StepStatsLog(schedule, dist.new_group(list(range(world_size))), replica=None,
                       log_stats=True, trace_folder=None, reads=rank == world_size - 1)
    scalars = {}
    for step in (1, 2, 3, 3):
        schedule.last_step_stats = made_up_stats(
            rank, peak_activation_bytes=None if step == 2 else 64,
            out_of_hint_order=10 * step + rank)
        scalars[step] = log.log(step)
        dist.barrier()  # what the next training step's pipeline does
    store = stats_store(list(range(world_size)), 0)
    keys = [step for step in (1, 2, 3) if store.check([f"{step}/{rank}"])]
    dist.barrier()  # rank 0, which does not read, hosts the store
    return {"scalars": scalars, "keys": keys}


def test_step_stats_are_gathered_through_the_store():
    """A reading rank gets the whole pipeline's stats in rank order (the others get no
    scalars), a metric not measured is left out of the scalars, a step logged twice does
    not lose its keys, and only the last step's keys stay in the store. (A
    collective there, the last one before exit, let a gloo worker release its tensors
    after the interpreter had started to shut down: an abort at exit in 2 of 32 runs of a
    two-step torchtitan job.)"""
    ranks = run_local_world(2, stats_exchange, timeout=120, store="tcp")
    assert all(scalars == {} for scalars in ranks[0]["scalars"].values())
    for rank, result in enumerate(ranks):
        assert result["keys"] == [3], (rank, result["keys"])
    for step, scalars in ranks[1]["scalars"].items():
        assert {k: v for k, v in scalars.items() if "out_of_hint" in k} == {
            "rrfp/out_of_hint_order/pp0": 10 * step, "rrfp/out_of_hint_order/pp1": 10 * step + 1}
        activations = {k for k in scalars if "peak_activation_bytes" in k}
        assert activations == (set() if step == 2 else {
            "rrfp/peak_activation_bytes/pp0", "rrfp/peak_activation_bytes/pp1"})


ADAPTERS = {
    (0, 2): ["torchtitan_ext.register", "torchtitan_ext.titan_0_2.patches",
             "torchtitan_ext.titan_0_2.trainer_hooks", "torchtitan_ext.titan_0_2.models"],
    (0, 3): ["torchtitan_ext.config_registry", "torchtitan_ext.titan_0_3.trainer",
             "torchtitan_ext.titan_0_3.pipelining", "torchtitan_ext.titan_0_3.dataloaders",
             "torchtitan_ext.titan_0_3.multimodal"],
}


def test_each_adapter_imports_with_its_version_and_refuses_the_other():
    import importlib

    import torchtitan_ext  # noqa: F401  (never fails)

    for version, modules in ADAPTERS.items():
        for name in modules:
            if version == VERSION:
                importlib.import_module(name)
                continue
            with pytest.raises(ImportError, match=(
                    rf"{re.escape(name)} is for torchtitan {version[0]}\.{version[1]} and "
                    rf"torchtitan {VERSION[0]}\.{VERSION[1]} is installed: with torchtitan "
                    rf"{VERSION[0]}\.{VERSION[1]} a job is")):
                importlib.import_module(name)


def test_the_cpu_patch_targets_exist():
    """torchtitan has no CPU setting: ``torchtitan_ext.common.cpu`` sets its modules' copies of
    ``device_type`` / ``device_module``; each must still be there."""
    import importlib

    from torchtitan_ext.common.cpu import DEVICE_MODULES

    for name, attributes in DEVICE_MODULES[VERSION].items():
        module = importlib.import_module(name)
        for attribute in attributes:
            assert hasattr(module, attribute), (name, attribute)


@only_0_2
def test_the_0_2_schedule_patch_targets_exist():
    """torchtitan 0.2.2 has no schedule hook: ``patches_0_2.install`` wraps these."""
    import importlib

    from torchtitan_ext.titan_0_2.patches import PATCHED

    for name, attributes in PATCHED.items():
        module = importlib.import_module(name)
        for attribute in attributes:
            assert callable(getattr(module, attribute, None)), (name, attribute)


@only_0_3
def test_the_0_3_adapter_uses_torchtitans_hooks():
    """``pipelining_fn`` is the model's hook (no patch), ``RRFPTrainer`` a Trainer whose
    config has the ``rrfp`` field, the loss rank of V placements is rank 0, and
    torchtitan's ``run_train.sh`` advice (the one log record dropped) still reads so."""
    import functools
    import logging
    from types import SimpleNamespace

    from torchtitan.components.metrics import ensure_pp_loss_visible
    from torchtitan.distributed.pipeline_parallel import pipeline_llm, pipeline_vlm
    from torchtitan.models.llama3 import model_registry
    from torchtitan.tools.utils import NoColor
    from torchtitan.trainer import Trainer

    from torchtitan_ext.config import RRFP
    from torchtitan_ext.titan_0_3.multimodal import multimodal_registry
    from torchtitan_ext.titan_0_3.pipelining import rrfp_pipelining, with_rrfp
    from torchtitan_ext.titan_0_3.trainer import HideLossAdvice, metrics_rank, RRFPTrainer

    assert model_registry("debugmodel").pipelining_fn is pipeline_llm
    assert multimodal_registry().pipelining_fn is pipeline_vlm
    settings = RRFP(buffer_limit=4)
    wrapped = with_rrfp(with_rrfp(model_registry("debugmodel"), RRFP()), settings)
    assert isinstance(wrapped.pipelining_fn, functools.partial)
    assert wrapped.pipelining_fn.func is rrfp_pipelining
    assert wrapped.pipelining_fn.keywords == {"model_pipelining": pipeline_llm,
                                              "settings": settings}
    assert issubclass(RRFPTrainer, Trainer) and issubclass(RRFPTrainer.Config, Trainer.Config)
    assert isinstance(parse(), RRFPTrainer.Config)

    dims = SimpleNamespace(pp_enabled=True, world_size=4, pp=2)
    assert metrics_rank(dims, "RRFP-ZBVZeroBubble") == metrics_rank(dims, "ZBVZeroBubble") == 0
    assert metrics_rank(dims, "RRFP-DualPipeV") == 0
    assert metrics_rank(dims, "RRFP") == metrics_rank(dims, "Interleaved1F1B") == 2

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Keep()
    torchtitan_logger = logging.getLogger()
    torchtitan_logger.addHandler(handler)
    try:
        ensure_pp_loss_visible(parallel_dims=dims, pp_schedule="RRFP", color=NoColor())
    finally:
        torchtitan_logger.removeHandler(handler)
    (record,) = [r for r in records if "run_train.sh" in r.getMessage()]
    assert not HideLossAdvice().filter(record)



@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE (Linux)")
def test_the_verdicts_child_runs_at_idle_priority_from_its_start():
    from torchtitan_ext.common.run_advice import AdvisorProcess

    child = AdvisorProcess("a run", [], low_priority=True)
    try:
        # Before it has imported anything: its start-up is the most of what it takes.
        assert os.sched_getscheduler(child.pid) == os.SCHED_IDLE
    finally:
        child.stop()


def test_the_verdicts_child_answers_from_the_steps_it_is_given():
    from torchtitan_ext.common.run_advice import AdvisorProcess

    child = AdvisorProcess("a run", [], low_priority=False)
    assert child.done(300)
    assert child.answer is None
    assert child.failure == "rrfp.advise: a run: no steps to read"


@pytest.mark.parametrize("total_steps, first_verdict", [(20, False), (100_000, True)])
def test_the_first_verdict_runs_in_the_run_only_where_it_costs_training_little(
        total_steps, first_verdict):
    # Decided after step 4: 4 steps of 2 ranks x 32 actions, about 4.4 s of CPU to predict
    # from. 16 steps of 0.5 s left have 16 s on 2 cores: 1% of it is far less; 99,996
    # steps left have far more.
    from torchtitan.tools.logging import logger as torchtitan_logger
    from torchtitan_ext.common.run_advice import RunAdvice

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    torchtitan_logger.addHandler(handler)
    level = torchtitan_logger.level
    torchtitan_logger.setLevel(logging.INFO)
    advice = RunAdvice(None, source="a run", label=lambda s: f"rank {s.pp_rank}", advise=True,
                       total_steps=total_steps, tensorboard_folder=None)
    try:
        for step in range(1, 6):
            advice.add(step, [made_up_stats(rank, step_time=0.5, realized_order=["0F0"] * 32)
                              for rank in range(2)])
        assert (advice.first_verdict is not None) == first_verdict
    finally:
        torchtitan_logger.removeHandler(handler)
        torchtitan_logger.setLevel(level)
        if advice.first_verdict is not None:
            advice.first_verdict.stop()
    waits = [r.getMessage() for r in records if "comes at the end of the run" in r.getMessage()]
    cores = len(os.sched_getaffinity(0))
    expected = ("rrfp: the verdict comes at the end of the run: predicting now would take "
                f"about 4 s of CPU, over 1% of the {16 * 0.5 * cores:.0f} s the 16 steps "
                f"left have on {cores} cores")
    assert waits == ([] if first_verdict else [expected])


def test_the_summary_names_the_steps_that_held_more_than_the_fixed_schedule():
    from torchtitan_ext.common.run_advice import ab_lines, held_line, StepRecord

    def record(step, held, fixed_order=False, seconds=1.0):
        return StepRecord(step, fixed_order, seconds, {}, {}, {}, {}, held=held,
                          fixed_held={"pp0": 5, "pp1": 3})

    records = [record(s, {"pp0": 6 if s in (2, 3, 7) else 5, "pp1": 3}) for s in range(1, 9)]
    assert held_line(records, ["pp0", "pp1"]) == (
        "pp0 at most 6 (fixed schedule 5; more in steps 2, 3, 7), pp1 at most 3 (fixed schedule 3)")
    # The A/B: each fixed-order step against the RRFP steps beside it.
    steps = [record(s, {}, fixed_order=s % 2 == 0, seconds=1.2 if s % 2 == 0 else 1.0)
             for s in range(2, 9)]
    assert ab_lines(steps)[0] == (
        "  measured (in-run A/B, 4 steps in the fixed order, each against the RRFP steps beside "
        "it): fixed / RRFP step time 1.20x [1.20-1.20] over 4 pairs; RRFP faster in every pair")


def test_importing_the_adapter_leaves_logging_alone():
    """Only a training process holds its log lines until the logging rank is known: a
    library import (a notebook, a test) keeps every record flowing to its handlers."""
    import logging

    import torchtitan_ext.register  # noqa: F401

    assert not logging.getLogger().filters and not logging.getLogger("py.warnings").filters
