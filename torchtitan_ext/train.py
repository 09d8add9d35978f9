"""torchtitan training with RRFP schedules, on GPUs or (without an accelerator) on CPU.

    torchrun --nproc-per-node 2 -m torchtitan_ext.train --job.config_file train_configs/llama3_debug_cpu.toml
"""

from __future__ import annotations

import os

import torch.distributed as dist

import torchtitan_ext.register as registration
from torchtitan.protocols import train_spec as train_spec_module
from torchtitan.tools.logging import logger
from torchtitan.train import main, Trainer

from rrfp import write_chrome_trace
from torchtitan_ext.cpu import force_sum_reductions
from torchtitan_ext.schedules import hint_of, rrfp_settings, validate


class RRFPTrainer(Trainer):
    """torchtitan's Trainer, plus RRFP config checks, CPU/gloo fixes and RRFP metrics."""

    def __init__(self, job_config):
        model_args = train_spec_module.get_train_spec(job_config.model.name).model_args
        try:
            validate(job_config, model_args[job_config.model.flavor].n_layers)
        except ValueError as e:
            raise SystemExit(f"rrfp: bad configuration: {e}") from None
        super().__init__(job_config)
        if registration.ON_CPU:
            force_sum_reductions(self.model_parts)
        parallelism = job_config.parallelism
        if parallelism.pipeline_parallel_degree > 1 and hint_of(parallelism.pipeline_parallel_schedule):
            self._log_metrics = self.metrics_processor.log
            self.metrics_processor.log = self._log_with_rrfp_stats

    def _log_with_rrfp_stats(self, step, global_avg_loss, global_max_loss, grad_norm,
                             extra_metrics=None):
        settings = rrfp_settings(self.job_config)
        metrics = dict(extra_metrics or {})
        if settings.log_stats or settings.trace_folder:
            stats = self.pp_schedule.last_step_stats
            group = self.parallel_dims.get_mesh("pp").get_group()
            gathered: list = [None] * dist.get_world_size(group)
            # All ranks of the pipeline group log at the same steps: a fixed point.
            dist.all_gather_object(gathered, stats, group=group)
            if settings.log_stats:
                for s in gathered:
                    metrics[f"rrfp/idle_fraction/pp{s.pp_rank}"] = s.idle_fraction
                    metrics[f"rrfp/out_of_hint_order/pp{s.pp_rank}"] = s.out_of_hint_order
                    metrics[f"rrfp/backpressure_entries/pp{s.pp_rank}"] = sum(
                        s.backpressure_entries.values())
                    metrics[f"rrfp/peak_in_flight/pp{s.pp_rank}"] = max(s.peak_in_flight.values())
                    metrics[f"rrfp/dispatch_overhead_us/pp{s.pp_rank}"] = s.overhead_per_action * 1e6
                logger.info(f"rrfp step {step:2}: " + " | ".join(
                    f"pp{s.pp_rank} idle {s.idle_fraction:.0%} out-of-hint {s.out_of_hint_order} "
                    f"backpressure {sum(s.backpressure_entries.values())} peak "
                    f"{max(s.peak_in_flight.values())}" for s in gathered))
            if settings.trace_folder and dist.get_rank(group) == 0:
                folder = os.path.join(self.job_config.job.dump_folder, settings.trace_folder)
                os.makedirs(folder, exist_ok=True)
                write_chrome_trace(gathered, os.path.join(folder, f"step{step}.json"))
        self._log_metrics(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=metrics)


if __name__ == "__main__":
    main(RRFPTrainer)
