"""OpenAI-compatible HTTP server for the native engine (needs the `server` extra)."""

from atom.server.app import build_app
from atom.server.async_engine import AsyncEngine
from atom.server.launcher import run_server

__all__ = ["AsyncEngine", "build_app", "run_server"]
