"""``tiering-config check FILE``: validate a configuration and print the engine it resolves
to, without building anything (no shared memory, no tier opened). What is cheap and local
is tried (a file tier creates and removes a file where its objects go; an S3 tier resolves
its credentials); ``--connect`` also opens each tier's store, reaching its server. With
``--model``, it prints the engine's identity (its manifest: what shapes its blocks). It lists
the namespaces each lasting tier's root holds, with their sizes, last writes and whose they
are (`tiering.tiers.blockstore.namespaces`): a file tier's always, others' with ``--connect``.

``tiering-config prune FILE --unused-for 7d`` removes the namespaces of each lasting tier not
written for that long (``--dry-run``: only lists them).

Thread: a command-line tool, the main thread.

    tiering-config check engine.yaml --model llama-3.1-8b
    tiering-config check --kv-transfer-config '{"kv_connector": "KVTieringConnector", ...}'
    tiering-config prune engine.yaml --unused-for 14d --dry-run

The second form takes ``vllm serve``'s ``--kv-transfer-config`` as it is, so its errors show
before vLLM spends minutes loading a model (vLLM builds the engine only after that).

Exit status: 0 the configuration is valid; 2 it is not (every problem is printed with the
file and the key path), or the engine would not start with it (with ``--model``, a CPU tier
or a tier capacity that holds no whole block of that model; a tier whose storage a try
found unusable).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from pydantic import BaseModel

from tiering.config import TieringConfig, load_config
from tiering.contract.keys import make_offload_key
from tiering.engine.admission import AdmissionConfig, TierAdmission
from tiering.errors import ConfigError
from tiering.errors import describe as describe_error
from tiering.integrations.vllm_config import check_kv_transfer_config
from tiering.options import DURATION_EXAMPLES, parse_duration
from tiering.spec import MODEL_PRESETS, KVLayout, block_tokens
from tiering.tiers.blockstore import BlockStore, BlockStoreSettings
from tiering.tiers.blockstore.namespaces import Found, remove, survey, unused
from tiering.tiers.blockstore.opening import store_maker
from tiering.tiers.factory import SecondaryTierFactory, block_store_parts
from tiering.tiers.object_format import object_size

SHM_DIR = "/dev/shm"  # the CPU tier's shared region (`tiering.cpu.shared_region`)
_KEY_BYTES = len(make_offload_key(bytes(32), 0))  # vLLM's keys: a 32-byte hash and a group index


def describe(config: TieringConfig, layout: KVLayout | None) -> tuple[list[str], list[str]]:
    """The resolved engine, one line per fact (sizes in bytes and in blocks where known), and
    why the engine would not start with it for `layout`'s blocks (empty: it would)."""
    block_size = block_tokens(config, layout) if layout else None
    lines = [
        f"configuration: {config.source}",
        f"cpu tier: {config.cpu_bytes_to_use:,} bytes, eviction policy {config.eviction_policy}",
    ]
    problems = []
    block_bytes = rows = None
    if layout is not None and block_size is not None:
        block_bytes = layout.kv_bytes_per_token * block_size
        rows = config.cpu_bytes_to_use // block_bytes
        groups = f" per KV-cache group ({layout.kv_groups} groups: a block of a prefix takes {layout.kv_groups} rows)"
        lines.append(
            f"block: {block_size} tokens of {layout.model} = {block_bytes:,} bytes"
            f"{groups if layout.kv_groups > 1 else ''}; cpu tier rows: {rows:,}"
        )
        if rows < 1:
            problems.append(f"cpu_bytes_to_use holds no whole block of {block_bytes:,} bytes")
    for index, tier in enumerate(config.secondary_tiers):
        options = {k: v for k, v in tier.items() if k not in ("type", "name", "admission")}
        admission = AdmissionConfig(**tier.get("admission", {}))
        lines.append(f"tier {tier['name']}: type {tier['type']}, {_options(options)}")
        lines.append(f"  admission: {_admission(admission, rows, len(config.secondary_tiers))}")
        capacity = tier.get("capacity_bytes")
        _, tier_cls, _ = SecondaryTierFactory.resolve(tier)
        if block_bytes is not None and capacity is not None and issubclass(tier_cls, BlockStore):
            smallest = object_size(_KEY_BYTES, block_bytes, tier_cls.header_align)
            if capacity < smallest:
                problems.append(
                    f"secondary_tiers[{index}].capacity_bytes ({capacity:,}) cannot hold one block: a block "
                    f"takes at least {smallest:,} bytes (a row of {block_bytes:,} and its header)"
                )
    free = shm_free_bytes()
    if free is not None and config.cpu_bytes_to_use > free:
        problems.append(
            f"cpu_bytes_to_use ({config.cpu_bytes_to_use:,}) is more than {SHM_DIR} has free on this machine "
            f"({free:,}): lower it or enlarge {SHM_DIR}"
        )
    if not config.secondary_tiers:
        lines.append("no secondary tiers")
    if config.metrics is not None:
        lines.append(f"metrics: http://{config.metrics.address}:{config.metrics.port}/metrics")
    return lines, problems


