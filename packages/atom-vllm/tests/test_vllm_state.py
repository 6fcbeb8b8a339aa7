"""Fast checks of the hybrid-model pieces (Gated DeltaNet states in vLLM's mamba cache),
without starting a vLLM engine: the config hook, the IsHybrid answers and the state
metadata builder over vLLM's real CommonAttentionMetadata."""

from __future__ import annotations

import logging

import pytest
import torch
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import MambaSpec

import atom_vllm
from atom.layers.gated_delta_net import config_state_shapes
from atom_vllm.backend import AtomStateBackend, AtomStateMetadataBuilder
from atom_vllm.config import UnsupportedVllmFeature
from atom_vllm.model import AtomHybridForCausalLM, wrapper_class

ARCH = "Qwen3NextForCausalLM"


def engine_config(checkpoints, **kwargs):
    atom_vllm.register()
    args = EngineArgs(
        model=str(checkpoints(ARCH)),
        skip_tokenizer_init=True,
        enable_prefix_caching=True,
        max_model_len=256,
        **kwargs,
    )
    return args.create_engine_config()


def test_hybrid_models_run_without_prefix_caching(checkpoints, monkeypatch):
    """Patch 3, inside vLLM's own config construction: prefix caching off, so vLLM's
    hybrid hook keeps one state per request (mamba cache mode "none")."""
    from atom_vllm import patches

    messages = []
    logger = logging.getLogger("test.atom_vllm.patches")  # vLLM's own logging set-up
    monkeypatch.setattr(logger, "info", lambda msg, *args: messages.append(msg % args))
    monkeypatch.setattr(patches, "logger", logger)  # varies with the tests run before
    config = engine_config(checkpoints, model_impl="atom")
    assert config.model_config.is_hybrid
    assert not config.cache_config.enable_prefix_caching
    assert config.cache_config.mamba_cache_mode == "none"
    assert sum("prefix caching off" in m for m in messages) == 1, messages


@pytest.mark.parametrize(
    "vllm_own", [dict(model_impl="vllm"), dict(enable_lora=True)], ids=["model-impl", "lora"]
)
def test_vllm_own_implementation_keeps_prefix_caching(checkpoints, vllm_own):
    config = engine_config(checkpoints, **vllm_own)
    assert config.cache_config.enable_prefix_caching
    assert config.cache_config.mamba_cache_mode == "align"


def test_wrapper_answers_is_hybrid_from_the_config(checkpoints):
    cls = wrapper_class(ARCH)
    assert issubclass(cls, AtomHybridForCausalLM) and cls.is_hybrid and cls.has_inner_state
    assert not getattr(wrapper_class("Qwen3ForCausalLM"), "is_hybrid", False)
    config = engine_config(checkpoints, model_impl="atom", dtype="float32")
    hf = config.model_config.hf_text_config
    want = config_state_shapes(hf, 1, torch.float32)
    assert cls.get_mamba_state_shape_from_config(config) == tuple(s for s, _ in want)
    assert cls.get_mamba_state_dtype_from_config(config) == (torch.float32, torch.float32)
    key_dim = hf.linear_num_key_heads * hf.linear_key_head_dim
    conv_dim = 2 * key_dim + hf.linear_num_value_heads * hf.linear_value_head_dim
    assert want[0][0] == (conv_dim, hf.linear_conv_kernel_dim - 1)
    assert want[1][0] == (
        hf.linear_num_value_heads,
        hf.linear_key_head_dim,
        hf.linear_value_head_dim,
    )
    copy_funcs = cls.get_mamba_state_copy_funcs({MambaAttentionBackendEnum.GDN_ATTN})
    assert len(copy_funcs[MambaAttentionBackendEnum.GDN_ATTN]) == 2

    # The recurrent state follows mamba_ssm_cache_dtype ("auto": the model dtype), as vLLM's
    # own Gated DeltaNet does; the conv state's dtype is ATOM's.
    for option, want_ssm in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        config.cache_config.mamba_ssm_cache_dtype = option
        assert cls.get_mamba_state_dtype_from_config(config) == (torch.float32, want_ssm)
    config.cache_config.mamba_ssm_cache_dtype = "auto"
    config.model_config.dtype = torch.bfloat16
    assert cls.get_mamba_state_dtype_from_config(config) == (torch.bfloat16, torch.bfloat16)
    config.cache_config.mamba_cache_dtype = "float32"
    with pytest.raises(UnsupportedVllmFeature, match="mamba_cache_dtype='float32'"):
        cls.get_mamba_state_dtype_from_config(config)


def test_state_builder_gives_each_request_its_mamba_block(checkpoints):
    config = engine_config(checkpoints, model_impl="atom")
    spec = MambaSpec(
        block_size=256,
        shapes=((8, 3), (2, 4, 4)),
        dtypes=(torch.float32, torch.float32),
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
    )
    builder = AtomStateBackend.get_builder_cls()(spec, ["l"], config, torch.device("cpu"))
    assert isinstance(builder, AtomStateMetadataBuilder)
    query_lens, context_lens, blocks = [1, 1, 5, 9], [7, 20, 0, 4], [17, 3, 42, 9]
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    qsl = torch.tensor([0, 1, 2, 7, 16], dtype=torch.int32)
    cm = CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        num_reqs=4,
        num_actual_tokens=16,
        max_query_len=9,
        max_seq_len=max(seq_lens),
        block_table_tensor=torch.tensor(blocks, dtype=torch.int32)[:, None],
        slot_mapping=torch.zeros(16, dtype=torch.int64),
    )
    md = builder.build(0, cm)
    assert md.state_slots.dtype == torch.int32 and md.state_slots.tolist() == blocks
    # A later chunk of a chunked prefill (context 4) continues its state; a first chunk
    # (context 0) starts from zeros.
    assert md.has_initial_state.tolist() == [True, True, False, True]
    assert (md.num_decodes, md.host_query_start_loc()) == (2, qsl.tolist())

    with pytest.raises(NotImplementedError, match="without speculative decoding"):
        AtomStateMetadataBuilder(
            MambaSpec(**{**spec.__dict__, "num_speculative_blocks": 2}),
            ["l"],
            config,
            torch.device("cpu"),
        )
    config.cache_config.mamba_cache_mode = "align"
    with pytest.raises(NotImplementedError, match="mamba_cache_mode='none'"):
        AtomStateMetadataBuilder(spec, ["l"], config, torch.device("cpu"))
