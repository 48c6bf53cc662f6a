"""A Mooncake Store pool for tests and benchmarks, alone in a network namespace of its own: a
real ``mooncake_master`` (with its HTTP metadata and admin servers) and ``mooncake_client``
processes that mount memory into the pool, started by `MooncakePool` and stopped by `stop`.

Mooncake listens on every address whatever it is told, so the pool lives in a namespace
whose only interface is ``lo`` (`NetworkNamespace`, made with ``unshare --net``); tiers reach
it with ``network_namespace`` (their client's threads enter it). Needs root (entering a
namespace needs CAP_SYS_ADMIN) and the ``mooncake`` extra; `unavailable` says why not.

Run as a program it starts one and prints the tier config that reaches it:

    sudo python -m tiering.testing.mooncake_pool --segment 1GiB

Used from one thread; `freeze`, `thaw`, `kill_master` and `start_master` act on the master.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, TypeVar

from tiering.options import parse_size
from tiering.testing.processes import exit_message, serve_until_stopped, spawn, stop_process
from tiering.tiers.network_namespace import enter_network_namespace

T = TypeVar("T")
RPC_PORT, METADATA_PORT, ADMIN_PORT = 50051, 8080, 9003  # alone in the namespace: fixed ports are free
START_TIMEOUT_S = 30.0


def binary(name: str) -> str:
    """The path of Mooncake's program `name`, installed beside this Python by the wheel.

    Raises:
        FileNotFoundError: the ``mooncake`` extra is not installed.
    """
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"no {name}: install the 'mooncake' extra")
    return found


@functools.cache
def unavailable() -> str | None:
    """Why a pool cannot start here (one line), or None; found out once per process."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        return f"Mooncake Store cannot be imported: {exc}"
    if os.geteuid() != 0:
        return "a Mooncake pool runs in a network namespace of its own, and entering one needs root"
    if shutil.which("unshare") is None or shutil.which("nsenter") is None or shutil.which("ip") is None:
        return "unshare, nsenter and ip (util-linux, iproute2) are needed"
    tried = subprocess.run(["unshare", "--net", "--", "ip", "link", "set", "lo", "up"], capture_output=True, text=True)
    if tried.returncode:
        return f"this machine refuses a network namespace: {tried.stderr.strip() or tried.returncode}"
    return None


