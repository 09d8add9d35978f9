"""Harness code stays on its side: the benchmarks import nothing from ``tests/`` (what they
share with the tests lives in ``rrfp.testing``) and each of them imports, the runtime
imports nothing of ``rrfp.testing``, the modules the local worlds' fork server preloads
exist, and what a rank writes by a relative path stays out of the caller's folder."""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from rrfp.testing.worlds import PRELOAD, run_local_world

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


def test_every_benchmark_imports():
    """Most benchmarks run in no test, so a module or name they import that moves would
    go unnoticed until someone regenerates a page: each at least imports (in a process of
    its own, so that what they import stays out of the other tests' process)."""
    modules = [f"benchmarks.{path.stem}" for path in sorted((ROOT / "benchmarks").glob("*.py"))]
    check = ("import importlib, sys\n"
             "for name in sys.argv[1:]:\n"
             "    try:\n"
             "        importlib.import_module(name)\n"
             "    except Exception as error:\n"
             "        print(name, repr(error))\n")
    done = subprocess.run([sys.executable, "-c", check, *modules], cwd=ROOT, text=True,
                          capture_output=True, timeout=300)
    assert (done.returncode, done.stdout) == (0, ""), done.stderr[-2000:]


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


def write_by_relative_path(rank: int, world_size: int) -> str:
    with open("written-by-a-rank.txt", "w") as f:
        f.write(str(rank))
    return os.path.abspath("written-by-a-rank.txt")


def test_a_rank_writes_relative_paths_into_its_world_s_own_folder():
    """As a hang report without a ``report_folder`` does: into the world's temporary
    folder, gone with the world, never into the folder the tests run from."""
    (written,) = set(run_local_world(2, write_by_relative_path, timeout=120))
    assert os.path.dirname(written) != os.getcwd()
    assert not os.path.exists(written) and not os.path.exists("written-by-a-rank.txt")
