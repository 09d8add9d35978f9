"""torchtitan 0.2.2: what torchtitan_ext adds to torchtitan's Trainer, the same for both launch paths.

``torchrun -m torchtitan_ext.train`` runs torchtitan's own Trainer with these hooks; stock
``torchrun -m torchtitan.train`` with ``[experimental] custom_import =
"torchtitan_ext.register"`` imports them at the start of ``Trainer.__init__``, before it
calls ``init_distributed``. That launch runs torchtitan/train.py as ``__main__``, a second
copy of ``torchtitan.train``, so both copies are hooked:

* ``init_distributed``: the RRFP configuration is checked first (``rrfp: bad
  configuration: ...`` before anything is built); afterwards only the rank that logs the
  loss prints log lines, those held since the hooks were installed included
  (``torchtitan_ext.common.log_ranks``), and without colour codes unless to a terminal.
* ``ensure_pp_loss_visible`` (torchtitan's check for its ``run_train.sh``): replaced by a
  check of ``LOG_RANK`` against the loss rank.
* ``train``: FSDP2 sum reductions on CPU, and ScheduleRRFP's stats next to torchtitan's
  metrics at each metrics step (``torchtitan_ext.common.stats_logging``).
* ``forward_backward_step``: with ``[rrfp] variable_shapes``, microbatches each as long as
  their own content (``torchtitan_ext.common.data``).
* ``close``: ScheduleRRFP's own ``close`` first (``torchtitan_ext.common.schedules.close_schedule``).
"""

from __future__ import annotations

from torchtitan_ext.common.version import require, TOML_INSTEAD

require((0, 2), "torchtitan_ext.titan_0_2.trainer_hooks", TOML_INSTEAD)

import functools
import os
import sys
from types import ModuleType

import torch
import torch.distributed as dist
import torchtitan.components.metrics as metrics
from torchtitan.protocols import train_spec as train_spec_module

from rrfp import ScheduleRRFP
from torchtitan_ext.common.cpu import force_sum_reductions
from torchtitan_ext.common.log_ranks import (hold_until_rank_known, log_ranks, print_only_on,
                                             warn_if_loss_hidden)
from torchtitan_ext.common.data import split_by_content
from torchtitan_ext.common.schedules import close_schedule, n_microbatches, rrfp_settings, validate
from torchtitan_ext.common.stats_logging import log_step_stats
from torchtitan_ext.common.stop import stop_job

_HOOKED = "_rrfp_hooks_installed"


def trainer_modules() -> list[ModuleType]:
    """``torchtitan.train``, and the copy of it that ``python -m torchtitan.train`` runs."""
    import torchtitan.train

    modules = [torchtitan.train]
    main = sys.modules.get("__main__")
    if getattr(getattr(main, "__spec__", None), "name", None) == "torchtitan.train":
        modules.append(main)
    return modules


def install(on_cpu: bool) -> None:
    """Hook torchtitan's Trainer (idempotent). ``on_cpu``: torchtitan runs on the CPU."""
    modules = trainer_modules()
    if len(modules) > 1:  # a training process (torchtitan's own entry point), not a library use
        hold_until_rank_known()
    for module in modules:
        if not getattr(module, _HOOKED, False):
            _hook(module, on_cpu)
            setattr(module, _HOOKED, True)


