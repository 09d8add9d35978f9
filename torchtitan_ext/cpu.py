"""Let torchtitan (0.2.2 and 0.3) run on a machine without an accelerator: CPU tensors, gloo.

torchtitan has no setting for this. It picks its device at import time and falls back to
"cuda" when none is found, in several modules' copies (``DEVICE_MODULES``, per version: a
test fails when one of them no longer has the attribute); it calls a few ``torch.cuda`` functions by name; it sets up
``barrier(device_ids=[current_device()])``, which needs an int. ``use_cpu()`` points all
of them at the CPU. FSDP2 on gloo also needs sum reductions (gloo has no PREMUL_SUM):
``force_sum_reductions`` sets that on the model parts.
"""

from __future__ import annotations

import os
import platform
import resource
from types import SimpleNamespace

import torch

from torchtitan_ext.version import torchtitan_version

DEVICE_MODULES: dict[tuple[int, int], dict[str, tuple[str, ...]]] = {
    (0, 2): {
        "torchtitan.tools.utils": ("device_type", "device_module"),
        "torchtitan.distributed.utils": ("device_type", "device_module"),
        "torchtitan.distributed.parallel_dims": ("device_type",),
        "torchtitan.distributed.dual_pipe_v": ("device_type", "device_module"),
        "torchtitan.components.metrics": ("device_type", "device_module"),
        "torchtitan.tools.profiling": ("device_module",),
    },
    (0, 3): {
        "torchtitan.tools.utils": ("device_type", "device_module"),
        "torchtitan.distributed.utils": ("device_type", "device_module"),
        "torchtitan.distributed.parallel_dims": ("device_type",),
        "torchtitan.components.metrics": ("device_type", "device_module"),
        "torchtitan.models.common.token_dispatcher": ("device_type", "device_module"),
        "torchtitan.tools.profiler": ("device_module",),
    },
}
"""Per torchtitan version, the modules that copied ``device_type`` / ``device_module`` at
import, and which of the two each holds."""


class CpuDeviceModule:
    """The part of ``torch.cuda``'s interface torchtitan calls, answered for the CPU."""

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def set_device(device) -> None:
        pass

    @staticmethod
    def synchronize(device=None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        pass

    @staticmethod
    def set_stream(stream) -> None:
        pass

    @staticmethod
    def get_device_name(device=None) -> str:
        return f"CPU ({platform.processor() or platform.machine()})"

    @staticmethod
    def get_device_properties(device=None) -> SimpleNamespace:
        return SimpleNamespace(total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))

    @staticmethod
    def memory_stats(device=None) -> dict[str, int]:
        # The process's peak resident memory stands in for the allocator's peaks.
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return {"active_bytes.all.peak": peak, "reserved_bytes.all.peak": peak,
                "num_alloc_retries": 0, "num_ooms": 0}


def use_cpu() -> bool:
    """Point torchtitan at the CPU if no accelerator is present; True if it did."""
    if torch.accelerator.is_available():
        return False
    import importlib

    for name, attributes in DEVICE_MODULES[torchtitan_version()].items():
        module = importlib.import_module(name)
        for attribute in attributes:
            if not hasattr(module, attribute):
                raise RuntimeError(f"torchtitan_ext.cpu: {name}.{attribute} is gone; update "
                                   "DEVICE_MODULES for this torchtitan")
            setattr(module, attribute, "cpu" if attribute == "device_type" else CpuDeviceModule)
    return True


def force_sum_reductions(model_parts) -> None:
    """FSDP2 modules reduce with SUM then divide: gloo lacks PREMUL_SUM and AVG."""
    from torch.distributed.fsdp import FSDPModule

    for part in model_parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

