"""The step loop's wake-up: one event that message arrivals, device completions and
the job's watch all signal."""

from __future__ import annotations

import threading


class Wakeup:
    """Wakes the step loop's driver when a message arrives or the device completes work.

    Sources that can notify (waiter threads, the emulated device's thread) call
    ``notify``; sources that must be polled (NCCL works, CUDA events) make ``wait`` poll.
    """

    POLL_INTERVAL_S = 20e-6

    def __init__(self) -> None:
        self._event = threading.Event()
        self.polled = False
        """Whether some source is only observable by polling."""

    def notify(self) -> None:
        self._event.set()

    def wait(self, timeout: float) -> bool:
        """Return after a notification (or, when polling, a short interval), or ``timeout``;
        whether the caller should look at its sources again (False: ``timeout`` passed
        without a notification, and nothing is polled)."""
        if self.polled:
            self._event.wait(min(timeout, self.POLL_INTERVAL_S))
            fired = True
        else:
            fired = self._event.wait(timeout)
        if fired:
            # Clearing may drop a notification that raced with the wait's return, but the
            # caller collects every source right after, so nothing is lost. After a
            # timeout the event is left alone: a notification that came just after it
            # must wake the next wait.
            self._event.clear()
        return fired
