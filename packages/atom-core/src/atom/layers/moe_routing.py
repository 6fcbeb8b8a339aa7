"""Routing of DeepSeek-style and MiniMax-M2 MoE configs as FusedMoE arguments.

DeepSeek-V2, DeepSeek-V3 and GLM-4.x MoE configs name their router with the same
fields (n_group, topk_group, norm_topk_prob, routed_scaling_factor, and optionally
scoring_func / topk_method). What a config leaves unnamed, its family's reference code
decides: V2 scores experts with a softmax and picks top-k greedily or within the best
groups (greedy / group_limited_greedy); V3 and GLM score with a sigmoid and pick by
score + a learned correction bias within the best groups (noaux_tc). MiniMax-M2 routes
as V3 without groups, always renormalised and unscaled.
"""

from __future__ import annotations

from typing import Any

from atom.config import ConfigError

# model_type -> (scoring function, top-k method) of configs that do not name them
_DEFAULT_ROUTING = {
    "deepseek_v2": ("softmax", "greedy"),
    "deepseek_v3": ("sigmoid", "noaux_tc"),
    "deepseek_v32": ("sigmoid", "noaux_tc"),
    "glm4_moe": ("sigmoid", "noaux_tc"),
    "glm_moe_dsa": ("sigmoid", "noaux_tc"),
}
SCORING_FUNCS = ("sigmoid", "softmax")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


def _named(config: Any, field: str, default: str, known: tuple[str, ...]) -> str:
    value = getattr(config, field, None) or default
    if value not in known:
        raise ConfigError(
            f"config field {field}={value!r} is not supported (ATOM routes with {', '.join(known)})"
        )
    return value


def grouped_topk_routing(config: Any) -> dict[str, Any]:
    """FusedMoE routing arguments of `config`. Always `grouped_topk`, which without
    groups is plain top-k and also applies routed_scaling_factor."""
    scoring, method = _DEFAULT_ROUTING.get(config.model_type, _DEFAULT_ROUTING["deepseek_v2"])
    method = _named(config, "topk_method", method, TOPK_METHODS)
    grouped = method in ("group_limited_greedy", "noaux_tc")
    return dict(
        scoring_func=_named(config, "scoring_func", scoring, SCORING_FUNCS),
        use_grouped_topk=True,
        num_expert_group=config.n_group if grouped else None,
        topk_group=config.topk_group if grouped else None,
        e_score_correction_bias=method == "noaux_tc",
        renormalize=bool(config.norm_topk_prob),
        routed_scaling_factor=config.routed_scaling_factor,
    )


def minimax_m2_routing(config: Any) -> dict[str, Any]:
    """FusedMoE routing arguments of a MiniMax-M2 config besides renormalisation (always
    on), as HF's MiniMaxM2TopKRouter: sigmoid scores, top-k by score + the correction bias
    (`use_routing_bias`), weights from the unbiased scores. `grouped_topk` without groups
    is exactly that."""
    scoring = getattr(config, "scoring_func", None) or "sigmoid"
    if scoring != "sigmoid":
        raise ConfigError(
            f"MiniMax-M2 config field scoring_func={scoring!r} is not supported "
            "(its router scores experts with 'sigmoid')"
        )
    return dict(
        scoring_func=scoring,
        use_grouped_topk=True,
        e_score_correction_bias=bool(getattr(config, "use_routing_bias", True)),
    )
