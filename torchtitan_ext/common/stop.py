"""Ending a job that cannot run before anything is built: one line per job, not per rank.

Every rank finds the same fault (the same command line, the same installation), so one
rank says it: rank 0 (``RANK``, which torchrun sets; a process without it is rank 0).
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn


def stop_job(message: str) -> NoReturn:
    """Exit: rank 0 prints ``message`` (no traceback) and exits 1; the other ranks exit 0
    without a word, so the job fails by rank 0 alone. Were they to fail too, torchrun,
    which stops every worker as soon as one fails, could stop rank 0 before it printed.
    They leave with ``os._exit``: torchtitan's Trainer.__init__ (where the configuration
    is checked) is wrapped in torch's ``record``, which takes ``SystemExit(0)`` for a
    normal return; nothing is built yet that would need closing."""
    if os.environ.get("RANK", "0") == "0":
        raise SystemExit(message)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
