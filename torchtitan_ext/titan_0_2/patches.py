"""torchtitan 0.2.2's adapter, part 1: make torchtitan accept RRFP schedule names.

torchtitan 0.2.2 has no hook for a schedule of its own: ``install()`` wraps its
``get_schedule_class`` (RRFP names), ``pipeline_module_split`` (the hint's placement, the
patch encoder on the first stage), ``build_pipeline_schedule`` (ScheduleRRFP with the
``[rrfp]`` settings) and ``metrics._get_metrics_rank`` (the loss rank of a V placement).
``tests/test_titan_patch_targets.py`` fails when one of these targets is gone.
"""

from __future__ import annotations

import functools

from torchtitan_ext.common.version import require, TOML_INSTEAD

require((0, 2), "torchtitan_ext.titan_0_2.patches", TOML_INSTEAD)

from torchtitan_ext.titan_0_2.models import first_stage_modules  # noqa: E402
from torchtitan_ext.common.schedules import (  # noqa: E402
    _torch_view, build_schedule, hint_of, n_microbatches, placement_schedule, rrfp_settings,
    schedule_class_of)

PATCHED = {
    "torchtitan.distributed.pipeline_parallel": (
        "get_schedule_class", "pipeline_module_split", "build_pipeline_schedule"),
    "torchtitan.components.metrics": ("_get_metrics_rank",),
}
"""What ``install()`` wraps, by module."""


def install() -> None:
    """Make torchtitan accept RRFP schedule names (idempotent)."""
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.pipeline_parallel as pipeline_parallel

    if getattr(pipeline_parallel, "_rrfp_installed", False):
        return
    pipeline_parallel._rrfp_installed = True
    torch_get_schedule_class = pipeline_parallel.get_schedule_class
    torch_build = pipeline_parallel.build_pipeline_schedule
    torch_split = pipeline_parallel.pipeline_module_split

    def get_schedule_class(name: str):
        found = schedule_class_of(name)
        return torch_get_schedule_class(name) if found is None else found

    def pipeline_module_split(whole_model, pp_mesh, pp_schedule, device, module_names_per_stage):
        hint = hint_of(pp_schedule)
        name = pp_schedule if hint is None else placement_schedule(hint)
        return torch_split(whole_model, pp_mesh, name, device,
                           first_stage_modules(whole_model, module_names_per_stage))

    def build_pipeline_schedule(job_config, stages, loss_fn):
        name = job_config.parallelism.pipeline_parallel_schedule
        hint = hint_of(name)
        if hint is None:
            return torch_build(job_config, stages, loss_fn)
        return build_schedule(name, rrfp_settings(job_config), stages,
                              n_microbatches(job_config), loss_fn)

    @functools.wraps(metrics._get_metrics_rank)
    def get_metrics_rank(parallel_dims, job_config):
        return torch_metrics_rank(parallel_dims, _torch_view(job_config))

    torch_metrics_rank = metrics._get_metrics_rank
    pipeline_parallel.get_schedule_class = get_schedule_class
    pipeline_parallel.pipeline_module_split = pipeline_module_split
    pipeline_parallel.build_pipeline_schedule = build_pipeline_schedule
    metrics._get_metrics_rank = get_metrics_rank
