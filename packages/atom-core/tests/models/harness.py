"""Checks an ATOM model against HF transformers on a tiny random checkpoint.

The checkpoint is written by the test with transformers; ATOM then loads it from disk
and runs through the paged KV path (scattered pages, small blocks, a mixed batch), and
every logit is compared with HF's full, cache-free forward of the same tokens.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from atom import LLM, SamplingParams
from atom.config import ModelConfig
from atom.engine.kv_groups import attention_impls
from atom.engine.model_runner import ModelRunner, StepInput, allocate_kv_cache, build_model
from atom.engine.state_cache import allocate_state_cache, is_hybrid
from atom.hosts.packed_pages import packed_row_width, unpack_pages
from atom.testing import write_checkpoint  # noqa: F401  (the suites import it from here)
from atom.testing.hf_references import hf_causal_lm_class
from atom.testing.trained_look import randomize_vectors

FP32_ATOL = 1e-4


def check_mtp_layer_skipped(folder: Path, config, caplog) -> None:
    """Appends a multi-token-prediction layer after the last decoder layer, DeepSeek-V3
    style (a copy of the last layer plus eh_proj, enorm / hnorm and a shared head), and
    checks that ATOM skips it with one log line and still gives HF's logits."""
    path = folder / "model.safetensors"
    tensors = load_file(path)
    last, mtp = config.num_hidden_layers - 1, f"model.layers.{config.num_hidden_layers}."
    extra = {
        name.replace(f"model.layers.{last}.", mtp): tensor.clone()
        for name, tensor in tensors.items()
        if name.startswith(f"model.layers.{last}.")
    }
    hidden = config.hidden_size
    extra[f"{mtp}eh_proj.weight"] = torch.zeros(hidden, 2 * hidden)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        extra[f"{mtp}{norm}.weight"] = torch.ones(hidden)
    save_file({**tensors, **extra}, path, metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="atom.models.deepseek_v2"):
        check_against_hf(folder, prompt_lengths=[6], decode_steps=1)
    (line,) = [r.getMessage() for r in caplog.records if "multi-token-prediction" in r.getMessage()]
    skipped = f"skipped the checkpoint's multi-token-prediction layers [{config.num_hidden_layers}]"
    assert f"{config.architectures[0]}: {skipped}" in line


def write_with_random_vectors(config, folder: Path, dtype: torch.dtype = torch.float32) -> Path:
    """A random checkpoint of `config` with matrices of std 0.1 and moved vectors
    (`randomize_vectors`): the form the MoE families' parity tests run."""
    write_checkpoint(config, folder, dtype=dtype, init_std=0.1)
    randomize_vectors(folder)
    return folder


def load_hf(folder: Path, dtype: torch.dtype = torch.float32):
    model = hf_causal_lm_class(folder).from_pretrained(folder, dtype=dtype)
    # Greedy references run to max_new_tokens through EOS, like ignore_eos in ATOM.
    # (min_new_tokens would instead forbid EOS and change the argmax.)
    model.generation_config.eos_token_id = None
    return model.eval()


@torch.inference_mode()
def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    ids = torch.tensor([token_ids])
    return hf_model(input_ids=ids).logits[0].float()


def make_prompts(vocab_size: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in lengths]


class PagedModel:
    """An ATOM model with a KV pool whose pages are handed out in shuffled order."""

    def __init__(
        self,
        folder: Path,
        dtype: torch.dtype = torch.float32,
        block_size: int = 4,
        num_blocks: int = 256,
        ssm_dtype: torch.dtype = torch.float32,
        packed_rows: bool = False,
    ):
        self.config = ModelConfig.from_pretrained(folder, dtype=dtype)
        self.model = build_model(self.config, "cpu", progress=False, ssm_dtype=ssm_dtype)
        allocate_kv_cache(self.model, num_blocks, block_size, dtype, "cpu")
        if packed_rows:
            pack_kv_caches(self.model, num_blocks, block_size, dtype)
        # Hybrid models: one state row per test sequence (row 0 is the engine's scratch).
        self.hybrid = is_hybrid(self.model)
        if self.hybrid:
            allocate_state_cache(self.model, 16, "cpu")
        self.runner = ModelRunner(self.model, block_size, "cpu")
        self.block_size = block_size
        self.free_pages = list(range(num_blocks))
        random.Random(1).shuffle(self.free_pages)

    def state_slots(self, num_seqs: int) -> list[int | None]:
        return list(range(1, num_seqs + 1)) if self.hybrid else [None] * num_seqs

    def pages_for(self, table: list[int], total_tokens: int) -> list[int]:
        while len(table) * self.block_size < total_tokens:
            table.append(self.free_pages.pop())
        return table


