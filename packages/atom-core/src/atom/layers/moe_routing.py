"""Routing of DeepSeek-style MoE configs as FusedMoE arguments.

DeepSeek-V2, DeepSeek-V3 and GLM-4.x MoE configs name their router with the same
fields (n_group, topk_group, norm_topk_prob, routed_scaling_factor, and optionally
scoring_func / topk_method). What a config leaves unnamed, its family's reference code
decides: V2 scores experts with a softmax and picks top-k greedily or within the best
groups (greedy / group_limited_greedy); V3 and GLM score with a sigmoid and pick by
score + a learned correction bias within the best groups (noaux_tc).
"""

from __future__ import annotations

from typing import Any

# model_type -> (scoring function, top-k method) of configs that do not name them
_DEFAULT_ROUTING = {
    "deepseek_v2": ("softmax", "greedy"),
    "deepseek_v3": ("sigmoid", "noaux_tc"),
    "glm4_moe": ("sigmoid", "noaux_tc"),
}


def grouped_topk_routing(config: Any) -> dict[str, Any]:
    """FusedMoE routing arguments of `config`. Always `grouped_topk`, which without
    groups is plain top-k and also applies routed_scaling_factor."""
    scoring, method = _DEFAULT_ROUTING.get(config.model_type, _DEFAULT_ROUTING["deepseek_v2"])
    method = getattr(config, "topk_method", None) or method
    grouped = method in ("group_limited_greedy", "noaux_tc")
    return dict(
        scoring_func=getattr(config, "scoring_func", None) or scoring,
        use_grouped_topk=True,
        num_expert_group=config.n_group if grouped else None,
        topk_group=config.topk_group if grouped else None,
        e_score_correction_bias=method == "noaux_tc",
        renormalize=bool(config.norm_topk_prob),
        routed_scaling_factor=config.routed_scaling_factor,
    )
