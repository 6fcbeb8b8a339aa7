"""`speculative_config`: which drafter, how many tokens, and the checks made before loading."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from atom.config import ConfigError, EngineConfig
from atom.loader import checkpoint_tensor_names

METHODS = ("mtp", "eagle3")
# Architectures whose checkpoints carry MTP layers ATOM runs (`num_nextn_predict_layers`
# of them) after their decoder layers: whether the next draft reads the layer's normed
# output (mtp.MtpDrafter).
# GLM-5's MTP is DeepSeek-V3.2's (vLLM 0.32 runs both as DeepseekV32MTPModel).
MTP_RECYCLES_NORMED = {
    "DeepseekV3ForCausalLM": True, "DeepseekV32ForCausalLM": True,
    "GlmMoeDsaForCausalLM": True, "Glm4MoeForCausalLM": False,
}  # fmt: skip
# Architectures whose checkpoints carry an `mtp.*` module (qwen3_next_mtp).
MTP_MODULE = (
    "Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
    "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration",
)  # fmt: skip


@dataclass(frozen=True)
class SpeculativeConfig:
    """method: "mtp" (the checkpoint's own multi-token-prediction layers) or "eagle3"
    (an EAGLE-3 drafter in the folder `model`).
    num_speculative_tokens: drafts per step and sequence.
    forced_acceptance: for benchmarks only, each draft is accepted with this probability
    whatever the target says (the output then no longer follows the target), so the
    mechanism's cost is measured apart from a random checkpoint's acceptance."""

    method: str
    num_speculative_tokens: int
    model: str | None = None
    forced_acceptance: float | None = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SpeculativeConfig:
        if not isinstance(raw, dict):
            raise ConfigError(f"speculative_config must be a dict, not {type(raw).__name__}")
        known = {"method", "num_speculative_tokens", "model", "forced_acceptance"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(
                f"speculative_config has unknown field(s) {unknown}; known: {sorted(known)}"
            )
        if "method" not in raw or "num_speculative_tokens" not in raw:
            raise ConfigError("speculative_config needs 'method' and 'num_speculative_tokens'")
        config = cls(
            raw["method"],
            raw["num_speculative_tokens"],
            raw.get("model"),
            raw.get("forced_acceptance"),
        )
        config.validate()
        return config

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(
                f"speculative method {self.method!r} is not supported; use one of {list(METHODS)}"
            )
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ConfigError(f"num_speculative_tokens must be an integer >= 1, got {k!r}")
        if self.method == "eagle3" and not self.model:
            raise ConfigError("speculative method 'eagle3' needs 'model': the drafter's folder")
        if self.method == "mtp" and self.model:
            raise ConfigError(
                "speculative method 'mtp' runs the target checkpoint's own MTP layers; "
                "'model' is for 'eagle3'"
            )
        rate = self.forced_acceptance
        if rate is not None and not (isinstance(rate, (int, float)) and 0.0 <= rate <= 1.0):
            raise ConfigError(f"forced_acceptance must be in [0, 1], got {rate!r}")

    def check_model(self, hf_config: Any, architecture: str, folder: str) -> None:
        """Fails before loading where the checkpoint (or drafter) cannot serve this method."""
        if self.method == "eagle3":
            from atom.speculative.eagle3 import read_drafter_config

            read_drafter_config(self.model, hf_config, architecture)
            return
        field = "num_nextn_predict_layers"
        if architecture in MTP_MODULE:
            from atom.speculative.qwen3_next_mtp import MTP_WEIGHT

            if MTP_WEIGHT not in checkpoint_tensor_names(folder):
                raise ConfigError(
                    f"speculative method 'mtp': the checkpoint has no MTP weights ({MTP_WEIGHT} "
                    "is missing)"
                )
            return
        if architecture not in MTP_RECYCLES_NORMED:
            raise ConfigError(
                f"speculative method 'mtp' is not supported for {architecture}; it is for "
                f"{sorted([*MTP_RECYCLES_NORMED, *MTP_MODULE])}"
            )
        count = getattr(hf_config, field, 0) or 0
        if count < 1:
            raise ConfigError(f"speculative method 'mtp' needs MTP layers, but {field} is {count}")
        first = f"model.layers.{hf_config.num_hidden_layers}.eh_proj.weight"
        if first not in checkpoint_tensor_names(folder):
            raise ConfigError(
                f"speculative method 'mtp': the checkpoint has no MTP weights ({first} is "
                f"missing although {field} is {count})"
            )


def check_engine_config(config: EngineConfig) -> None:
    """Fails before any weight loads where speculative decoding cannot run."""
    spec, model = config.speculative, config.model
    spec.check_model(model.hf_config, model.entry.architecture, model.path)
