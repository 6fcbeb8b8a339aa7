"""`atom generate` prints the same greedy completions as the offline API."""

from __future__ import annotations

from atom import LLM, SamplingParams
from atom.cli import main
from atom.demo import write_demo_model


def test_generate_matches_offline_api(tmp_path, capsys):
    folder = write_demo_model(tmp_path / "demo")
    prompts = ["the quick brown fox", "a small cat"]
    main(
        [
            "generate",
            str(folder),
            "--max-tokens",
            "6",
            *[a for p in prompts for a in ("--prompt", p)],
        ]
    )
    printed = capsys.readouterr().out.splitlines()
    llm = LLM(model=str(folder), dtype="float32")
    expected = [
        o.outputs[0].text
        for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    ]
    assert printed == expected
