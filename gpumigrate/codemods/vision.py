"""torchvision: deprecated model and transform arguments, module imports. GM901-GM903
(TorchFix TOR201-TOR203)."""

from __future__ import annotations

from typing import Dict, List, Optional

import libcst as cst
import libcst.matchers as m

from gpumigrate.codemods.base import LINT_FIX, Clean, Flagged, Rule
from gpumigrate.codemods.helpers import fresh_name, keyword_arg, literal_bool
from gpumigrate.rewriter.facts import SourceFacts
from gpumigrate.rewriter.names import dotted

# What `pretrained=True` / `pretrained_backbone=True` loaded, per torchvision's own
# `handle_legacy_interface` (the V1 weights, not today's DEFAULT, which is V2 for some
# models: writing DEFAULT would change the weights the script trains from). Model names
# relative to `torchvision.models`; read from torchvision 0.29.1's own builders by
# bench/vision_weights.py (quantized builders left out).
_WEIGHTS: Dict[str, str] = {
    "alexnet": "AlexNet_Weights.IMAGENET1K_V1",
    "convnext_base": "ConvNeXt_Base_Weights.IMAGENET1K_V1",
    "convnext_large": "ConvNeXt_Large_Weights.IMAGENET1K_V1",
    "convnext_small": "ConvNeXt_Small_Weights.IMAGENET1K_V1",
    "convnext_tiny": "ConvNeXt_Tiny_Weights.IMAGENET1K_V1",
    "densenet121": "DenseNet121_Weights.IMAGENET1K_V1",
    "densenet161": "DenseNet161_Weights.IMAGENET1K_V1",
    "densenet169": "DenseNet169_Weights.IMAGENET1K_V1",
    "densenet201": "DenseNet201_Weights.IMAGENET1K_V1",
    "detection.fasterrcnn_mobilenet_v3_large_320_fpn": "FasterRCNN_MobileNet_V3_Large_320_FPN_Weights.COCO_V1",
    "detection.fasterrcnn_mobilenet_v3_large_fpn": "FasterRCNN_MobileNet_V3_Large_FPN_Weights.COCO_V1",
    "detection.fasterrcnn_resnet50_fpn": "FasterRCNN_ResNet50_FPN_Weights.COCO_V1",
    "detection.fasterrcnn_resnet50_fpn_v2": "FasterRCNN_ResNet50_FPN_V2_Weights.COCO_V1",
    "detection.fcos_resnet50_fpn": "FCOS_ResNet50_FPN_Weights.COCO_V1",
    "detection.keypointrcnn_resnet50_fpn": "KeypointRCNN_ResNet50_FPN_Weights.COCO_V1",
    "detection.maskrcnn_resnet50_fpn": "MaskRCNN_ResNet50_FPN_Weights.COCO_V1",
    "detection.maskrcnn_resnet50_fpn_v2": "MaskRCNN_ResNet50_FPN_V2_Weights.COCO_V1",
    "detection.retinanet_resnet50_fpn": "RetinaNet_ResNet50_FPN_Weights.COCO_V1",
    "detection.retinanet_resnet50_fpn_v2": "RetinaNet_ResNet50_FPN_V2_Weights.COCO_V1",
    "detection.ssd300_vgg16": "SSD300_VGG16_Weights.COCO_V1",
    "detection.ssdlite320_mobilenet_v3_large": "SSDLite320_MobileNet_V3_Large_Weights.COCO_V1",
    "efficientnet_b0": "EfficientNet_B0_Weights.IMAGENET1K_V1",
    "efficientnet_b1": "EfficientNet_B1_Weights.IMAGENET1K_V1",
    "efficientnet_b2": "EfficientNet_B2_Weights.IMAGENET1K_V1",
    "efficientnet_b3": "EfficientNet_B3_Weights.IMAGENET1K_V1",
    "efficientnet_b4": "EfficientNet_B4_Weights.IMAGENET1K_V1",
    "efficientnet_b5": "EfficientNet_B5_Weights.IMAGENET1K_V1",
    "efficientnet_b6": "EfficientNet_B6_Weights.IMAGENET1K_V1",
    "efficientnet_b7": "EfficientNet_B7_Weights.IMAGENET1K_V1",
    "efficientnet_v2_l": "EfficientNet_V2_L_Weights.IMAGENET1K_V1",
    "efficientnet_v2_m": "EfficientNet_V2_M_Weights.IMAGENET1K_V1",
    "efficientnet_v2_s": "EfficientNet_V2_S_Weights.IMAGENET1K_V1",
    "googlenet": "GoogLeNet_Weights.IMAGENET1K_V1",
    "inception_v3": "Inception_V3_Weights.IMAGENET1K_V1",
    "maxvit_t": "MaxVit_T_Weights.IMAGENET1K_V1",
    "mnasnet0_5": "MNASNet0_5_Weights.IMAGENET1K_V1",
    "mnasnet0_75": "MNASNet0_75_Weights.IMAGENET1K_V1",
    "mnasnet1_0": "MNASNet1_0_Weights.IMAGENET1K_V1",
    "mnasnet1_3": "MNASNet1_3_Weights.IMAGENET1K_V1",
    "mobilenet_v2": "MobileNet_V2_Weights.IMAGENET1K_V1",
    "mobilenet_v3_large": "MobileNet_V3_Large_Weights.IMAGENET1K_V1",
    "mobilenet_v3_small": "MobileNet_V3_Small_Weights.IMAGENET1K_V1",
    "optical_flow.raft_large": "Raft_Large_Weights.C_T_SKHT_V2",
    "optical_flow.raft_small": "Raft_Small_Weights.C_T_V2",
    "regnet_x_16gf": "RegNet_X_16GF_Weights.IMAGENET1K_V1",
    "regnet_x_1_6gf": "RegNet_X_1_6GF_Weights.IMAGENET1K_V1",
    "regnet_x_32gf": "RegNet_X_32GF_Weights.IMAGENET1K_V1",
    "regnet_x_3_2gf": "RegNet_X_3_2GF_Weights.IMAGENET1K_V1",
    "regnet_x_400mf": "RegNet_X_400MF_Weights.IMAGENET1K_V1",
    "regnet_x_800mf": "RegNet_X_800MF_Weights.IMAGENET1K_V1",
    "regnet_x_8gf": "RegNet_X_8GF_Weights.IMAGENET1K_V1",
    "regnet_y_16gf": "RegNet_Y_16GF_Weights.IMAGENET1K_V1",
    "regnet_y_1_6gf": "RegNet_Y_1_6GF_Weights.IMAGENET1K_V1",
    "regnet_y_32gf": "RegNet_Y_32GF_Weights.IMAGENET1K_V1",
    "regnet_y_3_2gf": "RegNet_Y_3_2GF_Weights.IMAGENET1K_V1",
    "regnet_y_400mf": "RegNet_Y_400MF_Weights.IMAGENET1K_V1",
    "regnet_y_800mf": "RegNet_Y_800MF_Weights.IMAGENET1K_V1",
    "regnet_y_8gf": "RegNet_Y_8GF_Weights.IMAGENET1K_V1",
    "resnet101": "ResNet101_Weights.IMAGENET1K_V1",
    "resnet152": "ResNet152_Weights.IMAGENET1K_V1",
    "resnet18": "ResNet18_Weights.IMAGENET1K_V1",
    "resnet34": "ResNet34_Weights.IMAGENET1K_V1",
    "resnet50": "ResNet50_Weights.IMAGENET1K_V1",
    "resnext101_32x8d": "ResNeXt101_32X8D_Weights.IMAGENET1K_V1",
    "resnext101_64x4d": "ResNeXt101_64X4D_Weights.IMAGENET1K_V1",
    "resnext50_32x4d": "ResNeXt50_32X4D_Weights.IMAGENET1K_V1",
    "segmentation.deeplabv3_mobilenet_v3_large": "DeepLabV3_MobileNet_V3_Large_Weights.COCO_WITH_VOC_LABELS_V1",
    "segmentation.deeplabv3_resnet101": "DeepLabV3_ResNet101_Weights.COCO_WITH_VOC_LABELS_V1",
    "segmentation.deeplabv3_resnet50": "DeepLabV3_ResNet50_Weights.COCO_WITH_VOC_LABELS_V1",
    "segmentation.fcn_resnet101": "FCN_ResNet101_Weights.COCO_WITH_VOC_LABELS_V1",
    "segmentation.fcn_resnet50": "FCN_ResNet50_Weights.COCO_WITH_VOC_LABELS_V1",
    "segmentation.lraspp_mobilenet_v3_large": "LRASPP_MobileNet_V3_Large_Weights.COCO_WITH_VOC_LABELS_V1",
    "shufflenet_v2_x0_5": "ShuffleNet_V2_X0_5_Weights.IMAGENET1K_V1",
    "shufflenet_v2_x1_0": "ShuffleNet_V2_X1_0_Weights.IMAGENET1K_V1",
    "shufflenet_v2_x1_5": "ShuffleNet_V2_X1_5_Weights.IMAGENET1K_V1",
    "shufflenet_v2_x2_0": "ShuffleNet_V2_X2_0_Weights.IMAGENET1K_V1",
    "squeezenet1_0": "SqueezeNet1_0_Weights.IMAGENET1K_V1",
    "squeezenet1_1": "SqueezeNet1_1_Weights.IMAGENET1K_V1",
    "swin_b": "Swin_B_Weights.IMAGENET1K_V1",
    "swin_s": "Swin_S_Weights.IMAGENET1K_V1",
    "swin_t": "Swin_T_Weights.IMAGENET1K_V1",
    "swin_v2_b": "Swin_V2_B_Weights.IMAGENET1K_V1",
    "swin_v2_s": "Swin_V2_S_Weights.IMAGENET1K_V1",
    "swin_v2_t": "Swin_V2_T_Weights.IMAGENET1K_V1",
    "vgg11": "VGG11_Weights.IMAGENET1K_V1",
    "vgg11_bn": "VGG11_BN_Weights.IMAGENET1K_V1",
    "vgg13": "VGG13_Weights.IMAGENET1K_V1",
    "vgg13_bn": "VGG13_BN_Weights.IMAGENET1K_V1",
    "vgg16": "VGG16_Weights.IMAGENET1K_V1",
    "vgg16_bn": "VGG16_BN_Weights.IMAGENET1K_V1",
    "vgg19": "VGG19_Weights.IMAGENET1K_V1",
    "vgg19_bn": "VGG19_BN_Weights.IMAGENET1K_V1",
    "video.mc3_18": "MC3_18_Weights.KINETICS400_V1",
    "video.mvit_v1_b": "MViT_V1_B_Weights.KINETICS400_V1",
    "video.mvit_v2_s": "MViT_V2_S_Weights.KINETICS400_V1",
    "video.r2plus1d_18": "R2Plus1D_18_Weights.KINETICS400_V1",
    "video.r3d_18": "R3D_18_Weights.KINETICS400_V1",
    "video.s3d": "S3D_Weights.KINETICS400_V1",
    "video.swin3d_b": "Swin3D_B_Weights.KINETICS400_V1",
    "video.swin3d_s": "Swin3D_S_Weights.KINETICS400_V1",
    "video.swin3d_t": "Swin3D_T_Weights.KINETICS400_V1",
    "vit_b_16": "ViT_B_16_Weights.IMAGENET1K_V1",
    "vit_b_32": "ViT_B_32_Weights.IMAGENET1K_V1",
    "vit_l_16": "ViT_L_16_Weights.IMAGENET1K_V1",
    "vit_l_32": "ViT_L_32_Weights.IMAGENET1K_V1",
    "wide_resnet101_2": "Wide_ResNet101_2_Weights.IMAGENET1K_V1",
    "wide_resnet50_2": "Wide_ResNet50_2_Weights.IMAGENET1K_V1",
}
_BACKBONE_WEIGHTS: Dict[str, str] = {
    "detection.fasterrcnn_mobilenet_v3_large_320_fpn": "MobileNet_V3_Large_Weights.IMAGENET1K_V1",
    "detection.fasterrcnn_mobilenet_v3_large_fpn": "MobileNet_V3_Large_Weights.IMAGENET1K_V1",
    "detection.fasterrcnn_resnet50_fpn": "ResNet50_Weights.IMAGENET1K_V1",
    "detection.fasterrcnn_resnet50_fpn_v2": "ResNet50_Weights.IMAGENET1K_V1",
    "detection.fcos_resnet50_fpn": "ResNet50_Weights.IMAGENET1K_V1",
    "detection.keypointrcnn_resnet50_fpn": "ResNet50_Weights.IMAGENET1K_V1",
    "detection.maskrcnn_resnet50_fpn": "ResNet50_Weights.IMAGENET1K_V1",
    "detection.maskrcnn_resnet50_fpn_v2": "ResNet50_Weights.IMAGENET1K_V1",
    "detection.retinanet_resnet50_fpn": "ResNet50_Weights.IMAGENET1K_V1",
    "detection.retinanet_resnet50_fpn_v2": "ResNet50_Weights.IMAGENET1K_V1",
    "detection.ssd300_vgg16": "VGG16_Weights.IMAGENET1K_FEATURES",
    "detection.ssdlite320_mobilenet_v3_large": "MobileNet_V3_Large_Weights.IMAGENET1K_V1",
    "segmentation.deeplabv3_mobilenet_v3_large": "MobileNet_V3_Large_Weights.IMAGENET1K_V1",
    "segmentation.deeplabv3_resnet101": "ResNet101_Weights.IMAGENET1K_V1",
    "segmentation.deeplabv3_resnet50": "ResNet50_Weights.IMAGENET1K_V1",
    "segmentation.fcn_resnet101": "ResNet101_Weights.IMAGENET1K_V1",
    "segmentation.fcn_resnet50": "ResNet50_Weights.IMAGENET1K_V1",
    "segmentation.lraspp_mobilenet_v3_large": "MobileNet_V3_Large_Weights.IMAGENET1K_V1",
}

