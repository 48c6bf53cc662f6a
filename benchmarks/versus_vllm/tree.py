"""vLLM's own KV-offloading code, as its wheel ships it, importable without the rest of vLLM.

`build` downloads the ``vllm==VLLM_VERSION`` wheel once (``pip download --no-deps``, with the
pip of the running Python, its progress on stderr after a line that says where it goes) into
a cache directory (``--cache``; `default_cache`), unzips ``vllm/v1/kv_offload/**`` and the
pure modules it imports (`EXTRACTED`) unchanged, and writes a stand-in for every other vLLM
module on their import paths (`STAND_INS`): a module whose every name is an inert class, and
``init_logger`` a standard logger. No stand-in is on a measured path: they are config types,
metrics plumbing and device helpers that a manager built on a CPU never calls.

Thread: the CLI's.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

VLLM_VERSION = "0.33.0"
WHEEL_MB = 340  # the wheel's size, for the line that says a download starts
EXTRACTED = (
    "vllm/v1/kv_offload/*",
    "vllm/v1/metrics/cache_hit_source.py",
    "vllm/utils/math_utils.py",
    "vllm/distributed/kv_transfer/kv_connector/v1/metrics.py",
    "vllm/distributed/kv_transfer/kv_connector/v1/offloading/metrics.py",
)
STAND_INS = (
    "vllm/logger.py",
    "vllm/config/__init__.py",
    "vllm/platforms/__init__.py",
    "vllm/v1/kv_hints.py",
    "vllm/distributed/kv_transfer/kv_connector/factory.py",
    "vllm/distributed/device_communicators/shm_broadcast.py",
    "vllm/distributed/device_communicators/cuda_wrapper.py",
    "vllm/distributed/kv_transfer/kv_connector/v1/offloading/canonical_mapping.py",
)
STAND_IN = '''"""A stand-in written by tiering.benchmarks.versus_vllm.tree: not vLLM's code."""
import logging


def init_logger(name):
    return logging.getLogger(name)


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return type(name, (), {"__init__": lambda self, *args, **kwargs: None})
'''


def default_cache() -> Path:
    """``$XDG_CACHE_HOME/kv-tiering`` (else ``~/.cache/kv-tiering``)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kv-tiering"


def build(cache: Path) -> Path:
    """The importable tree (``<cache>/vllm-<VLLM_VERSION>/tree``, rebuilt from the wheel on
    every call; the wheel is downloaded once).

    Raises:
        RuntimeError: pip could not download the wheel (its error's end in the message).
    """
    wheels = cache / f"vllm-{VLLM_VERSION}"
    wheel = next(wheels.glob(f"vllm-{VLLM_VERSION}-*.whl"), None)
    if wheel is None:
        wheels.mkdir(parents=True, exist_ok=True)
        print(
            f"versus_vllm: fetching the vllm=={VLLM_VERSION} wheel (about {WHEEL_MB} MB, once) with pip into {wheels}; "
            "--cache DIR keeps it elsewhere",
            file=sys.stderr,
            flush=True,
        )
        command = [sys.executable, "-m", "pip", "download", "--no-deps", f"vllm=={VLLM_VERSION}", "-d", str(wheels)]
        # pip's progress (a bar on a terminal) to our stderr, beside the tables on stdout; its errors kept
        done = subprocess.run([*command, "--progress-bar", "on"], stdout=2, stderr=subprocess.PIPE, text=True)
        wheel = next(wheels.glob(f"vllm-{VLLM_VERSION}-*.whl"), None)
        if done.returncode != 0 or wheel is None:
            raise RuntimeError(f"pip download vllm=={VLLM_VERSION} failed: {done.stderr.strip()[-1000:]}")
    tree = wheels / "tree"
    shutil.rmtree(tree, ignore_errors=True)
    with zipfile.ZipFile(wheel) as archive:
        names = [name for name in archive.namelist() if any(fnmatch.fnmatchcase(name, p) for p in EXTRACTED)]
        archive.extractall(tree, names)
    for name in STAND_INS:
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_text(STAND_IN)
    for directory in [tree / "vllm", *(tree / "vllm").rglob("*")]:
        if directory.is_dir() and not (directory / "__init__.py").exists():
            (directory / "__init__.py").write_text(STAND_IN)
    return tree
