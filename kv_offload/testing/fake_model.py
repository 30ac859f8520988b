"""A fake model for the scheduler harness: KV is a deterministic function of the tokens.

``FakeModelRunner`` plays vLLM's GPU model runner for one rank without a model: it keeps
each request's tokens and block table from the ``SchedulerOutput``s (as
``GPUModelRunner._update_states`` does), calls the worker-side connector in the order of
one of vLLM's model runners (``model_runner``, docs/architecture.md "Hook order on both
model runners"), and in its "forward" first checks that the KV of every position before
the scheduled ones holds the KV of the request's tokens (``KVMismatchError`` otherwise:
a token would be computed on wrong KV), then writes the KV of the scheduled positions;
sampling then gives a token that depends on every token before it.

- ``"v1"`` (``gpu_model_runner.py``; the CPU backend up to vLLM 0.33):
  ``handle_preemptions``, the request states (zeroing and copy-on-write copies
  included), bind, sync ``start_load_kv``, forward, async ``start_load_kv``,
  ``wait_for_save``, ``get_finished``, sampling.
- ``"v2"`` (``gpu/model_runner.py``; the only runner in vLLM 0.34): the request states
  first (``update_requests``), then ``pre_forward``'s ``handle_preemptions``, bind and
  sync ``start_load_kv``, forward, ``finish_forward`` (where vLLM has it), sampling, then
  ``post_forward``'s async ``start_load_kv``, ``wait_for_save``, ``get_finished``.

What differs between vLLM versions in the ``SchedulerOutput`` and ``ModelRunnerOutput``
is read and built through ``vllm_compat``.

KV of position p on layer l: 8 float32 values derived from a hash of tokens[0..p], in a
CPU-backend KV tensor of shape [num_blocks, 1 head, block_size, 8] per layer.

KV cache groups (``FakeGroup``) play vLLM's hybrid KV cache manager: each group has its
own block table and its own layers, and the layers of every group are views of the same
tensors (a block id belongs to one group at a time). A sliding-window group's forward
reads, and so checks, only the window: positions from p - window + 1 on.

A mamba group ("align" mode, ``FakeGroup.mamba``) keeps one state per request: the state
after p tokens on layer l is the KV row of position p - 1 (a function of every token up to
it), in the first row of a block's page; the rest of the page is vLLM's padding (its
mamba page is padded to the attention page). As vLLM's align mode does, a step over
tokens [s, e) reads the state after s from table entry ``cdiv(s, block) - 1`` (checked:
a null block or another state is a mismatch) and writes the state after e into entry
``cdiv(e, block) - 1``; a new request starts from no state.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kv_offload.testing import vllm_compat

ROW = 8  # floats per token and layer: K and V of one head of size 4
_MASK = (1 << 64) - 1


class KVMismatchError(AssertionError):
    """A token was about to be computed on KV that is not the KV of its prefix
    (``position``: the first wrong position, when known)."""

    position: int | None = None


def prefix_hashes(tokens: list[int], done: list[int]) -> list[int]:
    """Extend ``done`` (hashes of a prefix of ``tokens``) to all of ``tokens``."""
    h = done[-1] if done else 0x9E3779B97F4A7C15
    for tok in tokens[len(done):]:
        h = ((h ^ (tok + 1)) * 0x100000001B3) & _MASK
        h ^= h >> 29
        done.append(h)
    return done


def kv_rows(hashes: list[int] | np.ndarray, layer: int) -> np.ndarray:
    """The KV rows ([n, ROW] float32) of positions with these prefix hashes."""
    h = np.asarray(hashes, dtype=np.uint64)[:, None]
    shifts = np.arange(ROW, dtype=np.uint64)[None, :] * np.uint64(7)
    values = (h >> shifts) & np.uint64(0xFFFF)
    return (values.astype(np.float32) + np.float32(layer * 65536))


def next_token(prefix_hash: int) -> int:
    return int(prefix_hash % 1000) + 3


def make_kv_tensors(num_layers: int, num_blocks: int, block_size: int) -> list[torch.Tensor]:
    """Zeroed CPU-backend KV tensors (NaN-free, so a never-written block shows as wrong)."""
    return [torch.zeros(num_blocks, 1, block_size, ROW, dtype=torch.float32)
            for _ in range(num_layers)]


@dataclass(frozen=True, slots=True)
class FakeGroup:
    """One KV cache group: the KV index of its layers (``kv_rows``' ``layer``; one per
    tensor, in tensor order) and its sliding window (0: full attention)."""

    layers: tuple[int, ...]
    window: int = 0
    mamba: bool = False  # a mamba group in vLLM's "align" mode: one state, see above


@dataclass(slots=True)
class _RequestState:
    prompt: list[int]
    output: list[int] = field(default_factory=list)
    block_ids: list[list[int]] = field(default_factory=list)  # one table per group
    hashes: list[int] = field(default_factory=list)

    def tokens(self) -> list[int]:
        return self.prompt + self.output


class FakeModelRunner:
    """One rank's model runner around a worker-side connector (see module docstring).

    ``on_background(step)`` runs between the forward and ``get_finished``: the harness
    lets the connector's background tasks progress there. ``model_runner``: the hook
    order, "v1" or "v2"; None: the one the installed vLLM's CPU backend runs
    (``vllm_compat.default_model_runner``).
    """

    def __init__(self, connector: Any, kv: list[torch.Tensor], block_size: int, *,
                 async_scheduling: bool, on_background: Callable[[], None],
                 groups: tuple[FakeGroup, ...] | None = None,
                 model_runner: str | None = None) -> None:
        model_runner = model_runner or vllm_compat.default_model_runner()
        if model_runner not in vllm_compat.MODEL_RUNNERS:
            raise ValueError(f"model_runner must be one of {vllm_compat.MODEL_RUNNERS}, "
                             f"got {model_runner!r}")
        self.model_runner = model_runner
        self.connector = connector
        self.kv = kv
        self.groups = groups or (FakeGroup(tuple(range(len(kv)))),)
        self.block_size = block_size
        self.async_scheduling = async_scheduling
        self.on_background = on_background
        self.requests: dict[str, _RequestState] = {}
        self.num_checked_tokens = 0
        # This step's requests computed on wrong KV, with the blocks before their first
        # scheduled position: excused only if the step reports one of those blocks as a
        # load error (a failed same-step load: vLLM then discards the step's output and
        # recomputes from the failed block).
        self._suspects: dict[str, tuple[KVMismatchError, list[int]]] = {}

    def execute(self, so: Any) -> Any:
        """Run one step of ``so`` (a SchedulerOutput); returns its ModelRunnerOutput."""
        conn = self.connector
        meta = pickle.loads(pickle.dumps(so.kv_connector_metadata))  # crosses processes
        if self.model_runner == "v1":
            conn.handle_preemptions(meta)
            self._update_states(so)
        else:  # V2: update_requests (zeroing, copy-on-write) before pre_forward
            self._update_states(so)
            conn.handle_preemptions(meta)
        conn.bind_connector_metadata(meta)
        if so.has_sync_kv_loads:
            conn.start_load_kv(None)
        last_hashes = self._forward(so)
        if self.model_runner == "v1":
            out = self._after_forward(so)
            sampled = self._sample(last_hashes)
        else:
            vllm_compat.finish_forward(conn)
            sampled = self._sample(last_hashes)
            out = self._after_forward(so)
        self._settle_suspects(set(out.invalid_block_ids or ()))
        req_ids = list(sampled)
        return vllm_compat.model_runner_output(req_ids, [sampled[r] for r in req_ids], out)

    def _after_forward(self, so: Any) -> Any:
        """Async ``start_load_kv``, ``wait_for_save``, ``get_finished`` and the worker's
        metadata (V2's ``post_forward``); returns the KVConnectorOutput."""
        from vllm.v1.outputs import KVConnectorOutput

        conn = self.connector
        if not so.has_sync_kv_loads:
            conn.start_load_kv(None)
        conn.wait_for_save()
        self.on_background()
        results = conn.get_transfer_results(so.finished_req_ids)
        out = KVConnectorOutput(
            finished_sending=results.finished_sending or None,
            finished_recving=results.finished_recving or None,
            failed_recving=results.failed_recving,
            invalid_block_ids=conn.get_block_ids_with_load_errors(),
            kv_connector_stats=conn.get_kv_connector_stats(),
            kv_connector_worker_meta=pickle.loads(pickle.dumps(
                conn.build_connector_worker_meta())))
        conn.clear_connector_metadata()
        return out

    # -- the runner's request states (GPUModelRunner._update_states, simplified) -----------

    def _update_states(self, so: Any) -> None:
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        for block in so.new_block_ids_to_zero or ():
            for layer in self.kv:
                layer[block].zero_()
        for copy in so.kv_cache_block_copies or ():
            for layer in self.kv:
                layer[copy.dst_block_id].copy_(layer[copy.src_block_id])
        for new in vllm_compat.new_requests(so):  # vLLM 0.34: also resumed ones, in full
            self.requests[new.req_id] = _RequestState(new.prompt, list(new.output),
                                                      block_ids=new.block_ids)
        for cached in vllm_compat.cached_requests(so):
            state = self.requests[cached.req_id]
            num_output, new_blocks = cached.num_output_tokens, cached.new_block_ids
            if cached.resumed:  # vLLM 0.32-0.33
                state.block_ids = [list(t) for t in new_blocks or ()]
                if self.async_scheduling and num_output > 0:
                    if cached.all_token_ids is None:
                        raise KVMismatchError(f"{cached.req_id}: resumed without its tokens")
                    state.output = cached.all_token_ids[-num_output:]
            elif new_blocks is not None:
                for table, added in zip(state.block_ids, new_blocks):
                    table.extend(added)
            if num_output < len(state.output):
                del state.output[num_output:]
            del state.hashes[len(state.prompt) + len(state.output):]

    def _computed_before(self, so: Any) -> dict[str, int]:
        out = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        out.update(zip(cached.req_ids, cached.num_computed_tokens))
        return out

    # -- forward ---------------------------------------------------------------------------

    def _forward(self, so: Any) -> dict[str, int | None]:
        """Check and write the KV of every scheduled request; returns, per request, the
        prefix hash its sampled token depends on (None: a prefill chunk, no token)."""
        last: dict[str, int | None] = {}
        computed = self._computed_before(so)
        for req_id, num_new in so.num_scheduled_tokens.items():
            state = self.requests[req_id]
            tokens = state.tokens()
            start, end = computed[req_id], computed[req_id] + num_new
            if end > len(tokens):
                raise KVMismatchError(f"{req_id}: scheduled up to position {end} but only "
                                      f"{len(tokens)} tokens are known")
            hashes = prefix_hashes(tokens, state.hashes)
            try:
                self._check(req_id, state, hashes, start)
            except KVMismatchError as exc:
                read = state.block_ids[0][:-(-start // self.block_size)]
                self._suspects[req_id] = (exc, [int(b) for b in read])
                self._write_garbage(state, start, end)  # computed on wrong KV
            else:
                self._write(state, hashes, start, end)
            last[req_id] = hashes[end - 1] if end == len(tokens) else None
        return last

    def _settle_suspects(self, invalid_block_ids: set[int]) -> None:
        """Raise for a request computed on wrong KV unless the step reported a block it
        read, at or before its first wrong position, as a load error: vLLM then drops its
        output and recomputes from that block (it truncates at the first reported one;
        its next ``SchedulerOutput`` says how many output tokens it kept)."""
        suspects, self._suspects = self._suspects, {}
        for exc, read in suspects.values():
            first = next((i for i, b in enumerate(read) if b in invalid_block_ids), None)
            if first is None or (exc.position is not None
                                 and exc.position < first * self.block_size):
                raise exc

    def _write_garbage(self, state: _RequestState, start: int, end: int) -> None:
        """What a forward on wrong KV writes for ``[start, end)``: KV of no tokens."""
        for g, group in enumerate(self.groups):
            if group.mamba or end <= start:
                continue
            blocks, offsets = self._positions(state, g, start, end)
            for tensor, _ in zip(self.kv, group.layers):
                tensor.numpy()[blocks, 0, offsets, :] = -1.0

    def _sample(self, last_hashes: dict[str, int | None]) -> dict[str, list[int]]:
        sampled: dict[str, list[int]] = {}
        for req_id, h in last_hashes.items():
            sampled[req_id] = [next_token(h)] if h is not None else []
            if sampled[req_id]:
                self.requests[req_id].output.append(sampled[req_id][0])
        return sampled

    def _positions(self, state: _RequestState, group: int, start: int, end: int
                   ) -> tuple[np.ndarray, np.ndarray]:
        pos = np.arange(start, end)
        table = np.asarray(state.block_ids[group], dtype=np.int64)
        return table[pos // self.block_size], pos % self.block_size

    def _state_block(self, req_id: str, state: _RequestState, group: int, tokens: int
                     ) -> int:
        """The block of a mamba group's table that holds the state after ``tokens``."""
        table = state.block_ids[group]
        index = -(-tokens // self.block_size) - 1
        if index >= len(table) or int(table[index]) == 0:
            raise KVMismatchError(f"{req_id}: mamba group {group} has no state block for "
                                  f"the state after {tokens} tokens")
        return int(table[index])

    def _check(self, req_id: str, state: _RequestState, hashes: list[int], end: int) -> None:
        for g, group in enumerate(self.groups):
            if group.mamba:
                self._check_state(req_id, state, hashes, g, end)
                continue
            start = max(0, end - group.window + 1) if group.window else 0
            if end <= start:
                continue
            blocks, offsets = self._positions(state, g, start, end)
            for tensor, layer_index in zip(self.kv, group.layers):
                actual = tensor.numpy()[blocks, 0, offsets, :]
                expected = kv_rows(hashes[start:end], layer_index)
                bad = np.flatnonzero((actual != expected).any(axis=1) | (blocks == 0))
                if bad.size:
                    p = int(bad[0])
                    error = KVMismatchError(
                        f"{req_id}: the KV of position {start + p} (group {g}, block "
                        f"{int(blocks[p])}, layer {layer_index}) is not the KV of its "
                        f"tokens; {bad.size} of {end - start} positions are wrong")
                    error.position = start + p
                    raise error
            self.num_checked_tokens += end - start

    def _check_state(self, req_id: str, state: _RequestState, hashes: list[int], group: int,
                     tokens: int) -> None:
        """The state a step starts from: the one after ``tokens`` (none at 0)."""
        if tokens == 0:
            return
        block = self._state_block(req_id, state, group, tokens)
        for tensor, layer_index in zip(self.kv, self.groups[group].layers):
            if not np.array_equal(tensor.numpy()[block, 0, 0, :],
                                  kv_rows(hashes[tokens - 1:tokens], layer_index)[0]):
                raise KVMismatchError(
                    f"{req_id}: the mamba state after {tokens} tokens (group {group}, block "
                    f"{block}, layer {layer_index}) is not the state of its tokens")
        self.num_checked_tokens += 1

    def _write(self, state: _RequestState, hashes: list[int], start: int, end: int) -> None:
        if end <= start:
            return
        for g, group in enumerate(self.groups):
            if group.mamba:
                block = self._state_block("", state, g, end)
                for tensor, layer_index in zip(self.kv, group.layers):
                    tensor.numpy()[block, 0, 0, :] = kv_rows(hashes[end - 1:end],
                                                             layer_index)[0]
                continue
            blocks, offsets = self._positions(state, g, start, end)
            if (blocks == 0).any():
                raise KVMismatchError(f"group {g} has no block for a position it computes")
            for tensor, layer_index in zip(self.kv, group.layers):
                tensor.numpy()[blocks, 0, offsets, :] = kv_rows(hashes[start:end],
                                                                 layer_index)
