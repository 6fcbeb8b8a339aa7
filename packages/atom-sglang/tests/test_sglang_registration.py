"""Registration and the version guard: what register() leaves in SGLang's registries, the
switches, the tested range, the adapters and the config bridge (in-process, no engine)."""

from __future__ import annotations

import importlib
import logging
import re
import sys

import pytest
from plugin_logs import logged
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
from sglang.srt.models.registry import ModelRegistry
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang.srt.utils.common import support_triton

import atom_sglang
from atom.hosts.plugin import UnsupportedHostVersion
from atom.registry import supported_architectures
from atom_sglang import guard
from atom_sglang import model as model_module
from atom_sglang.adapters import adapter_for
from atom_sglang.attention_layer import layer_index
from atom_sglang.backend import atom_sliding_window, create_atom_backend
from atom_sglang.patches import (
    IS_DEEPSEEK_DSA,
    IS_DEEPSEEK_V4,
    IS_HYBRID_SWA,
    MODEL_DECLARATIONS,
    SUPPORT_TRITON,
    V4_DEFAULTS,
)

REFUSAL = (
    r"SGLang 0\.5\.17 is outside the range atom-sglang was tested on "
    r"\(SGLang >=0\.5\.21,<0\.5\.24\)"
)


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
    # Change 1: on the CPU engine, where SGLang answers by the name (0.5.21).
    assert bool(HookRegistry._hooks.get(SUPPORT_TRITON)) == support_triton("atom")
    assert "serves LlamaForCausalLM" in logged(caplog)


def test_register_is_idempotent(fresh_plugin, monkeypatch):
    atom_sglang.register()
    hooks = {target: len(h) for target, h in HookRegistry._hooks.items()}
    calls = []
    monkeypatch.setattr(atom_sglang, "register_models", lambda archs: calls.append(archs))
    atom_sglang.register()
    assert calls == [] and {target: len(h) for target, h in HookRegistry._hooks.items()} == hooks
    assert hooks[IS_DEEPSEEK_DSA] == 1
    # DeepSeek-V4 (served): SGLang's own V4 path off, once (changes 11, 13, 14).
    assert [hooks[t] for t in (IS_DEEPSEEK_V4, IS_HYBRID_SWA, MODEL_DECLARATIONS, V4_DEFAULTS)] == [
        1, 1, 1, 1,
    ]  # fmt: skip


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
    assert str(atom_sglang.SUPPORTED) == ">=0.5.21,<0.5.24"


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
        # DeepSeek-V4's packed rows live in SGLang's MLA pool (atom_sglang.patches, 12).
        pool = "mla" if entry.attention == "compressed" else entry.attention.lower()
        assert (adapter.attention, adapter.kv_pool) == (entry.attention, pool)
    assert set(atom_sglang.served_architectures()) <= {n for e in sglang_entries for n in e.names}


def test_adapters_declare_pool_and_attention_kind():
    from atom.registry import get_entry

    assert adapter_for(get_entry("DeepseekV2ForCausalLM")).kv_pool == "mla"
    assert adapter_for(get_entry("Qwen3ForCausalLM")).attention == "MHA"
    assert layer_index("model.layers.11.self_attn.attn") == 11
    with pytest.raises(ValueError):
        layer_index("lm_head")
    assert atom_sliding_window(-1) is None and atom_sliding_window(7) == 8


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
