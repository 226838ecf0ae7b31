"""Which values are scalar graph tensors (losses), shared by the 0.4-API and memory rules.

A loss is what a criterion returns: a call of `torch.nn.functional.*_loss`/`cross_entropy`,
of an instance of a `torch.nn.*Loss` class, of a name like `criterion`/`loss_fn`, or a name
that `.backward()` is called on. Names are tracked per function scope.
"""

from __future__ import annotations

from typing import Dict, Optional, Set, Tuple

import libcst as cst
import libcst.matchers as m

from gpumigrate.codemods.helpers import findall

from gpumigrate.rewriter.engine import FileContext

_FUNCTIONAL_LOSSES = {
    "cross_entropy", "nll_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits",
    "kl_div", "l1_loss", "mse_loss", "smooth_l1_loss", "huber_loss", "soft_margin_loss",
    "multi_margin_loss", "multilabel_margin_loss", "multilabel_soft_margin_loss",
    "cosine_embedding_loss", "hinge_embedding_loss", "margin_ranking_loss",
    "triplet_margin_loss", "poisson_nll_loss", "gaussian_nll_loss", "ctc_loss",
}
_REDUCTIONS = {"sum", "mean", "norm", "item"}
Scope = Optional[cst.CSTNode]  # a FunctionDef, or None for the module


class LossAnalysis:
    def __init__(self, ctx: FileContext) -> None:
        self.ctx = ctx
        self.criteria: Set[str] = set()  # names bound to loss modules: criterion = nn.CrossEntropyLoss()
        self.losses: Dict[Scope, Set[str]] = {}
        self.backward: Dict[Scope, Set[str]] = {}  # names `.backward()` is called on
        self._scan(ctx.module.body, None)

    def _scan(self, body, scope: Scope) -> None:
        names = self.losses.setdefault(scope, set())
        for stmt in body:
            if isinstance(stmt, cst.FunctionDef):
                self._scan(stmt.body.body, stmt)
                continue
            if isinstance(stmt, cst.ClassDef):
                for inner in stmt.body.body:
                    if isinstance(inner, cst.FunctionDef):
                        self._scan(inner.body.body, inner)
                continue
            for assign in findall(stmt, m.Assign() | m.AugAssign() | m.AnnAssign()):
                targets = [t.target for t in assign.targets] if isinstance(assign, cst.Assign) else [assign.target]
                value = assign.value
                if value is None:
                    continue
                if isinstance(value, cst.Call) and (self.ctx.names.qualify(value.func) or "").startswith("torch.nn.") \
                        and (self.ctx.names.qualify(value.func) or "").endswith("Loss"):
                    self.criteria.update(t.value for t in targets if isinstance(t, cst.Name))
                elif self.is_loss(value, scope, names):
                    names.update(t.value for t in targets if isinstance(t, cst.Name))
            for call in findall(stmt, m.Call(func=m.Attribute(attr=m.Name("backward")))):
                receiver = call.func.value
                if isinstance(receiver, cst.Name):
                    names.add(receiver.value)
                self.backward.setdefault(scope, set()).update(n.value for n in findall(receiver, m.Name()))

    def is_loss(self, expr: cst.BaseExpression, scope: Scope, names: Optional[Set[str]] = None) -> bool:
        """Is `expr` a scalar loss tensor (still in the graph unless detached)?"""
        if names is None:
            names = self.losses.get(scope, set())
        if isinstance(expr, cst.Name):
            return expr.value in names
        if isinstance(expr, cst.Call):
            func = expr.func
            qualified = self.ctx.names.qualify(func) or ""
            if qualified.startswith("torch.nn.functional.") and qualified.rsplit(".", 1)[1] in _FUNCTIONAL_LOSSES:
                return True
            if isinstance(func, cst.Name) and (func.value in self.criteria or _loss_like(func.value)):
                return True
            if isinstance(func, cst.Attribute) and isinstance(func.value, cst.Name) and func.value.value == "self" \
                    and _loss_like(func.attr.value):
                return True
            if isinstance(func, cst.Attribute) and func.attr.value in ("sum", "mean") and not expr.args:
                return self.is_loss(func.value, scope, names)
            return False
        if isinstance(expr, cst.BinaryOperation):
            return self.is_loss(expr.left, scope, names) or self.is_loss(expr.right, scope, names)
        return False


    def is_scalar(self, expr: cst.BaseExpression, scope: Scope) -> bool:
        """A 0-dim tensor: a loss, or a full reduction such as `x.sum()`."""
        if isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute) \
                and expr.func.attr.value in _REDUCTIONS and not expr.args:
            return True
        return self.is_loss(expr, scope)


    def feeds_backward(self, name: str, scope: Scope) -> bool:
        """Is `name` part of what `.backward()` is called on (`(a + b).backward()`,
        `torch.stack(losses).sum().backward()`)? Then keeping its graph is the point."""
        return name in self.backward.get(scope, set())


def _loss_like(name: str) -> bool:
    lowered = name.lower()
    return "criterion" in lowered or lowered.endswith("loss") or lowered.startswith("loss")


def loss_analysis(ctx: FileContext) -> LossAnalysis:
    return ctx.shared("loss-analysis", LossAnalysis)


def scope_of(ancestors) -> Scope:
    for node in reversed(ancestors):
        if isinstance(node, (cst.FunctionDef, cst.Lambda)):
            return node if isinstance(node, cst.FunctionDef) else None
    return None
