"""The docs' headline hit rates are what the commands printed beside them give now: each is
replayed (the cheap ones: the CPU tier alone) and compared with the page's table, to the
printed decimal. Where a page's command is self-contained (it writes its own config), it is
run as the page prints it, with this venv's tools."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tiering.benchmarks.loadgen import cli

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "traces" / "conversation_trace.jsonl.gz"


def replay(tmp_path: Path, rows: int, policy: str, *options: str) -> float:
    """The total hit rate, in percent rounded as the docs print it, of the conversation trace
    replayed through a CPU tier of `rows` blocks of 8 KiB and `policy`."""
    config, output = tmp_path / "engine.yaml", tmp_path / "run.json"
    config.write_text(f"cpu_bytes_to_use: {rows * 8192}\neviction_policy: {policy}\n")
    argv = ["--config", str(config), "--trace", str(TRACE), "--block-bytes", "8KiB", "--quiet", *options]
    assert cli.main([*argv, "--output", str(output)]) == 0
    return round(100 * json.loads(output.read_text())["hit_rate"]["total"], 1)


def table_row(page: str, starts: str) -> list[str]:
    """The cells of the first row of `page`'s tables that starts with `starts`."""
    for line in (ROOT / "docs" / page).read_text().splitlines():
        if line.startswith(f"| {starts}"):
            return [cell.strip().strip("*") for cell in line.strip("|").split("|")]
    raise AssertionError(f"docs/{page}: no row starting with {starts!r}")


def percent(cell: str) -> float:
    """The number of a cell such as ``20.7%``, ``**31.8**`` or `` 12.0 ``."""
    found = re.match(r"\**([0-9.]+)", cell.strip())
    assert found, cell
    return float(found[1])


@pytest.mark.parametrize(("policy", "column"), [("lru", 1), ("arc", 2)])
def test_the_policy_tables_5_percent_row(tmp_path, policy, column):
    row = table_row("configuration.md", "Mooncake conversation, 5% (9,140 blocks)")
    assert replay(tmp_path, 9140, policy, "--gpu-blocks", "0") == percent(row[column])


def run_as_written(tmp_path: Path, page: str, marker: str) -> float:
    """Run the ``sh`` block of docs/`page` that holds `marker` as the page prints it, in
    `tmp_path` (the repository's traces linked there), `.venv/bin/` being this venv's; returns
    the total hit rate it printed, in percent."""
    blocks = re.findall(r"```sh\n(.*?)\n```", (ROOT / "docs" / page).read_text(), flags=re.S)
    (block,) = [block for block in blocks if marker in block]
    (tmp_path / "traces").symlink_to(ROOT / "traces")
    script = block.replace(".venv/bin/", f"{Path(sys.executable).parent}/")
    done = subprocess.run(["bash", "-eu", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stderr[-2000:]
    total = re.search(r"│ total +│ +([0-9.]+)% │", done.stdout)
    assert total, done.stdout[-2000:]
    return float(total[1])


@pytest.mark.timeout(240)
def test_the_hint_tables_continuation_cell_from_the_pages_own_command(tmp_path):
    row = table_row("configuration.md", "Mooncake conversation, 5% |")
    lru = [percent(value) for value in row[1].rstrip("%").split("/")]
    assert run_as_written(tmp_path, "configuration.md", "--hints continuation") == lru[1]


@pytest.mark.timeout(240)
def test_the_policy_tables_arc_s_cell_from_the_pages_own_command(tmp_path):
    row = table_row("configuration.md", "Mooncake conversation, 1% (1,828 blocks)")
    assert run_as_written(tmp_path, "configuration.md", "--config arcs.yaml") == percent(row[3])


def test_the_load_generators_cpu_tier_alone_row(tmp_path):
    row = table_row("load-generator.md", "LRU, CPU tier alone")
    assert replay(tmp_path, 9140, "lru") == percent(row[4])
