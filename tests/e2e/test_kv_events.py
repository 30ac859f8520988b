"""Routers see every tier: vLLM's ZMQ KV event stream, replayed into a small prefix index,
predicts exactly what kv-offload loads, through stores, evictions, a reset and a restart.

One engine runs the workload (a CPU tier of 4 chunks and a disk tier of 6, so both evict),
then a second engine opens the same disk store: with no request at all, its announcement
alone rebuilds the index. The index is what a router keeps: (parent hash, token ids) ->
block hash from ``BlockStored``, the tiers holding each hash, ``BlockRemoved`` taking them
away; vLLM's own GPU events (medium GPU) are ignored. Before each prompt vLLM's prefix
cache is reset, so what the engine gets from outside it is what kv-offload loads.
"""

from __future__ import annotations

import random
import socket
import threading
import time
from pathlib import Path

import pytest

from kv_offload.testing.engine import EngineProcess, offload_transfer
from kv_offload.testing.tiny_model import make_tiny_model

pytestmark = pytest.mark.engine

CHUNK, BLOCK = 64, 32  # tokens; the harness's engines use 32-token blocks
PROMPT_TOKENS = 200  # three whole chunks, and a rest that no chunk covers


class PrefixIndex:
    """A router's view of one instance's offloaded KV, replayed from its KV events."""

    def __init__(self) -> None:
        self.children: dict[tuple, object] = {}  # (parent hash, token ids) -> block hash
        self.tiers: dict[object, set[tuple]] = {}  # block hash -> {(medium, locality)}
        self.num_events = 0
        # block hash -> (parent, token ids, extra keys) as vLLM's GPU events and ours say
        self.described: dict[str, dict[object, tuple]] = {"GPU": {}, "ours": {}}

    def apply(self, event) -> None:
        from vllm.distributed.kv_events import BlockRemoved, BlockStored

        if isinstance(event, BlockStored):
            self._describe(event)
        if getattr(event, "medium", None) in (None, "GPU"):
            return
        self.num_events += 1
        tier = (event.medium, event.locality)
        if isinstance(event, BlockStored):
            parent = event.parent_block_hash
            for i, h in enumerate(event.block_hashes):
                tokens = tuple(event.token_ids[i * event.block_size:(i + 1) * event.block_size])
                self.children[(parent, tokens)] = h
                self.tiers.setdefault(h, set()).add(tier)
                parent = h
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                self.tiers.get(h, set()).discard(tier)

    def _describe(self, event) -> None:
        seen = self.described["GPU" if event.medium == "GPU" else "ours"]
        parent, size = event.parent_block_hash, event.block_size
        for i, h in enumerate(event.block_hashes):
            extra = event.extra_keys[i] if event.extra_keys else None
            seen[h] = (parent, tuple(event.token_ids[i * size:(i + 1) * size]), extra)
            parent = h

    def predicted_hit(self, tokens: list[int]) -> int:
        """Tokens kv-offload can load for a prompt of ``tokens``: the leading blocks held
        by a tier, in whole chunks, leaving the last prompt token to compute."""
        parent, held = None, 0
        for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
            h = self.children.get((parent, tuple(tokens[start:start + BLOCK])))
            if h is None or not self.tiers.get(h):
                break
            parent, held = h, held + BLOCK
        return min(held, (len(tokens) - 1) // CHUNK * CHUNK) // CHUNK * CHUNK


class Subscriber:
    """Collects vLLM's ZMQ KV events in a thread (connected before the engine binds)."""

    def __init__(self, port: int) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.RCVTIMEO, 100)
        self._sock.connect(f"tcp://127.0.0.1:{port}")
        self._decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode
        self.index, self.received = PrefixIndex(), 0  # received: the last seq seen + 1
        self._lock, self._stop = threading.Lock(), False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        while not self._stop:
            try:
                _topic, seq, payload = self._sock.recv_multipart()
            except zmq.Again:
                continue
            with self._lock:
                for event in self._decode(payload).events:
                    self.index.apply(event)
                self.received = max(self.received, int.from_bytes(seq, "big") + 1)

    def settle(self, engine: EngineProcess, timeout_s: float = 30.0) -> PrefixIndex:
        """The index once every batch ``engine`` has published so far arrived (its
        sequence numbers; it waited for a second without events, which a busy host
        could outlast with events still on their way). ``timeout_s`` bounds a hang only."""
        sent = engine.kv_events_sent()
        deadline = time.monotonic() + timeout_s
        while self.received < sent:
            assert time.monotonic() < deadline, f"{self.received} of {sent} event batches came"
            time.sleep(0.01)
        return self.index

    def close(self) -> None:
        self._stop = True
        self._thread.join(timeout=5)
        self._sock.close(linger=0)
        self._ctx.term()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 500) for _ in range(PROMPT_TOKENS)]


