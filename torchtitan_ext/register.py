"""Importing this module registers RRFP with torchtitan 0.2.2 (its adapter's entry point).

Stock torchtitan: ``[experimental] custom_import = "torchtitan_ext.register"`` (plus
``[job] custom_config_module = "torchtitan_ext.config"`` for the ``[rrfp]`` section).
It adds the ``RRFP`` / ``RRFP-<hint>`` schedule names (to torchtitan's and torch's
``get_schedule_class``), the ``rrfp_arithmetic`` dataset and
the ``rrfp_llama3_documents`` / ``rrfp_multimodal`` models (``torchtitan_ext.titan_0_2.models``),
points torchtitan at the CPU when the machine has no accelerator, and hooks torchtitan's
Trainer (config checks, one logging rank, RRFP stats: ``torchtitan_ext.titan_0_2.trainer_hooks``).
"""

from torchtitan_ext.common.version import require, TOML_INSTEAD

require((0, 2), "torchtitan_ext.register", TOML_INSTEAD)

from torchtitan_ext.titan_0_2 import trainer_hooks  # noqa: E402
from torchtitan_ext.common.assets import register_dataset  # noqa: E402
from torchtitan_ext.common.cpu import use_cpu  # noqa: E402
from torchtitan_ext.common.schedules import register_with_torch  # noqa: E402
from torchtitan_ext.titan_0_2.models import register_models  # noqa: E402
from torchtitan_ext.titan_0_2.patches import install  # noqa: E402

install()
register_with_torch()
register_dataset()
register_models()
trainer_hooks.install(on_cpu=use_cpu())
