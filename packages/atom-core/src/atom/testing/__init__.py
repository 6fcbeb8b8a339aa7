"""Test support for ATOM and the host plugins' test suites (like `torch.testing`).

`atom.testing.tiny_configs` makes tiny random HF configs and checkpoints;
`atom.testing.servers` waits for a server a test started. Nothing here imports a host,
and torch / transformers are imported only when a checkpoint is made.
"""

from atom.testing.servers import ServerFailed, wait_healthy
from atom.testing.tiny_configs import (
    DEEPSEEK_YARN_ROPE,
    config_class_name,
    tiny_config,
    tiny_fields,
    write_checkpoint,
)

__all__ = [
    "DEEPSEEK_YARN_ROPE",
    "ServerFailed",
    "wait_healthy",
    "config_class_name",
    "tiny_config",
    "tiny_fields",
    "write_checkpoint",
]