def shm_free_bytes() -> int | None:
    """The bytes free in `SHM_DIR`, where the CPU tier's region goes; None if it cannot be read."""
    try:
        info = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return info.f_bavail * info.f_frsize


def _admission(config: AdmissionConfig, rows: int | None, tiers: int) -> str:
    """`config`'s settings, those sized by the CPU tier's rows resolved when `rows` is known."""
    settings = config.model_dump()
    if rows is not None and rows > 0:
        resolved = TierAdmission(config, rows, tiers)
        settings["max_rows_in_flight"], settings["writeback_window"] = resolved.max_rows, resolved.writeback_window
        return _options(settings)
    unresolved = [key for key in ("max_rows_in_flight", "writeback_window") if settings[key] is None]
    for key in unresolved:
        del settings[key]
    auto = f"; {' and '.join(unresolved)} sized by the CPU tier's rows (--model prints them)" if unresolved else ""
    return _options(settings) + auto


def preflight(config: TieringConfig, connect: bool) -> tuple[list[str], list[str]]:
    """Try what can be tried of each tier before the engine starts (`BlockStore.preflight`):
    returns what was not tried and the warnings (`BlockStore.caveats`), and the problems
    found, one line each."""
    notes, problems = [], []
    for index, tier in enumerate(config.secondary_tiers):
        parts = block_store_parts(tier)
        if parts is None:
            notes.append(f"tier {tier['name']}: a tier class of its own: not tried (it checks itself when built)")
            continue
        store_cls, options, settings = parts
        caveats: list[str] = []
        problems += [
            f"secondary_tiers[{index}]: {line}" for line in store_cls.preflight(options, settings, connect, caveats)
        ]
        notes += [f"tier {tier['name']}: warning: {line}" for line in caveats]
    if config.secondary_tiers and not connect:
        notes.append("servers not reached: --connect opens each tier's store (S3, Valkey, ...) as the engine would")
    return notes, problems


def identity_lines(config: TieringConfig, layout: KVLayout) -> tuple[bytes, list[str]]:
    """The identity an engine of `config` over `layout` has (`KVLayout.identity`, as the
    engine computes it) and its manifest, one line of JSON."""
    block_size = block_tokens(config, layout)
    identity = layout.identity(block_size, layout.kv_bytes_per_token * block_size, config.model_version)
    digest = identity.digest()
    return digest, [f"identity: {digest.hex()}", f"  manifest: {json.dumps(identity.manifest(), sort_keys=True)}"]


def survey_tiers(
    config: TieringConfig, identity: bytes | None, connect: bool
) -> tuple[list[str], list[tuple[str, Callable[[bytes, bool], BlockStore], list[Found]]], int]:
    """Each lasting tier's namespaces (those whose store lists them, remote ones only with
    `connect`): lines to print; per tier listed, (name, its store maker, what it found); and
    how many tiers could not be listed."""
    lines, surveyed, failed = [], [], 0
    for tier in config.secondary_tiers:
        parts = block_store_parts(tier)
        if parts is None or not parts[0].lasting:
            continue
        store_cls, options, settings = parts
        if store_cls.list_namespaces.__func__ is BlockStore.list_namespaces.__func__:  # type: ignore[attr-defined]
            lines.append(f"tier {tier['name']}: its store does not list namespaces")
            continue
        if not (connect or store_cls.lists_locally):
            lines.append(f"tier {tier['name']}: namespaces not listed (--connect lists them)")
            continue
        try:
            make = store_maker(tier["name"], _factory(store_cls, options, settings), settings, 0)
            usages = asyncio.run(store_cls.list_namespaces(options, settings))
            found = None if usages is None else asyncio.run(survey(usages, make, identity))
        except Exception as exc:
            lines.append(f"tier {tier['name']}: its namespaces cannot be listed: {describe_error(exc)}")
            failed += 1
            continue
        if found is None:
            lines.append(f"tier {tier['name']}: its store does not list namespaces")
            continue
        lines.append(f"tier {tier['name']}: {len(found)} namespaces")
        lines += [f"  {item.describe()}" for item in found]
        surveyed.append((tier["name"], make, found))
    return lines, surveyed, failed


