"""Signed and encrypted blocks in shared tiers: keys from the config, plants never loaded,
secrets never shown."""

import base64
import logging
import re
import secrets
import struct
import time

import numpy as np
import pytest
import xxhash

from tests.helpers import CTX, ROW, block_bytes, keys, metrics_text
from tests.test_identity import IdentitySpec, identity
from tiering import ConfigError, CorruptObjectError, ForgedObjectError
from tiering.config import parse_config
from tiering.testing.block_store import FINGERPRINT
from tiering.tiers.object_format import encode_object, parse_header, verify_payload
from tiering.tiers.seal import Integrity, Seal, Sealed, read_keys

KEYS_ENV = "KV_TIERING_TEST_KEYS"


@pytest.fixture
def keys_a(monkeypatch):
    """The first deployment's key, hex, in `KEYS_ENV`."""
    key = secrets.token_hex(32)
    monkeypatch.setenv(KEYS_ENV, key)
    return key


def planted(engine, ids, fill: int):
    """Store blocks `ids` from `engine` with rows of `fill` bytes (what a planter writes)."""
    out = engine.manager.prepare_store(keys(*ids), CTX)
    for row in out.store_spec.block_ids:
        engine.rows[row].view(np.uint8)[:] = fill
    engine.manager.complete_store(out.keys_to_store, CTX)
    engine.settle()


def file_config(root, **extra):
    shared = {"layout": "files", "probe_misses": True, "negative_ttl_s": 60}  # engines share the directory
    return {"type": "file", "root_dir": str(root), **shared, **extra}


def s3_config(server, bucket, **extra):
    return {"type": "s3", "bucket": bucket, "endpoint_url": server.endpoint_url, "probe_misses": True, **extra}


# -- keys ---------------------------------------------------------------------------------


def test_keys_come_as_hex_or_base64_separated_by_spaces_commas_or_lines(tmp_path, monkeypatch):
    a, b, c = (secrets.token_bytes(32) for _ in range(3))
    monkeypatch.setenv(KEYS_ENV, f"{a.hex()}, {base64.b64encode(b).decode()}")
    assert read_keys(Integrity(keys_env=KEYS_ENV)) == [a, b]
    path = tmp_path / "keys"
    path.write_text(f"# rotated 2026-11\n{c.hex()}  # new\n{a.hex()}\n")
    assert read_keys(Integrity(keys_file=path)) == [c, a]


BAD_KEYS = [
    ({}, "set keys_env (an environment variable) or keys_file (a path), exactly one"),
    ({"keys_env": "KV_TIERING_NO_SUCH_VARIABLE"}, "the environment variable KV_TIERING_NO_SUCH_VARIABLE is not set"),
    ({"keys_env": KEYS_ENV, "value": "   "}, f"keys_env {KEYS_ENV} holds no key"),
    ({"keys_env": KEYS_ENV, "value": "abcd" * 16 + " 1234"}, f"keys_env {KEYS_ENV}: key 2 is not 32 bytes"),
    ({"keys_env": KEYS_ENV, "value": "zz" * 32}, "key 1 is not 32 bytes as 64 hex digits or base64"),
    ({"keys_env": KEYS_ENV, "value": ("ab" * 32 + " ") * 2}, "holds the same key twice"),
    ({"keys_file": "/no/such/keys"}, "keys_file: cannot read /no/such/keys (No such file or directory)"),
]


@pytest.mark.parametrize(("given", "message"), BAD_KEYS, ids=[message[:40] for _, message in BAD_KEYS])
def test_bad_keys_fail_the_config_at_load_naming_the_key_path_and_never_the_secret(monkeypatch, given, message):
    given = dict(given)
    if "value" in given:
        monkeypatch.setenv(KEYS_ENV, given.pop("value"))
    source = ", ".join(f"{k}: {v}" for k, v in given.items())
    tier = f"{{type: file, root_dir: /x, integrity: {{{source}}}}}"
    with pytest.raises(ConfigError) as caught:
        parse_config(f"cpu_bytes_to_use: 1GiB\nsecondary_tiers: [{tier}]")
    assert "secondary_tiers[0].integrity" in str(caught.value) and message in str(caught.value)
    assert "abcd" not in str(caught.value) and "zz" * 4 not in str(caught.value)


