"""What a lasting tier's root holds, in plain words, and the removal of what nobody used for a
while: ``tiering-config check`` lists it, ``tiering-config prune`` removes it.

A root (a file tier's ``root_dir``, an S3 prefix) holds namespaces (`BlockStore.list_namespaces`).
Each is one of:

- an identity's **records** (`tiering.tiers.blockstore.generations`): its manifest, which names
  the model and everything else that shapes its blocks, and the weight versions its engines
  declared;
- the **blocks** of an identity computed with one version of the weights, ``namespace(identity,
  weights)``: the checkpoint's or a version the records list;
- an identity's **leases** (`tiering.tiers.blockstore.leases`): one per running engine, naming
  the namespaces of blocks it uses;
- **unnamed**: no identity's records name it. The blocks of an engine's own weights after a
  reset without a declared version, of an engine whose records were removed, or written by a
  version of the engine before namespaces followed the weights. No engine that starts reads
  them.

Pruning removes the namespaces whose newest object is older than a given time and that no
live lease names: the blocks first, then records whose every namespace of blocks is gone or
goes with them and none of whose engines runs (records are labels: removed under blocks that
stay, those would list as unnamed), with their leases. A namespace is only ever removed whole
(`BlockStore.remove_namespace`); an engine still using one (its lease lost, expired or not
yet written) sees misses, never wrong bytes.

Thread: any thread without a running event loop (the coroutines run on one of their own).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from tiering.contract.identity import CHECKPOINT, namespace
from tiering.tiers.blockstore.generations import read_records
from tiering.tiers.blockstore.leases import LeaseRecord, lease_namespace, read_leases
from tiering.tiers.blockstore.store import BlockStore, NamespaceUsage

T = TypeVar("T")
MAX_ENGINES_LISTED = 3  # engines named on a namespace's line; the others counted

RECORDS_MAX_OBJECTS = 2  # a manifest and the versions: a namespace with more is not records


@dataclass(frozen=True)
class Found:
    """A namespace and what it is: `kind` ``records``, ``leases``, ``blocks`` or ``unnamed``;
    `identity` the hex digest of the identity whose it is (None: unnamed); `model` its model's
    name and what else tells identities of one model apart (`label`); `weights` the weight
    version of a namespace of blocks (`CHECKPOINT`: the checkpoint's), the versions the
    records list for records; `this_engine` whether the identity is the one asked about;
    `leases` the live leases that name it (for leases: those it holds); `now` when they
    were read (Unix seconds)."""

    usage: NamespaceUsage
    kind: str
    identity: str | None = None
    model: str | None = None
    weights: tuple[str, ...] = ()
    this_engine: bool = False
    leases: tuple[LeaseRecord, ...] = ()
    now: float = 0.0

    def written_before(self, when: float) -> bool:
        """Whether its newest write is known and before `when` (Unix seconds)."""
        return self.usage.last_write is not None and self.usage.last_write < when

    def describe(self) -> str:
        """One line: the namespace, its size, newest write (UTC), what it is, and the
        running engines whose live leases name it."""
        return self._what() + self._engines()

    def _engines(self) -> str:
        if self.kind == "records":
            return ""
        if not self.leases:
            return "; no live lease"
        count = f"{len(self.leases)} live lease{'s' if len(self.leases) > 1 else ''}"
        named = "; ".join(lease.describe(self.now) for lease in self.leases[:MAX_ENGINES_LISTED])
        more = len(self.leases) - MAX_ENGINES_LISTED
        return f"; {count} ({named}{f'; and {more} more' if more > 0 else ''})"

    def _what(self) -> str:
        usage = self.usage
        when = (
            "unknown"
            if usage.last_write is None
            else time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(usage.last_write))
        )
        where = f"{usage.namespace.hex()}: {usage.objects:,} objects, {usage.bytes:,} bytes, last write {when}"
        if self.kind == "unnamed":
            return f"{where}; named by no identity's records (an engine's own weights, or blocks of an older version)"
        if self.kind == "records":
            versions = ", ".join(self.weights) or "none"
            whose = f"identity {self.identity} ({self.model}); weight versions declared: {versions}"
        elif self.kind == "leases":
            whose = f"identity {self.identity} ({self.model})"
        else:
            (weights,) = self.weights
            words = "the checkpoint's weights" if weights == CHECKPOINT else f"weight version {weights}"
            whose = f"identity {self.identity} ({self.model}), {words}"
        return f"{where}; {self.kind} of {whose}{', this engine' if self.this_engine else ''}"


def label(manifest: dict) -> str:
    """An identity's manifest in a few words: its model and what most often tells two
    identities of one model apart (version, block, dtype, parallel split), so that a listing
    of several does not show one name for all. Pure; any thread."""
    parts = [str(manifest.get("model"))]
    if manifest.get("model_version"):
        parts.append(f"version {manifest['model_version']}")
    if manifest.get("model_revision"):
        parts.append(f"revision {manifest['model_revision']}")
    tokens, size = manifest.get("tokens_per_block"), manifest.get("bytes_per_block")
    if isinstance(tokens, int) and isinstance(size, int):
        parts.append(f"{tokens} tokens / {size:,} bytes per block")
    if manifest.get("kv_dtype"):
        parts.append(str(manifest["kv_dtype"]))
    parallel = manifest.get("parallel")
    if isinstance(parallel, dict):
        split = ", ".join(f"{k} {v}" for k, v in sorted(parallel.items()) if isinstance(v, int) and v > 1)
        if split:
            parts.append(split)
    return ", ".join(parts)


async def survey(
    usages: list[NamespaceUsage],
    make_store: Callable[[bytes, bool], BlockStore],
    identity: bytes | None,
    now: float | None = None,
) -> list[Found]:
    """What each of `usages` (a root's namespaces) is, read from the records and leases
    among them: `make_store` builds an unopened store of a namespace (``blocks`` False: of
    records), as `tiering.tiers.blockstore.opening.store_maker` does; `identity`: an engine's
    identity digest, whose namespaces are marked ``this_engine`` (None: none asked about);
    `now`: Unix seconds that tell live leases (None: the clock's).

    Raises:
        Exception: the store's own errors (a namespace cannot be opened or read).
    """
    now = time.time() if now is None else now
    records: dict[bytes, Found] = {}
    for usage in usages:  # only those that may hold records are opened: a listing writes nothing
        if usage.holds_manifest is False or usage.objects > RECORDS_MAX_OBJECTS:
            continue
        read = await _read(make_store, usage.namespace, read_records)
        if read is not None and isinstance(digest := read[0].get("identity"), str):
            mine = identity is not None and digest == identity.hex()
            records[usage.namespace] = Found(usage, "records", digest, label(read[0]), tuple(read[1]), mine)
    listed = {usage.namespace: usage for usage in usages}
    leases: dict[bytes, Found] = {}
    leased: dict[str, list[LeaseRecord]] = {}  # hex namespace: live leases naming it
    for owner in records.values():
        assert owner.identity is not None
        if (held_by := listed.get(lease_namespace(bytes.fromhex(owner.identity)))) is None:
            continue
        live = tuple(lease for lease in await _read(make_store, held_by.namespace, read_leases) if lease.live(now))
        leases[held_by.namespace] = Found(
            held_by, "leases", owner.identity, owner.model, (), owner.this_engine, live, now
        )
        for lease in live:
            for held in lease.held:
                leased.setdefault(held, []).append(lease)
    blocks = {}
    for found in records.values():
        assert found.identity is not None
        for weights in (CHECKPOINT, *found.weights):
            blocks[namespace(bytes.fromhex(found.identity), weights)] = (found, weights)
    named = []
    for usage in usages:
        users = tuple(leased.get(usage.namespace.hex(), ()))
        if (own := records.get(usage.namespace) or leases.get(usage.namespace)) is not None:
            named.append(own)
        elif (owned := blocks.get(usage.namespace)) is not None:
            owner, weights = owned
            named.append(Found(usage, "blocks", owner.identity, owner.model, (weights,), owner.this_engine, users, now))
        else:
            named.append(Found(usage, "unnamed", leases=users, now=now))
    return named


async def _read(
    make_store: Callable[[bytes, bool], BlockStore], name: bytes, read: Callable[[BlockStore], Awaitable[T]]
) -> T:
    """``read(store)`` of an opened store of records of namespace `name`, closed after."""
    store = make_store(name, False).for_records()
    await store.open()
    try:
        return await read(store)
    finally:
        await store.close()


def unused(found: list[Found], unused_for_s: float, now: float) -> list[Found]:
    """Those of `found` to prune: namespaces that no live lease names and whose newest write
    is more than `unused_for_s` seconds before `now` (Unix seconds; never one whose last write
    is unknown), blocks and unnamed ones first; records only where every namespace of their
    identity's blocks is pruned too or absent and none of its engines holds a live lease; an
    identity's leases with its records."""

    def old(found: Found) -> bool:
        return not found.leases and found.written_before(now - unused_for_s)

    first = [f for f in found if f.kind in ("blocks", "unnamed") and old(f)]
    kept = {f.identity for f in found if (f.kind == "blocks" and f not in first) or f.leases}
    records = [f for f in found if f.kind == "records" and old(f) and f.identity not in kept]
    gone = {f.identity for f in records}
    return first + records + [f for f in found if f.kind == "leases" and f.identity in gone]


async def remove(found: Found, make_store: Callable[[bytes, bool], BlockStore]) -> None:
    """Remove the namespace of `found` whole (`BlockStore.remove_namespace`).

    Raises:
        Exception: the store's own errors.
    """
    store = make_store(found.usage.namespace, False)  # whatever it holds: removed whole
    await store.open()
    try:
        await store.remove_namespace()
    finally:
        await store.close()
