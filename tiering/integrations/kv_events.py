"""The KV events a vLLM engine publishes (``--kv-events-config``), as a router receives them.

`KvEventsSubscriber` is a router's end of vLLM's ZMQ publisher: it decodes each batch into
vLLM's own event types (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`). As a command it
prints them, one line (or JSON object) per event, to watch what each tier of an engine
announces::

    python -m tiering.integrations.kv_events --connect tcp://127.0.0.1:5557   # vLLM binds tcp://*:5557
    python -m tiering.integrations.kv_events --bind tcp://127.0.0.1:5557      # vLLM connects to it
    python -m tiering.integrations.kv_events --connect tcp://127.0.0.1:5557 --json --count 100

Needs vLLM (its event types, pyzmq and msgspec come with it): run it in vLLM's venv.
Thread: the subscriber receives on a thread of its own and calls `on_batch` there; the
command, the main thread.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from collections.abc import Callable
from typing import Any


class KvEventsSubscriber:
    """A ZMQ SUB socket on vLLM's publisher: bound at `endpoint` (None: a free port of
    127.0.0.1, the bound address in `endpoint` then; vLLM's publisher connects to it), or connected to it
    (`connect`: vLLM binds it); receiving on a thread of its own, it decodes each batch into
    vLLM's event types and hands them to `on_batch(topic, sequence number, events)`; only
    topics that start with `topics`.

    Raises:
        ImportError: vLLM (or pyzmq, msgspec) is not installed.
        zmq.ZMQError: the endpoint cannot be bound or connected to.
    """

    def __init__(
        self,
        on_batch: Callable[[str, int, list[Any]], None],
        topics: str = "",
        endpoint: str | None = None,
        connect: bool = False,
    ):
        import zmq
        from msgspec.msgpack import Decoder
        from vllm.distributed.kv_events import KVEventBatch

        self._on_batch = on_batch
        self._socket = zmq.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, topics.encode())
        self._socket.setsockopt(zmq.RCVTIMEO, 200)
        if connect and endpoint is not None:
            self._socket.connect(endpoint)
        else:  # "*" as the port: ZMQ binds a free one
            self._socket.bind(endpoint or "tcp://127.0.0.1:*")
        self.endpoint: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT) if endpoint is None else endpoint
        self._decoder = Decoder(type=KVEventBatch)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._receive, name="kv-events-subscriber", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop receiving and close the socket (waits up to 5 s for the thread)."""
        self._stop.set()
        self._thread.join(5)
        self._socket.close(linger=0)

    def _receive(self) -> None:
        import zmq

        while not self._stop.is_set():
            try:
                topic, sequence, payload = self._socket.recv_multipart()
            except zmq.Again:
                continue
            number = int.from_bytes(sequence, "big", signed=True)
            self._on_batch(topic.decode(errors="replace"), number, self._decoder.decode(payload).events)


def as_dict(event: Any) -> dict[str, Any]:
    """`event` (one of vLLM's KV events) as JSON-ready fields: its type first, then the fields
    it has set (byte hashes as hex). Pure."""
    fields: dict[str, Any] = {"type": type(event).__name__}
    for name in getattr(event, "__struct_fields__", ()):
        value = getattr(event, name)
        if value is not None:
            fields[name] = _plain(value)
    return fields


def _plain(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    return value


def describe(topic: str, sequence: int, event: Any) -> str:
    """One line of `event`: topic, batch number, type, where (medium, locality, ownership,
    KV-cache group) and its blocks (hashes cut to 16 hex digits), with token counts when the
    event describes them. Pure."""
    fields = as_dict(event)
    kind = fields.pop("type")
    where = " ".join(
        f"{name}={fields.pop(name)}" for name in ("medium", "locality", "ownership", "group_idx") if name in fields
    )
    hashes = [str(h)[:16] for h in fields.pop("block_hashes", [])]
    blocks = f" blocks={len(hashes)}: {' '.join(hashes)}" if hashes else ""
    tokens = fields.get("token_ids")
    described = f" tokens={len(tokens)} block_size={fields.get('block_size')}" if tokens else ""
    return f"{topic or '-'} #{sequence} {kind} {where}{blocks}{described}".replace("  ", " ")


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring). Returns 0 once `--count` events were
    printed or Ctrl-C stopped it; 2 where the endpoint cannot be used."""
    parser = argparse.ArgumentParser(
        prog="python -m tiering.integrations.kv_events",
        description="Print the KV events a vLLM engine publishes (--kv-events-config), one per line.",
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--connect", metavar="ENDPOINT", help="connect to vLLM's endpoint (it binds tcp://*:PORT)")
    where.add_argument("--bind", metavar="ENDPOINT", help="bind here; vLLM's endpoint names this address")
    parser.add_argument("--topic", default="", help="only topics that start with this (default: all)")
    parser.add_argument("--json", action="store_true", help="one JSON object per event instead of a line")
    parser.add_argument("--count", type=int, default=0, help="stop after this many events (default: never)")
    args = parser.parse_args(argv)
    done = threading.Event()
    printed = 0
    lock = threading.Lock()

    def show(topic: str, sequence: int, events: list[Any]) -> None:
        nonlocal printed
        with lock:
            for event in events:
                if done.is_set():
                    return
                if args.json:
                    line = json.dumps({"topic": topic, "seq": sequence, **as_dict(event)})
                else:
                    line = describe(topic, sequence, event)
                print(line, flush=True)
                printed += 1
                if printed == args.count:
                    done.set()

    try:
        subscriber = KvEventsSubscriber(show, args.topic, args.connect or args.bind, connect=bool(args.connect))
    except Exception as exc:  # zmq.ZMQError: a bad or busy endpoint
        print(f"kv_events: {args.connect or args.bind}: {exc}", file=sys.stderr)
        return 2
    print(f"kv_events: listening on {subscriber.endpoint} (Ctrl-C stops)", file=sys.stderr, flush=True)
    try:
        done.wait()
    except KeyboardInterrupt:
        pass
    finally:
        subscriber.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
