"""Importing this module registers RRFP with torchtitan.

Stock torchtitan: ``[experimental] custom_import = "torchtitan_ext.register"`` (plus
``[job] custom_config_module = "torchtitan_ext.config"`` for the ``[rrfp]`` section).
It adds the ``RRFP`` / ``RRFP-<hint>`` schedule names, the ``rrfp_arithmetic`` dataset and
the ``rrfp_llama3_documents`` / ``rrfp_multimodal`` models (``torchtitan_ext.models``),
points torchtitan at the CPU when the machine has no accelerator, and hooks torchtitan's
Trainer (config checks, one logging rank, RRFP stats: ``torchtitan_ext.trainer_hooks``).
"""

from torchtitan_ext import trainer_hooks
from torchtitan_ext.assets import register_dataset
from torchtitan_ext.cpu import use_cpu
from torchtitan_ext.models import register_models
from torchtitan_ext.schedules import install

install()
register_dataset()
register_models()
trainer_hooks.install(on_cpu=use_cpu())
