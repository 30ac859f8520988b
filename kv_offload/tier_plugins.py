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
import inspect
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
        missing = contract_mismatches(tier, context.side)
        if missing:
            raise ValueError(f"extra_tiers: {spec!r} made a {context.side} tier {name!r} that "
                             f"does not follow the tier contract: {'; '.join(missing)}. "
                             f"Update it to kv_offload.tier_contract (its signatures change "
                             f"with kv-offload's releases)")
        names.add(name)
        tiers.append(tier)
    return tiers


def contract_mismatches(tier: Any, side: str) -> list[str]:
    """What ``tier`` lacks of its side's protocol (``tier_contract.SecondaryTier`` on the
    scheduler, ``TierIO`` on a worker): each method that is missing, or whose signature
    cannot take the protocol's arguments (a plugin written against an older contract
    would fail only when first called, in the middle of serving). Pure."""
    from kv_offload import tier_contract

    protocol = tier_contract.SecondaryTier if side == "scheduler" else tier_contract.TierIO
    out = []
    for method, spec in vars(protocol).items():
        if method.startswith("_") or not inspect.isfunction(spec):
            continue
        ours = getattr(tier, method, None)
        if not callable(ours):
            out.append(f"no method {method}")
            continue
        params = list(inspect.signature(spec).parameters.values())[1:]  # self
        args = [None for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
        kwargs = {p.name: None for p in params if p.kind is p.KEYWORD_ONLY}
        try:
            inspect.signature(ours).bind(*args, **kwargs)
        except TypeError:
            out.append(f"{method}{inspect.signature(ours)} cannot take "
                       f"({', '.join(p.name for p in params)})")
        except ValueError:  # no signature to read (a builtin): trust it
            pass
    return out
