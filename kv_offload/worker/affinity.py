"""Which CPUs kv-offload's worker threads run on, next to a model bound to its cores.

vLLM's CPU backend binds the model's OpenMP threads one per core (it declares the cores in
the worker's environment: ``GOMP_CPU_AFFINITY``, ``OMP_PLACES`` or ``KMP_AFFINITY``) and
keeps other cores free for the scheduler process and KV transfer. Threads started later
inherit the starting thread's binding, so without this module every kv-offload thread
would share the first model core with the model's main thread: disk reads, checksums and
background copies would stall the forward while the reserved cores idle.

``ThreadPlacement.for_worker()`` reads that binding once; pools pass
``placement.background`` or ``placement.anywhere`` as their initializer:
- background threads (I/O, loads, background stores) run on the engine's cores that the
  model does not use (on all of them when the model uses every one);
- a copy's helper threads (which mostly run while the model waits for a synchronous store)
  may run on any of the engine's cores, so that they do not queue on one.
With no binding declared (GPUs, ``VLLM_CPU_OMP_THREADS_BIND=nobind``) threads stay as
they start. A worker knows only its own rank's cores: with several ranks on one host its
threads may run on another rank's model cores (as they would unbound).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

logger = logging.getLogger(__name__)

_PROCLIST = re.compile(r"proclist=\[([^\]]*)\]")


def parse_cpu_list(text: str) -> frozenset[int]:
    """CPUs of a list such as ``"0 2 4-7"``, ``"0,1"`` or ``"8-15:2"`` (GNU/Linux
    syntax, stride after ``:``). ValueError on anything else."""
    cpus: set[int] = set()
    for item in re.split(r"[\s,]+", text.strip()):
        if not item:
            continue
        span, _, stride = item.partition(":")
        first, _, last = span.partition("-")
        lo = int(first)
        hi = int(last) if last else lo
        step = int(stride) if stride else 1
        if lo < 0 or hi < lo or step < 1:
            raise ValueError(f"bad CPU range {item!r}")
        cpus.update(range(lo, hi + 1, step))
    if not cpus:
        raise ValueError(f"no CPUs in {text!r}")
    return frozenset(cpus)


def _parse_places(text: str) -> frozenset[int]:
    """CPUs of explicit OpenMP places: ``{0,1,2}``, ``{0},{1}`` or ``{0:4}`` (start:count)."""
    cpus: set[int] = set()
    places = re.findall(r"\{([^}]*)\}", text)
    if not places:
        raise ValueError(f"no explicit places in {text!r}")
    for place in places:
        for item in place.split(","):
            start, _, count = item.strip().partition(":")
            first = int(start)
            cpus.update(range(first, first + int(count)) if count else (first,))
    return frozenset(cpus)


def openmp_cpus(environ: Mapping[str, str]) -> frozenset[int] | None:
    """The cores the OpenMP runtime binds the model's threads to, as declared in
    ``environ``; None when it declares no explicit binding (or one we cannot read)."""
    try:
        if environ.get("GOMP_CPU_AFFINITY"):
            return parse_cpu_list(environ["GOMP_CPU_AFFINITY"])
        bind = environ.get("OMP_PROC_BIND", "").strip().lower()
        if environ.get("OMP_PLACES") and bind not in ("", "false"):
            return _parse_places(environ["OMP_PLACES"])
        match = _PROCLIST.search(environ.get("KMP_AFFINITY", ""))
        if match:
            return parse_cpu_list(match.group(1))
    except ValueError as exc:
        logger.debug("kv-offload: unreadable OpenMP binding (%s); threads stay unbound", exc)
    return None


def _set_affinity(cpus: frozenset[int]) -> None:
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:  # e.g. a cpuset without these CPUs: run where we started
        logger.debug("kv-offload: cannot move a thread to CPUs %s: %s", sorted(cpus), exc)


def _keep() -> None:
    return None


@dataclass(frozen=True)
class ThreadPlacement:
    """CPU sets for kv-offload's threads (see the module docstring); None: leave as is."""

    background_cpus: frozenset[int] | None = None
    engine_cpus: frozenset[int] | None = None
    model_cpus: frozenset[int] | None = None

    @classmethod
    def for_worker(cls, environ: Mapping[str, str] | None = None,
                   allowed: frozenset[int] | None = None) -> ThreadPlacement:
        """Placement for this worker process. ``allowed``: the CPUs the engine may use
        (default: its parent's, the process that spawned this worker, else all online)."""
        if not hasattr(os, "sched_setaffinity"):
            return cls()
        compute = openmp_cpus(os.environ if environ is None else environ)
        if compute is None:
            return cls()
        allowed = _engine_cpus() if allowed is None else allowed
        compute = compute & allowed or compute
        background = allowed - compute or allowed
        return cls(background_cpus=frozenset(background), engine_cpus=frozenset(allowed),
                   model_cpus=frozenset(compute))

    def _initializer(self, cpus: frozenset[int] | None) -> Callable[[], None]:
        if cpus is None:
            return _keep
        return lambda: _set_affinity(cpus)

    @property
    def background(self) -> Callable[[], None]:
        """Thread initializer: move the calling thread to the background CPUs."""
        return self._initializer(self.background_cpus)

    @property
    def anywhere(self) -> Callable[[], None]:
        """Thread initializer: let the calling thread run on any of the engine's CPUs."""
        return self._initializer(self.engine_cpus)

    def describe(self) -> str:
        if self.background_cpus is None:
            return "threads unbound"
        return (f"model on CPUs {_fmt(self.model_cpus)}, offload threads on "
                f"{_fmt(self.background_cpus)}")


def _engine_cpus() -> frozenset[int]:
    try:
        return frozenset(os.sched_getaffinity(os.getppid()))
    except OSError:
        return frozenset(range(os.cpu_count() or 1))


def _fmt(cpus: frozenset[int] | None) -> str:
    return ",".join(map(str, sorted(cpus or ())))
