"""extra_tiers: an operator's mistake names the option and the fix; nothing starts half-built."""

import inspect
from types import SimpleNamespace

import pytest

from kv_offload.config import OffloadConfig
from kv_offload.tier_contract import SecondaryTier, TierIO
from kv_offload.tier_plugins import TierContext, build_tiers

CONTEXT = TierContext("scheduler", "ns", 1, 0, 1024, None)


def stub_tier(name, side, **overrides):
    """A tier of ``side`` with every method of its half of the contract, doing nothing."""
    protocol = SecondaryTier if side == "scheduler" else TierIO
    methods = {k: v for k, v in vars(protocol).items()
               if inspect.isfunction(v) and not k.startswith("_")}
    return type("Stub", (), {**methods, **overrides, "name": name, "side": side})()


def named(name):
    return lambda context: stub_tier(name, context.side)


make_cold = named("cold")
make_disk = named("disk")
make_cpu = named("cpu")


@pytest.mark.parametrize("bad", ["my_tiers", "my_tiers.make", ["my tiers:make"], [3], "a:b"])
def test_a_malformed_entry_is_refused_naming_the_option(bad):
    with pytest.raises(ValueError, match="extra_tiers: expected a list of tier factories"):
        OffloadConfig(extra_tiers=bad)


def test_entries_survive_the_json_round_trip():
    config = OffloadConfig(extra_tiers=["my_tiers.cold:make"])
    assert OffloadConfig.from_json(config.to_json()).extra_tiers == ["my_tiers.cold:make"]
    assert OffloadConfig(extra_tiers=[]).extra_tiers is None


def test_a_factory_that_cannot_be_loaded_is_named():
    with pytest.raises(ValueError, match=r"cannot load 'no_such_module_x:make'"):
        build_tiers(["no_such_module_x:make"], CONTEXT)
    with pytest.raises(ValueError, match=r"cannot load 'test_tier_plugins:missing'"):
        build_tiers(["test_tier_plugins:missing"], CONTEXT)


def test_each_tier_needs_a_name_of_its_own():
    (tier,) = build_tiers(["test_tier_plugins:make_cold"], CONTEXT)
    assert tier.name == "cold" and tier.side == "scheduler"
    with pytest.raises(ValueError, match="each tier needs a name of its own"):
        build_tiers(["test_tier_plugins:make_cold", "test_tier_plugins:make_cold"], CONTEXT)
    with pytest.raises(ValueError, match="named 'disk'"):
        build_tiers(["test_tier_plugins:make_disk"], CONTEXT)
    with pytest.raises(ValueError, match="named 'cpu'"):  # the planner's name for CPU hits
        build_tiers(["test_tier_plugins:make_cpu"], CONTEXT)


def old_tails_of(self, parent):  # the contract before the remote tier kept tails
    return []


make_old = lambda context: stub_tier("old", context.side, tails_of=old_tails_of)  # noqa: E731
make_no_read = lambda context: SimpleNamespace(name="bare", side=context.side)  # noqa: E731


def test_a_tier_written_against_another_contract_is_refused_at_start_naming_the_method():
    """A plugin whose ``tails_of`` still takes only the parent (the contract before
    issue 33) would raise a TypeError at its first lookup, while serving; it is refused
    when the engine starts, naming the method and the contract to follow."""
    with pytest.raises(ValueError, match=r"'old'.*tails_of\(parent\) cannot take "
                                         r"\(asker, parent\).*kv_offload.tier_contract"):
        build_tiers(["test_tier_plugins:make_old"], CONTEXT)
    worker = TierContext("worker", "ns", 1, 0, 1024, None)
    assert build_tiers(["test_tier_plugins:make_old"], worker)[0].name == "old"  # no tails
    with pytest.raises(ValueError, match="no method read"):
        build_tiers(["test_tier_plugins:make_no_read"], worker)
