"""Data-parallel attention on 2 GPUs (NCCL, Triton kernels): each GPU runs its own batch
with the whole MLA attention and half of the experts, and the greedy tokens equal HF
transformers' in fp32, with either token exchange (all2all_backend: NCCL's reduce-scatter,
all_to_all_single with uneven and zero splits). Decode steps replay captured graphs, every
rank the same size (atom.engine.data_parallel_graphs), and give the eager engine's tokens;
under all_to_all nothing is captured. One command on the lent 2-GPU machine:
`pytest -m gpu tests/engine/test_gpu_data_parallel.py`."""

from __future__ import annotations

import pytest
import torch

from atom import LLM, SamplingParams
from tests.engine.test_data_parallel_graph_inputs import MAX_TOKENS, PROMPTS
from tests.engine.test_gpu_engine import check_greedy_on_gpu
from tests.models.harness import check_greedy_generation, write_with_random_vectors
from tests.models.test_deepseek import CASES as DEEPSEEK_CASES

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
    pytest.mark.usefixtures("hf_v2_group_limited_greedy"),
]

CASES = {
    "deepseek-v2-mla": DEEPSEEK_CASES["v2-group-limited-qlora-dense1"],
    "deepseek-v3-mla": DEEPSEEK_CASES["v3-grouped-qlora-dense1"],
}
DATA_PARALLEL = dict(data_parallel_size=2, enable_expert_parallel=True)


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cuda-graphs"])
@pytest.mark.parametrize("name", list(CASES))
def test_gpu_data_parallel_attention_greedy_matches_hf(tmp_path, name, enforce_eager):
    check_greedy_on_gpu(
        write_with_random_vectors(CASES[name], tmp_path), enforce_eager, **DATA_PARALLEL
    )


@pytest.mark.parametrize("name", list(CASES))
def test_gpu_data_parallel_all_to_all_greedy_matches_hf(tmp_path, name):
    check_greedy_on_gpu(
        write_with_random_vectors(CASES[name], tmp_path),
        True,
        **DATA_PARALLEL,
        all2all_backend="all_to_all",
    )


@pytest.mark.parametrize("all2all_backend", ["allgather_reducescatter", "all_to_all"])
def test_gpu_data_parallel_idle_rank_runs_zero_token_steps(tmp_path, all2all_backend):
    """One prompt on two GPUs: the other rank's forwards have no tokens (empty attention
    metadata, zero-row routing) and its MoE collectives still meet rank 0's."""
    folder = write_with_random_vectors(CASES["deepseek-v3-mla"], tmp_path)
    check_greedy_generation(
        folder, [37], 12, device="cuda", **DATA_PARALLEL, all2all_backend=all2all_backend
    )


def test_gpu_data_parallel_decode_graphs_equal_eager(tmp_path):
    """Captured decode graphs under DP (the CPU test's schedule: uneven ranks, an idle one,
    a prefill mid-run) give the eager engine's tokens; all_to_all asks for them and runs
    eagerly."""
    folder = write_with_random_vectors(CASES["deepseek-v3-mla"], tmp_path)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    runs = {}
    for eager, backend in [(True, "allgather_reducescatter"), (False, "allgather_reducescatter"),
                           (False, "all_to_all")]:  # fmt: skip
        llm = LLM(
            str(folder),
            dtype="float32",
            device="cuda",
            skip_tokenizer_init=True,
            enforce_eager=eager,
            max_num_seqs=3,
            kv_cache_memory_bytes=64 << 20,
            all2all_backend=backend,
            **DATA_PARALLEL,
        )
        try:
            graphs = llm.engine.executor.runner.decode_graphs
            captured = not eager and backend == "allgather_reducescatter"
            assert (graphs is not None) == captured
            outputs = llm.generate(PROMPTS, params, use_tqdm=False)
            runs[eager, backend] = [o.outputs[0].token_ids for o in outputs]
            if captured:
                assert graphs.capture and graphs.replays > 0
        finally:
            llm.engine.shutdown()
    assert all(run == runs[True, "allgather_reducescatter"] for run in runs.values())
