"""Numerics: formulas that lose precision or overflow where torch has a stable function.
GM701-GM703 (TorchFix TOR106-TOR108).

Lint-only: the stable function is the same formula, but not the same bits (that is its
point), so a migration that `gpumigrate verify` compares to the original would differ in the
last digits, and `logsumexp` turns the original's `inf` into a finite value. The author
decides; the message names the replacement.
"""

from __future__ import annotations

from typing import Optional

import libcst as cst
import libcst.matchers as m

from gpumigrate.codemods.base import Clean, Flagged, Rule
from gpumigrate.codemods.helpers import get_arg, positional_args
from gpumigrate.rewriter.facts import SourceFacts

_ONE = m.Integer("1") | m.Float("1.0") | m.Float("1.")


def _unary(rule: Rule, node: cst.BaseExpression, *names: str) -> Optional[cst.BaseExpression]:
    """The argument `x` of `torch.<name>(x)` (one positional argument, nothing else), else None."""
    if not isinstance(node, cst.Call) or rule.qualify(node.func) not in names:
        return None
    if len(node.args) != 1 or node.args[0].keyword is not None or node.args[0].star:
        return None
    return node.args[0].value


class Log1p(Rule):
    """
    ## What it does
    Finds `torch.log(1 + x)` and `torch.log(x + 1)` (TorchFix TOR106).

    ## Why is this bad?
    For small `x`, `1 + x` rounds away most of `x`'s digits before the log is taken:
    in float32, `torch.log(1 + 1e-8)` is `0.0`; `torch.log1p(1e-8)` is `1e-8`.

    ## Example
    ```python
    y = torch.log(1 + x)
    ```

    ## Use instead
    ```python
    y = torch.log1p(x)
    ```
    Lint-only: the result changes in its last digits, which is the point, so the author
    applies it (a migration keeps the script's numbers).
    """

    code = "GM701"
    name = "log-one-plus"
    torchfix = ("TOR106",)
    message = "`torch.log(1 + x)` loses precision for small `x`; use `torch.log1p(x)`"
    triggers = ("log",)

    @classmethod
    def gate(cls, facts: SourceFacts) -> bool:
        return facts.any_call("log") and "torch" in facts.ids

    examples = (
        Flagged("import torch\ny = torch.log(1 + x)\n"),
        Flagged("import torch\ny = torch.log(x + 1.0)\n"),
        Clean("import torch\ny = torch.log(2 + x)\n"),
        Clean("import math\ny = math.log(1 + x)\n"),
        Clean("import torch\ny = torch.log1p(x)\n"),
    )

    def visit_Call(self, node: cst.Call) -> None:
        arg = _unary(self, node, "torch.log")
        if m.matches(arg, m.BinaryOperation(operator=m.Add(), left=_ONE) | m.BinaryOperation(operator=m.Add(),
                                                                                               right=_ONE)):
            self.report(node)


class Expm1(Rule):
    """
    ## What it does
    Finds `torch.exp(x) - 1` (TorchFix TOR107).

    ## Why is this bad?
    For small `x`, `exp(x)` is close to 1 and the subtraction cancels most of its digits:
    in float32, `torch.exp(1e-8) - 1` is `0.0`; `torch.expm1(1e-8)` is `1e-8`.

    ## Example
    ```python
    y = torch.exp(x) - 1
    ```

    ## Use instead
    ```python
    y = torch.expm1(x)
    ```
    Lint-only, as GM701.
    """

    code = "GM702"
    name = "exp-minus-one"
    torchfix = ("TOR107",)
    message = "`torch.exp(x) - 1` loses precision for small `x`; use `torch.expm1(x)`"
    triggers = ("exp",)

    @classmethod
    def gate(cls, facts: SourceFacts) -> bool:
        return facts.any_call("exp") and "torch" in facts.ids and "BinOp" in facts.kinds

    examples = (
        Flagged("import torch\ny = torch.exp(x) - 1\n"),
        Flagged("import torch\ny = (torch.exp(a) - 1.0) * 2\n"),
        Clean("import torch\ny = torch.exp(x) - 2\n"),
        Clean("import torch\ny = 1 - torch.exp(x)\n"),
        Clean("import numpy as np\ny = np.exp(x) - 1\n"),
    )

    def visit_BinaryOperation(self, node: cst.BinaryOperation) -> None:
        if isinstance(node.operator, cst.Subtract) and m.matches(node.right, _ONE) \
                and _unary(self, node.left, "torch.exp") is not None:
            self.report(node)


class LogSumExp(Rule):
    """
    ## What it does
    Finds `torch.log(torch.sum(torch.exp(x), dim))` (TorchFix TOR108), with a `dim` given
    and not `None`.

    ## Why is this bad?
    `exp` overflows to `inf` for `x` above about 88 in float32 (11 in float16), and the
    log of the sum is then `inf`; `torch.logsumexp` subtracts the maximum first and stays
    finite.

    ## Example
    ```python
    y = torch.log(torch.sum(torch.exp(x), dim=1))
    ```

    ## Use instead
    ```python
    y = torch.logsumexp(x, dim=1)
    ```
    `keepdim=` carries over. Lint-only, as GM701. Without a `dim` (or with `dim=None`)
    the sum is over all elements, which `logsumexp` does not accept on every torch
    version (pytorch#144339): not flagged.
    """

    code = "GM703"
    name = "log-sum-exp"
    torchfix = ("TOR108",)
    message = "`torch.log(torch.sum(torch.exp(x), dim))` overflows for large `x`; use `torch.logsumexp(x, dim)`"
    triggers = ("exp",)

    @classmethod
    def gate(cls, facts: SourceFacts) -> bool:
        return facts.any_call("exp") and facts.any_call("log") and facts.any_call("sum")

    examples = (
        Flagged("import torch\ny = torch.log(torch.sum(torch.exp(x), 1, keepdim=True))\n"),
        Flagged("import torch\ny = torch.log(torch.sum(torch.exp(2 * x), dim=-1))\n"),
        Clean("import torch\ny = torch.log(torch.sum(torch.exp(x)))\n"),
        Clean("import torch\ny = torch.log(torch.sum(torch.exp(x), dim=None))\n"),
        Clean("import torch\ny = torch.log(torch.sum(torch.exp(x), 1) + 1e-6)\n"),
        Clean("import torch\ny = torch.log(torch.sum(torch.exp(x) * w, 1))\n"),
    )

    def visit_Call(self, node: cst.Call) -> None:
        total = _unary(self, node, "torch.log")
        if not isinstance(total, cst.Call) or self.qualify(total.func) != "torch.sum" or any(a.star for a in total.args):
            return
        positional = positional_args(total)
        if not positional or _unary(self, positional[0].value, "torch.exp") is None:
            return
        dim = get_arg(total, "dim", 1)
        if dim is not None and not m.matches(dim.value, m.Name("None")):
            self.report(node)
