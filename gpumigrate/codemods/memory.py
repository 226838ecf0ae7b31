"""GPU memory: graphs kept alive, evaluation without no_grad, fp16 BatchNorm, the caching
allocator and out-of-memory handlers. GM301-GM306 (GM304, GM306 report only).

The seed posts' main lesson: a loss tensor carries the autograd graph of its step. Keep it
(`total += loss`, `losses.append(loss)`) and every step's activations stay in memory.
"""

from __future__ import annotations

import bisect
import itertools
import re
from functools import cached_property
from typing import List, Optional, Set, Union

import libcst as cst

from gpumigrate.analysis import script_model
from gpumigrate.analysis import values as v
from gpumigrate.analysis.structure import dotted, target_names
from gpumigrate.analysis.values import FUNCTIONAL_LOSSES
from gpumigrate.codemods.amp_plan import amp_plan
from gpumigrate.codemods.base import Clean, Flagged, Rule
from gpumigrate.codemods.helpers import (
    call_method,
    findall,
    is_method_call,
    last_name,
    literal_str,
    loop_index,
    runtime_helper,
    runtime_name,
    statements,
    walk,
)
from gpumigrate.codemods.legacy import (has_no_grad_decorator, no_grad_decorator, no_grad_with, returned_total,
                                       volatile_plan)
from gpumigrate.rewriter.facts import SourceFacts
from gpumigrate.rewriter.lazy import matchers as m


def _operands(expr: cst.BaseExpression):
    if isinstance(expr, cst.BinaryOperation):
        return [*_operands(expr.left), *_operands(expr.right)]
    return [expr]


def _itemize_by_position(updated: cst.BaseExpression, original: cst.BaseExpression, losses) -> cst.BaseExpression:
    """`loss * n` -> `loss.item() * n`: the operands (found on the original tree, where the
    model knows them) become Python numbers in the rewritten expression."""
    if isinstance(updated, cst.BinaryOperation) and isinstance(original, cst.BinaryOperation):
        return updated.with_changes(left=_itemize_by_position(updated.left, original.left, losses),
                                    right=_itemize_by_position(updated.right, original.right, losses))
    return call_method(updated, "item") if id(original) in losses else updated


def _loss_evidence(facts: SourceFacts) -> bool:
    """What the script model needs to prove anything a loss (`is_loss`): a name `.backward()`
    is called on, or a `torch.nn` name: a functional loss, an `nn.*Loss`, or a module class of
    the file named like a loss or criterion. Everything else in values.py only passes one on."""
    return facts.any_call("backward") or facts.any_id("nn") and (
        facts.any_id("functional") and facts.any_id(*FUNCTIONAL_LOSSES)
        or any(i.endswith("Loss") for i in facts.ids)
        or "ClassDef" in facts.kinds and any("loss" in i.lower() or "criterion" in i.lower() for i in facts.ids))


def _graph_operand(rule: Rule, expr: cst.BaseExpression) -> bool:
    """Is `expr` (or an operand of its arithmetic) a loss still in the graph?"""
    if script_model(rule.ctx).is_loss(expr):
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
    done = "accumulated graph tensor → `.item()`"
    name = "tensor-accumulation"
    message = "accumulating a graph tensor keeps every step's graph alive; use `.item()`"
    fixed_in = frozenset({"device"})
    triggers = ("loss", "criterion", "backward")

    # an `x += ...` or `x = x + ...` whose operand the script model proves a loss
    @classmethod
    def gate(cls, facts: SourceFacts) -> bool:
        return bool(facts.kinds & {"AugAssign", "BinOp"}) and _loss_evidence(facts)

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
        # MAML's per-step query losses, the last one backpropagated through a name bound to it
        Clean("import torch.nn.functional as F\nlosses_q = [0, 0]\nfor x, y in tasks:\n    for k in range(2):\n"
              "        loss_q = F.mse_loss(model(x), y)\n        losses_q[k] += loss_q\nmeta_loss = losses_q[-1] / len(tasks)\n"
              "meta_loss.backward()\n"),
        # a model's forward sums its per-step losses and returns them: its caller backpropagates
        Clean("import torch.nn.functional as F\nclass VRNN(nn.Module):\n    def forward(self, x):\n"
              "        kld_loss = 0\n        for t in range(x.size(0)):\n"
              "            kld_loss += F.kl_div(self.enc(x[t]), x[t])\n        return kld_loss, None\n"),
    )

    def _skip(self, target: cst.BaseExpression) -> bool:
        model = script_model(self.ctx)
        names = [n.value for n in findall(target, m.Name())]
        return any(model.feeds_backward(n, target) for n in names) or model.under_no_grad(target) or \
            returned_total(self.ctx, target)

    def leave_AugAssign(self, original: cst.AugAssign, updated: cst.AugAssign):
        if not isinstance(original.operator, (cst.AddAssign, cst.SubtractAssign)):
            return None
        if not _graph_operand(self, original.value) or self._skip(original.target):
            return None
        self.report(original)
        self._original_value = original.value
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
        self._original_value = original.value
        return updated.with_changes(value=self._fix(updated.value, target))

    def _fix(self, value: cst.BaseExpression, total: cst.BaseExpression) -> cst.BaseExpression:
        """Every loss operand becomes `.item()`; the running total itself stays as it is."""
        model = script_model(self.ctx)
        losses = {id(n) for n in _operands(self._original_value) if model.is_loss(n) and not n.deep_equals(total)}
        return _itemize_by_position(value, self._original_value, losses)


