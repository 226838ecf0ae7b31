"""Fixes from field report 2 that belong to no single codemod's test module: `torch.full`
labels for a float loss (GM208, a today's-torch fix of `--to device`)."""

import textwrap

import pytest

from tests.conftest import migrate


def device(code: str):
    source = textwrap.dedent(code)
    result = migrate(source.encode(), "device")
    assert result.error is None, result.error
    out = (result.new_source or result.source).decode()
    again = migrate(out.encode(), "device")
    assert again.error is None and again.new_source is None, "not idempotent"
    return out, [f.message for f in result.findings if f.review]


DCGAN_LABELS = """\
import torch
import torch.nn as nn
real_label = 1
fake_label = 0
netD = nn.Sequential(nn.Linear(4, 1), nn.Sigmoid())
opt = torch.optim.SGD(netD.parameters(), lr=0.1)
criterion = nn.BCELoss()
for step in range(2):
    x = torch.randn(8, 4)
    label = torch.full((x.size(0),), real_label)
    label = label.to("cpu")
    errD_real = criterion(netD(x).view(-1), label)
    errD_real.backward()
    label.fill_(fake_label)
    errD_fake = criterion(netD(x * 0).view(-1), label)
    target = torch.full((8, 1), 1).to("cpu")
    mse = torch.nn.functional.mse_loss(netD(x), target)
    (errD_fake + mse).backward()
    opt.step()
print("ok")
"""


def test_int_filled_labels_of_a_float_loss_become_float():
    out, reviews = device(DCGAN_LABELS)
    assert not reviews
    assert "label = torch.full((x.size(0),), real_label, dtype=torch.float)\n" in out
    assert "target = torch.full((8, 1), 1, dtype=torch.float).to(" in out
    namespace = {}
    exec(compile(out, "x.py", "exec"), namespace)  # BCELoss and mse_loss take them


@pytest.mark.parametrize("code", [
    # class indices for CrossEntropyLoss: int64 is right
    "import torch\nidx = torch.full((8,), 2)\nloss = torch.nn.CrossEntropyLoss()(torch.randn(8, 3), idx)\n",
    # a float fill, or a dtype given: float already
    "import torch\ncrit = torch.nn.BCELoss()\nlabel = torch.full((8,), 1.0)\nloss = crit(torch.rand(8), label)\n",
    "import torch\ncrit = torch.nn.BCELoss()\nlabel = torch.full((8,), 1, dtype=torch.float)\n"
    "loss = crit(torch.rand(8), label)\n",
    # not a loss target
    "import torch\nmask = torch.full((8,), 1)\nprint(mask.sum())\n",
])
def test_torch_full_left_alone(code):
    out, reviews = device(code)
    assert out == code and not reviews


def test_int_filled_labels_of_an_unknown_loss_are_listed():
    out, reviews = device("""\
        import torch
        from losses import make_loss
        criterion = make_loss()
        label = torch.full((8,), 1)
        loss = criterion(torch.rand(8), label)
        """)
    assert "dtype" not in out
    assert reviews == ["`torch.full` with an integer fill value makes an int64 tensor (since torch 1.7): if it is a "
                       "float label for the loss it reaches, pass `dtype=torch.float`"]
