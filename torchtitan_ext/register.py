"""Importing this module registers RRFP with torchtitan.

Stock torchtitan: ``[experimental] custom_import = "torchtitan_ext.register"`` (plus
``[job] custom_config_module = "torchtitan_ext.config"`` for the ``[rrfp]`` section).
It adds the ``RRFP`` / ``RRFP-<hint>`` schedule names and the ``rrfp_arithmetic`` dataset,
and points torchtitan at the CPU when the machine has no accelerator.
"""

from torchtitan_ext.assets import register_dataset
from torchtitan_ext.cpu import use_cpu
from torchtitan_ext.schedules import install

install()
register_dataset()
ON_CPU = use_cpu()
