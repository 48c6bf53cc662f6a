"""The format of one stored block: a header, then the payload (the primary row's bytes, or
their ciphertext).

Header, little-endian, padded with zeros to `header_size` (a multiple of the store's
alignment: 64 bytes by default; the file store uses 4096 so that payloads stay aligned for
O_DIRECT). Version 3, a plain object::

    magic       4s   b"KVTB"
    version     H    3
    key_len     H    bytes of the key that follows the fixed part
    header_len  I    bytes of the whole padded header
    layout      16s  layout fingerprint (see `layout_fingerprint`)
    length      Q    payload bytes
    crc         I    CRC32C of the payload
    header_crc  I    CRC32C of the header up to the key's end, this field zeroed
    key         key_len bytes

Version 4, a sealed object (`tiering.tiers.seal`), has ``crc`` 0 and the seal before the key::

    mode        B    1 signed, 2 encrypted (`SealMode`), then 3 zero bytes
    key_id      4s   id of the key that sealed it
    nonce       12s
    tag         16s  over the header up to the key's end (the tag and header_crc zeroed) and
                     the payload

The header's own CRC lets a reader trust a header before it has the payload: a file tier's
segment recovery walks pages, and a page that merely looks like a header (a torn one, or a
payload's bytes) must never name a block. Versions 1 and 2 (no header CRC) are not read: an
engine of this format has an identity of its own (`OBJECT_FORMAT`), so their namespaces are
other engines'.

A store writes what `encode_object` returns and checks the header and the payload's length
as it reads (`parse_header`, `check_length`), passing its tier's seal. The payload is checked
by `verify_payload` (CRC or signature) after every store layer, in `BlockStoreTier`, unless
the store checks it itself as it reads (`BlockStore.verifies_payloads`, the file tier); an
encrypted payload is checked as it is decrypted, once, by the tier (`open_payload`).

A tier with a seal loads only objects sealed by its keys, and a tier without one only plain
objects: either way anything else raises `ForgedObjectError`.

Thread: any; pure functions (the stores call them on the loop or in their pool threads).
"""

from __future__ import annotations

import hashlib
import struct
from typing import NamedTuple

import crc32c

from tiering.contract.keys import OffloadKey
from tiering.errors import CorruptObjectError, ForgedObjectError
from tiering.tiers.seal import TAG_BYTES, Seal, Sealed, SealMode

MAGIC = b"KVTB"
PLAIN, SEALED = 3, 4  # header versions
HEADER_ALIGN = 64
FINGERPRINT_BYTES = 16
MAX_KEY_BYTES = 1024
_FIXED = struct.Struct("<4sHHI16sQII")  # version 3: the fixed part, then the key
_SEALED = struct.Struct("<4sHHI16sQIIB3x4s12s16s")  # version 4: the fixed part, the seal, then the key
_HEADER_CRC_AT = _FIXED.size - 4
_TAG_AT = _SEALED.size - TAG_BYTES
_NO_TAG = bytes(TAG_BYTES)
CRC_RELEASES_GIL_FROM = 256 << 10
"""A payload of this many bytes or more has its CRC32C computed with the GIL released (the
`crc32c` package's own default releases it from 32 KiB). Below it the CRC takes a few
microseconds, less than handing the GIL to another thread and waiting to get it back (the
measurements: docs/results.md, "The measurements behind the constants")."""


def layout_fingerprint(description: str) -> bytes:
    """16 bytes naming a KV layout (model, block size, bytes per block, dtype, world size):
    objects are only ever read back by an engine of the same layout."""
    return hashlib.blake2b(description.encode(), digest_size=FINGERPRINT_BYTES).digest()


def payload_crc(payload: memoryview) -> int:
    """The CRC32C of `payload` (any thread; see `CRC_RELEASES_GIL_FROM`)."""
    return crc32c.crc32c(payload, 0, 1 if payload.nbytes >= CRC_RELEASES_GIL_FROM else 0)


