"""Test support for ATOM and the host plugins' test suites (like `torch.testing`).

`atom.testing.tiny_configs` makes tiny random HF configs and checkpoints;
`atom.testing.references` gives random prompts and HF greedy tokens;
`atom.testing.mtp_checkpoints` writes checkpoints with an MTP drafter and
`atom.testing.eagle3_checkpoints` targets with an EAGLE-3 drafter (speculative decoding,
native engine and hosts); `atom.testing.servers` waits for a server a test started.
Nothing here imports a host,
and torch / transformers are imported only when a checkpoint is made.
"""

from atom.testing.references import VOCAB, hf_greedy, random_prompts
from atom.testing.servers import ServerFailed, wait_healthy
from atom.testing.tiny_configs import (
    DEEPSEEK_YARN_ROPE,
    config_class_name,
    host_checkpoints,
    tiny_config,
    tiny_fields,
    write_checkpoint,
    write_host_checkpoint,
)

__all__ = [
    "DEEPSEEK_YARN_ROPE",
    "VOCAB",
    "hf_greedy",
    "random_prompts",
    "write_host_checkpoint",
    "ServerFailed",
    "wait_healthy",
    "config_class_name",
    "host_checkpoints",
    "tiny_config",
    "tiny_fields",
    "write_checkpoint",
]
