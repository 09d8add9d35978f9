"""torchtitan training with RRFP schedules, on GPUs or (without an accelerator) on CPU.

torchtitan 0.2.2 (TOML)::

    torchrun --nproc-per-node 2 -m torchtitan_ext.train --job.config_file train_configs/llama3_debug_cpu.toml

torchtitan's own Trainer, with ``torchtitan_ext.register`` imported first: the same as
stock ``torchrun -m torchtitan.train`` with ``[experimental] custom_import =
"torchtitan_ext.register"``.

torchtitan 0.3 (config functions)::

    torchrun --nproc-per-node 2 -m torchtitan_ext.train --module torchtitan_ext --config rrfp_llama3_debug_cpu

the same as stock ``torchrun -m torchtitan.train`` with those arguments (the config's
``RRFPTrainer`` brings everything; see ``torchtitan_ext.config_registry``).
"""

from torchtitan_ext.version import torchtitan_version

if __name__ == "__main__":
    if torchtitan_version() == (0, 2):
        import torchtitan_ext.register  # noqa: F401  (registers RRFP and hooks the Trainer)
        from torchtitan.train import main, Trainer

        main(Trainer)
    else:
        from torchtitan.train import main

        main()
