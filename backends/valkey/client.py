"""Reaching a Valkey or Redis server or cluster with valkey-glide, for the ``valkey`` tier:
its config keys (`ValkeyOptions`), addresses, where the password comes from, and a client
opened in the mode (cluster or standalone) the servers really are. The glide names the tier
uses are imported here, once, with a clear error where valkey-glide is missing.

The password comes from an environment variable or a file, read when the tier is built; it
lives only inside glide's credentials object and is never logged, printed or kept in a repr.

Thread: `ValkeyConnection.connect` runs on the tier's loop; the rest where the config is
loaded.
"""

from __future__ import annotations

import errno
import os
import sys
import warnings
from typing import Any

from pydantic import BaseModel, Field, field_validator, model_validator

from tiering.options import STRICT, Lifetime, Seconds, Size, parse_address

try:
    from glide import (
        AdvancedGlideClientConfiguration,
        AdvancedGlideClusterClientConfiguration,
        Batch,
        ClusterBatch,
        ClusterScanCursor,
        ExpiryGetEx,
        ExpirySet,
        ExpiryType,
        ExpiryTypeGetEx,
        GlideClient,
        GlideClientConfiguration,
        GlideClusterClient,
        GlideClusterClientConfiguration,
        GlideError,
        Logger,
        LogLevel,
        NodeAddress,
        RequestError,
        ServerCredentials,
    )
    from glide_shared.config import TlsAdvancedConfiguration
except ImportError as exc:
    raise ImportError(f"the valkey tier needs valkey-glide: pip install 'kv-tiering[valkey]' ({exc})") from exc


__all__ = [  # and the glide names the store uses, imported once here
    "Batch",
    "ClusterBatch",
    "ClusterScanCursor",
    "ExpiryGetEx",
    "ExpirySet",
    "ExpiryType",
    "ExpiryTypeGetEx",
    "GlideError",
    "RequestError",
    "ValkeyConnection",
    "ValkeyOptions",
    "parse_address",
    "read_password",
]


