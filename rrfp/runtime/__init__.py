"""The torch-facing runtime: ``ScheduleRRFP``, a step's phases, what an action does on the
stages, data parallelism in lockstep, the byte meter and the step's statistics."""
