"""Print the tables of gpumigrate/codemods/vision.py (GM901): the weights torchvision's builders
load for `pretrained=True` and `pretrained_backbone=True`, read from torchvision's own
`handle_legacy_interface` closures (needs torchvision; run it with a Python that has it):

    python bench/vision_weights.py > /tmp/tables.py   # then paste over the two tables
"""

from __future__ import annotations

import inspect
from typing import Dict

import torchvision
import torchvision.models as models

SUBPACKAGES = ("detection", "segmentation", "video", "optical_flow")  # quantized builders: other rules


def legacy_weights() -> Dict[str, Dict[str, str]]:
    """model (relative to torchvision.models) -> legacy parameter -> `Enum.MEMBER` it means."""
    found: Dict[str, Dict[str, str]] = {}
    for name in models.list_models():
        builder = models.get_model_builder(name)
        package = builder.__module__.replace("torchvision.models.", "").split(".")[0]
        if package == "quantization":
            continue
        key = f"{package}.{name}" if package in SUBPACKAGES else name
        layer = builder
        while hasattr(layer, "__wrapped__"):
            table = inspect.getclosurevars(layer).nonlocals.get("weights")
            if isinstance(table, dict):
                for legacy, default in table.values():
                    value = default({legacy: True}) if callable(default) else default
                    if value is not None:
                        found.setdefault(key, {})[legacy] = f"{type(value).__name__}.{value.name}"
            layer = layer.__wrapped__
    return found


def main() -> None:
    found = legacy_weights()
    print(f"# torchvision {torchvision.__version__}")
    for table, legacy in (("_WEIGHTS", "pretrained"), ("_BACKBONE_WEIGHTS", "pretrained_backbone")):
        print(f"{table}: Dict[str, str] = {{")
        for key in sorted(k for k in found if legacy in found[k]):
            print(f'    "{key}": "{found[key][legacy]}",')
        print("}")


if __name__ == "__main__":
    main()
