"""What a lasting tier's root holds, in plain words, and the removal of what nobody used for a
while: ``tiering-config check`` lists it, ``tiering-config prune`` removes it.

A root (a file tier's ``root_dir``, an S3 prefix) holds namespaces (`BlockStore.list_namespaces`).
Each is one of:

- an identity's **records** (`tiering.tiers.blockstore.generations`): its manifest, which names
  the model and everything else that shapes its blocks, and the weight versions its engines
  declared;
- the **blocks** of an identity computed with one version of the weights, ``namespace(identity,
  weights)``: the checkpoint's or a version the records list;
- **unnamed**: no identity's records name it. The blocks of an engine's own weights after a
  reset without a declared version, of an engine whose records were removed, or written by a
  version of the engine before namespaces followed the weights. No engine that starts reads
  them.

Pruning removes the namespaces whose newest object is older than a given time: the blocks
first, then records whose every namespace of blocks is gone or goes with them (records are
labels: removed under blocks that stay, those would list as unnamed). A namespace is only
ever removed whole (`BlockStore.remove_namespace`); an engine still using one sees misses,
never wrong bytes.

Thread: any thread without a running event loop (the coroutines run on one of their own).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from tiering.contract.identity import CHECKPOINT, namespace
from tiering.tiers.blockstore.generations import read_records
from tiering.tiers.blockstore.store import BlockStore, NamespaceUsage

RECORDS_MAX_OBJECTS = 2  # a manifest and the versions: a namespace with more is not records


@dataclass(frozen=True)
class Found:
    """A namespace and what it is: `kind` ``records``, ``blocks`` or ``unnamed``; `identity`
    the hex digest of the identity whose it is (None: unnamed); `model` its model's name and
    what else tells identities of one model apart (`label`); `weights` the weight version of
    a namespace of blocks (`CHECKPOINT`: the checkpoint's), the versions the records list for
    records; `this_engine` whether the identity is the one asked about."""

    usage: NamespaceUsage
    kind: str
    identity: str | None = None
    model: str | None = None
    weights: tuple[str, ...] = ()
    this_engine: bool = False

    def describe(self) -> str:
        """One line: the namespace, its size, newest write (UTC) and what it is."""
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
    usages: list[NamespaceUsage], make_store: Callable[[bytes, bool], BlockStore], identity: bytes | None
) -> list[Found]:
    """What each of `usages` (a root's namespaces) is, read from the records among them:
    `make_store` builds an unopened store of a namespace (``blocks`` False: of records), as
    `tiering.tiers.blockstore.opening.store_maker` does; `identity`: an engine's identity
    digest, whose namespaces are marked ``this_engine`` (None: none asked about).

    Raises:
        Exception: the store's own errors (a namespace cannot be opened or read).
    """
    records: dict[bytes, Found] = {}
    for usage in usages:  # only those that may hold records are opened: a listing writes nothing
        if usage.holds_manifest is False or usage.objects > RECORDS_MAX_OBJECTS:
            continue
        store = make_store(usage.namespace, False).for_records()
        await store.open()
        try:
            read = await read_records(store)
        finally:
            await store.close()
        if read is not None and isinstance(digest := read[0].get("identity"), str):
            mine = identity is not None and digest == identity.hex()
            records[usage.namespace] = Found(usage, "records", digest, label(read[0]), tuple(read[1]), mine)
    blocks = {}
    for found in records.values():
        assert found.identity is not None
        for weights in (CHECKPOINT, *found.weights):
            blocks[namespace(bytes.fromhex(found.identity), weights)] = (found, weights)
    named = []
    for usage in usages:
        if usage.namespace in records:
            named.append(records[usage.namespace])
        elif (owned := blocks.get(usage.namespace)) is not None:
            owner, weights = owned
            named.append(Found(usage, "blocks", owner.identity, owner.model, (weights,), owner.this_engine))
        else:
            named.append(Found(usage, "unnamed"))
    return named


def unused(found: list[Found], unused_for_s: float, now: float) -> list[Found]:
    """Those of `found` to prune: namespaces whose newest write is more than `unused_for_s`
    seconds before `now` (Unix seconds; never one whose last write is unknown), blocks and
    unnamed ones first; records only where every namespace of their identity's blocks is
    pruned too or absent."""

    def old(usage: NamespaceUsage) -> bool:
        return usage.last_write is not None and now - usage.last_write > unused_for_s

    kept_blocks = {f.identity for f in found if f.kind == "blocks" and not old(f.usage)}
    first = [f for f in found if f.kind != "records" and old(f.usage)]
    return first + [f for f in found if f.kind == "records" and old(f.usage) and f.identity not in kept_blocks]


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
