"""The launch search of benchmarks/gated_delta.py --sweep: the chunked gated delta rule
(prefill) under candidate ChunkLaunch configs and the recurrent one (decode cases) under
DecodeLaunch configs, at Qwen3-Next's shapes.

The candidates are the launch the rule picks for the case by default (the narrow or the
wide state tile, atom.kernels.triton.gated_delta.chunk_launch; DECODE_LAUNCH) and, one field
at a time, each other value of VARIATIONS (Dv tiles, row blocks, warps and stages of the
kernels, the scratch dtypes, the prepare variant, input-dtype products), and the staged
prepare with each value of STAGED_VARIATIONS;
then the default with every field that beat it on its own, combined. Each candidate's outputs and
final states are checked once against ATOM's torch reference (against the default's for
sequences longer than REFERENCE_MAX_LEN, which the reference would take long to step
through); those off by more than SUSPECT_REL_ERROR are shown and never win. Then all take
turns over a few timing rounds, so that the clock's drift hits them alike. Last, the GPU
time of each kernel of the winner and of the default (torch profiler).
"""

from __future__ import annotations

import statistics
from contextlib import contextmanager
from dataclasses import asdict, fields, replace

import torch

import atom.kernels.triton.gated_delta as triton_gated_delta
from atom.kernels.causal_conv1d import causal_conv1d_torch
from atom.kernels.gated_delta import gated_delta_rule_torch
from atom.kernels.triton.gated_delta import ChunkLaunch, DecodeLaunch
from benchmarks.gated_delta import (
    REFERENCE_MAX_LEN,
    SUSPECT_REL_ERROR,
    atom_side,
    error,
    make_batch,
)
from benchmarks.timing import bench, interleaved, wall_ms

# Every value of a field (the default's among them, dropped as a duplicate), so the search
# tries the others whichever launch is the default.
VARIATIONS = {
    "block_v": [8, 16, 32, 64, 128],  # DecodeLaunch
    "num_warps": [1, 2, 4, 8],
    "target_programs": [2048, 4096, 8192, 16384, 32768],
    "state_block_v": [16, 32, 64],  # ChunkLaunch
    "state_warps": [4, 8],
    "state_stages": [1, 2, 3, 4],
    "state_rows": [16, 32, 64],
    "output_block_v": [32, 64, 128],
    "output_warps": [4, 8],
    "prepare_warps": [4, 8],
    "low_precision_wu": [True, False],
    "low_precision_deltas": [True, False],
    "low_precision_dots": [False, True],
    "prepare": ["fused", "staged"],
}
# The staged prepare (ChunkLaunch(prepare="staged")) has its own kernels, so its warps and
# the input-dtype products are also tried on top of it, not only on the default's prepare.
STAGED_VARIATIONS = {
    "prepare_warps": [4, 8],
    "apply_warps": [4, 8],
    "low_precision_dots": [False, True],
}
TIMING_ROUNDS = 3
PROFILED_CALLS = 5


Launch = ChunkLaunch | DecodeLaunch


@contextmanager
def launched_with(launch: Launch):
    """The gated delta rule's chunked (or recurrent) kernel launched with `launch` inside
    the block."""
    hook = "CHUNK_LAUNCH" if isinstance(launch, ChunkLaunch) else "DECODE_LAUNCH"
    default = getattr(triton_gated_delta, hook)
    setattr(triton_gated_delta, hook, launch)
    try:
        yield
    finally:
        setattr(triton_gated_delta, hook, default)


def candidates(default: Launch) -> list[Launch]:
    own = {f.name for f in fields(default)}
    variations = [
        replace(default, **{field: value})
        for field, values in VARIATIONS.items()
        if field in own
        for value in values
    ]
    if isinstance(default, ChunkLaunch):
        staged = replace(default, prepare="staged")
        variations += [
            replace(staged, **{field: value})
            for field, values in STAGED_VARIATIONS.items()
            for value in values
        ]
    return list(dict.fromkeys([default, *variations]))  # a value may be the default's


def combined(results: list[dict], default: Launch) -> Launch | None:
    """The default with every single-field change that was faster than it, or None when
    fewer than two were."""
    default_ms = next(r["ms"] for r in results if r["launch"] == default)
    changes = {}
    for r in sorted((r for r in results if r["ok"]), key=lambda r: r["ms"], reverse=True):
        if r["ms"] < default_ms:  # fastest last, so it wins its field
            changes |= {f: v for f, v in asdict(r["launch"]).items() if v != getattr(default, f)}
    return replace(default, **changes) if len(changes) > 1 else None


def describe(launch: Launch, default: Launch) -> str:
    changed = [f"{f.name}={getattr(launch, f.name)}" for f in fields(launch)
               if getattr(launch, f.name) != getattr(default, f.name)]  # fmt: skip
    return ", ".join(changed) or "default"