# calls that take gradients where they are made, whatever mode the model is in
_GRADIENTS = frozenset({"torch.autograd.grad", "torch.autograd.backward", "torch.autograd.functional.jacobian",
                        "torch.autograd.functional.vjp", "torch.autograd.functional.hessian", "torch.func.grad",
                        "torch.func.vjp", "torch.func.jacrev"})


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
    done = "stored graph tensor → `.item()`"
    name = "tensor-in-container"
    message = "storing a graph tensor keeps its step's graph alive; store `.item()`"
    fixed_in = frozenset({"device"})
    triggers = ("append",)

    # a `.append(x)` of what the script model proves a loss
    @classmethod
    def gate(cls, facts: SourceFacts) -> bool:
        return facts.any_call("append") and _loss_evidence(facts)

    examples = (
        Flagged(
            "loss = criterion(out, y)\nloss.backward()\nlosses.append(loss)\n",
            fixed="loss = criterion(out, y)\nloss.backward()\nlosses.append(loss.item())\n",
        ),
        Flagged(
            "import torch.nn as nn\nloss_fn = nn.MSELoss()\nloss = loss_fn(out, y)\nhistory['loss'].append(loss)\n",
            fixed="import torch.nn as nn\nloss_fn = nn.MSELoss()\nloss = loss_fn(out, y)\n"
            "history['loss'].append(loss.item())\n",
        ),
        Clean("loss = criterion(out, y)\nlosses.append(loss.item())\nouts.append(out)\n"),
        Clean("losses = []\nfor x in xs:\n    loss = criterion(x)\n    losses.append(loss)\ntorch.stack(losses).sum().backward()\n"),
        Clean("import torch.nn.functional as F\nlosses = []\nfor x, y in data:\n    loss = F.mse_loss(model(x), y)\n"
              "    losses.append(loss)\ntotal = sum(losses) / len(losses)\ntotal.backward()\n"),
    )

    def leave_Call(self, original: cst.Call, updated: cst.Call):
        if not is_method_call(original, "append") or len(original.args) != 1 or original.args[0].keyword:
            return None
        value = original.args[0].value
        model = script_model(self.ctx)
        if not model.is_loss(value) or model.under_no_grad(original):
            return None
        container = [n.value for n in findall(original.func.value, m.Name())]
        if any(model.feeds_backward(n, original) or _computes_with(model, n, original) for n in container):
            return None
        self.report(original.args[0])
        arg = updated.args[0]
        return updated.with_changes(args=[arg.with_changes(value=call_method(arg.value, "item"))])


def _computes_with(model, name: str, at: cst.CSTNode) -> bool:
    """Is the list `name` computed with (`torch.stack(losses).mean()`), rather than only kept
    for logging? Then its graphs are needed."""
    scope = model.s.scope(at)
    for node in model.s.index.subtree(scope.node):
        if not (isinstance(node, cst.Name) and node.value == name and model.s.scope(node) is scope):
            continue
        for ancestor in model.s.ancestors(node):
            if isinstance(ancestor, cst.Call) and (model.qualify(ancestor.func) or "").startswith("torch."):
                return True
            if isinstance(ancestor, (cst.BaseSmallStatement, cst.BaseCompoundStatement)):
                break
    return False


_EVAL_NAME = re.compile(r"^(test|evaluate|evaluation|eval|validate|validation|valid|predict|inference|infer)"
                        r"(_.*)?$|^(evaluate|validate|predict|infer)")
_DEF = re.compile(r"\bdef[\s\\]+(\w+)")  # a function's name: `def` and blanks (or `\` line joins) before it


def _mode_calls(ctx, mode: str) -> List[int]:
    """Index positions of `x.eval()` (no argument) or `x.train(...)`, once per file: the plan
    asks block after block."""
    def build(ctx) -> List[int]:
        return [ctx.index.start[id(n)] for n in ctx.index.of(cst.Call) if type(n.func) is cst.Attribute
                and n.func.attr.value == mode and (mode != "eval" or not n.args)]
    return ctx.shared(("mode-calls", mode), build)


def _calls_mode(ctx, node: cst.CSTNode, mode: str) -> bool:
    index = ctx.index
    at = index.start.get(id(node))
    if at is None or index.order[at] is not node:
        return bool(m.findall(node, m.Call(func=m.Attribute(attr=m.Name(mode)),
                                           **({"args": []} if mode == "eval" else {}))))
    found = _mode_calls(ctx, mode)
    k = bisect.bisect_left(found, at)
    return k < len(found) and found[k] < index.end[id(node)]


def _calls_eval(ctx, node: cst.CSTNode) -> bool:
    return _calls_mode(ctx, node, "eval")


def _function_calls_eval(model, func: cst.FunctionDef) -> bool:
    """`model.eval()` in the function's own body (not in nested functions)."""
    if not _calls_eval(model.ctx, func):  # a slice of the node index: spares the script model most functions
        return False
    fn = model.s.functions.get(id(func))
    return fn is not None and any(isinstance(c.func, cst.Attribute) and c.func.attr.value == "eval" and not c.args
                                  for c in fn.calls)


def _own_body(func: cst.FunctionDef):
    """The function's statements, without nested functions and classes."""
    return [s for s in func.body.body if not isinstance(s, (cst.FunctionDef, cst.ClassDef))]


