"""Gated DeltaNet kernels on a CUDA GPU: ATOM's Triton causal conv1d and gated delta rule
against vLLM 0.32's own, at Qwen3-Next-80B-A3B's linear-attention shapes (16 key and 32
value heads of dim 128, conv kernel 4, bf16 activations, a bf16 recurrent state as both
hosts keep it by default; --state-dtype float32 for vLLM's --mamba-ssm-cache-dtype float32).

Each side runs as its Qwen3-Next layer calls it, from the same pre-conv projection output
mixed_qkv [T, q|k|v], gate inputs a, b [T, Hv] and parameters A_log, dt_bias:
- ATOM: causal_conv1d, then g = -exp(A_log) * softplus(a + dt_bias) and beta = sigmoid(b)
  in torch, then gated_delta_rule (q/k l2norm inside; states [S, Hv, Dk, Dv] updated in
  place through state_slots; the chunked path reads the lengths on the host each call).
- vLLM prefill: causal_conv1d_fn (channel-last x, conv states [S, C, K-1] viewed from its
  default "SD" storage [S, K-1, C]), fused_post_conv_prep (split, l2norm, g, beta), a
  gather of the initial states [N, Hv, Dv, Dk], the chunked rule, a scatter back. Its
  per-step metadata (conv program map, FLA chunk indices) is built once, as its metadata
  builder does. Two rules: "vllm-fi", FlashInfer's, vLLM's default on Hopper, and
  "vllm-fla", its Triton/FLA fallback (--gdn-prefill-backend triton).
- vLLM decode: causal_conv1d_update, then fused_recurrent_gated_delta_rule_packed_decode
  (gating, l2norm and the rule in one kernel), its default non-speculative path.
Both sides read and write the state in --state-dtype and do the math in fp32. Pool row 0 is
vLLM's null block, so sequences use rows 1..B.

Rows: conv, rule (everything after the conv) and core (both), per case. Before timing, the
outputs and final states of every side are compared with ATOM's (and with ATOM's torch
reference for sequences up to 4096 tokens). Decode steps are timed as CUDA-graph replays,
as engines run them (eagerly, a one-sequence step times the host's launches:
docs/performance.md, "Gated delta chunk launches"). ATOM and the peers take turns over five rounds;
ratio = peer / ATOM (above 1: ATOM faster). Decode rows give ATOM's GB/s (recurrent and conv
state read + write, activations) against the H100's peak. Usage:
    PYTHONPATH=packages/atom-core/src:. python benchmarks/gated_delta.py [--json out.json]
        [--cases decode-B1 prefill-1x4096 ...] [--no-flashinfer]
    TRITON_INTERPRET=1 PYTHONPATH=packages/atom-core/src:. python benchmarks/gated_delta.py
        --check-cpu     # tiny heads on the CPU: ATOM (and vLLM-FLA if importable) vs reference
    PYTHONPATH=packages/atom-core/src:. python benchmarks/gated_delta.py --sweep [--cases ...]
        # ATOM's launch configs, prefill or decode cases (benchmarks/gated_delta_sweep.py); with --check-cpu
        # and TRITON_INTERPRET=1, the same plumbing at tiny heads on the CPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from dataclasses import dataclass
from functools import cache, partial
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from atom.kernels.causal_conv1d import causal_conv1d_torch
from atom.kernels.gated_delta import gated_delta_rule_torch
from atom.kernels.triton.causal_conv1d import causal_conv1d
from atom.kernels.triton.gated_delta import gated_delta_rule
from benchmarks.timing import H100_PEAK_GBPS, graphed, interleaved, median_ratio


@dataclass(frozen=True)
class Shape:
    k_heads: int
    v_heads: int
    head_dim: int  # keys and values alike
    conv_kernel: int = 4

    @property
    def key_dim(self) -> int:
        return self.k_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.v_heads * self.head_dim


QWEN3_NEXT = Shape(k_heads=16, v_heads=32, head_dim=128)
TINY = Shape(k_heads=2, v_heads=4, head_dim=16)
CASES = {  # name: (sequence lengths, whether they start from a state)
    "decode-B1": ([1], True),
    "decode-B64": ([1] * 64, True),
    "decode-B256": ([1] * 256, True),
    "prefill-1x4096": ([4096], False),
    "prefill-1x32768": ([32768], False),
    "prefill-8x4096": ([4096] * 8, False),
    "prefill-8x4096-state": ([4096] * 8, True),
}
CPU_CASES = {"decode-B3": ([1] * 3, True), "prefill-varlen": ([5, 70, 23], False),
             "prefill-varlen-state": ([5, 70, 23], True)}  # fmt: skip
# --sweep: the prefill cases its launch search times
SWEEP_CASES = ["prefill-1x4096", "prefill-8x4096", "prefill-1x32768"]
REFERENCE_MAX_LEN = 4096  # the torch reference steps token by token
SUSPECT_REL_ERROR = 2e-2


def make_batch(
    shape: Shape, lens: list[int], has_state: bool, device: str, state_dtype=torch.bfloat16
) -> SimpleNamespace:
    """Seeded inputs of one layer step. A_log = log U(1, 16) as Qwen3-Next initialises it,
    softplus(a + dt_bias) near U(1e-3, 1e-2): states carry over tens to hundreds of tokens."""
    torch.manual_seed(0)
    tokens, seqs, c, hv, d = sum(lens), len(lens), shape.conv_dim, shape.v_heads, shape.head_dim
    bf16 = dict(device=device, dtype=torch.bfloat16)
    dt = torch.empty(hv, device=device).uniform_(1e-3, 1e-2)
    return SimpleNamespace(
        shape=shape, lens=lens,
        decode=tokens == seqs,  # one token per sequence: the recurrent (decode) kernels
        x=torch.randn(tokens, c, **bf16),
        weight=torch.randn(c, shape.conv_kernel, **bf16) * shape.conv_kernel**-0.5,
        a=torch.randn(tokens, hv, **bf16) * 0.1, b=torch.randn(tokens, hv, **bf16),
        A_log=torch.empty(hv, device=device).uniform_(1, 16).log(),
        dt_bias=dt + torch.log(-torch.expm1(-dt)),  # softplus^-1(dt)
        conv_state=torch.randn(seqs + 1, c, shape.conv_kernel - 1, **bf16),
        ssm_state=(torch.randn(seqs + 1, hv, d, d, device=device) * 0.1).to(state_dtype),
        slots=torch.arange(1, seqs + 1, dtype=torch.int32, device=device),
        qsl=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                         device=device),
        has_initial=torch.full((seqs,), has_state, dtype=torch.bool, device=device),
    )  # fmt: skip


def atom_side(batch, conv_op=causal_conv1d, rule_op=gated_delta_rule) -> dict:
    """{part: fn(inputs, conv_state, ssm_state) -> (out, conv_state, ssm_state)}, as
    atom.layers.gated_delta_net calls the ops (`conv_op`/`rule_op`: Triton or reference)."""
    s, b = batch.shape, batch
    meta = (b.slots, b.qsl, b.has_initial)

    def conv(x, conv_state, ssm_state):
        return conv_op(x, b.weight, None, conv_state, *meta, "silu"), conv_state, ssm_state

    def rule(mixed, conv_state, ssm_state):
        t = mixed.shape[0]
        q, k, v = mixed.split([s.key_dim, s.key_dim, s.v_heads * s.head_dim], dim=-1)
        g = -b.A_log.float().exp() * F.softplus(b.a.float() + b.dt_bias)
        out = rule_op(
            q.view(t, s.k_heads, s.head_dim), k.view(t, s.k_heads, s.head_dim),
            v.view(t, s.v_heads, s.head_dim), g, b.b.sigmoid(), ssm_state, *meta,
            s.head_dim**-0.5, True,
        )  # fmt: skip
        return out, conv_state, ssm_state

    def core(x, conv_state, ssm_state):
        return rule(conv(x, conv_state, ssm_state)[0], conv_state, ssm_state)

    return {"conv": conv, "rule": rule, "core": core}


@cache
def say_once(message: str) -> None:
    print(message, flush=True)


def vllm_sides(batch, flashinfer: bool) -> dict[str, dict]:
    """{peer: {part: fn}} of vLLM 0.32's kernels, in its state layouts (see side_states);
    {} without vllm."""
    try:
        from vllm.model_executor.layers.mamba.ops.causal_conv1d import (
            causal_conv1d_fn,
            causal_conv1d_update,
        )
        from vllm.third_party.flash_linear_attention.ops import (
            chunk_gated_delta_rule,
            fused_post_conv_prep,
            fused_recurrent_gated_delta_rule_packed_decode,
        )
        from vllm.third_party.flash_linear_attention.ops.index import (
            prepare_chunk_indices,
            prepare_chunk_offsets,
        )
        from vllm.third_party.flash_linear_attention.ops.utils import FLA_CHUNK_SIZE
        from vllm.v1.attention.backends.utils import compute_causal_conv1d_metadata
    except ImportError as exc:
        say_once(f"vLLM is not importable ({exc}): timing ATOM only")
        return {}
    s, b = batch.shape, batch
    out_buffer = torch.empty_like(b.x)

    def decode_conv(x, conv_state, ssm_state):
        y = causal_conv1d_update(x, conv_state, b.weight, None, "silu",
                                 conv_state_indices=b.slots, validate_data=False, out=out_buffer)  # fmt: skip
        return y, conv_state, ssm_state

    def decode_rule(mixed, conv_state, ssm_state):
        out = torch.empty(
            mixed.shape[0], s.v_heads, s.head_dim, dtype=mixed.dtype, device=mixed.device
        )
        fused_recurrent_gated_delta_rule_packed_decode(
            mixed_qkv=mixed, a=b.a, b=b.b, A_log=b.A_log, dt_bias=b.dt_bias,
            scale=s.head_dim**-0.5, initial_state=ssm_state, out=out.unsqueeze(1),
            ssm_state_indices=b.slots, use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        return out, conv_state, ssm_state

    if b.decode:
        parts = {"conv": decode_conv, "rule": decode_rule}
        return {"vllm": {**parts, "core": chained(parts)}}

    qsl_cpu = b.qsl.cpu()
    nums, batch_ptr, offset_ptr = compute_causal_conv1d_metadata(qsl_cpu, device=b.x.device)
    conv_meta = SimpleNamespace(
        nums_dict=nums, batch_ptr=batch_ptr, token_chunk_offset_ptr=offset_ptr
    )
    chunk_indices = prepare_chunk_indices(qsl_cpu, FLA_CHUNK_SIZE).to(b.x.device)
    chunk_offsets = prepare_chunk_offsets(qsl_cpu, FLA_CHUNK_SIZE).to(b.x.device)

    def prefill_conv(x, conv_state, ssm_state):
        y = causal_conv1d_fn(x.transpose(0, 1), b.weight, None, activation="silu",
                             conv_states=conv_state, has_initial_state=b.has_initial,
                             cache_indices=b.slots, query_start_loc=b.qsl, metadata=conv_meta)  # fmt: skip
        return y.transpose(0, 1), conv_state, ssm_state

    def fla_rule(q, k, v, g, beta, initial):
        return chunk_gated_delta_rule(
            q=q, k=k, v=v, g=g, beta=beta, initial_state=initial, output_final_state=True,
            cu_seqlens=b.qsl, chunk_indices=chunk_indices, chunk_offsets=chunk_offsets,
            use_qk_l2norm_in_kernel=False,
        )  # fmt: skip

    def fi_rule(q, k, v, g, beta, initial):
        return fi_chunk_gated_delta_rule(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial,
                                         output_final_state=True, cu_seqlens=b.qsl,
                                         use_qk_l2norm_in_kernel=False)  # fmt: skip

    def prefill_rule(chunk_rule):
        def rule(mixed, conv_state, ssm_state):
            q, k, v, g, beta = fused_post_conv_prep(
                conv_output=mixed, a=b.a, b=b.b, A_log=b.A_log, dt_bias=b.dt_bias,
                num_k_heads=s.k_heads, head_k_dim=s.head_dim, head_v_dim=s.head_dim,
                apply_l2norm=True, output_g_exp=False,
            )  # fmt: skip
            initial = ssm_state[b.slots]
            initial[~b.has_initial, ...] = 0
            o, final = chunk_rule(*(t.unsqueeze(0) for t in (q, k, v, g, beta)), initial)
            ssm_state[b.slots] = final.to(ssm_state.dtype)
            return o.squeeze(0), conv_state, ssm_state

        return rule

    rules = {}
    if flashinfer:
        try:  # vLLM's wrapper; it imports flashinfer when called
            from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
                fi_chunk_gated_delta_rule,
            )

            rules["vllm-fi"] = fi_rule
        except ImportError as exc:
            say_once(f"vLLM's FlashInfer GDN prefill is not importable: {exc}")
    rules["vllm-fla"] = fla_rule
    sides = {}
    for name, chunk_rule in rules.items():
        parts = {"conv": prefill_conv, "rule": prefill_rule(chunk_rule)}
        sides[name] = {**parts, "core": chained(parts)}
    return sides


def chained(parts: dict):
    def core(x, conv_state, ssm_state):
        return parts["rule"](parts["conv"](x, conv_state, ssm_state)[0], conv_state, ssm_state)

    return core


def side_states(side: str, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh copies of the batch's pools in the side's layouts. vLLM: conv [S, C, K-1] as a
    view of its default [S, K-1, C] storage, recurrent [S, Hv, Dv, Dk]."""
    if side.startswith("vllm"):
        conv = batch.conv_state.transpose(1, 2).contiguous().transpose(1, 2)
        return conv, batch.ssm_state.transpose(2, 3).contiguous()
    return batch.conv_state.clone(), batch.ssm_state.clone()


