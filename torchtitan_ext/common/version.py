"""Which torchtitan is installed, and so which of torchtitan_ext's two adapters applies.

* torchtitan 0.2 (0.2.2): a job is a TOML file; ``[experimental] custom_import =
  "torchtitan_ext.register"`` and ``[job] custom_config_module = "torchtitan_ext.config"``
  add the schedules and the ``[rrfp]`` section (``register`` and ``titan_0_2``).
* torchtitan 0.3: a job is a config function, ``--module torchtitan_ext --config <fn>``
  (``config_registry``), whose ``Trainer.Config`` has an ``rrfp`` field (``titan_0_3``).

Everything else (names, validation, placement, coordination, stats, traces, data, assets)
is shared. Importing ``torchtitan_ext`` or this module never fails; an adapter's modules
raise ``ImportError`` naming what to use instead when the other version is installed, and
0.3's stop the job with one line naming what to install when the torch beside it is older
than 0.3 needs (``torch_mismatch``: torchtitan declares no torch requirement of its own).
"""

from __future__ import annotations

from importlib import metadata

from torchtitan_ext.common.stop import stop_job

SUPPORTED = ((0, 2), (0, 3))
"""The torchtitan minor versions an adapter exists for."""

TORCH_FOR_0_3 = (2, 14)
"""The oldest torch torchtitan 0.3 runs on: it calls ``torch.distributed.set_timeout``
(new in torch 2.14) after the first step. torchtitan 0.2.2 runs on every torch rrfp
supports (2.13-2.15)."""


def major_minor(package: str, text: str) -> tuple[int, int]:
    """(major, minor) of a version string such as ``"0.3.0"`` or ``"2.13.0+cpu"``."""
    parts = text.split(".")
    try:
        return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)
    except (IndexError, ValueError):
        raise ImportError(f"cannot read {package}'s version {text!r}") from None


def torchtitan_version() -> tuple[int, int] | None:
    """(major, minor) of the installed torchtitan, None if it is not installed."""
    try:
        return major_minor("torchtitan", metadata.version("torchtitan"))
    except metadata.PackageNotFoundError:
        return None


def torch_mismatch(torchtitan_text: str, torch_text: str) -> str | None:
    """The line that says what to install when torchtitan ``torchtitan_text`` cannot run on
    torch ``torch_text`` (both as installed), None when they fit."""
    if major_minor("torchtitan", torchtitan_text) != (0, 3):
        return None
    if major_minor("torch", torch_text) >= TORCH_FOR_0_3:
        return None
    needed = ".".join(map(str, TORCH_FOR_0_3))
    return (f"rrfp: torchtitan {torchtitan_text} needs torch >= {needed}, and torch "
            f"{torch_text} is installed: pip install 'torch>={needed}' (rrfp's titan03 "
            f"extra), or pip install 'torchtitan==0.2.2' (rrfp's titan extra: TOML jobs, "
            f"which run on this torch)")


def stop_unless_torch_fits() -> None:
    """Stop the job (one line, ``stop_job``) if the installed torchtitan cannot run on the
    installed torch."""
    if torchtitan_version() is None:
        return
    problem = torch_mismatch(metadata.version("torchtitan"), metadata.version("torch"))
    if problem is not None:
        stop_job(problem)


def require(version: tuple[int, int], module: str, instead: str) -> None:
    """Raise ImportError unless torchtitan ``version`` is installed: ``module`` is part of
    that version's adapter, ``instead`` says what to use with the other. Stop the job if
    that torchtitan cannot run on the installed torch (``stop_unless_torch_fits``): a
    SystemExit, which torchtitan 0.3's ``--module`` import does not take for a missing
    module, as it does an ImportError."""
    installed = torchtitan_version()
    if installed == version:
        stop_unless_torch_fits()
        return
    shown = "no torchtitan" if installed is None else f"torchtitan {installed[0]}.{installed[1]}"
    raise ImportError(f"{module} is for torchtitan {version[0]}.{version[1]} and {shown} is "
                      f"installed: {instead}")


TOML_INSTEAD = ("with torchtitan 0.3 a job is a config function: torchrun --nproc-per-node 2 "
                "-m torchtitan.train --module torchtitan_ext --config rrfp_llama3_debug_cpu")
CONFIG_FN_INSTEAD = ("with torchtitan 0.2 a job is a TOML file: torchrun --nproc-per-node 2 "
                     "-m torchtitan_ext.train --job.config_file train_configs/llama3_debug_cpu.toml")