class _EvalPlan:
    """Which evaluation code GM303 puts under `torch.no_grad()`: functions that evaluate
    (`model.eval()`, or named like evaluation and running a model) and never train, and loops
    after `model.eval()` at module or `main()` level."""

    def __init__(self, ctx) -> None:
        self.ctx = ctx
        self.model = script_model(ctx)
        self.functions: Set[int] = set()  # evaluation functions that get `@torch.no_grad()`
        self.loops: Set[int] = set()  # evaluation loops that get `with torch.no_grad():`
        self._blocks(ctx.module.body, decorated=False)

    def covers(self, node: cst.CSTNode) -> bool:
        """Will `node` run under a `no_grad` this plan adds?"""
        return any(id(a) in self.functions or id(a) in self.loops for a in [node, *self.model.s.ancestors(node)])

    def _blocks(self, body, decorated: bool) -> None:
        """Mark evaluation functions, and evaluation loops after `model.eval()` in a block."""
        evaluating = False
        for stmt in body:
            if isinstance(stmt, cst.FunctionDef):
                marked = self._evaluation_function(stmt)
                if marked:
                    self.functions.add(id(stmt))
                self._blocks(stmt.body.body, decorated=marked or self.model.under_no_grad(stmt))
                continue
            if isinstance(stmt, cst.ClassDef):
                for inner in stmt.body.body:
                    if isinstance(inner, cst.FunctionDef) and _function_calls_eval(self.model, inner) and \
                            self._evaluation_function(inner, method=True):
                        self.functions.add(id(inner))
                continue
            if isinstance(stmt, cst.SimpleStatementLine):
                if _calls_mode(self.ctx, stmt, "train"):
                    evaluating = False
                elif _calls_eval(self.ctx, stmt):
                    evaluating = True
            elif isinstance(stmt, (cst.For, cst.While)) and evaluating and not decorated:
                if not self.model.trains(stmt) and not self._no_grad_inside(stmt) and findall(stmt, m.Call()) \
                        and not self.model.under_no_grad(stmt) and not volatile_plan(self.ctx).covers(stmt) \
                        and not self._may_train_elsewhere(stmt, 0):
                    self.loops.add(id(stmt))
            elif isinstance(stmt, cst.If) and stmt.test and m.matches(stmt.test, m.Comparison(left=m.Name("__name__"))):
                self._blocks(stmt.body.body, decorated)

    def _evaluation_function(self, func: cst.FunctionDef, method: bool = False) -> bool:
        named = bool(_EVAL_NAME.match(func.name.value))
        evals = _function_calls_eval(self.model, func)
        if not (evals or (named and not method and self._runs_a_model(func))):
            return False
        if named and not evals and func.name.value.startswith("test_") and self.model.s.own(func, cst.Assert):
            return False  # a pytest test, not an evaluation
        if all(m.matches(c.func, m.Attribute(attr=m.Name("eval") | m.Name("train"))) for c in findall(func.body, m.Call())):
            return False  # `def _eval(self): self.actor.eval()`: it only switches modes, no graph to save
        fn = self.model.s.functions.get(id(func))
        return fn is not None and not self.model.function_trains(fn) and not self.model.under_no_grad(func) \
            and not self._no_grad_inside(func) and not self._may_train_elsewhere(func, 0)

    def _may_train_elsewhere(self, func: Union[cst.FunctionDef, cst.For, cst.While], depth: int) -> bool:
        """Does `func` (a function or a loop, or a function of this file it calls) hand an
        optimizer to a call, or call a function of a project module that trains
        (`train_one_epoch(model, loader)` from engine.py)? Its training is out of sight: under
        `no_grad` it could not backward."""
        calls = findall(func.body, m.Call())
        evaluated = {dotted(c.func.value) for c in calls if m.matches(c.func, m.Attribute(attr=m.Name("eval")))}
        for call in calls:
            if any(self.model.kind(a.value) == v.OPTIMIZER for a in call.args):
                return True
            if self.model.qualify(call.func) in _GRADIENTS:
                return True  # gradients taken on purpose (an SGLD sampler, an attack): no_grad would stop them
            name = call.func.value if isinstance(call.func, cst.Name) else \
                call.func.attr.value if isinstance(call.func, cst.Attribute) else None
            # `train_one_epoch(model, criterion, loader, optimizer, loss_scaler)` (its backward in a
            # library's scaler), `trainer.train()`; not a module's mode switch `model.train()`
            if name and "train" in name.lower() and not (
                    name == "train" and isinstance(call.func, cst.Attribute) and self._switches_modes(call, evaluated)):
                return True
            if any(isinstance(a.value, cst.Name) and "optim" in a.value.value.lower() for a in call.args):
                return True  # an optimizer made where the analysis cannot see (`create_optimizer(args, model)`)
            target = self.model.s.callee(call)
            if target is None and name in self._project_trainers:
                return True
            if target is not None and isinstance(target.node, cst.FunctionDef) and target.node is not func and \
                    depth < 3 and self._may_train_elsewhere(target.node, depth + 1):
                return True
        return False

    def _switches_modes(self, call: cst.Call, evaluated: Set[Optional[str]]) -> bool:
        """`model.train()` of a module, or of what the function also calls `.eval()` on
        (`evaluated`: those receivers' names)."""
        receiver = call.func.value
        if self.model.kind(receiver) in (v.MODULE, v.LOSS_MODULE):
            return True
        name = dotted(receiver)
        return name is not None and name in evaluated

    @cached_property
    def _project_trainers(self) -> Set[str]:
        """The functions and methods of the project modules this file imports that train."""
        project = self.ctx.options.get("project")
        return {name for link in getattr(project, "imports", ()) if "backward" in link.calls
                for name in (*link.defines, *(m_.split(".")[-1] for m_ in link.methods), *link.steps)}

    def _no_grad_inside(self, node: cst.CSTNode) -> bool:
        return any(self.model.under_no_grad(w) for w in self.model.s.inside(node, cst.With))

    def _runs_a_model(self, func: cst.FunctionDef) -> bool:
        """A name like `validate` is not enough (`validate_config()`): the function must take
        a model or loop over batches."""
        params = {p.name.value.lower() for p in (*func.params.params, *func.params.kwonly_params)}
        if any("model" in p or p in ("net", "network", "encoder", "decoder") for p in params):
            return True
        code = self.ctx.module.code_for_node
        return any(re.search(r"loader|batch|data", code(loop.iter), re.I) for loop in findall(func.body, m.For()))



