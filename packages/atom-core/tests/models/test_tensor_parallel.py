"""TP=2 over gloo (two CPU processes) gives the same logits as TP=1."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from atom.config import ModelConfig
from atom.distributed import SingleProcessGroup, TorchDistributedGroup, set_tp_group
from atom.engine.model_runner import ModelRunner, StepInput, allocate_kv_cache, build_model
from atom.testing import tiny_config
from tests.models.harness import make_prompts, randomize_vectors, write_checkpoint
from tests.models.test_deepseek import CASES as DEEPSEEK_CASES
from tests.models.test_glm4_moe import CASES as GLM_CASES
from tests.models.test_gpt_oss import CASES as GPT_OSS_CASES
from tests.models.test_llama import llama_config
from tests.models.test_minimax_m2 import CASES as MINIMAX_CASES
from tests.models.test_moe_models import CASES as MOE_CASES

BLOCK_SIZE = 4


def run_prefill_and_decode(
    folder: str,
    prompt_lengths: tuple[int, ...] = (13, 6),
    before_step: Callable[[int], None] = lambda num_tokens: None,
) -> torch.Tensor:
    """All-position prefill logits of the prompts, then two decode steps. `before_step`
    learns each step's token count (data-parallel ranks exchange theirs)."""
    config = ModelConfig.from_pretrained(folder, dtype="float32")
    model = build_model(config, "cpu", progress=False)
    allocate_kv_cache(model, 64, BLOCK_SIZE, torch.float32, "cpu")
    runner = ModelRunner(model, BLOCK_SIZE, "cpu")
    prompts = make_prompts(config.hf_config.vocab_size, list(prompt_lengths))
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(len(prompts))]
    before_step(sum(prompt_lengths))
    outputs = [
        runner.run([StepInput(p, 0, [t]) for p, t in zip(prompts, tables)], all_positions=True)
    ]
    lengths = [len(p) for p in prompts]
    for step in range(2):
        tokens = [(7 * step + i) % config.hf_config.vocab_size for i in range(len(prompts))]
        batch = [StepInput([tok], n, [t]) for tok, n, t in zip(tokens, lengths, tables)]
        before_step(len(batch))
        outputs.append(runner.run(batch))
        lengths = [n + 1 for n in lengths]
    return torch.cat(outputs)


def _worker(rank: int, world_size: int, port: int, folder: str, result_file: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        set_tp_group(TorchDistributedGroup())
        logits = run_prefill_and_decode(folder)
        if rank == 0:
            torch.save(logits, result_file)
    finally:
        set_tp_group(SingleProcessGroup())
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CASES = {
    "llama-gqa": llama_config(num_attention_heads=4, num_key_value_heads=2),
    "llama-kv-replicated": llama_config(num_key_value_heads=1, tie_word_embeddings=True),
    "qwen3-odd-vocab": tiny_config(
        "Qwen3ForCausalLM", vocab_size=251, hidden_size=64, intermediate_size=96, head_dim=16
    ),
    "deepseek-v3-mla-qlora": DEEPSEEK_CASES["v3-grouped-qlora-dense1"],
    "qwen3-moe": MOE_CASES["qwen3-moe-top2-norm"],
    "mixtral-mqa": MOE_CASES["mixtral-top1-mqa"],
    "glm4-moe-qk-norm-dense1": GLM_CASES["glm-4.5-dense1"],
    # QK-norm over all heads: q and k norms sharded, then k replicated on both ranks.
    "minimax-m2-qk-norm": MINIMAX_CASES["m2"],
    "minimax-m2-mqa-qk-norm": MINIMAX_CASES["mqa-top3-full-rotary"],
    "gpt-oss-sinks-expert-biases": GPT_OSS_CASES["sliding-full"],
}


@pytest.mark.parametrize("name", list(CASES))
def test_tp2_matches_tp1(tmp_path, name):
    folder = write_checkpoint(CASES[name], tmp_path / "ckpt")
    randomize_vectors(folder)  # biases and sinks sharded or not, and added once
    expected = run_prefill_and_decode(str(folder))
    result_file = str(tmp_path / "tp2.pt")
    mp.start_processes(
        _worker, args=(2, _free_port(), str(folder), result_file), nprocs=2, start_method="spawn"
    )
    actual = torch.load(result_file)
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=0)
