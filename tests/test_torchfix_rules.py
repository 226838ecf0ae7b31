"""TorchFix's misc, non-public, performance and vision checks as GM rules (issue 21 part B):
the fixes keep what the code does (or are listed), and TorchFix's codes reach them."""

from __future__ import annotations

import textwrap
import warnings

import pytest

from gpumigrate.codemods import RULES_BY_CODE
from tests.conftest import lint, migrate


def _fixed(source: str) -> str:
    result = migrate(textwrap.dedent(source).encode())
    assert result.error is None
    return (result.new_source or result.source).decode()


def _codes(source: str, *codes: str):
    rules = [RULES_BY_CODE[c] for c in codes]
    return [(f.code, f.line, f.review) for f in lint(textwrap.dedent(source).encode(), rules).findings]


@pytest.mark.parametrize("code, tor", [("GM801", "TOR002"), ("GM802", "TOR003"), ("GM803", "TOR104"),
                                       ("GM803", "TOR105"), ("GM701", "TOR106"), ("GM702", "TOR107"),
                                       ("GM703", "TOR108"), ("GM901", "TOR201"), ("GM902", "TOR202"),
                                       ("GM903", "TOR203"), ("GM601", "TOR401"), ("GM604", "TOR402")])
def test_each_rule_carries_its_torchfix_code(code, tor):
    assert tor in RULES_BY_CODE[code].torchfix


def test_noqa_with_torchfix_codes_silences_the_new_rules():
    source = """\
        import torch
        x.require_grad = True  # noqa: TOR002
        y = torch.log(1 + x)  # noqa: TOR106
        optimizer.zero_grad(set_to_none=False)  # noqa: TOR402
        x.require_grad = False
        """
    assert _codes(source, "GM801", "GM701", "GM604") == [("GM801", 5, False)]


def test_checkpoint_fix_keeps_todays_behaviour_and_silences_the_warning():
    import torch
    from torch.utils.checkpoint import checkpoint

    fixed = _fixed("from torch.utils.checkpoint import checkpoint\nh = checkpoint(f, x)\n")
    assert "use_reentrant=True" in fixed  # not TorchFix's False, which changes behaviour
    block = torch.nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)

    def grads(**kw):
        block.zero_grad()
        x.grad = None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            checkpoint(block, x, **kw).sum().backward()
        return [p.grad.clone() for p in (x, *block.parameters())], [str(w.message) for w in caught]

    before, warned = grads()
    after, quiet = grads(use_reentrant=True)
    assert any("use_reentrant" in w for w in warned) and not any("use_reentrant" in w for w in quiet)
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_nonpublic_collate_fix_names_the_same_functions_and_runs():
    import torch.utils.data
    from torch.utils.data._utils import collate

    assert torch.utils.data.default_collate is collate.default_collate
    assert torch.utils.data.default_convert is collate.default_convert
    # `import torch` comes later in the file: the fix must not lean on it
    fixed = _fixed("""\
        from torch.utils.data import _utils
        batch = _utils.collate.default_collate([1, 2])
        import torch
        """)
    assert "_utils" not in fixed
    scope: dict = {}
    exec(compile(fixed, "fixed.py", "exec"), scope)
    assert scope["batch"].tolist() == [1, 2]


def test_nonpublic_import_with_private_neighbours_is_listed_not_rewritten():
    source = "from torch.utils.data._utils.collate import default_collate, np_str_obj_array_pattern\n"
    assert _fixed(source) == source
    assert _codes(source, "GM803") == [("GM803", 1, True)]


def test_require_grad_the_script_reads_is_listed_not_renamed():
    source = "c.require_grad = True\nif c.require_grad:\n    pass\n"
    assert _fixed(source) == source
    assert _codes(source, "GM801") == [("GM801", 1, True)]


def test_pretrained_fix_writes_the_weights_it_loaded_not_default():
    fixed = _fixed("import torchvision\nnet = torchvision.models.resnet50(pretrained=True)\n")
    assert "ResNet50_Weights.IMAGENET1K_V1" in fixed  # DEFAULT is V2 for resnet50: other weights


def test_pretrained_positional_followed_by_progress_is_listed():
    # `fasterrcnn_resnet50_fpn(False, True)`: the second is `progress`, and a keyword may
    # not precede it (TorchFix takes position 1 for pretrained_backbone)
    source = "import torchvision\nm = torchvision.models.detection.fasterrcnn_resnet50_fpn(False, True)\n"
    assert _fixed(source) == source
    assert _codes(source, "GM901") == [("GM901", 2, True)]


def test_pretrained_does_not_shadow_the_scripts_own_name():
    source = "from torchvision.models import vgg16\nVGG16_Weights = 3\nnet = vgg16(pretrained=True)\n"
    assert _fixed(source) == source
    assert _codes(source, "GM901") == [("GM901", 3, True)]


def test_pretrained_does_not_import_torchvisions_models_over_the_users():
    # TorchFix adds `from torchvision import models`, which would shadow a project's `models`
    fixed = _fixed("import models\nfrom torchvision.models import resnet18\nnet = resnet18(pretrained=True)\n"
                   "head = models.Head()\n")
    assert "from torchvision import models" not in fixed
    assert "resnet18(weights=ResNet18_Weights.IMAGENET1K_V1)" in fixed


def test_module_import_on_a_shared_line_is_listed():
    source = "import torchvision.models as models, torch\n"
    assert _fixed(source) == source
    assert _codes(source, "GM903") == [("GM903", 1, True)]


def test_numerics_are_reported_not_rewritten():
    source = "import torch\na = torch.log(1 + x)\nb = torch.exp(x) - 1\nc = torch.log(torch.sum(torch.exp(x), 1))\n"
    assert _fixed(source) == source
    assert [c for c, _, _ in _codes(source, "GM701", "GM702", "GM703")] == ["GM701", "GM702", "GM703"]


def test_the_stable_forms_are_what_the_messages_claim():
    import torch

    tiny = torch.tensor([1e-8])
    assert torch.log(1 + tiny).item() == 0.0 and torch.log1p(tiny).item() > 0
    assert (torch.exp(tiny) - 1).item() == 0.0 and torch.expm1(tiny).item() > 0
    big = torch.tensor([[100.0, 100.0]])
    assert torch.isinf(torch.log(torch.sum(torch.exp(big), 1))).all()
    assert torch.isfinite(torch.logsumexp(big, 1)).all()


def test_loader_no_workers_flags_every_loader_but_evaluation_ones():
    source = """\
        import torch
        ds = torch.rand((100, 100))
        sync_loader = torch.utils.data.DataLoader(ds, batch_size=10)
        workers = torch.utils.data.DataLoader(ds, batch_size=10, num_workers=4)
        zero = torch.utils.data.DataLoader(ds, 10, False, None, None, 0)
        val_loader = torch.utils.data.DataLoader(ds, batch_size=100)
        scores = torch.utils.data.DataLoader(ds)
        for x in scores:
            print(x.sum())
        """
    assert [line for _, line, _ in _codes(source, "GM601")] == [3, 5]
