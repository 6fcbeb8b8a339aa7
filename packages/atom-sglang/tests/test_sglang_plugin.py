"""Fast checks of the plugin's pieces in-process, without starting an SGLang engine."""

from __future__ import annotations

import importlib
import logging
import pkgutil
import random
import re
import sys
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.models.registry import ModelRegistry
from sglang.srt.plugins.hook_registry import HookRegistry

import atom_sglang
from atom.hosts.plugin import UnsupportedHostVersion
from atom.kernels.paged_attention import attention_mask, dense_attention
from atom.registry import supported_architectures
from atom_sglang import guard
from atom_sglang import model as model_module
from atom_sglang.adapters import adapter_for
from atom_sglang.attention_layer import layer_index
from atom_sglang.backend import AtomAttnBackend, atom_sliding_window, create_atom_backend
from atom_sglang.patches import SUPPORT_TRITON


@pytest.fixture
def fresh_plugin(monkeypatch):
    """register() as in a new process; SGLang's registries restored afterwards."""
    from sglang.srt.arg_groups import resolution_hooks
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES

    models = dict(ModelRegistry.models)
    backends = dict(ATTENTION_BACKENDS)
    choices = list(ATTENTION_BACKEND_CHOICES)
    steps = {name: list(hooks) for name, hooks in resolution_hooks._HOOKS.items()}
    monkeypatch.setattr(atom_sglang, "_registered", None)
    monkeypatch.setattr(guard, "_installed", False)
    for name in ("ATOM_DISABLE_SGLANG_PLUGIN", "ATOM_SGLANG_BACKEND_ONLY"):
        monkeypatch.delenv(name, raising=False)
    yield
    ModelRegistry.models.clear()
    ModelRegistry.models.update(models)
    ATTENTION_BACKENDS.clear()
    ATTENTION_BACKENDS.update(backends)
    ATTENTION_BACKEND_CHOICES[:] = choices
    resolution_hooks._HOOKS.clear()
    resolution_hooks._HOOKS.update(steps)
    HookRegistry._hooks.pop(SUPPORT_TRITON, None)


@pytest.fixture
def root_logging():
    """SGLang's launch paths reconfigure the root logger (basicConfig(force=True))."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


UNSUPPORTED_VERSION = "0.5.17"
REFUSAL = (
    r"SGLang 0\.5\.17 is outside the range atom-sglang was tested on "
    r"\(SGLang >=0\.5\.21,<0\.5\.22\)"
)


@pytest.fixture
def unsupported_sglang(fresh_plugin, monkeypatch):
    """The installed SGLang as register() sees it: 0.5.17, below the tested range."""
    monkeypatch.setattr(atom_sglang, "sglang_version", lambda: UNSUPPORTED_VERSION)


def logged(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records)


def test_register_serves_every_sglang_capable_architecture(fresh_plugin, caplog):
    with caplog.at_level(logging.INFO, logger="sglang.atom_sglang"):
        atom_sglang.register()
    served = atom_sglang.served_architectures()
    assert set(served) == set(supported_architectures("sglang"))
    assert {"LlamaForCausalLM", "Qwen3ForCausalLM", "DeepseekV3ForCausalLM"} <= set(served)
    for arch in served:
        cls = ModelRegistry.models[arch]
        assert cls is model_module.wrapper_class(arch) and cls.__name__ == arch
        assert issubclass(cls, model_module.AtomForCausalLM)
    assert ATTENTION_BACKENDS["atom"] is create_atom_backend
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES

    assert "atom" in ATTENTION_BACKEND_CHOICES
    assert [t for t in HookRegistry._hooks if t == SUPPORT_TRITON]  # CPU engine only
    assert "serves LlamaForCausalLM" in logged(caplog)


@pytest.mark.parametrize(
    "name",
    [
        # Change 1 (atom_sglang.patches): the hooked function and SGLang's hook registry.
        "sglang.srt.utils.common:support_triton",
        "sglang.srt.plugins.hook_registry:HookRegistry.register",
        "sglang.srt.plugins.hook_registry:HookType.AROUND",
        # Changes 2 and 3: the published CUDA-graph config and SGLang's way to change it.
        "sglang.srt.runtime_context:get_context",
        "sglang.srt.runtime_context:RuntimeContext.override",
        "sglang.srt.runtime_context:get_exec",
        "sglang.srt.model_executor.cuda_graph_config:with_phase",
        "sglang.srt.model_executor.cuda_graph_config:Phase.DECODE",
        "sglang.srt.model_executor.cuda_graph_config:Backend.DISABLED",
        "sglang.srt.arg_groups.cuda_graph_hook:generate_decode_cuda_graph_batch_sizes",
        # Change 4: the model step it wraps and what the wrapper reads and declares.
        "sglang.srt.arg_groups.model_hook:handle_model_specific_adjustments",
        "sglang.srt.arg_groups.overrides:declare_resolution",
        "sglang.srt.arg_groups.overrides:resolving_view",
        "sglang.srt.arg_groups.overrides:model_config_of",
        "sglang.srt.connector:ConnectorType.INSTANCE",
        "sglang.srt.utils.common:parse_connector_type",
        # The launch check (atom_sglang.guard): the resolution step it wraps.
        "sglang.srt.arg_groups.resolution_hooks:register_resolution_hook",
        "sglang.srt.arg_groups.platform_hook:handle_hardware_runtime_validation",
    ],
)
def test_sglang_names_the_patches_rely_on_exist(name):
    assert pkgutil.resolve_name(name) is not None


def gpt_oss_launch(checkpoints, backend: str):
    from sglang.srt.server_args import ServerArgs

    model = str(checkpoints("GptOssForCausalLM"))
    return ServerArgs(
        model_path=model, device="cpu", skip_tokenizer_init=True, attention_backend=backend
    )


def test_atom_backend_passes_sglang_gpt_oss_backend_check(fresh_plugin, checkpoints):
    """SGLang's model step accepts only its backends with sinks and sliding windows for
    GPT-OSS (atom_sglang.patches, change 4): "atom" passes, resolves to "atom", and
    every other backend meets SGLang's check as before."""
    atom_sglang.register()
    launch = gpt_oss_launch(checkpoints, "atom")
    launch.resolve_once()
    assert launch.resolved_dict()["attention_backend"] == "atom"
    with pytest.raises(AssertionError, match="GptOssForCausalLM requires one of"):
        gpt_oss_launch(checkpoints, "torch_native").resolve_once()


