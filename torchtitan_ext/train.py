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

On both, one difference from stock ``torchtitan.train``: an unknown ``[rrfp]`` setting (as
``--rrfp.<name>``, or on 0.2.2 in the TOML) stops the job with one line naming the nearest
setting (``torchtitan_ext.common.setting_names``) before torchtitan parses the command line;
stock ``torchtitan.train`` leaves such a name to torchtitan, which reports it on every rank
(tyro's box of help, or on 0.2.2 a traceback for a TOML key).

A command for the other torchtitan, or a torchtitan that cannot run on the installed
torch, stops with one line naming what to run or install instead.
"""

import sys

from torchtitan_ext.common.stop import stop_job
from torchtitan_ext.common.version import (
    CONFIG_FN_INSTEAD, stop_unless_torch_fits, TOML_INSTEAD, torchtitan_version)


def launch_problem(version: tuple[int, int] | None, args: list[str]) -> str | None:
    """The line that says what to run or install instead, when ``args`` cannot run on
    torchtitan ``version`` (None: not installed); None when they can."""
    if version is None:
        return ("rrfp: torchtitan is not installed: install rrfp's titan extra (torchtitan "
                "0.2.2, TOML jobs; in a clone: pip install -e '.[titan]') or its titan03 "
                "extra (torchtitan 0.3, config functions, torch >= 2.14)")
    config_function = any(arg == "--module" or arg.startswith("--module=") for arg in args)
    if version == (0, 3) and not config_function:
        return (f"rrfp: torchtitan 0.3 is installed; {TOML_INSTEAD}; or pip install "
                "'torchtitan==0.2.2' (rrfp's titan extra) for TOML jobs")
    if version == (0, 2) and config_function:
        return (f"rrfp: torchtitan 0.2 is installed; {CONFIG_FN_INSTEAD}; or pip install "
                "'torchtitan>=0.3,<0.4' 'torch>=2.14' (rrfp's titan03 extra) for config "
                "functions")
    return None


if __name__ == "__main__":
    stop_unless_torch_fits()
    problem = launch_problem(torchtitan_version(), sys.argv[1:])
    if problem is not None:
        stop_job(problem)
    from torchtitan_ext.common.log_ranks import hold_until_rank_known

    hold_until_rank_known()  # torchtitan's start-up lines: on the logging rank only
    from torchtitan_ext.common.setting_names import stop_on_unknown_settings

    titan_0_2 = torchtitan_version() == (0, 2)
    stop_on_unknown_settings(sys.argv[1:], toml=titan_0_2)
    if titan_0_2:
        import torchtitan_ext.register  # noqa: F401  (registers RRFP and hooks the Trainer)
        from torchtitan.train import main, Trainer

        main(Trainer)
    else:
        from torchtitan.train import main

        main()
