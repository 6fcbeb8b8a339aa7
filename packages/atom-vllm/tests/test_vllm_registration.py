"""Registration and the version guard: what register() leaves in vLLM's registries, the
switch, the tested range and the wrapper classes (in-process, no engine)."""

from __future__ import annotations

import logging

import pytest
from vllm import ModelRegistry
from vllm.model_executor.models.interfaces import supports_lora
from vllm.model_executor.models.interfaces_base import is_text_generation_model
from vllm.v1.attention.backends.registry import AttentionBackendEnum

import atom_vllm
from atom.registry import supported_architectures
from atom_vllm import model as model_module
from atom_vllm.backend import (
    AtomAttentionBackend,
)
from atom_vllm.config import UnsupportedVllmFeature


def test_register_serves_every_vllm_capable_architecture(fresh_plugin, caplog, capsys):
    with caplog.at_level(logging.INFO, logger="vllm.atom_vllm"):
        atom_vllm.register()
    served = atom_vllm.served_architectures()
    assert set(served) <= set(supported_architectures("vllm"))
    assert {"LlamaForCausalLM", "Qwen3ForCausalLM"} <= set(served)
    for arch in served:
        lazy = ModelRegistry.models[arch]
        assert (lazy.module_name, lazy.class_name) == ("atom_vllm.model", arch)
    # vLLM's MTP draft architectures of the targets ATOM serves: ATOM's drafter.
    for draft, targets in atom_vllm.MTP_DRAFT_ARCHITECTURES.items():
        lazy = ModelRegistry.models[draft]
        drafter = f"{lazy.module_name}:{lazy.class_name}"
        assert (drafter == atom_vllm.MTP_DRAFTER_CLASS) == bool(set(targets) & set(served))
    assert AttentionBackendEnum.CUSTOM.get_path() == "atom_vllm.backend.AtomAttentionBackend"
    assert AttentionBackendEnum.CUSTOM.get_class() is AtomAttentionBackend
    assert AttentionBackendEnum[AtomAttentionBackend.get_name()] is AttentionBackendEnum.CUSTOM
    # Through vLLM's logger once vLLM has configured logging, to stderr before.
    said = capsys.readouterr().err + "".join(r.getMessage() for r in caplog.records)
    assert "serves LlamaForCausalLM" in said


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


def test_wrapper_classes_carry_vllm_own_lora_interface():
    """vLLM 0.33 refuses enable_lora unless the registered class supports LoRA; the run
    then builds vLLM's own class, whose packed modules the registered class carries."""
    for arch in atom_vllm.served_architectures():
        cls = getattr(model_module, arch)
        try:
            own = model_module.vllm_model_class(arch)
        except (UnsupportedVllmFeature, ImportError):
            assert not supports_lora(cls), arch
            continue
        assert supports_lora(cls) == supports_lora(own), arch
        if supports_lora(own):
            assert cls.packed_modules_mapping == own.packed_modules_mapping
            assert cls.embedding_modules == own.embedding_modules
    assert supports_lora(model_module.LlamaForCausalLM)


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
