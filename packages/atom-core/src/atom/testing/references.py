"""Independent references for the engine tests: random token-id prompts and HF
transformers' greedy tokens (a full forward per step, no cache, no EOS stop)."""

from __future__ import annotations

import random
from pathlib import Path

from atom.testing.tiny_configs import tiny_fields

VOCAB = tiny_fields("LlamaForCausalLM")["vocab_size"]  # every tiny architecture's


def random_prompts(lengths: list[int], seed: int, vocab: int = VOCAB) -> list[list[int]]:
    """Prompts of the given lengths; ids from 3 up (below are often special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def hf_greedy(
    model_dir: str | Path, prompts: list[list[int]], max_tokens: int, device: str = "cpu"
) -> list[list[int]]:
    """HF transformers' greedy continuation of each prompt, in fp32 (a multimodal
    checkpoint's whole model where transformers has no causal LM for it: Kimi-K2.5)."""
    import torch

    from atom.testing.hf_references import hf_causal_lm_class

    hf = hf_causal_lm_class(model_dir).from_pretrained(model_dir, dtype=torch.float32)
    hf = hf.to(device).eval()
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(max_tokens):
                logits = hf(input_ids=torch.tensor([ids], device=device)).logits
                ids.append(int(logits[0, -1].argmax()))
            outputs.append(ids[len(prompt) :])
    return outputs
