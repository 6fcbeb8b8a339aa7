"""Fast checks of the plugin's pieces, without starting a vLLM engine."""

from __future__ import annotations

import logging
import pkgutil
import random

import pytest
import torch
from vllm import ModelRegistry
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.models.config import MODELS_CONFIG_MAP
from vllm.model_executor.models.interfaces_base import is_text_generation_model
from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata
from vllm.v1.attention.backends.registry import AttentionBackendEnum

import atom_vllm
from atom.forward_context import AttentionMetadata
from atom.kernels.paged_attention import attention_mask, dense_attention
from atom.layers.attention_spec import AttentionSpec
from atom.registry import supported_architectures
from atom_vllm import model as model_module
from atom_vllm.backend import (
    AtomAttentionBackend,
    AtomAttentionImpl,
    AtomAttentionMetadataBuilder,
    to_atom_metadata,
)


@pytest.fixture
def fresh_plugin(monkeypatch):
    """register() as in a new process; vLLM's registry and backend overrides restored after."""
    models = dict(ModelRegistry.models)
    config_hooks = dict(MODELS_CONFIG_MAP)
    custom = AttentionBackendEnum.CUSTOM
    override = custom.get_path() if custom.is_overridden() else None
    monkeypatch.setattr(atom_vllm, "_registered", None)
    monkeypatch.delenv("ATOM_DISABLE_VLLM_PLUGIN", raising=False)
    yield
    ModelRegistry.models.clear()
    ModelRegistry.models.update(models)
    MODELS_CONFIG_MAP.clear()
    MODELS_CONFIG_MAP.update(config_hooks)
    if override is None:
        custom.clear_override()
    else:
        from vllm.v1.attention.backends.registry import register_backend

        register_backend(custom, override)


def test_register_serves_every_vllm_capable_architecture(fresh_plugin, caplog, capsys):
    with caplog.at_level(logging.INFO, logger="vllm.atom_vllm"):
        atom_vllm.register()
    served = atom_vllm.served_architectures()
    assert set(served) <= set(supported_architectures("vllm"))
    assert {"LlamaForCausalLM", "Qwen3ForCausalLM"} <= set(served)
    for arch in served:
        lazy = ModelRegistry.models[arch]
        assert (lazy.module_name, lazy.class_name) == ("atom_vllm.model", arch)
    assert AttentionBackendEnum.CUSTOM.get_path() == "atom_vllm.backend.AtomAttentionBackend"
    assert AttentionBackendEnum.CUSTOM.get_class() is AtomAttentionBackend
    assert AttentionBackendEnum[AtomAttentionBackend.get_name()] is AttentionBackendEnum.CUSTOM
    # Through vLLM's logger once vLLM has configured logging, to stderr before.
    said = capsys.readouterr().err + "".join(r.getMessage() for r in caplog.records)
    assert "serves LlamaForCausalLM" in said


@pytest.mark.parametrize(
    ("model_impl", "max_num_seqs", "user_max", "expected"),
    [("auto", 1024, None, 1024), ("atom", 128, None, None), ("vllm", 1024, None, None),
     ("atom", 1024, 64, 64)],
)  # fmt: skip
def test_decode_graphs_cover_max_num_seqs_for_atom_models(
    fresh_plugin, checkpoints, model_impl, max_num_seqs, user_max, expected
):
    """Patch 1 runs inside vLLM's own config construction (on CPU vLLM captures no graphs,
    so the value stays as the hook left it)."""
    atom_vllm.register()
    compilation = {} if user_max is None else {"max_cudagraph_capture_size": user_max}
    engine_args = EngineArgs(
        model=str(checkpoints("Qwen3ForCausalLM")),
        skip_tokenizer_init=True,
        model_impl=model_impl,
        max_num_seqs=max_num_seqs,
        compilation_config=compilation,
    )
    vllm_config = engine_args.create_engine_config()
    assert vllm_config.compilation_config.max_cudagraph_capture_size == expected


