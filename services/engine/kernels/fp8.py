"""The fp8 KV-cache format: the torch dtype (e4m3) and its largest finite value, shared by kernels and cache."""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
