"""`run_server`: load a model into the native engine and serve it over HTTP."""

from __future__ import annotations

from typing import Any

from atom.engine.llm import LLM
from atom.server.app import build_app
from atom.server.async_engine import AsyncEngine


def run_server(
    model: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str | None = None,
    log_level: str = "info",
    **engine_kwargs: Any,
) -> None:
    """Serves `model` (a local HF folder) until interrupted.

    `engine_kwargs` go to `atom.LLM` (dtype, device, max_model_len, block_size, num_blocks,
    kv_cache_memory_bytes, max_num_seqs, tensor_parallel_size, ...). Clients name the
    model `served_model_name`, by default the `model` argument itself.
    """
    import uvicorn

    llm = LLM(model, **engine_kwargs)  # kept alive here: it owns the engine's workers
    engine = AsyncEngine(llm.engine)
    app = build_app(engine, served_model_name or model)
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level)
    finally:
        engine.shutdown()
