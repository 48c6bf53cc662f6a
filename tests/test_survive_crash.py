"""A CPU tier that outlives its engine (``cpu_tier: {survive_crash: true}``): engines in
processes of their own (`tests.survival_engine`) are killed with SIGKILL at each step of a store,
and an engine started after them serves exactly the blocks that were committed, byte for byte,
and nothing of another identity or other weights."""

import contextlib
import json
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest

from tests import survival_engine as engine
from tests.helpers import keys, region_name
from tiering import ReqContext, TieringOffloadingSpec
from tiering.contract.identity import CHECKPOINT, namespace
from tiering.cpu.kept_regions import KEPT_SUFFIX
from tiering.cpu.row_records import HEADER, HEADER_BYTES, read_header

pytestmark = pytest.mark.timeout(120)
ROWS = 16
CPU_BYTES = ROWS * engine.ROW_BYTES
REPO = Path(__file__).resolve().parents[1]


def kept_regions(model: str) -> list[Path]:
    """The kept regions of `model`'s engines, of any weights and worker count these tests use."""
    layouts = [engine.layout(model, workers) for workers in (1, 2)]
    identities = [layout.identity(engine.GPU_BLOCK, engine.ROW_BYTES).digest() for layout in layouts]
    digests = {namespace(identity, weights) for identity in identities for weights in (CHECKPOINT, "step-1", "step-2")}
    found = []
    for path in Path("/dev/shm").glob(f"tiering-*{KEPT_SUFFIX}"):
        try:
            with path.open("rb") as file:
                file.seek(-HEADER_BYTES, 2)
                header = read_header(file.read(HEADER.size))
        except OSError:
            continue
        if header.digest in digests:
            found.append(path)
    return found


@pytest.fixture
def model():
    """A model of this test alone: its engines adopt no other test's region; every engine
    process started for it is killed, and every region kept for it removed, at the end."""
    name = f"survival-{uuid.uuid4().hex[:12]}"
    yield name
    for process in Engine.started.pop(name, []):
        process.kill()
    for path in kept_regions(name):
        path.unlink(missing_ok=True)


