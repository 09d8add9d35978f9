"""The torchtitan names torchtitan_ext patches or hooks into are still in the installed
torchtitan, and each torchtitan version's adapter refuses the other version."""

from __future__ import annotations

import re

import pytest

from tests.titan_helpers import only_0_2, only_0_3, parse, VERSION


ADAPTERS = {
    (0, 2): ["torchtitan_ext.register", "torchtitan_ext.titan_0_2.patches",
             "torchtitan_ext.titan_0_2.trainer_hooks", "torchtitan_ext.titan_0_2.models"],
    (0, 3): ["torchtitan_ext.config_registry", "torchtitan_ext.titan_0_3.trainer",
             "torchtitan_ext.titan_0_3.pipelining", "torchtitan_ext.titan_0_3.dataloaders",
             "torchtitan_ext.titan_0_3.multimodal"],
}


def test_each_adapter_imports_with_its_version_and_refuses_the_other():
    import importlib

    import torchtitan_ext  # noqa: F401  (never fails)

    for version, modules in ADAPTERS.items():
        for name in modules:
            if version == VERSION:
                importlib.import_module(name)
                continue
            with pytest.raises(ImportError, match=(
                    rf"{re.escape(name)} is for torchtitan {version[0]}\.{version[1]} and "
                    rf"torchtitan {VERSION[0]}\.{VERSION[1]} is installed: with torchtitan "
                    rf"{VERSION[0]}\.{VERSION[1]} a job is")):
                importlib.import_module(name)


def test_the_cpu_patch_targets_exist():
    """torchtitan has no CPU setting: ``torchtitan_ext.common.cpu`` sets its modules' copies of
    ``device_type`` / ``device_module``; each must still be there."""
    import importlib

    from torchtitan_ext.common.cpu import DEVICE_MODULES

    for name, attributes in DEVICE_MODULES[VERSION].items():
        module = importlib.import_module(name)
        for attribute in attributes:
            assert hasattr(module, attribute), (name, attribute)


@only_0_2
def test_the_0_2_schedule_patch_targets_exist():
    """torchtitan 0.2.2 has no schedule hook: ``patches_0_2.install`` wraps these."""
    import importlib

    from torchtitan_ext.titan_0_2.patches import PATCHED

    for name, attributes in PATCHED.items():
        module = importlib.import_module(name)
        for attribute in attributes:
            assert callable(getattr(module, attribute, None)), (name, attribute)


@only_0_3
def test_the_0_3_adapter_uses_torchtitans_hooks():
    """``pipelining_fn`` is the model's hook (no patch), ``RRFPTrainer`` a Trainer whose
    config has the ``rrfp`` field, the loss rank of V placements is rank 0, and
    torchtitan's ``run_train.sh`` advice (the one log record dropped) still reads so."""
    import functools
    import logging
    from types import SimpleNamespace

    from torchtitan.components.metrics import ensure_pp_loss_visible
    from torchtitan.distributed.pipeline_parallel import pipeline_llm, pipeline_vlm
    from torchtitan.models.llama3 import model_registry
    from torchtitan.tools.utils import NoColor
    from torchtitan.trainer import Trainer

    from torchtitan_ext.config import RRFPConfig
    from torchtitan_ext.titan_0_3.multimodal import multimodal_registry
    from torchtitan_ext.titan_0_3.pipelining import rrfp_pipelining, with_rrfp
    from torchtitan_ext.titan_0_3.trainer import HideLossAdvice, metrics_rank, RRFPTrainer

    assert model_registry("debugmodel").pipelining_fn is pipeline_llm
    assert multimodal_registry().pipelining_fn is pipeline_vlm
    settings = RRFPConfig(buffer_limit=4)
    wrapped = with_rrfp(with_rrfp(model_registry("debugmodel"), RRFPConfig()), settings)
    assert isinstance(wrapped.pipelining_fn, functools.partial)
    assert wrapped.pipelining_fn.func is rrfp_pipelining
    assert wrapped.pipelining_fn.keywords == {"model_pipelining": pipeline_llm,
                                              "settings": settings}
    assert issubclass(RRFPTrainer, Trainer) and issubclass(RRFPTrainer.Config, Trainer.Config)
    assert isinstance(parse(), RRFPTrainer.Config)

    dims = SimpleNamespace(pp_enabled=True, world_size=4, pp=2)
    assert metrics_rank(dims, "RRFP-ZBVZeroBubble") == metrics_rank(dims, "ZBVZeroBubble") == 0
    assert metrics_rank(dims, "RRFP-DualPipeV") == 0
    assert metrics_rank(dims, "RRFP") == metrics_rank(dims, "Interleaved1F1B") == 2

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Keep()
    torchtitan_logger = logging.getLogger()
    torchtitan_logger.addHandler(handler)
    try:
        ensure_pp_loss_visible(parallel_dims=dims, pp_schedule="RRFP", color=NoColor())
    finally:
        torchtitan_logger.removeHandler(handler)
    (record,) = [r for r in records if "run_train.sh" in r.getMessage()]
    assert not HideLossAdvice().filter(record)