def test_sglang_own_gpt_oss_keeps_its_backend_check(fresh_plugin, monkeypatch, checkpoints):
    """Backend only (SGLang's own GPT-OSS): the check stays as SGLang has it."""
    monkeypatch.setenv("ATOM_SGLANG_BACKEND_ONLY", "1")
    atom_sglang.register()
    with pytest.raises(AssertionError, match="GptOssForCausalLM requires one of"):
        gpt_oss_launch(checkpoints, "atom").resolve_once()


def test_register_is_idempotent(fresh_plugin, monkeypatch):
    atom_sglang.register()
    calls = []
    monkeypatch.setattr(atom_sglang, "register_models", lambda archs: calls.append(archs))
    atom_sglang.register()
    assert calls == [] and len(HookRegistry._hooks[SUPPORT_TRITON]) == 1


def test_disable_env_leaves_sglang_untouched(fresh_plugin, monkeypatch, caplog):
    before = dict(ModelRegistry.models)
    ATTENTION_BACKENDS.pop("atom", None)
    monkeypatch.setenv("ATOM_DISABLE_SGLANG_PLUGIN", "1")
    with caplog.at_level(logging.INFO, logger="sglang.atom_sglang"):
        atom_sglang.register()
    assert dict(ModelRegistry.models) == before and "atom" not in ATTENTION_BACKENDS
    assert "plugin inactive" in logged(caplog)


def test_backend_only_env_keeps_sglang_models(fresh_plugin, monkeypatch):
    before = dict(ModelRegistry.models)
    monkeypatch.setenv("ATOM_SGLANG_BACKEND_ONLY", "1")
    atom_sglang.register()
    assert dict(ModelRegistry.models) == before and "atom" in ATTENTION_BACKENDS


def test_register_never_raises(fresh_plugin, monkeypatch, caplog):
    def broken():
        raise RuntimeError("registry exploded")

    monkeypatch.setattr(atom_sglang, "served_architectures", broken)
    before = dict(ModelRegistry.models)
    atom_sglang.register()  # logs, does not raise
    assert dict(ModelRegistry.models) == before
    assert "register() failed" in logged(caplog)


def test_register_logs_to_stderr_before_logging_is_configured(fresh_plugin, monkeypatch, capsys):
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    atom_sglang.register()
    assert "serves LlamaForCausalLM" in capsys.readouterr().err


def test_register_logs_to_stderr_after_sglang_import_time_basic_config(
    fresh_plugin, monkeypatch, capsys
):
    """SGLang's modules run `logging.basicConfig()` at import (a root handler, the root
    left at its default WARNING), before its schedulers run the plugins: an INFO line
    through logging would vanish there, so it goes to stderr."""
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [logging.StreamHandler()])
    monkeypatch.setattr(root, "level", logging.WARNING)
    atom_sglang.register()
    assert "ATOM 0.1.0 serves LlamaForCausalLM" in capsys.readouterr().err


def test_register_checks_the_installed_sglang_version():
    from importlib.metadata import version

    assert atom_sglang.sglang_version() == version("sglang")
    assert atom_sglang.SUPPORTED.admits(atom_sglang.sglang_version())
    assert str(atom_sglang.SUPPORTED) == ">=0.5.21,<0.5.22"


def test_explicit_request_on_supported_version_registers(fresh_plugin, monkeypatch):
    monkeypatch.setenv("ATOM_DISABLE_SGLANG_PLUGIN", "0")
    atom_sglang.register()
    assert "atom" in ATTENTION_BACKENDS and "Qwen3ForCausalLM" in atom_sglang._registered


def test_unsupported_version_registers_nothing(unsupported_sglang, checkpoints, caplog):
    """Outside the tested range, unrequested: one log line, and SGLang as it was."""
    from sglang.srt.server_args import ServerArgs

    models = dict(ModelRegistry.models)
    ATTENTION_BACKENDS.pop("atom", None)
    with caplog.at_level(logging.INFO, logger="sglang.atom_sglang"):
        atom_sglang.register()
        atom_sglang.register()
    assert dict(ModelRegistry.models) == models and "atom" not in ATTENTION_BACKENDS
    assert not HookRegistry._hooks.get(SUPPORT_TRITON)
    (line,) = [r for r in caplog.records if r.name.startswith("sglang.atom_sglang")]
    assert line.levelno == logging.WARNING
    assert re.fullmatch(REFUSAL + ": ATOM inactive, the host runs its own models", line.message)
    # SGLang resolves a launch with its own backend as before.
    ServerArgs(
        model_path=str(checkpoints("Qwen3ForCausalLM")), device="cpu", skip_tokenizer_init=True
    ).resolve_once()


