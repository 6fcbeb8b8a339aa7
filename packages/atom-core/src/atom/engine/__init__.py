"""The native engine: sequences, KV blocks, model runner, sampler and the offline LLM API."""
