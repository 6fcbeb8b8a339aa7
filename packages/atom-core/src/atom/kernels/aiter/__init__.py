"""aiter (AMD) adapters, registered with the kernel policy when imported.

atom.kernels.backends imports this package only on ROCm with `aiter` installed, and the
policy tries aiter before Triton there. Each adapter converts ATOM's op signature to one
aiter call and back; an input it cannot take (dtype, shape, FP8 flavour) goes to the next
backend through `policy.fallback`.

Adapted: rms_norm, fused_add_rms_norm (norm.py), silu_and_mul (activation.py),
topk_softmax (moe_routing.py), quantize_fp8_per_token_group and block-scale
fp8_scaled_mm (fp8.py).

Not adapted, because aiter's semantics differ in ways a thin adapter cannot bridge:
- fused_moe: aiter.fused_moe (aiter/fused_moe.py) runs CK/asm kernels that read expert
  weights pre-shuffled by aiter's shuffle_weight (a load-time re-layout of w13/w2) and, on
  MI300 (gfx942), FP8 as float8_e4m3fnuz; ATOM keeps plain [E, 2I, H] / [E, H, I] e4m3fn
  weights. Shuffling per call would copy every expert weight each step.
- grouped_topk: aiter/ops/topk.py's biased_grouped_topk hands large token counts to
  moe_fused_gate, which asserts need_renorm (ATOM's op allows renormalize=False), and
  how the HIP kernels rank groups (DeepSeek-V3: sum of the best two biased scores; V2: the
  best one) and apply routed_scaling_factor is not stated by the Python API. Until that is
  checked on ROCm, DeepSeek routing stays on Triton.
- paged_attention (decode included): aiter's paged_attention_rocm / pa_fwd_asm
  (aiter/ops/attention.py) read vLLM's split key cache [blocks, Hkv, D/x, block, x] and
  value cache [blocks, Hkv, D, block] (asm: a shuffled layout); ATOM's cache is
  [blocks, block, Hkv, D] and is shared with the KV-write, prefill and MLA kernels.
- fp8_scaled_mm with per-tensor / per-token / per-channel scales: aiter's gemm_a8w8
  (aiter/ops/gemm_op_a8w8.py) states its scale shapes only for the asm path
  (x_scale [M, 1], w_scale [1, N]) and not for the CK kernel it dispatches to, so these
  modes stay on Triton until checked on ROCm.
- FP8 on MI300 (gfx942): aiter.dtypes.fp8 is float8_e4m3fnuz there and ATOM's weights are
  e4m3fn, so the FP8 adapters decline unless aiter's FP8 type is ATOM's (gfx950 and later).
"""

from atom.kernels.aiter import activation, fp8, moe_routing, norm

__all__ = ["activation", "fp8", "moe_routing", "norm"]
