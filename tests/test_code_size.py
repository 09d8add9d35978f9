"""The runtime's rooms stay small enough to hold in one's head."""

from __future__ import annotations

from pathlib import Path

import rrfp
from rrfp.testing.code_size import MAX_CLASS, MAX_FUNCTION, MAX_MODULE, measure, over_limits


def test_no_class_function_or_module_of_the_runtime_is_over_its_limit():
    found = measure(Path(rrfp.__file__).parent)
    assert found["class"] and found["function"] and found["module"]
    assert over_limits(found) == []


def test_the_size_check_finds_what_is_over(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION))
    (package / "big.py").write_text(f"def long():\n{body}\n"
                                    + "\n" * (MAX_MODULE - MAX_FUNCTION)
                                    + "class Small:\n    pass\n")
    over = over_limits(measure(package))
    assert [line.split(":")[0] for line in over] == ["function pkg/big.py", "module pkg/big.py"]
    assert MAX_CLASS == 300
