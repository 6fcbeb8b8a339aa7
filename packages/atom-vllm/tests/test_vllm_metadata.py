"""The metadata bridge: vLLM's CommonAttentionMetadata as ATOM's schema (the builders), and
vLLM's per-layer metadata as the step's one complete AttentionMetadata (atom_vllm.step)."""

from __future__ import annotations

import torch
from vllm_steps import common_metadata

from atom.forward_context import AttentionMetadata
from atom_vllm.backend import (
    to_atom_metadata,
)


def test_metadata_builder_maps_common_metadata_onto_atom_schema():
    cm = common_metadata([1, 1, 5, 9], [7, 20, 0, 4], block_size=4, num_blocks=64)
    md = to_atom_metadata(cm)
    assert isinstance(md, AttentionMetadata)
    assert (md.num_decodes, md.num_decode_tokens, md.num_prefills) == (2, 2, 2)
    assert md.host_query_start_loc() == [0, 1, 2, 7, 16]
    assert md.host_seq_lens() == [8, 21, 5, 13]
    assert md.slot_mapping.dtype == torch.int64 and md.num_tokens == 16
    assert (md.max_query_len, md.max_seq_len) == (9, 21)
    assert md.block_table is cm.block_table_tensor or torch.equal(
        md.block_table, cm.block_table_tensor
    )
