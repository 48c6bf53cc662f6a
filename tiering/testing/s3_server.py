"""A local S3-compatible server for tests and benchmarks: moto's server mode in a child process
on loopback. Needs the `moto[server]` package (in the `test` and `bench-s3` extras) and
botocore (the `s3` extra) for `MotoServer.client`.

As a command, it serves until Ctrl-C (or SIGTERM), with a bucket ready, and prints the
endpoint and the keys an S3 tier needs::

    python -m tiering.testing.s3_server [--port 9000] [--bucket kv-cache]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import subprocess
import sys
import time
from typing import IO

from tiering.testing.processes import exit_message, free_port, serve_until_stopped, spawn, stop_process


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
        self._stderr: IO[bytes] | None = None

    def start(self, timeout_s: float = 30.0) -> None:
        """Start the server and wait until it accepts connections.

        Raises:
            RuntimeError: moto is not installed, or the server exited (its stderr's end is in
                the message) or did not listen in `timeout_s`.
        """
        if importlib.util.find_spec("moto") is None:
            raise RuntimeError("no moto: the local S3 server needs moto[server] (the 'test' or 'bench-s3' extra)")
        command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]
        self._process, self._stderr = spawn(command, {**os.environ, **self.environment})
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                message = exit_message("moto server", self._process, self._stderr)
                self.stop()
                raise RuntimeError(message)
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
        """Stop the server; later calls do nothing."""
        if self._process is not None:
            stop_process(self._process)
            self._process = None
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None

    def client(self):
        """A synchronous botocore S3 client, for test set-up and raw object access."""
        import botocore.session

        return botocore.session.get_session().create_client(
            "s3", endpoint_url=self.endpoint_url, region_name="us-east-1"
        )

    def create_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)


LOCAL_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
"""What moto accepts (any keys); an S3 tier's client finds them in its environment."""


def main(argv: list[str] | None = None) -> None:
    """The command line (see the module docstring); returns once stopped.

    Raises:
        RuntimeError: the server could not start (as `MotoServer.start`).
    """
    parser = argparse.ArgumentParser(description="Start a local S3-compatible server (moto) until Ctrl-C.")
    parser.add_argument("--port", type=int, default=0, help="the port on 127.0.0.1 (default: a free one)")
    parser.add_argument("--bucket", default="kv-cache", help="a bucket created at start (default kv-cache)")
    args = parser.parse_args(argv)
    os.environ.update({key: os.environ.get(key, value) for key, value in LOCAL_CREDENTIALS.items()})
    server = MotoServer(args.port or None)

    def start() -> str:
        server.start()
        server.create_bucket(args.bucket)
        keys = " ".join(f"{key}={os.environ[key]}" for key in LOCAL_CREDENTIALS)
        tier = f"{{type: s3, bucket: {args.bucket}, endpoint_url: {server.endpoint_url}}}"
        return f"s3 server up: {server.endpoint_url}; bucket {args.bucket}; tier: {tier} with {keys};"

    serve_until_stopped(start, server.stop)


if __name__ == "__main__":
    main()
