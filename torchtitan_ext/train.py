"""torchtitan training with RRFP schedules, on GPUs or (without an accelerator) on CPU.

    torchrun --nproc-per-node 2 -m torchtitan_ext.train --job.config_file train_configs/llama3_debug_cpu.toml

torchtitan's own Trainer, with ``torchtitan_ext.register`` imported first: the same as
stock ``torchrun -m torchtitan.train`` with ``[experimental] custom_import =
"torchtitan_ext.register"``.
"""

import torchtitan_ext.register  # noqa: F401  (registers RRFP and hooks the Trainer)
from torchtitan.train import main, Trainer

if __name__ == "__main__":
    main(Trainer)
