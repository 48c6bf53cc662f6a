"""The ``s3`` tier: one object per block in an S3-compatible bucket, through aiobotocore.

Objects are ``<prefix><layout fingerprint hex>/<key hex>``, in the stored format of
`tiering.tiers.object_format`, so any engine of the same layout reading the bucket shares the
blocks (a cross-instance cache): the tier probes keys it has not seen (one HEAD per key, a
short negative cache) and rebuilds its index from a paginated listing at start.

Loop thread: every coroutine of `S3BlockStore`; `S3Options` and the class methods run where
the config is loaded.

One long-lived client per tier, created and closed on the runtime's loop; its connection
pool is as large as the tier's concurrency; standard retries with backoff; connect and read
timeouts (well below the operation timeout, and without the `Expect: 100-continue`
handshake, whose wait no timeout bounds, so a frozen endpoint fails requests within
seconds). Uploads stream the header and the primary row without joining them; downloads
stream into the primary row. Credentials come from the standard AWS chain only (the
environment, config files, an instance role): this module never takes, logs or prints them.
"""

from __future__ import annotations

import errno
import io
import os
import re
from collections.abc import Collection, Mapping, Sequence
from contextlib import AsyncExitStack
from typing import Any, ClassVar

import botocore.session
from aiobotocore.session import get_session
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError, ParamValidationError
from pydantic import BaseModel, field_validator

from tiering.backends.buffers import spans
from tiering.contract.keys import OffloadKey
from tiering.contract.mediums import REMOTE
from tiering.errors import CorruptObjectError, ObjectNotFoundError, UnusableObjectError
from tiering.options import STRICT, Count, Seconds
from tiering.tiers.blockstore import BlockStore, BlockStoreSettings
from tiering.tiers.blockstore.generations import MANIFEST_KEY
from tiering.tiers.blockstore.store import NamespaceUsage, RecoveryProgress, namespace_named
from tiering.tiers.object_format import ObjectHeader, check_length, encode_object, header_size, parse_header

_DELETE_BATCH = 1000  # the most keys one DeleteObjects request takes
_NOT_FOUND = {"404", "NoSuchKey", "NotFound"}
_UNUSABLE = {"InvalidObjectState", "ObjectNotInActiveTierError"}
"""Error codes about one object only: archived by a lifecycle rule to a storage class
(Glacier, Deep Archive, an archive tier) that a GET cannot read."""


class _PartsReader(io.RawIOBase):
    """A seekable, read-only file over several buffers, so an upload reads the header and
    the payload in place (seekable, so retries and checksums can rewind it)."""

    def __init__(self, parts: Sequence[bytes | memoryview]):
        super().__init__()
        self._parts = [memoryview(part).cast("B") for part in parts]
        self.size = sum(part.nbytes for part in self._parts)
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self.size}[whence]
        self._position = max(0, base + offset)
        return self._position

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        copied = 0
        for part, start, length in spans(self._parts, self._position, out.nbytes):
            out[copied : copied + length] = part[start : start + length]
            copied += length
        self._position += copied
        return copied


_BUCKET = re.compile(r"[a-zA-Z0-9.\-_]{1,255}")


class S3Options(BaseModel):
    """Config keys of the ``s3`` tier, besides every block-store tier's (see `S3BlockStore`)."""

    model_config = STRICT

    bucket: str
    prefix: str = ""
    endpoint_url: str | None = None
    region_name: str | None = None
    create_bucket: bool = False
    verify_tls: bool = True
    connect_timeout_s: Seconds = 2.0
    read_timeout_s: Seconds = 5.0
    max_attempts: Count = 2

    @field_validator("bucket")
    @classmethod
    def _bucket_name(cls, bucket: str) -> str:
        """The names the S3 client sends (botocore's own check, which runs only at the first
        request): 1-255 letters, digits, '.', '-', '_', or an access point's ARN."""
        if not (_BUCKET.fullmatch(bucket) or bucket.startswith("arn:")):
            raise ValueError(f"{bucket!r} is not a bucket name (letters, digits, '.', '-', '_') or an access point ARN")
        return bucket


