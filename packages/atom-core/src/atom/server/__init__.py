"""OpenAI-compatible HTTP server for the native engine (needs the `server` extra)."""

from atom.server.app import build_app
from atom.server.async_engine import AsyncEngine
from atom.server.launcher import StartupError, run_server
from atom.server.options import ServeOptions

__all__ = ["AsyncEngine", "ServeOptions", "StartupError", "build_app", "run_server"]