def eval_plan(ctx) -> _EvalPlan:
    return ctx.shared("eval-plan", _EvalPlan)


def under_no_grad_after_migration(ctx, node: cst.CSTNode) -> bool:
    """Does `node` run under `torch.no_grad()` once the device fixes are made (its own, or one
    that GM203 or GM303 adds)?"""
    if script_model(ctx).under_no_grad(node) or volatile_plan(ctx).covers(node):
        return True
    return "GM303" in ctx.fixing and eval_plan(ctx).covers(node)


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
    done = "evaluation runs under `torch.no_grad()`"
    name = "eval-without-no-grad"
    message = "evaluation without `torch.no_grad()` builds graphs it never uses"
    fixed_in = frozenset({"device"})
    triggers = ("eval", "test", "valid", "predict", "infer")

    # `.eval()` marks evaluation code; without it, only a function named like evaluation that
    # takes a model-like parameter or loops
    @classmethod
    def gate(cls, facts: SourceFacts) -> bool:
        return facts.any_call("eval") or (
            bool(facts.kinds & {"For", "AsyncFor"})
            or any("model" in i.lower() or i.lower() in ("net", "network", "encoder", "decoder") for i in facts.ids)
        ) and any(_EVAL_NAME.match(d.group(1)) for d in _DEF.finditer(facts.text))

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
        # an energy model's SGLD sampler: gradients of the input, in eval mode, for training
        Clean("import torch\ndef sample_q(f, x):\n    f.eval()\n    for _ in range(3):\n"
              "        x = x + torch.autograd.grad(f(x).sum(), [x])[0]\n    f.train()\n    return x.detach()\n"),
        Clean("def test_shapes():\n    assert f(1) == 1\n"),
        Clean("class Agent:\n    def _eval(self):\n        self.actor.eval()\n        self.critic.eval()\n"),
        Clean("model.eval()\nmodel.train()\nfor x in loader:\n    model(x)\n"),
        # deit-style main(): it evaluates, then trains through a project function whose backward
        # is in a library's loss scaler
        Clean("import torch\nfrom engine import evaluate, train_one_epoch\ndef main(args):\n    model.eval()\n"
              "    print(evaluate(loader, model))\n    for epoch in range(3):\n"
              "        train_one_epoch(model, loader, optimizer, loss_scaler)\n"),
        Flagged(
            "import torch\ndef evaluate(model, loader):\n    model.eval()\n    for x, y in loader:\n"
            "        out = model(x)\n    model.train()\n",
            fixed="import torch\n@torch.no_grad()\ndef evaluate(model, loader):\n    model.eval()\n"
            "    for x, y in loader:\n        out = model(x)\n    model.train()\n",
        ),
    )

    def visit_Module(self, node: cst.Module) -> None:
        plan = eval_plan(self.ctx)
        self.functions, self.loops = plan.functions, plan.loops

    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef):
        if id(original) not in self.functions:
            return None
        name = original.name.value
        self.report(original.name, f"`{name}()` runs under `@torch.no_grad()`: it evaluates, and built graphs it "
                                   "never used" if self.fixing else
                                   f"`{name}()` evaluates without `torch.no_grad()`; it builds graphs it never uses")
        if has_no_grad_decorator(updated):
            return None  # GM203 added it in this run
        return updated.with_changes(decorators=[*updated.decorators, no_grad_decorator(self.ctx)])

    def _loop(self, original, updated):
        if id(original) not in self.loops:
            return None
        self.report(original, "evaluation loop after `.eval()` runs under `torch.no_grad()`" if self.fixing
                    else "evaluation loop after `.eval()` without `torch.no_grad()`")
        return no_grad_with(self.ctx, updated)

    leave_For = leave_While = _loop


# A conversion of a model to float16 is a statement of its own whose value is a chain of
# `.half()`, `.to(...)`, `.cuda(...)` and `.cpu()` calls that leaves it in float16:
# `model.half()`, `net = Net().half()`, `net = model.half().to(device)`,
# `model = model.to(device).half()`, `model.half().cuda()`.
_CHAIN = ("half", "to", "cuda", "cpu")
_HALF_DTYPES = frozenset({"float16", "half"})
_OTHER_DTYPES = frozenset({"float", "float32", "float64", "double", "bfloat16"})
_GUARD = "keep_batchnorm_fp32"


