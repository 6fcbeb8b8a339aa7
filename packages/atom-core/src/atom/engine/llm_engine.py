"""The engine loop: admit requests, schedule a step, run the model, sample, emit outputs."""

from __future__ import annotations

import copy
import itertools
import logging
import time
from dataclasses import dataclass, field

import torch

from atom.config import EngineConfig
from atom.engine.block_manager import BlockManager
from atom.engine.data_parallel_scheduler import DataParallelBatch, DataParallelScheduler
from atom.engine.detokenizer import Detokenizer, find_stop_string
from atom.engine.executor import Executor
from atom.engine.model_runner import select_rows
from atom.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from atom.engine.parallel_check import check_parallel
from atom.engine.rank_sampling import RankResult, RankStep, SampleRow
from atom.engine.sampler import PendingSamples, Sampler, prompt_logprob_entries, uses_penalties
from atom.engine.scheduler import Scheduler
from atom.engine.sequence import Sequence
from atom.engine.state_cache import StateSlots, num_state_slots
from atom.engine.step_arrays import TokenFeed
from atom.engine.step_plan import StepPlan
from atom.sampling_params import SamplingParams
from atom.speculative.config import check_engine_config
from atom.speculative.draft_policy import DraftPolicy
from atom.speculative.drafts import Drafts
from atom.speculative.proposer import Proposer
from atom.speculative.stats import SpeculativeStats
from atom.speculative.verifier import PendingVerification, verify

logger = logging.getLogger(__name__)

