"""``tiering-config check FILE``: validate a configuration and print the engine it resolves
to, without building anything (no shared memory, no tier opened). What is cheap and local
is tried (a file tier creates and removes a file where its objects go; an S3 tier resolves
its credentials); ``--connect`` also opens each tier's store, reaching its server.

Thread: a command-line tool, the main thread.

    tiering-config check engine.yaml --model llama-3.1-8b
    tiering-config check --kv-transfer-config '{"kv_connector": "KVTieringConnector", ...}'

The second form takes ``vllm serve``'s ``--kv-transfer-config`` as it is, so its errors show
before vLLM spends minutes loading a model (vLLM builds the engine only after that).

Exit status: 0 the configuration is valid; 2 it is not (every problem is printed with the
file and the key path), or the engine would not start with it (with ``--model``, a CPU tier
or a tier capacity that holds no whole block of that model; a tier whose storage a try
found unusable).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from tiering.config import TieringConfig, load_config
from tiering.contract.keys import make_offload_key
from tiering.errors import ConfigError
from tiering.integrations.vllm_config import check_kv_transfer_config
from tiering.spec import MODEL_PRESETS, KVLayout
from tiering.tiers.admission import AdmissionConfig, TierAdmission
from tiering.tiers.blockstore import BlockStore
from tiering.tiers.factory import SecondaryTierFactory, block_store_parts
from tiering.tiers.object_format import object_size

_KEY_BYTES = len(make_offload_key(bytes(32), 0))  # vLLM's keys: a 32-byte hash and a group index


def describe(config: TieringConfig, layout: KVLayout | None) -> tuple[list[str], list[str]]:
    """The resolved engine, one line per fact (sizes in bytes and in blocks where known), and
    why the engine would not start with it for `layout`'s blocks (empty: it would)."""
    block_size = config.block_size or (layout.gpu_block_size if layout else None)
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
    if not config.secondary_tiers:
        lines.append("no secondary tiers")
    if config.metrics is not None:
        lines.append(f"metrics: http://{config.metrics.address}:{config.metrics.port}/metrics")
    return lines, problems


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
    returns what was not tried, and the problems found, one line each."""
    notes, problems = [], []
    for index, tier in enumerate(config.secondary_tiers):
        parts = block_store_parts(tier)
        if parts is None:
            notes.append(f"tier {tier['name']}: a tier class of its own: not tried (it checks itself when built)")
            continue
        store_cls, options, settings = parts
        problems += [f"secondary_tiers[{index}]: {line}" for line in store_cls.preflight(options, settings, connect)]
    if config.secondary_tiers and not connect:
        notes.append("servers not reached: --connect opens each tier's store (S3, Valkey, ...) as the engine would")
    return notes, problems


def _options(options: dict[str, Any]) -> str:
    return ", ".join(f"{key}={value!r}" for key, value in options.items()) or "default options"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tiering-config", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check", help="validate a configuration and print the resolved engine")
    check.add_argument("file", nargs="?", help="the YAML configuration")
    check.add_argument(
        "--kv-transfer-config",
        metavar="JSON",
        help="instead of a file, vLLM's --kv-transfer-config (the same JSON), checked as vLLM would build the engine",
    )
    check.add_argument("--model", choices=sorted(MODEL_PRESETS), help="size blocks and rows for this model's KV")
    check.add_argument(
        "--connect", action="store_true", help="also open each tier's store, reaching its server, as the engine would"
    )
    args = parser.parse_args(argv)
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
    print("\n".join(lines + notes))
    for problem in problems:
        print(f"{config.source}: {problem}: the engine would not start", file=sys.stderr)
    return 2 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