def error(got: torch.Tensor, want: torch.Tensor) -> dict:
    got, want = got.float(), want.float()
    max_abs = (got - want).abs().max().item()
    return {"max_abs": max_abs, "rel": max_abs / max(want.abs().max().item(), 1e-6)}


def agreement(batch, sides: dict[str, dict]) -> dict:
    """Each side's core output and final states (the batch's pool rows) against ATOM's,
    and ATOM's against the "reference" side; {peer: {field: error}}, and the failed sides."""
    results, failed = {}, []
    for side, parts in sides.items():
        conv_state, ssm_state = side_states(side, batch)
        try:
            out, conv_state, ssm_state = parts["core"](batch.x, conv_state, ssm_state)
        except Exception as exc:  # a kernel this vLLM or its FlashInfer cannot run here
            print(f"  {side} failed: {type(exc).__name__}: {exc}", flush=True)
            failed.append(side)
            continue
        if side.startswith("vllm"):
            ssm_state = ssm_state.transpose(2, 3)
        rows = batch.slots.long()
        results[side] = (out.reshape(-1, *out.shape[-2:]), conv_state[rows], ssm_state[rows])
    checks = {}
    for side, result in results.items():
        if side == "atom":
            continue
        name, got, want = f"{side}-vs-atom", result, results["atom"]
        if side == "reference":
            name, got, want = "atom-vs-reference", want, got
        checks[name] = {f: error(g, w) for f, g, w in zip(("out", "conv", "ssm"), got, want)}
        worst = max(e["rel"] for e in checks[name].values())
        text = ", ".join(
            f"{f} {e['max_abs']:.1e} ({e['rel']:.1e} rel)" for f, e in checks[name].items()
        )
        flag = "  SUSPECT" if worst > SUSPECT_REL_ERROR else ""
        print(f"  {name}: max abs error {text}{flag}", flush=True)
    return {"checks": checks, "failed": failed}