PROMPTS = [prompt(s) for s in range(5)]
SALTED = 4  # this prompt carries a cache_salt: its first block's extra keys name it


def start(model: Path, store: Path, port: int, log: Path) -> EngineProcess:
    extra = {"cpu_size": "2MiB", "disk_path": str(store), "disk_size": "3MiB",
             "chunk_tokens": CHUNK, "io_threads": 1}
    events = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": f"tcp://*:{port}"}
    return EngineProcess(model, log_path=log, transfer=offload_transfer(extra),
                         engine={"kv_events_config": events}, in_process=True)


def run_checked(engine: EngineProcess, sub: Subscriber, order: list[int]) -> list[tuple]:
    """Each prompt of ``order`` alone, after vLLM's prefix cache was reset: (prompt,
    predicted, loaded) for each."""
    out = []
    for i in order:
        engine.drain()
        assert engine.reset()
        predicted = sub.settle(engine).predicted_hit(PROMPTS[i])
        request = {"prompt_token_ids": PROMPTS[i]}
        if i == SALTED:
            request["cache_salt"] = "tenant-a"
        got = engine.generate([request], max_tokens=2)
        loaded = int(got["metrics"]["external_hits"])
        out.append((i, predicted, loaded // CHUNK * CHUNK))  # whole chunks: a partial
    return out  # hit's tail (CPU tier only) is below vLLM's block size, never announced


@pytest.fixture(scope="module")
def model() -> Path:
    return make_tiny_model()


def test_replayed_events_predict_every_load_through_evictions_a_reset_and_a_restart(
        model, tmp_path):
    store = tmp_path / "store"
    port = free_port()
    sub = Subscriber(port)
    try:
        with start(model, store, port, tmp_path / "first.log") as engine:
            # cold, CPU hit, then enough prompts to evict from both tiers, then back
            seen = run_checked(engine, sub, [0, 0, 1, 2, 3, 0, 1, 4, 2])
            assert {p for _, p, _ in seen} >= {0, 3 * CHUNK}, seen  # misses and hits
            engine.drain()
            assert engine.reset(connector=True)  # the CPU tier and, for the run, the disk
            seen += run_checked(engine, sub, [1, 4])
        assert all(p == got for _, p, got in seen), seen
        gpu, ours = sub.index.described["GPU"], sub.index.described["ours"]
        assert ours and ours.keys() <= gpu.keys()  # every block we announced, vLLM did too
        assert all(ours[h] == gpu[h] for h in ours)  # with its parent, tokens, extra keys
        assert any(extra for _, _, extra in ours.values())  # the salted prompt's first block
    finally:
        sub.close()

    port = free_port()
    sub = Subscriber(port)  # a router that knew nothing of this instance
    try:
        with start(model, store, port, tmp_path / "restart.log") as engine:
            engine.drain()  # no request: the disk tier's announcement alone
            index = sub.settle(engine)
            assert index.num_events > 0
            after = run_checked(engine, sub, [4, 3, 2, 1, 0])
        assert all(p == got for _, p, got in after), after
        assert any(p == 3 * CHUNK for _, p, _ in after), after  # the disk tier served
    finally:
        sub.close()
