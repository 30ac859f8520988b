"""kv-offload: a vLLM KV connector that keeps prefix KV in host RAM and on local disk."""

from kv_offload.config import OffloadConfig

__all__ = ["OffloadConfig"]
__version__ = "0.1.0"
