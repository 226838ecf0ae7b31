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
    still see float16. Call it again after converting the model again. Returns `model`.
    """
    for module in model.modules():
        if not isinstance(module, nn.modules.batchnorm._BatchNorm):
            continue
        module.float()  # again after a later `.half()` of the model; the hooks stay registered once
        if not getattr(module, "_gpumigrate_fp32", False):
            module.register_forward_pre_hook(_remember_dtype)
            module.register_forward_hook(_back_to_input_dtype)
            module._gpumigrate_fp32 = True
    return model


# The dtype autocast uses on each device type: float16 where the hardware is built for it
# (with loss scaling, as float16 underflows), bfloat16 on CPUs (no scaling needed).
_AMP_DTYPES = {"cuda": torch.float16, "mps": torch.float16, "xpu": torch.bfloat16, "cpu": torch.bfloat16}
_AMP_NAMES = {"off": None, "fp16": torch.float16, "float16": torch.float16, "bf16": torch.bfloat16,
              "bfloat16": torch.bfloat16}


Where = Union[torch.device, str, nn.Module, torch.Tensor]


def _device_type(where: Where) -> str:
    """The device type of a device, a module (its first parameter or buffer) or a tensor."""
    if isinstance(where, nn.Module):
        first = _first(where, "_parameters")
        if first is None:
            first = _first(where, "_buffers")
        return first.device.type if first is not None else "cpu"
    if isinstance(where, torch.Tensor):
        return where.device.type
    return torch.device(where).type


def _first(module: nn.Module, kind: str) -> Optional[torch.Tensor]:
    """`next(module.parameters())` (or buffers) in the same order, without the generator
    machinery of `named_modules`: autocast asks this every step (2.5 us -> 0.5 us)."""
    for tensor in getattr(module, kind).values():
        if tensor is not None:
            return tensor
    for child in module._modules.values():
        if child is not None:
            found = _first(child, kind)
            if found is not None:
                return found
    return None


def amp_dtype(where: Where) -> Optional[torch.dtype]:
    """The autocast dtype on the device of `where` (a device, a model or a tensor), or None
    for none (full precision).

    The environment variable `GPUMIGRATE_AMP` overrides the choice for every device: `off`,
    `fp16`/`float16` or `bf16`/`bfloat16` (for example to debug a run in float32, or to
    exercise loss scaling on a CPU)."""
    return _dtype_on(_device_type(where))


def _dtype_on(device_type: str) -> Optional[torch.dtype]:
    chosen = os.environ.get("GPUMIGRATE_AMP", "").strip().lower()
    if chosen:
        if chosen not in _AMP_NAMES:
            raise ValueError(f"GPUMIGRATE_AMP={chosen!r}: use one of {', '.join(_AMP_NAMES)}")
        return _AMP_NAMES[chosen]
    return _AMP_DTYPES.get(device_type)


def autocast(where: Where, enabled: bool = True) -> torch.autocast:
    """`torch.autocast` on the device of `where` (a device, or the model about to run, or a
    tensor) with the dtype of `amp_dtype`: one script runs in float16 on CUDA, bfloat16 on a
    CPU, float32 when switched off. `enabled`: the script's own switch (`enabled=args.fp16`);
    mixed precision runs only where both it and `GPUMIGRATE_AMP` allow it."""
    device_type = _device_type(where)  # once: this runs every step
    dtype = _dtype_on(device_type)
    # autocast checks its dtype even when it is off: give it one every device accepts
    return torch.autocast(device_type=device_type, dtype=dtype or _AMP_DTYPES.get(device_type, torch.bfloat16),
                          enabled=enabled and dtype is not None)


class GradScaler:
    """`torch.amp.GradScaler` whose device is the first scaled loss's, so a script can make
    it once, anywhere, before it knows its device. It is on only where autocast runs in
    float16 (bfloat16 has float32's range: scaling would only cost time); off, it passes
    through: `scale(loss)` is `loss`, `step(opt)` is `opt.step()`."""

    def __init__(self, enabled: bool = True) -> None:
        self._enabled = enabled
        self._scaler: Optional[torch.amp.GradScaler] = None
        self._pending: Optional[dict] = None  # state loaded before the first loss

    def _start(self, where: Where) -> torch.amp.GradScaler:
        if self._scaler is None:
            self._scaler = grad_scaler(where, self._enabled)
            if self._pending is not None:
                self._scaler.load_state_dict(self._pending)
        return self._scaler

    def scale(self, outputs: Any) -> Any:
        first = outputs if isinstance(outputs, torch.Tensor) else next(iter(outputs))
        return self._start(first).scale(outputs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if self._scaler is not None:
            self._scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if self._scaler is None:  # nothing was scaled: a plain step
            return optimizer.step(*args, **kwargs)
        return self._scaler.step(optimizer, *args, **kwargs)

    def update(self, new_scale: Any = None) -> None:
        if self._scaler is not None:
            self._scaler.update(new_scale)

    def is_enabled(self) -> bool:
        return self._scaler.is_enabled() if self._scaler is not None else self._enabled

    def get_scale(self) -> float:
        if self._scaler is not None:
            return self._scaler.get_scale()
        return float((self._pending or {}).get("scale", 2.0**16)) if self._enabled else 1.0  # torch's initial scale

    def state_dict(self) -> dict:
        if self._scaler is None:
            return dict(self._pending or {})
        return self._scaler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if self._scaler is None:
            self._pending = dict(state)
        else:
            self._scaler.load_state_dict(state)


def grad_scaler(where: Optional[Where] = None, enabled: bool = True) -> Any:
    """A loss scaler, on only where autocast runs in float16 on the device of `where` (and
    `enabled`, the script's own switch, is true: give autocast the same). With no `where`, a
    `GradScaler` that finds its device at the first `scale(loss)`."""
    if where is None:
        return GradScaler(enabled)
    device_type = _device_type(where)
    return torch.amp.GradScaler(device_type, enabled=enabled and _dtype_on(device_type) == torch.float16)


def optimizer_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.nn.Parameter]:
    """Every parameter `optimizer` updates (what apex's `amp.master_params` gave)."""
    for group in optimizer.param_groups:
        yield from group["params"]


def load_scaler_state(scaler: Any, state: Optional[dict]) -> None:
    """Restore `scaler` from a checkpoint's entry. Checkpoints written before mixed precision
    (None), by a run with scaling off (an empty dict) or by apex's `amp.state_dict()` (its
    loss scale is kept) still load."""
    if state and "scale" not in state:  # apex: {"loss_scaler0": {"loss_scale": ..., "unskipped": ...}}
        scales = [v["loss_scale"] for v in state.values() if isinstance(v, dict) and "loss_scale" in v]
        state = {"scale": float(min(scales)), "growth_factor": 2.0, "backoff_factor": 0.5,
                 "growth_interval": 2000, "_growth_tracker": 0} if scales else None
    if state and scaler.is_enabled():
        scaler.load_state_dict(state)
