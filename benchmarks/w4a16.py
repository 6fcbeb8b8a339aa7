"""W4A16 GEMM benchmark on a CUDA GPU: ATOM's Triton kernel against vLLM's Marlin on
Qwen3-8B's linear layers (issue #22 item 3), and Machete, which vLLM 0.32 picks ahead of
Marlin for 4-bit GPTQ / AWQ on Hopper (choose_mp_linear_kernel).

Per layer, random 4-bit codes, zero points and bf16 scales are drawn once (seeded) and
stored as a GPTQ v1 (symmetric: uint4b8) or AWQ (zero points: uint4) checkpoint stores
them. ATOM repacks them through its own loader (weight loaders, then
process_weights_after_loading); vLLM's layouts come from the same integers through its own
functions, as its MarlinLinearKernel and MacheteLinearKernel prepare them. Each output is
checked against x @ W.T (float64, bf16 dequantized weights) before timing. Each kernel is
timed as a CUDA-graph replay (benchmarks.timing.graphed), ATOM and the peers taking turns
over five rounds; a ratio above 1: ATOM is faster.
GB/s counts the weight bytes ATOM reads (packed codes, fp32 scales and zero points).
    PYTHONPATH=packages/atom-core/src:. python benchmarks/w4a16.py [--tokens 1 16]
        [--layers qkv o] [--formats gptq awq] [--group-size 128] [--sweep] [--json out.json]
--sweep times, per layer and M in (1, 16), candidate launches of ATOM's small-M kernel
(tile width, K splits, warps, stages; benchmarks/w4a16_sweep.py) as graph replays, each
checked against the reference first, and prints them fastest first and the winner per
(layer, M); no peers.
--check-cpu builds small layers on CPU through ATOM's loader and checks ATOM's torch
reference (with TRITON_INTERPRET=1 also the Triton kernel, fp32, and with --sweep every
candidate launch on a small layer, each timed by one interpreted call) against the
dequantized matmul.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import dataclass
from functools import partial

import torch

from atom.kernels.triton.tiles import num_sms
from atom.kernels.triton.w4a16 import pick_w4a16_config, w4a16_gemm_triton
from atom.kernels.w4a16 import pack_int4_rows
from atom.layers.linear import ReplicatedLinear
from atom.layers.quantization.awq import AWQ_PACK_ORDER, AwqConfig
from atom.layers.quantization.gptq import GptqConfig
from benchmarks.timing import (
    H100_PEAK_GBPS,
    H100_PEAK_TFLOPS,
    graphed,
    interleaved,
    median_ratio,
    wall_ms,
)
from benchmarks.w4a16_sweep import (
    SWEEP_TOKENS,
    graph_replay_us,
    print_sweep,
    search,
    sweep_configs,
)

# Qwen3-8B (hidden 4096, intermediate 12288, 32 q / 8 kv heads of 128): (K, N) per layer.
LAYERS = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 24576), "down": (12288, 4096)}
TOKENS = [1, 16, 64, 256]
FORMATS = ("gptq", "awq")
PEERS = ("marlin", "machete")
# Max |error| over max |reference|: a bf16 output is within 2^-8 of each exact element.
TOLERANCE = 1e-2


@dataclass
class QuantizedWeight:
    """W[k, n] = (codes[k, n] - zeros[g, n]) * scales[g, n], g = k // group_size."""

    fmt: str
    codes: torch.Tensor  # [K, N] int32 in [0, 15]
    zeros: torch.Tensor  # [G, N] int32 in [0, 15]; 8 for GPTQ (symmetric)
    scales: torch.Tensor  # [G, N] bf16
    group_size: int  # the checkpoint's: -1 for one group per output channel

    def dequantized(self) -> torch.Tensor:
        """[K, N] float64: the weight rounded once to bf16, as both kernels multiply it."""
        rows = self.codes.shape[0] // self.zeros.shape[0]
        zeros = self.zeros.repeat_interleave(rows, dim=0)
        scales = self.scales.float().repeat_interleave(rows, dim=0)
        return ((self.codes - zeros).float() * scales).bfloat16().double()


def random_weight(fmt: str, k: int, n: int, group_size: int, device) -> QuantizedWeight:
    gen = torch.Generator(device).manual_seed(k * n)
    groups = 1 if group_size == -1 else k // group_size
    codes = torch.randint(0, 16, (k, n), generator=gen, device=device, dtype=torch.int32)
    if fmt == "gptq":
        zeros = torch.full((groups, n), 8, device=device, dtype=torch.int32)
    else:
        zeros = torch.randint(0, 16, (groups, n), generator=gen, device=device, dtype=torch.int32)
    # Scales near 1 / (4 sqrt(K)) keep the outputs of unit activations near 1.
    scales = (torch.rand(groups, n, generator=gen, device=device) + 0.5) / (4 * k**0.5)
    return QuantizedWeight(fmt, codes, zeros, scales.bfloat16(), group_size)