_MODEL_NAMES = frozenset(name.rsplit(".", 1)[-1] for name in _WEIGHTS)

# Modules that define the classification models, which torchvision.models re-exports.
_SUBMODULES = ("alexnet", "convnext", "densenet", "efficientnet", "googlenet", "inception", "mnasnet", "mobilenet",
               "mobilenetv2", "mobilenetv3", "regnet", "resnet", "shufflenetv2", "squeezenet", "vgg",
               "vision_transformer", "swin_transformer", "maxvit")


def _model(qualified: Optional[str]) -> Optional[str]:
    """`resnet50` for `torchvision.models.resnet50` or `torchvision.models.resnet.resnet50`."""
    if not qualified or not qualified.startswith("torchvision.models."):
        return None
    name = qualified[len("torchvision.models."):]
    head, _, rest = name.partition(".")
    if head in _SUBMODULES and rest:
        name = rest
    return name if name in _WEIGHTS else None


class VisionPretrained(Rule):
    """
    ## What it does
    Finds torchvision model builders called with `pretrained=` or `pretrained_backbone=`
    (or `pretrained` as the first positional argument): TorchFix TOR201.

    ## Why is this bad?
    Deprecated since torchvision 0.13 in favour of `weights=` / `weights_backbone=`,
    which say which weights are loaded.

    ## Example
    ```python
    model = torchvision.models.resnet50(pretrained=True)
    ```

    ## Use instead
    ```python
    model = torchvision.models.resnet50(weights=torchvision.models.ResNet50_Weights.IMAGENET1K_V1)
    ```
    The fix writes the weights `pretrained=True` loaded (IMAGENET1K_V1, as torchvision's
    legacy interface maps it), not `DEFAULT`, which is a newer set for some models and
    would change what the script trains from; `False` becomes `None`. A value that is not
    a literal `True`/`False`, or a model whose old weights have no name, is listed.
    """

    code = "GM901"
    name = "vision-pretrained"
    torchfix = ("TOR201",)
    message = "`pretrained=` is deprecated since torchvision 0.13; use `weights=`"
    done = "`pretrained=` → `weights=` (the weights it loaded)"
    fixed_in = frozenset({"device"})
    triggers = ("torchvision",)

    @classmethod
    def gate(cls, facts: SourceFacts) -> bool:
        return "torchvision" in facts.ids and (facts.any_id("pretrained", "pretrained_backbone")
                                               or any(c in _MODEL_NAMES for c in facts.calls))

    examples = (
        Flagged("import torchvision\nnet = torchvision.models.resnet50(pretrained=True)\n",
                fixed="import torchvision\n"
                      "net = torchvision.models.resnet50(weights=torchvision.models.ResNet50_Weights.IMAGENET1K_V1)\n"),
        Flagged("from torchvision.models import vgg16\nnet = vgg16(True)\n",
                fixed="from torchvision.models import VGG16_Weights, vgg16\nnet = vgg16(weights=VGG16_Weights.IMAGENET1K_V1)\n"),
        Flagged("from torchvision import models\nnet = models.detection.fasterrcnn_resnet50_fpn(pretrained=False, "
                "pretrained_backbone=True)\n",
                fixed="from torchvision import models\nnet = models.detection.fasterrcnn_resnet50_fpn(weights=None, "
                      "weights_backbone=models.ResNet50_Weights.IMAGENET1K_V1)\n"),
        Flagged("import torchvision\nnet = torchvision.models.resnet18(pretrained=args.pretrained)\n"),
        Clean("import torchvision\nnet = torchvision.models.resnet50(weights=None)\n"),
        Clean("from torchvision.models.vgg import make_layers, cfgs\nf = make_layers(cfgs['D'], False)\n"),
        Clean("import timm\nnet = timm.create_model('resnet50', pretrained=True)\n"),
    )

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        model = _model(self.qualify(original.func))
        if model is None or any(a.star for a in original.args):
            return updated
        args: List[cst.Arg] = list(updated.args)
        found, listed = [], []
        for i, arg in enumerate(original.args):
            if arg.keyword is not None and arg.keyword.value in ("pretrained", "pretrained_backbone"):
                backbone = arg.keyword.value == "pretrained_backbone"
            elif i == 0 and arg.keyword is None:
                backbone = False
            else:
                continue
            old = "pretrained_backbone" if backbone else "pretrained"
            found.append(old)
            later_positional = arg.keyword is None and any(a.keyword is None for a in original.args[i + 1:])
            # `resnet50(True, False)`: a keyword cannot precede the positional `progress`
            new_value = None if later_positional else self._weights(original, model, backbone, literal_bool(arg.value))
            if new_value is None:
                listed.append(old)
                continue
            new = keyword_arg("weights_backbone" if backbone else "weights", new_value)
            args[i] = new.with_changes(comma=updated.args[i].comma)
        if not found:
            return updated
        if listed:
            self.report(original, f"`{listed[0]}=` is deprecated since torchvision 0.13; pass `weights=` with the "
                                  "weights meant (its value is not a literal True/False, or they have no name)",
                        review=True)
            return updated
        self.report(original, "`pretrained=` → `weights=` (the weights it loaded)" if self.fixing else
                    f"`{found[0]}=` is deprecated since torchvision 0.13; use `{found[0].replace('pretrained', 'weights')}=`")
        return updated.with_changes(args=args)

    def _weights(self, call: cst.Call, model: str, backbone: bool, value: Optional[bool]) -> Optional[cst.BaseExpression]:
        if value is None:
            return None
        if value is False:
            return cst.Name("None")
        table = _BACKBONE_WEIGHTS if backbone else _WEIGHTS
        weights = table.get(model)
        if weights is None or weights == "None":
            return None
        cls, member = weights.split(".")
        module = "torchvision.models"
        if not backbone and "." in model:
            module += "." + model.split(".")[0]
        local = self.ctx.names.local_name_for(f"{module}.{cls}")
        if local is None:
            taken = self.ctx.names.local.get(cls)
            if fresh_name(self.ctx, cls) != cls and taken != f"{module}.{cls}":
                return None  # the script uses the name for something else
            if self.fixing:
                self.ctx.add_import(module, cls)
            local = cls
        return cst.parse_expression(f"{local}.{member}")


