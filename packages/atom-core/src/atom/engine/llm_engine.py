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
from atom.engine.model_runner import StepInput
from atom.engine.outputs import CompletionOutput, RequestOutput
from atom.engine.sampler import Sampler
from atom.engine.scheduler import Scheduler
from atom.engine.sequence import Sequence
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
    def step(self) -> list[RequestOutput]:
        """Runs one scheduled batch; returns the current output of each request it touched."""
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        inputs = [
            StepInput(
                seq.token_ids[seq.num_computed_tokens : seq.num_computed_tokens + n],
                seq.num_computed_tokens,
                seq.block_table,
            )
            for seq, n in zip(batch.seqs, batch.num_new_tokens)
        ]
        starts = list(itertools.accumulate((len(x.token_ids) for x in inputs), initial=0))
        rows, owners = self._logit_rows(batch, starts)
        logits = self.executor.execute(inputs, rows)
        touched: dict[str, _Request] = {}
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            seq_rows = [r for r, owner in enumerate(owners) if owner[0] == i]
            start = seq.num_computed_tokens
            seq.num_computed_tokens += n
            self.block_manager.register_full_blocks(seq)
            if seq.prompt_logprobs is not None:
                self._record_prompt_logprobs(
                    seq, start, [(owners[r][1], logits[r]) for r in seq_rows]
                )
            if seq.num_computed_tokens == seq.num_tokens:
                self._append_token(seq, logits[seq_rows[-1]])
            touched[seq.request_id] = self.requests[seq.request_id]
        return [self._output(request) for request in touched.values()]

    def _logit_rows(self, batch, starts: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
        """Hidden-state rows that need logits: each completed sequence's last token, plus
        every prompt position of sequences that asked for prompt logprobs."""
        rows, owners = [], []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            begin = starts[i]
            positions = range(n) if seq.prompt_logprobs is not None else []
            for j in positions:
                if j < n - 1 or seq.num_computed_tokens + n < seq.num_tokens:
                    rows.append(begin + j)
                    owners.append((i, seq.num_computed_tokens + j))
            if seq.num_computed_tokens + n == seq.num_tokens:
                rows.append(begin + n - 1)
                owners.append((i, seq.num_computed_tokens + n - 1))
        return rows, owners

    def _record_prompt_logprobs(self, seq: Sequence, start: int, rows) -> None:
        k = seq.params.prompt_logprobs
        for position, row in rows:
            # Skip positions already recorded before a preemption made us recompute them.
            if not len(seq.prompt_logprobs) <= position + 1 < seq.num_prompt_tokens:
                continue
            logprobs = row.log_softmax(-1)
            target = seq.token_ids[position + 1]
            entry = {target: float(logprobs[target])}
            if k:
                values, ids = logprobs.topk(k)
                entry.update(zip(ids.tolist(), values.tolist()))
            seq.prompt_logprobs.append(entry)

    def _append_token(self, seq: Sequence, logits: torch.Tensor) -> None:
        params = seq.params
        blocked = self.eos_token_ids if seq.num_output_tokens < params.min_tokens else ()
        result = self.sampler.sample(
            logits, params, seq.prompt_ids, seq.output_ids, seq.generator, blocked
        )
        seq.token_ids.append(result.token_id)
        seq.cumulative_logprob += result.logprob
        if result.top_logprobs is not None:
            seq.logprobs.append(result.top_logprobs)
        self._check_stop(seq, result.token_id)
        if seq.finish_reason is not None:
            # Flush text held back as incomplete, unless a stop string already cut it short
            # (re-decoding would bring the stop string back).
            if not isinstance(seq.stop_reason, str):
                self.detokenizer.update(seq)
            self.scheduler.finish(seq)

    def _check_stop(self, seq: Sequence, token: int) -> None:
        params = seq.params
        new_chars = len(self.detokenizer.update(seq))
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
