"""Made-up step statistics, for code that reads ``StepStats`` without running a step."""

from __future__ import annotations

from rrfp.core.stats import StepStats


def made_up_stats(rank: int, **fields) -> StepStats:
    """A rank's ``StepStats`` with plain values in every field; ``fields`` override them."""
    values = dict(pp_rank=rank, global_rank=rank, hint="1F1B", policy="hint",
                  device="HostDevice", launch_depth=1, buffer_limits=None,
                  rank_buffer_limit=None, hint_peak_in_flight={}, hint_rank_peak=1,
                  hint_busiest_rank_peak=1,
                  peak_in_flight={}, peak_rank_in_flight=1, peak_activation_bytes=0,
                  receive_buffer_bytes=0, messages_sent=0, bytes_sent=0,
                  backpressure_entries={}, out_of_hint_order=0, hint_order=[],
                  realized_order=[], step_time=1.0, device_busy_time=0.5, wait_time=0.0,
                  decision_time=0.0, launch_time=0.0, start_unix=0.0)
    return StepStats(**{**values, **fields})
