"""The test servers' child processes: a free loopback port, a server started with its stderr
kept, what a server that exited said, a stop that always ends the process, and a server run
from the command line until Ctrl-C."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import IO

STDERR_TAIL_BYTES = 2000  # of a failed server's stderr, in its error


def free_port() -> int:
    """A loopback port free at the time of the call."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn(command: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen, IO[bytes]]:
    """Start `command` (`env`: its whole environment; None: this process's) with stdout
    discarded and stderr kept in an anonymous temporary file, for `exit_message`.

    Returns:
        The process and its stderr file (the caller closes it once the process is stopped).

    Raises:
        OSError: the program cannot be started.
    """
    stderr = tempfile.TemporaryFile()  # noqa: SIM115  (closed by the caller, or below)
    try:
        return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=stderr), stderr
    except BaseException:
        stderr.close()
        raise


def exit_message(name: str, process: subprocess.Popen, stderr: IO[bytes]) -> str:
    """'`name` exited with status N: <the end of its stderr>', for a server that exited."""
    stderr.seek(max(0, stderr.seek(0, os.SEEK_END) - STDERR_TAIL_BYTES))  # a long-lived server's log is long
    tail = stderr.read().decode(errors="replace").strip()
    return f"{name} exited with status {process.returncode}: " + (tail or "(nothing on stderr)")


def stop_process(process: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGTERM `process` and wait for it; SIGKILL it if it has not exited in `timeout_s`."""
    process.terminate()
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def serve_until_stopped(start: Callable[[], str], stop: Callable[[], None]) -> None:
    """A test server run as a command: `start` it (it returns the line that says where it
    listens), print that line, and wait for Ctrl-C or SIGTERM; `stop` it then, however it
    ended. Main thread only (it sets a SIGTERM handler)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        print(f"{start()} (Ctrl-C stops it)", flush=True)
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        stop()
