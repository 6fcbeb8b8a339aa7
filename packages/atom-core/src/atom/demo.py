"""`atom demo`: build a tiny random Llama with a locally trained tokenizer, then generate.

Everything is made on this machine: no hub, no network.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "the",
    "lazy",
    "dog",
    "while",
    "a",
    "small",
    "cat",
    "watches",
    "from",
    "the",
    "warm",
    "window",
    "and",
    "the",
    "old",
    "man",
    "reads",
    "his",
    "paper",
    "in",
    "the",
    "quiet",
    "morning",
    "light",
    "a",
    "river",
    "runs",
    "past",
    "green",
    "hills",
    "where",
    "children",
    "play",
    "and",
    "birds",
    "sing",
    "their",
    "songs",
    "to",
    "the",
    "bright",
    "blue",
    "sky",
    "every",
    "day",
    "brings",
    "new",
    "stories",
    "to",
    "tell",
    "about",
    "friends",
    "and",
    "family",
    "near",
    "and",
    "far",
    "away",
]

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


def build_tokenizer(vocab_size: int):
    """A word-level tokenizer over the demo words, padded to exactly `vocab_size` entries."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    words = list(dict.fromkeys(WORDS)) + [":", "user", "assistant", "system"]
    vocab = {token: i for i, token in enumerate(specials + words)}
    for i in range(len(vocab), vocab_size):
        vocab[f"<extra_{i}>"] = i
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()]
    )
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def write_demo_model(folder: str | Path, vocab_size: int = 128, seed: int = 0) -> Path:
    """Writes a tiny random LlamaForCausalLM (fp32, safetensors) and its tokenizer."""
    return write_tiny_llama(folder, build_tokenizer(vocab_size), vocab_size, 256, seed)


def write_tiny_llama(
    folder: str | Path, tokenizer, vocab_size: int, max_position_embeddings: int, seed: int
) -> Path:
    """A tiny random LlamaForCausalLM (fp32) with `tokenizer`'s special tokens, saved
    with it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = Path(folder)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


def serve_one_request(llm, prompt: str) -> dict:
    """Starts the OpenAI server on a free loopback port, sends one completion, stops."""
    import socket
    import threading

    import httpx
    import uvicorn

    from atom.server import AsyncEngine, build_app

    engine = AsyncEngine(llm.engine)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(build_app(engine, "demo"), port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(100):  # up to 10 s for the server to come up
            try:
                httpx.get(f"{url}/health", timeout=1).raise_for_status()
                break
            except httpx.HTTPError:
                threading.Event().wait(0.1)
        body = {"model": "demo", "prompt": prompt, "max_tokens": 16, "temperature": 0}
        return httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        engine.shutdown()


def run_demo(out: str | None = None) -> None:
    from atom import LLM, SamplingParams

    folder = Path(out) if out else Path(tempfile.mkdtemp(prefix="atom-demo-"))
    write_demo_model(folder)
    print(f"wrote a tiny random Llama and its tokenizer to {folder}")
    llm = LLM(model=str(folder), dtype="float32", device="cpu")
    prompts = ["the quick brown fox", "a river runs past"]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for output in llm.generate(prompts, params):
        print(f"prompt:     {output.prompt!r}\ncompletion: {output.outputs[0].text!r}")
    response = serve_one_request(llm, prompts[0])
    print(f"served /v1/completions: {response['choices'][0]['text']!r}")