_V2_TO_TENSOR = "torchvision.transforms.v2.ToTensor"


class V2ToTensor(Rule):
    """
    ## What it does
    Finds `torchvision.transforms.v2.ToTensor` (TorchFix TOR202), imported or used.

    ## Why is this bad?
    Deprecated in torchvision 0.16 and to be removed.

    ## Example
    ```python
    from torchvision.transforms import v2
    t = v2.ToTensor()
    ```

    ## Use instead
    ```python
    t = v2.Compose([v2.ToImage(), v2.ToDtype(torch.float32, scale=True)])
    ```
    Lint-only: the replacement returns a `tv_tensors.Image`, not a plain tensor, which
    later v2 transforms treat differently; check the pipeline by hand. (The v1
    `transforms.ToTensor` is not deprecated and not flagged.)
    """

    code = "GM902"
    name = "vision-v2-to-tensor"
    torchfix = ("TOR202",)
    message = ("`v2.ToTensor` is deprecated; use `v2.Compose([v2.ToImage(), v2.ToDtype(torch.float32, "
               "scale=True)])`")
    triggers = ("ToTensor",)

    @classmethod
    def gate(cls, facts: SourceFacts) -> bool:
        return "ToTensor" in facts.ids and "v2" in facts.ids

    examples = (
        Flagged("from torchvision.transforms import v2\nt = v2.Compose([v2.ToTensor()])\n"),
        Flagged("from torchvision.transforms.v2 import ToTensor\n"),
        Clean("from torchvision import transforms\nt = transforms.ToTensor()\n"),
        Clean("from torchvision.transforms import v2\nt = v2.Compose([v2.ToImage()])\n"),
    )

    def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
        if node.relative or node.module is None or isinstance(node.names, cst.ImportStar):
            return
        if dotted(node.module) == "torchvision.transforms.v2":
            for alias in node.names:
                if alias.name.value == "ToTensor":
                    self.report(alias)

    def visit_Attribute(self, node: cst.Attribute) -> None:
        if node.attr.value == "ToTensor" and self.qualify(node) == _V2_TO_TENSOR:
            self.report(node)


