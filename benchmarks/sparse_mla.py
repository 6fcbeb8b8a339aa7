"""DeepSeek Sparse Attention's decode step against dense MLA's, on a CUDA GPU (issue #34).

DeepSeek-V3.2 shapes, bf16: 128 heads, latent L = 512, rope R = 64; the indexer's 64 heads
of 128 channels and top-2048. At each (batch, context), one decode token per sequence:

- dense: the MLA decode kernel over every cached row (atom.kernels.triton.mla);
- indexer: scores against every cached indexer key, then top-k as cache slots
  (atom.kernels.triton.indexer), keys in bf16 or fp8;
- sparse: MLA over each token's 2048 selected rows (atom.kernels.triton.sparse_mla).

The sparse step is indexer + sparse; it prints its time over the dense step's (issue #34
asks at most 0.35 at 32k, batch 64) and the indexer's share of it (at most 0.25), with the
GB/s each part moves. Before timing, the Triton indexer and sparse MLA are checked against
the torch references on the first sequences. Times are medians of triton.testing.do_bench.
    PYTHONPATH=packages/atom-core/src:. python benchmarks/sparse_mla.py [--json out.json]
        [--shapes 64x32768 ...] [--block-size 64]
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch

from atom.forward_context import AttentionMetadata
from atom.kernels.indexer import indexer_topk_torch
from atom.kernels.kv_cache import FP8_KV_CACHE_DTYPE
from atom.kernels.sparse_mla import sparse_mla_attention_torch
from atom.kernels.triton import mla
from atom.kernels.triton.indexer import indexer_topk_triton
from atom.kernels.triton.sparse_mla import sparse_mla_attention_triton
from benchmarks.kernel_timings import shuffled_block_tables
from benchmarks.timing import H100_PEAK_GBPS, bench

HEADS, LATENT, ROPE = 128, 512, 64
INDEX_HEADS, INDEX_DIM, TOPK = 64, 128, 2048
SCALE = (128 + ROPE) ** -0.5
SHAPES = ["64x4096", "64x8192", "64x32768", "1x32768"]
CHECKED_SEQS = 2


def decode_batch(batch: int, context: int, block_size: int, index_dtype: torch.dtype):
    """Queries, the latent and indexer key caches (pages in random order) and the metadata
    of `batch` decode tokens, each the last of `context` cached tokens."""
    tables = shuffled_block_tables([context] * batch, block_size)
    metadata = AttentionMetadata.build([1] * batch, [context] * batch, tables, [-1] * batch,
                                       device="cuda")  # fmt: skip
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    num_pages = sum(map(len, tables))
    latent_cache = torch.randn(num_pages, block_size, LATENT + ROPE, **bf16)
    index_cache = torch.randn(num_pages, block_size, INDEX_DIM, **bf16).to(index_dtype)
    return dict(
        tables=tables,
        metadata=metadata,
        latent_cache=latent_cache,
        index_cache=index_cache,
        q_latent=torch.randn(batch, HEADS, LATENT, **bf16),
        q_pe=torch.randn(batch, HEADS, ROPE, **bf16),
        index_q=torch.randn(batch, INDEX_HEADS, INDEX_DIM, **bf16),
        # the model folds Di^-0.5 and Hi^-0.5 into the weights
        index_weights=torch.randn(batch, INDEX_HEADS, device="cuda") * (INDEX_DIM * INDEX_HEADS) ** -0.5,
    )  # fmt: skip


def check(inputs: dict) -> str:
    """The Triton indexer's selection and sparse MLA's output against the torch references
    on the first CHECKED_SEQS sequences: the number of differing selections, the largest
    output difference."""
    x = inputs
    n = min(CHECKED_SEQS, len(x["q_latent"]))
    seq_lens = x["metadata"].seq_lens_cpu[:n].tolist()
    first = AttentionMetadata.build([1] * n, seq_lens, x["tables"][:n], [-1] * n, device="cuda")
    slots = torch.empty(n, TOPK, dtype=torch.int32, device="cuda")
    expected_slots = indexer_topk_torch(
        x["index_q"][:n], x["index_weights"][:n], x["index_cache"], first, TOPK, slots.clone()
    )
    indexer_topk_triton(x["index_q"][:n], x["index_weights"][:n], x["index_cache"], first,
                        TOPK, slots)  # fmt: skip
    differing = sum(len(set(a.tolist()) ^ set(b.tolist())) for a, b in zip(slots, expected_slots))
    out = torch.empty_like(x["q_latent"][:n])
    args = (x["q_latent"][:n], x["q_pe"][:n], x["latent_cache"], expected_slots, SCALE)
    sparse_mla_attention_triton(*args, out)
    expected = sparse_mla_attention_torch(*args, out.clone())
    error = (out.float() - expected.float()).abs().max().item()
    return f"selections differing {differing} of {n * TOPK}, sparse MLA max abs error {error:.2e}"


def step_rows(batch: int, context: int, block_size: int, index_dtype: torch.dtype):
    x = decode_batch(batch, context, block_size, index_dtype)
    md = x["metadata"]
    print(f"{batch} x {context}, indexer keys {str(index_dtype).removeprefix('torch.')}: "
          f"{check(x)}", flush=True)  # fmt: skip
    slots = torch.empty(batch, TOPK, dtype=torch.int32, device="cuda")
    select = partial(indexer_topk_triton, x["index_q"], x["index_weights"], x["index_cache"],
                     md, TOPK, slots)  # fmt: skip
    select()
    out = torch.empty_like(x["q_latent"])
    dense_ms = bench(partial(mla.mla_decode_attention_triton, x["q_latent"], x["q_pe"],
                             x["latent_cache"], md, SCALE, out))  # fmt: skip
    indexer_ms = bench(select)
    sparse_ms = bench(partial(sparse_mla_attention_triton, x["q_latent"], x["q_pe"],
                              x["latent_cache"], slots, SCALE, out))  # fmt: skip
    row_bytes = (LATENT + ROPE) * 2
    moved = {
        "dense": batch * context * row_bytes,
        "indexer": batch * context * INDEX_DIM * x["index_cache"].element_size(),
        "sparse": batch * min(TOPK, context) * row_bytes,
    }
    times = {"dense": dense_ms, "indexer": indexer_ms, "sparse": sparse_ms}
    step_ms = indexer_ms + sparse_ms
    return {
        "shape": f"{batch}x{context}",
        "index_dtype": str(index_dtype).removeprefix("torch."),
        **{f"{part}_ms": ms for part, ms in times.items()},
        **{f"{part}_GB/s": moved[part] / ms / 1e6 for part, ms in times.items()},
        "sparse_step_vs_dense": step_ms / dense_ms,
        "indexer_share": indexer_ms / step_ms,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", nargs="+", default=SHAPES, help="BATCHxCONTEXT")
    parser.add_argument("--block-size", type=int, default=64, help="cache page size in tokens")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    header = (f"{'shape':>9} {'idx keys':>12} {'dense ms':>9} {'indexer ms':>10} "
              f"{'sparse ms':>9} {'step/dense':>10} {'idx share':>9}  GB/s dense / indexer / sparse "
              f"(peak {H100_PEAK_GBPS:.0f})")  # fmt: skip
    for shape in args.shapes:
        batch, context = map(int, shape.split("x"))
        for index_dtype in (torch.bfloat16, FP8_KV_CACHE_DTYPE):
            row = step_rows(batch, context, args.block_size, index_dtype)
            rows.append(row)
            if len(rows) == 1:
                print(header)
            print(
                f"{row['shape']:>9} {row['index_dtype']:>12} {row['dense_ms']:>9.4f} "
                f"{row['indexer_ms']:>10.4f} {row['sparse_ms']:>9.4f} "
                f"{row['sparse_step_vs_dense']:>10.2f} {row['indexer_share']:>9.2f}  "
                f"{row['dense_GB/s']:.0f} / {row['indexer_GB/s']:.0f} / {row['sparse_GB/s']:.0f}",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