def test_uncapturable_model_turns_cuda_graphs_off_in_its_engine_config(caplog):
    """A model with ATOM ops that cannot be captured sets its engine's cudagraph_mode to
    NONE (vLLM's runner reads it after building the model); nothing else changes."""
    from vllm.config import CUDAGraphMode, VllmConfig

    from atom_vllm.patches import cuda_graphs_off

    config = VllmConfig()
    # As vLLM resolves it on a GPU (its CPU platform resolves NONE).
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
    cuda_graphs_off(config, "Qwen3MoeForCausalLM", ["fused_moe (torch)"])
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
    assert "not capturable: fused_moe (torch)" in caplog.text


@pytest.mark.parametrize(
    "name",
    [
        # Patch 1: the per-architecture config hook table and when vLLM reads it.
        "vllm.model_executor.models.config:MODELS_CONFIG_MAP",
        "vllm.model_executor.models.config:VerifyAndUpdateConfig.verify_and_update_config",
        "vllm.config:VllmConfig.try_verify_and_update_config",
        "vllm.config:VllmConfig._set_cudagraph_sizes",
        # Patch 2: where the runner reads the CUDA-graph mode after building the model.
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner.load_model",
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner._check_and_update_cudagraph_mode",
        "vllm.config:CompilationConfig.resolve_cudagraph_mode_and_sizes",
        # The backend slot register() overrides.
        "vllm.v1.attention.backends.registry:AttentionBackendEnum.CUSTOM",
        # Patch 3: the hybrid hook that picks the mamba cache mode from prefix caching.
        "vllm.model_executor.models.config:HybridAttentionMambaModelConfig",
        "vllm.model_executor.models.config:MambaModelConfig.verify_and_update_config",
        # Patch 4: the layer's window, which decides its KV-cache spec.
        "vllm.model_executor.layers.attention:Attention.get_kv_cache_spec",
        # Read 6: vLLM's own model classes.
        "vllm.model_executor.models.registry:_VLLM_MODELS",
    ],
)
def test_vllm_names_the_patches_rely_on_exist(name):
    assert pkgutil.resolve_name(name) is not None


def test_config_hooks_keep_vllm_own_hook(fresh_plugin, monkeypatch):
    from atom_vllm.patches import install_config_hooks

    seen = []

    class VllmHook:
        @staticmethod
        def verify_and_update_config(vllm_config):
            seen.append(vllm_config)

    monkeypatch.setitem(MODELS_CONFIG_MAP, "LlamaForCausalLM", VllmHook)
    install_config_hooks(["LlamaForCausalLM"])
    install_config_hooks(["LlamaForCausalLM"])  # idempotent: wrapped once
    hook = MODELS_CONFIG_MAP["LlamaForCausalLM"]
    assert hook.atom_wrapped is VllmHook
    hook.verify_and_update_config(config := type("Cfg", (), {"model_config": None})())
    assert seen == [config]


def test_register_is_idempotent(fresh_plugin, monkeypatch):
    atom_vllm.register()
    calls = []
    monkeypatch.setattr(ModelRegistry, "register_model", lambda *a: calls.append(a))
    atom_vllm.register()
    assert calls == []


def test_disable_env_leaves_vllm_untouched(fresh_plugin, monkeypatch, capsys):
    before = dict(ModelRegistry.models)
    AttentionBackendEnum.CUSTOM.clear_override()
    monkeypatch.setenv("ATOM_DISABLE_VLLM_PLUGIN", "1")
    atom_vllm.register()
    assert dict(ModelRegistry.models) == before
    assert not AttentionBackendEnum.CUSTOM.is_overridden()


def test_register_never_raises(fresh_plugin, monkeypatch):
    def broken(*args):
        raise RuntimeError("registry exploded")

    monkeypatch.setattr(atom_vllm, "served_architectures", broken)
    before = dict(ModelRegistry.models)
    atom_vllm.register()  # logs, does not raise
    assert dict(ModelRegistry.models) == before


def test_installed_vllm_is_in_the_supported_range():
    import vllm

    assert atom_vllm.SUPPORTED.admits(vllm.__version__)


