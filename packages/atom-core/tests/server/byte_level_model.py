"""A tiny random Llama with a byte-level BPE tokenizer trained here, and a Qwen-style chat
template that renders tools: any text (JSON included) can be written with it, as with a
real model's tokenizer, which word-level demo tokenizers cannot do."""

from __future__ import annotations

from pathlib import Path

from atom.demo import write_tiny_llama

VOCAB_SIZE = 384
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Special, as in some real tokenizers: decoding drops them unless a tool-call request keeps
# them (the server does, as vLLM's parsers do).
TOOL_TAGS = ["<tool_call>", "</tool_call>"]

CORPUS = [
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    '{"answer": true, "count": 12, "items": ["red", "green", "blue"], "value": null}',
    "The quick brown fox jumps over the lazy dog while the cat watches.",
    "user assistant system tool call result weather city temperature 0123456789",
]

CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call these tools:\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    'Answer with <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>\n'
    "{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(TOOL_TAGS),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    fast.add_tokens(TOOL_TAGS, special_tokens=True)
    fast.chat_template = CHAT_TEMPLATE
    assert len(fast) <= VOCAB_SIZE
    return fast


def write_byte_level_model(folder: Path, seed: int = 0) -> Path:
    return write_tiny_llama(folder, build_tokenizer(), VOCAB_SIZE, 1024, seed)
