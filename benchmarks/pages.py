"""Where the benchmarks write their results: ``benchmarks/results/``."""

from __future__ import annotations

import os

RESULTS = os.path.join(os.path.dirname(__file__), "results")


def result_path(name: str) -> str:
    """The path of ``benchmarks/results/<name>``, the folder made if missing."""
    os.makedirs(RESULTS, exist_ok=True)
    return os.path.join(RESULTS, name)


def write_page(name: str, lines: list[str]) -> str:
    """Write ``lines`` (markdown) as ``benchmarks/results/<name>``; return its path."""
    path = result_path(name)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path