def test_untested_vllm_gets_one_line_and_no_registration(fresh_plugin, monkeypatch, capsys, caplog):
    before = dict(ModelRegistry.models)
    AttentionBackendEnum.CUSTOM.clear_override()
    monkeypatch.setattr(atom_vllm, "vllm_version", lambda: "0.40.1")
    with caplog.at_level(logging.INFO, logger="vllm.atom_vllm"):
        atom_vllm.register()
    assert dict(ModelRegistry.models) == before
    assert not AttentionBackendEnum.CUSTOM.is_overridden()
    said = capsys.readouterr().err.strip().splitlines()
    said += [r.getMessage() for r in caplog.records if r.name == "vllm.atom_vllm"]
    (line,) = said
    assert "vLLM 0.40.1 is outside the range" in line and ">=0.32,<0.33" in line
    assert "ATOM inactive, the host runs its own models" in line


def test_untested_vllm_with_atom_requested_is_an_error(fresh_plugin, monkeypatch):
    from atom.hosts.plugin import UnsupportedHostVersion

    monkeypatch.setattr(atom_vllm, "vllm_version", lambda: "0.31.2")
    monkeypatch.setenv("ATOM_DISABLE_VLLM_PLUGIN", "0")
    before = dict(ModelRegistry.models)
    with pytest.raises(UnsupportedHostVersion, match=r"vLLM 0\.31\.2 .*>=0\.32,<0\.33"):
        atom_vllm.register()
    assert dict(ModelRegistry.models) == before


def test_register_falls_back_to_stderr_before_vllm_logging(fresh_plugin, monkeypatch, capsys):
    monkeypatch.setattr(logging.getLogger("vllm"), "handlers", [])
    atom_vllm.register()
    assert "serves LlamaForCausalLM" in capsys.readouterr().err


def test_wrapper_classes_implement_vllm_text_generation_interface():
    for arch in atom_vllm.served_architectures():
        cls = getattr(model_module, arch)
        assert cls is getattr(model_module, arch)  # made once
        assert cls.__name__ == arch and cls.__module__ == "atom_vllm.model"
        assert issubclass(cls, model_module.AtomForCausalLM)
        assert is_text_generation_model(cls)
    with pytest.raises(AttributeError):
        model_module.NotAModelForCausalLM  # noqa: B018


def test_vllm_model_class_is_vllm_own_implementation():
    cls = model_module.vllm_model_class("LlamaForCausalLM")
    assert cls.__module__ == "vllm.model_executor.models.llama"


def test_backend_declares_capabilities():
    b = AtomAttentionBackend
    assert b.get_name() == "CUSTOM"
    assert b.supports_block_size(16) and b.supports_block_size(1)
    assert b.supports_sliding_window() and b.supports_sink() and not b.is_mla()
    assert b.supports_dtype(torch.float32) and b.supports_dtype(torch.bfloat16)
    assert b.supports_kv_cache_dtype("fp8") and b.supports_kv_cache_dtype("fp8_e4m3")
    assert not b.supports_kv_cache_dtype("fp8_e5m2")
    assert AtomAttentionMetadataBuilder.reorder_batch_threshold == 1
    assert (
        AtomAttentionMetadataBuilder._cudagraph_support
        == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    )


