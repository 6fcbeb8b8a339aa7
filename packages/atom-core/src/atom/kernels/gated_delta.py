"""The gated delta rule (Gated DeltaNet, Qwen3-Next / Qwen3.5 linear attention) over a
varlen batch whose recurrent states live in a per-request pool.

Per sequence, with S its [Hv, Dk, Dv] state and, per token, q, k [Hk, Dk], v [Hv, Dv],
decay g and write strength beta [Hv] (value head h reads key head h // (Hv // Hk)):

    S = S * exp(g);  kv = k^T S;  delta = (v - kv) * beta;  S += outer(k, delta);  o = (scale q)^T S

The pool `state [S, Hv, Dk, Dv]` (fp32, or bf16 / fp16 where the host keeps it so; the
math is fp32 either way) is indexed by `state_slots` and updated in place; a sequence
without an initial state starts from zeros. The Triton kernel
(atom/kernels/triton/gated_delta.py) registers under the same op name and signature; the
kernel policy picks it on GPUs, this reference elsewhere.
"""

from __future__ import annotations

import torch

from atom.kernels.policy import dispatch, register

GATED_DELTA_RULE_OP = "gated_delta_rule"
# What a recurrent state pool may be stored in (the math is fp32 in every case).
STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
L2NORM_EPS = 1e-6  # as FLA and HF transformers


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def padded_rows(query_start_loc: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(token index [B, L] into the varlen rows, valid [B, L]) for a batch padded to its
    longest sequence L; padding entries point at row 0."""
    starts = torch.tensor(query_start_loc[:-1])
    lengths = torch.tensor(query_start_loc[1:]) - starts
    width = int(lengths.max()) if len(lengths) else 0
    offsets = torch.arange(width)
    valid = offsets[None, :] < lengths[:, None]
    index = torch.where(valid, starts[:, None] + offsets[None, :], 0)
    return index, valid


@register(GATED_DELTA_RULE_OP, "torch")
def gated_delta_rule_torch(
    q, k, v, g, beta, state, state_slots, query_start_loc, has_initial_state, scale,
    use_qk_l2norm=True, max_query_len=None,
):  # fmt: skip
    # One step per token position, all sequences of the batch at once (padded to the
    # longest), so a decode batch is a single step. The lengths are read on the host
    # whatever max_query_len says (this reference is never captured).
    starts = query_start_loc.tolist()
    index, valid = padded_rows(starts)
    index, valid = index.to(q.device), valid.to(q.device)
    group = v.shape[1] // k.shape[1]
    q32, k32 = q.float(), k.float()
    if use_qk_l2norm:
        q32, k32 = l2_normalize(q32), l2_normalize(k32)
    q32 = (q32 * scale).repeat_interleave(group, dim=1)
    k32 = k32.repeat_interleave(group, dim=1)
    slots = state_slots.long()
    keep = has_initial_state.to(state.device)[:, None, None, None]
    s = torch.where(keep, state[slots].float(), torch.zeros((), device=state.device))
    out = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for t in range(index.shape[1]):
        rows, live = index[:, t], valid[:, t, None, None, None]
        k_t, v_t = k32[rows], v[rows].float()  # [B, Hv, Dk], [B, Hv, Dv]
        decayed = s * g[rows].float().exp()[..., None, None]
        kv = torch.einsum("bhk,bhkv->bhv", k_t, decayed)
        delta = (v_t - kv) * beta[rows].float()[..., None]
        updated = decayed + k_t[..., :, None] * delta[..., None, :]
        s = torch.where(live, updated, s)
        o_t = torch.einsum("bhk,bhkv->bhv", q32[rows], s)
        out[rows[valid[:, t]]] = o_t[valid[:, t]]
    state[slots] = s.to(state.dtype)
    return out.to(v.dtype)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    has_initial_state: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool = True,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """o [T, Hv, Dv] in v's dtype.

    q, k [T, Hk, Dk]; v [T, Hv, Dv]; g [T, Hv] fp32 log decay; beta [T, Hv]; state
    [S, Hv, Dk, Dv] pool (fp32, bf16 or fp16; updated in place); state_slots [B] int32
    (each sequence's pool row); query_start_loc [B+1] int32; has_initial_state [B] bool
    (False: start from zeros). use_qk_l2norm normalises q and k per head first (fp32). Tokens past
    query_start_loc[B] (a host's padding) are left zero. max_query_len: the host's bound on
    any sequence's tokens (AttentionMetadata.max_query_len; None: unknown), with which an
    implementation may plan its work without reading the lengths on the host.
    """
    return dispatch(GATED_DELTA_RULE_OP, q.device)(
        q, k, v, g, beta, state, state_slots, query_start_loc, has_initial_state, scale,
        use_qk_l2norm, max_query_len=max_query_len,
    )  # fmt: skip
