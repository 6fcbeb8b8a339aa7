"""The decode-graph input path (staged buffers, padding to a captured size) on the CPU:
"replaying" runs the model eagerly on the static buffers (StepGraphs' capture=False), so
the tokens equal the plain eager engine's only if run() fills those buffers right."""

from __future__ import annotations

from atom import LLM, SamplingParams
from tests.models.harness import make_prompts, write_checkpoint
from tests.models.test_llama import qwen3_config


def test_staged_decode_inputs_give_eager_tokens(tmp_path):
    folder = write_checkpoint(qwen3_config(), tmp_path, init_std=0.1)
    prompts = make_prompts(256, [3, 17, 5, 30, 9], seed=8)
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (9, 4, 12, 7, 10)
    ]
    outputs = {}
    for staged in (False, True):
        llm = LLM(str(folder), dtype="float32", skip_tokenizer_init=True, block_size=4)
        runner = llm.engine.executor.runner
        if staged:
            runner.capture_cuda_graphs(8, 64, capture=False)
            assert runner.decode_graphs.sizes == [1, 2, 4, 8]
        outputs[staged] = [
            o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)
        ]
        if staged:
            assert runner.decode_graphs.replays >= 8  # every pure-decode step went through it
    assert outputs[True] == outputs[False]