def test_unsupported_version_refuses_the_atom_backend(
    unsupported_sglang, checkpoints, root_logging
):
    """`attention_backend="atom"` on an unsupported SGLang: SGLang's own argument
    resolution raises UnsupportedHostVersion, for the Engine's keyword and the CLI flag."""
    from sglang.srt.server_args import ServerArgs, prepare_server_args

    model = str(checkpoints("Qwen3ForCausalLM"))
    atom_sglang.register()  # registers no backend: the request shows only at launch
    assert "atom" not in ATTENTION_BACKENDS
    for field in guard.ATTENTION_FIELDS:
        args = ServerArgs(
            model_path=model, device="cpu", skip_tokenizer_init=True, **{field: "atom"}
        )
        with pytest.raises(UnsupportedHostVersion, match=REFUSAL + ": ATOM was requested"):
            args.resolve_once()
    cli = prepare_server_args(
        ["--model-path", model, "--device", "cpu", "--attention-backend", "atom"]
    )  # argparse accepts the name, so the refusal below is what the user reads
    with pytest.raises(UnsupportedHostVersion, match=REFUSAL):
        cli.resolve_once()


def test_unsupported_version_refuses_the_env_request_at_engine_start(
    unsupported_sglang, monkeypatch, checkpoints, caplog, root_logging
):
    """ATOM_DISABLE_SGLANG_PLUGIN=0 on an unsupported SGLang: register() raises; SGLang's
    plugin loader logs and swallows that, and the real `sglang.Engine(...)` raises it
    while resolving its arguments, before it starts a process."""
    import sglang
    import sglang.srt.plugins as sglang_plugins

    monkeypatch.setenv("ATOM_DISABLE_SGLANG_PLUGIN", "0")
    with pytest.raises(UnsupportedHostVersion, match=REFUSAL + ": ATOM was requested"):
        atom_sglang.register()
    monkeypatch.setattr(atom_sglang, "_registered", None)
    monkeypatch.setattr(sglang_plugins, "_plugins_loaded", False)
    with caplog.at_level(logging.ERROR, logger="sglang.srt.plugins"):
        sglang_plugins.load_plugins()  # the entry point SGLang runs: atom_sglang:register
    assert "Failed to execute general plugin: atom" in caplog.text
    assert "UnsupportedHostVersion" in caplog.text
    assert "atom" not in ATTENTION_BACKENDS
    with pytest.raises(UnsupportedHostVersion, match=REFUSAL):
        sglang.Engine(
            model_path=str(checkpoints("Qwen3ForCausalLM")),
            device="cpu",
            skip_tokenizer_init=True,
            attention_backend="torch_native",
        )


def test_external_model_package_offers_every_served_architecture():
    from atom_sglang.models import atom_models

    names = sorted(cls.__name__ for cls in atom_models.EntryClass)
    assert names == sorted(atom_sglang.served_architectures())


def test_external_model_package_refuses_an_unsupported_sglang(unsupported_sglang, caplog):
    """SGLANG_EXTERNAL_MODEL_PACKAGE=atom_sglang.models asks for ATOM explicitly: on an
    SGLang outside the range its import raises, which SGLang's registry logs (keeping
    its own classes)."""
    from sglang.srt.models.registry import import_model_classes

    module = "atom_sglang.models.atom_models"
    sys.modules.pop(module, None)
    try:
        with pytest.raises(UnsupportedHostVersion, match=REFUSAL + ": ATOM was requested"):
            importlib.import_module(module)
        with caplog.at_level(logging.WARNING):
            assert import_model_classes("atom_sglang.models") == {}
        assert re.search(REFUSAL + ": ATOM was requested", logged(caplog))
    finally:
        sys.modules.pop(module, None)


def test_every_sglang_capable_registry_entry_gets_the_adapter_of_its_attention_kind():
    from atom.registry import all_models

    sglang_entries = [e for e in all_models() if "sglang" in e.hosts]
    assert sglang_entries
    for entry in sglang_entries:
        adapter = adapter_for(entry)
        assert (adapter.attention, adapter.kv_pool) == (entry.attention, entry.attention.lower())
    assert set(atom_sglang.served_architectures()) <= {e.architecture for e in sglang_entries}


def test_adapters_declare_pool_and_attention_kind():
    from atom.registry import get_entry

    assert adapter_for(get_entry("DeepseekV2ForCausalLM")).kv_pool == "mla"
    assert adapter_for(get_entry("Qwen3ForCausalLM")).attention == "MHA"
    assert layer_index("model.layers.11.self_attn.attn") == 11
    with pytest.raises(ValueError):
        layer_index("lm_head")
    assert atom_sliding_window(-1) is None and atom_sliding_window(7) == 8


# --------------------------------------------------------------------------- the backend


class FakePool:
    """SGLang's pool interface over flat [slots, H, D] tensors (slot 0 = padding)."""

    dtype = torch.float32

    def __init__(self, slots, heads, dim, v_dim, page_size, mla_latent=None):
        self.page_size = page_size
        if mla_latent is not None:
            self.kv_lora_rank = mla_latent
            self.kv = torch.zeros(slots, 1, dim)
        else:
            self.k, self.v = torch.zeros(slots, heads, dim), torch.zeros(slots, heads, v_dim)

    def get_key_buffer(self, layer_id):
        return self.kv if hasattr(self, "kv_lora_rank") else self.k

    def get_value_buffer(self, layer_id):
        return self.kv[..., : self.kv_lora_rank] if hasattr(self, "kv_lora_rank") else self.v


