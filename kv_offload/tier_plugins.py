"""Secondary tiers from outside kv-offload: the ``extra_tiers`` option.

Each entry names a factory, ``"package.module:attribute"``, that kv-offload calls once on
the scheduler side and once on each worker rank with a ``TierContext``; it returns that
side's half of one tier (``tier_contract.SecondaryTier`` on the scheduler,
``tier_contract.TierIO`` on a worker), both with the same ``name``. The tiers are asked
after the built-in disk and remote tiers, in the order given. A tier keeps chunks of one
``namespace`` (model, layout, salt: invariant 4) and must not serve another's.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

SPEC = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


@dataclass(frozen=True, slots=True)
class TierContext:
    """What a tier factory is told. ``side``: "scheduler" or "worker"; ``rank``: the
    worker's tensor-parallel rank (0 on the scheduler); ``slot_bytes``: one chunk's bytes
    on one rank; ``config``: the ``OffloadConfig``."""

    side: str
    namespace: str
    num_ranks: int
    rank: int
    slot_bytes: int
    config: Any


def check_specs(specs: Any) -> list[str]:
    """``specs`` as a list of ``module:attribute`` strings; ValueError naming the option
    otherwise."""
    if specs is None:
        return []
    if isinstance(specs, str) or not isinstance(specs, Sequence) or not all(
            isinstance(s, str) and SPEC.fullmatch(s) for s in specs):
        raise ValueError(f"extra_tiers: expected a list of tier factories like "
                         f"['my_package.tiers:make_tier'], got {specs!r}")
    return list(specs)


def build_tiers(specs: Sequence[str], context: TierContext) -> list[Any]:
    """Each factory's half of its tier for ``context.side``, in order. Raises ValueError
    naming the entry when it cannot be imported, is not callable, or returns a tier whose
    name repeats another's."""
    tiers, names = [], {"cpu", "disk", "remote"}  # "cpu": the primary tier's name
    for spec in specs:
        module, _, attribute = spec.partition(":")
        try:
            factory = getattr(importlib.import_module(module), attribute)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"extra_tiers: cannot load {spec!r} ({exc}); name an importable "
                             f"module and a factory in it, 'package.module:factory'") from exc
        if not callable(factory):
            raise ValueError(f"extra_tiers: {spec!r} is not callable")
        tier = factory(context)
        name = getattr(tier, "name", None)
        if not isinstance(name, str) or name in names:
            raise ValueError(f"extra_tiers: {spec!r} made a tier named {name!r}; each tier "
                             f"needs a name of its own (not cpu, disk or remote)")
        names.add(name)
        tiers.append(tier)
    return tiers
