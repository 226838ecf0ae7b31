"""GPU memory: graphs kept alive, evaluation without no_grad, fp16 BatchNorm. GM301-GM305.

The seed posts' main lesson: a loss tensor carries the autograd graph of its step. Keep it
(`total += loss`, `losses.append(loss)`) and every step's activations stay in memory.
"""

from __future__ import annotations

import re
from typing import Optional, Set

import libcst as cst
import libcst.matchers as m

from gpumigrate.codemods.base import Clean, Flagged, Rule
from gpumigrate.codemods.device_plan import RUNTIME
from gpumigrate.codemods.graph import loss_analysis, scope_of
from gpumigrate.codemods.helpers import findall, call_method, is_method_call
from gpumigrate.codemods.legacy import (
    calls_backward,
    has_no_grad_decorator,
    no_grad_decorator,
    no_grad_with,
    under_no_grad,
)


def _itemize(expr: cst.BaseExpression, is_loss) -> cst.BaseExpression:
    """`loss * n` -> `loss.item() * n`: every loss operand becomes a Python number."""
    if isinstance(expr, cst.BinaryOperation):
        return expr.with_changes(left=_itemize(expr.left, is_loss), right=_itemize(expr.right, is_loss))
    return call_method(expr, "item") if is_loss(expr) else expr


def _graph_operand(rule: Rule, expr: cst.BaseExpression) -> bool:
    analysis = loss_analysis(rule.ctx)
    scope = scope_of(rule.ctx.ancestors)
    if analysis.is_loss(expr, scope):
        return True
    if isinstance(expr, cst.BinaryOperation):
        return _graph_operand(rule, expr.left) or _graph_operand(rule, expr.right)
    return False


class TensorAccumulation(Rule):
    """
    ## What it does
    Finds graph tensors (losses) added into running totals: `total_loss += loss`,
    `running = running + loss`.

    ## Why is this bad?
    `loss` carries the autograd graph of its step. Adding it to a total links every step's
    graph to the total, so the graphs pile up step after step; where no `.backward()` frees
    them (evaluation without `no_grad`), every step's saved activations stay in memory too,
    until the GPU runs out. (`loss.item()` also makes the total a plain number to print.)

    ## Example
    ```python
    loss = criterion(model(x), y)
    loss.backward()
    total_loss += loss
    ```

    ## Use instead
    ```python
    total_loss += loss.item()
    ```
    """

    code = "GM301"
    name = "tensor-accumulation"
    message = "accumulating a graph tensor keeps every step's graph alive; use `.item()`"
    fixed_in = frozenset({"device"})
    triggers = ("loss", "criterion", "backward")
    examples = (
        Flagged(
            "loss = criterion(out, y)\nloss.backward()\ntotal_loss += loss\n",
            fixed="loss = criterion(out, y)\nloss.backward()\ntotal_loss += loss.item()\n",
        ),
        Flagged(
            "import torch.nn.functional as F\ndef train():\n    for x, y in data:\n"
            "        loss = F.mse_loss(model(x), y)\n        running = running + loss * x.size(0)\n",
            fixed="import torch.nn.functional as F\ndef train():\n    for x, y in data:\n"
            "        loss = F.mse_loss(model(x), y)\n        running = running + loss.item() * x.size(0)\n",
        ),
        Clean("loss = criterion(out, y)\ntotal_loss += loss.item()\ntotal += float(loss)\n"),
        Clean("loss = criterion(out, y)\nepoch_loss += loss.detach()\n"),
        Clean("total = 0\nfor part in parts:\n    loss = criterion(part)\n    total += loss\ntotal.backward()\n"),
        Clean("count += batch_size\ndef f(loss):\n    total += other\n"),
    )

    def _skip(self, target: cst.BaseExpression) -> bool:
        names = [n.value for n in findall(target, m.Name())]
        analysis, scope = loss_analysis(self.ctx), scope_of(self.ctx.ancestors)
        return any(analysis.feeds_backward(n, scope) for n in names) or under_no_grad(self.ctx, self.ctx.ancestors)

    def leave_AugAssign(self, original: cst.AugAssign, updated: cst.AugAssign):
        if not isinstance(original.operator, (cst.AddAssign, cst.SubtractAssign)):
            return None
        if not _graph_operand(self, original.value) or self._skip(original.target):
            return None
        self.report(original)
        return updated.with_changes(value=self._fix(updated.value, original.target))

    def leave_Assign(self, original: cst.Assign, updated: cst.Assign):
        # `running = running + loss`: the target is an operand of its own sum
        value = original.value
        if len(original.targets) != 1 or not isinstance(value, cst.BinaryOperation) \
                or not isinstance(value.operator, (cst.Add, cst.Subtract)):
            return None
        target = original.targets[0].target
        operands = [value.left, value.right]
        if not any(o.deep_equals(target) for o in operands) or self._skip(target):
            return None
        others = [o for o in operands if not o.deep_equals(target)]
        if not any(_graph_operand(self, o) for o in others):
            return None
        self.report(original)
        return updated.with_changes(value=self._fix(updated.value, target))

    def _fix(self, value: cst.BaseExpression, total: cst.BaseExpression) -> cst.BaseExpression:
        """Every loss operand becomes `.item()`; the running total itself stays as it is."""
        analysis, scope = loss_analysis(self.ctx), scope_of(self.ctx.ancestors)
        return _itemize(value, lambda e: analysis.is_loss(e, scope) and not e.deep_equals(total))


