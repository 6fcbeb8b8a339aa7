"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`.

This version runs one batch at a time: all prompts are prefilled together, then decoded
together over a simple paged KV pool until every sequence has finished.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from atom.config import ConfigError, ModelConfig
from atom.engine.model_runner import (
    ModelRunner,
    StepInput,
    allocate_kv_cache,
    build_model,
    kv_cache_bytes_per_block,
)
from atom.engine.outputs import CompletionOutput, RequestOutput
from atom.engine.sampler import Sampler
from atom.sampling_params import SamplingParams

Prompt = str | list[int]


@dataclass
class _Sequence:
    request_index: int
    completion_index: int
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    block_table: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str = ""

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)


class LLM:
    def __init__(
        self,
        model: str,
        dtype: str | torch.dtype | None = None,
        device: str = "cpu",
        max_model_len: int | None = None,
        block_size: int = 16,
        kv_cache_memory_bytes: int | None = None,
        skip_tokenizer_init: bool = False,
        seed: int = 0,
    ):
        self.model_config = ModelConfig.from_pretrained(
            model, dtype=dtype, max_model_len=max_model_len
        )
        self.device = torch.device(device)
        self.block_size = block_size
        self.kv_cache_memory_bytes = kv_cache_memory_bytes
        self.tokenizer = None if skip_tokenizer_init else _load_tokenizer(model)
        self.model = build_model(self.model_config, self.device)
        self.runner = ModelRunner(self.model, block_size, self.device)
        self.sampler = Sampler(seed)
        self.eos_token_ids = _eos_ids(self.model_config.hf_config, self.tokenizer)
        self._num_blocks = 0

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} sampling params for {len(prompts)} prompts")
        prompt_ids = [self._encode(p) for p in prompts]
        seqs = [
            _Sequence(i, j, ids, p, _generator(p, j))
            for i, (ids, p) in enumerate(zip(prompt_ids, params_list))
            for j in range(p.n)
        ]
        self._reserve_cache(seqs)
        self._run(seqs, use_tqdm)
        return [
            RequestOutput(
                request_id=str(i),
                prompt=prompt if isinstance(prompt, str) else None,
                prompt_token_ids=prompt_ids[i],
                outputs=[self._completion(s) for s in seqs if s.request_index == i],
            )
            for i, prompt in enumerate(prompts)
        ]

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    "text prompts need a tokenizer; pass token ids with skip_tokenizer_init"
                )
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        vocab = self.model_config.hf_config.vocab_size
        if not ids:
            raise ValueError("prompt is empty")
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if len(ids) >= self.model_config.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens; max_model_len is {self.model_config.max_model_len}"
            )
        return ids

    def _max_len(self, seq: _Sequence) -> int:
        limit = self.model_config.max_model_len
        if seq.params.max_tokens is not None:
            limit = min(limit, len(seq.prompt_ids) + seq.params.max_tokens)
        return limit

    def _reserve_cache(self, seqs: list[_Sequence]) -> None:
        pages = [-(-self._max_len(s) // self.block_size) for s in seqs]
        needed = sum(pages)
        if self.kv_cache_memory_bytes is not None:
            per_block = kv_cache_bytes_per_block(
                self.model, self.block_size, self.model_config.dtype
            )
            budget = self.kv_cache_memory_bytes // per_block
            if needed > budget:
                raise ConfigError(
                    f"this batch needs {needed} KV blocks; kv_cache_memory_bytes allows {budget}"
                )
        if needed > self._num_blocks:
            allocate_kv_cache(
                self.model, needed, self.block_size, self.model_config.dtype, self.device
            )
            self._num_blocks = needed
        start = 0
        for seq, n in zip(seqs, pages):
            seq.block_table = list(range(start, start + n))
            start += n

    def _run(self, seqs: list[_Sequence], use_tqdm: bool) -> None:
        bar = tqdm(total=len(seqs), desc="Generating", disable=not use_tqdm, unit="seq")
        logits = self.runner.run([StepInput(s.prompt_ids, 0, s.block_table) for s in seqs])
        active = self._sample(seqs, logits, bar)
        while active:
            logits = self.runner.run(
                [StepInput([s.output_ids[-1]], s.num_tokens - 1, s.block_table) for s in active]
            )
            active = self._sample(active, logits, bar)
        bar.close()

    def _sample(self, seqs: list[_Sequence], logits: torch.Tensor, bar) -> list[_Sequence]:
        still_running = []
        for seq, row in zip(seqs, logits):
            blocked = self.eos_token_ids if len(seq.output_ids) < seq.params.min_tokens else ()
            result = self.sampler.sample(
                row, seq.params, seq.prompt_ids, seq.output_ids, seq.generator, blocked
            )
            seq.output_ids.append(result.token_id)
            seq.cumulative_logprob += result.logprob
            if result.top_logprobs is not None:
                seq.logprobs.append(result.top_logprobs)
            self._check_stop(seq)
            if seq.finish_reason is None:
                still_running.append(seq)
            else:
                bar.update(1)
        return still_running

    def _check_stop(self, seq: _Sequence) -> None:
        token, params = seq.output_ids[-1], seq.params
        if params.detokenize and self.tokenizer is not None:
            seq.text = self.tokenizer.decode(
                seq.output_ids, skip_special_tokens=params.skip_special_tokens
            )
        if len(seq.output_ids) >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", None
                return
            if token in params.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", token
                return
            for stop in params.stop:
                cut = seq.text.find(stop)
                if cut >= 0:
                    seq.text = seq.text[:cut]
                    seq.finish_reason, seq.stop_reason = "stop", stop
                    return
        if seq.num_tokens >= self._max_len(seq):
            seq.finish_reason = "length"

    def _completion(self, seq: _Sequence) -> CompletionOutput:
        return CompletionOutput(
            index=seq.completion_index,
            text=seq.text,
            token_ids=list(seq.output_ids),
            cumulative_logprob=seq.cumulative_logprob,
            logprobs=seq.logprobs if seq.params.logprobs is not None else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )


def _generator(params: SamplingParams, index: int) -> torch.Generator | None:
    if params.seed is None:
        return None
    return torch.Generator().manual_seed(params.seed + index)


def _load_tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"cannot load a tokenizer from {path!r} ({exc}); pass skip_tokenizer_init=True "
            "to run token-id prompts without one"
        ) from exc


def _eos_ids(hf_config, tokenizer) -> set[int]:
    ids = getattr(hf_config, "eos_token_id", None)
    ids = set(ids if isinstance(ids, list) else [] if ids is None else [ids])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


__all__ = ["LLM"]
