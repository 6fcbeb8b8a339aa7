"""KV-cache groups: attention layers that keep the same pages of a sequence.

A full-attention layer reads every earlier token's K/V; a sliding-window layer of window
W reads only the last W. The engine groups the layers by that (full attention first,
then each window), and every group gets its own block table per sequence, so a window
group keeps only the pages its window still reaches (block_manager.py frees the rest).
An impl whose tensors reach back differently is grouped by its parts
(atom.layers.kv_cache_part): DeepSeek-V4's per-token rows go to a window group, its
compressed entries to the full-attention group.

Groups take their pages from pools, one per page shape. Cache tensor j of a pool is
shared by the j-th layer of each of its groups, and page p of it belongs to whichever
group holds page p: a page holds max(group sizes) layers instead of all of them, and a
page a window leaves behind is free at once for any sequence or group of that pool.
(vLLM's hybrid allocator works the same way; this is a smaller version.) A group joins
the first pool whose groups have its layers' page shapes, layer by layer, else starts
one: GPT-OSS's full and window groups share one pool; DeepSeek-V4's entries and rows
(other shapes: a page holds block_size / rate entries) take one each, and the memory is
split between them (kv_layout.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from atom.layers.kv_cache_part import KVCachePart

# What holds pages: an attention impl, or a part of one.
CacheUser = nn.Module | KVCachePart


def attention_impls(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(m, "bind_kv_cache")]


@dataclass(frozen=True)
class KVCacheGroup:
    sliding_window: int | None  # None: full attention
    layers: tuple[CacheUser, ...]  # their attention impls (or parts of them), in model order
    pool: int = 0  # the page pool its pages come from

    @property
    def label(self) -> str:
        window = self.sliding_window
        kind = "full-attention" if window is None else f"sliding-window({window})"
        return f"{len(self.layers)} {kind} layer{'s' if len(self.layers) != 1 else ''}"


def cache_users(model: nn.Module) -> list[CacheUser]:
    """Each attention impl, or the parts it splits its tensors into (`kv_cache_parts`)."""
    users: list[CacheUser] = []
    for impl in attention_impls(model):
        users.extend(impl.kv_cache_parts() if hasattr(impl, "kv_cache_parts") else [impl])
    return users


def _window(user: CacheUser, max_model_len: int) -> int | None:
    window = user.sliding_window if isinstance(user, KVCachePart) else user.spec.sliding_window
    # A window as long as the longest sequence never drops a token.
    return window if window is not None and window < max_model_len else None


def plan_kv_groups(
    model: nn.Module, max_model_len: int, block_size: int, window_only: bool = True
) -> list[KVCacheGroup]:
    """The model's attention layers by the pages they keep, each group with its pool; one
    group (every layer keeps every page) without `window_only`."""
    if not window_only:
        return [KVCacheGroup(None, tuple(attention_impls(model)))]
    users = cache_users(model)
    windows = sorted({_window(u, max_model_len) for u in users}, key=lambda w: (w is not None, w))
    members = [tuple(u for u in users if _window(u, max_model_len) == w) for w in windows]
    pages = [[_page_shapes(u, block_size) for u in layers] for layers in members]
    pools: list[list[list]] = []  # each pool's groups' page shapes
    pool_of = []
    for shapes in pages:
        pool = next(
            (i for i, groups in enumerate(pools) if all(_same_pages(shapes, g) for g in groups)),
            len(pools),
        )
        if pool == len(pools):
            pools.append([])
        pools[pool].append(shapes)
        pool_of.append(pool)
    groups = [KVCacheGroup(w, m, p) for w, m, p in zip(windows, members, pool_of)]
    return groups or [KVCacheGroup(None, ())]


def _page_shapes(user: CacheUser, block_size: int) -> list[tuple[int, ...]]:
    return [tuple(shape[1:]) for shape in user.kv_cache_shapes(1, block_size)]


def _same_pages(a: list, b: list) -> bool:
    """Whether two groups can share tensors: their j-th layers' pages alike for every j."""
    return all(x == y for x, y in zip(a, b))


def num_pools(groups: list[KVCacheGroup]) -> int:
    return max(g.pool for g in groups) + 1


def shared_slots(groups: list[KVCacheGroup], pool: int) -> list[list[tuple[int, CacheUser]]]:
    """(group index, user) pairs per cache tensor of `pool`: tensor j is the j-th layer of
    each of its groups."""
    members = [(index, g) for index, g in enumerate(groups) if g.pool == pool]
    depth = max(len(g.layers) for _, g in members)
    return [
        [(index, g.layers[j]) for index, g in members if j < len(g.layers)] for j in range(depth)
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
