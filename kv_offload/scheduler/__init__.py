"""Scheduler side: indexes and planning. Imports neither torch nor vLLM."""

from kv_offload.scheduler.cpu_index import CpuHit, CpuIndex, SlotState
from kv_offload.scheduler.planner import OffloadScheduler, PlannerConfig

__all__ = ["CpuHit", "CpuIndex", "OffloadScheduler", "PlannerConfig", "SlotState"]