class TensorInContainer(Rule):
    """
    ## What it does
    Finds graph tensors (losses) stored in lists or dicts of lists for logging:
    `losses.append(loss)`, `history["loss"].append(loss)`.

    ## Why is this bad?
    Each stored loss keeps its step's whole autograd graph (and activations) alive for as
    long as the list lives: memory grows with every step.

    ## Example
    ```python
    losses.append(loss)
    ```

    ## Use instead
    ```python
    losses.append(loss.item())
    ```
    """

    code = "GM302"
    name = "tensor-in-container"
    message = "storing a graph tensor keeps its step's graph alive; store `.item()`"
    fixed_in = frozenset({"device"})
    triggers = ("append",)
    examples = (
        Flagged(
            "loss = criterion(out, y)\nloss.backward()\nlosses.append(loss)\n",
            fixed="loss = criterion(out, y)\nloss.backward()\nlosses.append(loss.item())\n",
        ),
        Flagged(
            "loss = loss_fn(out, y)\nhistory['loss'].append(loss)\n",
            fixed="loss = loss_fn(out, y)\nhistory['loss'].append(loss.item())\n",
        ),
        Clean("loss = criterion(out, y)\nlosses.append(loss.item())\nouts.append(out)\n"),
        Clean("losses = []\nfor x in xs:\n    loss = criterion(x)\n    losses.append(loss)\ntorch.stack(losses).sum().backward()\n"),
    )

    def leave_Call(self, original: cst.Call, updated: cst.Call):
        if not is_method_call(original, "append") or len(original.args) != 1 or original.args[0].keyword:
            return None
        value = original.args[0].value
        analysis, scope = loss_analysis(self.ctx), scope_of(self.ctx.ancestors)
        if not analysis.is_loss(value, scope) or under_no_grad(self.ctx, self.ctx.ancestors):
            return None
        container = [n.value for n in findall(original.func.value, m.Name())]
        if any(analysis.feeds_backward(n, scope) for n in container):
            return None
        self.report(original.args[0])
        arg = updated.args[0]
        return updated.with_changes(args=[arg.with_changes(value=call_method(arg.value, "item"))])


_EVAL_NAME = re.compile(r"^(test|evaluate|evaluation|eval|validate|validation|valid|predict|inference|infer)"
                        r"(_.*)?$|^(evaluate|validate|predict|infer)")
_TRAIN_MODE = m.Call(func=m.Attribute(attr=m.Name("train")))


def _calls_eval(node: cst.CSTNode) -> bool:
    return bool(findall(node, m.Call(func=m.Attribute(attr=m.Name("eval")), args=[])))


def _own_body(func: cst.FunctionDef):
    """The function's statements, without nested functions and classes."""
    return [s for s in func.body.body if not isinstance(s, (cst.FunctionDef, cst.ClassDef))]


