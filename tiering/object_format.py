"""The format of one stored block: a header, then the payload (the primary row's bytes).

Header, little-endian, padded with zeros to a multiple of the store's alignment (64 bytes
by default; the file store uses 4096 so that payloads stay aligned for O_DIRECT)::

    magic       4s   b"KVTB"
    version     H    1
    key_len     H    bytes of the key that follows the fixed part
    header_len  I    bytes of the whole padded header
    layout      16s  layout fingerprint (see `layout_fingerprint`)
    length      Q    payload bytes
    crc         I    CRC32C of the payload
    key         key_len bytes

A store checks the header and the payload's length as it reads (`parse_header`,
`check_length`); the CRC is checked by `verify_payload` after every store layer (in
`BlockStoreTier`), so a corruption anywhere below it is caught before the payload counts
as loaded. A store that checks it itself as it reads (`BlockStore.verifies_payloads`, the
file tier) spares the adapter that second pass over the bytes.

Thread: any; pure functions (the stores call them on the loop or in their pool threads).
"""

from __future__ import annotations

import hashlib
import struct
from typing import NamedTuple

import crc32c

from tiering.errors import CorruptObjectError
from tiering.keys import OffloadKey

MAGIC = b"KVTB"
VERSION = 1
HEADER_ALIGN = 64
FINGERPRINT_BYTES = 16
MAX_KEY_BYTES = 1024
_FIXED = struct.Struct("<4sHHI16sQI")


def layout_fingerprint(description: str) -> bytes:
    """16 bytes naming a KV layout (model, block size, bytes per block, dtype, world size):
    objects are only ever read back by an engine of the same layout."""
    return hashlib.blake2b(description.encode(), digest_size=FINGERPRINT_BYTES).digest()


def header_size(key_len: int, align: int = HEADER_ALIGN) -> int:
    """Bytes of the header for a key of `key_len` bytes, padded to a multiple of `align`."""
    return -(-(_FIXED.size + key_len) // align) * align


def object_size(key_len: int, payload_len: int, align: int = HEADER_ALIGN) -> int:
    """Bytes of a whole stored object."""
    return header_size(key_len, align) + payload_len


def encode_header(key: OffloadKey, payload: memoryview, fingerprint: bytes, align: int = HEADER_ALIGN) -> bytes:
    """The header for `payload` stored under `key`, padded to a multiple of `align` bytes
    (computes the payload's CRC32C).

    Raises:
        ValueError: the key is longer than `MAX_KEY_BYTES` or the fingerprint is not 16 bytes.
    """
    if len(key) > MAX_KEY_BYTES or len(fingerprint) != FINGERPRINT_BYTES:
        raise ValueError(f"key of {len(key)} bytes (max {MAX_KEY_BYTES}) or fingerprint of {len(fingerprint)} bytes")
    size = header_size(len(key), align)
    fixed = _FIXED.pack(MAGIC, VERSION, len(key), size, fingerprint, payload.nbytes, crc32c.crc32c(payload))
    return (fixed + key).ljust(size, b"\0")


class ObjectHeader(NamedTuple):  # a tuple: built once per block read, it must be cheap
    key: OffloadKey
    payload_len: int
    crc: int
    size: int
    """Bytes of the header itself."""


def parse_header(
    buf: bytes | bytearray | memoryview, fingerprint: bytes, key: OffloadKey | None = None
) -> ObjectHeader:
    """Read and check a header; `key`, when given, must be the stored key.

    Raises:
        CorruptObjectError: the buffer is short, or magic, version, layout or key differ.
    """
    if len(buf) < _FIXED.size:
        raise CorruptObjectError(f"header of {len(buf)} bytes is truncated")
    magic, version, key_len, size, layout, length, crc = _FIXED.unpack_from(buf)
    if magic != MAGIC or version != VERSION:
        raise CorruptObjectError(f"bad magic {bytes(magic)!r} or version {version}")
    if size < _FIXED.size + key_len or size % HEADER_ALIGN:
        raise CorruptObjectError(f"header length {size} is impossible for a key of {key_len} bytes")
    if layout != fingerprint:
        raise CorruptObjectError("object of a foreign layout")
    stored_key = OffloadKey(bytes(buf[_FIXED.size : _FIXED.size + key_len]))
    if len(stored_key) != key_len or (key is not None and stored_key != key):
        raise CorruptObjectError("object holds another key")
    return ObjectHeader(stored_key, length, crc, size)


def check_length(header: ObjectHeader, received: int, expected: int) -> None:
    """A store's check that it read the whole payload the header announces, and that it fits
    the buffer of `expected` bytes.

    Raises:
        CorruptObjectError: a short or long payload.
    """
    if received != header.payload_len or expected != header.payload_len:
        raise CorruptObjectError(
            f"payload of {received} bytes; the header says {header.payload_len}, the row holds {expected}"
        )


def verify_payload(header: ObjectHeader, payload: memoryview) -> None:
    """Check the payload read into `payload` against the header's length and CRC32C.

    Raises:
        CorruptObjectError: the length or the CRC differs.
    """
    check_length(header, payload.nbytes, payload.nbytes)
    if crc32c.crc32c(payload) != header.crc:
        raise CorruptObjectError("payload CRC32C mismatch")
