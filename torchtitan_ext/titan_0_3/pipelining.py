"""torchtitan 0.3's adapter, part 1: RRFP through the model's ``pipelining_fn`` hook.

torchtitan 0.3 builds a pipeline with ``ModelSpec.pipelining_fn`` (``pipeline_llm``, or
``pipeline_vlm`` that puts a vision encoder on the first stage). ``rrfp_pipelining`` wraps
the model's own: for an ``RRFP-<hint>`` schedule name it calls it with the hint's
placement schedule instead (torchtitan's placement, stages per rank, module split and
SPMD parallelization, unchanged), then runs torchtitan's stages under ScheduleRRFP with
the config's ``rrfp`` settings. Other schedule names go to the model's own function as
they are. Nothing of torchtitan is patched.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable

from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

from torchtitan_ext.common.version import CONFIG_FN_INSTEAD, require

require((0, 3), "torchtitan_ext.titan_0_3.pipelining", CONFIG_FN_INSTEAD)

from torchtitan.tools.logging import logger  # noqa: E402

from torchtitan_ext.config import RRFPConfig  # noqa: E402
from torchtitan_ext.common.batch import batch_settings  # noqa: E402
from torchtitan_ext.common.schedules import (  # noqa: E402
    build_schedule, hint_of, placement_schedule)


TORCHTITAN_SCHEDULE_LINE = "Using pipeline schedule "
"""The start of the line torchtitan logs for the torch schedule it builds, here the
placement schedule's, which ScheduleRRFP replaces (``build_schedule`` logs its own):
``HideTorchtitanScheduleLine`` drops it; a test fails if torchtitan's line changes."""


class HideTorchtitanScheduleLine(logging.Filter):
    # By its text: the model's pipelining_fn builds and logs a torch schedule, no option not to.
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(TORCHTITAN_SCHEDULE_LINE)


def torch_schedule_stages(schedule) -> list:
    """The stages torchtitan built a torch schedule over (its private fields)."""
    if isinstance(schedule, PipelineScheduleMulti):
        return list(schedule._stages)
    if isinstance(schedule, PipelineScheduleSingle):
        return [schedule._stage]
    raise TypeError(f"{type(schedule).__name__} is not a torch pipeline schedule")


def rrfp_pipelining(model, *, parallelism, training, loss_fn, model_pipelining: Callable,
                    settings: RRFPConfig, **kwargs):
    """A ``pipelining_fn`` (same arguments and result as torchtitan's ``pipeline_llm``)
    that builds ScheduleRRFP for RRFP schedule names; ``model_pipelining``: the model's
    own ``pipelining_fn``, ``settings``: the config's ``rrfp`` field."""
    name = parallelism.pipeline_parallel_schedule
    if hint_of(name) is None:
        return model_pipelining(model, parallelism=parallelism, training=training,
                                loss_fn=loss_fn, **kwargs)
    placement = dataclasses.replace(parallelism,
                                    pipeline_parallel_schedule=placement_schedule(hint_of(name)))
    hidden = HideTorchtitanScheduleLine()
    logger.addFilter(hidden)
    try:
        torch_schedule, model_parts, has_first, has_last = model_pipelining(
            model, parallelism=placement, training=training, loss_fn=loss_fn, **kwargs)
    finally:
        logger.removeFilter(hidden)

    # torchtitan's losses return (loss, metrics); schedules take the loss alone.
    def scalar_loss(*args, **loss_kwargs):
        loss, _ = loss_fn(*args, **loss_kwargs)
        return loss

    schedule = build_schedule(name, settings, torch_schedule_stages(torch_schedule),
                              batch_settings(training, parallelism).microbatches,
                              scalar_loss)
    return schedule, model_parts, has_first, has_last


def with_rrfp(model_spec, settings: RRFPConfig):
    """``model_spec`` whose ``pipelining_fn`` builds ScheduleRRFP for RRFP names."""
    if model_spec.pipelining_fn is None:
        return model_spec
    inner = model_spec.pipelining_fn
    if isinstance(inner, functools.partial) and inner.func is rrfp_pipelining:
        inner = inner.keywords["model_pipelining"]
    return dataclasses.replace(model_spec, pipelining_fn=functools.partial(
        rrfp_pipelining, model_pipelining=inner, settings=settings))