class NetworkNamespace:
    """A network namespace with only ``lo`` up, held by a sleeping process until `stop`."""

    def __init__(self) -> None:
        self._holder = subprocess.Popen(
            ["unshare", "--net", "--", "sh", "-c", "ip link set lo up && echo up && exec sleep infinity"],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._holder.stdout is not None
        if self._holder.stdout.readline().strip() != "up":
            self._holder.wait(10)
            raise OSError(f"unshare --net failed with status {self._holder.returncode}")
        self.path = f"/proc/{self._holder.pid}/ns/net"

    def spawn(self, command: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen, IO[bytes]]:
        """`command` started inside the namespace (`tiering.testing.processes.spawn`)."""
        return spawn(["nsenter", f"--net={self.path}", "--", *command], env)

    def call(self, func: Callable[[], T]) -> T:
        """`func()` on a thread inside the namespace; its result, or what it raised."""
        outcome: list[Any] = []

        def run() -> None:
            try:
                enter_network_namespace(self.path)
                outcome.append((True, func()))
            except BaseException as exc:
                outcome.append((False, exc))

        thread = threading.Thread(target=run, name="in-namespace")
        thread.start()
        thread.join()
        ok, value = outcome[0]
        if not ok:
            raise value
        return value  # type: ignore[no-any-return]

    def interfaces(self) -> list[str]:
        """The namespace's network interfaces."""
        lines = Path(f"/proc/{self._holder.pid}/net/dev").read_text().splitlines()[2:]
        return [line.split(":")[0].strip() for line in lines]

    def tcp_sockets(self, owner: int | None = None) -> list[tuple[str, str]]:
        """(local, remote) addresses, as ``ip:port``, of every TCP socket in the namespace
        (with `owner`: only those process `owner` holds)."""
        return tcp_sockets(f"/proc/{self._holder.pid}/net", owner)

    def stop(self) -> None:
        stop_process(self._holder)
        assert self._holder.stdout is not None
        self._holder.stdout.close()


def tcp_sockets(net: str, owner: int | None = None) -> list[tuple[str, str]]:
    """(local, remote) of every TCP socket in the tables under `net` (``/proc/PID/net``);
    with `owner`, only those process `owner` holds open."""
    held = None if owner is None else socket_inodes(owner)
    found = []
    for table, width in (("tcp", 8), ("tcp6", 32)):
        for line in Path(net, table).read_text().splitlines()[1:]:
            fields = line.split()
            if held is None or int(fields[9]) in held:
                found.append((_address(fields[1], width), _address(fields[2], width)))
    return found


def socket_inodes(pid: int) -> set[int]:
    """The inodes of the sockets process `pid` holds open."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):  # closed meanwhile
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    return inodes


def _address(text: str, width: int) -> str:
    """``ip:port`` of a /proc/net/tcp{,6} field (hex, host byte order in 32-bit words)."""
    raw, port = text.split(":")
    words = [bytes.fromhex(raw[i : i + 8])[::-1] for i in range(0, width, 8)]
    packed = b"".join(words)
    if width == 8:
        return f"{'.'.join(str(b) for b in packed)}:{int(port, 16)}"
    if packed[:12] == bytes(10) + b"\xff\xff":  # an IPv4-mapped address
        return f"{'.'.join(str(b) for b in packed[12:])}:{int(port, 16)}"
    return f"[{packed.hex()}]:{int(port, 16)}"


class MooncakePool:
    """A master and `members` clients mounting `segment_bytes` each, in a fresh namespace."""

    def __init__(self, segment_bytes: int = 256 << 20, members: int = 1, lease_ms: int = 500):
        self.segment_bytes = segment_bytes
        self.lease_ms = lease_ms
        self.namespace = NetworkNamespace()
        self._master: tuple[subprocess.Popen, IO[bytes]] | None = None
        self._members: list[tuple[subprocess.Popen, IO[bytes]]] = []
        try:
            self.start_master()
            for i in range(members):
                self.add_member(RPC_PORT + 1 + i)
        except BaseException:
            self.stop()
            raise

    @property
    def master_address(self) -> str:
        return f"127.0.0.1:{RPC_PORT}"

    @property
    def metadata_server(self) -> str:
        return f"http://127.0.0.1:{METADATA_PORT}/metadata"

    @property
    def admin_address(self) -> str:
        return f"127.0.0.1:{ADMIN_PORT}"

    def tier_options(self, **extra: Any) -> dict[str, Any]:
        """The config keys of a ``mooncake`` tier that reaches this pool."""
        return {
            "master_address": self.master_address,
            "metadata_server": self.metadata_server,
            "local_hostname": "127.0.0.1",
            "admin_address": self.admin_address,
            "network_namespace": self.namespace.path,
            **extra,
        }

    def start_master(self) -> None:
        """Start the master, and wait until it serves.

        Raises:
            RuntimeError: it exited or did not answer in time (with its stderr).
        """
        command = [
            binary("mooncake_master"),
            "-rpc_address=127.0.0.1",
            f"-rpc_port={RPC_PORT}",
            "-enable_http_metadata_server=true",
            "-http_metadata_server_host=127.0.0.1",
            f"-http_metadata_server_port={METADATA_PORT}",
            "-metrics_host=127.0.0.1",
            f"-metrics_port={ADMIN_PORT}",
            f"-default_kv_lease_ttl={self.lease_ms}",
            "-enable_metric_reporting=false",
        ]
        self._master = self.namespace.spawn(command)
        self._wait(lambda: self.admin_get("/health"), "mooncake_master", self._master)

    def add_member(self, port: int) -> None:
        """Start a ``mooncake_client`` that mounts `segment_bytes` into the pool; wait until
        the master lists its segment."""
        before = self.segments()
        command = [
            binary("mooncake_client"),
            "-host=127.0.0.1",
            f"-port={port}",
            f"-global_segment_size={self.segment_bytes}",
            f"-master_server_address={self.master_address}",
            f"-metadata_server={self.metadata_server}",
        ]
        member = self.namespace.spawn(command, {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"})
        self._members.append(member)

        def mounted() -> None:
            if len(self.segments()) <= len(before):
                raise OSError("not mounted yet")

        self._wait(mounted, f"mooncake_client on port {port}", member)

    def _wait(self, check: Callable[[], object], name: str, started: tuple[subprocess.Popen, IO[bytes]]) -> None:
        process, stderr = started
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                raise RuntimeError(exit_message(name, process, stderr))
            try:
                check()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name} did not serve in {START_TIMEOUT_S} s") from None
                time.sleep(0.05)

    def admin_get(self, path: str) -> bytes:
        """GET `path` from the master's admin server.

        Raises:
            OSError: it did not answer.
        """

        def get() -> bytes:
            with urllib.request.urlopen(f"http://{self.admin_address}{path}", timeout=5) as answer:
                body: bytes = answer.read()
            return body

        return self.namespace.call(get)

    def object_names(self) -> list[str]:
        """Every object's name the master holds."""
        return self.admin_get("/get_all_keys").decode().split()

    def placements(self, names: list[str]) -> dict[str, list[str]]:
        """The segments (endpoints) holding a replica of each of `names`, as the master
        says; an object it does not hold has none."""
        found: dict[str, list[str]] = {}
        for start in range(0, len(names), 100):  # a query's names ride in its URL
            batch = names[start : start + 100]
            answer = json.loads(self.admin_get(f"/batch_query_keys?keys={','.join(batch)}"))["data"]
            for name in batch:
                replicas = answer.get(name) or {}
                found[name] = [replica["transport_endpoint_"] for replica in replicas.get("values") or ()]
        return found

    def segments(self) -> list[str]:
        """The endpoints of the segments mounted into the pool."""
        return self.admin_get("/get_all_segments").decode().split()

    def kill_master(self) -> None:
        """SIGKILL the master (`start_master` starts a new one, which knows no object)."""
        assert self._master is not None
        process, stderr = self._master
        process.kill()
        process.wait()
        stderr.close()
        self._master = None

    def freeze(self) -> None:
        """SIGSTOP the master (it stops answering, its sockets stay open)."""
        assert self._master is not None
        self._master[0].send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        assert self._master is not None
        self._master[0].send_signal(signal.SIGCONT)

    def stop(self) -> None:
        """Stop the clients, the master and the namespace. Later calls do nothing."""
        for process, stderr in [*self._members, *([self._master] if self._master else [])]:
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
            stop_process(process)
            stderr.close()
        self._members, self._master = [], None
        self.namespace.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--segment", type=parse_size, default=1 << 30, help="memory each member mounts (1GiB)")
    parser.add_argument("--members", type=int, default=1, help="mooncake_client processes (1)")
    args = parser.parse_args(argv)
    why = unavailable()
    if why:
        parser.error(why)
    pool: list[MooncakePool] = []

    def start() -> str:
        pool.append(MooncakePool(args.segment, args.members))
        return "mooncake tier options: " + json.dumps(pool[0].tier_options())

    serve_until_stopped(start, lambda: pool[0].stop() if pool else None)


if __name__ == "__main__":
    main()
