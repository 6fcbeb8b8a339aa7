"""Do the engines of one bench run generate the same greedy tokens?

Every engine gets the same prompts for a seed and decodes greedily, so each ATOM engine
is compared with its host's own model (`vllm-atom` with `vllm`, `sglang-atom` with
`sglang`) and ATOM's native engine with the baseline. In bf16 two implementations may
part ways where two logits tie within rounding; the common prefix says how far they went
together before that.
"""

from __future__ import annotations


def reference_of(engine: str, baseline: str) -> str | None:
    """The engine whose tokens `engine`'s are compared with, or None."""
    if engine.endswith("-atom"):
        return engine.removesuffix("-atom")
    if engine == "atom" and baseline != "atom":
        return baseline
    return None


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def agreement(results: list[dict], baseline: str) -> list[dict]:
    """Per shape, workload and compared pair: prompts with identical tokens and the mean
    common prefix, over the prompts both engines sampled."""
    samples = {
        (r["shape"], r["workload"], r["engine"]): r["greedy_sample"]
        for r in results
        if r.get("greedy_sample")
    }
    rows = []
    for (shape, workload, engine), tokens in samples.items():
        reference = reference_of(engine, baseline)
        want = samples.get((shape, workload, reference))
        if want is None:
            continue
        pairs = list(zip(tokens, want))
        prefixes = [common_prefix(got, ref) for got, ref in pairs]
        rows.append(
            dict(
                shape=shape,
                workload=workload,
                engine=engine,
                reference=reference,
                prompts=len(pairs),
                identical=sum(got == ref for got, ref in pairs),
                mean_common_prefix=sum(prefixes) / len(pairs),
                output_len=max(len(ref) for ref in want),
            )
        )
    return rows


def format_agreement(rows: list[dict]) -> str:
    lines = ["greedy tokens (same prompts, temperature 0):"]
    for r in rows:
        lines.append(
            f"  {r['shape']} {r['workload']}: {r['engine']} vs {r['reference']}: "
            f"{r['identical']}/{r['prompts']} prompts identical, mean common prefix "
            f"{r['mean_common_prefix']:.1f} of {r['output_len']} tokens"
        )
    return "\n".join(lines)
