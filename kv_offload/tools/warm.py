"""`kv-offload warm`: fill a disk store ahead of serving by prefilling prompts in vLLM.

Runs an offline vLLM engine with the connector on (``SamplingParams(max_tokens=1)``), so
every full chunk of every prompt is stored; waits until the stores are committed in the
LMDB index (durable); reports new, already present and missing chunks. Chunks already in
the store are not written again: the connector skips them.

The namespace is the one the engine opened (``engine_namespace``). To know which chunks
a prompt has, its chunk keys are computed with vLLM's own request block hasher (the same
tokens, hash algorithm and ``cache_salt`` as the engine) and looked up in the store
before and after the run. If they cannot be computed, the counts fall back to the
namespace's commit counter. vLLM is imported only inside ``run_warm`` and
``chunk_keys_of``: validating the input needs no vLLM.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import psutil
from tqdm import tqdm

from kv_offload.config import OffloadConfig, format_size
from kv_offload.disk import StorePathError, iter_entries, list_namespaces
from kv_offload.disk.admin import namespaces_held_by
from kv_offload.disk.env import check_store_path
from kv_offload.keys import chunk_keys
from kv_offload.tools.warm_prompts import WarmPrompt, check_model, load_prompts

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30  # vLLM's CPU default (92% of RAM) fails on small hosts
POLL_S = 0.5
SETTLE_S = 1.0  # commits unchanged and no reservation for this long: the stores are durable
# The index helpers open and close this process's LMDB environment per call; one reader at
# a time (progress thread, main thread) so that two never overlap in this process.
_STORE_READ_LOCK = threading.Lock()


class WarmError(Exception):
    """Warming could not finish: the engine failed, or stores did not become durable."""


@dataclass(frozen=True)
class WarmOptions:
    """What `kv-offload warm` does. ``engine`` holds extra ``vllm.LLM`` keyword arguments."""

    model: str
    prompts: Path
    offload: OffloadConfig
    engine: dict[str, Any] = field(default_factory=dict)
    batch_size: int = 32
    timeout_s: float = 120.0  # wait at most this long for the stores to be durable
    show_progress: bool = True
    quiet_engine: bool = True  # vLLM logs only warnings (see run_warm)


@dataclass
class WarmSummary:
    """What a warm run did. Chunk counts are unique chunks of the workload; ``chunks``,
    ``already_present`` and ``not_stored`` are None when the keys could not be computed
    or matched (``new_chunks`` then counts the namespace's commits)."""

    store: str
    namespace: str
    model: str
    chunk_tokens: int
    chunk_bytes: int
    prompts: int
    skipped_prompts: int
    chunks: int | None
    new_chunks: int
    already_present: int | None
    not_stored: int | None
    bytes_written: int
    pending_writes: int
    evictions: int
    startup_s: float
    seconds: float
    notes: list[str] = field(default_factory=list)
    tails: int = 0  # prompt tails stored besides the chunks (partial_hits)

    @property
    def complete(self) -> bool:
        """Every chunk of the workload is in the store and durable."""
        return self.pending_writes == 0 and not self.not_stored

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "complete": self.complete}

    def lines(self) -> list[str]:
        rate = self.bytes_written / max(self.seconds - self.startup_s, 1e-9)
        chunks, present, missing = ("?" if n is None else n for n in (
            self.chunks, self.already_present, self.not_stored))
        durable = "yes" if not self.pending_writes else f"no, {self.pending_writes} pending"
        out = [
            f"warm: {'done' if self.complete else 'INCOMPLETE'} in {self.seconds:.1f} s "
            f"(engine start {self.startup_s:.1f} s)",
            f"  store      {self.store}",
            f"  namespace  {self.namespace} (chunk {self.chunk_tokens} tokens = "
            f"{format_size(self.chunk_bytes)})",
            f"  prompts    {self.prompts} warmed, {self.skipped_prompts} skipped",
            f"  chunks     {chunks} in the workload: {self.new_chunks} new, "
            f"{present} already present, {missing} not stored"
            + (f"; {self.tails} prompt tails" if self.tails else ""),
            f"  written    {format_size(self.bytes_written)} ({format_size(int(rate))}/s)",
            f"  durable    {durable}",
        ]
        return out + [f"  note: {n}" for n in self.notes]


# -- chunk keys and the store ----------------------------------------------------------------


