"""`atom demo`: its checkpoint loads with transformers, and the command generates."""

from __future__ import annotations

from transformers import AutoModelForCausalLM, AutoTokenizer

from atom.cli import main
from atom.demo import write_demo_model

TEXT = "the quick brown fox jumps over the lazy dog"


def test_checkpoint_loads_with_transformers(tmp_path):
    write_demo_model(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == TEXT
    model = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.vocab_size == len(tokenizer)
    assert (tmp_path / "model.safetensors").is_file()


def test_demo_command_generates(tmp_path, capsys):
    main(["demo", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "prompt:     'the quick brown fox'" in out and "completion:" in out
