"""A layer whose checkpoint stores its weight quantized but whose product no quantized
kernel runs (DeepSeek-V4's grouped `wo_a`, which the release's own reference converts to
bf16 too): the checkpoint's method creates and loads the parameters, then the weight is
kept dequantized in the model's dtype."""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from atom.layers.quantization.base import LinearMethod
from atom.layers.quantization.unquantized import UnquantizedLinearMethod


class DequantizedAfterLoading(LinearMethod):
    def __init__(self, loaded_as: LinearMethod):
        self.loaded_as = loaded_as

    def create_weights(
        self, layer, input_size_per_partition, output_partition_sizes, params_dtype, weight_loader
    ):
        self.dtype = params_dtype
        self.loaded_as.create_weights(
            layer, input_size_per_partition, output_partition_sizes, params_dtype, weight_loader
        )

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.loaded_as.process_weights_after_loading(layer)
        weight = self.loaded_as.dequantize_weight(layer).to(self.dtype)
        for name, _ in list(layer.named_parameters(recurse=False)):  # the scales go too
            delattr(layer, name)
        layer.weight = nn.Parameter(weight, requires_grad=False)
        # From here on the layer is unquantized (a host that runs the hook twice is served).
        self.loaded_as = UnquantizedLinearMethod()

    def apply(self, layer, x, bias):
        return F.linear(x, layer.weight, bias)
