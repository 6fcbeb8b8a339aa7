"""What ATOM's MTP drafter (`atom_vllm.mtp`) relies on in vLLM, checked without an engine:
the draft architectures vLLM asks for, and which of them vLLM expects to return the
hidden state for the next draft step apart from the one for the logits."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm.model_executor.models.registry import _VLLM_MODELS
from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

from atom.speculative.config import MTP_RECYCLES_NORMED
from atom_vllm import MTP_DRAFT_ARCHITECTURES


@pytest.mark.parametrize(
    "draft,target",
    [(draft, target) for draft, targets in MTP_DRAFT_ARCHITECTURES.items() for target in targets],
)
def test_vllm_unpacks_the_drafters_output_as_atom_returns_it(draft, target):
    """A family whose next draft reads the normed output returns (output, normed): vLLM
    must unpack exactly those drafters' outputs."""
    assert draft in _VLLM_MODELS  # vLLM's own drafter, which ATOM's replaces
    proposer = SimpleNamespace(
        method="mtp",
        draft_model_config=SimpleNamespace(hf_config=SimpleNamespace(architectures=[draft])),
    )
    assert SpecDecodeBaseProposer.model_returns_tuple(proposer) == MTP_RECYCLES_NORMED[target]
