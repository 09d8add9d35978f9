"""Harness code shared by the tests, the benchmarks and the demo; the runtime never imports it.

* ``worlds``: ``run_local_world``, a function on N CPU/gloo processes with a hard timeout.
* ``emulation``: ``EmulatedDeviceTime``, stage compute that takes a chosen wall time.
* ``chains``: toy stage chains (small float64 blocks), built into stages, run for a few
  optimizer steps under any schedule, compared bitwise; ``coordinated_runs`` for TP/EP.
* ``timing``: random device times and send delays, and messages made late on purpose to
  force an order (``LATE_S``, ``SECOND_ACTIVATION_LATE``, ``replicas_apart``).
* ``probes``: readings independent of the runtime's books (microbatches held recounted
  from an order, whether forwards ran under saved-tensor hooks, an error's chain).
* ``stats``: made-up ``StepStats``.
* ``nccl_like``: 2-rank channel groups with NCCL's completion and abort semantics, on CPU.
* ``moe``: stages built from torchtitan's MoE, experts sharded for expert parallelism.
* ``byte_limits_world``: stages that save known, different bytes, under the byte limits.
* ``ab``: alternating rounds for A/B comparisons.
* ``code_size``: the runtime's longest classes, functions and modules, against the limits.
* ``figures``: measured figures, dates, seeds or commit hashes where prose should hold none.

A scenario's per-rank body lives in the test module that asserts on it (ranks import it by
name); what more than one test module or a benchmark uses lives here.
"""
