"""The native engine with kv_cache_dtype="fp8": twice the KV tokens of a bf16 cache for the
same budget, logits close to the model-dtype cache, the checkpoint's per-layer scales, and
one clear error for each combination it does not run."""

from __future__ import annotations

import argparse
import logging

import pytest
import torch

from atom import LLM
from atom.cli import add_engine_args, engine_kwargs
from atom.config import ConfigError
from atom.engine.model_runner import check_fp8_kv_cache
from atom.engine.step_arrays import StepInput
from atom.kernels.policy import selected_backend
from atom.layers.mla_impl import NativeMLAImpl
from atom.layers.paged_attention_impl import NativeAttentionImpl
from atom.testing.kv_scales import K_SCALE, V_SCALE, write_with_kv_scales
from tests.models.harness import make_prompts, write_checkpoint
from tests.models.test_deepseek import v2_config
from tests.models.test_llama import qwen3_config

KV_BYTES = 1 << 20
# fp8 e4m3 rounds each K/V element by up to 2^-4 relative. Through this tiny random Qwen3
# (2 layers, fp32) the logits move by ~6% of their largest magnitude (0.21 of 3.5, measured
# 2026-11-25); the bound, 15%, still catches a lost or wrong scale (with scales that
# saturate V the logits moved by ~90%).
LOGITS_RTOL = 0.15
# DeepSeek-V2's latents are keys and values at once and feed W_UK and W_UV, so the rounding
# shows more: 6-23% of the largest logit across the checkpoints transformers 5.12 / 5.24
# draw (measured 2026-11-25); scales that saturate the latents move them by ~120%.
MLA_LOGITS_RTOL = 0.35
# GPU (Triton) against CPU (torch reference), both fp8: the same quantized cache up to rare
# one-step rounding flips where fp32 K/V differ in the last bit.
GPU_RTOL = 1e-2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(qwen3_config(), tmp_path_factory.mktemp("qwen3"), init_std=0.1)


@pytest.fixture(scope="module")
def scaled_checkpoint(checkpoint, tmp_path_factory):
    return write_with_kv_scales(checkpoint, tmp_path_factory.mktemp("qwen3-kv-scales"))


def engine(folder, **kwargs) -> LLM:
    kwargs = {"dtype": "float32", "kv_cache_memory_bytes": KV_BYTES, **kwargs}
    return LLM(model=str(folder), skip_tokenizer_init=True, **kwargs)