# Stands on the host for a token sampled by a step still in flight.
PLACEHOLDER_TOKEN = -1


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
    spec_decode: SpeculativeStats = field(default_factory=SpeculativeStats)


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer=None, async_scheduling: bool | None = None):
        """async_scheduling (default: on for GPUs) overlaps each step's host work with
        the next step's GPU work."""
        self.config = config
        self.tokenizer = tokenizer
        self.detokenizer = Detokenizer(tokenizer)
        if config.speculative is not None:
            check_engine_config(config)
        check_parallel(config)
        self.executor = Executor(config)
        self.model = self.executor.model
        self.kv_layout = self.executor.kv_layout
        self.hybrid = hybrid = self.executor.state_cache_bytes > 0
        prefix_caching = config.cache.enable_prefix_caching and not hybrid
        if hybrid and config.cache.enable_prefix_caching:
            logger.info("prefix caching is off: the model keeps per-request state (hybrid)")

        def make_block_manager() -> BlockManager:
            return BlockManager(
                self.executor.pool_blocks,
                config.cache.block_size,
                prefix_caching,
                self.kv_layout.windows,
                self.kv_layout.pool_of,
            )

        self.draft_policy = None
        if config.speculative is not None:
            self.draft_policy = DraftPolicy(config.speculative, config.model.max_model_len)
        self.data_parallel_size = config.parallel.data_parallel_size
        if self.data_parallel_size > 1:
            # One scheduler and block manager per DP rank; every rank's pool has the same
            # size, so rank 0's block manager answers the admission checks.
            self.scheduler = DataParallelScheduler(
                make_block_manager,
                self.data_parallel_size,
                config.max_num_seqs,
                config.max_num_batched_tokens,
                (lambda: StateSlots(config.max_num_seqs)) if hybrid else None,
            )
            self.block_manager = self.scheduler.block_managers[0]
            self._done_seq_ids: list[list[int]] = [[] for _ in range(self.data_parallel_size)]
        else:
            self.block_manager = make_block_manager()
            self.scheduler = Scheduler(
                self.block_manager,
                config.max_num_seqs,
                config.max_num_batched_tokens,
                StateSlots(config.max_num_seqs) if hybrid else None,
                self.draft_policy.num_drafts if self.draft_policy is not None else None,
            )
        self.proposer = None
        self.spec_stats = SpeculativeStats()
        if config.speculative is not None:
            self.proposer = Proposer(self.executor.draft)
            self.spec_stats = SpeculativeStats(config.speculative.num_speculative_tokens)
        self.sampler = Sampler(config.seed, compile=config.compile)
        self.eos_token_ids = _eos_ids(config.model.hf_config, tokenizer)
        self.requests: dict[str, _Request] = {}
        self._request_counter = itertools.count()
        if async_scheduling is None:
            async_scheduling = config.device.startswith("cuda")
        if async_scheduling and config.speculative is not None:
            logger.info("async scheduling is off: speculative decoding verifies on the host")
            async_scheduling = False
        if self.data_parallel_size > 1:
            logger.info(
                "data-parallel MoE tokens reach the experts by %s", config.parallel.all2all_backend
            )
            if config.use_cuda_graphs and config.parallel.all2all_backend == "all_to_all":
                logger.info(
                    "CUDA graphs are off: all_to_all reads every MoE layer's split sizes on "
                    "the host, which a graph cannot hold"
                )
            elif config.use_cuda_graphs:
                logger.info(
                    "data-parallel steps in which a rank prefills, or has more sequences "
                    "than the largest CUDA graph, run eagerly on every rank"
                )
            if async_scheduling:
                logger.info(
                    "async scheduling is off: data-parallel ranks return sampled tokens "
                    "to rank 0 before the next step"
                )
                async_scheduling = False
        self.async_scheduling = async_scheduling
        self._in_flight: _Step | None = None
        logger.info("%s", self.kv_cache_summary())
        if hybrid:
            logger.info(
                "state cache: %d slots, %.1f MiB (taken from the KV-cache budget)",
                num_state_slots(config.max_num_seqs),
                self.executor.state_cache_bytes / (1 << 20),
            )

    def kv_cache_summary(self) -> str:
        """The KV pool in one line; with sliding-window groups, what it holds of
        max_model_len sequences against the full layout."""
        return self.kv_layout.summary(
            self.config.model.max_model_len,
            str(self.executor.cache_dtype).removeprefix("torch."),
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
        if any(t >= vocab for t in params.logit_bias or ()):
            raise ValueError(f"logit_bias keys must be token ids in [0, {vocab})")
        longest = min(max_len, len(ids) + (params.max_tokens or max_len))
        # A recomputed (preempted) sequence may run as one chunk of up to the token budget.
        bm = self.block_manager
        held = bm.pages_held(longest, min(longest, self.config.max_num_batched_tokens))
        for pool, pages in zip(bm.pools, held):
            if pages > pool.num_blocks:
                raise ValueError(
                    f"a sequence of up to {longest} tokens needs {pages} KV blocks at once and "
                    f"does not fit the KV cache ({pool.num_blocks} blocks of {bm.block_size} "
                    "tokens); lower max_tokens or enlarge the cache"
                )

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """arrival_time: `time.monotonic()` when the request arrived (default: now); its
        RequestMetrics count from it."""
        request_id = request_id if request_id is not None else str(next(self._request_counter))
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.encode(prompt)
        self.validate_prompt(ids, params)
        metrics = RequestMetrics(arrival_time if arrival_time is not None else time.monotonic())
        seqs = [Sequence(ids, params, request_id, i, metrics) for i in range(params.n)]
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
                self._finish_sequence(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # The step -------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """Runs one scheduled batch; returns the current output of each request it touched
        (only of those it finished, with finished_only: the offline API needs no more).

        With async scheduling, the next batch is launched before this one's tokens reach
        the host: its rows continuing a sequence read the sampled tokens on the device, and
        the host's bookkeeping overlaps the GPU's work. A sequence that stops here has
        then run one row too many, whose result is dropped.
        """
        current = self._in_flight or self._launch(None)
        self._in_flight = None
        if current is None:
            return []
        if self.async_scheduling and self._can_feed(current):
            self._in_flight = self._launch(current)
        outputs = self._finish(current, finished_only)
        if not self.requests and self._in_flight is not None:
            # Every row in flight belongs to a finished sequence: drop the step.
            if self._in_flight.samples is not None:
                self._in_flight.samples.results()
            self._in_flight = None
        return outputs

    def _can_feed(self, step: _Step) -> bool:
        # Penalties read the output tokens on the host, which would still lack the last; a
        # guide's next mask needs the last token accepted.
        return step.samples is not None and not any(
            uses_penalties(seq.params) or seq.guide is not None for seq in step.plan.samples
        )

    def _launch(self, feeding: _Step | None) -> _Step | None:
        """Schedules and starts a step; `feeding` is the step still in flight whose sampled
        tokens this one reads on the device (they stand as placeholders on the host)."""
        if feeding is not None:
            for seq in feeding.plan.samples:
                if not seq.is_finished:
                    seq.token_ids.append(PLACEHOLDER_TOKEN)
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return None
        if isinstance(batch, DataParallelBatch):
            return self._launch_data_parallel(batch)
        drafts = Drafts.none(len(batch.seqs))
        if self.proposer is not None:
            drafts = self.proposer.propose(batch.seqs, batch.num_drafts)
        num_drafts = drafts.counts
        plan = StepPlan(batch.seqs, batch.num_new_tokens, num_drafts)
        feed = None
        if feeding is not None:
            source = {seq: i for i, seq in enumerate(feeding.plan.samples)}
            rows, sources = [], []
            for seq, row in zip(batch.seqs, plan.token_starts):
                i = source.get(seq)
                if i is not None and seq.token_ids[seq.num_computed_tokens] == PLACEHOLDER_TOKEN:
                    rows.append(row)
                    sources.append(i)
            feed = TokenFeed(feeding.samples.tokens, rows, sources) if rows else None
        hidden = None
        rolls_back = self.hybrid and bool(plan.verified)
        if self.proposer is None:
            logits = self.executor.execute(plan.inputs, plan.rows, feed)
        else:
            logits, hidden = self.executor.verify(
                plan.inputs,
                plan.rows,
                plan.verified_state_rows() if rolls_back else None,
                drafts.feed(plan.draft_rows) if plan.draft_rows else None,
            )
        for seq, n, d in zip(batch.seqs, batch.num_new_tokens, num_drafts):
            # Drafts count as computed once accepted (_finish_verified).
            seq.num_computed_tokens += n - d
        samples = verification = None
        if plan.verified:
            verification = verify(
                select_rows(logits, plan.verified_rows),
                [seq for seq, _ in plan.verified],
                drafts.of(plan.verified_seqs),
                self.sampler,
                self.config.speculative.forced_acceptance,
            )
        if plan.samples:
            sample_logits = select_rows(logits, plan.sample_rows)
            blocked = [
                self.eos_token_ids if seq.num_output_tokens < seq.params.min_tokens else ()
                for seq in plan.samples
            ]
            samples = self.sampler.launch(sample_logits, plan.samples, blocked)
        step = _Step(batch.seqs, plan, logits if plan.prompt_logprobs else None, samples)
        step.verification, step.rolls_back = verification, rolls_back
        if hidden is not None:
            step.hidden_rows = [
                (seq, seq.num_computed_tokens - (n - d), hidden[start : start + n])
                for seq, n, d, start in zip(
                    batch.seqs, batch.num_new_tokens, num_drafts, plan.token_starts
                )
                if self.draft_policy.may_draft(seq)
            ]
        return step

    def _launch_data_parallel(self, batch: DataParallelBatch) -> _Step:
        """Every DP rank runs its own batch (an empty one: zero tokens) and samples its
        rows; the step's plan covers all of them, in rank order, for the bookkeeping."""
        plan = StepPlan(batch.seqs, batch.num_new_tokens, [0] * len(batch.seqs))
        vocab = self.config.model.hf_config.vocab_size
        # Prompt logprobs read logits on rank 0: then every rank sends its rows, so the
        # ranks' rows concatenate into the plan's.
        keep_logits = bool(plan.prompt_logprobs)
        steps = []
        for rank in range(self.data_parallel_size):
            seqs, num_new_tokens = batch.of_rank(rank)
            part = StepPlan(seqs, num_new_tokens, [0] * len(seqs))
            rows = [SampleRow.of(seq, self._blocked(seq), vocab) for seq in part.samples]
            steps.append(
                RankStep(part.inputs, part.rows, part.sample_rows, rows, keep_logits,
                         self._done_seq_ids[rank])
            )  # fmt: skip
            self._done_seq_ids[rank] = []
        results = self.executor.step_data_parallel(steps)
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
        logits = torch.cat([r.logits for r in results]) if keep_logits else None
        return _Step(batch.seqs, plan, logits, _GatheredSamples(results))

    def _blocked(self, seq: Sequence):
        return self.eos_token_ids if seq.num_output_tokens < seq.params.min_tokens else ()

    def _finish(self, step: _Step, finished_only: bool) -> list[RequestOutput]:
        """Brings a step's tokens to the host, then does its bookkeeping."""
        results = step.samples.results() if step.samples is not None else []
        verified = step.verification.results() if step.verification is not None else []
        if step.rolls_back:
            # The rows that stand: the sequence's own new ones and the drafts it kept.
            self.executor.roll_back(
                [n - d + len(emitted) - 1 for (_, d), n, emitted in zip(
                    step.plan.verified, step.plan.verified_num_rows, verified)]
            )  # fmt: skip
        arrived = time.monotonic()  # when this step's tokens reached the host
        # Sequences that stopped (or were aborted) while this step was in flight are
        # done; their rows here are the extra ones.
        running = [seq for seq in step.seqs if not seq.is_finished]
        live = set(running)
        for seq, result in zip(step.plan.samples, results):
            if seq in live:
                self._take_token(seq, result, arrived)
        hashing = self.block_manager.enable_prefix_caching
        block_size = self.block_manager.block_size
        for seq in running:
            if hashing and seq.num_computed_tokens // block_size > seq.num_hashed_blocks:
                self._block_manager_of(seq).register_full_blocks(seq)
        for seq, first, last, row in step.plan.prompt_logprobs:
            rows = step.logits[row : row + last - first]
            targets = seq.token_ids[first + 1 : last + 1]
            seq.prompt_logprobs += prompt_logprob_entries(rows, targets, seq.params.prompt_logprobs)
        for seq, result in zip(step.plan.samples, results):
            if seq in live:
                self._after_token(seq, result.token_id)
        for (seq, num_drafts), emitted in zip(step.plan.verified, verified):
            self._finish_verified(seq, num_drafts, emitted, arrived)
        for seq, start, rows in step.hidden_rows:
            if not seq.is_finished:
                # The rows whose tokens stand; the last precedes the token just sampled.
                seq.drafter_backlog = (start, rows[: seq.num_computed_tokens - start])
        outputs = []
        for request_id in dict.fromkeys(seq.request_id for seq in running):
            request = self.requests.get(request_id)
            if request is None:
                continue
            if not finished_only or all(s.is_finished for s in request.seqs):
                outputs.append(self._output(request))
        return outputs

    def _finish_verified(self, seq: Sequence, num_drafts: int, emitted, arrived: float) -> None:
        """Takes a verified sequence's accepted drafts and the target's token after them,
        up to a stop; their K/V (the step wrote it) then counts as computed."""
        if seq.is_finished:
            return
        self.spec_stats.record(num_drafts, len(emitted) - 1)
        for result in emitted:
            self._take_token(seq, result, arrived)
            self._after_token(seq, result.token_id)
            if seq.is_finished:
                return
        seq.num_computed_tokens += len(emitted) - 1
        if self.block_manager.enable_prefix_caching:  # no drafts under DP: rank 0's pool
            self.block_manager.register_full_blocks(seq)

    def _take_token(self, seq: Sequence, result, arrived: float) -> None:
        """Appends a sampled token, or fills the placeholder a fed step left for it."""
        if seq.token_ids[-1] == PLACEHOLDER_TOKEN:
            seq.token_ids[-1] = result.token_id
        else:
            seq.token_ids.append(result.token_id)
        metrics = seq.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = arrived
        metrics.last_token_time = arrived
        seq.cumulative_logprob += result.logprob
        if result.top_logprobs is not None:
            seq.logprobs.append(result.top_logprobs)

    def _after_token(self, seq: Sequence, token: int) -> None:
        stopping_token = self._check_stop(seq, token)
        if seq.finish_reason is not None:
            # Flush text held back as incomplete, unless a stop string already cut it
            # short (re-decoding would bring the stop string back).
            if not isinstance(seq.stop_reason, str):
                self.detokenizer.update(seq, leave_out_last=stopping_token)
            self._finish_sequence(seq)

    def _finish_sequence(self, seq: Sequence) -> None:
        if self.data_parallel_size > 1 and seq.seed is not None and seq in self.scheduler.rank_of:
            # Its rank drops the sequence's generator with its next step.
            self._done_seq_ids[self.scheduler.rank_of[seq]].append(seq.seq_id)
        self.scheduler.finish(seq)

    def _block_manager_of(self, seq: Sequence) -> BlockManager:
        if self.data_parallel_size > 1:
            return self.scheduler.block_manager_of(seq)
        return self.block_manager

    def _check_stop(self, seq: Sequence, token: int) -> bool:
        """Sets the sequence's finish reason where `token` ends it; True when `token` is
        a stopping token (EOS, a stop token id), which its text leaves out."""
        params = seq.params
        stopping_token = seq.num_output_tokens >= params.min_tokens and (
            (not params.ignore_eos and token in self.eos_token_ids)
            or token in params.stop_token_ids
        )
        # As in vLLM, the text leaves out the token that stops it (shown only where special
        # tokens are not skipped, or for a stop_token_ids entry that is an ordinary token).
        new_chars = 0
        if params.detokenize:
            new_chars = len(self.detokenizer.update(seq, leave_out_last=stopping_token))
        if seq.guide is not None:
            seq.guide.accept(token)
            if seq.guide.is_done:
                seq.finish_reason = "stop"
                return stopping_token
        if seq.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                seq.finish_reason = "stop"
                return stopping_token
            if token in params.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", token
                return stopping_token
            stop = find_stop_string(seq, new_chars) if params.stop else None
            if stop is not None:
                seq.finish_reason, seq.stop_reason = "stop", stop
                return stopping_token
        limit = self.config.model.max_model_len
        if params.max_tokens is not None:
            limit = min(limit, seq.num_prompt_tokens + params.max_tokens)
        if seq.num_tokens >= limit:
            seq.finish_reason = "length"
        return stopping_token

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
            metrics=first.metrics,
        )

    def shutdown(self) -> None:
        self.executor.shutdown()

    def stats(self) -> EngineStats:
        """Under DP attention: summed over the ranks (their pools, their prefix caches)."""
        bm = self.scheduler if self.data_parallel_size > 1 else self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_free_blocks=bm.num_free_blocks,
            num_blocks=bm.num_blocks,
            kv_cache_usage=bm.usage,
            prefix_cache_queries=bm.prefix_queries,
            prefix_cache_hits=bm.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
            spec_decode=copy.deepcopy(self.spec_stats),
        )


@dataclass
class _Step:
    """A launched step: what ran, and what its results are waiting on."""

    seqs: list[Sequence]
    plan: StepPlan
    logits: torch.Tensor | None  # kept only for prompt logprobs
    samples: PendingSamples | None
    verification: PendingVerification | None = None
    rolls_back: bool = False  # a hybrid model's verify step: its states roll back
    # (sequence, position of its first row, hidden states) for the drafter's backlog.
    hidden_rows: list[tuple[Sequence, int, torch.Tensor]] = field(default_factory=list)


class _GatheredSamples:
    """The DP ranks' sampled tokens, already on rank 0's host (PendingSamples' results)."""

    def __init__(self, results: list[RankResult]):
        self._results = [sample for result in results for sample in result.samples]

    def results(self):
        return self._results


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
