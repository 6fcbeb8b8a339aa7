"""Builds the model, owns its paged KV cache, and runs one step (schema: docs/architecture.md)."""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Iterator

import numpy as np
import torch
from torch import nn

from atom.config import ConfigError, ModelConfig
from atom.cuda_graphs import graph_blockers
from atom.engine.cuda_graphs import StepGraphs
from atom.engine.kv_groups import KVCacheGroup, attention_impls, num_pools, shared_slots
from atom.engine.speculative_graphs import drafter_shapes, drafter_step, target_step
from atom.engine.state_cache import is_hybrid
from atom.engine.step_arrays import (
    StepArrays,
    StepInput,
    TokenFeed,
    build_step_arrays,
    pad_rows_in_front,
    to_device,
    upload,
)
from atom.forward_context import AttentionMetadata, set_forward_context
from atom.kernels.kv_cache import fp8_kv_cache_unsupported
from atom.layers.gated_delta_net import state_backend
from atom.layers.quantization import get_quant_config
from atom.loader import load_model_weights
from atom.speculative.config import MTP_MODULE, MTP_RECYCLES_NORMED, SpeculativeConfig
from atom.speculative.eagle3 import load_eagle3_drafter, read_drafter_config
from atom.speculative.mtp import MtpDrafter
from atom.speculative.qwen3_next_mtp import Qwen3NextMtpDrafter
from atom.speculative.state_rollback import ListedCheckpoints, StateCheckpoints

logger = logging.getLogger(__name__)
# Above this many sequences a decode step is large enough that launches cost little, and
# captures would hold memory: it runs eagerly, as vLLM caps its capture sizes at 512.
MAX_GRAPH_BATCH = 512


