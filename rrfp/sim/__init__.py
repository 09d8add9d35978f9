"""Discrete-event simulation of pipeline steps that drives the runtime's own arbiter.

CLI: ``python -m rrfp.sim --help``; replay files: ``python -m rrfp.sim.replay``.
"""

from rrfp.sim import policies  # noqa: F401, E402  (registers the studied policies)