def part_bytes(shape: Shape, batch: int, part: str, state_bytes: int) -> int:
    """Decode bytes moved: conv reads x and writes y (bf16) and its state; the rule reads the
    conv output, writes o (bf16) and reads and writes the state."""
    c, hv, d = shape.conv_dim, shape.v_heads, shape.head_dim
    conv = batch * 2 * c * (2 + 2 * (shape.conv_kernel - 1))
    rule = batch * (2 * c + 2 * hv * d + 2 * state_bytes * hv * d * d)
    return {"conv": conv, "rule": rule, "core": conv + rule}[part]


def measure(name: str, lens: list[int], has_state: bool, flashinfer: bool, state_dtype):
    batch = make_batch(QWEN3_NEXT, lens, has_state, "cuda", state_dtype)
    print(f"{name}: {len(lens)} sequence(s), {batch.x.shape[0]} tokens, "
          f"initial state {has_state}", flush=True)  # fmt: skip
    sides = {"atom": atom_side(batch), **vllm_sides(batch, flashinfer)}
    reference = {}
    if max(lens) <= REFERENCE_MAX_LEN:
        reference["reference"] = atom_side(batch, causal_conv1d_torch, gated_delta_rule_torch)
    check = agreement(batch, sides | reference)
    for failed in check["failed"]:
        sides.pop(failed, None)
    mixed = atom_side(batch)["conv"](batch.x, batch.conv_state.clone(), None)[0]
    for part in ("conv", "rule", "core"):
        runs = {}  # each side on its own copy of the pools, updated in place call after call
        for side, parts in sides.items():
            inputs = mixed if part == "rule" else batch.x
            runs[side] = partial(parts[part], inputs, *side_states(side, batch))
            if batch.decode:  # timed as CUDA-graph replays, as engines run decode steps
                try:
                    runs[side] = graphed(runs[side])
                except Exception as exc:  # a side whose step cannot be captured runs eagerly
                    print(f"  {side} {part}: not capturable ({type(exc).__name__}: {exc}); "
                          "timed eagerly", flush=True)  # fmt: skip
        times = dict(zip(runs, interleaved(list(runs.values()))))
        row = {"case": name, "part": part, "atom_us": 1e3 * statistics.median(times["atom"])}
        for side in runs.keys() - {"atom"}:
            row[f"{side}_us"] = 1e3 * statistics.median(times[side])
            row[f"{side}_ratio"] = median_ratio(times[side], times["atom"])
        if batch.decode:
            state_bytes = batch.ssm_state.element_size()
            row["atom_GB/s"] = (
                part_bytes(QWEN3_NEXT, len(lens), part, state_bytes) / row["atom_us"] / 1e3
            )
            row["peak_bw_fraction"] = row["atom_GB/s"] / H100_PEAK_GBPS
        row["check"] = check["checks"]
        yield row


