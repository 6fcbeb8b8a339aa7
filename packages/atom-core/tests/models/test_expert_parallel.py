"""Expert parallelism over gloo (two CPU processes), each rank holding half of the
experts, whole:

- with tensor-parallel attention, every MoE family gives the logits of the
  single-process model;
- with data-parallel attention (MLA), each rank runs its own prompts (other lengths,
  another count) with whole attention weights, and gets the logits the single-process
  model gives for those prompts, with either token exchange (all-gather +
  reduce-scatter, all-to-all).

All cases run in one pair of processes: starting them costs more than the models. GLM-4.5
and DeepSeek-V3 use DeepSeek-V2's MoE block, MiniMax-M2 Mixtral's, Qwen3-Next (and
Qwen3.5) FusedMoE beside a shared expert as DeepSeek-V2 does.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from atom.all_to_all_tokens import AllToAllTokens
from atom.config import ModelConfig
from atom.distributed import SingleProcessGroup, TorchDistributedGroup, set_tp_group
from atom.engine.model_runner import build_model
from atom.expert_parallel import (
    ExpertParallel,
    GatheredTokens,
    ReplicatedTokens,
    set_expert_parallel,
)
from atom.layers.moe import FusedMoE
from tests.models.harness import randomize_vectors, write_checkpoint
from tests.models.test_deepseek import CASES as DEEPSEEK_CASES
from tests.models.test_tensor_parallel import CASES as TP_CASES
from tests.models.test_tensor_parallel import _free_port, run_prefill_and_decode

TP_ATTENTION_CASES = {
    "qwen3-moe": TP_CASES["qwen3-moe"],
    # MLA, a dense first layer, shared experts and group-limited routing.
    "deepseek-v2-mla-shared-dense1": DEEPSEEK_CASES["v2-group-limited-qlora-dense1"],
    # Expert biases: each rank adds its own experts' w2 biases, none twice.
    "gpt-oss": TP_CASES["gpt-oss-sinks-expert-biases"],
}
DP_ATTENTION_CASES = {"deepseek-v2-mla-shared-dense1"}
DP_EXCHANGES = (GatheredTokens, AllToAllTokens)
PROMPTS_OF_DP_RANK = [(13, 6), (5,)]


def experts_held(folder: str) -> set[tuple[int, int]]:
    """(experts held, experts in the layer) of every MoE layer of the model this rank builds."""
    model = build_model(ModelConfig.from_pretrained(folder, dtype="float32"), "cpu", False)
    return {
        (m.w13_weight.shape[0], m.num_experts) for m in model.modules() if isinstance(m, FusedMoE)
    }


def run_tp_attention(folders: dict[str, str]) -> dict:
    group = TorchDistributedGroup()
    set_tp_group(group)
    set_expert_parallel(ExpertParallel(group, ReplicatedTokens(group)))
    return {name: (experts_held(f), run_prefill_and_decode(f)) for name, f in folders.items()}


def run_dp_attention(folders: dict[str, str], rank: int, exchange_type) -> dict:
    world = TorchDistributedGroup()
    set_tp_group(SingleProcessGroup())  # attention, dense layers, embeddings: whole
    exchange = exchange_type(world)
    set_expert_parallel(ExpertParallel(world, exchange))

    def exchange_token_counts(num_tokens: int) -> None:
        counts = [None, None]
        dist.all_gather_object(counts, num_tokens)
        exchange.begin_step(counts)

    return {
        name: run_prefill_and_decode(folders[name], PROMPTS_OF_DP_RANK[rank], exchange_token_counts)
        for name in DP_ATTENTION_CASES
    }


def _worker(rank: int, port: int, folders: dict[str, str], result_file: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        tp_attention = run_tp_attention(folders)
        dp_attention = {e.__name__: run_dp_attention(folders, rank, e) for e in DP_EXCHANGES}
        everyone = [None, None]
        dist.all_gather_object(everyone, dp_attention)
        if rank == 0:
            torch.save((tp_attention, everyone), result_file)
    finally:
        set_expert_parallel(None)
        set_tp_group(SingleProcessGroup())
        dist.destroy_process_group()


def test_expert_parallel_with_tp_and_with_dp_attention_matches_single_process(tmp_path):
    folders = {}
    for name, config in TP_ATTENTION_CASES.items():
        folder = write_checkpoint(config, tmp_path / name)
        randomize_vectors(folder)  # biases, sinks and correction biases all nonzero
        folders[name] = str(folder)
    result_file = str(tmp_path / "ep2.pt")
    mp.start_processes(
        _worker, args=(_free_port(), folders, result_file), nprocs=2, start_method="spawn"
    )
    tp_attention, dp_attention = torch.load(result_file)
    for name, folder in folders.items():
        held, logits = tp_attention[name]
        assert held == {(n // 2, n) for _, n in held}, name  # half of the experts, whole
        expected = run_prefill_and_decode(folder)
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0, msg=name)
    for name in DP_ATTENTION_CASES:
        for rank, prompt_lengths in enumerate(PROMPTS_OF_DP_RANK):
            expected = run_prefill_and_decode(folders[name], prompt_lengths)
            for exchange in DP_EXCHANGES:
                actual = dp_attention[rank][exchange.__name__][name]
                what = f"{name} {exchange.__name__} rank {rank}"
                torch.testing.assert_close(actual, expected, atol=1e-4, rtol=0, msg=what)
