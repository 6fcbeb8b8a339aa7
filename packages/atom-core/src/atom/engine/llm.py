"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`, like vLLM's."""

from __future__ import annotations

import weakref

import torch
from tqdm.auto import tqdm

from atom.config import CacheConfig, ConfigError, EngineConfig, ModelConfig, ParallelConfig
from atom.engine.llm_engine import LLMEngine
from atom.engine.outputs import RequestOutput
from atom.hub import resolve_model_path
from atom.sampling_params import SamplingParams
from atom.speculative.config import SpeculativeConfig

# A text, token ids, or vLLM's dict forms: {"prompt": text} (TextPrompt) and
# {"prompt_token_ids": ids} (TokensPrompt).
Prompt = str | list[int] | dict
CPU_DEFAULT_KV_CACHE_BYTES = 256 << 20


def default_batch_limits(device: str) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) when not given: vLLM's defaults for its
    offline `LLM` on the same device (vllm/engine/arg_utils.py, get_batch_defaults), so
    that both engines batch a workload alike: 1024 sequences and 16,384 tokens on GPUs of
    70 GiB or more other than the A100, 256 and 8,192 elsewhere."""
    # Without a visible GPU the engine's own checks name what is missing.
    if device.startswith("cuda") and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.device(device))
        if props.total_memory >= 70 * 2**30 and "a100" not in props.name.lower():
            return 1024, 16384
    return 256, 8192


class LLM:
    def __init__(
        self,
        model: str,
        dtype: str | torch.dtype | None = None,
        device: str = "cpu",
        max_model_len: int | None = None,
        block_size: int = 16,
        kv_cache_memory_bytes: int | None = None,
        num_blocks: int | None = None,
        kv_cache_dtype: str = "auto",
        mamba_ssm_cache_dtype: str = "auto",
        window_only_kv: bool = True,
        gpu_memory_utilization: float = 0.9,
        enable_prefix_caching: bool = True,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        tensor_parallel_size: int = 1,
        enable_expert_parallel: bool = False,
        data_parallel_size: int = 1,
        all2all_backend: str = "allgather_reducescatter",
        enforce_eager: bool = False,
        compile: bool = False,
        skip_tokenizer_init: bool = False,
        async_scheduling: bool | None = None,
        speculative_config: dict | None = None,
        seed: int = 0,
    ):
        """model: a local HF checkpoint folder or a hub id (read from huggingface_hub's
        cache, downloaded if missing). seed: seeds the random sampling of requests
        that give no seed of their own (vLLM's `seed`). speculative_config: as vLLM's,
        e.g. {"method": "mtp", "num_speculative_tokens": 3} (atom.speculative.config).
        data_parallel_size: MLA models, with enable_expert_parallel: that many GPUs (CPU
        processes), each with the whole attention, its own KV cache and its own batch, the
        MoE experts split over them; max_num_seqs and max_num_batched_tokens are per rank,
        and stats() sums the ranks' pools (docs/architecture.md, "Parallelism").
        all2all_backend: how those ranks' tokens reach the experts, as vLLM's option:
        "allgather_reducescatter" (every token to every rank) or "all_to_all" (each token
        to its experts' ranks only, after a host sync per MoE layer)."""
        speculative = (
            SpeculativeConfig.from_dict(speculative_config) if speculative_config else None
        )
        model = resolve_model_path(model)
        model_config = ModelConfig.from_pretrained(model, dtype=dtype, max_model_len=max_model_len)
        if kv_cache_memory_bytes is None and num_blocks is None and device == "cpu":
            kv_cache_memory_bytes = CPU_DEFAULT_KV_CACHE_BYTES
        default_seqs, default_tokens = default_batch_limits(device)
        config = EngineConfig(
            model=model_config,
            cache=CacheConfig(
                block_size=block_size,
                num_blocks=num_blocks,
                kv_cache_memory_bytes=kv_cache_memory_bytes,
                kv_cache_dtype=kv_cache_dtype,
                mamba_ssm_cache_dtype=mamba_ssm_cache_dtype,
                window_only_kv=window_only_kv,
                gpu_memory_utilization=gpu_memory_utilization,
                enable_prefix_caching=enable_prefix_caching,
            ),
            parallel=ParallelConfig(
                tensor_parallel_size, enable_expert_parallel, data_parallel_size, all2all_backend
            ),
            device=device,
            max_num_seqs=max_num_seqs or default_seqs,
            max_num_batched_tokens=max_num_batched_tokens
            or max(default_tokens, model_config.max_model_len),
            enforce_eager=enforce_eager,
            compile=compile,
            speculative=speculative,
            seed=seed,
        )
        tokenizer = None if skip_tokenizer_init else load_tokenizer(model)
        self.engine = LLMEngine(config, tokenizer, async_scheduling)
        # Worker processes of a tensor-parallel engine end with the LLM object.
        weakref.finalize(self, self.engine.shutdown)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = [_text_or_ids(p) for p in prompts]
        params = sampling_params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} sampling params for {len(prompts)} prompts")
        ids = []
        try:
            for prompt, p in zip(prompts, params_list):
                ids.append(self.engine.add_request(prompt, p))
        except ValueError:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Applies the model's chat template, then generates."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer (skip_tokenizer_init was set)")
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [
            self.tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False)
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Generating", disable=not use_tqdm, unit="req")
        while self.engine.has_unfinished_requests():
            for output in self.engine.step(finished_only=True):
                results[output.request_id] = output
                bar.update(1)
        bar.close()
        return [results[i] for i in request_ids]


def _text_or_ids(prompt: Prompt) -> str | list[int]:
    if not isinstance(prompt, dict):
        return prompt
    forms = [key for key in ("prompt", "prompt_token_ids") if key in prompt]
    if len(forms) != 1:
        raise ValueError(
            "a dict prompt needs exactly one of 'prompt' (text) and 'prompt_token_ids', "
            f"got the keys {sorted(prompt)}"
        )
    return prompt[forms[0]]


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"cannot load a tokenizer from {path!r} ({exc}); pass skip_tokenizer_init=True "
            "to run token-id prompts without one"
        ) from exc
