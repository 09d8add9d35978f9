"""Which torchtitan is installed, and so which of torchtitan_ext's two adapters applies.

* torchtitan 0.2 (0.2.2): a job is a TOML file; ``[experimental] custom_import =
  "torchtitan_ext.register"`` and ``[job] custom_config_module = "torchtitan_ext.config"``
  add the schedules and the ``[rrfp]`` section (``register``, ``patches_0_2``,
  ``trainer_hooks``, ``models``).
* torchtitan 0.3: a job is a config function, ``--module torchtitan_ext --config <fn>``
  (``config_registry``), whose ``Trainer.Config`` has an ``rrfp`` field (``trainer``,
  ``pipelining``, ``dataloaders``, ``multimodal``).

Everything else (names, validation, placement, coordination, stats, traces, data, assets)
is shared. Importing ``torchtitan_ext`` or this module never fails; an adapter's modules
raise ``ImportError`` naming what to use instead when the other version is installed.
"""

from __future__ import annotations

from importlib import metadata

SUPPORTED = ((0, 2), (0, 3))
"""The torchtitan minor versions an adapter exists for."""


def torchtitan_version() -> tuple[int, int] | None:
    """(major, minor) of the installed torchtitan, None if it is not installed."""
    try:
        text = metadata.version("torchtitan")
    except metadata.PackageNotFoundError:
        return None
    parts = text.split(".")
    try:
        return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)
    except (IndexError, ValueError):
        raise ImportError(f"cannot read torchtitan's version {text!r}") from None


def require(version: tuple[int, int], module: str, instead: str) -> None:
    """Raise ImportError unless torchtitan ``version`` is installed: ``module`` is part of
    that version's adapter, ``instead`` says what to use with the other."""
    installed = torchtitan_version()
    if installed == version:
        return
    shown = "no torchtitan" if installed is None else f"torchtitan {installed[0]}.{installed[1]}"
    raise ImportError(f"{module} is for torchtitan {version[0]}.{version[1]} and {shown} is "
                      f"installed: {instead}")


TOML_INSTEAD = ("with torchtitan 0.3 a job is a config function: torchrun --nproc-per-node 2 "
                "-m torchtitan.train --module torchtitan_ext --config rrfp_llama3_debug_cpu")
CONFIG_FN_INSTEAD = ("with torchtitan 0.2 a job is a TOML file: torchrun --nproc-per-node 2 "
                     "-m torchtitan_ext.train --job.config_file train_configs/llama3_debug_cpu.toml")
