"""A local S3-compatible server for tests and benchmarks: moto's server mode in a child process
on loopback (needs the `moto[server]` package, part of the test extra)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import botocore.session


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop_process(process: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGTERM `process` and wait for it; SIGKILL it if it has not exited in `timeout_s`."""
    process.terminate()
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


class MotoServer:
    """moto_server on 127.0.0.1:`port`; `stop` and `start` again to simulate an outage (the
    restarted server has lost every bucket and object)."""

    def __init__(self, port: int | None = None, environment: dict[str, str] | None = None):
        """`environment`: extra variables for the server, for example
        ``{"INITIAL_NO_AUTH_ACTION_COUNT": "0"}`` to make it check credentials."""
        self.port = port or free_port()
        self.environment = environment or {}
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self._process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 30.0) -> None:
        command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]
        self._process = subprocess.Popen(
            command, env={**os.environ, **self.environment}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"moto server exited with {self._process.returncode}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"moto server did not listen on port {self.port} in {timeout_s} s")

    @property
    def pid(self) -> int:
        """The server's process id (to freeze it with SIGSTOP, say).

        Raises:
            RuntimeError: the server is not running.
        """
        if self._process is None:
            raise RuntimeError("the moto server is not running")
        return self._process.pid

    def stop(self) -> None:
        if self._process is not None:
            stop_process(self._process)
            self._process = None

    def client(self):
        """A synchronous botocore S3 client, for test set-up and raw object access."""
        return botocore.session.get_session().create_client(
            "s3", endpoint_url=self.endpoint_url, region_name="us-east-1"
        )

    def create_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)
