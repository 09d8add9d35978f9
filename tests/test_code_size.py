"""The runtime's rooms stay small enough to hold in one's head: no class over 300 lines, no
function (methods included) over 80, no module over 500, in ``rrfp/``.

The limits are written here as the project states them, apart from the measuring code's
constants: the second test measures files at and one line over each of them."""

from __future__ import annotations

from pathlib import Path

import rrfp
from rrfp.testing.code_size import measure, over_limits


def test_no_class_function_or_module_of_the_runtime_is_over_its_limit():
    found = measure(Path(rrfp.__file__).parent)
    assert found["class"] and found["function"] and found["module"]
    over = over_limits(found)
    assert not over, "over the limit:\n" + "\n".join(over)


def definition(head: list[str], lines: int, indent: str) -> list[str]:
    """``head`` (a definition's decorators and first line) and a body, ``lines`` in all."""
    return head + [f"{indent}x{i} = {i}" for i in range(lines - len(head))]


def module_of(lines: int, *, class_lines: int, function_lines: int) -> str:
    """A module of ``lines`` lines: a class and a function of the sizes given, and a
    decorated method of ``function_lines`` in a class of its own."""
    text = (definition(["class Big:"], class_lines, "    ")
            + definition(["def long():"], function_lines, "    ")
            + ["class Holder:"]
            + definition(["    @staticmethod", "    def long_method():"], function_lines,
                         "        "))
    return "\n".join(text + ["# padding"] * (lines - len(text))) + "\n"


def test_the_size_check_flags_one_line_over_each_limit_and_nothing_at_it(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "at.py").write_text(module_of(500, class_lines=300, function_lines=80))
    (package / "over.py").write_text(module_of(501, class_lines=301, function_lines=81))
    found = measure(package)
    assert [s.lines for s in found["module"]] == [501, 500]
    assert sorted(over_limits(found)) == [
        "class pkg/over.py:1 Big: 301 lines, over 300",
        "function pkg/over.py:302 long: 81 lines, over 80",
        "function pkg/over.py:385 long_method: 81 lines, over 80",
        "module pkg/over.py: 501 lines, over 500"]
