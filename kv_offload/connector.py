"""The module path vLLM loads kv-offload from (``kv_connector_module_path``); the
connector lives in ``kv_offload.plugin.connector``."""

from kv_offload.plugin.connector import KVOffloadConnector

__all__ = ["KVOffloadConnector"]
