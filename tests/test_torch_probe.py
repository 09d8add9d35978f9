"""The torch probe: every private name rrfp relies on (``rrfp._torch_compat.RELIED_ON``),
removed or renamed in turn in a patched torch, or given another signature, makes a
ScheduleRRFP's construction on a real 2-rank pipeline raise one line naming it, before
anything else runs; a missing name makes ``import rrfp`` say the same."""

from __future__ import annotations

import ast
import enum
import importlib
import pathlib
import subprocess
import sys
import types

import pytest

from rrfp import ScheduleRRFP
from rrfp._torch_compat import check_torch, RELIED_ON, supported_range, TORCH_VERSION
from rrfp.testing.chains import build_stages, loss_fn, make_batch, make_chain, run_steps
from rrfp.testing.worlds import run_local_world
from rrfp.torch_probe import Needed

APPLYING = [need for need in RELIED_ON if need.applies_to(TORCH_VERSION)]
SHAPED = [need for need in APPLYING if need.positional is not None]
RENAMED = "_renamed_by_torch"
M = 4


def _renamed_code(code: types.CodeType, old: str, new: str) -> types.CodeType:
    consts = tuple(_renamed_code(c, old, new) if isinstance(c, types.CodeType) else c
                   for c in code.co_consts)
    names = tuple(new if n == old else n for n in code.co_names)
    return code.replace(co_names=names, co_consts=consts)


def _renamed_function(function: types.FunctionType, old: str, new: str) -> types.FunctionType:
    renamed = types.FunctionType(_renamed_code(function.__code__, old, new),
                                 function.__globals__, function.__name__,
                                 function.__defaults__, function.__closure__)
    renamed.__kwdefaults__ = function.__kwdefaults__
    return renamed


def _rename_instance_attribute(patch: pytest.MonkeyPatch, cls: type, name: str) -> None:
    """Every method of ``cls`` and its bases that uses ``self.<name>`` uses another name."""
    for klass in cls.__mro__[:-1]:
        for member_name, member in list(vars(klass).items()):
            if isinstance(member, types.FunctionType) and name in _all_names(member.__code__):
                patch.setattr(klass, member_name, _renamed_function(member, name, name + RENAMED))


def _all_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _all_names(const)
    return names


def _owner(need: Needed) -> tuple[object, str]:
    owner: object = importlib.import_module(need.module)
    *parents, name = need.path.split(".")
    for part in parents:
        owner = getattr(owner, part)
    return owner, name


def _rename(patch: pytest.MonkeyPatch, need: Needed) -> None:
    """What torch renaming ``need`` would look like: the old name gone, a new one there."""
    owner, name = _owner(need)
    if isinstance(owner, enum.EnumMeta):  # members cannot be deleted: a new enum without it
        module = importlib.import_module(need.module)
        members = {m.name: m.value for m in owner if m.name != name}
        members[name + RENAMED] = "renamed"
        patch.setattr(module, owner.__name__, enum.Enum(owner.__name__, members, type=str))
        return
    for defining in [k for k in getattr(owner, "__mro__", (owner,)) if name in vars(k)]:
        value = vars(defining)[name]
        patch.delattr(defining, name)
        patch.setattr(defining, name + RENAMED, value, raising=False)
    if isinstance(owner, type):  # and wherever its methods assign or read it
        _rename_instance_attribute(patch, owner, name)


def _change_signature(patch: pytest.MonkeyPatch, need: Needed) -> None:
    """``need`` still there, but taking nothing rrfp passes."""
    owner, name = _owner(need)

    def changed(*, a_keyword_rrfp_does_not_pass):
        raise AssertionError("the probe must refuse before anything calls it")

    defining = next((k for k in getattr(owner, "__mro__", (owner,)) if name in vars(k)), owner)
    patch.setattr(defining, name, changed)


def _construction_error(stages: list, breaks) -> str | None:
    """The error (type: message) building a ScheduleRRFP raises with torch broken by
    ``breaks(patch)``; None if it builds."""
    with pytest.MonkeyPatch.context() as patch:
        breaks(patch)
        check_torch.cache_clear()
        try:
            ScheduleRRFP(stages, M, loss_fn=loss_fn).close()
            return None
        except Exception as e:  # noqa: BLE001 - what exactly is raised is the finding
            return f"{type(e).__name__}: {e}"
        finally:
            check_torch.cache_clear()


def probe_errors(rank: int, world_size: int) -> dict:
    """Per name of ``RELIED_ON`` that applies here: the error building a ScheduleRRFP
    raises with it renamed, and with its signature changed; then, torch restored, a
    ScheduleRRFP built and run for a step (nothing of the patching is left)."""
    chain = make_chain(2 * world_size)
    stages, blocks = build_stages(chain, rank, world_size, "loop")
    renamed = {need.qualified: _construction_error(stages, lambda p, n=need: _rename(p, n))
               for need in APPLYING}
    changed = {need.qualified: _construction_error(
        stages, lambda p, n=need: _change_signature(p, n)) for need in SHAPED}
    schedule = ScheduleRRFP(stages, M, loss_fn=loss_fn)
    x, y = make_batch(M)
    run_steps(schedule, stages, blocks, x, y, 1)
    schedule.close()
    return {"renamed": renamed, "changed": changed, "ran_after": True}


@pytest.fixture(scope="module")
def errors() -> list[dict]:
    return run_local_world(2, probe_errors, timeout=240)


def _one_clear_line(message: str | None, need: Needed, what: str) -> None:
    assert message is not None, f"{need.qualified} {what}: ScheduleRRFP was built"
    assert message.startswith("UnsupportedTorchError: rrfp needs "), message
    assert "\n" not in message, message
    assert f"{need.qualified}: {what}" in message, message
    assert f"supported torch: {supported_range()}" in message, message


@pytest.mark.parametrize("need", APPLYING, ids=lambda n: n.qualified)
def test_a_renamed_private_name_is_named_at_construction(errors, need):
    for rank_errors in errors:
        _one_clear_line(rank_errors["renamed"][need.qualified], need, "missing or renamed")


@pytest.mark.parametrize("need", SHAPED, ids=lambda n: n.qualified)
def test_a_changed_signature_is_named_at_construction(errors, need):
    for rank_errors in errors:
        _one_clear_line(rank_errors["changed"][need.qualified], need, "signature changed")


def test_the_schedule_runs_again_once_torch_is_restored(errors):
    assert all(rank_errors["ran_after"] for rank_errors in errors)


def test_the_probe_lists_every_private_torch_name_rrfp_imports():
    """Each private name of torch that a module of rrfp (not its test harness) or of
    torchtitan_ext imports is in the probe's list."""
    listed = {need.qualified for need in RELIED_ON}
    listed |= {need.qualified.rsplit(".", 1)[0] for need in RELIED_ON}  # classes, by members
    files = [p for p in pathlib.Path("rrfp").rglob("*.py") if "testing" not in p.parts]
    missing = set()
    for path in [*files, *pathlib.Path("torchtitan_ext").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch."):
                missing |= {f"{node.module}.{alias.name}" for alias in node.names
                            if alias.name.startswith("_")} - listed
    assert not missing, sorted(missing)


def test_a_missing_name_stops_import_in_one_line():
    code = ("import torch.distributed.pipelining.schedules as s; del s._add_reduce_grad; "
            "import rrfp")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("rrfp.torch_probe.UnsupportedTorchError: rrfp needs "
                           "torch.distributed.pipelining.schedules._add_reduce_grad: missing"), last
