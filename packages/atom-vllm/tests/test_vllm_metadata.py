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


def test_bridge_makes_one_metadata_of_every_kv_cache_group():
    """vLLM gives each KV-cache group its own metadata object (a sliding-window group and
    several state groups here); the bridge numbers the groups in ATOM's layer order, tells
    each layer its group, and puts every group's tables into one object with the
    positions the model was called with."""
    from types import SimpleNamespace

    from atom.hosts.state import with_state_slots
    from atom_vllm.step import StepBridge

    full = to_atom_metadata(common_metadata([1, 3], [5, 0], 4, 64, seed=1))
    window = to_atom_metadata(common_metadata([1, 3], [5, 0], 4, 64, seed=2))
    states = [
        with_state_slots(
            to_atom_metadata(common_metadata([1, 3], [5, 0], 4, 64, seed=seed)),
            torch.tensor([seed, seed + 1]),
            torch.tensor([5, 0]),
        )
        for seed in (3, 4)
    ]
    layers = ["l0.linear", "l1.attn", "l2.linear", "l3.attn"]
    per_layer = dict(zip(layers, [states[0], full, states[1], window]))
    members = [SimpleNamespace(layer_name=name, kv_group=None) for name in layers]
    bridge = StepBridge(members)
    positions = torch.tensor([5, 0, 1, 2])
    step = bridge.combine(per_layer, positions)
    assert [m.kv_group for m in members] == [0, 1, 2, 3]
    assert step.positions is positions
    for member in members:
        group = per_layer[member.layer_name]
        seen = step.for_kv_group(member.kv_group)
        assert seen.block_table is group.block_table
        assert seen.slot_mapping is group.slot_mapping
        if group.state_slots is not None:
            assert seen.state_slots is group.state_slots
    assert step.has_initial_state.tolist() == [True, False]
    assert bridge.combine({}, positions) is None and bridge.combine(None, positions) is None
    # Later steps: the same numbering, without asking the layers again.
    members[0].kv_group = "unchanged"
    assert bridge.combine(per_layer, positions).for_kv_group(3).block_table is window.block_table
    assert members[0].kv_group == "unchanged"