def chunk_keys_of(token_ids: Sequence[Sequence[int]], salts: Sequence[str | None],
                  descriptor: dict) -> list[list[bytes]] | None:
    """The chunk keys the engine gives each prompt, or None if vLLM is unavailable.

    Builds each prompt's vLLM ``Request`` with the engine's own block hasher (the
    namespace's hash algorithm and hash block size), then picks the chunk keys as the
    connector does (``kv_offload.keys.chunk_keys``).
    """
    try:
        from vllm import SamplingParams
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request
    except ImportError:
        return None
    hash_fn = get_hash_fn_by_name(descriptor["hash_algo"])
    init_none_hash(hash_fn)
    per_hash, per_chunk = int(descriptor["tokens_per_hash"]), int(descriptor["chunk_tokens"])
    hasher, params = get_request_block_hasher(per_hash, hash_fn), SamplingParams(max_tokens=1)
    out = []
    for i, (ids, salt) in enumerate(zip(token_ids, salts)):
        request = Request(f"warm-{i}", list(ids), params, None, cache_salt=salt or None,
                          block_hasher=hasher)
        out.append(chunk_keys(request.block_hashes, tokens_per_hash=per_hash,
                              chunk_tokens=per_chunk))
    return out


def namespace_state(root: str, namespace_id: str) -> dict:
    """The namespace's record with counters (list_namespaces); {} if it is gone."""
    with _STORE_READ_LOCK:
        namespaces = list_namespaces(root)
    return next((n for n in namespaces if n["namespace_id"] == namespace_id), {})


def engine_namespace(root: str) -> dict:
    """The namespace the engine started by this process opened in the store at ``root``:
    the one whose slab files this process or its children (the engine's workers) hold
    open. Asking the engine, rather than recomputing the namespace id here, gives the
    connector's own answer (``layout_from_vllm(...).fingerprint()``, which needs the
    engine's KV cache config: it lives in the engine core process)."""
    me = psutil.Process()
    pids = [me.pid] + [child.pid for child in me.children(recursive=True)]
    held = namespaces_held_by(Path(root), pids)
    with _STORE_READ_LOCK:
        namespaces = [n for n in list_namespaces(root) if n["namespace_id"] in held]
    if len(namespaces) != 1:
        found = ", ".join(sorted(held)) or "none"
        raise WarmError(
            f"the engine did not open exactly one disk-tier namespace in {root} (found: "
            f"{found}); look for a kv-offload warning above (e.g. the disk tier is off when "
            "block hashes are not reproducible: set PYTHONHASHSEED or use "
            "--prefix-caching-hash-algo sha256)")
    return namespaces[0]


def _present(root: str, namespace_id: str, wanted: set[bytes]) -> set[bytes]:
    with _STORE_READ_LOCK:
        return {e.key for e, _ in iter_entries(root, namespace_id) if e.key in wanted}


# -- progress --------------------------------------------------------------------------------


class Progress:
    """The warm progress bar on ``stream`` (tqdm): prompts done, chunks and bytes stored,
    a status. Redrawn at most twice a second on a terminal, every 10 s elsewhere; the
    final state is always drawn. Thread-safe (the main thread and the commit poller)."""

    def __init__(self, stream: TextIO, total: int, *, enabled: bool = True) -> None:
        tty = hasattr(stream, "isatty") and stream.isatty()
        self._bar = tqdm(total=total, file=stream, disable=not enabled, desc="warm",
                         bar_format="{desc} {n_fmt}/{total_fmt} prompts | {postfix} | "
                         "{elapsed}", mininterval=0.5 if tty else 10.0, dynamic_ncols=tty)
        self.fields, self.status = {"done": 0, "chunks": 0, "bytes": 0}, ""
        self._start, self._lock = time.monotonic(), threading.Lock()
        self._bar.set_postfix_str(self._postfix(), refresh=False)

    def update(self, **fields: Any) -> None:
        """Set ``done`` (prompts), ``chunks``, ``bytes`` and/or ``status``; redraw if due."""
        with self._lock:
            self.status = fields.pop("status", self.status)
            self.fields.update(fields)
            self._bar.set_postfix_str(self._postfix(), refresh=False)
            self._bar.update(self.fields["done"] - self._bar.n)

    def close(self, **fields: Any) -> None:
        """Draw the final state and end the line."""
        with self._lock:
            self.fields.update(fields)
            self.status = "done"
            self._bar.n = self.fields["done"]
            self._bar.set_postfix_str(self._postfix(), refresh=False)
            self._bar.refresh()
            self._bar.close()

    def _postfix(self) -> str:
        f, elapsed = self.fields, time.monotonic() - self._start
        rate = format_size(int(f["bytes"] / max(elapsed, 1e-9)))
        return (f"{f['chunks']} chunks stored | {format_size(f['bytes'])} | {rate}/s"
                + (f" | {self.status}" if self.status else ""))


