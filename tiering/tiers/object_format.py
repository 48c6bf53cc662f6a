"""The format of one stored block: a header, then the payload (the primary row's bytes, or
their ciphertext).

Header, little-endian, padded with zeros to `header_size` (a multiple of the store's
alignment: 64 bytes by default; the file store uses 4096 so that payloads stay aligned for
O_DIRECT). Version 5, a plain object::

    magic       4s   b"KVTB"
    version     H    5
    key_len     H    bytes of the key that follows the fixed part
    header_len  I    bytes of the whole padded header
    layout      16s  layout fingerprint (see `layout_fingerprint`)
    length      Q    payload bytes
    checksum    Q    XXH3-64 of the payload
    header_sum  Q    XXH3-64 of the header up to the key's end, this field zeroed
    key         key_len bytes

Version 6, a sealed object (`tiering.tiers.seal`), has ``checksum`` 0 and the seal before the
key::

    mode        B    1 signed, 2 encrypted (`SealMode`), then 3 zero bytes
    key_id      4s   id of the key that sealed it
    nonce       12s
    tag         16s  over the header up to the key's end (the tag and header_sum zeroed) and
                     the payload

What each check guarantees: the checksums find torn and corrupted bytes (a torn write, a
flipped bit, a payload of another block), not forged ones (anyone who can write the store can
compute them); the seal's MAC finds forged ones. XXH3-64 rather than a CRC: it runs at twice
CRC32C's speed here (52 against 26 GB/s on one core, 2 MiB buffers), and no part of the path
(a NIC, an object store) would check a CRC for us on the wire.

The header's own checksum lets a reader trust a header before it has the payload: a file tier's
segment recovery walks pages, and a page that merely looks like a header (a torn one, or a
payload's bytes) must never name a block. Versions 1 to 4 (CRC32C, and before 3 no header
check) are not read: an engine of this format has an identity of its own (`OBJECT_FORMAT`),
so their namespaces are other engines', listed and pruned as any older namespace.

A store writes what `encode_object` returns and checks the header and the payload's length
as it reads (`parse_header`, `check_length`), passing its tier's seal. The payload is checked
by `verify_payload` (checksum or signature) after every store layer, in `BlockStoreTier`, unless
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

import xxhash

from tiering.contract.keys import OffloadKey
from tiering.errors import CorruptObjectError, ForgedObjectError
from tiering.tiers.seal import TAG_BYTES, Seal, Sealed, SealMode

MAGIC = b"KVTB"
PLAIN, SEALED = 5, 6  # header versions
HEADER_ALIGN = 64
FINGERPRINT_BYTES = 16
MAX_KEY_BYTES = 1024
_FIXED = struct.Struct("<4sHHI16sQQQ")  # version 5: the fixed part, then the key
_SEALED = struct.Struct("<4sHHI16sQQQB3x4s12s16s")  # version 6: the fixed part, the seal, then the key
_HEADER_SUM_AT = _FIXED.size - 8
_TAG_AT = _SEALED.size - TAG_BYTES
_NO_TAG = bytes(TAG_BYTES)


def layout_fingerprint(description: str) -> bytes:
    """16 bytes naming a KV layout (model, block size, bytes per block, dtype, world size):
    objects are only ever read back by an engine of the same layout."""
    return hashlib.blake2b(description.encode(), digest_size=FINGERPRINT_BYTES).digest()


payload_checksum = xxhash.xxh3_64_intdigest
"""The XXH3-64 of a payload (any buffer), as an int. Any thread: it releases the GIL for
buffers over 64 KiB (`xxhash`'s own threshold), where the hash takes longer than handing the
GIL to another thread."""


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
    of its length). Without a seal the header carries the payload's XXH3-64; with one, the
    seal's tag (see `tiering.tiers.seal`).

    Raises:
        ValueError: the key is longer than `MAX_KEY_BYTES` or the fingerprint is not 16 bytes.
    """
    if len(key) > MAX_KEY_BYTES or len(fingerprint) != FINGERPRINT_BYTES:
        raise ValueError(f"key of {len(key)} bytes (max {MAX_KEY_BYTES}) or fingerprint of {len(fingerprint)} bytes")
    size = header_size(len(key), align)
    if seal is None:
        fixed = _FIXED.pack(MAGIC, PLAIN, len(key), size, fingerprint, payload.nbytes, payload_checksum(payload), 0)
        return _with_header_sum(fixed + key, size), payload
    nonce = seal.next_nonce()
    sealing = (seal.mode, seal.key_id, nonce, _NO_TAG)
    fixed = _SEALED.pack(MAGIC, SEALED, len(key), size, fingerprint, payload.nbytes, 0, 0, *sealing)
    body, tag = seal.close(nonce, fixed + key, payload)
    return _with_header_sum(fixed[:_TAG_AT] + tag + key, size), body


SEAL_KEY_ID_AT = _FIXED.size + 4
"""Where a sealed header's key id starts (after the fixed part and the seal's mode)."""


def restamp_header_sum(image: bytearray) -> None:
    """Put the right header checksum into the object `image` (whole, or its header) in place: what
    someone who edits a stored object and knows this format does (the conformance suite's
    forgeries), so that only the seal stands in the way.

    Raises:
        struct.error: `image` is shorter than a header's fixed part.
    """
    _, version, key_len = struct.unpack_from("<4sHH", image)
    end = (_FIXED.size if version == PLAIN else _SEALED.size) + key_len
    header = bytearray(image[:end])
    header[_HEADER_SUM_AT : _HEADER_SUM_AT + 8] = bytes(8)
    image[:end] = _with_header_sum(bytes(header), end)


def _with_header_sum(header: bytes, size: int) -> bytes:
    """`header` (up to the key's end, its header_sum zeroed) with its XXH3-64 in place,
    padded with zeros to `size`."""
    digest = payload_checksum(header).to_bytes(8, "little")
    return (header[:_HEADER_SUM_AT] + digest + header[_HEADER_SUM_AT + 8 :]).ljust(size, b"\0")


class ObjectHeader(NamedTuple):  # a tuple: built once per block read, it must be cheap
    key: OffloadKey
    payload_len: int
    checksum: int
    """The payload's XXH3-64 (0 for a sealed object)."""
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
            them), the header's own checksum, layout or key differ.
        ForgedObjectError: a plain object and `seal` is given; a sealed one and it is not,
            or sealed by a key that is not `seal`'s.
    """
    if len(buf) < _FIXED.size:
        raise CorruptObjectError(f"header of {len(buf)} bytes is truncated")
    magic, version, key_len, size, layout, length, checksum, header_sum = _FIXED.unpack_from(buf)
    fixed = _FIXED.size if version == PLAIN else _SEALED.size
    if magic != MAGIC or version not in (PLAIN, SEALED):
        raise CorruptObjectError(f"bad magic {bytes(magic)!r} or version {version}")
    if size < fixed + key_len or size % HEADER_ALIGN or len(buf) < fixed + key_len:
        raise CorruptObjectError(f"header length {size} is impossible for a key of {key_len} bytes")
    unchecked = bytearray(buf[: fixed + key_len])
    unchecked[_HEADER_SUM_AT : _HEADER_SUM_AT + 8] = bytes(8)
    if payload_checksum(unchecked) != header_sum:
        raise CorruptObjectError("header checksum (XXH3-64) mismatch")
    if layout != fingerprint:
        raise CorruptObjectError("object of a foreign layout")
    stored_key = OffloadKey(bytes(buf[fixed : fixed + key_len]))
    if key is not None and stored_key != key:
        raise CorruptObjectError("object holds another key")
    if version == PLAIN:
        if seal is not None:
            raise ForgedObjectError(f"block {stored_key.hex()}: not sealed; this tier loads only sealed objects")
        return ObjectHeader(stored_key, length, checksum, size)
    mode, key_id, nonce, tag = _SEALED.unpack_from(buf)[8:]
    if mode not in (SealMode.SIGNED, SealMode.ENCRYPTED):
        raise CorruptObjectError(f"unknown seal mode {mode}")
    if seal is None:
        raise ForgedObjectError(f"block {stored_key.hex()}: sealed, and this tier has no integrity keys")
    if not seal.knows(key_id):
        raise ForgedObjectError(f"block {stored_key.hex()}: sealed by key id {key_id.hex()}, not one of this tier's")
    covered = bytes(unchecked[:_TAG_AT]) + _NO_TAG + stored_key
    return ObjectHeader(stored_key, length, checksum, size, Sealed(SealMode(mode), key_id, nonce, tag, covered))


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
    """Check the payload read into `payload` against the header: its length, then the XXH3-64
    of a plain object or the signature of a signed one (`seal`: the reading tier's). An
    encrypted payload passes here: it is checked as it is decrypted (`open_payload`).

    Raises:
        CorruptObjectError: the length or the checksum differs.
        ForgedObjectError: the signature does not match, or the header's seal is not one
            `seal` opens.
    """
    check_length(header, payload.nbytes, payload.nbytes)
    sealed = header.sealed
    if sealed is None:
        if seal is not None:
            raise ForgedObjectError(f"block {header.key.hex()}: not sealed; this tier loads only sealed objects")
        if payload_checksum(payload) != header.checksum:
            raise CorruptObjectError("payload checksum (XXH3-64) mismatch")
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
