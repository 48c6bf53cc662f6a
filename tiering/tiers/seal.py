"""Signed and encrypted blocks: a tier's secret keys, and the seal they put on its objects.

A shared tier (a bucket, a directory, a cache cluster) takes objects from everyone with write
access, and block keys are predictable (hashes of token ids): a checksum proves that bytes are
intact, not who wrote them. A tier configured with `integrity` keys seals every object it
writes and loads only objects sealed by one of its keys; anything else is a miss
(`ForgedObjectError`), never loaded and never deleted.

Keys: 256-bit secrets, each written as 64 hex digits or as base64 (44 characters), separated
by whitespace or commas, from an environment variable (``keys_env``) or a file
(``keys_file``; ``#`` starts a comment). The first key seals; every key opens, so keys
rotate without a flag day: add the new key second, roll out, move it first, roll out, drop
the old one.

The seal is AES-256-GCM (`cryptography`) under a 96-bit nonce made of 8 random bytes, drawn
when the `Seal` is built, and a 32-bit counter (the deterministic construction of NIST
SP 800-38D, 8.2.1: within one seal no nonce repeats; a new random part is drawn when the
counter wraps). What it covers is the object's header up to its key (layout fingerprint,
block key, payload length, mode, key id and nonce: everything but the tag) and the payload:

- ``signed``: the payload is stored as it is; the tag is GCM's over the header (as the
  plaintext, whose ciphertext is dropped) with the payload as associated data, so a GMAC
  over both. It costs about twice what the XXH3-64 checksum it replaces costs.
- ``encrypted``: the payload is stored encrypted, the header is the associated data.

The header carries the mode, a 4-byte key id (HMAC-SHA256 of a fixed label under the key:
which key to open with, without revealing it), the nonce and the 16-byte tag.

Secrets: key bytes live only inside `cryptography`'s cipher objects and for the moment
they are parsed; no repr, log line, stat, metric or error shows them.

Thread: any; one `Seal` seals and opens from many store threads at once.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import itertools
import os
import re
import threading
from collections.abc import Sequence
from enum import IntEnum
from pathlib import Path
from typing import NamedTuple

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from pydantic import BaseModel, model_validator

from tiering.errors import ForgedObjectError
from tiering.options import STRICT

KEY_BYTES = 32
KEY_ID_BYTES = 4
NONCE_BYTES = 12
TAG_BYTES = 16
_COUNTER_LIMIT = 1 << 32
_KEY_ID_LABEL = b"kv-tiering key id"
_SEPARATORS = re.compile(r"[\s,]+")


class SealMode(IntEnum):
    """How an object is sealed, as its header says."""

    PLAIN = 0
    """Not sealed: an XXH3-64 checksum guards the payload."""
    SIGNED = 1
    """The payload as it is, a tag over the header and the payload."""
    ENCRYPTED = 2
    """The payload encrypted, the tag over the header and the ciphertext."""


class Sealed(NamedTuple):
    """What a sealed object's header says about its seal."""

    mode: SealMode
    key_id: bytes
    nonce: bytes
    tag: bytes
    covered: bytes
    """The header's bytes up to the key's end, the tag zeroed: what the tag covers."""


class Integrity(BaseModel):
    """The ``integrity`` key of a tier: where its secret keys come from (exactly one of
    `keys_env` and `keys_file`). The keys are read and checked when the config is loaded,
    and again when the tier is built; the config keeps only where they are."""

    model_config = STRICT

    keys_env: str | None = None
    keys_file: Path | None = None

    @model_validator(mode="after")
    def _keys_readable(self) -> Integrity:
        if (self.keys_env is None) == (self.keys_file is None):
            raise ValueError("set keys_env (an environment variable) or keys_file (a path), exactly one")
        read_keys(self)
        return self

    def where(self) -> str:
        """The key source, as an error message names it."""
        return f"keys_env {self.keys_env}" if self.keys_env is not None else f"keys_file {self.keys_file}"


def read_keys(source: Integrity) -> list[bytes]:
    """The secret keys of `source`, in order (the first seals).

    Raises:
        ValueError: the variable is unset, the file unreadable, there is no key, a key is not
            32 bytes of hex or base64, or a key is given twice; the message names the
            source and the key's position, never its bytes.
    """
    if source.keys_env is not None:
        text = os.environ.get(source.keys_env)
        if text is None:
            raise ValueError(f"keys_env: the environment variable {source.keys_env} is not set")
    else:
        try:
            text = Path(os.path.expanduser(str(source.keys_file))).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise ValueError(f"keys_file: cannot read {source.keys_file} ({reason})") from None
        text = "\n".join(line.partition("#")[0] for line in text.splitlines())
    words = [word for word in _SEPARATORS.split(text) if word]
    if not words:
        raise ValueError(f"{source.where()} holds no key; expected 32-byte keys as hex or base64")
    keys = [_decode_key(word, position, source) for position, word in enumerate(words, 1)]
    if len({key_id(key) for key in keys}) != len(keys):
        raise ValueError(f"{source.where()} holds the same key twice")
    return keys


