"""atom_sglang.patches: the SGLang names each change relies on, and each change in-process."""

from __future__ import annotations

import pkgutil

import pytest

import atom_sglang


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
        # Changes 9 and 10: the DSA test SGLang asks and the model config it derives.
        "sglang.srt.configs.model_config:is_deepseek_dsa",
        "sglang.srt.configs.model_config:ModelConfig._derive_model_shapes",
        "sglang.srt.plugins.hook_registry:HookType.AFTER",
        # The launch check (atom_sglang.guard): the resolution step it wraps.
        "sglang.srt.arg_groups.resolution_hooks:register_resolution_hook",
        "sglang.srt.arg_groups.platform_hook:handle_hardware_runtime_validation",
    ],
)
def test_sglang_names_the_patches_rely_on_exist(name):
    assert pkgutil.resolve_name(name) is not None


# Change 1 by SGLang version: SGLang's own `support_triton("atom")` on its CPU engine. 0.5.21
# answers by the backend's name (True: the hook is needed); 0.5.23 first asks its platform,
# which has no Triton on CPU (False: no hook).
SGLANG_SUPPORT_TRITON_ON_CPU = {"0.5.21": True, "0.5.23": False}


def test_support_triton_hook_only_where_sglang_answers_by_name(fresh_plugin):
    """Change 1 is registered on the CPU engine only where SGLang would let "atom" launch
    Triton kernels there; with it, "atom" is Triton-free and other names keep SGLang's
    answer. A version missing from the table has not been checked."""
    from packaging.version import Version
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.utils.common import is_cpu, support_triton

    from atom_sglang.patches import SUPPORT_TRITON, _support_triton_on_cpu

    version = Version(atom_sglang.sglang_version()).base_version
    assert version in SGLANG_SUPPORT_TRITON_ON_CPU, f"change 1 not checked on SGLang {version}"
    assert is_cpu()
    assert support_triton("atom") is SGLANG_SUPPORT_TRITON_ON_CPU[version]
    assert support_triton("torch_native") is False
    atom_sglang.register()
    hooks = HookRegistry._hooks.get(SUPPORT_TRITON, [])
    assert len(hooks) == SGLANG_SUPPORT_TRITON_ON_CPU[version]
    assert _support_triton_on_cpu(support_triton, "atom") is False
    assert _support_triton_on_cpu(support_triton, "triton") is support_triton("triton")


def test_served_sparse_models_skip_sglang_dsa_path_and_widen_mla_rows():
    """Changes 9 and 10 for a DeepSeek-V3.2 config ATOM serves: SGLang's DSA test says no
    (so its plain MLA pool and ATOM's backend serve it) and the MLA row grows by the
    indexer key; an architecture ATOM does not serve keeps SGLang's answers."""
    from types import SimpleNamespace

    from sglang.srt.configs.model_config import is_deepseek_dsa

    from atom.testing import tiny_config
    from atom_sglang.patches import not_served_by_sglang, pool_rows_for_atom

    config = tiny_config("DeepseekV32ForCausalLM")
    assert is_deepseek_dsa(config)
    assert not not_served_by_sglang(["DeepseekV32ForCausalLM"])(is_deepseek_dsa, config)
    assert not_served_by_sglang(["GlmMoeDsaForCausalLM"])(is_deepseek_dsa, config)

    def model_config():
        return SimpleNamespace(hf_config=config, hf_text_config=config, kv_lora_rank=64)

    widened, kept = model_config(), model_config()
    pool_rows_for_atom(["DeepseekV32ForCausalLM"])(None, widened)
    pool_rows_for_atom(["DeepseekV3ForCausalLM"])(None, kept)
    assert (widened.kv_lora_rank, kept.kv_lora_rank) == (64 + config.index_head_dim, 64)


def test_served_deepseek_v4_skips_sglang_v4_path_and_gets_packed_mla_rows():
    """Changes 11 and 12 for a DeepSeek-V4 config ATOM serves: SGLang's V4 test says no,
    and its pool becomes MLA rows as wide as the widest layer's packed page at page size 1:
    the CSA layer's K = V (32), compressor and indexer rows (2 x 128: kv | gate, both
    overlapped) and one entry of each (32 + 32). Unserved, SGLang's answers stay."""
    from types import SimpleNamespace

    from sglang.srt.configs.model_config import AttentionArch, is_deepseek_v4

    from atom.testing import tiny_config
    from atom_sglang.patches import not_served_by_sglang, pool_rows_for_atom

    arch = "DeepseekV4ForCausalLM"
    config = tiny_config(arch)
    assert is_deepseek_v4(config)
    assert not not_served_by_sglang([arch])(is_deepseek_v4, config)
    assert not_served_by_sglang(["DeepseekV3ForCausalLM"])(is_deepseek_v4, config)

    def model_config():
        return SimpleNamespace(
            hf_config=config, hf_text_config=config, attention_arch=AttentionArch.MHA,
            qk_rope_head_dim=16,
        )  # fmt: skip

    packed, kept = model_config(), model_config()
    pool_rows_for_atom([arch])(None, packed)
    pool_rows_for_atom(["DeepseekV3ForCausalLM"])(None, kept)
    assert packed.attention_arch == AttentionArch.MLA
    assert packed.kv_lora_rank + packed.qk_rope_head_dim == 32 + 2 * 128 + 32 + 32
    assert kept.attention_arch == AttentionArch.MHA and not hasattr(kept, "kv_lora_rank")


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


def test_served_deepseek_v4_gets_no_sglang_swa_pool_and_no_sglang_v4_defaults():
    """Changes 13 and 14: for DeepSeek-V4 while ATOM serves it, SGLang's hybrid-SWA test
    says no, its model-override declarations are left out and its V4 defaults step does
    nothing; other architectures (GPT-OSS's sliding pool) keep SGLang's answers."""
    from sglang.srt.arg_groups.overrides import collect_model_override_declarations
    from sglang.srt.configs.model_config import is_hybrid_swa_model

    from atom_sglang.patches import not_hybrid_swa, skip_own_defaults, without_own_declarations

    v4, gpt_oss = "DeepseekV4ForCausalLM", "GptOssForCausalLM"
    served = [v4, gpt_oss]
    assert is_hybrid_swa_model([v4]) and is_hybrid_swa_model([gpt_oss])
    assert not not_hybrid_swa(served)(is_hybrid_swa_model, [v4])
    assert not_hybrid_swa(served)(is_hybrid_swa_model, [gpt_oss])
    assert not_hybrid_swa([gpt_oss])(is_hybrid_swa_model, [v4])

    asked = []

    def sglang_declarations(architecture, *args):
        asked.append(architecture)
        return [("SGLang's", {"page_size": 256})]

    assert without_own_declarations(served)(sglang_declarations, v4, None, None) == []
    assert without_own_declarations(served)(sglang_declarations, gpt_oss, None, None)
    assert without_own_declarations([gpt_oss])(sglang_declarations, v4, None, None)
    assert asked == [gpt_oss, v4]
    assert collect_model_override_declarations.__name__ == "collect_model_override_declarations"

    def sglang_defaults(server_args, model_arch):
        asked.append(model_arch)

    skip_own_defaults(served)(sglang_defaults, None, v4)
    skip_own_defaults([gpt_oss])(sglang_defaults, None, v4)
    assert asked == [gpt_oss, v4, v4]
