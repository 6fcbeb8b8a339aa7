"""KV-cache groups: attention layers that keep the same pages of a sequence.

A full-attention layer reads every earlier token's K/V; a sliding-window layer of window
W reads only the last W. The engine groups the layers by that (full attention first,
then each window), and every group gets its own block table per sequence, so a window
group keeps only the pages its window still reaches (block_manager.py frees the rest).

All groups take their pages from one pool. Cache tensor j is shared by the j-th layer of
every group, and page p of it belongs to whichever group holds page p: a page holds
max(group sizes) layers instead of all of them, and a page a window leaves behind is free
at once for any sequence or group. (vLLM's hybrid allocator works the same way; this is a
smaller version.) The groups must then agree on a page's shape; where they do not, the
engine keeps one group, the full layout, and says so.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from torch import nn

logger = logging.getLogger(__name__)


def attention_impls(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(m, "bind_kv_cache")]


@dataclass(frozen=True)
class KVCacheGroup:
    sliding_window: int | None  # None: full attention
    layers: tuple[nn.Module, ...]  # their attention impls, in model order

    @property
    def label(self) -> str:
        window = self.sliding_window
        kind = "full-attention" if window is None else f"sliding-window({window})"
        return f"{len(self.layers)} {kind} layer{'s' if len(self.layers) != 1 else ''}"


def _window(impl: nn.Module, max_model_len: int) -> int | None:
    # A window as long as the longest sequence never drops a token.
    window = impl.spec.sliding_window
    return window if window is not None and window < max_model_len else None


def plan_kv_groups(
    model: nn.Module, max_model_len: int, window_only: bool = True
) -> list[KVCacheGroup]:
    """The model's attention layers by the pages they keep; one group (every layer keeps
    every page) without `window_only`."""
    impls = attention_impls(model)
    if not window_only:
        return [KVCacheGroup(None, tuple(impls))]
    windows = sorted({_window(i, max_model_len) for i in impls}, key=lambda w: (w is not None, w))
    groups = [
        KVCacheGroup(w, tuple(i for i in impls if _window(i, max_model_len) == w)) for w in windows
    ]
    if len(groups) > 1 and len({str(i.kv_cache_shapes(1, 1)) for i in impls}) > 1:
        logger.info(
            "KV cache: every layer keeps every page (the full layout): the layers' cache "
            "shapes differ, so sliding-window layers cannot share pages with the others"
        )
        return [KVCacheGroup(None, tuple(impls))]
    return groups or [KVCacheGroup(None, ())]


def shared_slots(groups: list[KVCacheGroup]) -> list[list[tuple[int, nn.Module]]]:
    """(group index, impl) pairs per cache tensor: tensor j is the j-th layer of each group."""
    depth = max(len(g.layers) for g in groups)
    return [
        [(index, g.layers[j]) for index, g in enumerate(groups) if j < len(g.layers)]
        for j in range(depth)
    ]


def pages_held(windows: list[int | None], block_size: int, num_tokens: int, chunk: int = 1) -> int:
    """The most pages a sequence of `num_tokens` holds at once over all groups when it
    runs chunks of at most `chunk` new tokens: a full group all of its pages; a window
    group those from the earliest query's window to the chunk's end, at most
    ceil((W - 1 + chunk) / block_size) + 1."""
    pages = -(-num_tokens // block_size)
    total = 0
    for window in windows:
        if window is None:
            total += pages
        else:
            total += min(pages, -(-(window - 1 + chunk) // block_size) + 1)
    return total


@dataclass(frozen=True)
class KVCacheLayout:
    """The engine's KV pool as allocated, and what the full layout would cost instead."""

    groups: list[KVCacheGroup]
    num_blocks: int
    block_size: int
    page_bytes: int  # one page over all cache tensors
    full_layout_page_bytes: int  # the same page if every layer kept every page
    # page_bytes by what it holds (model_runner.kv_cache_page_parts), when that is more
    # than K/V: MLA latents and sparse attention's indexer keys.
    page_parts: dict[str, int] = field(default_factory=dict)

    @property
    def windows(self) -> list[int | None]:
        return [g.sliding_window for g in self.groups]

    def bytes_per_token(self, context_len: int) -> float:
        """KV bytes per token of a sequence of `context_len` tokens while it decodes."""
        pages = pages_held(self.windows, self.block_size, context_len)
        return pages * self.page_bytes / context_len

    def full_layout_bytes_per_token(self, context_len: int) -> float:
        pages = -(-context_len // self.block_size)
        return pages * self.full_layout_page_bytes / context_len

    def report(self, context_len: int) -> dict:
        """The memory figures `atom bench` prints, for sequences of `context_len` tokens."""
        window = self.bytes_per_token(context_len)
        full = self.full_layout_bytes_per_token(context_len)
        return dict(
            kv_groups=", ".join(g.label for g in self.groups),
            context_len=context_len,
            kv_bytes_per_token=round(window, 1),
            kv_bytes_per_token_full_layout=round(full, 1),
            kv_saving=round(full / window, 3),
        )

    def summary(self, context_len: int, dtype: str) -> str:
        """One line for the startup log and `atom serve`'s summary; with window groups,
        how many `context_len`-token sequences fit, against the full layout (every layer
        keeps every page) in the same memory."""
        tokens = self.num_blocks * self.block_size
        head = (
            f"KV cache: {self.num_blocks} blocks of {self.block_size} tokens = {tokens} "
            f"tokens ({dtype})"
        )
        if len(self.page_parts) > 1:
            per_token = " + ".join(
                f"{size / self.block_size:.0f} B {label}" for label, size in self.page_parts.items()
            )
            head = f"{head}, {self.page_bytes / self.block_size:.0f} B per token ({per_token})"
        if self.windows == [None]:
            return f"{head}, {tokens / context_len:.1f} sequences of {context_len} tokens"
        pages = pages_held(self.windows, self.block_size, context_len)
        full_blocks = self.num_blocks * self.page_bytes // self.full_layout_page_bytes
        fits = self.num_blocks // pages
        fits_full = full_blocks // -(-context_len // self.block_size)
        ratio = self.full_layout_bytes_per_token(context_len) / self.bytes_per_token(context_len)
        groups = ", ".join(g.label for g in self.groups)
        return (
            f"{head}, shared by {len(self.groups)} group{'s' if len(self.groups) > 1 else ''} "
            f"({groups}): {fits} sequences of {context_len} tokens fit ({pages} blocks each), "
            f"{ratio:.2f}x the tokens of the full layout in the same memory ({fits_full} "
            f"sequences, {full_blocks} blocks of every layer)"
        )