@pytest.mark.parametrize(
    ("tier", "message"),
    [
        ("{type: file, root_dir: /x, encryption: aes-256-gcm}", "encryption needs keys: set integrity"),
        (
            "{type: file, root_dir: /x, integrity: {keys_env: " + KEYS_ENV + "}, encryption: aes-128-cbc}",
            "secondary_tiers[0].encryption: Input should be 'aes-256-gcm'",
        ),
        (
            "{type: faulty, inner: {type: example}, integrity: {keys_env: " + KEYS_ENV + "}}",
            "inner: type: is not a block store",
        ),
    ],
)
def test_encryption_needs_keys_and_a_store_that_seals(keys_a, tier, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(f"cpu_bytes_to_use: 1GiB\nsecondary_tiers: [{tier}]")


def test_a_store_that_does_not_declare_sealing_refuses_integrity(keys_a, tmp_path):
    from tiering import BlockStore
    from tiering.options import validate_options
    from tiering.tiers.factory import tier_options

    class Unsealed(BlockStore):  # a third party's store that never passes its seal on
        put = get = exists = delete_many = recover = None  # type: ignore[assignment]

    Unsealed.__abstractmethods__ = frozenset()
    with pytest.raises(ConfigError, match="integrity: Unsealed cannot seal its objects"):
        validate_options(tier_options(Unsealed), {"integrity": {"keys_env": KEYS_ENV}}, "tier type 'unsealed'")


def test_nonces_never_repeat_within_a_seal_and_differ_between_seals():
    first, second = Seal([bytes(32)]), Seal([bytes(32)])
    nonces = [first.next_nonce() for _ in range(10_000)] + [second.next_nonce() for _ in range(10_000)]
    assert len(set(nonces)) == len(nonces) and all(len(nonce) == 12 for nonce in nonces)


# -- plants in shared tiers -------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["file", "s3"])
def test_blocks_planted_by_an_engine_with_other_keys_are_never_loaded_and_each_is_counted(
    backend, keys_a, tmp_path, monkeypatch, engine_factory, request
):
    if backend == "s3":
        server, bucket = request.getfixturevalue("s3_server"), request.getfixturevalue("s3_bucket")
        shared = s3_config(server, bucket, integrity={"keys_env": KEYS_ENV})
    else:
        shared = file_config(tmp_path / "shared", integrity={"keys_env": KEYS_ENV})
    victim = engine_factory(shared)  # started before the plants: finds them by probes
    monkeypatch.setenv("KV_TIERING_PLANTER_KEYS", secrets.token_hex(32))
    planter = engine_factory({**shared, "integrity": {"keys_env": "KV_TIERING_PLANTER_KEYS"}})
    unsigned = engine_factory({key: value for key, value in shared.items() if key != "integrity"})
    planted(planter, [0, 1], fill=0xEE)  # write access, another key
    planted(unsigned, [2, 3], fill=0xDD)  # write access, no key at all

    assert victim.lookup_until_done(0, 1, 2, 3, steps=10) == [False] * 4  # misses: failed promotions
    assert victim.tier.failures["load_forged"] == 4 and victim.tier.health.healthy
    assert victim.lookup_until_done(0, 1, 2, 3) == [False] * 4  # believed absent for negative_ttl_s
    assert victim.tier.failures["load_forged"] == 4
    assert victim.tier.get_stats()["counters"]["blocks_loaded"] == 0  # their rows were never handed out

    friend = engine_factory({**shared, "integrity": {"keys_env": "KV_TIERING_PLANTER_KEYS"}})
    assert friend.lookup_until_done(0, 1) == [True, True]  # with the right key they load: loads deleted nothing
    assert all(row == bytes([0xEE]) * ROW for row in friend.loaded_bytes(0, 1))

    late = engine_factory(shared)  # started after: loads still refuse them
    assert late.lookup_until_done(0, 1, 2, 3, steps=10) == [False] * 4
    assert len(late.tier.index) == 0
    if backend == "file":  # and its recovery reclaimed them: a namespace is one deployment's
        assert not [path for path in late.tier.store.directory.rglob("*") if path.is_file()]


def test_a_signed_tier_stores_over_a_plant_and_then_loads_its_own_block(keys_a, tmp_path, engine_factory):
    shared = file_config(tmp_path / "shared", integrity={"keys_env": KEYS_ENV})
    victim = engine_factory(shared, num_blocks=8)
    planted(engine_factory({key: value for key, value in shared.items() if key != "integrity"}), [0], fill=0xEE)
    assert victim.lookup_until_done(0, steps=10) == [False]
    victim.store(0)
    victim.store(4, 5, 6, 7, 1, 2, 3)  # evicts 0 from the primary tier
    assert victim.lookup_until_done(0) == [True]
    assert victim.loaded_bytes(0) == [block_bytes(keys(0)[0], ROW)]


def test_forged_blocks_are_logged_once_a_minute_with_their_key(keys_a, tmp_path, engine_factory, caplog):
    shared = file_config(tmp_path / "shared", integrity={"keys_env": KEYS_ENV})
    victim = engine_factory(shared)
    planted(engine_factory(file_config(tmp_path / "shared")), [0, 1, 2], fill=0xEE)
    with caplog.at_level(logging.WARNING, logger="tiering"):
        victim.lookup_until_done(0, 1, 2, steps=10)
    lines = [record.getMessage() for record in caplog.records if "seal does not open" in record.getMessage()]
    assert len(lines) == 1 and any(k.hex() in lines[0] for k in keys(0, 1, 2))
    assert victim.tier.failures["load_forged"] == 3


def test_a_key_rotation_as_the_docs_give_it_keeps_every_engine_starting(monkeypatch, tmp_path, engine_factory):
    """Rotated as docs/sharing.md says (add the new key second, move it first, drop the old
    one), the records stayed sealed with the dropped key and no engine started again."""
    old, new = secrets.token_hex(32), secrets.token_hex(32)
    shared = file_config(tmp_path / "shared", integrity={"keys_env": KEYS_ENV})
    spec = IdentitySpec(identity("control"))  # an engine's identity: a manifest beside the versions
    monkeypatch.setenv(KEYS_ENV, old)
    first = engine_factory(shared, spec=spec)
    first.store(0)
    before = first.tier.store
    first.manager.reset_cache("step-1")  # a list of versions, sealed with the old key
    first.manager.on_schedule_end()
    deadline = time.monotonic() + 30
    while first.tier.store is before and time.monotonic() < deadline:  # the loop opens the new namespace
        time.sleep(0.01)
    for keys_given, rewritten in ((f"{old} {new}", 0), (f"{new} {old}", 2), (new, 0)):
        monkeypatch.setenv(KEYS_ENV, keys_given)
        engine = engine_factory(shared, spec=spec)  # starts at every step
        assert engine.tier._records.rewritten == rewritten, keys_given
    assert engine.lookup_until_done(0) == [False]  # block 0 itself was sealed with the dropped key: a miss


# -- encryption ---------------------------------------------------------------------------------


def test_an_encrypted_file_tier_round_trips_and_keeps_no_payload_in_clear(keys_a, tmp_path, engine_factory):
    root = tmp_path / "enc"
    engine = engine_factory(file_config(root, integrity={"keys_env": KEYS_ENV}, encryption="aes-256-gcm"))
    engine.store(0, 1, 2, 3)
    engine.store(4, 5, 6, 7)
    engine.rows[:] = 0
    assert engine.lookup_until_done(0, 1, 2, 3) == [True] * 4
    assert engine.loaded_bytes(0, 1, 2, 3) == [block_bytes(k, ROW) for k in keys(0, 1, 2, 3)]
    stored = b"".join(path.read_bytes() for path in root.rglob("*") if path.is_file())
    assert all(block_bytes(k, ROW)[:64] not in stored for k in keys(0, 1, 2, 3, 4, 5, 6, 7))


def test_a_faulty_store_corrupting_encrypted_blocks_never_loads_one(keys_a, tmp_path, engine_factory):
    config = {
        "type": "faulty",
        "inner": {"type": "file", "root_dir": str(tmp_path / "f")},
        "corruption_rate": 1.0,
        "integrity": {"keys_env": KEYS_ENV},
        "encryption": "aes-256-gcm",
    }
    engine = engine_factory(config)
    engine.store(0, 1, 2, 3)
    engine.store(4, 5, 6, 7)
    assert engine.lookup_until_done(0, 1, 2, 3, steps=10) == [False] * 4
    assert engine.tier.failures["load_forged"] == 4


# -- secrets ------------------------------------------------------------------------------------


def test_secrets_never_appear_in_reprs_stats_metrics_logs_or_errors(keys_a, tmp_path, engine_factory, caplog):
    raw = bytes.fromhex(keys_a)
    spellings = (keys_a, keys_a.upper(), base64.b64encode(raw).decode(), repr(raw)[2:-1])
    config = file_config(tmp_path / "s", integrity={"keys_env": KEYS_ENV}, encryption="aes-256-gcm")
    with caplog.at_level(logging.DEBUG, logger="tiering"):
        engine = engine_factory(config)
        engine.store(0, 1)
        planted(engine_factory(file_config(tmp_path / "s")), [2], fill=1)
        engine.lookup_until_done(2)
    seal = engine.tier.store.seal
    with pytest.raises(ForgedObjectError) as forged:
        seal.open(Sealed(seal.mode, seal.key_id, b"n" * 12, b"t" * 16, b""), memoryview(bytearray(16)))
    metrics = metrics_text(engine.manager)
    texts = [
        repr(engine.tier),
        repr(engine.tier.store),
        repr(seal),
        str(vars(engine.tier.store)),
        str(vars(seal)),
        str(engine.tier.get_stats()),
        str(engine.tier.settings),
        repr(engine.tier.settings.model_dump()),
        metrics,
        caplog.text,
        str(forged.value),
    ]
    for text in texts:
        for spelling in spellings:
            assert spelling not in text
    assert engine.tier.failures["load_forged"] == 1


def test_blocks_loaded_from_a_signed_tier_are_what_was_stored(keys_a, tmp_path, engine_factory):
    engine = engine_factory(file_config(tmp_path / "signed", integrity={"keys_env": KEYS_ENV}))
    engine.store(0, 1, 2, 3)
    engine.store(4, 5, 6, 7)
    engine.rows[:] = np.uint8(0)
    assert engine.lookup_until_done(0, 1, 2, 3) == [True] * 4
    assert engine.loaded_bytes(0, 1, 2, 3) == [block_bytes(k, ROW) for k in keys(0, 1, 2, 3)]


@pytest.mark.parametrize("size", [1, 64 << 10, (64 << 10) + 4096, 2 << 20])  # xxhash releases the GIL over 64 KiB
def test_the_checksum_catches_one_flipped_bit_whether_it_holds_the_gil_or_not(size):
    payload = bytearray(np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes())
    header, _ = encode_object(keys(1)[0], memoryview(payload), FINGERPRINT)
    parsed = parse_header(header, FINGERPRINT)
    assert parsed.checksum == xxhash.xxh3_64_intdigest(payload)
    verify_payload(parsed, memoryview(payload))
    payload[size // 2] ^= 1
    with pytest.raises(CorruptObjectError, match="XXH3-64"):
        verify_payload(parsed, memoryview(payload))


def test_an_object_of_the_crc32c_format_is_never_read():
    """Object format 2 (header version 3: CRC32C fields, 4 bytes each) is another identity's:
    a header of it, however well formed, is refused as an older format."""
    key, payload = keys(1)[0], b"\x07" * 4096
    fixed = struct.Struct("<4sHHI16sQII").pack(b"KVTB", 3, len(key), 128, FINGERPRINT, len(payload), 0, 0)
    with pytest.raises(CorruptObjectError, match="version 3"):
        parse_header((fixed + key).ljust(128, b"\0"), FINGERPRINT)