_SINGLETON = ("datasets", "models", "transforms")
_IMPORT_MSG = "`import torchvision.{name} as {name}`: write `from torchvision import {name}`"
_IMPORT_DONE = "`import torchvision.{name} as {name}` → `from torchvision import {name}`"


class VisionModuleImport(Rule):
    """
    ## What it does
    Finds `import torchvision.models as models` (and `datasets`, `transforms`): TorchFix
    TOR203.

    ## Why is this bad?
    A roundabout spelling of `from torchvision import models` (pylint's
    consider-using-from-import, ruff's PLR0402): both bind the same module to the same
    name.

    ## Example
    ```python
    import torchvision.models as models
    ```

    ## Use instead
    ```python
    from torchvision import models
    ```
    `gpumigrate lint --fix` rewrites an import statement that imports only that; one that
    imports other modules too is listed. Migrations leave it: it changes nothing the script
    does, and a migration's diff should hold only what does.
    """

    code = "GM903"
    name = "vision-module-import"
    torchfix = ("TOR203",)
    message = "`import torchvision.models as models`: write `from torchvision import models`"
    done = "`import torchvision.models as models` → `from torchvision import models`"
    fixed_in = frozenset({LINT_FIX})  # a spelling: `lint --fix` rewrites it, migrations leave it
    triggers = ("torchvision",)

    @classmethod
    def gate(cls, facts: SourceFacts) -> bool:
        return "torchvision" in facts.ids and facts.any_id(*_SINGLETON) and "Import" in facts.kinds

    examples = (
        Flagged("import torchvision.models as models\nnet = models.resnet18()\n",
                fixed="from torchvision import models\nnet = models.resnet18()\n"),
        Flagged("import torchvision.transforms as transforms, torch\n"),
        Clean("import torchvision.models as cnn\nfrom torchvision import datasets\nimport torchvision.models\n"),
    )

    def leave_Import(self, original: cst.Import, updated: cst.Import):
        for alias in original.names:
            if m.matches(alias, m.ImportAlias(name=m.Attribute(value=m.Name("torchvision"), attr=m.Name()),
                                              asname=m.AsName(name=m.Name()))):
                name = alias.name.attr.value
                if name not in _SINGLETON or alias.asname.name.value != name:
                    continue
                if len(original.names) != 1:
                    self.report(original, _IMPORT_MSG.format(name=name) + " (on a line of its own)", review=True)
                    return updated
                self.report(original, (_IMPORT_DONE if self.fixing else _IMPORT_MSG).format(name=name))
                return cst.ImportFrom(module=cst.Name("torchvision"), names=[cst.ImportAlias(name=cst.Name(name))])
        return updated
