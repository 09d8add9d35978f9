"""Harness code stays on its side: the benchmarks import nothing from ``tests/`` (what they
share with the tests lives in ``rrfp.testing``), the runtime imports nothing of
``rrfp.testing``, and the modules the local worlds' fork server preloads exist."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

from rrfp.testing.worlds import PRELOAD

ROOT = Path(__file__).resolve().parents[1]


def imports_of(root: Path, package: str) -> list[str]:
    """``path:line module`` for every import of ``package`` (or of a module in it) by a
    Python file under ``root``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            found += [f"{path.relative_to(root.parent)}:{node.lineno} {module}"
                      for module in modules
                      if module == package or module.startswith(package + ".")]
    return found


def test_benchmarks_import_nothing_from_tests():
    assert imports_of(ROOT / "benchmarks", "tests") == []


def test_the_runtime_imports_nothing_of_its_testing_package():
    runtime = [where for where in imports_of(ROOT / "rrfp", "rrfp.testing")
               if not where.startswith(("rrfp/testing/", "rrfp/demo.py:"))]
    assert runtime == []


def test_an_import_from_tests_is_found_in_every_spelling(tmp_path):
    package = tmp_path / "bench"
    package.mkdir()
    (package / "a.py").write_text("import tests.workers\nimport testsuite\n")
    (package / "b.py").write_text("def f():\n    from tests import workers\n"
                                  "    from tests.workers import make_chain\n"
                                  "    from .tests import x\n")
    assert imports_of(package, "tests") == [
        "bench/a.py:1 tests.workers", "bench/b.py:2 tests", "bench/b.py:3 tests.workers"]


def test_every_module_the_fork_server_preloads_exists():
    # The fork server skips a preloaded module that fails to import, silently.
    assert [name for name in PRELOAD if importlib.util.find_spec(name) is None] == []
