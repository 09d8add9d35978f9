"""The store a control plane talks to, counted and served apart.

``CountingStore`` wraps a store and counts each operation a rank makes on it (calls, and
the keys they name), shared with its clones: what the tests and
``benchmarks.control_plane_scale`` measure a control plane's traffic by. It is a
``dist.Store``, so torch's ``PrefixStore`` and ``init_process_group(store=...)`` take it.
``ServedStore`` runs a ``TCPStore`` server in a process of its own, which a test kills to
take the store away from a job (``SERVE`` says why it listens on IPv4).
"""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import threading
from collections import Counter

import torch.distributed as dist


class StoreOps:
    """Store operations by name, and the keys they named (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.calls: Counter[str] = Counter()
        self.keys = 0

    def count(self, name: str, keys: int = 1) -> None:
        with self._lock:
            self.calls[name] += 1
            self.keys += keys

    def snapshot(self) -> tuple[int, int]:
        """(calls, keys) so far."""
        with self._lock:
            return sum(self.calls.values()), self.keys


class CountingStore(dist.Store):
    """``inner``, with each operation counted in ``ops`` (a clone shares its parent's)."""

    def __init__(self, inner: dist.Store, ops: StoreOps | None = None):
        super().__init__()
        self.inner = inner
        self.ops = ops if ops is not None else StoreOps()
        # torch keeps only the C++ half of a store made in Python: its clones stay
        # referenced here, or their Python methods would be gone when called.
        self._clones: list[CountingStore] = []

    @property
    def underlying_store(self) -> dist.Store:
        return self.inner

    def set(self, key, value):
        self.ops.count("set")
        return self.inner.set(key, value)

    def get(self, key):
        self.ops.count("get")
        return self.inner.get(key)

    def add(self, key, value):
        self.ops.count("add")
        return self.inner.add(key, value)

    def append(self, key, value):
        self.ops.count("append")
        return self.inner.append(key, value)

    def check(self, keys):
        self.ops.count("check", len(keys))
        return self.inner.check(keys)

    def compare_set(self, key, expected, desired):
        self.ops.count("compare_set")
        return self.inner.compare_set(key, expected, desired)

    def delete_key(self, key):
        self.ops.count("delete_key")
        return self.inner.delete_key(key)

    def multi_get(self, keys):
        self.ops.count("multi_get", len(keys))
        return self.inner.multi_get(keys)

    def multi_set(self, keys, values):
        self.ops.count("multi_set", len(keys))
        return self.inner.multi_set(keys, values)

    def num_keys(self):
        self.ops.count("num_keys")
        return self.inner.num_keys()

    def wait(self, keys, timeout=None):
        self.ops.count("wait", len(keys))
        return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def set_timeout(self, timeout):
        return self.inner.set_timeout(timeout)

    def clone(self) -> "CountingStore":
        clone = CountingStore(self.inner.clone(), self.ops)
        self._clones.append(clone)
        return clone


SERVE = ("import datetime, socket, sys\n"
         "import torch.distributed as dist\n"
         "listening = socket.socket(socket.AF_INET, socket.SOCK_STREAM)\n"
         "listening.bind(('127.0.0.1', 0))\n"
         "port = listening.getsockname()[1]\n"
         "store = dist.TCPStore('127.0.0.1', port, is_master=True, wait_for_workers=False,\n"
         "                      timeout=datetime.timedelta(seconds=600),\n"
         "                      master_listen_fd=listening.detach())\n"
         "print(store.port, flush=True)\n"
         "sys.stdin.read()\n")
"""The server process: serves until its stdin closes (or it is killed), on an IPv4 socket
of its own. torch's server listens on IPv6 (``::``) where it binds the socket itself, and
looks up the name of each client that connects, on its one thread: a client's address is
then ``::ffff:127.0.0.1``, which the hosts file does not name, so each lookup asks the
name server, and where that drops queries sent at once (this sandbox's does) every
connection waits out the resolver's timeout behind it. On an IPv4 socket a client is
``127.0.0.1``, which the hosts file names."""


class ServedStore:
    """A ``TCPStore`` served by a process of its own on this host: ``host``, ``port``,
    ``client()``; ``kill()`` takes it away (SIGKILL: its connections close at once)."""

    host = "127.0.0.1"

    def __init__(self) -> None:
        self._process = subprocess.Popen([sys.executable, "-c", SERVE], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True)
        self.port = int(self._process.stdout.readline())

    @property
    def pid(self) -> int:
        return self._process.pid

    def client(self, timeout: float = 120.0) -> dist.TCPStore:
        return dist.TCPStore(self.host, self.port, is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=timeout))

    def kill(self) -> None:
        if self._process.poll() is None:
            os.kill(self._process.pid, signal.SIGKILL)
        self._process.wait()

    def __enter__(self) -> "ServedStore":
        return self

    def __exit__(self, *exc) -> None:
        self.kill()


def ops_of(store: dist.Store) -> StoreOps:
    """The counts of the ``CountingStore`` under ``store`` (under any prefixes)."""
    while not isinstance(store, CountingStore):
        store = store.underlying_store
    return store.ops
