"""The bench's GB/s: bytes of weights and KV cache a workload's generation reads, per second.

gpt-fast reports model bytes x tokens/s, the memory traffic that bounds decoding. Here the
bytes come from the shape's config and the workload alone, never from an engine, so every
engine's row divides the same numerator by its own measured time. The model of the traffic:

- Passes: the N prompts run as one batch for output_len forward passes (the prefill's pass
  makes the first output token; gpt-fast counts it the same way). An engine that splits the
  batch (max_num_seqs < N) reads the weights more often than counted, so for it the figure
  is a floor of what it moved.
- Weights: each pass reads every weight it multiplies by once: per layer the attention
  projections and norms and the MLP, then the final norm and the LM head. The input
  embedding is gathered (N rows), not read in full, so it counts only when tied (then it is
  the LM head, counted once).
- MoE layers: the router, plus the experts the batch's N tokens touch, expected under uniform
  top-k routing, E * (1 - (1 - k/E)^N): k at batch 1, all E at large batches. Counting k
  experts understates a batch; counting all E overstates batch 1. Random-weight checkpoints
  route close to uniformly; a trained router's skew would touch fewer.
- KV cache: the pass that makes output token i (i = 0..output_len-1) attends over
  input_len + i positions and reads that many rows per layer: 2 * kv_heads * head_dim
  elements (K and V), or for MLA one latent row, kv_lora_rank + qk_rope_head_dim. Writes of
  the new rows and the prefill's own attention traffic are left out.
- Element size: the run's dtype (bfloat16 on a GPU, float32 for ATOM on the CPU), the KV
  cache in the same dtype (an engine option such as an fp8 cache is not seen). Quantized
  checkpoints (`--quantize`) get no figure.
"""

from __future__ import annotations

from atom.bench.driver import engine_dtype
from atom.bench.shapes import Shape
from atom.bench.workloads import Workload

# Architectures whose weights `layer_elements` knows; others get no GB/s ("-").
WEIGHT_MODELS = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


ELEMENT_BYTES = {"bfloat16": 2, "float32": 4}


def element_bytes(device: str) -> int:
    """Bytes per weight and KV element at the dtype the driver loads the engines in."""
    return ELEMENT_BYTES[engine_dtype(device)]


def _head_dim(fields: dict) -> int:
    return fields.get("head_dim") or fields["hidden_size"] // fields["num_attention_heads"]


def attention_elements(fields: dict) -> int:
    """q, k, v, o projections (their biases if the config has them) and Qwen3's per-head
    q/k RMSNorms."""
    hidden, head_dim = fields["hidden_size"], _head_dim(fields)
    q = fields["num_attention_heads"] * head_dim
    kv = fields["num_key_value_heads"] * head_dim
    biases = q + 2 * kv + hidden if fields.get("attention_bias") else 0
    return 2 * hidden * q + 2 * hidden * kv + biases + 2 * head_dim


def mlp_elements(hidden: int, intermediate: int) -> int:
    return 3 * hidden * intermediate  # gate, up, down


def is_sparse_layer(fields: dict, layer: int) -> bool:
    """Qwen3-MoE's rule for which layers have experts instead of a dense MLP."""
    return (
        fields.get("num_experts", 0) > 0
        and layer not in fields.get("mlp_only_layers", [])
        and (layer + 1) % fields.get("decoder_sparse_step", 1) == 0
    )


def expected_experts(num_experts: int, top_k: int, batch: int) -> float:
    """Distinct experts that `batch` tokens touch, each picking `top_k` uniformly: an expert
    escapes one token with probability 1 - k/E, all of them with (1 - k/E)^batch."""
    return num_experts * (1 - (1 - top_k / num_experts) ** batch)


def layer_elements(fields: dict, layer: int, batch: int) -> float:
    """Weight elements one pass at `batch` reads in decoder layer `layer`."""
    hidden = fields["hidden_size"]
    if is_sparse_layer(fields, layer):
        experts = expected_experts(fields["num_experts"], fields["num_experts_per_tok"], batch)
        router = hidden * fields["num_experts"]  # scores every expert for every token
        ffn = router + experts * mlp_elements(hidden, fields["moe_intermediate_size"])
    else:
        ffn = mlp_elements(hidden, fields["intermediate_size"])
    return attention_elements(fields) + 2 * hidden + ffn  # + the two RMSNorms


def pass_weight_elements(fields: dict, batch: int) -> float:
    """Weight elements one forward pass at `batch` reads: the layers, the final norm and
    the LM head (the embedding's N gathered rows are left out)."""
    hidden = fields["hidden_size"]
    layers = sum(layer_elements(fields, i, batch) for i in range(fields["num_hidden_layers"]))
    return layers + hidden + fields["vocab_size"] * hidden


def kv_row_bytes(fields: dict, element: int) -> int:
    """Cache bytes per position per layer."""
    if "kv_lora_rank" in fields:  # MLA caches one latent row shared by K and V
        return (fields["kv_lora_rank"] + fields["qk_rope_head_dim"]) * element
    return 2 * fields["num_key_value_heads"] * _head_dim(fields) * element


def attended_positions(workload: Workload) -> int:
    """Positions one sequence's passes attend over: input_len + i for i = 0..output_len-1."""
    out = workload.output_len
    return out * workload.input_len + out * (out - 1) // 2


def weight_read_bytes(fields: dict, workload: Workload, element: int) -> float:
    per_pass = pass_weight_elements(fields, workload.num_prompts) * element
    return workload.output_len * per_pass


def kv_read_bytes(fields: dict, workload: Workload, element: int) -> int:
    rows = workload.num_prompts * attended_positions(workload) * fields["num_hidden_layers"]
    return rows * kv_row_bytes(fields, element)


def bytes_moved(shape: Shape, workload: Workload, element: int) -> int | None:
    """The workload's weight + KV cache reads (see the module's docstring), or None for an
    architecture without a weight model or a quantized checkpoint (whose bytes per weight
    the model does not count)."""
    if shape.architecture not in WEIGHT_MODELS or shape.quantization:
        return None
    weights = weight_read_bytes(shape.fields, workload, element)
    return round(weights + kv_read_bytes(shape.fields, workload, element))


def add_bandwidth(row: dict, moved: int | None) -> None:
    """Adds `bytes_moved` and `gb_s` (decimal GB, 1e9 bytes, as gpt-fast and HBM specs
    count) to a result row that has a measured `time_s`."""
    if moved is None or "time_s" not in row:
        return
    row["bytes_moved"] = moved
    row["gb_s"] = moved / row["time_s"] / 1e9
