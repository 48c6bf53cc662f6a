"""Reaching a Mooncake Store pool for the ``mooncake`` tier: its config keys
(`MooncakeOptions`), one `MooncakeDistributedStore` client per tier, the threads its blocking
calls run on, and the registered staging memory blocks pass through.

Mooncake's calls block, and its client starts threads and sockets of its own when it is set
up. So every call goes through `MooncakeClient.call`, to one of the client's `threads`
threads; each of them first enters the tier's `network_namespace` where one is configured, so
that everything Mooncake opens (the transfer engine's listener, its connections, the RPC to
the master, the metadata server's HTTP) lives in that namespace. The transfer engine binds
and announces `local_hostname`'s address (``MC_TCP_BIND_ADDRESS``, unless already set).

Each thread owns one slice of the staging buffer, registered with the transfer engine once:
a call moves its blocks through its thread's slice (header and payload written together, so
one object is one transfer), never through memory another call is using.

Thread: `MooncakeClient.open`/`close`/`call` are awaited on the tier's loop; the work runs on
the client's threads. `MooncakeOptions` is built where the config is loaded.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import socket
import threading
import urllib.request
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal, TypeVar

import numpy as np
from pydantic import BaseModel, Field, field_validator

from tiering.options import STRICT, Size, parse_address
from tiering.tiers.network_namespace import enter_network_namespace

try:
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig
except ImportError as exc:  # the wheel, or the libibverbs.so.1 it links against
    raise ImportError(
        f"the mooncake tier needs Mooncake Store: pip install 'kv-tiering[mooncake]', "
        f"and libibverbs.so.1 (Debian: apt-get install libibverbs1) ({exc})",
        name="mooncake",
    ) from exc

__all__ = ["MooncakeClient", "MooncakeOptions", "ReplicateConfig"]

T = TypeVar("T")
MASTER_CONNECT_TIMEOUT_S = 2.0
MIN_SEGMENT_BYTES = 16 << 20  # a smaller segment fails Mooncake's setup


class MooncakeOptions(BaseModel):
    """Config keys of the ``mooncake`` tier, besides every block-store tier's (see
    `tiering.backends.mooncake.MooncakeBlockStore`)."""

    model_config = STRICT

    master_address: str
    metadata_server: str = Field(min_length=1)
    local_hostname: str = Field(min_length=1)
    protocol: Literal["tcp", "rdma"] = "tcp"
    rdma_devices: str = ""
    segment_bytes: Literal[0] | Size = 1 << 30  # 0: a client only, contributing no memory
    local_buffer_bytes: Size = Field(16 << 20, gt=0)
    staging_bytes: Size = Field(64 << 20, gt=0)
    threads: int = Field(4, ge=1, le=64)
    key_prefix: str = Field("kvt", min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    replicas: int = Field(1, ge=1, le=8)
    prefer_local_segment: bool = True
    network_namespace: str | None = None
    admin_address: str | None = None
    recover_index: bool = False

    @field_validator("segment_bytes")
    @classmethod
    def _segment(cls, size: int) -> int:
        if 0 < size < MIN_SEGMENT_BYTES:
            raise ValueError(f"0 (no memory lent) or at least {MIN_SEGMENT_BYTES} bytes (16MiB, Mooncake's least)")
        return size

    @field_validator("master_address", "admin_address")
    @classmethod
    def _host_port(cls, address: str | None) -> str | None:
        if address is not None:
            parse_address(address)
        return address


class MooncakeClient:
    """One Mooncake client (its segment mounted into the pool while open), its threads and
    its staging memory."""

    def __init__(self, options: MooncakeOptions, slot_bytes_at_least: int = 0):
        """`slot_bytes_at_least`: the largest object a call moves (each thread's slice of the
        staging memory is at least this large). Nothing is opened yet."""
        self.options = options
        self.slot_bytes = max(options.staging_bytes // options.threads, slot_bytes_at_least)
        self.hostname: str | None = None  # the transfer engine's endpoint, once open
        self._store: Any = None
        self._staging: mmap.mmap | None = None
        self._slots = threading.local()
        self._next_slot = 0
        self._slot_lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None

    def __repr__(self) -> str:
        namespace = f", network_namespace={self.options.network_namespace!r}" if self.options.network_namespace else ""
        return f"MooncakeClient(master {self.options.master_address}, {self.options.protocol}{namespace})"

    async def open(self) -> None:
        """Start the threads, set the client up (its segment of `segment_bytes` joins the
        pool) and register the staging memory.

        Raises:
            ConnectionError: the master does not accept a connection.
            OSError: the namespace cannot be entered, or Mooncake's setup or registration
                failed (the message gives its status).
        """
        options = self.options
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", parse_host(options.local_hostname))
        self._executor = ThreadPoolExecutor(options.threads, "mooncake", initializer=self._start_thread)
        try:
            await self.call(self._setup)
        except BaseException:
            self._executor.shutdown(wait=False)
            self._executor = None
            raise

    def _start_thread(self) -> None:
        if self.options.network_namespace:
            enter_network_namespace(self.options.network_namespace)

    def _setup(self) -> None:
        options = self.options
        try:  # Mooncake's own setup retries a master that does not answer for a minute and a half
            socket.create_connection(parse_address(options.master_address), MASTER_CONNECT_TIMEOUT_S).close()
        except OSError as exc:
            raise ConnectionError(f"the Mooncake master at {options.master_address} does not answer: {exc}") from None
        store = MooncakeDistributedStore()
        status = store.setup(
            options.local_hostname,
            options.metadata_server,
            options.segment_bytes,
            options.local_buffer_bytes,
            options.protocol,
            options.rdma_devices,
            options.master_address,
        )
        if status != 0:
            raise OSError(f"Mooncake setup failed (status {status}): is the master at {options.master_address} up?")
        staging = mmap.mmap(-1, self.slot_bytes * options.threads)
        status = store.register_buffer(_address(staging), len(staging))
        if status != 0:
            store.close()
            raise OSError(f"Mooncake refused to register {len(staging)} bytes of staging memory (status {status})")
        self._store, self._staging, self.hostname = store, staging, store.get_hostname()

    async def close(self) -> None:
        """Unmount the segment (its objects leave the pool) and stop the threads. Later calls
        do nothing."""
        executor, self._executor = self._executor, None
        if executor is None:
            return
        try:
            await asyncio.wrap_future(executor.submit(self._close))
        finally:
            executor.shutdown(wait=False)

    def _close(self) -> None:
        store, self._store = self._store, None
        if store is not None:
            store.close()
            del store  # its destructor talks to the metadata server: from inside the namespace

    async def call(self, func: Callable[..., T], *args: Any) -> T:
        """`func(*args)` on one of the client's threads, awaited.

        Raises:
            ConnectionError: the client is closed.
        """
        return await asyncio.wrap_future(self.submit(func, *args))

    def submit(self, func: Callable[..., T], *args: Any) -> Future[T]:
        """`func(*args)` on one of the client's threads; any thread.

        Raises:
            ConnectionError: the client is closed.
        """
        if self._executor is None:
            raise ConnectionError("the Mooncake client is closed")
        return self._executor.submit(func, *args)

    @property
    def store(self) -> Any:
        """The `MooncakeDistributedStore`, for the client's threads only.

        Raises:
            ConnectionError: the client is not set up.
        """
        if self._store is None:
            raise ConnectionError("the Mooncake client is not set up")
        return self._store

    def slot(self) -> tuple[np.ndarray, int]:
        """This thread's slice of the staging memory, as bytes, and its address; the
        client's threads only (each owns one slice for as long as the client lives)."""
        index = getattr(self._slots, "index", None)
        if index is None:
            with self._slot_lock:
                index = self._slots.index = self._next_slot
                self._next_slot += 1
        assert self._staging is not None
        view = np.frombuffer(self._staging, np.uint8, self.slot_bytes, index * self.slot_bytes)
        return view, view.ctypes.data

    def admin_get(self, path: str) -> bytes:
        """GET `path` from the master's HTTP admin server (`admin_address`); client threads only.

        Raises:
            OSError: no `admin_address`, or the request failed.
        """
        if self.options.admin_address is None:
            raise OSError("admin_address is not set: the master's keys cannot be listed")
        with urllib.request.urlopen(f"http://{self.options.admin_address}{path}", timeout=10) as answer:
            body: bytes = answer.read()
        return body


def parse_host(hostname: str) -> str:
    """The address part of a ``host[:port]`` `local_hostname`."""
    host, colon, port = hostname.rpartition(":")
    return host.strip("[]") if colon and port.isdigit() else hostname


def _address(buffer: mmap.mmap) -> int:
    return int(np.frombuffer(buffer, np.uint8).ctypes.data)
