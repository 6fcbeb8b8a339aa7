"""Prometheus metrics in the text exposition format (written by hand: no extra dependency)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from atom.engine.llm_engine import EngineStats

FINISH_REASONS = ("stop", "length", "abort")


@dataclass
class ServingCounters:
    """Totals since start; the engine thread updates them, /metrics reads them."""

    requests: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    # Seeded so every reason is exported (and the dict never grows while being read).
    finished: Counter[str] = field(
        default_factory=lambda: Counter(dict.fromkeys(FINISH_REASONS, 0))
    )


def render_metrics(stats: EngineStats, counters: ServingCounters) -> str:
    finished = dict(counters.finished)
    families = [
        ("atom_requests_total", "counter", "Engine requests admitted (one per prompt).",
         {"": counters.requests}),
        ("atom_requests_finished_total", "counter", "Engine requests ended, by finish reason.",
         {f'{{finish_reason="{reason}"}}': n for reason, n in sorted(finished.items())}),
        ("atom_num_requests_running", "gauge", "Sequences in the running batch.",
         {"": stats.num_running}),
        ("atom_num_requests_waiting", "gauge", "Sequences waiting to be scheduled.",
         {"": stats.num_waiting}),
        ("atom_prompt_tokens_total", "counter", "Prompt tokens prefilled.",
         {"": counters.prompt_tokens}),
        ("atom_generation_tokens_total", "counter", "Tokens generated.",
         {"": counters.generation_tokens}),
        ("atom_kv_cache_usage_perc", "gauge", "Fraction of KV cache blocks in use (0 to 1).",
         {"": stats.kv_cache_usage}),
        ("atom_kv_cache_free_blocks", "gauge", "KV cache blocks free.",
         {"": stats.num_free_blocks}),
        ("atom_kv_cache_blocks", "gauge", "KV cache blocks in all.", {"": stats.num_blocks}),
        ("atom_prefix_cache_queries_total", "counter",
         "Prompt tokens looked up in the prefix cache.", {"": stats.prefix_cache_queries}),
        ("atom_prefix_cache_hits_total", "counter", "Prompt tokens served by the prefix cache.",
         {"": stats.prefix_cache_hits}),
        ("atom_num_preemptions_total", "counter", "Sequences preempted to free KV blocks.",
         {"": stats.num_preemptions}),
    ]  # fmt: skip
    lines = []
    for name, kind, help_text, samples in families:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        lines += [f"{name}{labels} {value}" for labels, value in samples.items()]
    return "\n".join(lines) + "\n"
