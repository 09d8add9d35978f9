"""Whether the running torch still has a private name rrfp drives, with the call shape rrfp
uses: the mechanism behind ``rrfp._torch_compat.check_torch`` (which lists the names).

A name is a module attribute, or a member of a class in one (a method, a property, an enum
member, a named-tuple field), or an instance attribute: one that some method of the class
or of a base assigns (``self.<name> = ...``, read off the methods' bytecode, since no
instance exists before a schedule is built). A call shape is how many positional
arguments rrfp passes and which keywords; it is checked against the callable's signature.
"""

from __future__ import annotations

import dataclasses
import difflib
import dis
import importlib
import inspect
import re
import types
from collections.abc import Iterator

Version = tuple[int, int]


class UnsupportedTorchError(RuntimeError):
    """The running torch lacks a private name rrfp drives, or calls it differently
    (``rrfp._torch_compat.check_torch`` names each in one line)."""


@dataclasses.dataclass(frozen=True)
class Needed:
    """One private name rrfp relies on, in the torch versions ``since`` (inclusive) to
    ``until`` (exclusive); None: no bound."""

    module: str
    path: str
    """``"name"``, ``"Class.member"``: what follows the module."""
    positional: int | None = None
    """How many positional arguments rrfp passes when it calls it (None: not called)."""
    keywords: tuple[str, ...] = ()
    since: Version | None = None
    until: Version | None = None

    @property
    def qualified(self) -> str:
        return f"{self.module}.{self.path}"

    def applies_to(self, version: Version) -> bool:
        return ((self.since is None or version >= self.since)
                and (self.until is None or version < self.until))

    def call_shape(self) -> str:
        return ", ".join([f"{self.positional} positional"] + [f"{k}=" for k in self.keywords])


_SPEC = re.compile(r"^([\w.]+)(?:\((\d+)((?:,\s*\w+)*)\))?$")


def needed(module: str, *specs: str, since: Version | None = None,
           until: Version | None = None) -> tuple[Needed, ...]:
    """``Needed`` for each spec of ``module``: ``"path"``, or ``"path(n, kw, ...)"`` for a
    callable rrfp calls with n positional arguments and those keywords."""
    found = []
    for spec in specs:
        match = _SPEC.match(spec)
        if match is None:
            raise ValueError(f"{spec!r} is not a name or 'name(positional, keyword, ...)'")
        path, positional, keywords = match.groups()
        found.append(Needed(module, path, None if positional is None else int(positional),
                            tuple(k.strip() for k in (keywords or "").split(",") if k.strip()),
                            since, until))
    return tuple(found)


def problems(names: tuple[Needed, ...], version: Version) -> list[str]:
    """What is wrong with each name that applies to torch ``version``: ``"<qualified>:
    <what>"``, in the order of ``names``."""
    assigned: dict[type, set[str]] = {}
    found = []
    for need in names:
        if need.applies_to(version):
            problem = _problem(need, assigned)
            if problem is not None:
                found.append(f"{need.qualified}: {problem}")
    return found


def _problem(need: Needed, assigned: dict[type, set[str]]) -> str | None:
    try:
        owner: object = importlib.import_module(need.module)
    except ImportError:
        return f"module {need.module} is missing"
    *parents, name = need.path.split(".")
    for part in parents:
        if not hasattr(owner, part):
            return _missing(owner, part, assigned)
        owner = getattr(owner, part)
    if hasattr(owner, name):
        return _signature_problem(need, owner, name)
    if isinstance(owner, type) and name in _assigned_by(owner, assigned):
        return None
    return _missing(owner, name, assigned)


def _missing(owner: object, name: str, assigned: dict[type, set[str]]) -> str:
    known = set(dir(owner))
    if isinstance(owner, type):
        known |= _assigned_by(owner, assigned)
    nearest = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.75)
    return f"missing or renamed{f' (nearest: {nearest[0]})' if nearest else ''}"


def _signature_problem(need: Needed, owner: object, name: str) -> str | None:
    if need.positional is None:
        return None
    target = getattr(owner, name)
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):  # a builtin without a signature: its presence is all
        return None
    bound_self = isinstance(owner, type) and inspect.isfunction(
        inspect.getattr_static(owner, name))
    arguments = [None] * (need.positional + bound_self)
    try:
        signature.bind(*arguments, **dict.fromkeys(need.keywords))
    except TypeError:
        return f"signature changed: torch's is {signature}, rrfp passes {need.call_shape()}"
    return None


def _assigned_by(cls: type, assigned: dict[type, set[str]]) -> set[str]:
    """The attribute names that the methods of ``cls`` and of its bases assign."""
    if cls not in assigned:
        names: set[str] = set()
        for klass in cls.__mro__[:-1]:
            for member in vars(klass).values():
                for code in _codes(member):
                    names.update(i.argval for i in dis.get_instructions(code)
                                 if i.opname == "STORE_ATTR")
        assigned[cls] = names
    return assigned[cls]


def _codes(member: object) -> Iterator[types.CodeType]:
    """The code of a class member (a function, a property's accessors, a static or class
    method), nested functions included."""
    if isinstance(member, property):
        functions = [member.fget, member.fset]
    else:
        functions = [getattr(member, "__func__", member)]
    pending = [f.__code__ for f in functions if isinstance(f, types.FunctionType)]
    while pending:
        code = pending.pop()
        yield code
        pending.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
