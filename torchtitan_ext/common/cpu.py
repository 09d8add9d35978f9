"""Let torchtitan (0.2.2 and 0.3) run on a machine without an accelerator: CPU tensors, gloo.

torchtitan has no setting for this. It picks its device at import time and falls back to
"cuda" when none is found, in several modules' copies (``DEVICE_MODULES``, per version: a
test fails when one of them no longer has the attribute); it calls a few ``torch.cuda`` functions by name; it sets up
``barrier(device_ids=[current_device()])``, which needs an int. ``use_cpu()`` points all
of them at the CPU, and gives torchtitan 0.2.2's MoE layers their CPU paths
(``MOE_CPU_PATCHES``). FSDP2 on gloo also needs sum reductions (gloo has no PREMUL_SUM):
``force_sum_reductions`` sets that on the model parts.
"""

from __future__ import annotations

import functools
import inspect
import os
import platform
import resource
from types import ModuleType, SimpleNamespace

import torch

from torchtitan_ext.common.version import torchtitan_version

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


MOE_CPU_PATCHES: dict[tuple[int, int], dict[str, str]] = {
    (0, 2): {
        # Counts tokens per expert with torch.histc on int64 expert indices.
        "torchtitan.models.moe.moe": "torch",
        # Calls the Triton kernel unless given use_cpu=True.
        "torchtitan.models.moe.utils": "generate_permute_indices",
    },
    (0, 3): {},
}
"""Per torchtitan version, what ``use_cpu`` replaces in its MoE modules, by module: the
module's ``torch`` (the same module, but ``histc`` counts integer tensors, which CPU's
kernel refuses) or its ``generate_permute_indices`` (taking its CPU path). torchtitan 0.3
counts by summing a routing map and permutes in PyTorch: nothing to replace."""


def histc(input: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0, *,
          out: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.histc`` that also counts integer tensors on the CPU, as CUDA's kernel does:
    the same counts, in the input's dtype. (Exact: the counted values are expert indices,
    exactly representable as float32.)"""
    if out is not None or input.is_floating_point() or input.device.type != "cpu":
        return torch.histc(input, bins=bins, min=min, max=max, out=out)
    return torch.histc(input.float(), bins=bins, min=min, max=max).to(input.dtype)


class TorchWithIntegerHistc(ModuleType):
    """``torch`` as one module sees it: everything is torch's, except ``histc``."""

    histc = staticmethod(histc)

    def __getattr__(self, name: str):
        return getattr(torch, name)


def moe_cpu_path(module: ModuleType, attribute: str):
    """What replaces ``module.attribute`` (one of ``MOE_CPU_PATCHES``); idempotent."""
    current = getattr(module, attribute)
    if isinstance(current, TorchWithIntegerHistc) or (
            isinstance(current, functools.partial) and current.keywords.get("use_cpu")):
        return current
    if attribute == "torch":
        if current is not torch:
            raise RuntimeError(f"torchtitan_ext.common.cpu: {module.__name__}.torch is not torch")
        return TorchWithIntegerHistc("torch")
    if "use_cpu" not in inspect.signature(current).parameters:
        raise RuntimeError(f"torchtitan_ext.common.cpu: {module.__name__}.{attribute} has no "
                           "use_cpu argument any more; update MOE_CPU_PATCHES")
    return functools.partial(current, use_cpu=True)


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
                raise RuntimeError(f"torchtitan_ext.common.cpu: {name}.{attribute} is gone; update "
                                   "DEVICE_MODULES for this torchtitan")
            setattr(module, attribute, "cpu" if attribute == "device_type" else CpuDeviceModule)
    for name, attribute in MOE_CPU_PATCHES[torchtitan_version()].items():
        module = importlib.import_module(name)
        if not hasattr(module, attribute):
            raise RuntimeError(f"torchtitan_ext.common.cpu: {name}.{attribute} is gone; update "
                               "MOE_CPU_PATCHES for this torchtitan")
        setattr(module, attribute, moe_cpu_path(module, attribute))
    return True


def force_sum_reductions(model_parts) -> None:
    """FSDP2 modules reduce with SUM then divide: gloo lacks PREMUL_SUM and AVG."""
    from torch.distributed.fsdp import FSDPModule

    for part in model_parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

