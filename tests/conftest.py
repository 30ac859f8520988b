"""Shared fixtures: throwaway Redis servers for the remote-tier tests, and
``SchedulerHarness`` engines closed after each test."""

from __future__ import annotations

import os

import pytest

from kv_offload.testing.redis_server import RedisCluster, RedisServer, server_binary


def _need_redis() -> None:
    """Skip without a redis-server binary, except where CI demands the remote tests
    (KV_OFFLOAD_REQUIRE_REDIS=1, set by .ci/run after installing it): then fail."""
    if server_binary() is None:
        if os.environ.get("KV_OFFLOAD_REQUIRE_REDIS") == "1":
            pytest.fail("redis-server is required (KV_OFFLOAD_REQUIRE_REDIS=1) but missing")
        pytest.skip("redis-server not installed (apt-get install redis-server)")


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    """A standalone server for the module; tests may kill and restart it."""
    _need_redis()
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory):
    """Three cluster masters on loopback."""
    _need_redis()
    cluster = RedisCluster(tmp_path_factory.mktemp("redis-cluster")).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def harness_factory(tmp_path):
    """Builds ``SchedulerHarness`` engines (keyword arguments as its own), each in a
    directory of its own, all closed after the test."""
    from kv_offload.testing.scheduler_harness import SchedulerHarness  # imports vLLM

    made: list[SchedulerHarness] = []

    def make(**kwargs) -> SchedulerHarness:
        harness = SchedulerHarness(tmp_path / f"h{len(made)}", **kwargs)
        made.append(harness)
        return harness

    yield make
    for harness in made:
        harness.close()