def _to_dtype(call: cst.Call) -> Optional[bool]:
    """For `.to(...)`: True if it casts to float16, False to another float dtype, None if it
    only moves (`.to(device)`)."""
    for arg in call.args:
        if arg.keyword is not None and arg.keyword.value != "dtype":
            continue
        name = (dotted(arg.value) or "").rsplit(".", 1)[-1]
        if name in _HALF_DTYPES:
            return True
        if name in _OTHER_DTYPES:
            return False
    return None


def _half_receiver(expr: cst.BaseExpression) -> Optional[cst.BaseExpression]:
    """What `expr` converts to float16, if it is such a chain (`model` in
    `model.half().to(device)`); else None."""
    links = []
    while is_method_call(expr, *_CHAIN):
        links.append(expr)
        expr = expr.func.value
    half = False
    for call in reversed(links):  # in the order they run
        if call.func.attr.value == "half" and not call.args:
            half = True
        elif call.func.attr.value == "to":
            dtype = _to_dtype(call)
            half = half if dtype is None else dtype
    return expr if half else None


def _half_statement(line: cst.CSTNode):
    """(receiver, assigned Name or None) for a conversion statement line, else None. Only
    one statement on the line; an assignment only to one name; an expression statement
    only on a name (`model.half()`: the receiver is the model that is then used)."""
    if not isinstance(line, cst.SimpleStatementLine) or len(line.body) != 1:
        return None
    small = line.body[0]
    if isinstance(small, cst.Assign) and len(small.targets) == 1 and isinstance(small.targets[0].target, cst.Name):
        receiver = _half_receiver(small.value)
        return (receiver, small.targets[0].target) if receiver is not None else None
    if isinstance(small, cst.Expr):
        receiver = _half_receiver(small.value)
        return (receiver, None) if isinstance(receiver, cst.Name) else None
    return None


class _Conversion:
    """A conversion statement line: the name it converts (None for `Net().half()`), the
    name then used (the assigned one, else the receiver), where it is."""

    __slots__ = ("line", "receiver", "used", "order", "block", "model")

    def __init__(self, line, receiver, used, order, block):
        self.line, self.receiver, self.used, self.order, self.block = line, receiver, used, order, block
        self.model = None  # which model object of its scope, found by HalfBatchNorm._plan_scope


