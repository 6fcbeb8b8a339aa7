"""Builds the model, owns its paged KV cache, and runs one step (schema: docs/architecture.md)."""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Iterator

import torch
from torch import nn

from atom.config import ConfigError, ModelConfig
from atom.cuda_graphs import graph_blockers
from atom.engine.cuda_graphs import DecodeGraphs
from atom.engine.kv_groups import KVCacheGroup, attention_impls, shared_slots
from atom.engine.step_arrays import StepInput, TokenFeed, build_step_arrays, upload
from atom.forward_context import AttentionMetadata, set_forward_context
from atom.kernels.kv_cache import fp8_kv_cache_unsupported
from atom.layers.gated_delta_net import state_backend
from atom.layers.quantization import get_quant_config
from atom.loader import load_model_weights
from atom.speculative.config import MTP_MODULE, MTP_RECYCLES_NORMED, SpeculativeConfig
from atom.speculative.eagle3 import load_eagle3_drafter, read_drafter_config
from atom.speculative.mtp import MtpDrafter
from atom.speculative.qwen3_next_mtp import Qwen3NextMtpDrafter
from atom.speculative.state_rollback import StateCheckpoints

logger = logging.getLogger(__name__)
# Above this many sequences a decode step is large enough that launches cost little, and
# captures would hold memory: it runs eagerly, as vLLM caps its capture sizes at 512.
MAX_GRAPH_BATCH = 512


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
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device,
    groups: list[KVCacheGroup] | None = None,
) -> int:
    """Gives every attention layer its cache tensors; returns the bytes allocated.

    With `groups` (kv_groups.plan_kv_groups), the j-th layers of the groups share one
    set of tensors, and each layer reads its group's block table; default: one group,
    every layer its own tensors.
    """
    total = 0
    for members in shared_slots(_groups(model, groups)):
        tensors = [
            torch.zeros(shape, dtype=dtype, device=device)
            for shape in members[0][1].kv_cache_shapes(num_blocks, block_size)
        ]
        for group, impl in members:
            impl.bind_kv_cache(tensors, kv_group=group)
        total += sum(t.numel() * t.element_size() for t in tensors)
    return total


def kv_cache_page_parts(
    model: nn.Module,
    block_size: int,
    dtype: torch.dtype,
    groups: list[KVCacheGroup] | None = None,
) -> dict[str, int]:
    """Bytes of one page (allocate_kv_cache's layout) by what the tensors hold: "K/V", or
    the impl's `kv_cache_labels` (an MLA layer's latents and its indexer keys)."""
    per_element = torch.empty((), dtype=dtype).element_size()
    parts: dict[str, int] = {}
    for members in shared_slots(_groups(model, groups)):
        impl = members[0][1]
        shapes = impl.kv_cache_shapes(1, block_size)
        labels = (
            impl.kv_cache_labels() if hasattr(impl, "kv_cache_labels") else ["K/V"] * len(shapes)
        )
        for label, shape in zip(labels, shapes):
            parts[label] = parts.get(label, 0) + per_element * torch.Size(shape).numel()
    return parts


def kv_cache_bytes_per_block(
    model: nn.Module,
    block_size: int,
    dtype: torch.dtype,
    groups: list[KVCacheGroup] | None = None,
) -> int:
    """Bytes of one page over all cache tensors (allocate_kv_cache's layout)."""
    return sum(kv_cache_page_parts(model, block_size, dtype, groups).values())


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
        self.decode_graphs = None

    def capture_cuda_graphs(self, max_batch_size: int, max_model_len: int) -> None:
        blockers = graph_blockers(self.model, self.device)
        if blockers:
            logger.warning(
                "decode runs without CUDA graphs: %s cannot be captured", ", ".join(blockers)
            )
            return
        if max_batch_size > MAX_GRAPH_BATCH:
            logger.info(
                "decode batches above %d sequences run without CUDA graphs", MAX_GRAPH_BATCH
            )
            max_batch_size = MAX_GRAPH_BATCH
        max_blocks = -(-max_model_len // self.block_size)
        self.decode_graphs = DecodeGraphs(
            self.model, max_batch_size, max_blocks, self.block_size, self.device,
            self.num_kv_groups,
        )  # fmt: skip

    def prepare(
        self, batch: list[StepInput]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        return upload(build_step_arrays(batch, self.block_size), self.device)

    @torch.inference_mode()
    def forward(
        self,
        batch: list[StepInput],
        feed: TokenFeed | None = None,
        state_checkpoints: StateCheckpoints | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] of every new token; `feed` supplies input tokens that
        are still on the device; `state_checkpoints`: a speculative verify step's, for a
        hybrid model (it runs eagerly).

        Decode rows (one new token) must come before prefill rows.
        """
        arrays = build_step_arrays(batch, self.block_size)
        if self.decode_graphs is not None and self.decode_graphs.can_run(arrays):
            return self.decode_graphs.run(arrays, feed)
        input_ids, positions, metadata = upload(arrays, self.device)
        metadata.state_checkpoints = state_checkpoints
        if feed is not None:
            feed.apply(input_ids)
        with set_forward_context(metadata):
            return self.model(input_ids, positions)

    @torch.inference_mode()
    def execute(
        self, batch: list[StepInput], logit_rows: list[int], feed: TokenFeed | None = None
    ) -> torch.Tensor | None:
        """fp32 logits of the given (ascending) token rows of the step; None when no row
        is asked."""
        return self.execute_keeping_hidden(batch, logit_rows, feed)[0]

    @torch.inference_mode()
    def execute_keeping_hidden(
        self,
        batch: list[StepInput],
        logit_rows: list[int],
        feed: TokenFeed | None = None,
        state_checkpoints: StateCheckpoints | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """`execute`'s logits and the hidden states [T, hidden] of every new token (a
        drafter reads them)."""
        hidden = self.forward(batch, feed, state_checkpoints)
        if not logit_rows:
            return None, hidden
        return self.model.compute_logits(select_rows(hidden, logit_rows)).float(), hidden

    @torch.inference_mode()
    def draft(
        self, batch: list[StepInput], hidden: torch.Tensor, step: int, rows: list[int]
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """One forward of the model's drafter over `hidden` (atom.speculative.proposer),
        then the draft tokens of output `rows` and their states for the next step (None
        and an empty state where no row drafts)."""
        drafter = self.model.drafter
        input_ids, positions, metadata = self.prepare(batch)
        with set_forward_context(metadata):
            output, state = drafter(input_ids, positions, hidden, step)
        if not rows:
            return None, state[:0]
        index = torch.tensor(rows, device=output.device)
        return drafter.draft_tokens(output[index], step), state[index]

    @torch.inference_mode()
    def run(self, batch: list[StepInput], all_positions: bool = False) -> torch.Tensor:
        """Logits [B, vocab] of each sequence's last new token, or [T, vocab] for all of them."""
        hidden = self.forward(batch)
        if not all_positions:
            last_rows = list(itertools.accumulate(len(item.token_ids) for item in batch))
            hidden = select_rows(hidden, [row - 1 for row in last_rows])
        return self.model.compute_logits(hidden).float()


def select_rows(tensor: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """tensor[rows] for ascending `rows`; the tensor itself when they are all of its rows."""
    if len(rows) == tensor.shape[0]:
        return tensor
    return tensor[torch.tensor(rows).to(tensor.device, non_blocking=True)]