class Engine:
    """A `tests.survival_engine` process: `ask` sends a command and returns its answer."""

    started: ClassVar[dict[str, list["Engine"]]] = {}  # by model, for the fixture's clean-up

    def __init__(self, model: str, root_dir: Path | None = None, wait: bool = True, workers: int = 1):
        command = [sys.executable, "-m", "tests.survival_engine", model, str(CPU_BYTES), region_name(), str(workers)]
        command += [str(root_dir)] if root_dir else []
        self.process = subprocess.Popen(command, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        Engine.started.setdefault(model, []).append(self)
        self.adopted = self._answer()["started"] if wait else None

    def ask(self, **command) -> dict:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return self._answer()

    def kill(self) -> None:
        """SIGKILL, if it still runs; once it is gone, its pipes are closed."""
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None and not pipe.closed:
                with contextlib.suppress(BrokenPipeError):  # what it had not read goes with it
                    pipe.close()

    def _answer(self) -> dict:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        assert line, f"the engine died (exit status {self.process.wait()})"
        return json.loads(line)


def served(model: str, weights: str | None = None, workers: int = 1) -> tuple[dict[int, bytes], int]:
    """Start an engine of `model` (and `weights`, and `workers` ranks) in this process: the bytes
    of each block it serves from its CPU tier, by block number, and the blocks it counted adopted."""
    config = engine.config(CPU_BYTES, keep_on_stop=False, weights=weights)
    with TieringOffloadingSpec(config, engine.layout(model, workers), region_name()) as spec:
        primary = spec.get_manager().primary_tier
        rows, ctx, found = np.asarray(primary.get_kv_memoryview()), ReqContext("check"), {}
        for block, key in enumerate(keys(*range(engine.GPU_BLOCKS))):
            if primary.lookup(key, ctx):
                (row,) = primary.prepare_load([key], ctx).block_ids
                found[block] = rows[row].tobytes()
                primary.complete_load([key], ctx)
        return found, primary.get_stats()["counters"]["blocks_adopted"]


def rows_of(*blocks: int, workers: int = 1) -> dict[int, bytes]:
    return {block: engine.expected_row(block, workers) for block in blocks}


def stored_and_sealed(model: str, blocks: list[int]) -> Engine:
    process = Engine(model)
    assert process.ask(store=blocks, commit=True)["stored"] == blocks
    assert process.ask(seal=True) == {"sealed": True}
    return process


def test_a_store_copied_but_not_committed_is_not_adopted(model):
    process = stored_and_sealed(model, [0, 1, 2, 3])
    assert process.ask(store=[4, 5], commit=False)["stored"] == [4, 5]  # the GPU's copy is in the rows
    process.kill()
    assert served(model) == (rows_of(0, 1, 2, 3), 4)


def test_a_row_torn_by_a_copy_cut_short_is_not_adopted(model):
    process = stored_and_sealed(model, [0, 1, 2])
    assert process.ask(tear=9) == {"torn": 9}
    process.kill()
    assert served(model) == (rows_of(0, 1, 2), 3)


def test_blocks_committed_just_before_the_kill_are_adopted_only_if_sealed_and_exact(model):
    process = stored_and_sealed(model, [0, 1])
    process.ask(store=[2, 3, 4, 5, 6, 7], commit=True)  # killed while the sealer may be hashing them
    process.kill()
    found, adopted = served(model)
    assert rows_of(0, 1).items() <= found.items() <= rows_of(*range(8)).items()
    assert adopted == len(found)


def test_an_eviction_cut_short_leaves_the_evicted_rows_unadopted(model):
    process = stored_and_sealed(model, list(range(ROWS)))  # every row full
    answer = process.ask(store=[20, 21, 22], commit=False)  # evicts three, copies over them
    assert len(answer["evicted"]) == 3 and answer["stored"] == [20, 21, 22]
    process.kill()
    assert served(model) == (rows_of(*sorted(set(range(ROWS)) - set(answer["evicted"]))), ROWS - 3)


def test_a_promotion_from_the_file_tier_cut_short_is_not_adopted(model, tmp_path):
    process = Engine(model, root_dir=tmp_path / "kv")
    process.ask(store=[0, 1, 2, 3], commit=True)
    assert process.ask(cascade=True) == {"cascaded": True}  # the file tier holds them
    later = list(range(10, 10 + ROWS))
    assert sorted(process.ask(store=later, commit=True)["evicted"]) == [0, 1, 2, 3]  # the CPU tier does not
    assert process.ask(seal=True) == {"sealed": True}
    assert process.ask(cascade=True) == {"cascaded": True}  # their rows are idle again
    assert process.ask(promote=[0, 1, 2, 3]) == {"found": [None] * 4}  # promotions started: ask again
    process.kill()
    found, adopted = served(model)
    assert found.items() <= rows_of(0, 1, 2, 3, *later).items()  # byte-exact, whatever had landed
    assert len(found.keys() & set(later)) >= ROWS - 4 and adopted == len(found)  # the promotions took 4 rows


def test_an_engine_killed_after_adopting_leaves_the_blocks_to_the_next(model):
    stored_and_sealed(model, [0, 1, 2]).kill()
    second = Engine(model)
    assert second.adopted == 3
    second.kill()
    assert served(model) == (rows_of(0, 1, 2), 3)


def test_an_engine_killed_while_adopting_leaves_the_next_one_cold_or_warm_never_wrong(model):
    stored_and_sealed(model, [0, 1, 2]).kill()
    (kept,) = kept_regions(model)
    second = Engine(model, wait=False)
    while kept.exists():  # until the second engine has claimed it: its adoption has begun
        assert second.process.poll() is None
        time.sleep(0.001)
    second.kill()
    found, adopted = served(model)  # the region, kept again or a leftover removed at this start
    assert found.items() <= rows_of(0, 1, 2).items() and adopted == len(found)


def test_another_identity_or_weights_adopts_nothing_and_leaves_the_region_to_its_own(model):
    stored_and_sealed(model, [0, 1, 2]).kill()
    assert served(f"{model}-other") == ({}, 0)  # another model: another identity
    assert served(model, weights="step-1") == ({}, 0)
    (kept,) = kept_regions(model)
    kept.chmod(0o620)  # others could have written its rows and records: never trusted
    assert served(model) == ({}, 0)
    kept.chmod(0o600)
    assert served(model) == (rows_of(0, 1, 2), 3)
    assert kept_regions(model) == []  # adopted, and not kept on this stop


def test_a_graceful_stop_keeps_every_committed_block_for_the_next_engine(model):
    process = Engine(model)
    process.ask(store=[0, 1, 2, 3, 4], commit=True)
    assert process.ask(stop=True) == {"stopped": True}  # seals what is committed before it goes
    process.kill()
    assert served(model) == (rows_of(0, 1, 2, 3, 4), 5)


def test_a_region_two_workers_filled_is_adopted_whole_by_an_engine_of_two_workers(model):
    process = Engine(model, workers=2)  # the scheduler and both ranks hold their roles, then the region is kept
    assert process.ask(store=[0, 1, 2, 3], commit=True)["stored"] == [0, 1, 2, 3]
    assert process.ask(seal=True) == {"sealed": True}
    process.kill()
    assert served(model) == ({}, 0)  # one worker: another layout, another identity
    assert served(model, workers=2) == (rows_of(0, 1, 2, 3, workers=2), 4)  # both ranks' slots, byte for byte
