"""torchtitan 0.3's adapter, part 2: ``RRFPTrainer``, torchtitan's Trainer with an ``rrfp``
config field.

A job's ``Trainer.Config`` is ``RRFPTrainer.Config`` (``torchtitan_ext.config_registry``
builds them); ``config.build()`` then makes an ``RRFPTrainer``, which is torchtitan's own
Trainer plus:

* the model's ``pipelining_fn`` wrapped (``torchtitan_ext.titan_0_3.pipelining``): RRFP schedule
  names build ScheduleRRFP with the ``rrfp`` settings;
* the configuration checked before anything is built (``rrfp: bad configuration: ...``);
* only the rank that logs the loss prints log lines (``torchtitan_ext.common.log_ranks``), and
  torchtitan's ``run_train.sh`` advice on ``LOG_RANK`` replaced by its own check;
* the loss rank of V placements under RRFP names (``RRFPMetricsProcessor``);
* ScheduleRRFP's stats next to torchtitan's metrics (console, TensorBoard, traces);
* with ``rrfp.variable_shapes``, each microbatch cut to its own content before the
  trainer's own pre-split ``pp_schedule.step(arg_mbs=...)`` call;
* on a machine without an accelerator: torchtitan on the CPU (``torchtitan_ext.common.cpu``);
* at ``close``, ScheduleRRFP's own ``close`` first (threads stopped, channels released).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from dataclasses import dataclass, field

from torchtitan_ext.common.version import CONFIG_FN_INSTEAD, require

require((0, 3), "torchtitan_ext.titan_0_3.trainer", CONFIG_FN_INSTEAD)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
# Private: torchtitan 0.3 names the rank that writes metrics only in _get_metrics_rank.
from torchtitan.components.metrics import _get_metrics_rank, MetricsProcessor  # noqa: E402
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader  # noqa: E402
from torchtitan.models.common.attention import FlexAttention, VarlenAttention  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

from rrfp import ScheduleRRFP  # noqa: E402
from torchtitan_ext.common.assets import register_dataset  # noqa: E402
from torchtitan_ext.config import RRFPConfig  # noqa: E402
from torchtitan_ext.common.cpu import force_sum_reductions, use_cpu  # noqa: E402
from torchtitan_ext.common.data import content_size, split_by_content  # noqa: E402
from torchtitan_ext.common.log_ranks import (  # noqa: E402
    hold_until_rank_known, log_ranks, print_only_on, warn_if_loss_hidden)
from torchtitan_ext.titan_0_3.pipelining import with_rrfp  # noqa: E402
from torchtitan_ext.common.schedules import close_schedule, hint_of, torch_view_name, validate  # noqa: E402
from torchtitan_ext.common.stats_logging import log_step_stats  # noqa: E402
from torchtitan_ext.common.stop import stop_job  # noqa: E402

TORCHTITAN_LOSS_ADVICE = "Pipeline Parallel loss is not visible"
"""The start of torchtitan's ``ensure_pp_loss_visible`` warning, which asks for
``LOG_RANK`` in a ``run_train.sh`` this project does not use, and names the wrong rank for
V placements under RRFP names: ``HideLossAdvice`` drops it (``warn_if_loss_hidden``
checks instead); a test fails if torchtitan's warning changes."""


class HideLossAdvice(logging.Filter):
    # By its text: torchtitan 0.3's Trainer calls ensure_pp_loss_visible, no setting skips it.
    def filter(self, record: logging.LogRecord) -> bool:
        return TORCHTITAN_LOSS_ADVICE not in record.getMessage()


class RRFPMetricsProcessor(MetricsProcessor):
    """torchtitan's MetricsProcessor, choosing the rank that writes TensorBoard (the one
    with the loss) from the placement an RRFP schedule name stands for."""

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        """torchtitan's metrics settings (``metrics.*``), unchanged."""

    def __init__(self, config: Config, *, pp_schedule: str = "1F1B", **kwargs):
        super().__init__(config, pp_schedule=torch_view_name(pp_schedule), **kwargs)


def metrics_rank(parallel_dims, schedule_name: str) -> int:
    """The rank that logs the loss and writes TensorBoard."""
    return _get_metrics_rank(parallel_dims=parallel_dims,
                             pp_schedule=torch_view_name(schedule_name))


def check(config) -> None:
    """ValueError saying what to change if ``config`` cannot run (nothing is built yet)."""
    validate(config, len(config.model_spec.model.layers))
    if not (config.rrfp.variable_shapes
            and hint_of(config.parallelism.pipeline_parallel_schedule) is not None):
        return
    model = config.model_spec.model
    if any(model.traverse(FlexAttention.Config)) or any(model.traverse(VarlenAttention.Config)):
        raise ValueError("rrfp.variable_shapes cuts microbatches to their own length, and "
                         "flex or varlen attention masks are built for the padded length: "
                         "build the model with attn_backend='sdpa'")
    if isinstance(config.dataloader, HuggingFaceTextDataLoader.Config):
        raise ValueError("rrfp.variable_shapes cuts samples that are not packed (one document "
                         "each, padded at the end: torchtitan_ext.titan_0_3.dataloaders."
                         "DocumentDataLoader); torchtitan's text dataloader packs documents "
                         "into full-length samples: set rrfp.variable_shapes false, or load "
                         "whole documents")


