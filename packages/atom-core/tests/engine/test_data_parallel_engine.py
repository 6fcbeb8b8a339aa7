"""`LLM(data_parallel_size=2, enable_expert_parallel=True)` on CPU (gloo): each rank holds
the whole attention and half of the experts, its own KV cache and its own batch, and the
greedy tokens equal HF transformers' in fp32 while requests are admitted mid-run, finish
at different steps, hit the prefix cache, are aborted, or leave a rank with nothing to
run (it runs zero-token steps so the MoE collectives of the other rank complete)."""

from __future__ import annotations

import pytest

from atom import LLM, SamplingParams
from atom.all_to_all_tokens import AllToAllTokens
from atom.expert_parallel import get_expert_parallel
from atom.layers.moe import FusedMoE
from atom.testing import references
from tests.engine.test_logits_processors import AllowedSet
from tests.models.harness import make_prompts, write_with_random_vectors
from tests.models.test_deepseek import CASES as DEEPSEEK_CASES

CASES = {
    "deepseek-v2-mla": DEEPSEEK_CASES["v2-group-limited-qlora-dense1"],
    "deepseek-v3-mla": DEEPSEEK_CASES["v3-grouped-qlora-dense1"],
}
# A shared 12-token prefix (3 pages of 4), then tails of different lengths.
PREFIX = make_prompts(256, [12], seed=3)[0]
TAILS = make_prompts(256, [1, 9, 3, 14, 5, 2, 7], seed=7)
MAX_TOKENS = [2, 12, 4, 9, 1, 11, 6]  # finishing at very different steps
ENGINE = dict(dtype="float32", skip_tokenizer_init=True, block_size=4)
DATA_PARALLEL = dict(data_parallel_size=2, enable_expert_parallel=True)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.mark.usefixtures("hf_v2_group_limited_greedy")
@pytest.mark.parametrize("name", list(CASES))
def test_data_parallel_attention_greedy_matches_hf(tmp_path, name):
    folder = write_with_random_vectors(CASES[name], tmp_path)
    prompts = [PREFIX + tail for tail in TAILS]
    expected = references.hf_greedy(folder, prompts, max_tokens=max(MAX_TOKENS))
    llm = LLM(
        str(folder),
        **ENGINE,
        **DATA_PARALLEL,
        num_blocks=64,
        max_num_seqs=2,  # per rank: 7 prompts over 2 x 2 seats, admitted while others run
    )
    engine = llm.engine
    try:
        layers = [m for m in engine.model.modules() if isinstance(m, FusedMoE)]
        assert layers and all(m.w13_weight.shape[0] == m.num_experts // 2 for m in layers)

        outputs = llm.generate(prompts, [greedy(n) for n in MAX_TOKENS], use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == [
            e[:n] for e, n in zip(expected, MAX_TOKENS)
        ]
        stats = engine.stats()
        assert stats.prefix_cache_hits > 0  # later admissions reuse their rank's prefix
        assert stats.num_blocks == 2 * 64 and stats.num_free_blocks == stats.num_blocks
        assert stats.num_running == stats.num_waiting == 0
        assert all(bm.num_free_blocks == 64 for bm in engine.scheduler.block_managers)

        # One request on two ranks: rank 1 runs a zero-token step every step.
        (alone,) = llm.generate([prompts[3]], greedy(10), use_tqdm=False)
        assert alone.outputs[0].token_ids == expected[3][:10]

        # An abort mid-run frees its pages on its own rank; the others go on unchanged.
        ids = [engine.add_request(prompts[i], greedy(10)) for i in (1, 4, 6)]
        for _ in range(3):
            engine.step()
        engine.abort_request(ids[1])
        done = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    done[output.request_id] = output.outputs[0].token_ids
        assert done == {ids[0]: expected[1][:10], ids[2]: expected[6][:10]}
        assert engine.stats().num_free_blocks == 2 * 64
    finally:
        engine.shutdown()


@pytest.mark.usefixtures("hf_v2_group_limited_greedy")
def test_data_parallel_preemption_stays_within_a_rank(tmp_path):
    """Pools of 9 pages of 4 tokens per rank hold one of these sequences (up to 8 pages)
    but not two: each rank preempts within its own block manager and recomputes, and the
    tokens stay HF's. The tokens reach the experts by all-to-all here (the test above:
    all-gather + reduce-scatter)."""
    folder = write_with_random_vectors(CASES["deepseek-v2-mla"], tmp_path)
    prompts = make_prompts(256, [17, 9, 20, 12], seed=11)
    expected = references.hf_greedy(folder, prompts, max_tokens=12)
    llm = LLM(
        str(folder),
        **ENGINE,
        **DATA_PARALLEL,
        num_blocks=9,
        enable_prefix_caching=False,
        all2all_backend="all_to_all",
    )
    try:
        assert isinstance(get_expert_parallel().exchange, AllToAllTokens)
        outputs = llm.generate(prompts, greedy(12), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        assert all(s.num_preemptions > 0 for s in llm.engine.scheduler.schedulers)
        assert llm.engine.stats().num_free_blocks == 2 * 9
    finally:
        llm.engine.shutdown()


def test_data_parallel_sampling_features_equal_the_single_process_engine(tmp_path):
    """What a rank's sampler reads comes from rank 0 (atom.engine.rank_sampling): seeded
    draws, penalties, logit bias, a guide's mask, EOS blocked under min_tokens, logprobs and
    prompt logprobs give what the single-process engine gives."""
    folder = write_with_random_vectors(CASES["deepseek-v3-mla"], tmp_path)
    prompts = make_prompts(256, [6, 13, 4, 9], seed=5)
    eos = 7
    params = [
        SamplingParams(temperature=0.9, seed=11, top_k=40, max_tokens=9, logprobs=2),
        SamplingParams(
            temperature=0.7, seed=3, repetition_penalty=1.3, presence_penalty=0.5,
            max_tokens=7, prompt_logprobs=1, logit_bias={5: 3.0},
        ),
        SamplingParams(temperature=0.0, max_tokens=6, guide_factory=lambda: AllowedSet(list(range(0, 256, 3)))),
        SamplingParams(temperature=0.0, max_tokens=8, min_tokens=4, logit_bias={eos: 50.0}),
    ]  # fmt: skip
    outputs = {}
    for name, extra in {"single": {}, "dp": DATA_PARALLEL}.items():
        llm = LLM(str(folder), **ENGINE, **extra, num_blocks=64)
        llm.engine.eos_token_ids = {eos}
        try:
            outputs[name] = llm.generate(prompts, params, use_tqdm=False)
        finally:
            llm.engine.shutdown()
    for single, dp in zip(outputs["single"], outputs["dp"]):
        a, b = single.outputs[0], dp.outputs[0]
        assert (b.token_ids, b.finish_reason) == (a.token_ids, a.finish_reason)
        assert b.cumulative_logprob == pytest.approx(a.cumulative_logprob, abs=1e-4)
        assert [e.keys() for e in b.logprobs or []] == [e.keys() for e in a.logprobs or []]
        assert [e and e.keys() for e in dp.prompt_logprobs or []] == [
            e and e.keys() for e in single.prompt_logprobs or []
        ]
    guided, bounded = outputs["dp"][2].outputs[0], outputs["dp"][3].outputs[0]
    assert all(t % 3 == 0 for t in guided.token_ids)
    assert eos not in bounded.token_ids[:4] and bounded.token_ids[4:] == [eos]
    assert bounded.finish_reason == "stop"
    assert outputs["dp"][1].prompt_logprobs is not None
