"""extra_tiers: an operator's mistake names the option and the fix; nothing starts half-built."""

from types import SimpleNamespace

import pytest

from kv_offload.config import OffloadConfig
from kv_offload.tier_plugins import TierContext, build_tiers

CONTEXT = TierContext("scheduler", "ns", 1, 0, 1024, None)


def named(name):
    return lambda context: SimpleNamespace(name=name, side=context.side)


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