def _poll_commits(root: str, ns: dict, progress: Progress, stop: threading.Event) -> None:
    base, chunk_bytes = ns["counters"]["commits"], ns["slot_bytes"] * ns["num_ranks"]
    while not stop.wait(POLL_S):
        counters = namespace_state(root, ns["namespace_id"]).get("counters")
        if counters:
            chunks = max(counters["commits"] - base, 0)
            progress.update(chunks=chunks, bytes=chunks * chunk_bytes)


def wait_durable(root: str, namespace_id: str, timeout_s: float, progress: Progress) -> int:
    """Poll until the namespace has no reservation and its commits stayed unchanged for
    SETTLE_S; return the reservations still held at ``timeout_s`` (0: durable)."""
    deadline, last, since = time.monotonic() + timeout_s, None, time.monotonic()
    while True:
        counters = namespace_state(root, namespace_id).get("counters", {})
        now, seen = time.monotonic(), (counters.get("commits"), counters.get("reserved", 0))
        if seen != last:
            last, since = seen, now
        if not seen[1] and now - since >= SETTLE_S:
            return 0
        if now >= deadline:
            return seen[1]
        progress.update(status=f"waiting for {seen[1]} disk writes" if seen[1] else "settling")
        time.sleep(POLL_S / 2)


# -- the run ---------------------------------------------------------------------------------


def _tokenize(tokenizer: Any, prompt: WarmPrompt) -> list[int]:
    if prompt.messages is None:
        return list(tokenizer.encode(prompt.text))
    try:
        text = tokenizer.apply_chat_template(list(prompt.messages), tokenize=False,
                                             add_generation_prompt=True)
    except Exception as exc:  # no template, bad roles: the tokenizer's own message
        raise ValueError(f"{prompt.origin}: cannot render chat messages with the model's "
                         f"chat template ({exc}); use a \"prompt\" line instead") from None
    return list(tokenizer.encode(text, add_special_tokens=False))


def validate(options: WarmOptions) -> list[WarmPrompt]:
    """Every check that needs no engine; returns the prompts. ValueError names the fix."""
    if options.offload.disk_path is None:
        raise ValueError("warm needs a disk path (--disk-path or disk_path in --config): the "
                         "CPU tier lives in this process and is gone when warm exits")
    try:
        check_store_path(Path(options.offload.disk_path))
    except StorePathError as exc:
        raise ValueError(str(exc)) from None
    check_model(options.model)
    if options.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {options.batch_size}")
    if options.engine.get("block_size") is not None:
        max_model_len = options.engine.get("max_model_len")
        options.offload.resolve_chunk_tokens(
            int(options.engine["block_size"]),
            max_model_len=None if max_model_len is None else int(max_model_len))
    return load_prompts(options.prompts)


def run_warm(options: WarmOptions, *, stream: TextIO = sys.stderr) -> WarmSummary:
    """Warm ``options.offload.disk_path`` with the prompts; progress goes to ``stream``.

    Raises ValueError for bad input (before any engine starts) and WarmError when the
    engine fails. Starts one vLLM engine (needs the ``__main__`` guard in scripts). Sets
    VLLM_LOGGING_STREAM to stderr and, with ``quiet_engine``, VLLM_LOGGING_LEVEL to
    WARNING in os.environ unless they are set: the engine processes inherit them.
    """
    prompts = validate(options)
    # The engine processes inherit these; stdout is kept for the caller's summary.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    if options.quiet_engine:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    engine = {k: v for k, v in options.engine.items() if v is not None}
    if current_platform.is_cpu() and not {"kv_cache_memory_bytes", "gpu_memory_utilization"} \
            & engine.keys() and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        engine["kv_cache_memory_bytes"] = DEFAULT_CPU_KV_CACHE_BYTES
    root, t0 = str(options.offload.disk_path), time.time()
    try:
        llm = LLM(model=options.model, kv_transfer_config=options.offload.to_kv_transfer_config(),
                  **engine)
    except Exception as exc:
        raise WarmError(f"the vLLM engine failed to start: {exc}") from exc
    try:
        return _warm(llm, SamplingParams(max_tokens=1, temperature=0.0), prompts, options,
                     (root, t0, stream))
    finally:
        del llm


