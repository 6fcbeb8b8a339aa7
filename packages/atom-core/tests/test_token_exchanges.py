"""The data-parallel token exchanges over gloo, on 3 processes and on a 2-rank group of
them, with uneven token counts and a rank with none (and equal ones, as the data-parallel
decode graphs run them): dispatch, the rank's experts, then combine give each rank the
MoE output of its own tokens that one process with every expert gives.

- `GatheredTokens` combines by reduce-scatter: its group refuses an all-reduce.
- `AllToAllTokens` sends a rank only the tokens routed to at least one of its experts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from atom.all_to_all_tokens import AllToAllTokens
from atom.distributed import TorchDistributedGroup
from atom.expert_parallel import ExpertPlacement, GatheredTokens
from atom.kernels.moe import fused_moe_torch, topk_softmax_torch

EXPERTS, TOP_K, HIDDEN, INTER = 6, 2, 16, 24
TOKENS_PER_RANK = {3: [4, 0, 7], 2: [0, 5]}
LAYERS = 2  # a second dispatch/combine pair must not see the first one's routes


class ReduceScatterOnly(TorchDistributedGroup):
    def all_reduce(self, x):
        raise AssertionError("GatheredTokens all-reduced the experts' outputs")


def moe_layer(seed: int, num_tokens: int):
    """Experts, and every rank's tokens with their routing, alike on every rank."""
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) / HIDDEN**0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) / INTER**0.5
    x = torch.randn(num_tokens, HIDDEN, generator=gen)
    logits = torch.randn(num_tokens, EXPERTS, generator=gen)
    return (w13, w2), x, *topk_softmax_torch(logits, TOP_K, True)


def experts(hidden, w13, w2, weights, ids):
    return fused_moe_torch(hidden, w13, w2, weights, ids, "silu", None, None, None)


def check_exchange(
    exchange, group: TorchDistributedGroup, counts: list[int], uniform: bool = False
) -> None:
    """uniform: the exchange is told no counts, only that every rank runs as many tokens
    (`GatheredTokens.begin_uniform_steps`, the data-parallel decode graphs' capture)."""
    placement = ExpertPlacement.of_rank(EXPERTS, group.rank, group.world_size, "experts")
    held = slice(placement.first, placement.first + placement.count)
    mine = slice(sum(counts[: group.rank]), sum(counts[: group.rank + 1]))
    for layer in range(LAYERS):
        (w13, w2), x, weights, ids = moe_layer(layer, sum(counts))
        if uniform:
            exchange.begin_uniform_steps()
        else:
            exchange.begin_step(counts)
        h, w, i = exchange.dispatch(x[mine], weights[mine], ids[mine], placement)
        out = exchange.combine(experts(h, w13[held], w2[held], w, placement.local_ids(i)))
        expected = experts(x[mine], w13, w2, weights[mine], ids[mine])
        what = f"{type(exchange).__name__} rank {group.rank} of {group.world_size}, layer {layer}"
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5, msg=what)
        if isinstance(exchange, AllToAllTokens):
            routed_here = (placement.owner_ranks(ids) == group.rank).any(1)
            assert h.shape[0] == int(routed_here.sum()), what


def _worker(rank: int, rendezvous: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=3)
    try:
        pair = dist.new_group([0, 1])  # every rank takes part in creating it
        groups = {3: None, 2: pair} if rank < 2 else {3: None}
        for size, process_group in groups.items():
            group = ReduceScatterOnly(process_group)
            for exchange in (GatheredTokens(group), AllToAllTokens(group)):
                check_exchange(exchange, group, TOKENS_PER_RANK[size])
            check_exchange(GatheredTokens(group), group, [3] * size, uniform=True)
    finally:
        dist.destroy_process_group()


def test_token_exchanges_give_each_rank_the_single_process_moe_output(tmp_path):
    rendezvous = str(tmp_path / "rendezvous")
    mp.start_processes(_worker, args=(rendezvous,), nprocs=3, start_method="spawn")
