"""What a user chooses of RRFP is one ``Settings`` object, checked in one place: the
schedule's constructor keeps torch's arguments and the hint, and carries no study knob."""

from __future__ import annotations

import ast
import inspect
from dataclasses import fields, replace
from pathlib import Path

import pytest

from rrfp import ScheduleRRFP, Settings
from rrfp.core import settings as settings_module
from rrfp.core.checks import check_settings
from rrfp.core.hints import build_hint

HINT = build_hint("Interleaved1F1B", num_ranks=2, num_stages=4, n_microbatches=8)
STUDY_KNOBS = {"device", "send_delay", "reorder_ahead"}


def test_the_constructor_keeps_torchs_arguments_the_hint_and_the_settings():
    parameters = inspect.signature(ScheduleRRFP).parameters
    assert len(parameters) <= 12, list(parameters)
    assert not STUDY_KNOBS & set(parameters)
    assert {"stages", "n_microbatches", "loss_fn", "args_chunk_spec", "kwargs_chunk_spec",
            "output_merge_spec", "scale_grads", "hint", "settings"} <= set(parameters)
    assert not STUDY_KNOBS & {f.name for f in fields(Settings)}


def test_settings_are_keyword_only_and_every_field_says_what_it_means():
    with pytest.raises(TypeError):
        Settings("hint+2")  # type: ignore[misc]
    body = next(node for node in ast.parse(Path(settings_module.__file__).read_text()).body
                if isinstance(node, ast.ClassDef) and node.name == "Settings").body
    documented = {field.target.id for field, after in zip(body, body[1:])
                  if isinstance(field, ast.AnnAssign) and isinstance(after, ast.Expr)
                  and isinstance(after.value, ast.Constant)}
    assert documented == {f.name for f in fields(Settings)}


BAD = {"buffer_limit": ("hint-1", "is not understood"),
       "policy": ("eager", "unknown policy 'eager'"),
       "coordination": ("vote", "coordination='vote' is not one of"),
       "launch_depth": (-1, "launch_depth must be an int >= 1"),
       "variable_shapes": ("yes", "must be true or false"),
       "meter_activations": (1, "must be true or false"),
       "meter_every": (0, "meter_every must be an int >= 1"),
       "stall_timeout": (0, "a number of seconds > 0"),
       "fixed_every": (1, "fixed_every must be 0 (no A/B) or an int >= 2"),
       "report_folder": (3, "a folder's path or None"),
       "tune_within": ("hint-2", "is not understood"),
       "tune_hints": ("yes", "must be true or false")}


def test_every_field_has_a_refusal_that_names_it():
    assert set(BAD) == {f.name for f in fields(Settings)}
    check_settings(Settings(), HINT, free_memory_known=False, device="cpu")
    for name, (value, says) in BAD.items():
        with pytest.raises(ValueError) as refused:
            check_settings(replace(Settings(), **{name: value}), HINT,
                           free_memory_known=False, device="cpu")
        assert str(refused.value).startswith(f"{name}: "), refused.value
        assert says in str(refused.value), refused.value


def test_settings_that_only_fail_together_or_over_the_hint_are_refused():
    # One stage per rank: a limit of 1 runs readiness-first, but not the fixed order.
    one_stage = build_hint("1F1B", num_ranks=2, num_stages=2, n_microbatches=4)
    check_settings(Settings(buffer_limit=1), one_stage, free_memory_known=False, device="cpu")
    cases = [(Settings(buffer_limit="busiest", meter_activations=False), "buffer_limit: ",
              "leave meter_activations on"),
             (Settings(buffer_limit="auto"), "buffer_limit: ", "reads the free memory"),
             (Settings(buffer_limit=1, policy="fixed"), "buffer_limit: ", "policy='fixed'"),
             (Settings(buffer_limit=1, fixed_every=2), "fixed_every: ", "fixed_every=2"),
             # Self-driving chooses the limit, the policy and its A/B itself.
             (Settings(tune_within="hint+2", buffer_limit="hint+1"), "tune_within: ",
              "leave buffer_limit at the default"),
             (Settings(tune_within="hint+2", policy="critical"), "tune_within: ",
              "leave policy at the default"),
             (Settings(tune_within="hint+2", fixed_every=2), "tune_within: ",
              "leave fixed_every at the default"),
             (Settings(tune_within="busiest", meter_activations=False), "tune_within: ",
              "leave meter_activations on"),
             (Settings(tune_within="auto"), "tune_within: ", "give the bytes RRFP may use"),
             (Settings(tune_hints=True), "tune_hints: ", "set tune_within to a memory budget")]
    for given, field, says in cases:
        with pytest.raises(ValueError) as refused:
            check_settings(given, one_stage, free_memory_known=False, device="cpu")
        assert str(refused.value).startswith(field) and says in str(refused.value), \
            refused.value


def test_parsed_settings_are_what_the_runtime_reads():
    checked = check_settings(Settings(policy="CRITICAL", launch_depth="none", stall_timeout=5),
                             HINT, free_memory_known=False, device="cpu")
    assert (checked.policy, checked.launch_depth, checked.stall_timeout) == ("critical", None, 5.0)
    assert checked.buffer_limit.spec == "hint" and checked.given.stall_timeout == 5


def test_something_else_than_settings_is_refused_saying_what_to_pass():
    with pytest.raises(ValueError, match=r"pass settings=rrfp.Settings\(buffer_limit=..."):
        check_settings({"buffer_limit": "hint"}, HINT,  # type: ignore[arg-type]
                       free_memory_known=False, device="cpu")


def test_counts_in_messages_agree_with_their_nouns():
    from rrfp.core.text import counted
    from rrfp.core.limits import resolve_buffer_limits
    from rrfp.runtime.limit_plan import limit_summary

    assert [counted(n, "microbatch") for n in (0, 1, 2)] == [
        "0 microbatches", "1 microbatch", "2 microbatches"]
    assert counted(1, "rank") == "1 rank" and counted(3, "stage") == "3 stages"
    # 1F1B on 2 ranks with 2 microbatches: the last rank holds one.
    hint = build_hint("1F1B", num_ranks=2, num_stages=2, n_microbatches=2)
    text = limit_summary("hint", resolve_buffer_limits("hint", hint), hint, 1)
    assert "(1 microbatch on this rank)" in text, text
