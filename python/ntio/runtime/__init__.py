"""The engine: the layer loop, the KV cache, the tier plan and memory budget, and the streaming layer loader."""
