"""RRFP in torchtitan, for torchtitan 0.2.2 (TOML jobs) and 0.3 (config functions).

Shared by both: ``config`` (the RRFP settings), ``schedules`` (names, checks, building
ScheduleRRFP), ``setting_names`` (unknown setting names), ``stop`` (one line per job),
``stats_logging``, ``log_ranks``, ``data``, ``assets``, ``cpu``.
torchtitan 0.2.2's adapter: ``register`` (``custom_import``), ``patches_0_2``,
``trainer_hooks``, ``models``. torchtitan 0.3's: ``config_registry`` (``--module
torchtitan_ext --config <function>``), ``trainer``, ``pipelining``, ``dataloaders``,
``multimodal``. ``version`` says which applies; importing this package never fails.
"""