class EvalWithoutNoGrad(Rule):
    """
    ## What it does
    Finds evaluation code that runs without `torch.no_grad()`: functions that put a model in
    `eval()` mode, or are named test/evaluate/validate/predict/inference, and never call
    `.backward()`; and evaluation loops after `model.eval()` at module or `main()` level.

    ## Why is this bad?
    `model.eval()` switches dropout and BatchNorm to inference behaviour but does not stop
    autograd: every forward pass still records a graph and keeps its activations, roughly
    doubling evaluation memory and time for nothing.

    ## Example
    ```python
    def evaluate(model, loader):
        model.eval()
        for x, y in loader:
            correct += (model(x).argmax(1) == y).sum().item()
    ```

    ## Use instead
    ```python
    @torch.no_grad()
    def evaluate(model, loader):
        ...
    ```
    """

    code = "GM303"
    name = "eval-without-no-grad"
    message = "evaluation without `torch.no_grad()` builds graphs it never uses"
    fixed_in = frozenset({"device"})
    triggers = ("eval", "test", "valid", "predict", "infer")
    examples = (
        Flagged(
            "import torch\ndef evaluate(model, loader):\n    model.eval()\n    for x, y in loader:\n        out = model(x)\n",
            fixed="import torch\n@torch.no_grad()\ndef evaluate(model, loader):\n    model.eval()\n"
            "    for x, y in loader:\n        out = model(x)\n",
        ),
        Flagged(
            "import torch\nmodel.eval()\nfor x, y in test_loader:\n    correct += (model(x).argmax(1) == y).sum().item()\n",
            fixed="import torch\nmodel.eval()\nwith torch.no_grad():\n    for x, y in test_loader:\n"
            "        correct += (model(x).argmax(1) == y).sum().item()\n",
        ),
        Clean("import torch\n@torch.no_grad()\ndef evaluate(model, loader):\n    model.eval()\n"),
        Clean("import torch\ndef test(model, x):\n    model.eval()\n    with torch.inference_mode():\n        return model(x)\n"),
        Clean("def validate(model, x):\n    model.eval()\n    loss = model(x).sum()\n    loss.backward()\n"),
        Clean("def test_shapes():\n    assert f(1) == 1\n"),
        Clean("model.eval()\nmodel.train()\nfor x in loader:\n    model(x)\n"),
    )

    def visit_Module(self, node: cst.Module) -> None:
        self.functions: Set[int] = set()
        self.loops: Set[int] = set()
        self._blocks(node.body, decorated=False)

    def _blocks(self, body, decorated: bool) -> None:
        """Mark evaluation functions, and evaluation loops after `model.eval()` in a block."""
        evaluating = False
        for stmt in body:
            if isinstance(stmt, cst.FunctionDef):
                marked = self._evaluation_function(stmt)
                if marked:
                    self.functions.add(id(stmt))
                self._blocks(stmt.body.body, decorated=marked or _has_no_grad(self.ctx, stmt))
                continue
            if isinstance(stmt, cst.ClassDef):
                for inner in stmt.body.body:
                    if isinstance(inner, cst.FunctionDef) and _calls_eval(inner) and self._evaluation_function(inner, method=True):
                        self.functions.add(id(inner))
                continue
            if isinstance(stmt, cst.SimpleStatementLine):
                if findall(stmt, _TRAIN_MODE):
                    evaluating = False
                elif _calls_eval(stmt):
                    evaluating = True
            elif isinstance(stmt, (cst.For, cst.While)) and evaluating and not decorated:
                if not calls_backward(stmt) and not _has_no_grad_block(self.ctx, stmt) and findall(stmt, m.Call()):
                    self.loops.add(id(stmt))
            elif isinstance(stmt, cst.If) and stmt.test and m.matches(stmt.test, m.Comparison(left=m.Name("__name__"))):
                self._blocks(stmt.body.body, decorated)

    def _evaluation_function(self, func: cst.FunctionDef, method: bool = False) -> bool:
        named = bool(_EVAL_NAME.match(func.name.value))
        body = cst.IndentedBlock(body=_own_body(func))
        evals = _calls_eval(body)
        if not (evals or (named and not method and self._runs_a_model(func))):
            return False
        if named and not evals and func.name.value.startswith("test_") and findall(body, m.Assert()):
            return False  # a pytest test, not an evaluation
        return not calls_backward(func) and not _has_no_grad(self.ctx, func) and not _has_no_grad_block(self.ctx, body)

    def _runs_a_model(self, func: cst.FunctionDef) -> bool:
        """A name like `validate` is not enough (`validate_config()`): the function must take
        a model or loop over batches."""
        params = {p.name.value.lower() for p in (*func.params.params, *func.params.kwonly_params)}
        if any("model" in p or p in ("net", "network", "encoder", "decoder") for p in params):
            return True
        code = self.ctx.module.code_for_node
        return any(re.search(r"loader|batch|data", code(loop.iter), re.I) for loop in findall(func.body, m.For()))

    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef):
        if id(original) not in self.functions:
            return None
        self.report(original.name, f"`{original.name.value}()` evaluates without `torch.no_grad()`; "
                                   "it builds graphs it never uses")
        if has_no_grad_decorator(updated):
            return None  # GM203 added it in this run
        return updated.with_changes(decorators=[*updated.decorators, no_grad_decorator(self.ctx)])

    def _loop(self, original, updated):
        if id(original) not in self.loops:
            return None
        self.report(original, "evaluation loop after `.eval()` without `torch.no_grad()`")
        return no_grad_with(self.ctx, updated)

    leave_For = leave_While = _loop