def packed_columns(values: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """[R, N] codes -> [R, N/8] int32, eight columns a word: column order[p] in nibble p."""
    r, n = values.shape
    ordered = values.reshape(r, n // 8, 8)[..., list(order)].reshape(r, n)
    return pack_int4_rows(ordered.T).T.contiguous()


def checkpoint(w: QuantizedWeight) -> tuple[object, dict[str, torch.Tensor]]:
    """(ATOM's quantization config, the layer's tensors) as the format's checkpoint has them."""
    if w.fmt == "gptq":  # v1 stores zero points minus one
        config = GptqConfig.from_dict({"bits": 4, "group_size": w.group_size, "sym": True})
        k = w.codes.shape[0]
        group_of_row = torch.arange(k, device=w.codes.device) // (k // w.zeros.shape[0])
        return config, {
            "qweight": pack_int4_rows(w.codes),
            "qzeros": packed_columns((w.zeros - 1) & 0xF),
            "scales": w.scales,
            "g_idx": group_of_row.int(),
        }
    config = AwqConfig.from_dict({"bits": 4, "group_size": w.group_size, "zero_point": True})
    return config, {
        "qweight": packed_columns(w.codes, AWQ_PACK_ORDER),
        "qzeros": packed_columns(w.zeros, AWQ_PACK_ORDER),
        "scales": w.scales,
    }


def atom_layer(w: QuantizedWeight) -> ReplicatedLinear:
    """ATOM's linear layer loaded from `w`'s checkpoint tensors, repacked as at model load."""
    config, tensors = checkpoint(w)
    with torch.device(w.codes.device):
        layer = ReplicatedLinear(*w.codes.shape, quant_config=config, prefix=f"bench.{w.fmt}")
        for name, tensor in tensors.items():
            param = getattr(layer, name)
            param.weight_loader(param, tensor)
        layer.process_weights_after_loading()
    return layer


def atom_gemm(layer: ReplicatedLinear):
    return partial(
        w4a16_gemm_triton, qweight=layer.qweight_w4, scales=layer.scales_w4,
        zeros=layer.zeros_w4, group_size=layer.w4a16_shape.group_size, bias=None,
    )  # fmt: skip


def import_vllm():
    try:
        from vllm import _custom_ops as ops
        from vllm.model_executor.layers.quantization.utils import marlin_utils
        from vllm.scalar_type import scalar_types
    except ImportError as exc:
        print(f"vLLM is not importable ({exc}): Marlin and Machete are skipped", flush=True)
        return None
    return ops, marlin_utils, scalar_types


def marlin_gemm(vllm, w: QuantizedWeight):
    """x -> vLLM's Marlin GEMM of `w`, prepared as MarlinLinearKernel does (no padding:
    every Qwen3-8B shape is a whole number of Marlin tiles)."""
    ops, mu, types = vllm
    (k, n), device = w.codes.shape, w.codes.device
    qweight = ops.gptq_marlin_repack(pack_int4_rows(w.codes), size_k=k, size_n=n, num_bits=4)
    scales = mu.marlin_permute_scales(w.scales, size_k=k, size_n=n, group_size=w.group_size)
    if w.fmt == "gptq":
        zeros, wtype = mu.marlin_make_empty(device), types.uint4b8
    else:
        groups = w.zeros.shape[0]
        zeros = mu.marlin_zero_points(w.zeros, size_k=groups, size_n=n, num_bits=4)
        wtype = types.uint4
    # The locks vLLM keeps per stream (get_marlin_workspace); Marlin resets them each call.
    workspace = mu.marlin_make_workspace_new(device, mu.MARLIN_MAX_BLOCKS_PER_SM)
    return partial(
        mu.apply_gptq_marlin_linear, weight=qweight, weight_scale=scales, weight_zp=zeros,
        workspace=workspace, wtype=wtype, output_size_per_partition=n,
        input_size_per_partition=k,
    )  # fmt: skip


def machete_gemm(vllm, w: QuantizedWeight):
    """x -> vLLM's Machete GEMM of `w`, prepared as MacheteLinearKernel does."""
    from vllm.model_executor.layers.quantization.utils.machete_utils import (
        query_machete_supported_group_sizes,
    )

    if w.group_size not in (supported := query_machete_supported_group_sizes(torch.bfloat16)):
        raise ValueError(f"group size {w.group_size} is not one of Machete's {supported}")
    ops, _, types = vllm
    wtype = types.uint4b8 if w.fmt == "gptq" else types.uint4
    columns_major = pack_int4_rows(w.codes).t().contiguous().t()
    b_q = ops.machete_prepack_B(columns_major, torch.bfloat16, wtype, torch.bfloat16)
    # Machete takes zero points pre-multiplied by the scales.
    zeros = None if w.fmt == "gptq" else (-1.0 * w.scales * w.zeros.to(w.scales.dtype))
    return lambda x: ops.machete_mm(
        a=x, b_q=b_q, b_type=wtype, b_group_scales=w.scales, b_group_zeros=zeros,
        b_group_size=w.group_size,
    )  # fmt: skip


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def peers(vllm, w: QuantizedWeight, names) -> dict:
    """The vLLM GEMMs of `w` that build here (a failure is printed and skipped)."""
    builders = {"marlin": marlin_gemm, "machete": machete_gemm}
    built = {}
    for name in names if vllm is not None else ():
        try:
            built[name] = builders[name](vllm, w)
        except Exception as exc:  # a kernel this GPU or vLLM build lacks
            print(f"  vLLM {name} unavailable: {type(exc).__name__}: {exc}", flush=True)
    return built


def weight_bytes(w: QuantizedWeight) -> int:
    """What ATOM's kernel reads of the weight: packed codes, fp32 scales and zero points."""
    k, n = w.codes.shape
    return k * n // 2 + 2 * 4 * w.zeros.numel()


def sweep_layer(name: str, w: QuantizedWeight, weight, gemm, m: int, sms: int, timer) -> dict:
    """benchmarks/w4a16_sweep.py's search over `gemm`'s small-M launches at M = m."""
    k, n = w.codes.shape
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(w.codes.device)
    x = x.bfloat16() if x.is_cuda else x  # the interpreter's bf16 dot is wrong
    want = x.double() @ weight
    default = pick_w4a16_config(m, n, k, sms)
    configs = dict.fromkeys([*sweep_configs(n, k, sms), default])
    runs = {config: partial(gemm, x, config=config) for config in configs}
    error_of = partial(relative_error, want=want)
    result = search(runs, default, error_of, TOLERANCE, weight_bytes(w), timer)
    return {"layer": name, "format": w.fmt, "K": k, "N": n, "M": m} | result


def measure(name: str, w: QuantizedWeight, weight, atom, vllm_gemms: dict, m: int) -> dict:
    k, n = w.codes.shape
    x = torch.randn(m, k, generator=torch.Generator("cuda").manual_seed(m), device="cuda")
    x = x.bfloat16()
    want = x.double() @ weight
    row = {"layer": name, "format": w.fmt, "group_size": w.group_size, "K": k, "N": n, "M": m}
    row["atom_error"] = relative_error(atom(x), want)
    if row["atom_error"] > TOLERANCE:
        raise SystemExit(
            f"{name} {w.fmt} M={m}: ATOM's output is off by {row['atom_error']:.3g} of its "
            f"largest element (bf16 tolerance {TOLERANCE})"
        )
    # Timed as CUDA-graph replays, as a decode step runs them: launched one by one, a
    # small-M GEMM times the host's launch overhead as much as the kernel
    # (docs/performance.md, "W4A16 small-M launch").
    runs = {"atom": graphed(partial(atom, x))}
    for peer, gemm in vllm_gemms.items():
        try:
            row[f"{peer}_error"] = relative_error(gemm(x), want)
        except Exception as exc:  # e.g. a shape this kernel build does not take
            print(f"  {peer} failed: {type(exc).__name__}: {exc}", flush=True)
            continue
        if row[f"{peer}_error"] > TOLERANCE:
            print(f"  {peer}'s output is off by {row[f'{peer}_error']:.3g}", flush=True)
        runs[peer] = graphed(partial(gemm, x))
    times = dict(zip(runs, interleaved(list(runs.values()))))
    for run, t in times.items():
        row[f"{run}_us"] = 1e3 * statistics.median(t)
        if run != "atom":  # above 1.0: ATOM faster
            row[f"{run}_ratio"] = median_ratio(t, times["atom"])
    seconds = row["atom_us"] * 1e-6
    row["weight_bytes"] = weight_bytes(w)
    row["GB/s"] = row["weight_bytes"] / seconds / 1e9
    row["peak_bw_fraction"] = row["GB/s"] / H100_PEAK_GBPS
    row["TFLOP/s"] = 2 * m * k * n / seconds / 1e12
    row["peak_flop_fraction"] = row["TFLOP/s"] / H100_PEAK_TFLOPS["bf16"]
    return row


def print_row(row: dict) -> None:
    line = (
        f"{row['layer']:>8} {row['format']:>5} {row['K']:>6} {row['N']:>6} {row['M']:>4} "
        f"{row['atom_us']:>8.1f} {row['GB/s']:>7.0f} {100 * row['peak_bw_fraction']:>4.0f}% "
        f"{row['TFLOP/s']:>7.1f}"
    )
    for peer in PEERS:
        if f"{peer}_us" in row:
            line += f" {row[f'{peer}_us']:>10.1f} {row[f'{peer}_ratio']:>9.2f}"
        else:
            line += f" {'-':>10} {'-':>9}"
    print(line)
    print("RESULT", json.dumps(row), flush=True)


def check_cpu(group_size: int, sweep: bool) -> None:
    """ATOM's loader and torch reference (and Triton, interpreted) on small CPU layers."""
    for fmt in FORMATS:
        w = random_weight(fmt, 256, 192, group_size, "cpu")
        layer, weight = atom_layer(w), w.dequantized()
        x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
        checks = {"torch reference, bf16": (layer(x.bfloat16()), x.bfloat16())}
        if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter's bf16 dot is wrong
            checks["triton (interpreted), fp32"] = (atom_gemm(layer)(x), x)
        for what, (got, inputs) in checks.items():
            error = relative_error(got, inputs.double() @ weight)
            print(f"{fmt} g{group_size} K=256 N=192 M=5 {what}: relative error {error:.2e}")
            if error > TOLERANCE:
                raise SystemExit(f"{fmt}: ATOM's {what} is off by {error:.3g}")
    if sweep and os.environ.get("TRITON_INTERPRET") == "1":
        # As if on 8 SMs, so that this small layer splits K too.
        w = random_weight("awq", 1024, 96, group_size, "cpu")
        gemm, weight = atom_gemm(atom_layer(w)), w.dequantized()
        for m in SWEEP_TOKENS:
            result = sweep_layer("cpu", w, weight, gemm, m, 8, cpu_call_us)
            print_sweep(result)
            if result["rejected"] or len(result["sweep"]) < 10:
                raise SystemExit(f"sweep: {len(result['sweep'])} configs match, rejected "
                                 f"{result['rejected']}")  # fmt: skip


def cpu_call_us(runs: list, rounds: int) -> list[float]:
    """sweep_layer's timer on CPU: one interpreted call per run."""
    return [1e3 * wall_ms(run) for run in runs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=TOKENS)
    parser.add_argument("--layers", nargs="+", choices=LAYERS, default=list(LAYERS))
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=["gptq"])
    parser.add_argument("--peers", nargs="*", choices=PEERS, default=list(PEERS))
    parser.add_argument("--group-size", type=int, choices=(32, 64, 128, -1), default=128)
    parser.add_argument("--sweep", action="store_true", help="time small-M configs per layer")
    parser.add_argument("--json", help="write all rows to this file")
    parser.add_argument("--check-cpu", action="store_true", help="check the setup on CPU")
    args = parser.parse_args()
    if args.check_cpu:
        return check_cpu(args.group_size, args.sweep)
    if not torch.cuda.is_available():
        sys.exit("benchmarks/w4a16.py needs a CUDA GPU (--check-cpu checks the setup on CPU)")
    vllm = import_vllm() if args.peers and not args.sweep else None
    print(f"{torch.cuda.get_device_name()}: Qwen3-8B layers, group size {args.group_size}")
    if not args.sweep:
        header = f"{'layer':>8} {'fmt':>5} {'K':>6} {'N':>6} {'M':>4} {'ATOM us':>8} {'GB/s':>7} "
        print(header + f"{'%bw':>5} {'TFLOP/s':>7}" + "".join(
            f" {peer + ' us':>10} {peer[:4] + '/ATOM':>9}" for peer in PEERS
        ))  # fmt: skip
    rows = []
    for fmt in args.formats:
        for name in args.layers:
            w = random_weight(fmt, *LAYERS[name], args.group_size, "cuda")
            atom, weight = atom_gemm(atom_layer(w)), w.dequantized()
            if args.sweep:
                sms = num_sms(torch.device("cuda"))
                for m in SWEEP_TOKENS:
                    rows.append(sweep_layer(name, w, weight, atom, m, sms, graph_replay_us))
                    print_sweep(rows[-1])
            else:
                vllm_gemms = peers(vllm, w, args.peers)
                for m in args.tokens:
                    rows.append(measure(name, w, weight, atom, vllm_gemms, m))
                    print_row(rows[-1])
            if args.json:  # after every layer: a run cut off by a time limit keeps the rest
                with open(args.json, "w") as f:
                    json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