def _chain_link(value: cst.BaseExpression) -> Optional[str]:
    """`net = model` or `net = model.to(device)`: `net` names the same module as `model`."""
    while is_method_call(value, *_CHAIN):
        value = value.func.value
    return value.value if isinstance(value, cst.Name) else None


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

    A model converted more than once (`model.half()`, later `net = model.half().to(device)`)
    gets the guard after its last conversion, on the name then used (`net`): a later `.half()`
    would put BatchNorm back in float16 under the float32 hooks.
    """

    code = "GM305"
    done = "BatchNorm kept in float32 under `.half()` (`keep_batchnorm_fp32`)"
    name = "half-batchnorm"
    message = "`.half()` puts BatchNorm in float16, which fails to converge; keep BatchNorm in float32"
    fixed_in = frozenset({"device"})
    triggers = ("half",)

    # a `.half()` conversion, and the rule only looks at files that mention BatchNorm
    @classmethod
    def gate(cls, facts: SourceFacts) -> bool:
        return facts.any_call("half") and "BatchNorm" in facts.text

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
        Flagged(  # converted twice: one guard, after the last conversion, on the name then used
            "import torch.nn as nn\nmodel = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4))\nmodel.half()\n"
            "net = model.half().to(device)\nout = net(x.half())\n",
            fixed="import torch.nn as nn\nfrom gpumigrate.runtime import keep_batchnorm_fp32\n\n"
            "model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4))\nmodel.half()\n"
            "net = model.half().to(device)\nkeep_batchnorm_fp32(net)\nout = net(x.half())\n",
        ),
        Clean("import torch.nn as nn\nmodel = nn.Linear(2, 2)\nmodel.half()\n"),
        Clean("import torch.nn as nn\nbn = nn.BatchNorm1d(3)\nx = data.half()\n"),
        Clean("import torch.nn as nn\nbn = nn.BatchNorm1d(3)\nmodel.half()\nkeep_batchnorm_fp32(model)\n"),
        Clean("import torch.nn as nn\nbn = nn.BatchNorm1d(3)\nmodel.half()\nnet = model.to(device).half()\n"
              "keep_batchnorm_fp32(net)\n"),
    )

    def visit_Module(self, node: cst.Module) -> None:
        # --to amp replaces `.half()` training by autocast (GM502): no float16 BatchNorm to guard
        self.active = "BatchNorm" in self.ctx.text and not ("GM502" in self.ctx.fixing and amp_plan(self.ctx).applies)
        self.flagged: Set[int] = set()  # id(line): conversions to report
        self.guard_after: dict = {}  # id(line) -> the name to guard after it
        if self.active:
            self._plan(node)

    def _is_guard(self, call: cst.Call) -> bool:
        return last_name(call.func) == _GUARD or runtime_helper(self.qualify(call.func)) == _GUARD

    def _plan(self, node: cst.Module) -> None:
        module = script_model(self.ctx)
        s = module.s
        by_scope: dict = {}  # scope -> [conversion]
        seen: Set[int] = set()
        for call in findall(node, m.Call(func=m.Attribute(attr=m.Name("half")), args=[])):
            line = s.line(call)
            if line is None or id(line) in seen:
                continue
            seen.add(id(line))
            found = _half_statement(line)
            if found is None:
                continue
            receiver, target = found
            if not (module.module_like(receiver) or (target is not None and module.module_like(target))):
                continue
            name = receiver.value if isinstance(receiver, cst.Name) else None
            by_scope.setdefault(s.scope(line), []).append(_Conversion(
                line, name, target.value if target is not None else name, s.order(line.body[0]), s.block(line)))
        if not by_scope:
            return
        guards: dict = {}  # scope -> [(order, name)]
        for call in findall(node, m.Call(args=[m.Arg(m.Name())])):
            if self._is_guard(call):
                guards.setdefault(s.scope(call), []).append((s.order(call), call.args[0].value.value))
        for scope, conversions in by_scope.items():
            self._plan_scope(scope, conversions, guards.get(scope, []))

    def _plan_scope(self, scope, conversions: List[_Conversion], guards) -> None:
        """Which model each conversion and guard is about, by walking the scope's bindings,
        conversions and guards in document order: a conversion or a plain alias
        (`net = model`, `net = model.to(device)`) makes its target name the model its
        receiver names; any other binding makes the name a new object."""
        at_conversion = {c.order: c for c in conversions}
        events = [(c.order, 1, c) for c in conversions]
        events += [(order, 2, name) for order, name in guards]
        events += [(b.order, 0, b) for bindings in scope.bindings.values() for b in bindings
                   if b.order not in at_conversion]
        events.sort(key=lambda e: (e[0], e[1]))
        current: dict = {}  # name -> model id
        fresh = itertools.count()

        def model_of(name: str):
            if name not in current:
                current[name] = ("initial", name)
            return current[name]

        guarded_at: dict = {}  # model -> [order of each guard]
        for order, kind, item in events:
            if kind == 0:  # a binding
                source = _chain_link(item.value) if item.how == "assign" and not item.path and \
                    isinstance(item.value, cst.BaseExpression) else None
                current[item.name] = model_of(source) if source is not None else next(fresh)
            elif kind == 1:  # a conversion
                item.model = model_of(item.receiver) if item.receiver is not None else next(fresh)
                current[item.used] = item.model
            else:  # a guard
                guarded_at.setdefault(model_of(item), []).append(order)
        groups: dict = {}
        for c in conversions:
            groups.setdefault(c.model, []).append(c)
        for model, group in groups.items():
            group.sort(key=lambda c: c.order)
            guards_of = guarded_at.get(model, [])
            # The guard goes after the last conversion (a guard after an earlier one is
            # undone by the next `.half()`). Where conversions of the model sit in different
            # blocks (branches, loops), which one runs last is not known here, so, proven or
            # guarded: each conversion that is the last of the model in its own block gets a
            # guard, and every path ends with one. A conversion is guarded by a guard call on
            # its model after it and before the model's next conversion.
            missing = []
            for i, c in enumerate(group):
                later = group[i + 1:]
                if any(other.block is c.block for other in later):
                    continue
                until = later[0].order if later else float("inf")
                if not any(c.order < g < until for g in guards_of):
                    missing.append(c)
            if missing:
                self.flagged.update(id(c.line) for c in group)
                self.guard_after.update((id(c.line), c.used) for c in missing)

    def leave_SimpleStatementLine(self, original, updated):
        if not self.active or id(original) not in self.flagged:
            return None
        self.report(original.body[0].value)
        used = self.guard_after.get(id(original))
        if used is None:
            return None
        guard = cst.SimpleStatementLine(body=[cst.Expr(cst.Call(
            func=runtime_name(self.ctx, _GUARD, self.fixing), args=[cst.Arg(cst.Name(used))]))])
        return cst.FlattenSentinel([updated, guard])


_EMPTY_CACHE = ("torch.cuda.empty_cache", "torch.mps.empty_cache")


class EmptyCacheInLoop(Rule):
    """
    ## What it does
    Finds `torch.cuda.empty_cache()` (or `torch.mps.empty_cache()`) inside the body of a
    `for` or `while` loop of the same function.

    ## Why is this bad?
    The caching allocator already reuses freed memory; emptying the cache gives this process
    nothing back. It synchronizes the device and returns the cached blocks to the driver, so
    the next iteration pays for fresh `cudaMalloc` calls: every step gets slower.

    ## Example
    ```python
    for data, target in train_loader:
        loss = train_step(data, target)
        torch.cuda.empty_cache()
    ```

    ## Use instead
    ```python
    for data, target in train_loader:
        loss = train_step(data, target)
    torch.cuda.empty_cache()  # once, if another process needs the memory
    ```
    Not flagged: a call inside an `except` handler (it runs only on failure, as in the
    out-of-memory skip-the-batch idiom), or in a per-epoch loop: one whose target or
    iterable names an epoch, or whose body holds the inner loop over batches.
    """

    code = "GM304"
    name = "empty-cache-in-loop"
    message = "`empty_cache()` in a loop syncs the GPU and frees the allocator's cache every iteration"
    reported_in = frozenset({"device"})
    triggers = ("empty_cache",)

    # a call qualified as `torch.cuda.empty_cache` / `torch.mps.empty_cache`, inside a loop
    @classmethod
    def gate(cls, facts: SourceFacts) -> bool:
        return facts.any_id("empty_cache") and facts.has_loop()

    examples = (
        Flagged("import torch\nfor x, y in loader:\n    loss = step(x, y)\n    torch.cuda.empty_cache()\n"),
        Flagged("from torch.cuda import empty_cache\nwhile step < total:\n    if step % 10 == 0:\n"
                "        empty_cache()\n    step += 1\n"),
        Clean("import torch\nfor x, y in loader:\n    step(x, y)\ntorch.cuda.empty_cache()\n"),
        Clean("import torch\nfor x, y in loader:\n    try:\n        step(x, y)\n    except RuntimeError:\n"
              "        torch.cuda.empty_cache()\n"),
        Clean("import torch\nfor epoch in range(args.epochs):\n    train(model, loader)\n    torch.cuda.empty_cache()\n"),
        Clean("import torch\nfor x in loader:\n    def cleanup():\n        torch.cuda.empty_cache()\n"),
        Clean("import torch\nfor fold in folds:\n    for x in loader:\n        step(x)\n    torch.cuda.empty_cache()\n"),
    )

    def visit_Call(self, node: cst.Call) -> None:
        qualified = self.qualify(node.func)
        if qualified not in _EMPTY_CACHE:
            return
        ancestors = self.ctx.ancestors
        index = loop_index(ancestors)
        if index is None or any(isinstance(a, cst.ExceptHandler) for a in ancestors[index:]):
            return
        if _per_epoch(ancestors[index]) or _leaves_loop(ancestors[index + 1:]):
            return
        self.report(node, f"`{qualified}()` in a loop syncs the device and frees the allocator's cache every "
                          f"iteration, so the next one pays for fresh allocations; the cache is already "
                          f"reused: call it once after the loop, if at all")


def _leaves_loop(inner) -> bool:
    """Does the block holding the call also `break`, `return` or `raise`? Then it runs once."""
    block = next(a for a in reversed(inner) if isinstance(a, cst.BaseSuite))
    lines = [s for s in block.body if isinstance(s, cst.SimpleStatementLine)] if isinstance(block, cst.IndentedBlock) \
        else [block]
    return any(isinstance(small, (cst.Break, cst.Return, cst.Raise)) for line in lines for small in line.body)


def _per_epoch(loop: Union[cst.For, cst.While]) -> bool:
    header = (loop.target, loop.iter) if isinstance(loop, cst.For) else (loop.test,)
    for part in header:
        for n in walk(part):
            name = last_name(n) if isinstance(n, (cst.Name, cst.Attribute)) else None
            if name and "epoch" in name.lower():
                return True
    return any(isinstance(n, (cst.For, cst.While)) for n in statements(loop.body))


_OOM_TYPES = ("torch.cuda.OutOfMemoryError", "torch.OutOfMemoryError")
_BROAD_TYPES = ("RuntimeError", "Exception", "BaseException")


class OomRetryLeak(Rule):
    """
    ## What it does
    Finds out-of-memory handlers inside a loop (`except RuntimeError as e:` checking
    `'out of memory' in str(e)`, or `except torch.cuda.OutOfMemoryError:`) that go on to the
    next attempt while the failed step's tensors are still bound: the handler neither
    `del`s them nor re-raises.

    ## Why is this bad?
    While the handler runs, the exception's traceback keeps every frame of the failed step
    alive with its activations; after it, `outputs` and `loss` still hold the failed step's
    graph. Retrying then needs that memory twice over and runs out of memory again.

    ## Example
    ```python
    for data, target in train_loader:
        try:
            output = model(data)
            loss = criterion(output, target)
            loss.backward()
        except RuntimeError as e:
            if "out of memory" in str(e):
                torch.cuda.empty_cache()
                continue
            raise
    ```

    ## Use instead
    ```python
    for data, target in train_loader:
        try:
            output = model(data)
            loss = criterion(output, target)
            loss.backward()
        except RuntimeError as e:
            if "out of memory" not in str(e):
                raise
            del output, loss  # drop the failed step's graph
            optimizer.zero_grad(set_to_none=True)
            continue
    ```
    The handler is fine when it `del`s (or sets to `None`) a name bound in the `try` body,
    re-raises, returns or breaks out of the loop.
    """

    code = "GM306"
    name = "oom-retry-leak"
    message = "OOM handler retries while the failed step's tensors are alive"
    reported_in = frozenset({"device"})
    triggers = ("except",)

    # a `try` in a loop whose handler catches an OutOfMemoryError or tests an "out of memory" literal
    @classmethod
    def gate(cls, facts: SourceFacts) -> bool:
        return "Try" in facts.kinds and facts.has_loop() and (
            facts.any_id("OutOfMemoryError") or any("out of memory" in s.lower() for s in facts.strings))

    examples = (
        Flagged("for x, y in loader:\n    try:\n        out = model(x)\n        loss = crit(out, y)\n"
                "        loss.backward()\n    except RuntimeError as e:\n        if 'out of memory' in str(e):\n"
                "            print('skipping batch')\n            continue\n        raise\n"),
        Flagged("import torch\nwhile bs > 0:\n    try:\n        out = model(x[:bs])\n        break\n"
                "    except torch.cuda.OutOfMemoryError:\n        bs //= 2\n"),
        Clean("for x, y in loader:\n    try:\n        out = model(x)\n        loss = crit(out, y)\n"
              "    except RuntimeError as e:\n        if 'out of memory' in str(e):\n"
              "            del out, loss\n            continue\n        raise\n"),
        Clean("for x, y in loader:\n    try:\n        out = model(x)\n    except RuntimeError as e:\n"
              "        if 'out of memory' in str(e):\n            raise MemoryError('reduce the batch') from e\n"),
        Clean("try:\n    out = model(x)\nexcept RuntimeError as e:\n    if 'out of memory' in str(e):\n"
              "        out = None\n"),
        Clean("for x in loader:\n    try:\n        out = model(x)\n    except RuntimeError as e:\n"
              "        log(e)\n        continue\n"),
        Clean("for x in loader:\n    try:\n        out = model(x)\n    except RuntimeError as e:\n"
              "        if 'out of memory' in str(e):\n            return None\n"),
    )

    def visit_Try(self, node: cst.Try) -> None:
        if not node.handlers or loop_index(self.ctx.ancestors) is None:
            return
        bound = _bound_names(node.body)
        if not bound:
            return
        for handler in node.handlers:
            path = self._oom_path(handler)
            if path is None or _leaves(path) or _releases(path, bound):
                continue
            self.report(handler, "this out-of-memory handler goes on to the next attempt while the failed "
                                 "step's tensors are alive (the exception's traceback holds the frame; "
                                 f"`{', '.join(sorted(bound))}` hold its graph), so the retry needs twice the "
                                 "memory: leave the handler first, `del` the outputs and loss, then retry")

    def _oom_path(self, handler: cst.ExceptHandler) -> Optional[List[cst.CSTNode]]:
        """The handler's statements that run on out-of-memory, or None if it does not catch it."""
        types = _handler_types(handler.type)
        qualified = [self.qualify(t) or last_name(t) for t in types]
        body = list(handler.body.body)
        if any(q in _OOM_TYPES for q in qualified):
            return body
        if not any(q in _BROAD_TYPES for q in qualified) or handler.name is None:
            return None
        name = handler.name.name.value if isinstance(handler.name.name, cst.Name) else None
        if not any(_oom_check(n, name) is not None for n in walk(handler.body)):
            return None
        path: List[cst.CSTNode] = []
        for stmt in body:
            checks = [_oom_check(n, name) for n in walk(stmt.test)] if isinstance(stmt, cst.If) else []
            if True in checks:
                path.append(stmt.body)  # `if "out of memory" in str(e): ... else: raise`
                if _ends_block(stmt.body):
                    break  # what follows runs for other errors only
            elif False in checks:
                path.extend([stmt.orelse] if stmt.orelse is not None else [])  # `if ... not in ...: raise`
            else:
                path.append(stmt)
        return path