def _quiet_legacy_glide_modules() -> None:
    """glide puts stand-ins for its old module names (``glide.exceptions``, ...) in
    `sys.modules` that warn on the first access of any attribute, and scans of every module
    (`inspect.getmodule`, run by torch and pytest) touch them all: a DeprecationWarning about
    imports nobody made, an error under ``-W error``. Touch each once, warnings off."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for name, module in list(sys.modules.items()):
            if name.startswith("glide.") and module is not None:
                hasattr(module, "__file__")


_quiet_legacy_glide_modules()


class ValkeyOptions(BaseModel):
    """Config keys of the ``valkey`` tier, besides every block-store tier's (see
    `ValkeyBlockStore`)."""

    model_config = STRICT

    addresses: list[str] = Field(min_length=1)
    cluster_mode: bool = False
    key_prefix: str = Field("kvt", min_length=1)
    tls: bool = False
    tls_ca_file: str | None = None
    username: str | None = None
    password_env: str | None = None
    password_file: str | None = None
    connect_timeout_s: Seconds = 2.0
    request_timeout_s: Seconds = 5.0
    ttl_s: Lifetime | None = None
    max_value_bytes: Size = 512 << 20
    recover_index: bool = False

    @field_validator("addresses")
    @classmethod
    def _host_port(cls, addresses: list[str]) -> list[str]:
        for address in addresses:
            parse_address(address)
        return addresses

    @field_validator("key_prefix")
    @classmethod
    def _no_hash_tag(cls, prefix: str) -> str:
        if "{" in prefix or "}" in prefix:
            raise ValueError(f"key_prefix {prefix!r} holds '{{' or '}}': a hash tag would put every block in one slot")
        return prefix

    @model_validator(mode="after")
    def _one_password_source(self) -> ValkeyOptions:
        if self.password_env and self.password_file:
            raise ValueError("set password_env or password_file, not both")
        if self.tls_ca_file and not self.tls:
            raise ValueError("tls_ca_file needs tls: true")
        return self


def read_password(options: ValkeyOptions) -> str | None:
    """The password of `options`: from `password_env` or `password_file`, or None.

    Raises:
        ValueError: the variable is not set, or the file cannot be read (the message names
            the variable or the file, never the password).
    """
    if options.password_env:
        password = os.environ.get(options.password_env)
        if password is None:
            raise ValueError(f"password_env: the environment variable {options.password_env} is not set")
        return password
    if options.password_file:
        try:
            with open(options.password_file, encoding="utf-8") as file:
                return file.read().strip()
        except OSError as exc:
            raise ValueError(f"password_file: cannot read {options.password_file} ({exc.strerror})") from None
    return None


class ValkeyConnection:
    """Where the servers are and how to reach them; `connect` opens a glide client.

    Args:
        addresses: (host, port) of the server, or of some nodes of the cluster.
        cluster_mode: the servers are a cluster.
        tls, tls_ca_file, username, password, connect_timeout_s, request_timeout_s: as
            `tiering.backends.valkey.ValkeyBlockStore`.
        max_inflight: requests glide lets be in flight at once.
    """

    def __init__(
        self,
        addresses: list[tuple[str, int]],
        cluster_mode: bool,
        tls: bool,
        tls_ca_file: str | None,
        username: str | None,
        password: str | None,
        connect_timeout_s: float,
        request_timeout_s: float,
        max_inflight: int,
    ):
        self.addresses = addresses
        self.cluster_mode = cluster_mode
        self.tls = tls
        self.tls_ca_file = tls_ca_file
        self.username = username
        self._credentials = None if password is None else ServerCredentials(password, username)
        self.connect_timeout_s = connect_timeout_s
        self.request_timeout_s = request_timeout_s
        self._max_inflight = max_inflight

    def __repr__(self) -> str:
        nodes = ",".join(f"{host}:{port}" for host, port in self.addresses)
        return f"{'cluster' if self.cluster_mode else 'standalone'} {nodes}, tls={self.tls}"

    async def connect(self) -> Any:
        """A glide client (cluster or standalone) connected to every node; closed again, and
        an error raised, if the servers' mode is not the configured one.

        Raises:
            PermissionError: the server refused the credentials.
            ConnectionError: no server answered in time.
            OSError: the server is a cluster node and `cluster_mode` is off, or the reverse.
        """
        # glide's core prints every request timeout to the console at WARN; the tier logs
        # failures itself (rate-limited). init() keeps a logger the application set first.
        Logger.init(LogLevel.ERROR)
        client: Any = None
        try:
            if self.cluster_mode:
                client = await GlideClusterClient.create(self._client_config())
            else:
                client = await GlideClient.create(self._client_config())
                info = await client.custom_command(["INFO", "cluster"])
                if b"cluster_enabled:1" in info:
                    raise OSError(errno.EINVAL, f"{self.where()} is a cluster node: set cluster_mode: true")
        except GlideError as exc:
            if client is not None:
                await client.close()
            if self.cluster_mode and await self._standalone_answers():
                raise OSError(errno.EINVAL, f"{self.where()} is not a cluster: set cluster_mode: false") from None
            raise self._open_error(exc) from None
        except BaseException:
            if client is not None:
                await client.close()
            raise
        return client

    def where(self) -> str:
        """The servers, for messages: ``valkey tier: cluster host:port, ...``."""
        nodes = ", ".join(f"{host}:{port}" for host, port in self.addresses)
        return f"valkey tier: {'cluster' if self.cluster_mode else 'server'} {nodes}"

    def _client_config(self) -> Any:
        tls_config = None
        if self.tls_ca_file:
            with open(self.tls_ca_file, "rb") as file:
                tls_config = TlsAdvancedConfiguration(root_pem_cacerts=file.read())
        advanced = (AdvancedGlideClusterClientConfiguration if self.cluster_mode else AdvancedGlideClientConfiguration)(
            connection_timeout=int(self.connect_timeout_s * 1000), tls_config=tls_config
        )
        config = GlideClusterClientConfiguration if self.cluster_mode else GlideClientConfiguration
        return config(
            [NodeAddress(host, port) for host, port in self.addresses],
            use_tls=self.tls,
            credentials=self._credentials,
            request_timeout=int(self.request_timeout_s * 1000),
            client_name="kv-tiering",
            inflight_requests_limit=self._max_inflight,
            advanced_config=advanced,
        )

    async def _standalone_answers(self) -> bool:
        """Whether the first address answers as a server without cluster support (the usual
        reason a cluster client cannot connect: glide then reports only a timeout)."""
        host, port = self.addresses[0]
        config = GlideClientConfiguration(
            [NodeAddress(host, port)],
            use_tls=self.tls,
            credentials=self._credentials,
            request_timeout=int(self.request_timeout_s * 1000),
        )
        try:
            client = await GlideClient.create(config)
        except GlideError:
            return False
        try:
            return b"cluster_enabled:0" in await client.custom_command(["INFO", "cluster"])
        except GlideError:
            return False
        finally:
            await client.close()

    def _open_error(self, exc: Exception) -> OSError:
        message = str(exc)
        if any(word in message for word in ("WRONGPASS", "NOAUTH", "NOPERM", "invalid username-password")):
            user = self.username or "default"
            return PermissionError(errno.EACCES, f"{self.where()}: authentication refused for user {user!r}")
        hint = "; with tls, also check tls_ca_file and the server's certificate" if self.tls else ""
        reason = f"{type(exc).__name__}: {message.strip()}"
        return ConnectionError(errno.ECONNREFUSED, f"{self.where()}: cannot connect ({reason}){hint}")
