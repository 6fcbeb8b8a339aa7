"""The hybrid-model pieces over SGLang's real mamba pool, without an engine: the state
rows in the step's metadata, and the views ATOM's Gated DeltaNet ops get of the pool."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape
from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool, MHATokenToKVPool
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from atom.layers.gated_delta_net import config_state_shapes
from atom_sglang.backend import AtomAttnBackend
from atom_sglang.state_layer import mamba_pool_states, ssm_state_dtype

# A Qwen3-Next-like DeltaNet: 2 key heads, 4 value heads of 16, conv width 4; the linear
# layers are 0 and 2 (layer 1: full attention).
CONFIG = SimpleNamespace(
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
)
LINEAR_LAYERS = [0, 2]


def mamba_pool(conv_dtype=torch.float32, ssm_dtype=torch.float32) -> HybridReqToTokenPool:
    key_dim, value_dim = 2 * 16, 4 * 16
    shape = Mamba2StateShape.create(
        tp_world_size=1, intermediate_size=value_dim, n_groups=2, num_heads=4, head_dim=16,
        state_size=16, conv_kernel=4, conv_shard_groups=[key_dim, key_dim, value_dim],
    )  # fmt: skip
    params = Mamba2CacheParams(
        shape=shape,
        layers=LINEAR_LAYERS,
        dtype=Mamba2StateDType(conv=conv_dtype, temporal=ssm_dtype),
    )
    return HybridReqToTokenPool(
        size=4, mamba_size=6, mamba_spec_state_size=6, max_context_len=64, device="cpu",
        enable_memory_saver=False, cache_params=params, mamba_layer_ids=LINEAR_LAYERS,
        enable_mamba_extra_buffer=False, enable_overlap_schedule=False,
    )  # fmt: skip


def test_backend_gives_each_request_its_mamba_row():
    pool = mamba_pool()
    rows, prefix_lens, new_lens = [3, 1, 0], [0, 13, 4], [9, 5, 1]
    mamba_rows = pool.mamba_allocator.alloc(3)
    pool.req_index_to_mamba_index_mapping[torch.tensor(rows)] = mamba_rows.to(torch.int32)
    slot = 1
    out_loc = []
    for row, p, n in zip(rows, prefix_lens, new_lens):
        pool.req_to_token[row, : p + n] = torch.arange(slot, slot + p + n)
        out_loc += list(range(slot + p, slot + p + n))
        slot += p + n
    kv = MHATokenToKVPool(
        size=128, page_size=1, dtype=torch.float32, head_num=2, head_dim=8, layer_num=3,
        device="cpu", enable_memory_saver=False,
    )  # fmt: skip
    runner = SimpleNamespace(device="cpu", req_to_token_pool=pool, token_to_kv_pool=kv, page_size=1)
    backend = AtomAttnBackend(runner)
    seq = [p + n for p, n in zip(prefix_lens, new_lens)]
    batch = SimpleNamespace(
        forward_mode=ForwardMode.EXTEND,
        batch_size=3,
        req_pool_indices=torch.tensor(rows),
        seq_lens=torch.tensor(seq),
        seq_lens_cpu=torch.tensor(seq),
        out_cache_loc=torch.tensor(out_loc),
        extend_seq_lens=torch.tensor(new_lens, dtype=torch.int32),
        extend_seq_lens_cpu=new_lens,
    )
    backend.init_forward_metadata(batch)
    md = backend.step_metadata
    assert md.state_slots.tolist() == mamba_rows.tolist()
    # The first chunk starts from zeros; a later chunk and a cached prefix continue.
    assert md.has_initial_state.tolist() == [False, True, True]


def test_layer_views_alias_sglang_rows_in_atom_layout():
    pool = mamba_pool()
    shapes = config_state_shapes(CONFIG, 1, torch.float32)
    conv, recurrent = mamba_pool_states(pool, 2, shapes)  # global layer 2: pool layer 1
    assert conv.shape[1:] == shapes[0][0] and recurrent.shape[1:] == shapes[1][0]
    sglang = pool.mamba2_layer_cache(2)
    conv[5] = 1.0
    recurrent[4, 1] = 2.0
    assert bool((sglang.conv[0][5] == 1.0).all()) and sglang.conv[0][:5].abs().sum() == 0
    # SGLang's [Hv, Dv, Dk] row holds ATOM's [Hv, Dk, Dv] bytes: row 4, head 1, nothing else.
    assert bool((sglang.temporal[4, 1] == 2.0).all()) and sglang.temporal.sum() == 2.0 * 256
    assert pool.mamba2_layer_cache(0).conv[0].abs().sum() == 0


def test_a_bf16_conv_pool_names_the_switch():
    pool = mamba_pool(conv_dtype=torch.bfloat16)
    shapes = config_state_shapes(CONFIG, 1, torch.float32)
    with pytest.raises(NotImplementedError, match="SGLANG_MAMBA_CONV_DTYPE"):
        mamba_pool_states(pool, 0, shapes)


def test_recurrent_state_follows_sglangs_ssm_dtype(monkeypatch):
    """ATOM's layers keep the recurrent state in the dtype SGLang allocates it in: float32
    by default, the config's `mamba_ssm_dtype`, or SGLANG_MAMBA_SSM_DTYPE above both."""
    monkeypatch.delenv("SGLANG_MAMBA_SSM_DTYPE", raising=False)
    assert ssm_state_dtype(CONFIG) == torch.float32
    assert ssm_state_dtype(SimpleNamespace(mamba_ssm_dtype="float16")) == torch.float16
    monkeypatch.setenv("SGLANG_MAMBA_SSM_DTYPE", "bfloat16")
    dtype = ssm_state_dtype(CONFIG)
    assert dtype == torch.bfloat16
    shapes = config_state_shapes(CONFIG, 1, torch.float32, dtype)
    _, recurrent = mamba_pool_states(mamba_pool(ssm_dtype=dtype), 0, shapes)
    assert recurrent.dtype == torch.bfloat16