def make_batch(prefix_lens, new_lens, page_size, num_slots, seed=0):
    """A req_to_token table with shuffled page-aligned slots and a ForwardBatch-like step."""
    rng = random.Random(seed)
    pages = list(range(1, num_slots // page_size))  # page 0 holds the padding slot
    rng.shuffle(pages)
    req_to_token = torch.zeros(8, 256, dtype=torch.int32)
    rows = [3, 1, 5, 0, 6, 2][: len(prefix_lens)]
    out_loc = []
    for row, p, n in zip(rows, prefix_lens, new_lens):
        table = [pages.pop() for _ in range(-(-(p + n) // page_size))]
        slots = [table[i // page_size] * page_size + i % page_size for i in range(p + n)]
        req_to_token[row, : p + n] = torch.tensor(slots, dtype=torch.int32)
        out_loc += slots[p:]
    seq = [p + n for p, n in zip(prefix_lens, new_lens)]
    decode = all(n == 1 for n in new_lens) and all(p > 0 for p in prefix_lens)
    batch = SimpleNamespace(
        forward_mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
        batch_size=len(seq),
        req_pool_indices=torch.tensor(rows),
        seq_lens=torch.tensor(seq),
        seq_lens_cpu=torch.tensor(seq),
        out_cache_loc=torch.tensor(out_loc),
        extend_seq_lens=torch.tensor(new_lens, dtype=torch.int32),
        extend_seq_lens_cpu=list(new_lens),
    )
    return req_to_token, batch


def make_backend(req_to_token, pool, page_size):
    runner = SimpleNamespace(
        device="cpu",
        req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
        token_to_kv_pool=pool,
        page_size=page_size,
    )
    return AtomAttnBackend(runner)


def layer(hq, hkv, d, dv, window=-1, cap=0.0, layer_id=0):
    return SimpleNamespace(
        layer_id=layer_id, tp_q_head_num=hq, tp_k_head_num=hkv, tp_v_head_num=hkv, qk_head_dim=d,
        v_head_dim=dv, scaling=d**-0.5, sliding_window_size=window, logit_cap=cap,
        logit_capping_method="tanh", k_scale_float=None, v_scale_float=None,
    )  # fmt: skip


def history(prefix_lens, new_lens, heads, d, dv):
    return [
        (torch.randn(p + n, heads, d), torch.randn(p + n, heads, dv))
        for p, n in zip(prefix_lens, new_lens)
    ]


def reference(q, hist, prefix_lens, new_lens, scale, window=None, cap=None):
    outs, start = [], 0
    for (k, v), p, n in zip(hist, prefix_lens, new_lens):
        mask = attention_mask(torch.arange(p, p + n), p + n, window)
        outs.append(dense_attention(q[start : start + n], k, v, mask, scale, cap))
        start += n
    return torch.cat(outs)


def fill_prefixes(pool_k, pool_v, req_to_token, batch, hist, prefix_lens):
    for row, (k, v), p in zip(batch.req_pool_indices.tolist(), hist, prefix_lens):
        slots = req_to_token[row, :p].long()
        pool_k[slots] = k[:p]
        if pool_v is not None:
            pool_v[slots] = v[:p]


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize(
    "prefix_lens,new_lens,window",
    [([0, 5, 17], [7, 3, 1], -1), ([9, 30, 2, 11], [1, 1, 1, 1], -1), ([0, 12], [20, 4], 5)],
)
def test_mha_backend_matches_dense_attention(page_size, prefix_lens, new_lens, window):
    torch.manual_seed(0)
    hq, hkv, d = 4, 2, 32
    req_to_token, batch = make_batch(prefix_lens, new_lens, page_size, 256)
    pool = FakePool(256, hkv, d, d, page_size)
    backend = make_backend(req_to_token, pool, page_size)
    hist = history(prefix_lens, new_lens, hkv, d, d)
    fill_prefixes(pool.k, pool.v, req_to_token, batch, hist, prefix_lens)
    k_new = torch.cat([k[p:] for (k, _), p in zip(hist, prefix_lens)])
    v_new = torch.cat([v[p:] for (_, v), p in zip(hist, prefix_lens)])
    q = torch.randn(sum(new_lens), hq, d)
    backend.init_forward_metadata(batch)
    md = backend.forward_metadata
    assert md.num_decodes == (batch.batch_size if batch.forward_mode.is_decode() else 0)
    out = backend.forward(
        q.flatten(1), k_new.flatten(1), v_new.flatten(1), layer(hq, hkv, d, d, window), batch
    )
    want = reference(q, hist, prefix_lens, new_lens, d**-0.5, atom_sliding_window(window))
    torch.testing.assert_close(out.view_as(want), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool.k[batch.out_cache_loc], k_new)  # the KV write
    assert backend.num_calls == 1


@pytest.mark.parametrize("prefix_lens,new_lens", [([0, 5, 17], [7, 3, 1]), ([9, 30], [1, 1])])
def test_mha_backend_reads_an_fp8_pool_with_layer_scales(prefix_lens, new_lens):
    """SGLang's fp8_e4m3 pool (uint8 storage) holds x / scale with the layer's
    k_scale_float / v_scale_float: attention equals dense attention over the dequantized
    K/V, and the new tokens' K/V land quantized in their slots."""
    torch.manual_seed(0)
    hq, hkv, d = 4, 2, 32
    k_scale, v_scale = 0.05, 0.02
    req_to_token, batch = make_batch(prefix_lens, new_lens, 1, 256)
    pool = MHATokenToKVPool(256, 1, torch.float8_e4m3fn, hkv, d, 1, "cpu", False)
    backend = make_backend(req_to_token, pool, 1)
    hist = history(prefix_lens, new_lens, hkv, d, d)

    def fp8(x, scale):
        return (x / scale).to(torch.float8_e4m3fn)

    stored = [
        (fp8(k, k_scale).view(torch.uint8), fp8(v, v_scale).view(torch.uint8)) for k, v in hist
    ]
    fill_prefixes(pool.k_buffer[0], pool.v_buffer[0], req_to_token, batch, stored, prefix_lens)
    k_new = torch.cat([k[p:] for (k, _), p in zip(hist, prefix_lens)])
    v_new = torch.cat([v[p:] for (_, v), p in zip(hist, prefix_lens)])
    q = torch.randn(sum(new_lens), hq, d)
    attn = layer(hq, hkv, d, d)
    attn.k_scale_float, attn.v_scale_float = k_scale, v_scale
    backend.init_forward_metadata(batch)
    out = backend.forward(q.flatten(1), k_new.flatten(1), v_new.flatten(1), attn, batch)
    read = [(fp8(k, k_scale).float() * k_scale, fp8(v, v_scale).float() * v_scale) for k, v in hist]
    want = reference(q, read, prefix_lens, new_lens, d**-0.5)
    torch.testing.assert_close(out.view_as(want), want, rtol=1e-5, atol=1e-5)
    written = pool.k_buffer[0][batch.out_cache_loc]
    assert torch.equal(written, fp8(k_new, k_scale).view(torch.uint8))


def test_backend_refuses_pools_its_kernels_cannot_read():
    req_to_token, _ = make_batch([0], [4], 1, 64)
    e5m2 = MHATokenToKVPool(64, 1, torch.float8_e5m2, 2, 32, 1, "cpu", False)
    with pytest.raises(
        NotImplementedError, match="float8_e5m2 KV cache; use --kv-cache-dtype fp8_e4m3"
    ):
        make_backend(req_to_token, e5m2, 1)


@pytest.mark.parametrize("prefix_lens,new_lens", [([0, 5, 17], [7, 3, 1]), ([9, 30], [1, 1])])
def test_fused_qk_rope_write_equals_rotating_first(prefix_lens, new_lens):
    """What SglangAttention hands ATOM's backend (raw q/k, its spec with qk_rope, the
    positions) gives the output and cache of rotating q/k first, then attending."""
    from atom.layers.attention_spec import AttentionSpec, QKRope
    from atom.layers.norm import RMSNorm
    from atom.layers.rotary import RotaryEmbedding

    torch.manual_seed(2)
    hq, hkv, d = 4, 2, 32
    q_norm, k_norm = RMSNorm(d), RMSNorm(d)
    q_norm.weight.data.uniform_(0.5, 1.5)
    k_norm.weight.data.uniform_(0.5, 1.5)
    qk_rope = QKRope(RotaryEmbedding(d, d, 256, 10000.0), q_norm, k_norm)
    positions = torch.cat([torch.arange(p, p + n) for p, n in zip(prefix_lens, new_lens)])
    q = torch.randn(sum(new_lens), hq, d)
    k, v = torch.randn(sum(new_lens), hkv, d), torch.randn(sum(new_lens), hkv, d)
    runs = {}
    for fused in (False, True):
        req_to_token, batch = make_batch(prefix_lens, new_lens, 1, 256)
        pool = FakePool(256, hkv, d, d, 1)
        backend = make_backend(req_to_token, pool, 1)
        backend.init_forward_metadata(batch)
        if fused:
            spec = AttentionSpec("layer", hq, hkv, d, d, d**-0.5, qk_rope=qk_rope)
            args, kwargs = (q, k), {"spec": spec, "positions": positions}
        else:
            args, kwargs = qk_rope(positions, q, k), {}
        qa, ka = args
        out = backend.forward(
            qa.flatten(1), ka.flatten(1), v.flatten(1), layer(hq, hkv, d, d), batch, **kwargs
        )
        runs[fused] = (out, pool.k[batch.out_cache_loc])
    torch.testing.assert_close(runs[True], runs[False], rtol=1e-5, atol=1e-5)


def test_decode_cuda_graph_metadata_matches_eager():
    """The static-buffer path (capture/replay) attends exactly like the eager one."""
    torch.manual_seed(1)
    hq, hkv, d, page = 4, 2, 32, 4
    prefix_lens, new_lens = [9, 30, 2], [1, 1, 1]
    req_to_token, batch = make_batch(prefix_lens, new_lens, page, 256)
    pool = FakePool(256, hkv, d, d, page)
    hist = history(prefix_lens, new_lens, hkv, d, d)
    fill_prefixes(pool.k, pool.v, req_to_token, batch, hist, prefix_lens)
    q = torch.randn(3, hq, d)
    k_new = torch.stack([k[-1] for k, _ in hist])
    v_new = torch.stack([v[-1] for _, v in hist])
    backend = make_backend(req_to_token, pool, page)
    backend.init_forward_metadata(batch)
    eager = backend.forward(
        q.flatten(1), k_new.flatten(1), v_new.flatten(1), layer(hq, hkv, d, d), batch
    )
    backend.init_cuda_graph_state(max_bs=8, max_num_tokens=8)
    assert backend.get_cuda_graph_seq_len_fill_value() == 1
    backend.init_forward_metadata_out_graph(batch, in_capture=True)
    buffers = backend.graph_buffers
    assert backend.forward_metadata.block_table.data_ptr() == buffers["block_table"].data_ptr()
    graphed = backend.forward(
        q.flatten(1), k_new.flatten(1), v_new.flatten(1), layer(hq, hkv, d, d), batch
    )
    torch.testing.assert_close(graphed, eager, rtol=0, atol=0)
    # A replay refills the buffers and keeps the metadata built at capture.
    captured = backend.forward_metadata
    backend.init_forward_metadata_out_graph(batch)
    assert backend.forward_metadata is captured


SLIDING_LAYER, FULL_LAYER = 0, 1


def hybrid_swa_batch(prefix_lens, new_lens, page_size, window, heads, dim):
    """A real SGLang hybrid SWA pool (layer 0 sliding, layer 1 full) and its allocator,
    holding requests as SGLang leaves them: both pools' slots allocated page by page and
    paired in the translation table, and the sliding slots of the tokens that no new
    query's window reaches freed again (`free_swa`, SGLang's out-of-window eviction).
    Returns the pool, its req_to_token table and a ForwardBatch-like step."""
    pool = SWAKVPool(
        size=256, size_swa=128, page_size=page_size, dtype=torch.float32, head_num=heads,
        head_dim=dim, swa_attention_layer_ids=[SLIDING_LAYER],
        full_attention_layer_ids=[FULL_LAYER], device="cpu",
    )  # fmt: skip
    allocator = SWATokenToKVPoolAllocator(
        256, 128, page_size, torch.float32, "cpu", pool, need_sort=False
    )
    allocator.swa_attn_allocator.alloc(3 * page_size)  # so the two pools' slots differ
    req_to_token = torch.zeros(8, 256, dtype=torch.int32)
    rows = [3, 1, 5][: len(prefix_lens)]
    new_slots = {}
    # Last request first: the translation is then no monotone function.
    for row, p, n in reversed(list(zip(rows, prefix_lens, new_lens))):
        pages = -(-(p + n) // page_size)
        full = allocator.full_attn_allocator.alloc(pages * page_size)
        allocator.set_full_to_swa_mapping(full, allocator.swa_attn_allocator.alloc(full.numel()))
        req_to_token[row, : p + n] = full[: p + n]
        new_slots[row] = full[p : p + n]
        # The first new token (position p) sees keys from p - window + 1 on.
        out_of_window = max(0, p - window + 1) // page_size * page_size
        allocator.free_swa(full[:out_of_window])
    seq = [p + n for p, n in zip(prefix_lens, new_lens)]
    batch = SimpleNamespace(
        forward_mode=ForwardMode.DECODE if set(new_lens) == {1} else ForwardMode.EXTEND,
        batch_size=len(seq),
        req_pool_indices=torch.tensor(rows),
        seq_lens=torch.tensor(seq),
        seq_lens_cpu=torch.tensor(seq),
        out_cache_loc=torch.cat([new_slots[row] for row in rows]),
        extend_seq_lens=torch.tensor(new_lens, dtype=torch.int32),
        extend_seq_lens_cpu=list(new_lens),
    )
    return pool, req_to_token, batch


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize(
    "prefix_lens,new_lens", [([0, 13, 21], [9, 5, 1]), ([17, 30, 9], [1, 1, 1])]
)
def test_hybrid_swa_pool_sliding_layers_attend_in_the_sliding_pool(
    page_size, prefix_lens, new_lens, caplog
):
    """With SGLang's SWAKVPool, a sliding layer writes and reads the sliding-window pool
    through the translated metadata, a full layer the full pool; tokens whose sliding
    slots SGLang freed read its padding slot, which the window masks (filled with large
    values here, so reading it unmasked would show). Eager and CUDA-graph metadata."""
    torch.manual_seed(3)
    hq, hkv, d, window = 4, 2, 32, 6
    pool, req_to_token, batch = hybrid_swa_batch(prefix_lens, new_lens, page_size, window, hkv, d)
    hist = history(prefix_lens, new_lens, hkv, d, d)
    translate = pool.translate_loc_from_full_to_swa
    for (k, v), row, p in zip(hist, batch.req_pool_indices.tolist(), prefix_lens):
        full = req_to_token[row, :p].long()
        pool.get_key_buffer(FULL_LAYER)[full] = k[:p]
        pool.get_value_buffer(FULL_LAYER)[full] = v[:p]
        kept = translate(full) > 0  # freed: translated to the padding slot 0
        sliding = translate(full[kept])
        pool.get_key_buffer(SLIDING_LAYER)[sliding] = k[:p][kept]
        pool.get_value_buffer(SLIDING_LAYER)[sliding] = v[:p][kept]
    # The padding page, which freed tokens' pages translate to.
    pool.get_key_buffer(SLIDING_LAYER)[:page_size] = 50.0
    pool.get_value_buffer(SLIDING_LAYER)[:page_size] = 50.0
    k_new = torch.cat([k[p:] for (k, _), p in zip(hist, prefix_lens)])
    v_new = torch.cat([v[p:] for (_, v), p in zip(hist, prefix_lens)])
    q = torch.randn(sum(new_lens), hq, d)
    with caplog.at_level(logging.INFO, logger="sglang.atom_sglang.backend"):
        backend = make_backend(req_to_token, pool, page_size)
    assert "hybrid SWA (full layers [1], sliding layers [0])" in logged(caplog)
    layers = {
        SLIDING_LAYER: layer(hq, hkv, d, d, window - 1, layer_id=SLIDING_LAYER),
        FULL_LAYER: layer(hq, hkv, d, d, layer_id=FULL_LAYER),
    }

    def attend(layer_id):
        return backend.forward(
            q.flatten(1), k_new.flatten(1), v_new.flatten(1), layers[layer_id], batch
        )

    backend.init_forward_metadata(batch)
    eager = {layer_id: attend(layer_id) for layer_id in layers}
    for layer_id, seen in ((SLIDING_LAYER, window), (FULL_LAYER, None)):
        want = reference(q, hist, prefix_lens, new_lens, d**-0.5, seen)
        torch.testing.assert_close(eager[layer_id].view_as(want), want, rtol=1e-5, atol=1e-5)
    sliding_slots = translate(batch.out_cache_loc)
    assert (sliding_slots > 0).all()
    torch.testing.assert_close(pool.get_key_buffer(SLIDING_LAYER)[sliding_slots], k_new)
    torch.testing.assert_close(pool.get_value_buffer(FULL_LAYER)[batch.out_cache_loc], v_new)
    if batch.forward_mode.is_decode():
        backend.init_cuda_graph_state(max_bs=8, max_num_tokens=8)
        backend.init_forward_metadata_out_graph(batch, in_capture=True)
        for layer_id in layers:
            torch.testing.assert_close(attend(layer_id), eager[layer_id], rtol=0, atol=0)


@pytest.mark.parametrize("prefix_lens,new_lens", [([0, 6], [9, 4]), ([5, 13, 1], [1, 1, 1])])
def test_mla_backend_matches_latent_mqa(prefix_lens, new_lens):
    """Absorbed MLA: q [T, H, L+R] over latent rows [L+R]; values = first L channels."""
    torch.manual_seed(2)
    h, latent, rope = 4, 64, 16
    req_to_token, batch = make_batch(prefix_lens, new_lens, 1, 256)
    pool = FakePool(256, 1, latent + rope, latent, 1, mla_latent=latent)
    backend = make_backend(req_to_token, pool, 1)
    assert backend.is_mla
    rows = [torch.randn(p + n, 1, latent + rope) for p, n in zip(prefix_lens, new_lens)]
    hist = [(r, r[..., :latent]) for r in rows]
    fill_prefixes(pool.kv, None, req_to_token, batch, hist, prefix_lens)
    k_new = torch.cat([r[p:] for r, p in zip(rows, prefix_lens)])
    q = torch.randn(sum(new_lens), h, latent + rope)
    mla_layer = layer(h, 1, latent + rope, latent)
    backend.init_forward_metadata(batch)
    out = backend.forward(
        q.flatten(1), k_new.flatten(1), k_new[..., :latent].flatten(1), mla_layer, batch
    )
    want = reference(q, hist, prefix_lens, new_lens, (latent + rope) ** -0.5)
    torch.testing.assert_close(out.view_as(want), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool.kv[batch.out_cache_loc], k_new)


@pytest.mark.parametrize("prefix_lens,new_lens", [([0, 5, 17], [7, 3, 1]), ([9, 30], [1, 1])])
def test_mla_backend_reads_an_fp8_latent_pool(prefix_lens, new_lens):
    """SGLang's MLA pool in fp8_e4m3 (uint8 storage) with the layer's k_scale_float:
    absorbed MLA over the dequantized latent rows."""
    torch.manual_seed(2)
    h, latent, rope, kv_scale = 4, 64, 16, 0.05
    req_to_token, batch = make_batch(prefix_lens, new_lens, 1, 256)
    pool = MLATokenToKVPool(256, 1, torch.float8_e4m3fn, latent, rope, 1, "cpu", False)
    backend = make_backend(req_to_token, pool, 1)
    rows = [torch.randn(p + n, 1, latent + rope) for p, n in zip(prefix_lens, new_lens)]
    stored = [((r / kv_scale).to(torch.float8_e4m3fn).view(torch.uint8), None) for r in rows]
    fill_prefixes(pool.kv_buffer[0], None, req_to_token, batch, stored, prefix_lens)
    k_new = torch.cat([r[p:] for r, p in zip(rows, prefix_lens)])
    q = torch.randn(sum(new_lens), h, latent + rope)
    mla_layer = layer(h, 1, latent + rope, latent)
    mla_layer.k_scale_float = kv_scale
    backend.init_forward_metadata(batch)
    out = backend.forward(
        q.flatten(1), k_new.flatten(1), k_new[..., :latent].flatten(1), mla_layer, batch
    )
    read = [(r / kv_scale).to(torch.float8_e4m3fn).float() * kv_scale for r in rows]
    want = reference(
        q, [(r, r[..., :latent]) for r in read], prefix_lens, new_lens, (latent + rope) ** -0.5
    )
    torch.testing.assert_close(out.view_as(want), want, rtol=1e-5, atol=1e-5)


@pytest.fixture
def runtime_context():
    """The process-wide config SGLang publishes, put back after the test."""
    from sglang.srt.runtime_context import restore_context, snapshot_context

    state = snapshot_context()
    yield
    restore_context(state)


H200_DECODE_MAX_BS = 256  # SGLang's decode graph size on an H100/H200 with tp < 4


def publish_as_on_gpu(model, **user_choice):
    """Publishes server args resolved here, then what SGLang resolves on an H200 (tp=1):
    device cuda, breakable prefill graphs, and, unless the user sized them, full decode
    graphs up to 256 requests with SGLang's own spacing."""
    from sglang.srt.arg_groups.cuda_graph_hook import generate_decode_cuda_graph_batch_sizes
    from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, with_phase
    from sglang.srt.runtime_context import get_context, get_exec, publish
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path=str(model), device="cpu", skip_tokenizer_init=True, **user_choice)
    publish(args, role="test")
    decode = {"backend": Backend.FULL}
    if not user_choice:
        decode["max_bs"] = H200_DECODE_MAX_BS
        decode["bs"] = generate_decode_cuda_graph_batch_sizes(args, H200_DECODE_MAX_BS)
    config = with_phase(get_exec().graph.cuda_graph_config, Phase.DECODE, **decode)
    config = with_phase(config, Phase.PREFILL, backend=Backend.BREAKABLE)
    get_context().override("test", device="cuda", cuda_graph_config=config)
    return args


def test_atom_models_keep_prefill_out_of_cuda_graphs(checkpoints, runtime_context):
    """SGLang's GPU default captures prefill through a decoder-body signature ATOM's
    models do not have (atom_sglang.patches, change 2): building ATOM's wrapper turns
    the prefill phase off in the published config; decode graphs stay as they were."""
    from sglang.srt.model_executor.cuda_graph_config import Backend
    from sglang.srt.runtime_context import get_context, get_exec

    from atom_sglang.patches import decode_graphs_enabled, keep_prefill_eager

    publish_as_on_gpu(checkpoints("Qwen3ForCausalLM"))
    decode = get_exec().graph.cuda_graph_config.decode
    assert keep_prefill_eager()
    config = get_exec().graph.cuda_graph_config
    assert config.prefill.backend == Backend.DISABLED
    assert config.decode == decode and decode_graphs_enabled()
    assert get_context().overrides_log()[-1][0] == "atom_sglang.patches"
    assert not keep_prefill_eager()  # already off: nothing to change


def test_graph_patches_leave_an_unpublished_process_alone(runtime_context):
    from sglang.srt.runtime_context import reset_context

    from atom_sglang.patches import (
        capture_decode_batches_up_to,
        decode_graphs_enabled,
        keep_prefill_eager,
    )

    reset_context()
    assert not keep_prefill_eager() and not decode_graphs_enabled()
    assert not capture_decode_batches_up_to(1024)


def test_cuda_graph_guard_reads_the_published_decode_phase(checkpoints, runtime_context):
    """The wrapper refuses a model with uncapturable parts only where SGLang will
    capture decode steps: `--disable-cuda-graph` turns that off."""
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs

    from atom_sglang.patches import decode_graphs_enabled

    model = str(checkpoints("Qwen3ForCausalLM"))
    publish_as_on_gpu(model)
    assert decode_graphs_enabled()
    args = ServerArgs(
        model_path=model, device="cpu", skip_tokenizer_init=True, disable_cuda_graph=True
    )
    publish(args, role="test")
    assert not decode_graphs_enabled()


@pytest.mark.parametrize(
    "user_choice",
    [
        {},
        {"cuda_graph_max_bs_decode": 128},
        {"cuda_graph_bs_decode": [1, 2, 4, 8]},
        {"cuda_graph_config": {"decode": {"max_bs": 64}}},
    ],
)
def test_atom_models_capture_decode_batches_up_to_1024(checkpoints, runtime_context, user_choice):
    """SGLang sizes decode graphs from GPU memory (256 on an H200), and ATOM's models
    run eagerly above that are CPU-bound (atom_sglang.patches, change 3): building ATOM's
    wrapper extends the decode list to 1024 with SGLang's own spacing, unless the user
    chose decode sizes (flags or JSON cuda_graph_config)."""
    from sglang.srt.arg_groups.cuda_graph_hook import generate_decode_cuda_graph_batch_sizes
    from sglang.srt.runtime_context import get_exec

    from atom_sglang.patches import capture_decode_batches_up_to

    args = publish_as_on_gpu(checkpoints("Qwen3ForCausalLM"), **user_choice)
    before = get_exec().graph.cuda_graph_config.decode
    if user_choice:
        assert not capture_decode_batches_up_to(1024)
        assert get_exec().graph.cuda_graph_config.decode == before
        return
    assert capture_decode_batches_up_to(1024)
    decode = get_exec().graph.cuda_graph_config.decode
    assert decode.max_bs == 1024 and decode.backend == before.backend
    assert decode.bs == generate_decode_cuda_graph_batch_sizes(args, 1024)
    assert decode.bs[: len(before.bs)] == before.bs  # SGLang's spacing, extended
    assert decode.bs[-3:] == [960, 992, 1024]
    assert not capture_decode_batches_up_to(1024)  # already there: nothing to change


def test_atom_model_config_restores_what_sglang_pads_on_cpu(tmp_path):
    """SGLang's CPU loader rounds MLP sizes up to a multiple of 32 (tp=1) and keeps the
    checkpoint's as `original_*`; ATOM's model is built from the checkpoint's, on a copy
    (SGLang's own code keeps the padded config)."""
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.configs.update_config import adjust_config_with_unaligned_cpu_tp

    from atom.testing import tiny_config, write_checkpoint
    from atom_sglang.config import atom_model_config

    config = tiny_config("Qwen3MoeForCausalLM", moe_intermediate_size=48, intermediate_size=200)
    model_config = ModelConfig(str(write_checkpoint(config, tmp_path)))
    padded = adjust_config_with_unaligned_cpu_tp(model_config, LoadConfig(), 1).hf_config
    assert (padded.moe_intermediate_size, padded.intermediate_size) == (64, 224)
    restored = atom_model_config(padded)
    assert (restored.moe_intermediate_size, restored.intermediate_size) == (48, 200)
    assert (padded.moe_intermediate_size, padded.intermediate_size) == (64, 224)
    assert restored.num_experts == padded.num_experts
    aligned = tiny_config("Qwen3MoeForCausalLM")
    assert atom_model_config(aligned) is aligned
