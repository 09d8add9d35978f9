"""Unknown RRFP setting names, named with the nearest known one before torchtitan parses.

torchtitan refuses an unknown name itself, on every rank and in its own words: 0.2.2 with
a traceback for a key of the TOML's ``[rrfp]`` table that advises ``run_train.sh --help``,
tyro (both versions) with a box of help for an unknown ``--rrfp.<name>``. Here they stop
the job with one ``rrfp: bad configuration: ...`` line (``torchtitan_ext.common.stop``), before
torchtitan parses: from ``torchtitan_ext.train`` (on 0.2.2 the TOML and the command line, on
0.3 the command line).
"""

from __future__ import annotations

import dataclasses
import difflib
import os

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: torchtitan 0.2.2 depends on tomli
    import tomli as tomllib

from torchtitan_ext.config import RRFPConfig
from torchtitan_ext.common.stop import stop_job

SETTINGS = tuple(f.name for f in dataclasses.fields(RRFPConfig))
"""The ``[rrfp]`` settings, in the order of ``torchtitan_ext.config.RRFPConfig``."""
FLAGS = tuple(f.name for f in dataclasses.fields(RRFPConfig) if isinstance(f.default, bool))
"""The settings that are true or false: tyro also takes ``--rrfp.no-<name>`` for them."""
OPTION = "--rrfp."
TOML_FILE_OPTIONS = ("--job.config_file", "--job.config-file")
"""How torchtitan 0.2.2 is given the TOML file (either, then the path or ``=path``)."""


def nearest(name: str, known: tuple[str, ...]) -> str | None:
    """The known name closest to ``name`` (``difflib``), None if none is close."""
    close = difflib.get_close_matches(name, known, n=1)
    return close[0] if close else None


def described(unknown: list[str], known: tuple[str, ...], spell) -> str:
    """``unknown`` names, each with the nearest known one, as ``spell`` writes names."""
    parts = []
    for name in unknown:
        guess = nearest(name.replace("-", "_"), known)
        hyphens = "-" in name
        suggestion = "" if guess is None else (
            f" (did you mean {spell(guess.replace('_', '-') if hyphens else guess)}?)")
        parts.append(spell(name) + suggestion)
    return ", ".join(parts)


def unknown_options(args: list[str]) -> str | None:
    """What is wrong with the ``--rrfp.<name>`` options of ``args`` (written with ``_`` or
    ``-``, ``--rrfp.no-<flag>`` too), None if every name is a setting."""
    known = SETTINGS + tuple(f"no_{flag}" for flag in FLAGS)
    names = [arg[len(OPTION):].split("=", 1)[0] for arg in args if arg.startswith(OPTION)]
    unknown = [name for name in names if name.replace("-", "_") not in known]
    if not unknown:
        return None
    plural = "s" if len(unknown) > 1 else ""
    return (f"unknown option{plural} {described(unknown, known, lambda n: OPTION + n)}; the rrfp "
            f"settings are {', '.join(SETTINGS)}")


def toml_file(args: list[str]) -> str | None:
    """The TOML file ``args`` give torchtitan 0.2.2, None if none."""
    for i, arg in enumerate(args):
        name, equals, value = arg.partition("=")
        if name in TOML_FILE_OPTIONS:
            return value if equals else (args[i + 1] if i + 1 < len(args) else None)
    return None


def missing_toml_file(args: list[str]) -> str | None:
    """What is wrong when the TOML file ``args`` give is no file (torchtitan would stop
    every rank with a traceback), with the nearest name in its folder; None if it is one."""
    path = toml_file(args)
    if path is None or os.path.isfile(path):
        return None
    folder = os.path.dirname(path) or "."
    tomls = (tuple(n for n in os.listdir(folder) if n.endswith(".toml"))
             if os.path.isdir(folder) else ())
    guess = nearest(os.path.basename(path), tomls)
    suggestion = "" if guess is None else f" (did you mean {os.path.join(folder, guess)}?)"
    return f"--job.config_file {path}: no such file{suggestion}"


def unknown_toml_keys(args: list[str]) -> str | None:
    """What is wrong with the keys of the ``[rrfp]`` table of the TOML file that ``args``
    give, None if each is a setting (or there is no readable file: torchtitan says so)."""
    path = toml_file(args)
    if path is None or not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as f:
            table = tomllib.load(f).get("rrfp", {})
    except tomllib.TOMLDecodeError:
        return None
    unknown = [key for key in table if key not in SETTINGS] if isinstance(table, dict) else []
    if not unknown:
        return None
    plural = "s" if len(unknown) > 1 else ""
    return (f"unknown setting{plural} {described(unknown, SETTINGS, repr)} in the [rrfp] table of "
            f"{path}; the settings are {', '.join(SETTINGS)}")


def stop_on_unknown_settings(args: list[str], *, toml: bool) -> None:
    """Stop the job with one line if ``args`` name an unknown ``--rrfp.<name>`` or (with
    ``toml``: torchtitan 0.2.2) a TOML file that is not there or whose ``[rrfp]`` table
    has an unknown key."""
    checks = (missing_toml_file, unknown_toml_keys, unknown_options) if toml else (unknown_options,)
    problems = [problem for problem in (check(args) for check in checks) if problem is not None]
    if problems:
        stop_job("rrfp: bad configuration: " + "; ".join(problems))
