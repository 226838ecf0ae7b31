"""Mixed precision chosen at run time (autocast and loss scaling), and half precision with
BatchNorm kept in float32, as the seed posts recommend."""

from __future__ import annotations

import os
from typing import Any, Iterator, Optional, Tuple, Union

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


# The dtype autocast uses on each device type: float16 where the hardware is built for it
# (with loss scaling, as float16 underflows), bfloat16 on CPUs (no scaling needed).
_AMP_DTYPES = {"cuda": torch.float16, "mps": torch.float16, "xpu": torch.bfloat16, "cpu": torch.bfloat16}
_AMP_NAMES = {"off": None, "fp16": torch.float16, "float16": torch.float16, "bf16": torch.bfloat16,
              "bfloat16": torch.bfloat16}


def amp_dtype(device: Union[torch.device, str]) -> Optional[torch.dtype]:
    """The autocast dtype for `device`, or None for none (full precision).

    The environment variable `GPUMIGRATE_AMP` overrides the choice for every device: `off`,
    `fp16`/`float16` or `bf16`/`bfloat16` (for example to debug a run in float32, or to
    exercise loss scaling on a CPU)."""
    chosen = os.environ.get("GPUMIGRATE_AMP", "").strip().lower()
    if chosen:
        if chosen not in _AMP_NAMES:
            raise ValueError(f"GPUMIGRATE_AMP={chosen!r}: use one of {', '.join(_AMP_NAMES)}")
        return _AMP_NAMES[chosen]
    return _AMP_DTYPES.get(torch.device(device).type)


def autocast(device: Union[torch.device, str], enabled: bool = True) -> torch.autocast:
    """`torch.autocast` for `device` with the dtype of `amp_dtype` (disabled where that is
    None): one script runs in float16 on CUDA, bfloat16 on a CPU, float32 when switched off."""
    dtype = amp_dtype(device)
    device_type = torch.device(device).type
    # autocast checks its dtype even when it is off: give it one every device accepts
    return torch.autocast(device_type=device_type, dtype=dtype or _AMP_DTYPES.get(device_type, torch.bfloat16),
                          enabled=enabled and dtype is not None)


def grad_scaler(device: Union[torch.device, str], enabled: bool = True) -> torch.amp.GradScaler:
    """A `torch.amp.GradScaler` for `device`, on only where autocast runs in float16 (bfloat16
    has float32's range: scaling would only cost time). Off, it is a pass-through:
    `scale(loss)` is `loss`, `step(opt)` is `opt.step()`, `update()` does nothing."""
    return torch.amp.GradScaler(torch.device(device).type, enabled=enabled and amp_dtype(device) == torch.float16)


def optimizer_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.nn.Parameter]:
    """Every parameter `optimizer` updates (what apex's `amp.master_params` gave)."""
    for group in optimizer.param_groups:
        yield from group["params"]


def load_scaler_state(scaler: torch.amp.GradScaler, state: Optional[dict]) -> None:
    """Restore `scaler` from a checkpoint's entry, which checkpoints written before mixed
    precision (None) or by a run with scaling off (an empty dict) do not have: the scaler
    then starts afresh."""
    if state:
        scaler.load_state_dict(state)
