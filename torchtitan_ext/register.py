"""Importing this module registers RRFP with torchtitan.

Stock torchtitan: ``[experimental] custom_import = "torchtitan_ext.register"`` (plus
``[job] custom_config_module = "torchtitan_ext.config"`` for the ``[rrfp]`` section).
It adds the ``RRFP`` / ``RRFP-<hint>`` schedule names and the ``rrfp_arithmetic`` dataset,
points torchtitan at the CPU when the machine has no accelerator, and hooks torchtitan's
Trainer (config checks, one logging rank, RRFP stats: ``torchtitan_ext.trainer_hooks``).
"""

from torchtitan_ext import trainer_hooks
from torchtitan_ext.assets import register_dataset
from torchtitan_ext.cpu import use_cpu
from torchtitan_ext.schedules import install

install()
register_dataset()
trainer_hooks.install(on_cpu=use_cpu())
