"""The layout is the architecture: each module's layer is its package, imports run only
downward (``rrfp.testing.layers.LAYERS``), and no modules import each other in a cycle.
``python -m rrfp.testing.layers`` prints the layout."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rrfp.testing import layers
from rrfp.testing.layers import cycles, Import, imports, layer_of, modules, ROOT, violations


def test_no_import_runs_upward_or_sideways():
    assert violations(imports(modules())) == []


def test_no_modules_import_each_other_in_a_cycle():
    assert cycles(imports(modules())) == []


def test_every_module_has_a_layer():
    assert {module: layer_of(module) for module in modules()}


def test_an_upward_and_a_sideways_import_are_found():
    found = [Import("rrfp.core.arbiter", 3, "rrfp.comm.transport"),
             Import("rrfp.sim.engine", 5, "rrfp.advise.report"),
             Import("rrfp.runtime.schedule", 7, "rrfp.comm.transport"),
             Import("rrfp.core.plan", 9, "rrfp.core.actions")]
    assert violations(found) == [
        "rrfp.core.arbiter:3 imports rrfp.comm.transport (core -> comm)",
        "rrfp.sim.engine:5 imports rrfp.advise.report (sim -> advise)"]


def test_a_cycle_through_a_third_module_is_found():
    found = [Import("rrfp.core.a", 1, "rrfp.core.b"), Import("rrfp.core.b", 1, "rrfp.core.c"),
             Import("rrfp.core.c", 1, "rrfp.core.a"), Import("rrfp.core.c", 2, "rrfp.core.d")]
    assert cycles(found) == [["rrfp.core.a", "rrfp.core.b", "rrfp.core.c"]]


def test_imports_are_read_in_every_spelling(tmp_path, monkeypatch):
    package = tmp_path / "rrfp"
    (package / "core").mkdir(parents=True)
    (package / "comm").mkdir()
    for path in ("__init__.py", "core/__init__.py", "comm/__init__.py", "comm/transport.py",
                 "core/loop.py"):
        (package / path).write_text("")
    (package / "core" / "plan.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from rrfp.comm import transport\n"
        "if TYPE_CHECKING:\n"
        "    import rrfp.comm.transport\n"
        "def f():\n"
        "    from . import loop\n"
        "    from ..comm.transport import x\n")
    monkeypatch.setattr(layers, "ROOT", tmp_path)
    found = imports(modules())
    assert [(i.module, i.line, i.imported) for i in found] == [
        ("rrfp.core.plan", 2, "rrfp.comm"), ("rrfp.core.plan", 2, "rrfp.comm.transport"),
        ("rrfp.core.plan", 4, "rrfp.comm.transport"), ("rrfp.core.plan", 6, "rrfp.core"),
        ("rrfp.core.plan", 6, "rrfp.core.loop"), ("rrfp.core.plan", 7, "rrfp.comm.transport")]
    assert violations(found) == [
        "rrfp.core.plan:2 imports rrfp.comm (core -> comm)",
        "rrfp.core.plan:2 imports rrfp.comm.transport (core -> comm)",
        "rrfp.core.plan:4 imports rrfp.comm.transport (core -> comm)",
        "rrfp.core.plan:7 imports rrfp.comm.transport (core -> comm)"]


def test_a_module_outside_every_layer_is_named():
    with pytest.raises(ValueError, match="rrfp.extras.thing is in no layer"):
        layer_of("rrfp.extras.thing")


def test_the_layout_prints():
    done = subprocess.run([sys.executable, "-m", "rrfp.testing.layers"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "core: " in done.stdout and "  rrfp.core.arbiter (" in done.stdout
    assert done.stdout.rstrip().endswith("no import runs upward or sideways; no cycle")
