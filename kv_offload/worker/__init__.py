"""Worker side: executes jobs on one rank (bytes, threads, files, streams)."""

from kv_offload.worker.runner import OffloadWorker, PollResult

__all__ = ["OffloadWorker", "PollResult"]