def print_row(row: dict) -> None:
    peers = sorted(k[: -len("_us")] for k in row if k.endswith("_us") and k != "atom_us")
    text = "".join(f"  {p} {row[f'{p}_us']:9.1f} us ({row[f'{p}_ratio']:.2f}x)" for p in peers)
    bw = (f"  ATOM {row['atom_GB/s']:6.0f} GB/s ({100 * row['peak_bw_fraction']:.0f}% peak)"
          if "atom_GB/s" in row else "")  # fmt: skip
    print(f"{row['case']:>22} {row['part']:>5}  ATOM {row['atom_us']:9.1f} us{text}{bw}")
    print("RESULT", json.dumps(row), flush=True)


def check_cpu() -> None:
    """Tiny heads under Triton's interpreter: ATOM's Triton side (and vLLM's FLA side when
    vllm imports) against ATOM's torch reference, through the benchmark's own plumbing."""
    worst = 0.0
    for name, (lens, has_state) in CPU_CASES.items():
        print(f"{name}: lengths {lens}, initial state {has_state}", flush=True)
        batch = make_batch(TINY, lens, has_state, "cpu")
        sides = {"atom": atom_side(batch), **vllm_sides(batch, flashinfer=False)}
        sides["reference"] = atom_side(batch, causal_conv1d_torch, gated_delta_rule_torch)
        checks = agreement(batch, sides)["checks"]
        worst = max(worst, *(e["rel"] for f in checks.values() for e in f.values()))
    if worst > SUSPECT_REL_ERROR:
        raise SystemExit(f"check-cpu FAILED: worst relative error {worst:.2e}")
    print(f"check-cpu passed: worst relative error {worst:.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", choices=list(CASES))
    parser.add_argument("--no-flashinfer", action="store_true", help="skip vLLM's FlashInfer rule")
    parser.add_argument("--check-cpu", action="store_true", help="tiny shapes, Triton interpreter")
    parser.add_argument("--sweep", action="store_true", help="time ATOM's launch configs")
    parser.add_argument("--state-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--json", help="write all rows to this file")
    args = parser.parse_args()
    state_dtype = getattr(torch, args.state_dtype)
    if args.check_cpu and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--check-cpu needs TRITON_INTERPRET=1 set before Python starts")
    if args.sweep:  # imported here: it imports this module
        from benchmarks.gated_delta_sweep import sweep

        if args.check_cpu:
            cases = {name: CPU_CASES[name][0] for name in ("prefill-varlen", "decode-B3")}
            shape, device = TINY, "cpu"
        else:
            require_cuda()
            names = args.cases or SWEEP_CASES
            cases, shape, device = {n: CASES[n][0] for n in names}, QWEN3_NEXT, "cuda"
        return save(sweep(cases, shape, device, state_dtype), args.json)
    if args.check_cpu:
        return check_cpu()
    require_cuda()
    print(f"{torch.cuda.get_device_name()}: Qwen3-Next GDN {QWEN3_NEXT}", flush=True)
    rows = []
    for name in args.cases or list(CASES):
        for row in measure(name, *CASES[name], not args.no_flashinfer, state_dtype):
            print_row(row)
            rows.append(row)
            save(rows, args.json)  # after every row: a run cut short keeps what it measured


def save(rows: list[dict], path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)


def require_cuda() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gated_delta.py needs a CUDA GPU (or --check-cpu on a CPU)")


if __name__ == "__main__":
    main()