class RRFPTrainer(Trainer):
    """torchtitan's Trainer with RRFP schedules (see the module's docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        rrfp: RRFPConfig = field(default_factory=RRFPConfig)
        """Readiness-first pipeline settings, used by the ``RRFP`` / ``RRFP-<hint>``
        values of ``parallelism.pipeline_parallel_schedule`` (``--rrfp.<field>``)."""

        metrics: RRFPMetricsProcessor.Config = field(
            default_factory=RRFPMetricsProcessor.Config)
        """torchtitan's metrics settings; the loss rank follows RRFP placements."""

    def __init__(self, config: Config):
        hold_until_rank_known()
        self._on_cpu = use_cpu()
        register_dataset()
        if config.model_spec is not None:
            config.model_spec = with_rrfp(config.model_spec, config.rrfp)
        if type(config.metrics) is MetricsProcessor.Config:
            config.metrics = RRFPMetricsProcessor.Config(**{
                f.name: getattr(config.metrics, f.name)
                for f in dataclasses.fields(MetricsProcessor.Config) if f.init})
        if not sys.stdout.isatty():  # a file or a pipe: no colour codes in it
            config.metrics.disable_color_printing = True
        super().__init__(config)

    def init_distributed(self):
        config = self.config
        try:
            check(config)
        except ValueError as e:
            stop_job(f"rrfp: bad configuration: {e}")
        parallel_dims = super().init_distributed()
        loss_rank = metrics_rank(parallel_dims, config.parallelism.pipeline_parallel_schedule)
        print_only_on(log_ranks(loss_rank), dist.get_rank())
        for handler in logging.getLogger().handlers:
            handler.addFilter(HideLossAdvice())
        if parallel_dims.pp_enabled:
            warn_if_loss_hidden(loss_rank)
        return parallel_dims

    def post_dataloading_process(self, input_dict, labels):
        """torchtitan's, then: under RRFP with ``rrfp.variable_shapes``, the microbatch cut
        to its own content (``torchtitan_ext.common.data.split_by_content``); otherwise a batch
        with image patches padded to one shape, the patches' targets ignored."""
        inputs, labels, extra_kwargs = super().post_dataloading_process(input_dict, labels)
        schedule = getattr(self, "pp_schedule", None)
        variable = isinstance(schedule, ScheduleRRFP) and schedule.variable_shapes
        images = "patch_counts" in extra_kwargs
        if not (variable or images):
            return inputs, labels, extra_kwargs
        unknown = set(extra_kwargs) - {"patches", "patch_counts"}
        if unknown:
            raise ValueError(f"rrfp.variable_shapes: the inputs {sorted(unknown)} are built "
                             "for the padded length; cut microbatches know only tokens, "
                             "labels and image patches")
        pad_to = None if variable else (inputs.shape[1], extra_kwargs["patches"].shape[1])
        cut = split_by_content(inputs, labels, extra_kwargs, 1, pad_to=pad_to)
        return cut.args[0][0], cut.targets[0], cut.kwargs[0]

    def pp_forward_backward_step(self, *, input_dict_mbs, label_mbs, global_valid_tokens):
        """torchtitan's; under RRFP with ``rrfp.variable_shapes``, each microbatch cut to its
        own content also gives the schedule its size (``content_size``: every rank of the
        pipeline cuts the same microbatches)."""
        schedule = getattr(self, "pp_schedule", None)
        if not (isinstance(schedule, ScheduleRRFP) and schedule.variable_shapes):
            return super().pp_forward_backward_step(
                input_dict_mbs=input_dict_mbs, label_mbs=label_mbs,
                global_valid_tokens=global_valid_tokens)
        # torchtitan's body with mb_sizes added: it calls pp_schedule.step with fixed arguments.
        cuts = [self.post_dataloading_process(input_dict, labels)
                for input_dict, labels in zip(input_dict_mbs, label_mbs, strict=True)]
        first, last = self.pp_has_first_stage, self.pp_has_last_stage
        losses: list | None = [] if last else None
        with self.train_context():
            schedule.step(arg_mbs=[(inputs,) for inputs, _, _ in cuts] if first else None,
                          kwarg_mbs=[kwargs for _, _, kwargs in cuts],
                          target_mbs=[labels for _, labels, _ in cuts] if last else None,
                          losses=losses, loss_kwargs={"global_valid_tokens": global_valid_tokens},
                          return_outputs=False,
                          mb_sizes=[content_size(labels, kwargs) for _, labels, kwargs in cuts])
        if not last:
            return torch.tensor([-1.0], device=self.device)
        return torch.sum(torch.stack(losses)).to(self.device)

    def close(self) -> None:
        """ScheduleRRFP's ``close`` first (``torchtitan_ext.common.schedules.close_schedule``),
        then torchtitan's."""
        try:
            close_schedule(getattr(self, "pp_schedule", None))
        finally:
            super().close()

    def train(self):
        if self._on_cpu:
            force_sum_reductions(self.model_parts)
        schedule = getattr(self, "pp_schedule", None)
        if isinstance(schedule, ScheduleRRFP):
            config = self.config
            schedule.report_folder = config.dump_folder  # a hang report goes there
            log_step_stats(self, schedule, config.rrfp,
                           metrics_rank(self.parallel_dims,
                                        config.parallelism.pipeline_parallel_schedule),
                           config.dump_folder,
                           os.path.join(config.dump_folder, config.metrics.save_tb_folder)
                           if config.metrics.enable_tensorboard else None,
                           config.training.steps)
        return super().train()