def _warm(llm: Any, params: Any, prompts: list[WarmPrompt], options: WarmOptions,
          where: tuple[str, float, TextIO]) -> WarmSummary:
    root, t0, stream = where
    startup = time.time() - t0
    vllm_config = llm.llm_engine.vllm_config
    ns = engine_namespace(root)
    desc, chunk_bytes = ns["descriptor"], ns["slot_bytes"] * ns["num_ranks"]
    tokenizer, max_len = llm.get_tokenizer(), vllm_config.model_config.max_model_len
    work, notes = [], []
    for prompt in prompts:
        ids = _tokenize(tokenizer, prompt)
        if 0 < len(ids) < max_len:
            work.append((prompt, ids))
    if len(work) < len(prompts):
        notes.append(f"{len(prompts) - len(work)} prompts skipped: empty, or not shorter "
                     f"than max_model_len {max_len} (raise --max-model-len)")
    keys = chunk_keys_of([ids for _, ids in work], [p.cache_salt for p, _ in work], desc)
    wanted = {k for ks in keys for k in ks} if keys is not None else set()
    before = _present(root, ns["namespace_id"], wanted) if wanted else set()
    if keys is not None and not wanted:
        notes.append(f"no prompt has a full chunk ({desc['chunk_tokens']} tokens): nothing "
                     "to store")
    if len(wanted) > ns["num_slots"]:
        notes.append(f"the workload has {len(wanted)} chunks but the namespace holds "
                     f"{ns['num_slots']}: raise --disk-size")
    progress, stop = Progress(stream, len(work), enabled=options.show_progress), threading.Event()
    poller = threading.Thread(target=_poll_commits, args=(root, ns, progress, stop), daemon=True)
    poller.start()
    try:
        for start in range(0, len(work), options.batch_size):
            batch = [{"prompt_token_ids": ids, **({"cache_salt": p.cache_salt}
                                                 if p.cache_salt else {})}
                     for p, ids in work[start:start + options.batch_size]]
            try:
                llm.generate(batch, params, use_tqdm=False)
            except Exception as exc:
                raise WarmError(f"the engine failed on prompts {start + 1}-{start + len(batch)}"
                                f": {exc}; chunks committed so far are kept, re-run to "
                                "continue") from exc
            progress.update(done=start + len(batch))
        pending = wait_durable(root, ns["namespace_id"], options.timeout_s, progress)
    finally:
        stop.set()
        poller.join()
    after = namespace_state(root, ns["namespace_id"])
    commits = after["counters"]["commits"] - ns["counters"]["commits"]
    tails = min(commits, max(0, after.get("tails", 0) - ns.get("tails", 0)))
    progress.close(chunks=commits, bytes=commits * chunk_bytes)
    evictions = after["counters"]["evictions"] - ns["counters"]["evictions"]
    summary = WarmSummary(
        store=root, namespace=ns["namespace_id"], model=desc["model"],
        chunk_tokens=desc["chunk_tokens"], chunk_bytes=chunk_bytes, prompts=len(work),
        skipped_prompts=len(prompts) - len(work), chunks=None, new_chunks=commits - tails,
        already_present=None, not_stored=None, bytes_written=commits * chunk_bytes,
        pending_writes=pending, evictions=evictions, startup_s=startup,
        seconds=time.time() - t0, notes=notes, tails=tails)
    if keys is not None:
        _count_by_keys(summary, root, wanted, before, commits)
    if pending:
        notes.append(f"{pending} disk writes were still pending after {options.timeout_s:.0f} "
                     "s (--timeout); those chunks are not durable")
    if evictions:
        notes.append(f"{evictions} chunks were evicted to make room: the namespace is full, "
                     "raise --disk-size")
    if summary.not_stored and not evictions:
        notes.append("some chunks found no free CPU slot while being stored: lower "
                     "--batch-size or raise --cpu-size, then run warm again")
    return summary


def _count_by_keys(summary: WarmSummary, root: str, wanted: set[bytes], before: set[bytes],
                   commits: int) -> None:
    """Fill the per-chunk counts from the keys present before and after the run."""
    after = _present(root, summary.namespace, wanted)
    new = len(after - before)
    if commits and not new and not before:
        summary.notes.append("could not match the workload's chunk keys with the store (a "
                             "different vLLM hashing?); counts come from the commit counter")
        return
    summary.chunks, summary.new_chunks, summary.already_present = len(wanted), new, len(before)
    summary.not_stored = len(wanted - after)
    summary.bytes_written = new * summary.chunk_bytes
