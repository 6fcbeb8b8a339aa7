"""Steps of a few query tokens per sequence, attended as decodes.

A speculative verify step (the last token and k drafts per sequence) and a drafter's
catch-up give every sequence the same few new tokens. As prefills they would take a kernel
built for long query tiles, mostly empty here; as decodes of a few causal queries each,
every key is read once per sequence and head group, as a decode step reads it. The
decode path reads every key from the pages, so it is also right for the padding rows a
CUDA-graph replay puts in front of a sequence's own (`engine.step_arrays.pad_rows_in_front`),
which write nowhere: their dense K/V are not the cache's.
"""

from __future__ import annotations

from dataclasses import replace

from atom.forward_context import AttentionMetadata

# Up to this many query tokens per sequence attend by the decode kernels (MHA and MLA's
# absorbed path): k + 1 for k <= 7 drafts.
MAX_DECODE_QUERIES = 8


def few_queries_as_decodes(metadata: AttentionMetadata) -> AttentionMetadata:
    """A step whose every sequence has the same few new tokens as decodes of that many
    queries each (num_decode_tokens = queries x num_decodes); other steps unchanged. It
    decides from host-side sizes only, so the step stays capturable in a CUDA graph."""
    n, q = metadata.num_seqs, metadata.max_query_len
    if metadata.num_decodes or not 1 < q <= MAX_DECODE_QUERIES or metadata.num_tokens != n * q:
        return metadata
    return replace(metadata, num_decodes=n, num_decode_tokens=n * q)
