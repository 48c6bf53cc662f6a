"""`python -m tiering.integrations.kv_events` prints what vLLM's own publisher sends: a new user
had to write a subscriber with zmq and msgspec to see an engine's events. vLLM's
`ZmqEventPublisher` publishes here, as ``--kv-events-config`` makes it do in a server."""

import json
import subprocess
import sys
import time

import pytest
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher

from tiering.testing.processes import free_port

pytestmark = pytest.mark.timeout(120)


def test_the_command_prints_each_event_vllms_publisher_sends():
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    command = [sys.executable, "-m", "tiering.integrations.kv_events", "--bind", endpoint, "--json", "--count", "2"]
    listener = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert listener.stderr.readline().startswith(f"kv_events: listening on {endpoint}")
    publisher = ZmqEventPublisher(0, endpoint=endpoint, topic="kv@replica-0@tiny")  # connects: the listener binds
    stored = BlockStored(
        block_hashes=[b"\x01" * 32, b"\x02" * 32],
        parent_block_hash=None,
        token_ids=[],
        block_size=0,
        lora_id=None,
        medium="STORAGE",
        lora_name=None,
        locality="LOCAL",
        ownership="file",
    )
    removed = BlockRemoved(block_hashes=[b"\x01" * 32], medium="CPU", locality="LOCAL")
    try:
        while listener.poll() is None:  # a subscription takes a moment to reach a publisher: batches before it are lost
            publisher.publish(KVEventBatch(ts=time.time(), events=[stored, removed]))
            time.sleep(0.05)
        out = listener.stdout.read()
    finally:
        publisher.shutdown()
        if listener.poll() is None:
            listener.kill()
        listener.wait()
        listener.stdout.close()
        listener.stderr.close()
    assert listener.returncode == 0
    first, second = (json.loads(line) for line in out.splitlines()[:2])
    assert first["topic"] == "kv@replica-0@tiny" and first["type"] == "BlockStored"
    assert first["block_hashes"] == ["01" * 32, "02" * 32]
    assert (first["medium"], first["locality"], first["ownership"]) == ("STORAGE", "LOCAL", "file")
    assert second["type"] == "BlockRemoved" and second["medium"] == "CPU" and second["seq"] == first["seq"]