def _factory(
    store_cls: type[BlockStore], options: BaseModel, settings: BlockStoreSettings
) -> Callable[[bytes], BlockStore]:
    """Builds a store of `store_cls` for a namespace, as its tier would."""
    return lambda namespace: store_cls.from_config(namespace, options, settings)


def _options(options: dict[str, Any]) -> str:
    return ", ".join(f"{key}={value!r}" for key, value in options.items()) or "default options"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tiering-config",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check", help="validate a configuration and print the resolved engine")
    check.add_argument("file", nargs="?", help="the YAML configuration")
    check.add_argument(
        "--kv-transfer-config",
        metavar="JSON",
        help="instead of a file, vLLM's --kv-transfer-config (the same JSON), checked as vLLM would build the engine",
    )
    check.add_argument(
        "--model", choices=sorted(MODEL_PRESETS), help="size blocks and rows for this model's KV; print its identity"
    )
    check.add_argument(
        "--connect", action="store_true", help="also open each tier's store, reaching its server, as the engine would"
    )
    prune = commands.add_parser("prune", help="remove the namespaces of lasting tiers not written for a while")
    prune.add_argument("file", help="the YAML configuration")
    prune.add_argument(
        "--unused-for",
        required=True,
        type=_duration,
        metavar="DURATION",
        help=f"not written for this long: {DURATION_EXAMPLES} (seconds without a unit)",
    )
    prune.add_argument("--dry-run", action="store_true", help="list what would be removed, remove nothing")
    parser.epilog = "".join(command.format_usage() for command in (check, prune))
    parser.epilog += "tiering-config COMMAND --help explains each option."
    args = parser.parse_args(argv)
    if args.command == "prune":
        return _prune(args.file, args.unused_for, args.dry_run)
    if (args.file is None) == (args.kv_transfer_config is None):
        check.error("give a YAML file or --kv-transfer-config, one of the two")
    try:
        config = load_config(args.file) if args.file else check_kv_transfer_config(args.kv_transfer_config)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    layout = KVLayout.from_preset(args.model) if args.model else None
    lines, problems = describe(config, layout)
    notes, found = preflight(config, args.connect)
    problems += found
    identity = None
    if layout is not None:
        identity, more = identity_lines(config, layout)
        lines += more
    if not problems:
        lines += survey_tiers(config, identity, args.connect)[0]
    print("\n".join(lines + notes), flush=True)
    if problems:  # last, worded as every other configuration error
        lines = [f"{config.source}: {problem}: the engine would not start" for problem in problems]
        print("invalid configuration\n  " + "\n  ".join(lines), file=sys.stderr)
    return 2 if problems else 0


def _duration(text: str) -> float:
    """``--unused-for``: seconds of a positive duration (`tiering.options.parse_duration`)."""
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _prune(path: str, unused_for_s: float, dry_run: bool) -> int:
    """``tiering-config prune``: remove (or, `dry_run`, list) every lasting tier's namespaces
    not written for `unused_for_s` seconds and leased by no running engine
    (`namespaces.unused`; those leased are listed as kept); a tier's records and leases stay
    where one of its namespaces could not be removed. Exit status 2 where the config is invalid, or
    a tier could not be listed or a namespace removed."""
    try:
        config = load_config(path)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    lines, surveyed, failed = survey_tiers(config, None, connect=True)
    print("\n".join(line for line in lines if not line.startswith(" ")))
    status = 2 if failed else 0
    for name, make, found in surveyed:
        kept_blocks = False  # a namespace that could not be removed: the tier's records stay
        now = time.time()
        for item in found:
            if item.leases and item.kind != "leases" and item.written_before(now - unused_for_s):
                print(f"tier {name}: kept {item.describe()}: a running engine uses it")
        stale = unused(found, unused_for_s, now)
        if not stale:
            print(f"tier {name}: nothing to remove: no namespace unused for {timedelta(seconds=unused_for_s)}")
        for item in stale:
            if item.kind in ("records", "leases") and kept_blocks:
                # the labels of the namespaces left: without them those would list as unnamed
                print(f"tier {name}: kept {item.describe()}: a namespace of blocks could not be removed")
                continue
            try:
                if not dry_run:
                    asyncio.run(remove(item, make))
                print(f"tier {name}: {'would remove' if dry_run else 'removed'} {item.describe()}")
            except Exception as exc:
                print(
                    f"tier {name}: cannot remove {item.usage.namespace.hex()}: {describe_error(exc)}", file=sys.stderr
                )
                status, kept_blocks = 2, True
    return status


if __name__ == "__main__":
    raise SystemExit(main())