def _has_no_grad(ctx, func: cst.FunctionDef) -> bool:
    return under_no_grad(ctx, [func])


def _has_no_grad_block(ctx, node: cst.CSTNode) -> bool:
    return any(under_no_grad(ctx, [w]) for w in findall(node, m.With()))


_HALF_STATEMENT = m.SimpleStatementLine(body=[
    m.Expr(m.Call(func=m.Attribute(attr=m.Name("half")), args=[]))
    | m.Assign(targets=[m.AssignTarget(m.Name())], value=m.Call(func=m.Attribute(attr=m.Name("half")), args=[]))
])


class HalfBatchNorm(Rule):
    """
    ## What it does
    Finds `model.half()` in a script whose model has BatchNorm layers.

    ## Why is this bad?
    In float16, BatchNorm's running variance and its normalisation lose precision (and can
    overflow): training fails to converge. The seed posts keep BatchNorm in float32.

    ## Example
    ```python
    model = Net().half()
    ```

    ## Use instead
    ```python
    model = Net().half()
    keep_batchnorm_fp32(model)  # from gpumigrate.runtime: BatchNorm stays float32
    ```
    Or better, train in mixed precision (`--to amp`).
    """

    code = "GM305"
    name = "half-batchnorm"
    message = "`.half()` puts BatchNorm in float16, which fails to converge; keep BatchNorm in float32"
    fixed_in = frozenset({"device"})
    triggers = ("half",)
    examples = (
        Flagged(
            "import torch.nn as nn\nmodel = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4))\nmodel.half()\n",
            fixed="import torch.nn as nn\nfrom gpumigrate.runtime import keep_batchnorm_fp32\n\n"
            "model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4))\nmodel.half()\nkeep_batchnorm_fp32(model)\n",
        ),
        Flagged(
            "import torch.nn as nn\nbn = nn.BatchNorm1d(3)\nnet = Net().half()\n",
            fixed="import torch.nn as nn\nfrom gpumigrate.runtime import keep_batchnorm_fp32\n\n"
            "bn = nn.BatchNorm1d(3)\nnet = Net().half()\nkeep_batchnorm_fp32(net)\n",
        ),
        Clean("import torch.nn as nn\nmodel = nn.Linear(2, 2)\nmodel.half()\n"),
        Clean("import torch.nn as nn\nbn = nn.BatchNorm1d(3)\nx = data.half()\n"),
        Clean("import torch.nn as nn\nbn = nn.BatchNorm1d(3)\nmodel.half()\nkeep_batchnorm_fp32(model)\n"),
    )

    def visit_Module(self, node: cst.Module) -> None:
        self.active = "BatchNorm" in self.ctx.text
        self.guarded = {
            call.args[0].value.value
            for call in findall(node, m.Call(func=m.Name("keep_batchnorm_fp32"), args=[m.Arg(m.Name())]))
        }

    def leave_SimpleStatementLine(self, original, updated):
        if not self.active or not m.matches(original, _HALF_STATEMENT):
            return None
        small = original.body[0]
        call = small.value
        if isinstance(small, cst.Assign):
            model = small.targets[0].target.value
        elif isinstance(call.func.value, cst.Name):
            model = call.func.value.value
        else:
            return None
        if model in self.guarded or not _module_like(model, call.func.value):
            return None
        self.report(call)
        if self.fixing:
            self.ctx.add_import(RUNTIME, "keep_batchnorm_fp32")
        guard = cst.SimpleStatementLine(body=[cst.Expr(cst.Call(func=cst.Name("keep_batchnorm_fp32"),
                                                                args=[cst.Arg(cst.Name(model))]))])
        return cst.FlattenSentinel([updated, guard])


def _module_like(name: str, receiver: cst.BaseExpression) -> bool:
    """A model rather than a data tensor: named like one, or built by a class (`Net()`)."""
    lowered = name.lower()
    if "model" in lowered or "net" in lowered or lowered in ("generator", "discriminator", "encoder", "decoder"):
        return True
    return m.matches(receiver, m.Call(func=m.Name(value=m.MatchIfTrue(lambda v: v[:1].isupper()))))