def _decode_key(word: str, position: int, source: Integrity) -> bytes:
    try:
        key = bytes.fromhex(word) if len(word) == 2 * KEY_BYTES else base64.b64decode(word, validate=True)
    except (ValueError, binascii.Error):
        key = b""
    if len(key) != KEY_BYTES:
        raise ValueError(
            f"{source.where()}: key {position} is not {KEY_BYTES} bytes as 64 hex digits or base64 "
            f"(make one with: python -c 'import secrets; print(secrets.token_hex(32))')"
        )
    return key


def key_id(key: bytes) -> bytes:
    """The 4-byte id of a secret key that object headers carry (reveals nothing of it)."""
    return hmac.new(key, _KEY_ID_LABEL, hashlib.sha256).digest()[:KEY_ID_BYTES]


class Seal:
    """Seals objects with the first of a tier's keys and opens those of any of them.

    Args:
        keys: 32-byte secret keys, the sealing one first (see `read_keys`).
        encrypt: True to encrypt payloads, False to sign them.

    Raises:
        ValueError: no key, or one that is not 32 bytes.
    """

    def __init__(self, keys: Sequence[bytes], encrypt: bool = False):
        if not keys or any(len(key) != KEY_BYTES for key in keys):
            raise ValueError(f"expected one or more keys of {KEY_BYTES} bytes")
        self.mode = SealMode.ENCRYPTED if encrypt else SealMode.SIGNED
        self._ciphers = {key_id(key): AESGCM(key) for key in keys}
        self.key_id = key_id(keys[0])
        self._sealer = self._ciphers[self.key_id]
        self._lock = threading.Lock()
        self._nonce_prefix, self._counter = os.urandom(NONCE_BYTES - 4), itertools.count()

    @classmethod
    def from_config(cls, integrity: Integrity, encryption: str | None) -> Seal:
        """The seal of a tier's ``integrity`` and ``encryption`` keys.

        Raises:
            ValueError: as `read_keys`.
        """
        return cls(read_keys(integrity), encrypt=encryption is not None)

    def __repr__(self) -> str:
        return f"Seal({self.mode.name.lower()}, {len(self._ciphers)} keys, sealing with key id {self.key_id.hex()})"

    def knows(self, sealed_by: bytes) -> bool:
        """Whether `sealed_by` (a header's key id) is the id of one of this seal's keys."""
        return sealed_by in self._ciphers

    def next_nonce(self) -> bytes:
        """A nonce never used before by this seal (12 bytes)."""
        with self._lock:
            count = next(self._counter)
            if count >= _COUNTER_LIMIT:
                self._nonce_prefix, self._counter = os.urandom(NONCE_BYTES - 4), itertools.count(1)
                count = 0
        return self._nonce_prefix + count.to_bytes(4, "little")

    def close(self, nonce: bytes, header: bytes | bytearray, payload: memoryview) -> tuple[memoryview, bytes]:
        """Seal `payload` under `header` (its bytes up to the key, the tag zeroed) with the
        sealing key: (the payload to store, the 16-byte tag). Signing stores `payload` as it
        is; encrypting stores a new buffer of its length."""
        if self.mode is SealMode.SIGNED:
            return payload, self._sealer.encrypt(nonce, bytes(header), payload)[-TAG_BYTES:]
        sealed = bytearray(payload.nbytes + TAG_BYTES)
        self._sealer.encrypt_into(nonce, payload, bytes(header), sealed)
        return memoryview(sealed)[: payload.nbytes], bytes(sealed[payload.nbytes :])

    def open(self, sealed: Sealed, payload: memoryview) -> None:
        """Check the tag of an object sealed as `sealed` says, and decrypt an encrypted
        payload in place.

        Raises:
            ForgedObjectError: the key is not one of this seal's, or the tag does not match
                (`payload` then holds garbage).
        """
        cipher = self._ciphers.get(sealed.key_id)
        if cipher is None:
            raise ForgedObjectError(f"sealed by key id {sealed.key_id.hex()}, not one of this tier's keys")
        if sealed.mode is SealMode.SIGNED:
            expected = cipher.encrypt(sealed.nonce, sealed.covered, payload)[-TAG_BYTES:]
            if not hmac.compare_digest(expected, sealed.tag):
                raise ForgedObjectError("its signature does not match")
            return
        stored = _scratch(payload.nbytes + TAG_BYTES)
        stored[: payload.nbytes] = payload
        stored[payload.nbytes :] = sealed.tag
        try:
            cipher.decrypt_into(sealed.nonce, stored, sealed.covered, payload)
        except InvalidTag:
            raise ForgedObjectError("it does not decrypt under its tag") from None


_thread_local = threading.local()


def _scratch(size: int) -> memoryview:
    """A buffer of `size` bytes private to this thread, reused by its next call."""
    buf = getattr(_thread_local, "buf", None)
    if buf is None or len(buf) < size:
        buf = _thread_local.buf = bytearray(size)
    return memoryview(buf)[:size]