class S3BlockStore(BlockStore):
    """Objects in ``bucket`` under ``prefix``. Tier type ``s3``: its tiers probe keys they
    have not seen (other engines write the bucket) and send one request per block, at most
    `max_concurrency` (64) at once, each within `op_timeout_s` (20 s).

    Args:
        fingerprint: the layout fingerprint; it names the namespace under the prefix.
        bucket: the bucket (must exist unless `create_bucket`).
        prefix: key prefix of this cache inside the bucket, for example ``"prod/"``.
        endpoint_url: an S3-compatible endpoint, or None for AWS.
        region_name: the region, or None for the chain's default.
        create_bucket: create the bucket at open if it is missing.
        verify_tls: verify the endpoint's TLS certificate.
        max_pool_connections: HTTP connections kept (at least the tier's concurrency).
        connect_timeout_s, read_timeout_s: per request, seconds.
        max_attempts: attempts per request, retries with backoff ("standard" mode).
        list_page_size: keys per listing request when recovering.
    """

    Options = S3Options
    supports_integrity = True
    locality = REMOTE
    tier_defaults: ClassVar[dict[str, Any]] = {
        "max_concurrency": 64,
        "op_timeout_s": 20.0,
        "batch_bytes": 1,  # one request per block: requests run concurrently, not in a batch
        "probe_misses": True,
        # ~200 MiB of index: a bucket may hold far more (every engine's, kept by lifecycle
        # rules); beyond it the least recent keys are forgotten, objects kept, found by probes
        "index_max_blocks": 1 << 20,
    }

    @classmethod
    def from_config(cls, fingerprint: bytes, options: BaseModel, settings: BlockStoreSettings) -> S3BlockStore:
        """A store of the tier's config, with connections for both lanes of requests (loads,
        stores: `max_concurrency` each)."""
        return cls(fingerprint, **dict(options), max_pool_connections=2 * settings.max_concurrency)

    @classmethod
    def check_config(cls, options: BaseModel, settings: BlockStoreSettings) -> None:
        """Client timeouts must be below the operation timeout, so that a frozen endpoint
        fails requests (and trips the breaker) within seconds, not when the call times out.

        Raises:
            ValueError: `connect_timeout_s` or `read_timeout_s` is not below `op_timeout_s`.
        """
        assert isinstance(options, S3Options)
        settings.check_client_timeouts(
            connect_timeout_s=options.connect_timeout_s, read_timeout_s=options.read_timeout_s
        )

    @classmethod
    def preflight(
        cls, options: BaseModel, settings: BlockStoreSettings, connect: bool, notes: list[str] | None = None
    ) -> list[str]:
        """Resolve the AWS credentials as the client will (environment, shared files, an
        instance role: no request to S3); with `connect`, also open the bucket (see
        `BlockStore.preflight`)."""
        try:
            credentials = botocore.session.get_session().get_credentials()
        except BotoCoreError as exc:
            return [f"the AWS credentials cannot be read: {exc}"]
        if credentials is None:
            return ["no AWS credentials in the chain (environment, shared files, instance role)"]
        return super().preflight(options, settings, connect, notes)

    @classmethod
    async def list_namespaces(cls, options: BaseModel, settings: BlockStoreSettings) -> list[NamespaceUsage]:
        """The namespaces under the prefix, from a paginated listing of it (the store is
        opened for it, as the engine opens it): objects, bytes, newest ``LastModified``,
        whether one of them is an identity's manifest."""
        store = cls.from_config(bytes(16), options, settings)
        await store.open()
        try:
            usage: dict[bytes, NamespaceUsage] = {}
            paginator = store._client.get_paginator("list_objects_v2")
            async for page in paginator.paginate(Bucket=store.bucket, Prefix=store.prefix):
                for obj in page.get("Contents", ()):
                    name, slash, rest = obj["Key"][len(store.prefix) :].partition("/")
                    if not slash or (namespace := namespace_named(name)) is None:
                        continue
                    seen = usage.get(namespace, NamespaceUsage(namespace, 0, 0, None, False))
                    written = max(seen.last_write or 0.0, obj["LastModified"].timestamp())
                    manifest = seen.holds_manifest or rest == MANIFEST_KEY.hex()
                    usage[namespace] = NamespaceUsage(
                        namespace, seen.objects + 1, seen.bytes + obj["Size"], written, manifest
                    )
            return sorted(usage.values(), key=lambda found: found.namespace)
        finally:
            await store.close()

    @classmethod
    def location(cls, options: Mapping[str, Any]) -> str:
        """``s3``, the endpoint (as configured: the environment's, else AWS), the bucket and
        the prefix."""
        endpoint = options.get("endpoint_url") or "the default endpoint"
        return f"s3 bucket {options['bucket']!r}, prefix {options.get('prefix', '')!r} at {endpoint}"

    def __init__(
        self,
        fingerprint: bytes,
        bucket: str,
        prefix: str = "",
        endpoint_url: str | None = None,
        region_name: str | None = None,
        create_bucket: bool = False,
        verify_tls: bool = True,
        max_pool_connections: int = 64,
        connect_timeout_s: float = 2.0,
        read_timeout_s: float = 5.0,
        max_attempts: int = 2,
        list_page_size: int = 1000,
    ):
        super().__init__(fingerprint)
        self._list_page_size = list_page_size
        self.bucket = bucket
        self.prefix = prefix
        self.endpoint_url = endpoint_url
        self.region_name = region_name
        self.create_bucket = create_bucket
        self.verify_tls = verify_tls
        self._namespace = f"{prefix}{fingerprint.hex()}/"
        self._config = Config(
            max_pool_connections=max_pool_connections,
            connect_timeout=connect_timeout_s,
            read_timeout=read_timeout_s,
            retries={"mode": "standard", "max_attempts": max_attempts},
            request_checksum_calculation="when_required",  # our own XXH3-64 covers the payload
            response_checksum_validation="when_required",
        )
        self._stack: AsyncExitStack | None = None
        self._client: Any = None

    def __repr__(self) -> str:
        return f"S3BlockStore(bucket={self.bucket!r}, prefix={self.prefix!r}, endpoint_url={self.endpoint_url!r})"

    def object_name(self, key: OffloadKey) -> str:
        """The S3 key of the object of `key`."""
        return self._namespace + key.hex()

    async def open(self) -> None:
        """Create the client and check that the bucket is there and ours to use.

        Raises:
            FileNotFoundError: the bucket does not exist (and `create_bucket` is false).
            PermissionError: no credentials in the chain, or access denied.
            ConnectionError: the endpoint cannot be reached.
        """
        stack = AsyncExitStack()
        try:
            self._client = await stack.enter_async_context(
                get_session().create_client(
                    "s3",
                    endpoint_url=self.endpoint_url,
                    region_name=self.region_name,
                    verify=self.verify_tls,
                    config=self._config,
                )
            )
            # botocore asks for "Expect: 100-continue" on uploads, and aiohttp's wait for the
            # interim answer has no timeout: a frozen endpoint would hang every store.
            self._client.meta.events.register("before-send.s3.PutObject", _no_expect_continue)
            if self.create_bucket:
                await self._create_bucket()
            await self._client.head_bucket(Bucket=self.bucket)
        except BaseException as exc:
            await stack.aclose()
            if isinstance(exc, ClientError | BotoCoreError):
                raise self._open_error(exc) from exc
            raise
        self._stack = stack
        await super().open()

    async def _create_bucket(self) -> None:
        try:
            await self._client.create_bucket(Bucket=self.bucket)
        except ClientError as exc:
            if exc.response["Error"]["Code"] not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise

    def _open_error(self, exc: Exception) -> OSError:
        where = f"s3 tier: bucket {self.bucket!r} at {self._endpoint_name()}"
        if isinstance(exc, NoCredentialsError):
            return PermissionError(errno.EACCES, f"{where}: no credentials in the AWS chain (environment, files, role)")
        if isinstance(exc, ClientError):
            code = str(exc.response.get("Error", {}).get("Code"))
            if code in ("404", "NoSuchBucket"):
                return FileNotFoundError(errno.ENOENT, f"{where} does not exist; create it or set create_bucket: true")
            if code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
                return PermissionError(errno.EACCES, f"{where}: access denied ({code}); check the credentials")
            return OSError(errno.EIO, f"{where}: {code}")
        if isinstance(exc, ParamValidationError):  # a request the client refused to send
            return OSError(errno.EINVAL, f"{where}: refused by the S3 client: {' '.join(str(exc).split())}")
        return ConnectionError(errno.ECONNREFUSED, f"{where}: cannot reach the endpoint ({type(exc).__name__}: {exc})")

    def _endpoint_name(self) -> str:
        """The endpoint in use, as the user gave it: the option, else the environment
        variable botocore reads, else AWS itself."""
        if self.endpoint_url:
            return self.endpoint_url
        for variable in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
            if os.environ.get(variable):
                return f"{os.environ[variable]} (from {variable})"
        return "AWS"

    async def close(self) -> None:
        await super().close()
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.aclose()

    async def put(self, key: OffloadKey, payload: memoryview) -> None:
        self.check_open()
        body = _PartsReader(list(encode_object(key, payload, self.fingerprint, seal=self.seal)))
        await self._client.put_object(Bucket=self.bucket, Key=self.object_name(key), Body=body, ContentLength=body.size)

    async def get(self, key: OffloadKey, into: memoryview) -> ObjectHeader:
        self.check_open()
        into = into.cast("B")
        try:
            response = await self._client.get_object(Bucket=self.bucket, Key=self.object_name(key))
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code"))
            if code in _NOT_FOUND:
                raise ObjectNotFoundError(key) from None
            if code in _UNUSABLE:
                raise UnusableObjectError(f"{self.object_name(key)}: {code} ({exc})") from None
            raise
        header_buf = memoryview(bytearray(header_size(len(key))))
        size = response["ContentLength"]
        async with response["Body"] as body:
            if size != header_buf.nbytes + into.nbytes:
                raise CorruptObjectError(
                    f"object of {size} bytes; a block of this layout takes {header_buf.nbytes + into.nbytes}"
                )
            received = 0
            async for chunk in body.iter_chunks(1 << 20):
                received += _scatter(chunk, received, (header_buf, into))
        if received < header_buf.nbytes:
            raise CorruptObjectError(f"object of {received} bytes, shorter than its header")
        header = parse_header(header_buf, self.fingerprint, key, self.seal)
        check_length(header, received - header.size, into.nbytes)
        return header

    async def exists(self, key: OffloadKey) -> bool:
        self.check_open()
        try:
            await self._client.head_object(Bucket=self.bucket, Key=self.object_name(key))
        except ClientError as exc:
            if str(exc.response.get("Error", {}).get("Code")) in _NOT_FOUND:
                return False
            raise
        return True

    async def delete_many(self, keys: Collection[OffloadKey]) -> None:
        self.check_open()
        names = [self.object_name(key) for key in keys]
        for start in range(0, len(names), _DELETE_BATCH):
            objects = [{"Key": name} for name in names[start : start + _DELETE_BATCH]]
            response = await self._client.delete_objects(Bucket=self.bucket, Delete={"Objects": objects, "Quiet": True})
            if response.get("Errors"):
                raise OSError(errno.EIO, f"s3 tier: {len(response['Errors'])} deletes failed: {response['Errors'][0]}")

    async def recover(self) -> list[tuple[OffloadKey, int]]:
        """Objects under the namespace, oldest first, from a paginated listing (headers are
        checked when a block is loaded, not here: that would be one GET per object)."""
        self.check_open()
        found = []
        paginator = self._client.get_paginator("list_objects_v2")
        pages = paginator.paginate(
            Bucket=self.bucket, Prefix=self._namespace, PaginationConfig={"PageSize": self._list_page_size}
        )
        progress = RecoveryProgress(f"s3 tier s3://{self.bucket}/{self._namespace}")
        async for page in pages:
            progress.add(len(page.get("Contents", ())))
            for obj in page.get("Contents", ()):
                try:
                    key = OffloadKey(bytes.fromhex(obj["Key"][len(self._namespace) :]))
                except ValueError:
                    continue  # not one of ours
                found.append((obj["LastModified"], key, obj["Size"]))
        found.sort(key=lambda item: item[0])
        return [(key, size) for _, key, size in found]

    async def ping(self) -> None:
        self.check_open()
        await self._client.head_bucket(Bucket=self.bucket)


def _no_expect_continue(request: Any, **_: Any) -> None:
    request.headers.pop("Expect", None)


def _scatter(chunk: bytes, offset: int, buffers: Sequence[memoryview]) -> int:
    """Copy `chunk`, which starts `offset` bytes into the stream, into the consecutive
    `buffers`; bytes past their end are dropped. Returns len(chunk)."""
    data, done = memoryview(chunk), 0
    for buffer, start, length in spans(buffers, offset, data.nbytes):
        buffer[start : start + length] = data[done : done + length]
        done += length
    return len(chunk)