def rule_call(batch, mixed, launch: Launch):
    """fn() -> (outputs, the batch's final states), the ATOM rule launched with `launch`
    on its own copy of the state pool, as benchmarks/gated_delta.py times it."""
    rule = atom_side(batch)["rule"]
    conv_state, ssm_state = batch.conv_state.clone(), batch.ssm_state.clone()

    def run():
        with launched_with(launch):
            out, _, states = rule(mixed, conv_state, ssm_state)
        return out, states[batch.slots.long()]

    return run


def check_all(batch, mixed, launches: list[Launch], default: Launch) -> list:
    """Per launch: {"launch", "error" (the worst relative error of outputs and states),
    "ok"}, or the exception that stopped it."""
    if max(batch.lens) <= REFERENCE_MAX_LEN:
        reference = atom_side(batch, causal_conv1d_torch, gated_delta_rule_torch)["rule"]
        out, _, states = reference(mixed, batch.conv_state.clone(), batch.ssm_state.clone())
        want, against = (out, states[batch.slots.long()]), "reference"
    else:
        want, against = rule_call(batch, mixed, default)(), "default launch"
    results = []
    for launch in launches:
        try:
            got = rule_call(batch, mixed, launch)()
        except Exception as exc:  # a config this Triton or this GPU cannot compile or run
            print(f"  skip {describe(launch, default)}: {type(exc).__name__}: {exc}", flush=True)
            continue
        worst = max(error(g, w)["rel"] for g, w in zip(got, want))
        results.append({"launch": launch, "error": worst, "against": against,
                        "ok": worst <= SUSPECT_REL_ERROR})  # fmt: skip
    return results


def time_all(batch, mixed, results: list[dict], device: str) -> None:
    """Each result's median time in ms (all candidates taking turns), into result["ms"]."""
    timer = bench if device == "cuda" else wall_ms
    runs = [rule_call(batch, mixed, r["launch"]) for r in results]
    rounds = TIMING_ROUNDS if device == "cuda" else 1
    times = [[timer(run)] for run in runs] if rounds == 1 else interleaved(runs, rounds)
    for result, per_round in zip(results, times):
        result["ms"] = statistics.median(per_round)


def kernel_breakdown(run) -> None:
    """The GPU time per call of each kernel that `run` launches (after one warm-up call)."""
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_CALLS):
            run()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_time_total > 0]
    for e in sorted(kernels, key=lambda e: e.device_time_total, reverse=True)[:8]:
        print(f"    {e.device_time_total / PROFILED_CALLS:9.1f} us  {e.key[:90]}", flush=True)


def sweep_case(name: str, lens: list[int], shape, device: str, state_dtype) -> list[dict]:
    decode = len(lens) == sum(lens)
    batch = make_batch(shape, lens, decode, device, state_dtype)
    mixed = atom_side(batch)["conv"](batch.x, batch.conv_state.clone(), None)[0]
    # the launch the rule picks for this batch when no sweep sets one
    default = (
        triton_gated_delta.DECODE_LAUNCH
        if decode
        else triton_gated_delta.chunk_launch(
            len(lens), shape.v_heads, shape.head_dim, torch.device(device)
        )
    )
    print(f"{name}: {len(lens)} sequence(s), {sum(lens)} tokens; default {default}", flush=True)
    results = check_all(batch, mixed, candidates(default), default)
    time_all(batch, mixed, results, device)
    best_of_each = combined(results, default)
    if best_of_each is not None:
        extra = check_all(batch, mixed, [best_of_each], default)
        time_all(batch, mixed, extra, device)
        results += extra
    results.sort(key=lambda r: (not r["ok"], r["ms"]))
    default_ms = next(r["ms"] for r in results if r["launch"] == default)
    print(f"  {'rule ms':>9} {'vs default':>10} {'rel error':>9}  launch (changes from default)")
    for r in results:
        flag = "" if r["ok"] else "  SUSPECT"
        print(f"  {r['ms']:9.3f} {default_ms / r['ms']:9.2f}x {r['error']:9.1e}  "
              f"{describe(r['launch'], default)}{flag}")  # fmt: skip
    print(f"  errors against the {results[0]['against']}", flush=True)
    if results[0]["ok"]:
        print(f"  winner: {results[0]['launch']}", flush=True)
    if device == "cuda":
        for launch in {results[0]["launch"], default}:
            print(f"  kernels of {describe(launch, default)}:", flush=True)
            kernel_breakdown(rule_call(batch, mixed, launch))
    return results


def sweep(cases: dict[str, list[int]], shape, device: str, state_dtype) -> list[dict]:
    """Rows for benchmarks/gated_delta.py --json: every case's candidates, best first."""
    rows = []
    for name, lens in cases.items():
        for r in sweep_case(name, lens, shape, device, state_dtype):
            rows.append({"case": name, "ms": r["ms"], "rel_error": r["error"], "ok": r["ok"],
                         "launch": asdict(r["launch"])})  # fmt: skip
    return rows
