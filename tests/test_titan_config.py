"""torchtitan_ext's settings: the RRFP schedule names, the checks a job's configuration
passes before anything is built, the ``[rrfp]`` TOML table and the ``--rrfp.*`` options as
torchtitan parses them, and the one line a job with a bad configuration stops with."""

from __future__ import annotations

import dataclasses
import os
import re

import pytest

from rrfp import ScheduleRRFP, Settings
from rrfp.core.hints import HINT_NAMES
from rrfp.core.settings import BufferLimit, parse_buffer_limit
from rrfp.testing.chains import build_stages, loss_fn, make_chain
from rrfp.testing.worlds import run_local_world
from tests.titan_helpers import (
    check, failure_excerpt, JOBS, n_layers, only_0_2, only_0_3, parse, parse_args, ROOT,
    run_titan, TITAN_0_2, titan_integration, toml_with_rrfp_lines)
from torchtitan_ext.common.schedules import hint_of, placement_schedule, schedule_settings, validate


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
    # The main job sets fixed_every = 2 (its in-run A/B): the refusal says how to reset it.
    (["--rrfp.tune_within", "hint+2"],
     r"rrfp.tune_within: tune_within='hint\+2' chooses buffer_limit and the policy itself and "
     r"runs its own in-run A/B: leave fixed_every at the default \(fixed_every=0\), or drop "
     r"tune_within to run the setting you give; on the command line: --rrfp.fixed_every 0$"),
    (["--rrfp.tune_within", "hint+2", "--rrfp.fixed_every", "0", "--rrfp.policy", "critical"],
     r"rrfp.tune_within: .*: leave policy at the default .*; on the command line: "
     r"--rrfp.policy ''$"),
    (["--rrfp.tune_within", "busiest", "--rrfp.buffer_limit", "hint+1"],
     r"rrfp.tune_within: .*: leave buffer_limit, fixed_every at their defaults .*; on the "
     r"command line: --rrfp.buffer_limit hint --rrfp.fixed_every 0$"),
    (["--rrfp.tune_within", "auto", "--rrfp.fixed_every", "0"],
     "rrfp.tune_within: 'auto' leaves the budget to the device: give the bytes"),
    (["--rrfp.tune_within", "1GiB", "--rrfp.fixed_every", "0", "--rrfp.no-meter-activations"],
     "rrfp.tune_within: .* leave meter_activations on"),
    (["--rrfp.tune_within", "hint-2", "--rrfp.fixed_every", "0"],
     "rrfp.tune_within: buffer_limit='hint-2' is not understood"),
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


def test_the_settings_are_written_as_torchtitans_configs():
    """``RRFPConfig`` as torchtitan 0.3 writes its config dataclasses: keyword-only,
    slotted, and a docstring under each field (tyro shows it as the option's help)."""
    import ast
    import inspect

    from torchtitan_ext.config import RRFPConfig

    names = [f.name for f in dataclasses.fields(RRFPConfig)]
    assert all(f.kw_only for f in dataclasses.fields(RRFPConfig))
    assert tuple(vars(RRFPConfig)["__slots__"]) == tuple(names)
    (definition,) = ast.parse(inspect.getsource(RRFPConfig)).body
    body = definition.body
    documented = [node.target.id for node, after in zip(body, body[1:])
                  if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr)
                  and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)]
    assert documented == names