def prefill_and_decode_logits(llm: LLM, prompt: list[int], decoded: list[int]) -> torch.Tensor:
    """Logits of every prompt token, then of each decode step (which reads the cache)."""
    runner = llm.engine.executor.runner
    total = len(prompt) + len(decoded)
    table = list(range(-(-total // llm.engine.config.cache.block_size)))
    logits = [runner.run([StepInput(prompt, 0, [table])], all_positions=True)]
    for i, token in enumerate(decoded):
        logits.append(runner.run([StepInput([token], len(prompt) + i, [table])]))
    return torch.cat(logits)


def relative_logits_gap(folder) -> float:
    """Largest logit change from the fp8 cache, relative to the largest logit."""
    prompt, decoded = make_prompts(256, [29, 6], seed=4)
    want = prefill_and_decode_logits(engine(folder), prompt, decoded)
    got = prefill_and_decode_logits(engine(folder, kv_cache_dtype="fp8"), prompt, decoded)
    return ((got - want).abs().max() / want.abs().max()).item()


def test_fp8_logits_close_to_model_dtype_cache(checkpoint, caplog):
    with caplog.at_level(logging.INFO, logger="atom.engine.model_runner"):
        gap = relative_logits_gap(checkpoint)
    assert 0 < gap < LOGITS_RTOL
    messages = [r.getMessage() for r in caplog.records]
    assert any("k_scale = v_scale = 1.0 in every layer" in m for m in messages)


def test_checkpoint_scales_are_loaded_and_used(scaled_checkpoint, caplog):
    llm = engine(scaled_checkpoint, kv_cache_dtype="fp8")
    impls = [m for m in llm.engine.model.modules() if isinstance(m, NativeAttentionImpl)]
    scales = [(i.k_scale, i.v_scale) for i in impls]
    assert scales == [pytest.approx((K_SCALE, V_SCALE))] * 2  # fp32 in the checkpoint
    with caplog.at_level(logging.INFO, logger="atom.engine.model_runner"):
        gap = relative_logits_gap(scaled_checkpoint)
    assert 0 < gap < LOGITS_RTOL
    assert not any("k_scale = v_scale = 1.0" in r.getMessage() for r in caplog.records)


def test_model_dtype_cache_ignores_checkpoint_scales(checkpoint, scaled_checkpoint):
    prompt, decoded = make_prompts(256, [11, 3], seed=5)
    plain = prefill_and_decode_logits(engine(checkpoint), prompt, decoded)
    scaled = prefill_and_decode_logits(engine(scaled_checkpoint), prompt, decoded)
    assert torch.equal(plain, scaled)


def test_fp8_cache_holds_twice_the_tokens_of_bf16(checkpoint, caplog):
    auto = engine(checkpoint, dtype="bfloat16")
    with caplog.at_level(logging.INFO, logger="atom.engine.llm_engine"):
        fp8 = engine(checkpoint, dtype="bfloat16", kv_cache_dtype="fp8_e4m3")
    auto_blocks, fp8_blocks = auto.engine.executor.num_blocks, fp8.engine.executor.num_blocks
    assert fp8_blocks in (2 * auto_blocks, 2 * auto_blocks + 1)
    block_size = fp8.engine.config.cache.block_size
    line = f"KV cache: {fp8_blocks} blocks of {block_size} tokens = {fp8_blocks * block_size}"
    assert any(line in r.getMessage() and "float8_e4m3fn" in r.getMessage() for r in caplog.records)
    cache = fp8.engine.model.model.layers[0].self_attn.attn.impl.key_cache
    assert cache.dtype == torch.float8_e4m3fn


@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cuda-graphs"])
def test_gpu_fp8_matches_cpu_fp8(scaled_checkpoint, enforce_eager):
    prompt, decoded = make_prompts(256, [29, 6], seed=4)
    cpu = engine(scaled_checkpoint, kv_cache_dtype="fp8")
    gpu = engine(
        scaled_checkpoint, kv_cache_dtype="fp8", device="cuda", enforce_eager=enforce_eager
    )
    assert selected_backend("paged_attention", "cuda") == "triton"
    assert (gpu.engine.executor.runner.decode_graphs is None) == enforce_eager
    want = prefill_and_decode_logits(cpu, prompt, decoded)
    got = prefill_and_decode_logits(gpu, prompt, decoded).cpu()
    assert ((got - want).abs().max() / want.abs().max()).item() < GPU_RTOL


def test_cli_passes_the_option():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args(["m"]))["kv_cache_dtype"] == "auto"
    args = parser.parse_args(["m", "--kv-cache-dtype", "fp8"])
    assert engine_kwargs(args)["kv_cache_dtype"] == "fp8"


def test_unknown_kv_cache_dtype(checkpoint):
    with pytest.raises(ConfigError, match=r"kv_cache_dtype='int8' is not supported.*'fp8'"):
        engine(checkpoint, kv_cache_dtype="int8")


def test_mla_fp8_latent_cache(tmp_path):
    """DeepSeek-V2's latent cache in fp8: logits close to the model-dtype cache, with the
    checkpoint's k_scale as the latent rows' scale (layer 0: vLLM's name, layer 1:
    compressed-tensors')."""
    folder = write_checkpoint(v2_config(), tmp_path / "deepseek", init_std=0.1)
    assert 0 < relative_logits_gap(folder) < MLA_LOGITS_RTOL
    scaled = write_with_kv_scales(folder, tmp_path / "deepseek-kv-scales")
    llm = engine(scaled, kv_cache_dtype="fp8")
    impls = [m for m in llm.engine.model.modules() if isinstance(m, NativeMLAImpl)]
    assert [impl.k_scale for impl in impls] == [pytest.approx(K_SCALE)] * 2
    assert impls[0].kv_cache.dtype == torch.float8_e4m3fn
    assert 0 < relative_logits_gap(scaled) < MLA_LOGITS_RTOL


def test_fp8_on_a_gpu_without_fp8_kernels(checkpoint, monkeypatch):
    model = engine(checkpoint).engine.model
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ConfigError, match=r"kv_cache_dtype='fp8'.*8\.9.*NVIDIA A100"):
        check_fp8_kv_cache(model, torch.device("cuda"))
