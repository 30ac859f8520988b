"""The operator's tools: the ``kv-offload`` command (``cli``: inspect, verify, clear,
warm) and offline cache warming (``warm``, its prompt files ``warm_prompts``)."""