def pack_kv_caches(model, num_blocks: int, block_size: int, dtype: torch.dtype) -> None:
    """Rebinds every attention impl to its tensors packed into one row per token, as vLLM
    holds them (atom.hosts.packed_pages), in a buffer whose pages are not adjacent (a
    second layer's page between each two, as in a block-outermost host layout)."""
    for impl in attention_impls(model):
        width = packed_row_width(impl, block_size)
        pages = torch.zeros(num_blocks, 2, block_size, width, dtype=dtype)[:, 1]
        impl.bind_kv_cache(unpack_pages(pages, impl))


def check_against_hf(
    folder: Path,
    prompt_lengths: list[int],
    decode_steps: int = 4,
    dtype: torch.dtype = torch.float32,
    atol: float = FP32_ATOL,
    cached_prefix: int = 0,
    atom_folder: Path | None = None,
    ssm_dtype: torch.dtype = torch.float32,
    packed_rows: bool = False,
    hf_model: torch.nn.Module | None = None,
) -> float:
    """Prefill a mixed batch, then decode steps (all batched); returns the max abs diff.

    With `cached_prefix`, the first prompt's first tokens are run in an earlier step, so
    its prefill reads them back from the paged cache. `atom_folder`: the checkpoint ATOM
    loads, when it differs in form from HF's (e.g. quantized). `ssm_dtype`: what hybrid
    models store their recurrent state in. `packed_rows`: the caches as a host packs them
    into one row per token (`pack_kv_caches`). `hf_model`: the reference, where it is not
    HF's plain model of `folder` (e.g. with the activations quantized as ATOM's kernels do).
    """
    hf = hf_model or load_hf(folder, dtype)
    paged = PagedModel(atom_folder or folder, dtype, ssm_dtype=ssm_dtype, packed_rows=packed_rows)
    vocab = hf.config.get_text_config().vocab_size
    seqs = make_prompts(vocab, prompt_lengths)
    tables = [paged.pages_for([], len(s) + decode_steps) for s in seqs]
    slots = paged.state_slots(len(seqs))
    worst = 0.0

    def compare(atom_logits: torch.Tensor, seq: list[int], positions: slice) -> None:
        nonlocal worst
        expected = hf_logits(hf, seq)[positions]
        diff = (atom_logits - expected).abs().max().item()
        worst = max(worst, diff)
        assert diff <= atol, (
            f"logits differ by {diff} (> {atol}) for a sequence of {len(seq)} tokens"
        )

    start = [0] * len(seqs)
    if cached_prefix:
        paged.runner.run([StepInput(seqs[0][:cached_prefix], 0, [tables[0]], slots[0])])
        start[0] = cached_prefix
    batch = [StepInput(s[start[i] :], start[i], [tables[i]], slots[i]) for i, s in enumerate(seqs)]
    logits = paged.runner.run(batch, all_positions=True)
    offset = 0
    for i, s in enumerate(seqs):
        n = len(s) - start[i]
        compare(logits[offset : offset + n], s, slice(start[i], len(s)))
        offset += n
    next_tokens = logits_to_next(logits, [len(s) - start[i] for i, s in enumerate(seqs)])
    for _ in range(decode_steps):
        batch = []
        for i, s in enumerate(seqs):
            s.append(next_tokens[i])
            batch.append(StepInput([next_tokens[i]], len(s) - 1, [tables[i]], slots[i]))
        logits = paged.runner.run(batch)
        for i, s in enumerate(seqs):
            compare(logits[i : i + 1], s, slice(len(s) - 1, len(s)))
        next_tokens = logits.argmax(-1).tolist()
    return worst


def logits_to_next(logits: torch.Tensor, query_lens: list[int]) -> list[int]:
    ends = torch.tensor(query_lens).cumsum(0) - 1
    return logits[ends].argmax(-1).tolist()


def check_greedy_generation(
    folder: Path,
    prompt_lengths: list[int],
    max_new_tokens: int = 16,
    device: str = "cpu",
    **llm_kwargs,
) -> LLM:
    """ATOM's greedy tokens (batched, paged) equal HF `generate` (on CPU) token for token;
    the engine that gave them."""
    hf = load_hf(folder)
    prompts = make_prompts(hf.config.get_text_config().vocab_size, prompt_lengths, seed=7)
    llm = LLM(
        model=str(folder),
        dtype="float32",
        device=device,
        skip_tokenizer_init=True,
        kv_cache_memory_bytes=64 << 20,
        **llm_kwargs,
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        with torch.inference_mode():
            expected = hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
        assert output.outputs[0].token_ids == expected
    return llm
