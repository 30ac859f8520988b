"""What vLLM loads and calls: the connector (both roles), the engine checks that read
vLLM's configs into a ``KVLayout``, the KV events in vLLM's classes, and the metrics in
vLLM's stats and Prometheus registry. ``kv_offload.connector`` is the module path vLLM
is given (``kv_connector_module_path``)."""
