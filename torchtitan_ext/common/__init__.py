"""What both torchtitan adapters share: the RRFP schedule names and their checks, building
ScheduleRRFP from torchtitan's stages, stats and traces, the logging ranks, data splitting,
the shipped assets, CPU support, and which torchtitan is installed."""
