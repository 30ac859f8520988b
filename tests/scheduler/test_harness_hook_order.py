"""The scheduler harness's fake model runner calls the worker hooks in the order of the
model runner it plays (docs/architecture.md "Hook order on both model runners").

Each hook call is recorded with what the runner had done by then: whether it already
held the request's state (``update_requests``/``_update_states``: on V2 before
``handle_preemptions``, on V1 after) and whether the step's token was already sampled
(on V2 before ``post_forward``'s async ``start_load_kv``, ``wait_for_save`` and
``get_finished``; on V1 after them).
"""

from __future__ import annotations

import pytest

from kv_offload.testing.fake_model import FakeModelRunner
from kv_offload.testing.scheduler_harness import SchedulerHarness
from kv_offload.testing.vllm_compat import (
    MODEL_RUNNERS,
    default_model_runner,
    installed_model_runners,
)

HOOKS = ("handle_preemptions", "bind_connector_metadata", "start_load_kv", "finish_forward",
         "wait_for_save", "get_transfer_results")


def _record_hooks(harness: SchedulerHarness, req_id: str) -> list[tuple[str, bool, bool]]:
    """Wrap the worker-side connector's hooks (on the instance): each call appends
    (hook, the runner holds the request's state, its token is sampled)."""
    calls: list[tuple[str, bool, bool]] = []
    conn = harness.runner.connector
    for name in HOOKS:
        real = getattr(conn, name, None)
        if real is None:  # finish_forward: only where vLLM's base class has it (0.32 on)
            continue

        def hook(*args, _real=real, _name=name, **kwargs):
            state = harness.runner.requests.get(req_id)
            calls.append((_name, state is not None, bool(state and state.output)))
            return _real(*args, **kwargs)

        setattr(conn, name, hook)
    return calls


@pytest.fixture
def make_harness(tmp_path):
    made: list[SchedulerHarness] = []

    def make(**kwargs) -> SchedulerHarness:
        made.append(SchedulerHarness(tmp_path / f"h{len(made)}", **kwargs))
        return made[-1]

    yield make
    for harness in made:
        harness.close()


@pytest.mark.parametrize("model_runner", installed_model_runners())
def test_the_fake_runner_calls_the_hooks_in_its_model_runners_order(make_harness,
                                                                     model_runner):
    harness = make_harness(model_runner=model_runner, disk=False)
    calls = _record_hooks(harness, "a")
    harness.add("a", list(range(3, 23)), max_tokens=1)  # prefilled and sampled in step 1
    harness.step()
    has_finish_forward = hasattr(harness.runner.connector, "finish_forward")
    if model_runner == "v1":
        expected = [("handle_preemptions", False, False),  # before _update_states
                    ("bind_connector_metadata", True, False),
                    ("start_load_kv", True, False),  # async loads, after the forward
                    ("wait_for_save", True, False),
                    ("get_transfer_results", True, False)]  # sampling comes after
    else:
        expected = [("handle_preemptions", True, False),  # after update_requests
                    ("bind_connector_metadata", True, False),
                    *([("finish_forward", True, False)] if has_finish_forward else []),
                    ("start_load_kv", True, True),  # post_forward, after sampling
                    ("wait_for_save", True, True),
                    ("get_transfer_results", True, True)]
    assert calls == expected
    harness.run()
    assert harness.check_idle() == []


def test_the_default_order_is_the_installed_cpu_backends_and_others_are_refused(
        make_harness):
    """vLLM 0.32 and 0.33 run V1 on the CPU backend; 0.34 has only V2."""
    assert installed_model_runners()[0] == default_model_runner()
    assert set(installed_model_runners()) <= set(MODEL_RUNNERS)
    assert make_harness(disk=False).runner.model_runner == default_model_runner()
    with pytest.raises(ValueError, match="model_runner must be one of"):
        FakeModelRunner(None, [], 8, async_scheduling=False, on_background=lambda: None,
                        model_runner="v3")


@pytest.mark.parametrize("model_runner", installed_model_runners())
def test_store_copies_start_at_finish_forward_on_v2_and_at_wait_for_save_on_v1(
        make_harness, model_runner):
    """Issue 32 §3: on V2 the step's store copies start in ``finish_forward``, right after
    the forward (before sampling and ``post_forward``); on V1, which never calls it, in
    ``wait_for_save``; once either way. The next request loads what they copied (the
    fake forward checks every loaded token's KV) and the engine ends idle."""
    harness = make_harness(model_runner=model_runner, disk=False, copy_thread=False,
                           partial_hits=False)  # no tails: one store job
    events: list[str] = []
    conn = harness.runner.connector
    for name in ("finish_forward", "wait_for_save"):
        real = getattr(conn, name)

        def hook(*args, _real=real, _name=name, **kwargs):
            events.append(_name)
            return _real(*args, **kwargs)

        setattr(conn, name, hook)
    note_copy = harness.note_copy
    harness.note_copy = lambda what: (events.append(what), note_copy(what))[1]
    prompt = list(range(3, 3 + 2 * harness.chunk_tokens + 1))
    harness.add("a", prompt, max_tokens=2)
    harness.step()  # the prefill: both chunks complete, one store job
    if model_runner == "v2":
        assert events == ["finish_forward", "store", "wait_for_save"]
    else:
        assert events == ["wait_for_save", "store"]
    harness.run()
    assert harness.reset_prefix_cache(reset_connector=False)  # b must load, not hit locally
    harness.add("b", prompt + [7], max_tokens=2)
    harness.run()
    assert harness.scheduler_side.counters.hit_tokens_cpu == 2 * harness.chunk_tokens
    assert events.count("store") == 1 and events.count("load") == 1
    assert harness.check_idle() == []
