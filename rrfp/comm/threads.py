"""Calls that run side by side, with one bounded wait for all of them."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


def concurrently(calls: dict[str, Callable[[], None]], timeout: float) -> list[threading.Thread]:
    """Run each call on its own thread; wait for all of them together for at most
    ``timeout`` seconds; return the threads still running (errors are logged)."""
    def run(name: str, call: Callable[[], None]) -> None:
        try:
            call()
        except Exception as e:
            logger.warning("%s: %s", name, e)

    threads = [threading.Thread(target=run, args=(name, call), name=name, daemon=True)
               for name, call in calls.items()]
    for thread in threads:
        thread.start()
    deadline = time.perf_counter() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.perf_counter()))
    return [t for t in threads if t.is_alive()]
