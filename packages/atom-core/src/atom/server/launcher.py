"""`run_server`: bind the port, load a model into the native engine, serve it over HTTP."""

from __future__ import annotations

import logging
import socket
from dataclasses import fields
from typing import Any

from atom.server.options import ServeOptions

logger = logging.getLogger(__name__)

SERVE_OPTIONS = frozenset(f.name for f in fields(ServeOptions))


class StartupError(Exception):
    """A reason the server cannot start, worth one line to the operator (no traceback)."""


def run_server(
    model: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    **kwargs: Any,
) -> None:
    """Serves `model` (a local HF folder or a hub id) until interrupted.

    Keyword arguments named like ServeOptions' fields (served_model_name, max_n,
    chat_template, api_key, ...) set those; the rest go to `atom.LLM` (dtype, device,
    max_model_len, block_size, num_blocks, max_num_seqs, seed, ...); trust_remote_code is
    accepted and logged as having no effect. Raises StartupError for a
    busy port (checked before the weights load), a bad model folder or a bad option.
    """
    import uvicorn

    from atom.server.app import build_app
    from atom.server.async_engine import AsyncEngine
    from atom.server.sampling_defaults import GenerationConfigError, sampling_defaults
    from atom.server.tokenization import load_chat_template
    from atom.server.tool_calls import TOOL_CALL_PARSERS

    serve_kwargs = {k: kwargs.pop(k) for k in SERVE_OPTIONS & kwargs.keys()}
    options = ServeOptions(**{"served_model_name": model, **serve_kwargs})
    if kwargs.pop("trust_remote_code", False):
        logger.warning(
            "--trust-remote-code has no effect: ATOM runs its own model classes and no code "
            "from the checkpoint"
        )
    if options.tool_call_parser not in TOOL_CALL_PARSERS:
        raise StartupError(
            f"--tool-call-parser {options.tool_call_parser!r} is not one ATOM has; it has: "
            + ", ".join(TOOL_CALL_PARSERS)
        )
    try:
        chat_template = load_chat_template(options.chat_template)
    except (ValueError, OSError) as exc:
        raise StartupError(str(exc)) from None
    listener = bind(host, port)
    llm = load_model(model, kwargs)  # kept alive here: it owns the engine's workers
    try:
        defaults = sampling_defaults(options.generation_config, llm.engine.config.model.path)
    except GenerationConfigError as exc:
        raise StartupError(str(exc)) from None
    engine = AsyncEngine(llm.engine, options.max_unread_tokens)
    app = build_app(engine, options.served_model_name, options, chat_template, defaults)
    config = uvicorn.Config(app, log_level=log_level)  # also sets up uvicorn's loggers
    logging.getLogger("uvicorn.error").info(summary(llm, options, host, port))
    try:
        uvicorn.Server(config).run(sockets=[listener])
    finally:
        engine.shutdown()


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # Naming IPPROTO_TCP (not the default 0) is what makes asyncio set TCP_NODELAY on each
    # accepted connection: it checks the protocol number, which accepted sockets inherit.
    # Without it Nagle's algorithm meets the client's delayed ACK and every response on a
    # kept-alive connection waits for that ACK's timer.
    listener = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as exc:
        listener.close()
        raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return listener


def load_model(model: str, engine_kwargs: dict):
    from atom.engine.llm import LLM

    try:
        return LLM(model, **engine_kwargs)
    except (ValueError, OSError, RuntimeError, KeyError) as exc:
        logger.debug("loading %s failed", model, exc_info=True)
        raise StartupError(f"cannot load the model {model!r}: {exc}") from None


def summary(llm, options: ServeOptions, host: str, port: int) -> str:
    config = llm.engine.config
    return (
        f"serving {options.served_model_name!r} ({config.model.path}, "
        f"{str(config.model.dtype).removeprefix('torch.')}, max_model_len "
        f"{config.model.max_model_len}) on {config.device}: {llm.engine.kv_cache_summary()}; "
        f"up to {config.max_num_seqs} sequences at once; http://{host}:{port}/v1"
    )
