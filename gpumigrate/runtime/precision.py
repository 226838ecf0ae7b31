"""Half precision with BatchNorm kept in float32, as the seed posts recommend."""

from __future__ import annotations

from typing import Any, Tuple

import torch
from torch import nn


def _to_float32(module: nn.Module, args: Tuple[Any, ...]) -> Tuple[Any, ...]:
    return tuple(a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)


def _back_to_input_dtype(module: nn.Module, args: Tuple[Any, ...], output: Any) -> Any:
    dtype = getattr(module, "_gpumigrate_input_dtype", None)
    if dtype is not None and isinstance(output, torch.Tensor) and output.dtype != dtype:
        return output.to(dtype)
    return output


def _remember_dtype(module: nn.Module, args: Tuple[Any, ...]) -> Tuple[Any, ...]:
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    module._gpumigrate_input_dtype = first.dtype if first is not None else None
    return _to_float32(module, args)


def keep_batchnorm_fp32(model: nn.Module) -> nn.Module:
    """Keep the BatchNorm layers of a `.half()` model in float32.

    Each BatchNorm's parameters and running statistics go back to float32; its input is
    cast up to float32 and its output back to the input's dtype, so the layers around it
    still see float16. Calling it again is harmless. Returns `model`.
    """
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and not getattr(module, "_gpumigrate_fp32", False):
            module.float()
            module.register_forward_pre_hook(_remember_dtype)
            module.register_forward_hook(_back_to_input_dtype)
            module._gpumigrate_fp32 = True
    return model