def header_size(key_len: int, align: int = HEADER_ALIGN) -> int:
    """Bytes of the header for a key of `key_len` bytes, padded to a multiple of `align`
    (the same whether the object is sealed or not)."""
    return -(-(_SEALED.size + key_len) // align) * align


def object_size(key_len: int, payload_len: int, align: int = HEADER_ALIGN) -> int:
    """Bytes of a whole stored object."""
    return header_size(key_len, align) + payload_len


def encode_object(
    key: OffloadKey, payload: memoryview, fingerprint: bytes, align: int = HEADER_ALIGN, seal: Seal | None = None
) -> tuple[bytes, memoryview]:
    """(header, payload to store) of an object for `payload` under `key`: the header padded
    to `header_size`, the payload `payload` itself unless `seal` encrypts (then a new buffer
    of its length). Without a seal the header carries the payload's CRC32C; with one, the
    seal's tag (see `tiering.tiers.seal`).

    Raises:
        ValueError: the key is longer than `MAX_KEY_BYTES` or the fingerprint is not 16 bytes.
    """
    if len(key) > MAX_KEY_BYTES or len(fingerprint) != FINGERPRINT_BYTES:
        raise ValueError(f"key of {len(key)} bytes (max {MAX_KEY_BYTES}) or fingerprint of {len(fingerprint)} bytes")
    size = header_size(len(key), align)
    if seal is None:
        fixed = _FIXED.pack(MAGIC, PLAIN, len(key), size, fingerprint, payload.nbytes, payload_crc(payload), 0)
        return _with_header_crc(fixed + key, size), payload
    nonce = seal.next_nonce()
    sealing = (seal.mode, seal.key_id, nonce, _NO_TAG)
    fixed = _SEALED.pack(MAGIC, SEALED, len(key), size, fingerprint, payload.nbytes, 0, 0, *sealing)
    body, tag = seal.close(nonce, fixed + key, payload)
    return _with_header_crc(fixed[:_TAG_AT] + tag + key, size), body


SEAL_KEY_ID_AT = _FIXED.size + 4
"""Where a sealed header's key id starts (after the fixed part and the seal's mode)."""


def restamp_header_crc(image: bytearray) -> None:
    """Put the right header CRC into the object `image` (whole, or its header) in place: what
    someone who edits a stored object and knows this format does (the conformance suite's
    forgeries), so that only the seal stands in the way.

    Raises:
        struct.error: `image` is shorter than a header's fixed part.
    """
    _, version, key_len = struct.unpack_from("<4sHH", image)
    end = (_FIXED.size if version == PLAIN else _SEALED.size) + key_len
    header = bytearray(image[:end])
    header[_HEADER_CRC_AT : _HEADER_CRC_AT + 4] = bytes(4)
    image[:end] = _with_header_crc(bytes(header), end)


def _with_header_crc(header: bytes, size: int) -> bytes:
    """`header` (up to the key's end, its header_crc zeroed) with its CRC32C in place, padded
    with zeros to `size`."""
    crc = crc32c.crc32c(header).to_bytes(4, "little")
    return (header[:_HEADER_CRC_AT] + crc + header[_HEADER_CRC_AT + 4 :]).ljust(size, b"\0")


class ObjectHeader(NamedTuple):  # a tuple: built once per block read, it must be cheap
    key: OffloadKey
    payload_len: int
    crc: int
    size: int
    """Bytes of the header itself."""
    sealed: Sealed | None = None
    """The seal, or None for a plain object."""

    @property
    def encrypted(self) -> bool:
        """Whether the payload is stored encrypted (`open_payload` decrypts it)."""
        return self.sealed is not None and self.sealed.mode is SealMode.ENCRYPTED


def parse_header(
    buf: bytes | bytearray | memoryview, fingerprint: bytes, key: OffloadKey | None = None, seal: Seal | None = None
) -> ObjectHeader:
    """Read and check a header; `key`, when given, must be the stored key; `seal`: the
    reading tier's, or None for a tier without keys.

    Raises:
        CorruptObjectError: the buffer is short, or magic, version (an older format among
            them), the header's own CRC, layout or key differ.
        ForgedObjectError: a plain object and `seal` is given; a sealed one and it is not,
            or sealed by a key that is not `seal`'s.
    """
    if len(buf) < _FIXED.size:
        raise CorruptObjectError(f"header of {len(buf)} bytes is truncated")
    magic, version, key_len, size, layout, length, crc, header_crc = _FIXED.unpack_from(buf)
    fixed = _FIXED.size if version == PLAIN else _SEALED.size
    if magic != MAGIC or version not in (PLAIN, SEALED):
        raise CorruptObjectError(f"bad magic {bytes(magic)!r} or version {version}")
    if size < fixed + key_len or size % HEADER_ALIGN or len(buf) < fixed + key_len:
        raise CorruptObjectError(f"header length {size} is impossible for a key of {key_len} bytes")
    unchecked = bytearray(buf[: fixed + key_len])
    unchecked[_HEADER_CRC_AT : _HEADER_CRC_AT + 4] = bytes(4)
    if crc32c.crc32c(unchecked) != header_crc:
        raise CorruptObjectError("header CRC32C mismatch")
    if layout != fingerprint:
        raise CorruptObjectError("object of a foreign layout")
    stored_key = OffloadKey(bytes(buf[fixed : fixed + key_len]))
    if key is not None and stored_key != key:
        raise CorruptObjectError("object holds another key")
    if version == PLAIN:
        if seal is not None:
            raise ForgedObjectError(f"block {stored_key.hex()}: not sealed; this tier loads only sealed objects")
        return ObjectHeader(stored_key, length, crc, size)
    mode, key_id, nonce, tag = _SEALED.unpack_from(buf)[8:]
    if mode not in (SealMode.SIGNED, SealMode.ENCRYPTED):
        raise CorruptObjectError(f"unknown seal mode {mode}")
    if seal is None:
        raise ForgedObjectError(f"block {stored_key.hex()}: sealed, and this tier has no integrity keys")
    if not seal.knows(key_id):
        raise ForgedObjectError(f"block {stored_key.hex()}: sealed by key id {key_id.hex()}, not one of this tier's")
    covered = bytes(unchecked[:_TAG_AT]) + _NO_TAG + stored_key
    return ObjectHeader(stored_key, length, crc, size, Sealed(SealMode(mode), key_id, nonce, tag, covered))


def announced(buf: bytes | bytearray | memoryview) -> tuple[OffloadKey, int]:
    """(key, payload bytes) a header announces, once `parse_header` parsed it or found it
    forged: a store that lists objects it keeps but cannot open (another deployment's) needs
    their extent."""
    _, version, key_len, _, _, length, _, _ = _FIXED.unpack_from(buf)
    fixed = _FIXED.size if version == PLAIN else _SEALED.size
    return OffloadKey(bytes(buf[fixed : fixed + key_len])), length


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


def verify_payload(header: ObjectHeader, payload: memoryview, seal: Seal | None = None) -> None:
    """Check the payload read into `payload` against the header: its length, then the CRC32C
    of a plain object or the signature of a signed one (`seal`: the reading tier's). An
    encrypted payload passes here: it is checked as it is decrypted (`open_payload`).

    Raises:
        CorruptObjectError: the length or the CRC differs.
        ForgedObjectError: the signature does not match, or the header's seal is not one
            `seal` opens.
    """
    check_length(header, payload.nbytes, payload.nbytes)
    sealed = header.sealed
    if sealed is None:
        if seal is not None:
            raise ForgedObjectError(f"block {header.key.hex()}: not sealed; this tier loads only sealed objects")
        if payload_crc(payload) != header.crc:
            raise CorruptObjectError("payload CRC32C mismatch")
    elif sealed.mode is SealMode.SIGNED:
        _open(header, sealed, payload, seal)


def open_payload(header: ObjectHeader, payload: memoryview, seal: Seal | None) -> None:
    """`verify_payload`, and for an encrypted object the check of its tag and the decryption
    of `payload` in place. Called once per block read, above every store layer.

    Raises:
        CorruptObjectError, ForgedObjectError: as `verify_payload`; also an encrypted payload
            whose tag does not match (`payload` then holds garbage).
    """
    verify_payload(header, payload, seal)
    if header.sealed is not None and header.encrypted:
        _open(header, header.sealed, payload, seal)


def _open(header: ObjectHeader, sealed: Sealed, payload: memoryview, seal: Seal | None) -> None:
    if seal is None:
        raise ForgedObjectError(f"block {header.key.hex()}: sealed, and this tier has no integrity keys")
    try:
        seal.open(sealed, payload.cast("B"))
    except ForgedObjectError as exc:
        raise ForgedObjectError(f"block {header.key.hex()}: {exc}") from None


def open_payloads(checks: list[tuple[ObjectHeader, memoryview]], seal: Seal | None) -> list[CorruptObjectError | None]:
    """`open_payload` of each (header, payload read into): None, or the error it raised."""
    outcomes: list[CorruptObjectError | None] = []
    for header, row in checks:
        try:
            open_payload(header, row, seal)
            outcomes.append(None)
        except CorruptObjectError as exc:
            outcomes.append(exc)
    return outcomes
