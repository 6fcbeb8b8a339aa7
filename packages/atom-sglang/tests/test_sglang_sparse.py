"""DeepSeek-V3.2, GLM-5 (DeepSeek Sparse Attention) and Kimi-K2.5's text model on
SGLang's CPU engine (0.5.21, 0.5.23) with atom-sglang, against independent references.

The tiny DSA configs keep the top 8 tokens per query; the rounds' prompts run to 130
tokens (16x that), are prefilled in chunks of 64, and the 48-token shared prefix
(indexer keys included, in the MLA pool's rows) comes from SGLang's radix cache. SGLang's
own DSA path does not run on its CPU engine (its argument resolution asks CUDA for the
device capability), so atom-sglang keeps these models off it (`atom_sglang.patches`,
changes 9 and 10) and the references are:

* DeepSeek-V3.2: HF transformers' greedy decoding of the same checkpoint.
* GLM-5: ATOM's native engine on the same checkpoint (SGLang 0.5.21 pins transformers 5.12.1,
  whose GLM-MoE-DSA indexer rotates half-split pairs where GLM-5 rotates interleaved
  ones; the core suite holds the native engine equal to a transformers that has it right).
* Kimi-K2.5: transformers 5.12.1 has no Kimi-K2.5, so the checkpoint is DeepSeek-V3's
  tiny one in Kimi-K2.5's released layout (`language_model.*` tensors, the text config
  under `text_config`, architecture KimiK25ForConditionalGeneration), and the
  reference is HF's greedy decoding of that DeepSeek-V3 checkpoint. SGLang runs it with
  `enable_multimodal=False` (the tiny checkpoint has no image processor).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from sglang_harness import ENGINE, MAX_TOKENS, PREFIX_LEN, Run, result_of, rounds, run_jobs

from atom.testing import hf_greedy, tiny_config
from atom_sglang import served_architectures

pytestmark = pytest.mark.slow

ATOM = {**ENGINE, "attention_backend": "atom"}
V32, GLM5, KIMI = (
    "DeepseekV32ForCausalLM",
    "GlmMoeDsaForCausalLM",
    "KimiK25ForConditionalGeneration",
)
SEEDS = {V32: 50, GLM5: 51, KIMI: 52}
LATENT_ROW = tiny_config(V32).kv_lora_rank + tiny_config(V32).qk_rope_head_dim  # fp32
INDEX_KEY = tiny_config(V32).index_head_dim


def released_kimi_k25(deepseek_v3: Path, folder: Path) -> Path:
    """`deepseek_v3`'s checkpoint as Kimi-K2.5's released checkpoints lay out their text
    model (no vision tower: ATOM skips it anyway)."""
    folder.mkdir(parents=True, exist_ok=True)
    text_config = json.loads((deepseek_v3 / "config.json").read_text())
    config = {
        "architectures": [KIMI],
        "model_type": "kimi_k25",
        "text_config": text_config,
        "dtype": text_config.get("dtype", "float32"),
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for shard in deepseek_v3.glob("*.safetensors"):
        tensors = {f"language_model.{name}": t for name, t in load_file(shard).items()}
        save_file(tensors, folder / shard.name, metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def kimi_checkpoint(checkpoints, tmp_path_factory):
    return released_kimi_k25(
        checkpoints("DeepseekV3ForCausalLM"), tmp_path_factory.mktemp("kimi-k25")
    )


@pytest.fixture(scope="module")
def runs(checkpoints, kimi_checkpoint, tmp_path_factory):
    def run(arch: str, model: Path, **engine) -> Run:
        return Run(arch, model, {**ATOM, **engine}, rounds(SEEDS[arch]))

    jobs = [
        [run(V32, checkpoints(V32)), run(KIMI, kimi_checkpoint, enable_multimodal=False)],
        [run(GLM5, checkpoints(GLM5))],
    ]
    return run_jobs(jobs, tmp_path_factory.mktemp("sglang-sparse"))


def native_greedy(model: Path, prompts: list[list[int]]) -> list[list[int]]:
    from atom import LLM, SamplingParams

    llm = LLM(str(model), dtype="float32", block_size=16, skip_tokenizer_init=True)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def reference(checkpoints, arch: str, prompts: list[list[int]]) -> list[list[int]]:
    if arch == GLM5:
        return native_greedy(checkpoints(GLM5), prompts)
    model = checkpoints("DeepseekV3ForCausalLM" if arch == KIMI else arch)
    return hf_greedy(model, prompts, MAX_TOKENS)


@pytest.mark.parametrize("arch", [V32, GLM5, KIMI])
def test_greedy_tokens_equal_the_reference_with_chunks_and_prefix_hits(runs, checkpoints, arch):
    assert arch in served_architectures()
    result = result_of(runs, arch)
    for spec in rounds(SEEDS[arch]):
        got = result.tokens()[spec["name"]]
        want = reference(checkpoints, arch, spec["prompts"])
        assert got == want, f"{arch} round {spec['name']!r}: SGLang+ATOM {got} != {want}"
    cached = [r["cached_tokens"] for r in result.rounds["prefix_reuse"]]
    assert all(c >= PREFIX_LEN for c in cached), f"prefix not reused: cached_tokens={cached}"
    assert "built for SGLang: 2 MLA attention layers, kv pool mla" in result.log
    assert "ATOM attention backend: MLA pool" in result.log
    # Per token: both layers' latents (fp32), and the keys of the layers that index
    # (GLM-5's second layer reuses the first one's selection); SGLang's pool rows must be
    # that wide, or ATOM's layer stops (SglangMLAAttention).
    keys = {V32: 2, GLM5: 1, KIMI: 0}[arch] * INDEX_KEY * 4
    line = f"B per token ({2 * LATENT_ROW * 4} B MLA latents + {keys} B indexer keys)"
    assert (line in result.log) == (arch != KIMI)