def graph_batch_size(max_num_seqs: int, max_num_tokens: int, query_len: int) -> int:
    """The largest batch captured for steps of query_len tokens per sequence (0: none)."""
    return min(max_num_seqs, MAX_GRAPH_BATCH, max_num_tokens // query_len)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(
    config: ModelConfig,
    device: torch.device | str,
    progress: bool = True,
    speculative: SpeculativeConfig | None = None,
    ssm_dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """Instantiates the registry's class for the checkpoint and loads its weights; with
    `speculative`, the model carries its drafter as `model.drafter`. Gated DeltaNet layers
    keep their recurrent state in `ssm_dtype`."""
    model_cls = config.entry.load_class()
    quant_config = get_quant_config(config.hf_config)
    mtp = speculative is not None and speculative.method == "mtp"
    with torch.device(device), default_dtype(config.dtype), state_backend(None, ssm_dtype):
        model = model_cls(config.hf_config, quant_config)
        if mtp:  # its weights are the target checkpoint's
            model.drafter = _mtp_drafter(model, config, quant_config)
    load_model_weights(model, config.path, progress=progress)
    if speculative is not None and not mtp:
        drafter_config = read_drafter_config(
            speculative.model, config.hf_config, config.entry.architecture
        )
        with torch.device(device), default_dtype(config.dtype):
            model.drafter = load_eagle3_drafter(model, speculative.model, drafter_config)
    return model.eval()


def _mtp_drafter(model: nn.Module, config: ModelConfig, quant_config) -> nn.Module:
    decoder_layer = type(model).model_cls.decoder_layer
    embed = model.model.embed_tokens.forward
    if config.entry.architecture in MTP_MODULE:
        return Qwen3NextMtpDrafter(
            config.hf_config, decoder_layer, quant_config, embed, model.compute_logits
        )
    recycle_normed = MTP_RECYCLES_NORMED[config.entry.architecture]
    return MtpDrafter(config.hf_config, decoder_layer, quant_config, recycle_normed, embed=embed)


def check_fp8_kv_cache(model: nn.Module, device: torch.device, log: bool = True) -> None:
    """Raises ConfigError where an fp8 KV cache cannot run; logs when every scale is 1.0."""
    impls = attention_impls(model)
    problem = fp8_kv_cache_unsupported(device)
    if problem:
        raise ConfigError(f"{problem}: use kv_cache_dtype='auto'")
    if log and all(impl.k_scale == impl.v_scale == 1.0 for impl in impls):
        logger.info(
            "fp8 KV cache: k_scale = v_scale = 1.0 in every layer (the checkpoint gives no others)"
        )


def _groups(model: nn.Module, groups: list[KVCacheGroup] | None) -> list[KVCacheGroup]:
    return groups or [KVCacheGroup(None, tuple(attention_impls(model)))]


def allocate_kv_cache(
    model: nn.Module,
    num_blocks: int | list[int],
    block_size: int,
    dtype: torch.dtype,
    device,
    groups: list[KVCacheGroup] | None = None,
) -> int:
    """Gives every attention layer its cache tensors; returns the bytes allocated.

    With `groups` (kv_groups.plan_kv_groups), the j-th layers of a pool's groups share
    one set of tensors of that pool's `num_blocks` (a list: one count per pool; an int:
    every pool's), and each layer reads its group's block table; default: one group,
    every layer its own tensors.
    """
    groups = _groups(model, groups)
    counts = [num_blocks] * num_pools(groups) if isinstance(num_blocks, int) else num_blocks
    total = 0
    for pool, pages in enumerate(counts):
        for members in shared_slots(groups, pool):
            tensors = [
                torch.zeros(shape, dtype=dtype, device=device)
                for shape in members[0][1].kv_cache_shapes(pages, block_size)
            ]
            for group, user in members:
                user.bind_kv_cache(tensors, kv_group=group)
            total += sum(t.numel() * t.element_size() for t in tensors)
    return total


def kv_cache_page_parts(
    model: nn.Module,
    block_size: int,
    dtype: torch.dtype,
    groups: list[KVCacheGroup] | None = None,
    pool: int = 0,
) -> dict[str, int]:
    """Bytes of one page of `pool` (allocate_kv_cache's layout) by what the tensors hold:
    "K/V", or the impl's `kv_cache_labels` (an MLA layer's latents and its indexer keys)."""
    per_element = torch.empty((), dtype=dtype).element_size()
    parts: dict[str, int] = {}
    for members in shared_slots(_groups(model, groups), pool):
        user = members[0][1]
        shapes = user.kv_cache_shapes(1, block_size)
        labels = (
            user.kv_cache_labels() if hasattr(user, "kv_cache_labels") else ["K/V"] * len(shapes)
        )
        for label, shape in zip(labels, shapes):
            parts[label] = parts.get(label, 0) + per_element * torch.Size(shape).numel()
    return parts


def kv_cache_bytes_per_block(
    model: nn.Module,
    block_size: int,
    dtype: torch.dtype,
    groups: list[KVCacheGroup] | None = None,
    pool: int = 0,
) -> int:
    """Bytes of one page of `pool` over its cache tensors (allocate_kv_cache's layout)."""
    return sum(kv_cache_page_parts(model, block_size, dtype, groups, pool).values())


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        block_size: int,
        device: torch.device | str,
        num_kv_groups: int = 1,
    ):
        self.model = model
        self.block_size = block_size
        self.device = torch.device(device)
        self.num_kv_groups = num_kv_groups
        # One step function for the eager path and the captured graphs.
        self.target_step = target_step(model)
        # Graphs of uniform steps, by query tokens per sequence, and the drafter's by
        # (draft step, rows per sequence) (atom.engine.speculative_graphs).
        self.target_graphs: dict[int, StepGraphs] = {}
        self.draft_graphs: dict[tuple[int, int], StepGraphs] = {}
        # Ragged steps replayed through padding.
        self.padded_target_steps = 0
        self.padded_draft_steps = 0
        # A hybrid model's last verify step's, until its rollback.
        self.state_checkpoints: StateCheckpoints | None = None

    @property
    def decode_graphs(self) -> StepGraphs | None:
        return self.target_graphs.get(1)

    def capture_cuda_graphs(
        self,
        max_batch_size: int,
        max_model_len: int,
        max_num_tokens: int | None = None,
        num_speculative_tokens: int = 0,
        capture: bool = True,
    ) -> None:
        """Graphs of decode steps and, with a drafter, of the verify step (k + 1 tokens
        per sequence) and the drafter's steps; max_num_tokens bounds a step's tokens.
        Parts that cannot be captured stay eager, each with one log line. capture=False
        builds the same static buffers and runs every step eagerly through them (the CPU
        tests of that path)."""
        if max_batch_size > MAX_GRAPH_BATCH:
            logger.info("steps of more than %d sequences run without CUDA graphs", MAX_GRAPH_BATCH)
            max_batch_size = MAX_GRAPH_BATCH
        max_blocks = -(-max_model_len // self.block_size)
        max_num_tokens = max_num_tokens or max_batch_size
        eager: dict[str, list[str]] = {}  # why -> the steps it keeps eager
        pool = None

        def build(name, module, step, query_len, hybrid=False, device_inputs=None):
            nonlocal pool
            batch_size = graph_batch_size(max_batch_size, max_num_tokens, query_len)
            if batch_size < 1:
                return None  # the token budget never schedules such a step
            blockers = graph_blockers(module, self.device, query_len) if capture else []
            if blockers:
                eager.setdefault(f"{', '.join(blockers)} cannot be captured", []).append(name)
                return None
            # A hybrid target's verify step keeps its states for the rollback.
            keeps_states = hybrid and query_len > 1
            graphs = StepGraphs(
                step, query_len, batch_size, max_blocks,
                self.block_size, self.device, self.num_kv_groups, hybrid, device_inputs,
                capture, pool, keeps_states,
            )  # fmt: skip
            pool = graphs.pool
            return graphs

        hybrid = is_hybrid(self.model)
        shapes = [1]
        if num_speculative_tokens:
            shapes.append(num_speculative_tokens + 1)
        for query_len in shapes:
            name = "decode" if query_len == 1 else f"verify ({query_len} tokens per sequence)"
            graphs = build(name, self.model, self.target_step, query_len, hybrid)
            if graphs is not None:
                self.target_graphs[query_len] = graphs
        drafter = getattr(self.model, "drafter", None)
        if num_speculative_tokens and drafter is not None:
            width = {"hidden": (self.activation_dtype(), drafter.hidden_size)}
            for step, rows in drafter_shapes(num_speculative_tokens):
                name = f"draft step {step} ({rows} rows per sequence)"
                fn = drafter_step(drafter, step, rows)
                graphs = build(name, drafter, fn, rows, device_inputs=width)
                if graphs is not None:
                    self.draft_graphs[step, rows] = graphs
        for why, names in eager.items():
            logger.warning("without CUDA graphs: %s (%s)", "; ".join(names), why)

    def activation_dtype(self) -> torch.dtype:
        """The dtype hidden states flow in (weights may be quantized; embeddings are not)."""
        return self.model.model.embed_tokens.weight.dtype

    def prepare(
        self, batch: list[StepInput]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        return upload(build_step_arrays(batch, self.block_size), self.device)

    @torch.inference_mode()
    def forward(
        self,
        batch: list[StepInput],
        feed: TokenFeed | None = None,
        verified_rows: tuple[list[int], list[int], list[int]] | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """The target step's outputs (`speculative_graphs.target_step`): the hidden states
        [T, hidden] of every new token, then, with a drafter, what it reads of them.
        `feed` supplies input tokens that are still on the device; `verified_rows`: a
        hybrid model's verify step, the (state slots, first token rows, row counts) of the
        sequences it verifies, whose states the step keeps for `roll_back`.

        Decode rows (one new token) must come before prefill rows.
        """
        arrays = build_step_arrays(batch, self.block_size)
        # The static buffers keep the states of every sequence: the rollback lines them up
        # with the verified ones only when the step verifies them all.
        verifies_all = verified_rows is None or len(verified_rows[0]) == arrays.num_seqs
        if verifies_all and arrays.num_seqs:
            replayed = self._replay_target(arrays, feed)
            if replayed is not None:
                outputs, rows = replayed
                checkpoints = self.target_graphs[rows].state_checkpoints
                self.state_checkpoints = None if verified_rows is None else checkpoints
                return outputs
        return self._eager(arrays, feed, verified_rows)

    def _replay_target(
        self, arrays: StepArrays, feed: TokenFeed | None
    ) -> tuple[tuple[torch.Tensor, ...], int] | None:
        """The step through the target's graphs of the fewest rows per sequence that hold
        its longest, and that row count; None where none can run it. A ragged step (a
        verify step in which some sequences have fewer drafts) is padded in front
        (`pad_rows_in_front`) and its outputs gathered back to the batch's token rows."""
        longest = int(np.diff(arrays.query_start_loc).max())
        fitting = [rows for rows in self.target_graphs if rows >= longest]
        if not fitting:
            return None
        rows = min(fitting)
        token_rows = None
        if arrays.num_tokens != arrays.num_seqs * rows:
            padded = pad_rows_in_front(arrays, rows)
            if padded is None:
                return None
            arrays, token_rows = padded
            if feed is not None:
                feed = feed.padded(token_rows)
        graphs = self.target_graphs[rows]
        if not graphs.can_run(arrays):
            return None
        outputs = graphs.run(arrays, feed)
        if token_rows is None:
            return outputs, rows
        self.padded_target_steps += 1
        index = torch.from_numpy(token_rows).to(self.device, non_blocking=True)
        return tuple(output[index] for output in outputs), rows

    def _eager(
        self,
        arrays: StepArrays,
        feed: TokenFeed | None = None,
        verified_rows: tuple[list[int], list[int], list[int]] | None = None,
    ) -> tuple[torch.Tensor, ...]:
        input_ids, positions, metadata = upload(arrays, self.device)
        metadata.state_checkpoints = self.state_checkpoints = (
            None if verified_rows is None else ListedCheckpoints(*verified_rows, self.device)
        )
        if feed is not None:
            feed.apply(input_ids)
        with set_forward_context(metadata):
            return self.target_step(input_ids, positions)

    @torch.inference_mode()
    def execute(
        self, batch: list[StepInput], logit_rows: list[int], feed: TokenFeed | None = None
    ) -> torch.Tensor | None:
        """fp32 logits of the given (ascending) token rows of the step; None when no row
        is asked."""
        return self._logits(self.forward(batch, feed)[0], logit_rows)

    @torch.inference_mode()
    def execute_data_parallel(
        self, batch: list[StepInput], logit_rows: list[int], graph_size: int | None
    ) -> torch.Tensor | None:
        """`execute` for a data-parallel rank: the decode graph of `graph_size` sequences,
        which every rank replays (its own sequences, then padding), or eagerly where it is
        None. The ranks' collectives must match, so no rank picks a path on its own
        (atom.engine.data_parallel_graphs)."""
        arrays = build_step_arrays(batch, self.block_size)
        if graph_size is None:
            outputs = self._eager(arrays)
        else:
            outputs = self.decode_graphs.run(arrays, batch_size=graph_size)
        return self._logits(outputs[0], logit_rows)

    @torch.inference_mode()
    def verify(
        self,
        batch: list[StepInput],
        logit_rows: list[int],
        verified_rows: tuple[list[int], list[int], list[int]] | None = None,
        feed: TokenFeed | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """A speculative step: `execute`'s logits and what the drafter reads of every new
        token (its `target_features`, [T, width]); `verified_rows` and `feed` (the drafts)
        as in `forward`."""
        hidden, features = self.forward(batch, feed, verified_rows)
        # A copy: the sequences' backlogs hold these rows past the graph's next replay.
        return self._logits(hidden, logit_rows), features.clone()

    @torch.inference_mode()
    def roll_back(self, kept_rows: list[int]) -> None:
        """After a hybrid model's verify step, before any other step: each verified
        sequence's states after its first kept_rows[i] rows (state_rollback)."""
        self.state_checkpoints.roll_back(kept_rows)
        self.state_checkpoints = None

    def _logits(self, hidden: torch.Tensor, logit_rows: list[int]) -> torch.Tensor | None:
        if not logit_rows:
            return None
        return self.model.compute_logits(select_rows(hidden, logit_rows)).float()

    @torch.inference_mode()
    def draft(
        self,
        batch: list[StepInput],
        hidden: torch.Tensor,
        step: int,
        rows: list[int],
        feed: TokenFeed | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """One forward of the model's drafter over `hidden` (atom.speculative.proposer),
        then the draft tokens of output `rows` (each a sequence's last row) and their
        states for the next step (None and an empty state where no row drafts). `feed`:
        input tokens still on the device (the drafts of the step before)."""
        drafter = self.model.drafter
        arrays = build_step_arrays(batch, self.block_size)
        if rows:
            replayed = self._replay_draft(arrays, hidden, step, rows, feed)
            if replayed is not None:
                return replayed
        input_ids, positions, metadata = upload(arrays, self.device)
        if feed is not None:
            feed.apply(input_ids)
        with set_forward_context(metadata):
            output, state = drafter(input_ids, positions, hidden, step)
        if not rows:
            return None, state[:0]
        index = to_device(rows, output.device)
        return drafter.draft_tokens(output[index], step), state[index]

    def _replay_draft(
        self,
        arrays: StepArrays,
        hidden: torch.Tensor,
        step: int,
        rows: list[int],
        feed: TokenFeed | None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`draft` through the graphs of draft step `step`, a ragged batch padded to its
        longest sequence's rows (`pad_rows_in_front`); None where none can run it."""
        rows_per_seq = int(np.diff(arrays.query_start_loc).max())
        graphs = self.draft_graphs.get((step, rows_per_seq))
        if graphs is None:
            return None
        seq_ends = arrays.query_start_loc[1:]
        ragged = arrays.num_tokens != arrays.num_seqs * rows_per_seq
        if ragged:
            padded = pad_rows_in_front(arrays, rows_per_seq)
            if padded is None:
                return None
            arrays, token_rows = padded
            if feed is not None:
                feed = feed.padded(token_rows)
            index = torch.from_numpy(token_rows).to(hidden.device, non_blocking=True)
            hidden = hidden.new_zeros(arrays.num_tokens, hidden.shape[1]).index_copy_(
                0, index, hidden
            )
        if not graphs.can_run(arrays):
            return None
        tokens, state = graphs.run(arrays, feed, device_inputs={"hidden": hidden})
        self.padded_draft_steps += ragged
        if len(rows) == arrays.num_seqs:
            return tokens, state
        # Each drafting row is the last of its sequence's.
        seqs = np.searchsorted(seq_ends, rows, side="right")
        index = torch.from_numpy(seqs).to(tokens.device, non_blocking=True)
        return tokens[index], state[index]

    @torch.inference_mode()
    def run(self, batch: list[StepInput], all_positions: bool = False) -> torch.Tensor:
        """Logits [B, vocab] of each sequence's last new token, or [T, vocab] for all of them."""
        hidden = self.forward(batch)[0]
        if not all_positions:
            last_rows = list(itertools.accumulate(len(item.token_ids) for item in batch))
            hidden = select_rows(hidden, [row - 1 for row in last_rows])
        return self.model.compute_logits(hidden).float()


def select_rows(tensor: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """tensor[rows] for ascending `rows`; the tensor itself when they are all of its rows."""
    if len(rows) == tensor.shape[0]:
        return tensor
    return tensor[to_device(rows, tensor.device)]
