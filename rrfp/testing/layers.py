"""The layers of rrfp, derived from where each module lives, and the imports that break them.

``python -m rrfp.testing.layers`` prints the layout: each layer, what it may import and its
modules. A module's layer is its package (``rrfp.core.arbiter`` is in ``core``); the
modules at the top of ``rrfp`` have layers of their own (``rrfp._torch_compat`` and the
probe it runs, ``rrfp.torch_probe``: ``compat``, below everything; ``rrfp``'s
``__init__``: ``api``, the public names; ``rrfp.demo``: ``tools``). An import is allowed
inside a layer and into the layers that layer lists; anything else runs upward or
sideways. Imports are read from the source (every ``import``, inside functions and
``TYPE_CHECKING`` blocks too), so a cycle between modules is found whether or not it
would fail at import time.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

LAYERS: dict[str, tuple[str, frozenset[str]]] = {
    # layer: (what it holds, the layers it may import); lowest first.
    "compat": ("every difference between the supported torch versions, and the probe of "
               "what rrfp drives", frozenset()),
    "core": ("the plan, limits, arbiter, policies and the step loop; no process talks",
             frozenset({"compat"})),
    "devices": ("what differs by device type: the loop's devices, platforms, streams",
                frozenset({"compat", "core"})),
    "comm": ("channels, the data plane, receive rings, group agreement, the store's boards",
             frozenset({"compat", "core", "devices"})),
    "failure": ("the job's watch and settings agreement, a stall's hang report",
                frozenset({"compat", "core", "devices", "comm"})),
    "sim": ("the discrete-event simulator, on the core's own arbiter and policies",
            frozenset({"compat", "core"})),
    "advise": ("a run's traces replayed in the simulator: the advisor",
               frozenset({"compat", "core", "sim"})),
    "runtime": ("ScheduleRRFP and a step's phases on torch's stages; self-driving predicts "
                "with the advisor",
                frozenset({"compat", "core", "devices", "comm", "failure", "sim", "advise"})),
    "api": ("the public names: from rrfp import ...",
            frozenset({"compat", "core", "runtime"})),
    "testing": ("the harness: local worlds, emulated devices, fakes, study knobs",
                frozenset({"compat", "core", "devices", "comm", "failure", "runtime", "api",
                           "sim", "advise"})),
    "tools": ("commands built on the harness (the demo)",
              frozenset({"compat", "core", "devices", "comm", "failure", "runtime", "api",
                         "sim", "advise", "testing"})),
}
TOP_LEVEL = {"rrfp._torch_compat": "compat", "rrfp.torch_probe": "compat", "rrfp": "api",
             "rrfp.demo": "tools"}


@dataclass(frozen=True)
class Import:
    module: str
    line: int
    imported: str


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> str:
    """The layer of an ``rrfp`` module: its package, or its own for the top-level ones."""
    if module in TOP_LEVEL:
        return TOP_LEVEL[module]
    package = module.split(".")[1]
    if package not in LAYERS:
        raise ValueError(f"{module} is in no layer: put it into one of {', '.join(LAYERS)} "
                         "or name its layer in rrfp.testing.layers.TOP_LEVEL")
    return package


def modules() -> dict[str, Path]:
    """Every module of ``rrfp`` by name."""
    return {module_name(path): path for path in sorted((ROOT / "rrfp").rglob("*.py"))}


def _imported(node: ast.AST, module: str, is_package: bool) -> Iterator[str]:
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            package = module.split(".")[: len(module.split(".")) - node.level + is_package]
            base = ".".join(package + ([base] if base else []))
        yield base
        # ``from rrfp.comm import channels`` imports the module ``rrfp.comm.channels``.
        yield from (f"{base}.{alias.name}" for alias in node.names)


def imports(known: dict[str, Path]) -> list[Import]:
    """Every import of one ``rrfp`` module by another (a name imported from a package
    counts as an import of that module where one of that name exists)."""
    found = []
    for module, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            for name in _imported(node, module, path.name == "__init__.py"):
                if name in known and name != module and name.startswith("rrfp"):
                    found.append(Import(module, node.lineno, name))
    return sorted(set(found), key=lambda i: (i.module, i.line, i.imported))


def _is_package_of(imported: str, module: str) -> bool:
    return module.startswith(imported + ".")


def violations(found: list[Import]) -> list[str]:
    """Imports that run upward or sideways: ``module:line imports name (layer -> layer)``."""
    wrong = []
    for i in found:
        source, target = layer_of(i.module), layer_of(i.imported)
        if _is_package_of(i.imported, i.module):
            continue  # a package's ``__init__`` runs first: not a dependency on it
        if source != target and target not in LAYERS[source][1]:
            wrong.append(f"{i.module}:{i.line} imports {i.imported} ({source} -> {target})")
    return wrong


def cycles(found: list[Import]) -> list[list[str]]:
    """Each group of modules that import each other, directly or through others."""
    graph: dict[str, set[str]] = {}
    for i in found:
        if not _is_package_of(i.imported, i.module):
            graph.setdefault(i.module, set()).add(i.imported)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def layout() -> str:
    """Each layer, lowest first: what it holds, what it may import, its modules."""
    by_layer: dict[str, list[str]] = {layer: [] for layer in LAYERS}
    for module, path in modules().items():
        lines = len(path.read_text().splitlines())
        by_layer[layer_of(module)].append(f"{module} ({lines} lines)")
    text = []
    for layer, (holds, may) in LAYERS.items():
        text.append(f"{layer}: {holds}")
        text.append(f"  may import: {', '.join(sorted(may)) or 'nothing of rrfp'}")
        text += [f"  {entry}" for entry in by_layer[layer]]
    return "\n".join(text)


if __name__ == "__main__":
    print(layout())
    found = imports(modules())
    problems = violations(found) + [" <-> ".join(c) for c in cycles(found)]
    print("\n".join(problems) if problems else "\nno import runs upward or sideways; no cycle")
    sys.exit(1 if problems else 0)