def _step(query_lens, context_lens, block_size, num_blocks, seed=0):
    """A vLLM CommonAttentionMetadata for a mixed step, pages handed out shuffled."""
    rng = random.Random(seed)
    pages = list(range(num_blocks))
    rng.shuffle(pages)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    width = max(-(-s // block_size) for s in seq_lens)
    table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    slots = []
    for i, (c, s) in enumerate(zip(context_lens, seq_lens)):
        row = [pages.pop() for _ in range(-(-s // block_size))]
        table[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
        slots += [row[p // block_size] * block_size + p % block_size for p in range(c, s)]
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        num_reqs=len(seq_lens),
        num_actual_tokens=sum(query_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_table_tensor=table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
    )


def test_metadata_builder_maps_common_metadata_onto_atom_schema():
    cm = _step([1, 1, 5, 9], [7, 20, 0, 4], block_size=4, num_blocks=64)
    md = to_atom_metadata(cm)
    assert isinstance(md, AttentionMetadata)
    assert (md.num_decodes, md.num_decode_tokens, md.num_prefills) == (2, 2, 2)
    assert md.host_query_start_loc() == [0, 1, 2, 7, 16]
    assert md.host_seq_lens() == [8, 21, 5, 13]
    assert md.slot_mapping.dtype == torch.int64 and md.num_tokens == 16
    assert (md.max_query_len, md.max_seq_len) == (9, 21)
    assert md.block_table is cm.block_table_tensor or torch.equal(
        md.block_table, cm.block_table_tensor
    )


def atom_impl(hq, d, hkv, kv_cache_dtype, **spec_fields):
    """The impl as vLLM's `Attention` builds it, holding ATOM's spec as VllmAttention
    hands it over."""
    impl = AtomAttentionImpl(hq, d, d**-0.5, hkv, None, None, kv_cache_dtype)
    impl.spec = AttentionSpec("layer", hq, hkv, d, d, d**-0.5, **spec_fields)
    return impl


@pytest.mark.parametrize("sliding_window", [None, 6])
def test_impl_writes_cache_then_matches_dense_attention(sliding_window):
    torch.manual_seed(0)
    hq, hkv, d, bs, nb = 4, 2, 32, 4, 64
    context, query = [7, 20, 0, 4], [1, 1, 5, 9]
    cm = _step(query, context, bs, nb)
    md = to_atom_metadata(cm)
    # vLLM's logical per-layer view [num_blocks, Hkv, block_size, D + Dv], stored
    # tokens-major (its default LBNHC layout) as vLLM allocates it.
    kv_cache = torch.zeros(nb, bs, hkv, 2 * d).transpose(1, 2)
    # The cached context of each sequence, written as earlier steps would have.
    history = []
    for i, c in enumerate(context):
        k, v = torch.randn(c + query[i], hkv, d), torch.randn(c + query[i], hkv, d)
        history.append((k, v))
        for p in range(c):
            page = int(cm.block_table_tensor[i, p // bs])
            kv_cache[page, :, p % bs] = torch.cat([k[p], v[p]], dim=-1)
    q = torch.randn(sum(query), hq, d)
    k_new = torch.cat([k[c:] for (k, _), c in zip(history, context)])
    v_new = torch.cat([v[c:] for (_, v), c in zip(history, context)])
    impl = atom_impl(hq, d, hkv, "auto", sliding_window=sliding_window)
    out = torch.empty(sum(query), hq, d)
    impl.forward(None, q, k_new, v_new, kv_cache, md, out)
    start = 0
    for (k, v), c, n in zip(history, context, query):
        positions = torch.arange(c, c + n)
        mask = attention_mask(positions, c + n, sliding_window)
        want = dense_attention(q[start : start + n], k, v, mask, d**-0.5, None)
        torch.testing.assert_close(out[start : start + n], want, rtol=1e-5, atol=1e-5)
        start += n
    assert impl.num_calls == 1
    # The new tokens' K/V went to their slots, K first and V after it in each row.
    for slot, k_row, v_row in zip(cm.slot_mapping.tolist(), k_new, v_new):
        row = kv_cache[slot // bs, :, slot % bs]
        assert torch.equal(row, torch.cat([k_row, v_row], dim=-1))


def test_impl_rotates_with_the_positions_of_its_metadata():
    """A layer built with `qk_rope` gets raw q/k; the impl rotates them with the step
    metadata's positions (vLLM's CommonAttentionMetadata.positions) as it writes the cache:
    the same output as rotating first and attending without it."""
    from atom.layers.attention_spec import QKRope
    from atom.layers.rotary import RotaryEmbedding

    torch.manual_seed(1)
    hq, hkv, d, bs, nb = 4, 2, 32, 4, 64
    context, query = [0, 0], [5, 3]
    cm = _step(query, context, bs, nb)
    cm.positions = torch.cat([torch.arange(n) for n in query])
    rope = QKRope(RotaryEmbedding(d, d, 64, 10000.0))
    q, k, v = torch.randn(8, hq, d), torch.randn(8, hkv, d), torch.randn(8, hkv, d)

    def run(impl, q, k):
        kv_cache = torch.zeros(nb, bs, hkv, 2 * d).transpose(1, 2)
        out = torch.empty(8, hq, d)
        impl.forward(None, q.clone(), k.clone(), v, kv_cache, to_atom_metadata(cm), out)
        return out

    fused = atom_impl(hq, d, hkv, "auto", qk_rope=rope)
    plain = atom_impl(hq, d, hkv, "auto")
    q_rot, k_rot = rope(cm.positions, q.clone(), k.clone())
    torch.testing.assert_close(run(fused, q, k), run(plain, q_rot, k_rot))
    cm.positions = None
    with pytest.raises(ValueError, match="positions"):
        run(fused, q, k)


def test_impl_reads_an_fp8_cache_with_its_scales():
    """vLLM allocates an fp8 cache as uint8: the impl writes and reads it as float8_e4m3fn
    holding x / scale, so attention equals dense attention over the dequantized K/V."""
    torch.manual_seed(0)
    hq, hkv, d, bs, nb = 4, 2, 32, 4, 64
    k_scale, v_scale = 0.05, 0.02
    context, query = [7, 20, 0], [1, 1, 6]
    cm = _step(query, context, bs, nb)
    kv_cache = torch.zeros(nb, bs, hkv, 2 * d, dtype=torch.uint8).transpose(1, 2)
    fp8 = kv_cache.view(torch.float8_e4m3fn)

    def fp8_round_trip(x, scale):
        return (x / scale).to(torch.float8_e4m3fn).float() * scale

    history = []
    for i, c in enumerate(context):
        k, v = torch.randn(c + query[i], hkv, d), torch.randn(c + query[i], hkv, d)
        history.append((k, v))
        for p in range(c):
            page = int(cm.block_table_tensor[i, p // bs])
            row = torch.cat([k[p] / k_scale, v[p] / v_scale], dim=-1)
            fp8[page, :, p % bs] = row.to(torch.float8_e4m3fn)
    q = torch.randn(sum(query), hq, d)
    k_new = torch.cat([k[c:] for (k, _), c in zip(history, context)])
    v_new = torch.cat([v[c:] for (_, v), c in zip(history, context)])
    impl = atom_impl(hq, d, hkv, "fp8")
    impl.k_scale, impl.v_scale = k_scale, v_scale
    out = torch.empty(sum(query), hq, d)
    impl.forward(None, q, k_new, v_new, kv_cache, to_atom_metadata(cm), out)
    start = 0
    for (k, v), c, n in zip(history, context, query):
        mask = attention_mask(torch.arange(c, c + n), c + n, None)
        k_read, v_read = fp8_round_trip(k, k_scale), fp8_round_trip(v, v_scale)
        want = dense_attention(q[start : start + n], k_read, v_read, mask, d**-0.5, None)
        torch.testing.assert_close(out[start : start + n], want, rtol=1e-5, atol=1e-5)
        start += n


def test_impl_rejects_what_it_cannot_do():
    with pytest.raises(NotImplementedError, match="fp8_e5m2.*supported: .*fp8_e4m3"):
        AtomAttentionImpl(4, 32, 0.1, 2, None, None, "fp8_e5m2")
    with pytest.raises(NotImplementedError, match="ALiBi"):
        AtomAttentionImpl(4, 32, 0.1, 2, [0.1] * 4, None, "auto")


def test_mla_backend_declares_latent_cache():
    from atom_vllm.backend import AtomMLABackend, AtomMLAMetadataBuilder

    assert AtomMLABackend.is_mla() and AtomMLABackend.get_name() == "CUSTOM"
    assert AtomMLABackend.supports_kv_cache_dtype("fp8")
    assert AtomMLABackend.get_builder_cls() is AtomMLAMetadataBuilder
    assert AtomMLAMetadataBuilder.reorder_batch_threshold == 1
    assert not AtomMLABackend.supports_pcp()  # get_impl_cls: ATOM's impl, not vLLM's


def test_served_architectures_include_mla_models_when_installed():
    import importlib.util

    served = atom_vllm.served_architectures()
    for arch, module in [
        ("DeepseekV2ForCausalLM", "atom.models.deepseek_v2"),
        ("Qwen3MoeForCausalLM", "atom.models.qwen3_moe"),
        ("MixtralForCausalLM", "atom.models.mixtral"),
        ("Glm4MoeForCausalLM", "atom.models.glm4_moe"),
        ("GptOssForCausalLM", "atom.models.gpt_oss"),
        ("MiniMaxM2ForCausalLM", "atom.models.minimax_m2"),
    ]:
        assert (arch in served) == (importlib.util.find_spec(module) is not None)