def _ends_block(suite: cst.BaseSuite) -> bool:
    last = suite.body[-1] if suite.body else None
    if isinstance(last, cst.SimpleStatementLine):
        last = last.body[-1]
    return isinstance(last, (cst.Continue, cst.Break, cst.Return, cst.Raise))


def _handler_types(node: Optional[cst.BaseExpression]) -> List[cst.BaseExpression]:
    if node is None:
        return []
    if isinstance(node, cst.Tuple):
        return [e.value for e in node.elements]
    return [node]


def _oom_check(node: cst.CSTNode, name: Optional[str]) -> Optional[bool]:
    """True for `'out of memory' in str(e)`, False for `not in`, None for anything else."""
    if not isinstance(node, cst.Comparison) or len(node.comparisons) != 1:
        return None
    text = literal_str(node.left)
    target = node.comparisons[0]
    if text is None or "out of memory" not in text.lower() or not isinstance(target.operator, (cst.In, cst.NotIn)):
        return None
    if name is not None and not any(isinstance(n, cst.Name) and n.value == name for n in walk(target.comparator)):
        return None
    return isinstance(target.operator, cst.In)


def _bound_names(body: cst.BaseSuite) -> Set[str]:
    """Names the `try` body binds to computed values (not literals or other names)."""
    names: Set[str] = set()
    for node in statements(body):
        if isinstance(node, (cst.Assign, cst.AnnAssign)) and node.value is not None and \
                not isinstance(node.value, (cst.Integer, cst.Float, cst.SimpleString, cst.Name)):
            targets = [t.target for t in node.targets] if isinstance(node, cst.Assign) else [node.target]
            names.update(n for t in targets for n in target_names(t))
    return names


def _leaves(path: List[cst.CSTNode]) -> bool:
    """Does the out-of-memory path re-raise or leave the loop?"""
    return any(isinstance(n, (cst.Raise, cst.Return, cst.Break)) for part in path for n in statements(part))


def _releases(path: List[cst.CSTNode], bound: Set[str]) -> bool:
    """Does the out-of-memory path `del` (or set to None) a name the `try` body bound?"""
    for part in path:
        for node in statements(part):
            if isinstance(node, cst.Del) and bound & set(target_names(node.target)):
                return True
            if isinstance(node, cst.Assign) and _is_none(node.value) and \
                    bound & {n for t in node.targets for n in target_names(t.target)}:
                return True
    return False


def _is_none(node: cst.BaseExpression) -> bool:
    return isinstance(node, cst.Name) and node.value == "None"
