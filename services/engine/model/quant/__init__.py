"""Quantized checkpoints: reading ``quantization_config`` (scheme.py), dequantising each stored layout
(formats.py), and what a quantized layer does at forward time (linear.py). docs/quantization.md has the
formats, their on-disk layouts and what is refused."""

from services.engine.model.quant.linear import PackedPart, QuantizedLinear, fp8_quant_dequant
from services.engine.model.quant.scheme import QuantConfig, WeightFormat, WeightScheme, read_quant_config

__all__ = ["PackedPart", "QuantConfig", "QuantizedLinear", "WeightFormat", "WeightScheme", "fp8_quant_dequant",
           "read_quant_config"]