def test_every_rrfp_setting_is_checked_before_anything_is_built():
    """Each field of ``RRFPConfig`` given a value of no accepted kind (as a TOML file can: its
    values are not converted) is refused naming the field and what it accepts; and the
    checks ScheduleRRFP makes of its device: 'auto' reads a CUDA device's free memory."""
    import dataclasses

    from rrfp.core.hints import build_hint
    from torchtitan_ext.config import RRFPConfig
    from torchtitan_ext.common.schedules import check_settings

    hint = build_hint("Interleaved1F1B", num_ranks=2, num_stages=4, n_microbatches=8)
    check_settings(RRFPConfig(), hint, "cpu")
    accepted = {"buffer_limit": "use 'hint'", "policy": "one of", "coordination": "not one of",
                "launch_depth": "an int >= 1", "variable_shapes": "true or false",
                "meter_activations": "true or false", "meter_every": "an int >= 1",
                "stall_timeout": "a number of seconds > 0", "log_stats": "true or false",
                "trace_folder": "a folder", "advise": "true or false",
                "fixed_every": "an int >= 2", "tune_within": "use 'hint'",
                "tune_hints": "true or false"}
    assert set(accepted) == {f.name for f in dataclasses.fields(RRFPConfig)}
    for name, says in accepted.items():
        with pytest.raises(ValueError) as refused:
            check_settings(dataclasses.replace(RRFPConfig(), **{name: 1.5j}), hint, "cuda")
        assert str(refused.value).startswith(f"rrfp.{name}: "), refused.value
        assert says in str(refused.value), refused.value
    with pytest.raises(ValueError, match="rrfp.buffer_limit: buffer_limit='auto' reads the "
                       "free memory of a CUDA device; these stages are on cpu"):
        check_settings(RRFPConfig(buffer_limit="auto"), hint, "cpu")
    check_settings(RRFPConfig(buffer_limit="auto"), hint, "cuda")


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
        "fixed_every, tune_within, tune_hints")
    assert unknown_options(["--rrfp.no-meter-activation", "--rrfp.xyz=1"]).startswith(
        "unknown options --rrfp.no-meter-activation (did you mean "
        "--rrfp.no-meter-activations?), --rrfp.xyz;")
    config_file = tmp_path / "train.toml"
    config_file.write_text(toml_with_rrfp_lines('bufer_limit = "hint"'))
    assert unknown_toml_keys(["--job.config_file", str(config_file)]) == (
        f"unknown setting 'bufer_limit' (did you mean 'buffer_limit'?) in the [rrfp] table "
        f"of {config_file}; the settings are buffer_limit, policy, coordination, "
        "launch_depth, variable_shapes, meter_activations, meter_every, stall_timeout, "
        "log_stats, trace_folder, advise, fixed_every, tune_within, tune_hints")
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
    config function's ``rrfp`` field (0.3) give the same ``RRFPConfig``."""
    from torchtitan_ext.config import RRFPConfig

    assert parse().rrfp == RRFPConfig(buffer_limit="hint", stall_timeout=300, log_stats=True,
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


@pytest.mark.parametrize("cli_value,expected", [("hint+2", BufferLimit(None, extra=2)),
                                                ("7", BufferLimit(7)), ("busiest", None)])
def test_tune_within_reaches_the_schedules_settings_from_the_command_line(cli_value, expected):
    """``--rrfp.tune_within`` (with the main job's A/B reset) passes the check and is the
    budget ScheduleRRFP gets; left out (empty), self-driving is off."""
    from rrfp.core.checks import check_settings as check_rrfp_settings
    from rrfp.core.hints import build_hint

    hint = build_hint("Interleaved1F1B", num_ranks=2, num_stages=4, n_microbatches=8)
    config = parse("--rrfp.tune_within", cli_value, "--rrfp.fixed_every", "0")
    check(config)
    settings = schedule_settings(config.rrfp)
    assert settings.fixed_every == 0 and settings.buffer_limit == "hint"
    budget = check_rrfp_settings(settings, hint, free_memory_known=False,
                                 device="cpu").tune_within
    assert budget is not None and budget.busiest == (cli_value == "busiest")
    if expected is not None:
        assert budget == expected
    off = schedule_settings(parse().rrfp)
    assert off.tune_within == ""
    assert check_rrfp_settings(dataclasses.replace(off, fixed_every=0), hint,
                               free_memory_known=False, device="cpu").tune_within is None


@only_0_2
@pytest.mark.parametrize("lines,message", [
    (['tune_within = "hint+2"'], None),
    (['tune_within = 3'], None),
    (['tune_within = ""', "fixed_every = 2"], None),  # off: the main job as it is
    (['tune_within = "hint+2"', "fixed_every = 2"],
     "rrfp.tune_within: tune_within='hint+2' chooses buffer_limit and the policy itself and "
     "runs its own in-run A/B: leave fixed_every at the default (fixed_every=0), or drop "
     "tune_within to run the setting you give; on the command line: --rrfp.fixed_every 0"),
    (['tune_within = "hint+2"', 'policy = "arrival"'], "leave policy at the default"),
])
def test_tune_within_in_toml(lines, message, tmp_path):
    """The ``[rrfp]`` table's ``tune_within`` (the main job's ``fixed_every = 2`` line
    replaced by ``lines``): the budget reaches ScheduleRRFP's settings, or the check
    refuses it naming ``rrfp.tune_within`` and the option that resets what it chooses."""
    with open(os.path.join(ROOT, JOBS["main"][0])) as f:
        text = f.read()
    fixed_every = next(line for line in text.splitlines() if line.startswith("fixed_every ="))
    config_file = tmp_path / "train.toml"
    config_file.write_text(text.replace(fixed_every, "\n".join(lines)))
    config = parse_args("--job.config_file", str(config_file))
    if message is not None:
        with pytest.raises(ValueError, match=re.escape(message)):
            check(config)
        return
    check(config)
    tune_within = schedule_settings(config.rrfp).tune_within
    assert tune_within == {'"hint+2"': "hint+2", "3": 3, '""': ""}[lines[0].split(" = ")[1]]


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
    (dict(buffer_limit="Hint+1", policy="arrival", launch_depth="none"),
     dict(buffer_limit='"hint+1"', policy='"Arrival"', launch_depth='"NONE"'),
     ["--limit", "HINT + 1", "--policy", "ARRIVAL", "--launch-depth", "NONE"]),
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
        ("critical", math.inf), ("hint", 3), ("lookahead", math.inf), ("arrival", math.inf),
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
        "fixed_every, tune_within, tune_hints")


@titan_integration
def test_a_bad_setting_value_stops_the_job_with_one_line(tmp_path):
    code, out = run_titan(2, "--rrfp.stall_timeout", "-5", dump=str(tmp_path))
    assert_stopped_with_one_line(code, out, (
        "rrfp: bad configuration: rrfp.stall_timeout: stall_timeout must be a number of "
        "seconds > 0, got -5.0"))


@titan_integration
def test_an_unknown_rrfp_option_stops_the_job_naming_the_nearest(tmp_path):
    """On either torchtitan, from ``torchtitan_ext.train`` (stock ``torchtitan.train``
    reports an unknown option itself)."""
    code, out = run_titan(2, "--rrfp.bufer_limit", "4", dump=str(tmp_path))
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
