"""The engine loop: admit requests, schedule a step, run the model, sample, emit outputs."""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

import torch

from atom.config import EngineConfig
from atom.engine.block_manager import BlockManager
from atom.engine.detokenizer import Detokenizer, find_stop_string
from atom.engine.executor import Executor
from atom.engine.outputs import CompletionOutput, RequestOutput
from atom.engine.sampler import Sampler, prompt_logprob_entries
from atom.engine.scheduler import Scheduler
from atom.engine.sequence import Sequence
from atom.engine.step_arrays import StepInput
from atom.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    seqs: list[Sequence]


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer=None):
        self.config = config
        self.tokenizer = tokenizer
        self.detokenizer = Detokenizer(tokenizer)
        self.executor = Executor(config)
        self.model = self.executor.model
        self.block_manager = BlockManager(
            self.executor.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens
        )
        self.sampler = Sampler()
        self.eos_token_ids = _eos_ids(config.model.hf_config, tokenizer)
        self.requests: dict[str, _Request] = {}
        self._request_counter = itertools.count()
        logger.info(
            "KV cache: %d blocks of %d tokens", self.executor.num_blocks, config.cache.block_size
        )

    # Requests -----------------------------------------------------------------------

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    "text prompts need a tokenizer; pass token ids with skip_tokenizer_init"
                )
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def validate_prompt(self, ids: list[int], params: SamplingParams) -> None:
        vocab = self.config.model.hf_config.vocab_size
        max_len = self.config.model.max_model_len
        if not ids:
            raise ValueError("prompt is empty")
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if len(ids) >= max_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is {max_len}")
        capacity = self.block_manager.num_blocks * self.block_manager.block_size
        if min(max_len, len(ids) + (params.max_tokens or max_len)) > capacity:
            raise ValueError(
                f"a sequence of up to {min(max_len, len(ids) + (params.max_tokens or max_len))} tokens "
                f"does not fit the KV cache ({capacity} tokens); lower max_tokens or enlarge the cache"
            )

    def add_request(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> str:
        request_id = request_id if request_id is not None else str(next(self._request_counter))
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.encode(prompt)
        self.validate_prompt(ids, params)
        seqs = [Sequence(ids, params, request_id, i) for i in range(params.n)]
        self.requests[request_id] = _Request(
            request_id, prompt if isinstance(prompt, str) else None, ids, seqs
        )
        for seq in seqs:
            if params.prompt_logprobs is not None:
                seq.prompt_logprobs = [None]
            self.scheduler.add(seq)
        return request_id

    def abort_request(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        for seq in request.seqs:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # The step -------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """Runs one scheduled batch; returns the current output of each request it touched
        (only of those it finished, with finished_only: the offline API needs no more)."""
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        plan = _StepPlan(batch.seqs, batch.num_new_tokens)
        logits = self.executor.execute(plan.inputs, plan.rows)
        block_manager = self.block_manager
        hashing = block_manager.enable_prefix_caching
        block_size = block_manager.block_size
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            if hashing and seq.num_computed_tokens // block_size > seq.num_hashed_blocks:
                block_manager.register_full_blocks(seq)
        for seq, first, last, row in plan.prompt_logprobs:
            rows = logits[row : row + last - first]
            targets = seq.token_ids[first + 1 : last + 1]
            seq.prompt_logprobs += prompt_logprob_entries(rows, targets, seq.params.prompt_logprobs)
        if plan.samples:
            self._append_tokens(plan.samples, logits, plan.sample_rows)
        outputs = []
        for request_id in dict.fromkeys(seq.request_id for seq in batch.seqs):
            request = self.requests[request_id]
            if not finished_only or all(s.is_finished for s in request.seqs):
                outputs.append(self._output(request))
        return outputs

    def _append_tokens(self, seqs: list[Sequence], logits: torch.Tensor, rows: list[int]) -> None:
        if len(rows) != logits.shape[0]:
            logits = logits[torch.tensor(rows).to(logits.device, non_blocking=True)]
        blocked = [
            self.eos_token_ids if seq.num_output_tokens < seq.params.min_tokens else ()
            for seq in seqs
        ]
        for seq, result in zip(seqs, self.sampler.sample(logits, seqs, blocked)):
            seq.token_ids.append(result.token_id)
            seq.cumulative_logprob += result.logprob
            if result.top_logprobs is not None:
                seq.logprobs.append(result.top_logprobs)
            self._check_stop(seq, result.token_id)
            if seq.finish_reason is not None:
                # Flush text held back as incomplete, unless a stop string already cut it
                # short (re-decoding would bring the stop string back).
                if not isinstance(seq.stop_reason, str):
                    self.detokenizer.update(seq)
                self.scheduler.finish(seq)

    def _check_stop(self, seq: Sequence, token: int) -> None:
        params = seq.params
        new_chars = len(self.detokenizer.update(seq)) if params.detokenize else 0
        if seq.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                seq.finish_reason = "stop"
                return
            if token in params.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", token
                return
            stop = find_stop_string(seq, new_chars) if params.stop else None
            if stop is not None:
                seq.finish_reason, seq.stop_reason = "stop", stop
                return
        limit = self.config.model.max_model_len
        if params.max_tokens is not None:
            limit = min(limit, seq.num_prompt_tokens + params.max_tokens)
        if seq.num_tokens >= limit:
            seq.finish_reason = "length"

    def _output(self, request: _Request) -> RequestOutput:
        finished = all(s.is_finished for s in request.seqs)
        if finished:
            self.requests.pop(request.request_id, None)
        first = request.seqs[0]
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_ids,
            outputs=[_completion(s) for s in request.seqs],
            prompt_logprobs=first.prompt_logprobs,
            finished=finished,
            num_cached_tokens=first.num_cached_tokens,
        )

    def shutdown(self) -> None:
        self.executor.shutdown()

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_free_blocks=bm.num_free_blocks,
            num_blocks=bm.num_blocks,
            kv_cache_usage=bm.usage,
            prefix_cache_queries=bm.prefix_queries,
            prefix_cache_hits=bm.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
        )


class _StepPlan:
    """A step's model inputs and which hidden rows need logits, in ascending order: the
    prompt positions of sequences that asked for prompt logprobs, and the last token of
    every sequence this step completes (it samples its next token)."""

    def __init__(self, seqs: list[Sequence], num_new_tokens: list[int]):
        self.inputs: list[StepInput] = []
        self.rows: list[int] = []
        self.prompt_logprobs: list[tuple[Sequence, int, int, int]] = []  # seq, first, last, row
        self.samples: list[Sequence] = []
        self.sample_rows: list[int] = []  # indexes into rows
        offset = 0
        for seq, n in zip(seqs, num_new_tokens):
            start = seq.num_computed_tokens
            self.inputs.append(StepInput(seq.token_ids[start : start + n], start, seq.block_table))
            if seq.prompt_logprobs is not None:
                # Positions whose next prompt token has no entry yet (a preempted sequence
                # recomputes positions it already recorded).
                first = max(start, len(seq.prompt_logprobs) - 1)
                last = min(start + n, seq.num_prompt_tokens - 1)
                if first < last:
                    self.prompt_logprobs.append((seq, first, last, len(self.rows)))
                    self.rows += range(offset + first - start, offset + last - start)
            if start + n == len(seq.token_ids):
                self.sample_rows.append(len(self.rows))
                self.rows.append(offset + n - 1)
                self.samples.append(seq)
            offset += n


def _completion(seq: Sequence) -> CompletionOutput:
    return CompletionOutput(
        index=seq.completion_index,
        text=seq.text,
        token_ids=list(seq.output_ids),
        cumulative_logprob=seq.cumulative_logprob,
        logprobs=seq.logprobs if seq.params.logprobs is not None else None,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
    )


def _eos_ids(hf_config, tokenizer) -> set[int]:
    ids = getattr(hf_config, "eos_token_id", None)
    ids = set(ids if isinstance(ids, list) else [] if ids is None else [ids])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