def _hook(module: ModuleType, on_cpu: bool) -> None:
    trainer_class = module.Trainer
    torch_init_distributed = trainer_class.init_distributed
    torch_train = trainer_class.train
    torch_forward_backward_step = trainer_class.forward_backward_step
    torch_close = trainer_class.close

    @functools.wraps(torch_init_distributed)
    def init_distributed(trainer):
        job_config = trainer.job_config
        model_args = train_spec_module.get_train_spec(job_config.model.name).model_args
        try:
            validate(job_config, model_args[job_config.model.flavor].n_layers)
        except ValueError as e:
            stop_job(f"rrfp: bad configuration: {e}")
        parallel_dims = torch_init_distributed(trainer)
        loss_rank = metrics._get_metrics_rank(parallel_dims, job_config)
        print_only_on(log_ranks(loss_rank), dist.get_rank())
        if not sys.stdout.isatty():  # a file or a pipe: no colour codes in it
            job_config.metrics.disable_color_printing = True
        return parallel_dims

    def ensure_pp_loss_visible(parallel_dims, job_config, color) -> None:
        warn_if_loss_hidden(metrics._get_metrics_rank(parallel_dims, job_config))

    @functools.wraps(torch_train)
    def train(trainer):
        if on_cpu:
            force_sum_reductions(trainer.model_parts)
        schedule = getattr(trainer, "pp_schedule", None)
        if isinstance(schedule, ScheduleRRFP):
            _log_step_stats(trainer, schedule)
        return torch_train(trainer)

    @functools.wraps(torch_forward_backward_step)
    def forward_backward_step(trainer, *, input_dict, labels, global_valid_tokens):
        schedule = getattr(trainer, "pp_schedule", None)
        if isinstance(schedule, ScheduleRRFP) and schedule.variable_shapes:
            return _variable_shape_step(trainer, schedule, input_dict, labels,
                                        global_valid_tokens)
        return torch_forward_backward_step(trainer, input_dict=input_dict, labels=labels,
                                           global_valid_tokens=global_valid_tokens)

    @functools.wraps(torch_close)
    def close(trainer):
        try:
            close_schedule(getattr(trainer, "pp_schedule", None))
        finally:
            torch_close(trainer)

    trainer_class.init_distributed = init_distributed
    trainer_class.train = train
    trainer_class.forward_backward_step = forward_backward_step
    trainer_class.close = close
    module.ensure_pp_loss_visible = ensure_pp_loss_visible


def _variable_shape_step(trainer, schedule: ScheduleRRFP, input_dict, labels,
                         global_valid_tokens) -> torch.Tensor:
    """torchtitan's pipeline forward/backward, on microbatches each as long as its own
    content (``torchtitan_ext.common.data.split_by_content``), each with its size (every
    rank of the pipeline cuts the same batch); the loss stays the sum over valid tokens
    divided by their global count."""
    inputs, labels, extra_inputs, extra_kwargs = trainer.post_dataloading_process(
        input_dict, labels)
    if extra_kwargs:
        raise ValueError("rrfp.variable_shapes: attention masks (flex or varlen attention) "
                         "are cut per batch, not per microbatch; use sdpa attention")
    microbatches = split_by_content(inputs, labels, extra_inputs,
                                    n_microbatches(trainer.job_config))
    first, last = trainer.pp_has_first_stage, trainer.pp_has_last_stage
    losses: list | None = [] if last else None
    with trainer.train_context():
        schedule.step(arg_mbs=microbatches.args if first else None,
                      kwarg_mbs=microbatches.kwargs if first else None,
                      target_mbs=microbatches.targets if last else None,
                      losses=losses, return_outputs=False, mb_sizes=microbatches.sizes)
    if not last:
        return torch.tensor([-1.0], device=trainer.device)
    return (torch.sum(torch.stack(losses)) / global_valid_tokens).to(trainer.device)


def _log_step_stats(trainer, schedule: ScheduleRRFP) -> None:
    """Add the pipeline's RRFP stats to each ``metrics_processor.log`` call of ``trainer``;
    a hang report goes to the job's dump folder."""
    job_config = trainer.job_config
    schedule.report_folder = job_config.job.dump_folder
    tensorboard = job_config.metrics
    log_step_stats(trainer, schedule, rrfp_settings(job_config),
                   metrics._get_metrics_rank(trainer.parallel_dims, job_config),
                   job_config.job.dump_folder,
                   os.path.join(job_config.job.dump_folder, tensorboard.save_tb_folder)
                   if tensorboard.enable_tensorboard else None, job_config.training.steps)
