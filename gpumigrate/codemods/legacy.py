"""The PyTorch 0.4 API migration and later removals: GM201-GM209 (GM204 reports only).

Scripts from 2017-2018 use idioms that today's torch rejects or silently changes:
`loss.data[0]` on a 0-dim tensor raises, `Variable` is a no-op whose `volatile` flag is
ignored (so evaluation builds graphs), `type(h) == Variable` is always False.
"""

from __future__ import annotations

import io
import re
import tokenize
from typing import Dict, List, Optional, Set, Tuple

import libcst as cst

from gpumigrate.analysis import script_model
from gpumigrate.analysis import values as v
from gpumigrate.analysis.structure import NEVER, dotted, target_names
from gpumigrate.codemods.base import Clean, Flagged, Rule
from gpumigrate.codemods.helpers import (
    enclosing,
    findall,
    call_method,
    get_arg,
    is_method_call,
    keyword_arg,
    literal_bool,
    positional_args,
    remove_statement,
    same_code,
    torch_name,
    with_args,
)
from gpumigrate.codemods.amp_plan import constructed_from
from gpumigrate.rewriter.facts import SourceFacts
from gpumigrate.rewriter.names import ImportTable
from gpumigrate.rewriter.lazy import matchers as m

VARIABLE = ("torch.autograd.Variable", "torch.autograd.variable.Variable")
# `from torch.autograd import Variable as V`: the only way to call it by another name.
_VARIABLE_AS = re.compile(r"\bVariable(?:\s|\\|#[^\r\n]*[\r\n])*as\b")  # comments end lines: no backtracking


# Gates read the stdlib facts: each part of a name the import table qualifies is an
# identifier of the file (of an import or an attribute), and a call's last name is in `calls`.
def _calls_variable(facts: SourceFacts) -> bool:
    return "autograd" in facts.ids and (facts.any_call("Variable") or (
        "Variable" in facts.ids and _VARIABLE_AS.search(facts.text) is not None))


# Every 0-dim kind (values.py) starts at a reduction, a functional loss or a loss module (torch's
# `*Loss`, a class of the file named for a loss or criterion).
def _zero_dim_source(facts: SourceFacts) -> bool:
    return facts.any_id(*v.REDUCTIONS, *v.FUNCTIONAL_LOSSES) or any(
        "loss" in name.lower() or "criterion" in name.lower() for name in facts.ids)


def _is_data_attr(node: cst.CSTNode) -> bool:
    return isinstance(node, cst.Attribute) and node.attr.value == "data"


def _index_zero(node: cst.Subscript) -> bool:
    return (
        len(node.slice) == 1
        and isinstance(node.slice[0].slice, cst.Index)
        and m.matches(node.slice[0].slice.value, m.Integer("0"))
    )


class DataIndexScalar(Rule):
    """
    ## What it does
    Finds `loss.data[0]`, the pre-0.4 way to read a Python number from a scalar loss, and
    `x[0]` on a value that is provably 0-dim (a criterion's result, also unpacked from a
    tuple; a full reduction such as `(pred == y).sum()`; arithmetic on these).

    ## Why is this bad?
    Since PyTorch 0.4 a loss is a 0-dim tensor: indexing it raises "invalid index of a 0-dim
    tensor. Use `tensor.item()`".

    ## Example
    ```python
    print(loss.data[0])
    ```

    ## Use instead
    ```python
    print(loss.item())
    ```
    `t.data[0]` on a tensor that is not known to be 0-dim is reported for review.
    """

    code = "GM201"
    done = "`.data[0]` → `.item()`"
    name = "data-index-scalar"
    message = "`.data[0]` on a 0-dim tensor raises since torch 0.4; use `.item()`"
    fixed_in = frozenset({"device"})
    triggers = ("[0]",)

    # `[0]` on `.data`, or on a name the values analysis finds 0-dim
    @classmethod
    def gate(cls, facts: SourceFacts) -> bool:
        return "[0]" in facts.text and "Subscript" in facts.kinds and ("data" in facts.ids or _zero_dim_source(facts))

    examples = (
        Flagged(
            "import torch.nn.functional as F\nloss = F.nll_loss(out, y)\nprint(loss.data[0])\n",
            fixed="import torch.nn.functional as F\nloss = F.nll_loss(out, y)\nprint(loss.item())\n",
        ),
        Flagged(
            "import torch.nn.functional as F\ntotal += F.nll_loss(out, y, reduction='sum').data[0]\n",
            fixed="import torch.nn.functional as F\ntotal += F.nll_loss(out, y, reduction='sum').item()\n",
        ),
        Flagged(
            "import torch\nimport torch.nn.functional as F\ndef criterion(o, y):\n    return F.mse_loss(o, y), F.l1_loss(o, y)\n"
            "out, y = torch.randn(4), torch.randn(4)\nloss_l, loss_c = criterion(out, y)\nprint(loss_l.data[0])\n"
            "correct = (out.argmax() == y.argmax()).sum()\nn = correct[0]\n",
            fixed="import torch\nimport torch.nn.functional as F\ndef criterion(o, y):\n    return F.mse_loss(o, y), F.l1_loss(o, y)\n"
            "out, y = torch.randn(4), torch.randn(4)\nloss_l, loss_c = criterion(out, y)\nprint(loss_l.item())\n"
            "correct = (out.argmax() == y.argmax()).sum()\nn = correct.item()\n",
        ),
        Flagged(  # a term of the loss backward runs on: one element (Beta-VAE's recon_loss)
            "recon = reconstruction_loss(x, x_recon)\nloss = recon + beta * kld\nloss.backward()\n"
            "print(recon.data[0], kld.data[0])\n",
            fixed="recon = reconstruction_loss(x, x_recon)\nloss = recon + beta * kld\nloss.backward()\n"
                  "print(recon.item(), kld.data[0])\n",
        ),
        Flagged("first = output.data[0]\n"),  # not known to be a scalar: review
        Flagged("loss.data[0] = 1.0\n"),  # a write: review, never `loss.item() = 1.0`
        Clean("print(loss.item())\nrow = batch[0]\n"),
    )

    @property
    def model(self):
        return script_model(self.ctx)

    @property
    def accumulated(self):
        return accumulated_data(self.ctx)  # GM207's: `total += loss.data` ... `total[0]`

    def leave_Subscript(self, original: cst.Subscript, updated: cst.Subscript) -> Optional[cst.BaseExpression]:
        if not _index_zero(original):
            return None
        if not _is_data_attr(original.value):
            value = original.value
            if isinstance(value, cst.Name) and value.value not in self.accumulated and \
                    not self._written(original) and self.model.zero_dim(value):
                self.report(original, f"`{value.value}[0]` on a 0-dim tensor raises since torch 0.4; use `.item()`")
                return call_method(updated.value, "item").with_changes(lpar=updated.lpar, rpar=updated.rpar)
            return None
        if self._written(original):
            self.report(original, "`.data[0] = ...` writes into a tensor: index the tensor itself "
                                  "under `torch.no_grad()`", review=True)
            return None
        tensor = original.value.value
        if not (self.model.zero_dim(tensor) or self.model.is_loss(tensor)):
            self.report(original, "`.data[0]`: use `.item()` if this is a scalar, `.detach()[0]` if not", review=True)
            return None
        self.report(original)
        return call_method(updated.value.value, "item").with_changes(lpar=updated.lpar, rpar=updated.rpar)

    def _written(self, node: cst.Subscript) -> bool:
        parent = self.ctx.ancestors[-1] if self.ctx.ancestors else None
        return isinstance(parent, (cst.AssignTarget, cst.AugAssign, cst.Del)) and getattr(parent, "target", None) is node


class VariableWrapper(Rule):
    """
    ## What it does
    Finds `Variable(x)` wrappers.

    ## Why is this bad?
    Since PyTorch 0.4 tensors carry autograd themselves; `Variable(x)` returns `x` and
    only obscures the code. `Variable(h.data)` meant "cut the graph": `h.detach()`.

    ## Example
    ```python
    data, target = Variable(data), Variable(target)
    w = Variable(torch.zeros(3), requires_grad=True)
    ```

    ## Use instead
    ```python
    data, target = data, target
    w = torch.zeros(3).requires_grad_()
    ```
    `Variable(img, requires_grad=True)` of a tensor the script holds becomes
    `img.detach().requires_grad_()`: a new leaf sharing `img`'s data, as Variable made.
    """

    code = "GM202"
    done = "`Variable(x)` → `x`"
    name = "variable-wrapper"
    message = "`Variable` is a no-op since torch 0.4; use the tensor itself"
    fixed_in = frozenset({"device"})
    triggers = ("Variable",)

    # a call whose callee qualifies to `Variable`
    @classmethod
    def gate(cls, facts: SourceFacts) -> bool:
        return _calls_variable(facts)

    examples = (
        Flagged(
            "from torch.autograd import Variable\nx = Variable(data)\n",
            fixed="x = data\n",
        ),
        Flagged(
            "import torch\nfrom torch.autograd import Variable\nw = Variable(torch.zeros(3), requires_grad=True)\n"
            "h = Variable(h.data)\n",
            fixed="import torch\nw = torch.zeros(3).requires_grad_()\nh = h.detach()\n",
        ),
        Flagged(
            "from torch.autograd import Variable\nimg_var = Variable(img, requires_grad=True)\n",
            fixed="img_var = img.detach().requires_grad_()\n",
        ),
        Clean("import torch\nx = torch.ones(2, requires_grad=True)\n"),
    )

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> Optional[cst.BaseExpression]:
        if self.qualify(original.func) not in VARIABLE:
            return None
        data = get_arg(updated, "data", 0)
        if data is None or any(a.star for a in updated.args):
            self.report(original, review=True)
            return None
        grad = get_arg(updated, "requires_grad", 1)
        known = {id(data), id(grad), id(get_arg(updated, "volatile"))}
        if any(id(a) not in known for a in updated.args):
            self.report(original, review=True)
            return None
        self.report(original)
        if self.fixing:
            _drop_variable_import(self.ctx)
        value = data.value
        if _is_data_attr(value):
            value = call_method(value.value, "detach")  # Variable(h.data): a new leaf cut from the graph
        if grad is not None and literal_bool(grad.value) is not False:
            if isinstance(value, (cst.Name, cst.Attribute, cst.Subscript)):
                # a tensor the script holds (`img`): Variable made a new leaf sharing its data, so
                # `img.clamp_()` later is no in-place change of a leaf that requires grad
                value = call_method(value, "detach")
            if literal_bool(grad.value) is True:
                return call_method(value, "requires_grad_")
            return call_method(value, "requires_grad_", [cst.Arg(grad.value)])
        self.unwrapped = True
        parent = self.ctx.ancestors[-1] if self.ctx.ancestors else None
        if not isinstance(parent, (cst.Arg, cst.Assign, cst.Element, cst.Return, cst.Expr)) and not _atomic(value):
            value = value.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
        return value

    def visit_SimpleStatementLine(self, node: cst.SimpleStatementLine) -> None:
        self.unwrapped = False

    def leave_SimpleStatementLine(self, original, updated):
        """`data, target = Variable(data), Variable(target)` leaves `data, target = data, target`."""
        if not self.unwrapped or len(updated.body) != 1:
            return None
        assign = updated.body[0]
        if isinstance(assign, cst.Assign) and len(assign.targets) == 1 and same_code(assign.targets[0].target, assign.value):
            return remove_statement(self.ctx, updated)
        return None


def _atomic(node: cst.BaseExpression) -> bool:
    return isinstance(node, (cst.Name, cst.Attribute, cst.Call, cst.Subscript, cst.SimpleString,
                             cst.Integer, cst.Float, cst.List, cst.Tuple, cst.Dict)) or bool(getattr(node, "lpar", None))


def has_no_grad_decorator(func: cst.FunctionDef) -> bool:
    """Spelled any way (the import may be one this run adds, unknown to the import table)."""
    render = cst.Module(body=[]).code_for_node
    return any(render(d.decorator).replace(" ", "").endswith(("no_grad()", "inference_mode()"))
               for d in func.decorators)


def _no_grad_call(ctx) -> cst.BaseExpression:
    local = ctx.names.local_name_for("torch.no_grad")
    if local is None:
        ctx.add_import("torch")
        local = "torch.no_grad"
    return cst.parse_expression(f"{local}()")


def no_grad_decorator(ctx) -> cst.Decorator:
    """`@torch.no_grad()`: evaluated where the function is defined, so its name must be bound
    at module level (a script that imports torch only inside functions gets `import torch`)."""
    call = _no_grad_call(ctx)
    root = call.func
    while isinstance(root, cst.Attribute):
        root = root.value
    if isinstance(root, cst.Name) and root.value not in _module_level_names(ctx.module):
        # AddImportsVisitor takes an `import torch` inside a function for one at the top
        ctx.add_finisher("module-level import torch", _import_torch_at_top)
        call = cst.parse_expression("torch.no_grad()")
    return cst.Decorator(decorator=call)


def _import_torch_at_top(module: cst.Module) -> cst.Module:
    from gpumigrate.codemods.device_plan import _after_imports  # device_plan imports the rules' helpers

    if "torch" in _module_level_names(module):
        return module
    at = _after_imports(module)
    rest = list(module.body[at:])
    if rest and isinstance(rest[0], (cst.FunctionDef, cst.ClassDef)) and not rest[0].leading_lines:
        rest[0] = rest[0].with_changes(leading_lines=[cst.EmptyLine(), cst.EmptyLine()])  # PEP 8
    return module.with_changes(body=[*module.body[:at], cst.parse_statement("import torch\n"), *rest])


def _module_level_names(module: cst.Module) -> Set[str]:
    """The names the module's imports bind outside its functions and classes, and not under
    `if __name__ == "__main__":`, which runs after every definition."""
    top = [stmt for stmt in module.body if not isinstance(stmt, (cst.FunctionDef, cst.ClassDef)) and
           not (isinstance(stmt, cst.If) and m.matches(stmt.test, m.Comparison(left=m.Name("__name__"))))]
    return set(ImportTable(module.with_changes(body=top)).local)


def no_grad_with(ctx, stmts) -> cst.With:
    """`with torch.no_grad():` around statements (one, or a run of a block), the first one's
    comments and blank lines moved above the `with`."""
    stmts = list(stmts) if isinstance(stmts, (list, tuple)) else [stmts]
    body = ctx.drop_removed(stmts) or stmts
    leading = stmts[0].leading_lines
    body = [body[0].with_changes(leading_lines=[]) if body[0] is stmts[0] else body[0], *body[1:]]
    return cst.With(items=[cst.WithItem(_no_grad_call(ctx))], body=cst.IndentedBlock(body=body),
                    leading_lines=leading)


class _VolatilePlan:
    """Where each `Variable(x, volatile=True)` puts `torch.no_grad()`: around exactly the
    statements that compute from the volatile values (a generation loop included), never
    around code that reaches `.backward()`, directly or through a call."""

    def __init__(self, ctx) -> None:
        self.ctx = ctx
        self.model = model = script_model(ctx)
        s = model.s
        self.decorate: Set[int] = set()  # functions: evaluation only, `@torch.no_grad()`
        self.lambdas: Set[int] = set()  # lambdas whose own body computes: `torch.no_grad()(lambda ...)`
        self.ranges: Dict[int, List[Tuple[int, int]]] = {}  # id(block) -> [(first, last)] line indices
        self.verdicts: Dict[int, Optional[str]] = {}  # id(call) -> None (fixed) or why not
        sources: List[Tuple[cst.Call, cst.CSTNode]] = []
        for node in s.index.of(cst.Call):
            if ctx.names.qualify(node.func) not in VARIABLE:
                continue
            volatile = get_arg(node, "volatile")
            if volatile is None or literal_bool(volatile.value) is not True:
                continue
            if model.under_no_grad(node):
                self.verdicts[id(node)] = None
                continue
            fn = s.function(node)
            if fn is not None and isinstance(fn.node, cst.Lambda):
                if fn.node.body is node and fn.callers:
                    sources.extend((node, site) for site in fn.callers)  # `ev = lambda x: Variable(x, ...)`
                else:
                    self.lambdas.add(id(fn.node))
                self.verdicts[id(node)] = None
                continue
            if fn is not None and not model.function_trains(fn):
                self.decorate.add(id(fn.node))
                self.verdicts[id(node)] = None
                continue
            sources.append((node, node))
        for call, site in sources:
            fn = s.function(site)
            if site is not call and fn is not None and isinstance(fn.node, cst.FunctionDef) \
                    and not model.function_trains(fn):
                self.decorate.add(id(fn.node))  # a call of `ev = lambda x: Variable(x, volatile=True)`
                continue
            why = self._range(site)
            if self.verdicts.get(id(call), None) is None or why is not None:
                self.verdicts[id(call)] = why
        self._drop_nested()

    def _range(self, site: cst.CSTNode) -> Optional[str]:
        s = self.model.s
        line = s.line(site)
        block = s.block(line) if line is not None else None
        if block is None:
            return "a one-line block: wrap it in `with torch.no_grad():` by hand"
        body = list(block.body)
        first = last = body.index(line)
        tainted = set(self._bound(line))
        for k in range(first + 1, len(body)):
            if self._reads(body[k], tainted):
                last = k
                tainted |= self._bound(body[k])
        if any(self.model.trains(body[k]) for k in range(first, last + 1)):
            return ("the volatile values are used by code that also trains: wrap only its evaluation part in "
                    "`with torch.no_grad():` by hand")
        spans = self.ranges.setdefault(id(block), [])
        spans.append((first, last))
        spans.sort()
        merged: List[Tuple[int, int]] = []
        for a, b in spans:
            if merged and a <= merged[-1][1] + 1:
                merged[-1] = (merged[-1][0], max(b, merged[-1][1]))
            else:
                merged.append((a, b))
        self.ranges[id(block)] = merged
        return None

    def _drop_nested(self) -> None:
        """A range inside another range, or inside a function that gets `@torch.no_grad()`,
        is already covered."""
        s = self.model.s
        blocks = {id(n): n for n in s.index.order if id(n) in self.ranges}
        for block_id in list(self.ranges):
            block = blocks[block_id]
            for ancestor in s.ancestors(block):
                if id(ancestor) in self.decorate:
                    del self.ranges[block_id]
                    break
                parent = s.parent(ancestor)
                if id(parent) in self.ranges and isinstance(ancestor, (cst.SimpleStatementLine,
                                                                          cst.BaseCompoundStatement)):
                    k = list(parent.body).index(ancestor)
                    if any(a <= k <= b for a, b in self.ranges[id(parent)]):
                        del self.ranges[block_id]
                        break

    def covers(self, node: cst.CSTNode) -> bool:
        """Will `node` run under a `no_grad` this plan adds?"""
        s = self.model.s
        for ancestor in [node, *s.ancestors(node)]:
            if id(ancestor) in self.decorate:
                return True
            parent = s.parent(ancestor)
            if parent is not None and id(parent) in self.ranges:
                body = list(parent.body)
                if ancestor in body and any(a <= body.index(ancestor) <= b for a, b in self.ranges[id(parent)]):
                    return True
        return False

    def _bound(self, stmt: cst.CSTNode) -> Set[str]:
        names: Set[str] = set()
        for node in self.model.s.index.subtree(stmt):
            if isinstance(node, cst.AssignTarget):
                names.update(target_names(node.target))
            elif isinstance(node, (cst.AugAssign, cst.AnnAssign, cst.For)):
                names.update(target_names(node.target))
        return names

    def _reads(self, stmt: cst.CSTNode, names: Set[str]) -> bool:
        skip = set()
        for node in self.model.s.index.subtree(stmt):
            if isinstance(node, cst.Attribute):
                skip.add(id(node.attr))
            elif isinstance(node, cst.Name) and node.value in names and id(node) not in skip:
                return True
        return False


def volatile_plan(ctx) -> _VolatilePlan:
    return ctx.shared("volatile-plan", _VolatilePlan)


class VolatileFlag(Rule):
    """
    ## What it does
    Finds `Variable(x, volatile=True)`.

    ## Why is this bad?
    `volatile` was removed in PyTorch 0.4 and has no effect: the evaluation code that used it
    now builds autograd graphs it never uses, costing memory and time.

    ## Example
    ```python
    def test():
        for data, target in test_loader:
            data = Variable(data, volatile=True)
    ```

    ## Use instead
    ```python
    @torch.no_grad()
    def test():
        for data, target in test_loader:
            data = data
    ```
    In a function that does not train, the whole function runs under `no_grad`. Elsewhere
    (module-level code, a training loop), exactly the statements that compute from the
    volatile values do, up to the last one that uses them; the calls of
    `ev = lambda x: Variable(x, volatile=True)` likewise. Code that reaches `.backward()` is
    never put under `no_grad`: such a case is left for review.
    """

    code = "GM203"
    done = "`volatile=True` → the code runs under `torch.no_grad()`"
    name = "volatile-flag"
    message = "`volatile=True` has no effect since torch 0.4; run this code under `torch.no_grad()`"
    fixed_in = frozenset({"device"})
    triggers = ("volatile",)

    # a `Variable(...)` call with a `volatile=` keyword (the no_grad spans come from those too)
    @classmethod
    def gate(cls, facts: SourceFacts) -> bool:
        return "volatile" in facts.ids and _calls_variable(facts)

    examples = (
        Flagged(
            "import torch\nfrom torch.autograd import Variable\ndef test(x):\n    return model(Variable(x, volatile=True))\n",
            fixed="import torch\n@torch.no_grad()\ndef test(x):\n    return model(x)\n",
        ),
        Flagged(
            "import torch\nh = torch.autograd.Variable(torch.zeros(1, 8), volatile=True)\nfor step in range(9):\n"
            "    h = rnn(x, h)\nprint(h)\n",
            fixed="import torch\nwith torch.no_grad():\n    h = torch.zeros(1, 8)\n    for step in range(9):\n"
            "        h = rnn(x, h)\n    print(h)\n",
        ),
        Flagged(
            "import torch\nfrom torch.autograd import Variable\nfor epoch in range(2):\n"
            "    loss = model(x).sum()\n    loss.backward()\n    out = model(Variable(x, volatile=True))\n"
            "    print(out.sum())\n",
            fixed="import torch\nfor epoch in range(2):\n    loss = model(x).sum()\n    loss.backward()\n"
            "    with torch.no_grad():\n        out = model(x)\n        print(out.sum())\n",
        ),
        Clean("import torch\nx = Variable(x, volatile=False)\n"),
    )

    def visit_Module(self, node: cst.Module) -> None:
        self.plan = volatile_plan(self.ctx)

    def visit_Call(self, node: cst.Call) -> None:
        if self.qualify(node.func) not in VARIABLE:
            return
        volatile = get_arg(node, "volatile")
        if volatile is None or literal_bool(volatile.value) is False:
            return
        if literal_bool(volatile.value) is None:
            self.report(node, "`volatile=<flag>` has no effect since torch 0.4; run the code path where it "
                              "is true under `torch.no_grad()`", review=True)
            return
        why = self.plan.verdicts.get(id(node))
        if why is not None:
            self.report(node, f"`volatile=True` has no effect since torch 0.4; {why}", review=True)
        elif script_model(self.ctx).under_no_grad(node):
            self.report(node, "`volatile=True` has no effect since torch 0.4 (already under no_grad here)")
        else:
            self.report(node)

    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef):
        if id(original) not in self.plan.decorate or has_no_grad_decorator(updated):
            return None
        return updated.with_changes(decorators=[*updated.decorators, no_grad_decorator(self.ctx)])

    def leave_Lambda(self, original: cst.Lambda, updated: cst.Lambda):
        if id(original) not in self.plan.lambdas:
            return None
        # each call of the lambda runs under no_grad (no_grad() decorates any callable)
        return cst.Call(func=_no_grad_call(self.ctx), args=[cst.Arg(updated)])

    def _block(self, original, updated):
        spans = self.plan.ranges.get(id(original))
        if not spans:
            return None
        body = list(updated.body)
        for first, last in reversed(spans):
            where = self.ctx.span_of(original.body[first:last + 1], body)
            if where is None:
                continue
            self.report(original.body[first], "statements computing from volatile values: run under "
                        "`torch.no_grad()`", through=original.body[last])
            a, b = where
            body[a:b] = [no_grad_with(self.ctx, body[a:b])]
        return updated.with_changes(body=body)

    leave_IndentedBlock = leave_Module = _block


class AsyncKwarg(Rule):
    """
    ## What it does
    Finds `.cuda(async=True)` and `.to(device, async=True)`.

    ## Why is this bad?
    `async` is a keyword since Python 3.7: the whole script is a syntax error today.
    PyTorch renamed the argument to `non_blocking` in 0.4.

    ## Example
    ```python
    input = input.cuda(async=True)
    ```

    ## Use instead
    ```python
    input = input.to(device, non_blocking=True)
    ```
    """

    code = "GM205"
    done = "`async=` → `non_blocking=`"
    name = "async-kwarg"
    message = "`async=` is a syntax error since Python 3.7; use `non_blocking=`"
    fixed_in = frozenset({"device"})

    # never: it reports only through `repair`, on files that do not compile, which are not gated
    @classmethod
    def gate(cls, facts: SourceFacts) -> bool:
        return False

    examples = (
        Flagged("x = y.float().cuda(async=True)\n"),  # repaired before parsing; see the fixtures
        Clean("x = y.to(device, non_blocking=True)\n"),
    )

    @classmethod
    def repair(cls, text: str) -> Optional[Tuple[str, List[Tuple[int, int, str]]]]:
        """Rename `async=` keyword arguments token by token: the file cannot be parsed as is."""
        if "async" not in text:
            return None
        try:
            tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
        except (tokenize.TokenError, SyntaxError, IndentationError):
            return None
        significant = [t for t in tokens if t.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT,
                                                           tokenize.INDENT, tokenize.DEDENT)]
        spots = []
        depth = 0
        for i, tok in enumerate(significant):
            if tok.type == tokenize.OP and tok.string in "([{":
                depth += 1
            elif tok.type == tokenize.OP and tok.string in ")]}":
                depth -= 1
            elif (tok.type == tokenize.NAME and tok.string == "async" and depth > 0 and 0 < i < len(significant) - 1
                  and significant[i - 1].string in ("(", ",") and significant[i + 1].string == "="):
                spots.append(tok.start)
        if not spots:
            return None
        lines = text.splitlines(keepends=True)
        for line, col in reversed(spots):
            row = lines[line - 1]
            lines[line - 1] = row[:col] + "non_blocking" + row[col + len("async"):]
        return "".join(lines), [(line, col, cls.message) for line, col in spots]


class VariableTypeCheck(Rule):
    """
    ## What it does
    Finds `type(h) == Variable` and `isinstance(h, Variable)`.

    ## Why is this bad?
    Since PyTorch 0.4 a tensor's type is `torch.Tensor`: `type(h) == Variable` is silently
    False, so code such as `repackage_hidden` takes the wrong branch and recurses into a tensor.

    ## Example
    ```python
    if type(h) == Variable:
        return Variable(h.data)
    ```

    ## Use instead
    ```python
    if isinstance(h, torch.Tensor):
        return h.detach()
    ```
    """

    code = "GM206"
    done = "`type(h) == Variable` → `isinstance(h, torch.Tensor)`"
    name = "variable-type-check"
    message = "`type(h) == Variable` is always False since torch 0.4; use `isinstance(h, torch.Tensor)`"
    fixed_in = frozenset({"device"})
    triggers = ("Variable",)

    # `Variable` named in `type(h) == Variable` (a comparison) or in `isinstance(h, Variable)`
    @classmethod
    def gate(cls, facts: SourceFacts) -> bool:
        return {"Variable", "autograd"} <= facts.ids and (
            facts.any_call("isinstance") or (facts.any_call("type") and "Compare" in facts.kinds))

    examples = (
        Flagged(
            "import torch\nfrom torch.autograd import Variable\nok = type(h) == Variable\n",
            fixed="import torch\nok = isinstance(h, torch.Tensor)\n",
        ),
        Flagged(
            "import torch\nfrom torch.autograd import Variable\nok = isinstance(h, Variable)\n",
            fixed="import torch\nok = isinstance(h, torch.Tensor)\n",
        ),
        Clean("import torch\nok = isinstance(h, torch.Tensor)\n"),
    )

    def _tensor(self) -> cst.BaseExpression:
        local = self.ctx.names.local_name_for("torch.Tensor")
        if local is None:
            self.ctx.add_import("torch")
            local = "torch.Tensor"
        return cst.parse_expression(local)

    def _isinstance(self, obj: cst.BaseExpression) -> cst.Call:
        return cst.Call(func=cst.Name("isinstance"), args=[
            cst.Arg(obj, comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))), cst.Arg(self._tensor())])

    def leave_Comparison(self, original: cst.Comparison, updated: cst.Comparison):
        if len(original.comparisons) != 1:
            return None
        target = original.comparisons[0]
        op = target.operator
        if not isinstance(op, (cst.Equal, cst.NotEqual, cst.Is, cst.IsNot)):
            return None
        if self.qualify(target.comparator) not in VARIABLE or not m.matches(
                original.left, m.Call(func=m.Name("type"), args=[m.Arg(keyword=None)])):
            return None
        self.report(original)
        if self.fixing:
            _drop_variable_import(self.ctx)
        check = self._isinstance(updated.left.args[0].value)
        if isinstance(op, (cst.NotEqual, cst.IsNot)):
            return cst.UnaryOperation(operator=cst.Not(), expression=check).with_changes(lpar=updated.lpar, rpar=updated.rpar)
        return check.with_changes(lpar=updated.lpar, rpar=updated.rpar)

    def leave_Call(self, original: cst.Call, updated: cst.Call):
        if not m.matches(original.func, m.Name("isinstance")) or len(original.args) != 2:
            return None
        if self.qualify(original.args[1].value) not in VARIABLE:
            return None
        self.report(original, "`isinstance(h, Variable)`: say `isinstance(h, torch.Tensor)`")
        if self.fixing:
            _drop_variable_import(self.ctx)
        return updated.with_changes(args=[updated.args[0], updated.args[1].with_changes(value=self._tensor())])


class DataAccumulatorIndex(Rule):
    """
    ## What it does
    Finds accumulators of `.data` values read back with `[0]`:
    `total_loss += loss.data` ... `total_loss[0]`.

    ## Why is this bad?
    Before 0.4 `loss.data` was a 1-element tensor; now it is 0-dim, so `total_loss[0]` raises
    "invalid index of a 0-dim tensor".

    ## Example
    ```python
    total_loss += loss.data
    cur_loss = total_loss[0] / args.log_interval
    ```

    ## Use instead
    ```python
    total_loss += loss.item()
    cur_loss = total_loss / args.log_interval
    ```
    """

    code = "GM207"
    done = "accumulated `.data` → `.item()`"
    name = "data-accumulator-index"
    message = "accumulated `.data` is a 0-dim tensor since torch 0.4: `total[0]` raises; accumulate `.item()`"
    fixed_in = frozenset({"device"})
    triggers = (".data",)

    # a name both `+=`-accumulating a `.data` and indexed with `[0]`
    @classmethod
    def gate(cls, facts: SourceFacts) -> bool:
        return ".data" in facts.text and "data" in facts.ids and {"AugAssign", "Subscript"} <= facts.kinds

    examples = (
        Flagged(
            "total_loss = 0\ntotal_loss += loss.data\nprint(total_loss[0] / 10)\n",
            fixed="total_loss = 0\ntotal_loss += loss.item()\nprint(total_loss / 10)\n",
        ),
        Flagged(
            "total = 0\ntotal += len(x) * criterion(out, y).data\nreturn_value = total[0]\n",
            fixed="total = 0\ntotal += len(x) * criterion(out, y).item()\nreturn_value = total\n",
        ),
        Clean("total = 0\ntotal += loss.item()\nfirst = batch[0]\n"),
    )

    def visit_Module(self, node: cst.Module) -> None:
        self.names = accumulated_data(self.ctx)


    def leave_AugAssign(self, original: cst.AugAssign, updated: cst.AugAssign):
        if not (isinstance(original.target, cst.Name) and original.target.value in self.names):
            return None
        self.report(original.value)
        return updated.with_changes(value=_data_to_item(updated.value))

    def leave_Subscript(self, original: cst.Subscript, updated: cst.Subscript):
        if isinstance(original.value, cst.Name) and original.value.value in self.names and _index_zero(original):
            self.report(original)
            return updated.value.with_changes(lpar=updated.lpar, rpar=updated.rpar)
        return None


class IteratorNextMethod(Rule):
    """
    ## What it does
    Finds `it.next()` on an iterator of a DataLoader (`it = iter(loader)`).

    ## Why is this bad?
    Python 3 iterators have no `.next()` method; old DataLoader iterators kept one for Python 2
    scripts and today's do not: `AttributeError: '_SingleProcessDataLoaderIter' object has no
    attribute 'next'`.

    ## Example
    ```python
    data_iter = iter(loader)
    images, labels = data_iter.next()
    ```

    ## Use instead
    ```python
    images, labels = next(data_iter)
    ```
    """

    code = "GM210"
    done = "`it.next()` → `next(it)`"
    name = "iterator-next-method"
    message = "`.next()` on a DataLoader iterator is gone; use `next(it)`"
    fixed_in = frozenset({"device"})
    triggers = (".next()",)

    # `.next()` on a value whose only source of the iterator kind is a plain `iter(...)` call
    @classmethod
    def gate(cls, facts: SourceFacts) -> bool:
        return ".next()" in facts.text and facts.any_call("next") and facts.any_call("iter")

    examples = (
        Flagged(
            "from torch.utils.data import DataLoader\nit = iter(DataLoader(ds))\nx = it.next()\n",
            fixed="from torch.utils.data import DataLoader\nit = iter(DataLoader(ds))\nx = next(it)\n",
        ),
        Clean("it = iter(items)\nx = next(it)\nnode = tree.next()\n"),
    )

    def leave_Call(self, original: cst.Call, updated: cst.Call):
        if not (is_method_call(original, "next") and not original.args):
            return None
        if script_model(self.ctx).kind(original.func.value) != v.ITERATOR:
            return None
        self.report(original)
        return cst.Call(func=cst.Name("next"), args=[cst.Arg(updated.func.value)]).with_changes(
            lpar=updated.lpar, rpar=updated.rpar)


class ScalarMetricAccumulation(Rule):
    """
    ## What it does
    Finds 0-dim metric tensors added into Python numbers in scripts written for torch 0.3:
    `correct += pred.eq(target).sum()`.

    ## Why is this bad?
    Before 0.4, `.sum()` of a tensor returned a Python number; now it returns a 0-dim tensor,
    so `correct` silently becomes a tensor: logs and CSV files show `tensor(87)`, and on a GPU
    every use synchronises.

    ## Example
    ```python
    correct = 0
    correct += pred.eq(target).sum()
    ```

    ## Use instead
    ```python
    correct += pred.eq(target).sum().item()
    ```
    Only in 0.3-era scripts (they use `Variable`, `volatile` or `.data[0]`), and only for a
    total that starts as a number and is never used as a tensor.
    """

    code = "GM209"
    done = "0-dim tensor added into a number → `.item()`"
    name = "scalar-metric-accumulation"
    message = "a 0-dim tensor added into a number: it was a Python number before torch 0.4; use `.item()`"
    fixed_in = frozenset({"device"})
    triggers = ("+=",)

    # a `+=` of a 0-dim value, only in a 0.3-era script (`era_03`: a `Variable` import, `volatile`, `.data[0]`)
    @classmethod
    def gate(cls, facts: SourceFacts) -> bool:
        return "+=" in facts.text and "AugAssign" in facts.kinds and _zero_dim_source(facts) and (
            {"Variable", "autograd"} <= facts.ids or "volatile" in facts.text or ".data[0]" in facts.text)

    examples = (
        Flagged(
            "from torch.autograd import Variable\ncorrect = 0\nfor x, y in loader:\n"
            "    correct += (model(Variable(x)).argmax(1) == y).sum()\nprint(correct)\n",
            fixed="correct = 0\nfor x, y in loader:\n    correct += (model(x).argmax(1) == y).sum().item()\nprint(correct)\n",
        ),
        Clean("correct = 0\nfor x, y in loader:\n    correct += (model(x).argmax(1) == y).sum()\nprint(correct.item())\n"),
        Clean("from torch.autograd import Variable\ncorrect = 0\nfor x, y in loader:\n"
              "    correct += (model(x).argmax(1) == y).sum()\nacc = correct.float() / n\n"),
        # a step function returning `loss.data[0]`, a number once GM201 makes it `.item()`
        Clean("import torch\nfrom torch.autograd import Variable\ndef train(x):\n    loss = torch.sum(model(x))\n"
              "    return loss.data[0]\ncost = 0\nfor x in batches:\n    cost += train(x)\nprint(cost)\n"),
        # a 0.3-era model's forward summing its per-step losses, which it returns to be backpropagated
        Clean("import torch\nfrom torch.autograd import Variable\nclass VRNN(nn.Module):\n"
              "    def forward(self, x):\n        kld_loss = 0\n        for t in range(x.size(0)):\n"
              "            kld_loss += self._kld(x[t])\n        return kld_loss\n"
              "    def _kld(self, x):\n        return 0.5 * torch.sum(x * x)\n"),
    )

    def visit_Module(self, node: cst.Module) -> None:
        self.model = script_model(self.ctx)
        self.active = self.model.era_03

    def leave_AugAssign(self, original: cst.AugAssign, updated: cst.AugAssign):
        if not self.active or not isinstance(original.operator, cst.AddAssign) or \
                not isinstance(original.target, cst.Name):
            return None
        if self.model.kind(original.value) != v.SCALAR or original.target.value in accumulated_data(self.ctx) \
                or any(_index_zero(sub) for sub in findall(original.value, m.Subscript())) \
                or returned_total(self.ctx, original.target) or self._returns_numbers(original.value):
            return None  # `.data` totals and `.data[0]` are GM207's and GM201's; a returned total may be a loss
        name = original.target.value
        s = self.model.s
        scope = s.scope(original)
        _, bindings = s.lookup(name, scope, s.order(original))
        starts = [b for b in bindings if b.how == "assign"]
        if not starts or not all(isinstance(b.value, (cst.Integer, cst.Float)) for b in starts):
            return None
        found, _ = s.lookup(name, scope)
        for node in s.index.order:
            if isinstance(node, cst.Attribute) and isinstance(node.value, cst.Name) and node.value.value == name \
                    and s.lookup(name, s.scope(node))[0] is found:
                return None  # `correct.float()`, `correct.item()`: used as a tensor
        self.report(original.value)
        return updated.with_changes(value=call_method(updated.value, "item"))

    def _returns_numbers(self, value: cst.BaseExpression) -> bool:
        """`train(...)` of this file returning `output.data[0]` (GM201 makes it `.item()`) or
        `x.item()`: a number already, in the migrated script."""
        callee = self.model.s.callee(value) if isinstance(value, cst.Call) else None
        return callee is not None and bool(callee.returns) and all(
            (isinstance(r, cst.Subscript) and _index_zero(r)) or is_method_call(r, "item") for r in callee.returns)


def returned_total(ctx, target: cst.BaseExpression) -> bool:
    """A loss total a function returns to be backpropagated: a model's forward (`kld_loss +=
    ...`, then `return kld_loss, nll_loss`), or a function whose caller here calls `.backward()`
    on what it returns. Not a training function's running total (`return total_loss`)."""
    if not isinstance(target, cst.Name):
        return False
    model = script_model(ctx)
    fn = model.s.function(target)
    if fn is None or not any(isinstance(n, cst.Name) and n.value == target.value
                             for r in fn.returns for n in findall(r, m.Name())):
        return False
    if fn.name == "forward":
        return True
    for call in fn.callers:
        assign = model.s.parent(call)
        if isinstance(assign, cst.Assign) and any(model.feeds_backward(name, call) for t in assign.targets
                                                  for name in target_names(t.target)):
            return True
    return False


def _data_leaves(value: cst.BaseExpression) -> List[cst.Attribute]:
    """`.data` reads that are the value itself or an operand of arithmetic."""
    if _is_data_attr(value):
        return [value]
    if isinstance(value, cst.BinaryOperation):
        return _data_leaves(value.left) + _data_leaves(value.right)
    return []


def accumulated_data(ctx) -> Set[str]:
    """Names that accumulate `.data` (`total_loss += loss.data`) and are read with `[0]`."""
    def build(ctx) -> Set[str]:
        index = ctx.index  # every AugAssign and Subscript of the module: by class, without matchers
        accumulated = {aug.target.value for aug in index.of(cst.AugAssign)
                       if type(aug.target) is cst.Name and type(aug.operator) is cst.AddAssign and _data_leaves(aug.value)}
        indexed = {sub.value.value for sub in index.of(cst.Subscript) if type(sub.value) is cst.Name and _index_zero(sub)}
        return accumulated & indexed

    return ctx.shared("accumulated-data", build)


def _data_to_item(value: cst.BaseExpression) -> cst.BaseExpression:
    if _is_data_attr(value):
        return call_method(value.value, "item").with_changes(lpar=value.lpar, rpar=value.rpar)
    if isinstance(value, cst.BinaryOperation):
        return value.with_changes(left=_data_to_item(value.left), right=_data_to_item(value.right))
    return value


_ALPHA_METHODS = {"add", "add_", "sub", "sub_"}
_VALUE_METHODS = {"addcmul", "addcmul_", "addcdiv", "addcdiv_"}
# Deprecated aliases that warn today (and are slated for removal): old name -> new name.
_RENAMES = {
    "torch.nn.utils.clip_grad_norm": "clip_grad_norm_",
    "torch.nn.init.xavier_uniform": "xavier_uniform_", "torch.nn.init.xavier_normal": "xavier_normal_",
    "torch.nn.init.kaiming_uniform": "kaiming_uniform_", "torch.nn.init.kaiming_normal": "kaiming_normal_",
    "torch.nn.init.uniform": "uniform_", "torch.nn.init.normal": "normal_",
    "torch.nn.init.constant": "constant_", "torch.nn.init.orthogonal": "orthogonal_",
    "torch.nn.functional.upsample": "interpolate",
    # torchvision's 2017 names, removed in 0.15 (the same transforms)
    "torchvision.transforms.Scale": "Resize", "torchvision.transforms.RandomSizedCrop": "RandomResizedCrop",
}
_OLD_NAMES = frozenset(old.rsplit(".", 1)[1] for old in _RENAMES)


def _legacy_tensor_overload(call: cst.Call) -> bool:
    """`p.data.add_(-lr, g)`, `exp_avg.mul_(b).add_(1 - b, g)`: a tensor's method with a
    number first. Not `pattern.sub("", text)`: a string first, or a receiver that is not
    visibly a tensor, is left alone."""
    first = call.args[0].value
    if isinstance(first, (cst.SimpleString, cst.FormattedString, cst.ConcatenatedString)):
        return False
    receiver = call.func.value
    method = call.func.attr.value
    tensorish = (isinstance(receiver, cst.Attribute) and receiver.attr.value in ("data", "grad")) or \
        (isinstance(receiver, cst.Call) and isinstance(receiver.func, cst.Attribute)
         and receiver.func.attr.value.endswith("_"))
    return tensorish or method.endswith("_")


_FLOAT_LOSSES = ("binary_cross_entropy", "binary_cross_entropy_with_logits", "mse_loss", "l1_loss",
                 "smooth_l1_loss", "huber_loss", "soft_margin_loss", "kl_div")
_FLOAT_LOSS_MODULES = ("BCELoss", "BCEWithLogitsLoss", "MSELoss", "L1Loss", "SmoothL1Loss", "HuberLoss",
                       "SoftMarginLoss", "KLDivLoss")
FLOAT_LOSS_FUNCTIONS = frozenset(f"torch.nn.functional.{n}" for n in _FLOAT_LOSSES)
FLOAT_LOSS_CLASSES = frozenset([f"torch.nn.{n}" for n in _FLOAT_LOSS_MODULES] +
                               [f"torch.nn.modules.loss.{n}" for n in _FLOAT_LOSS_MODULES])
_LOSS_NAME = re.compile(r"loss|crit", re.I)
# methods whose result is the same tensor, moved or reshaped: `label = label.to(device)`
_SAME_TENSOR = frozenset({"to", "cuda", "cpu", "view", "reshape", "detach", "squeeze", "unsqueeze", "expand",
                          "expand_as", "view_as", "contiguous", "clone", "fill_"})


class _TorchLoss:
    """Any of torch's loss modules (`torch.nn.CrossEntropyLoss`), as a set of names."""

    def __contains__(self, qualified: object) -> bool:
        return isinstance(qualified, str) and qualified.startswith("torch.nn.") and qualified.endswith("Loss")


def _int_literal(node: cst.BaseExpression) -> bool:
    if isinstance(node, cst.UnaryOperation) and isinstance(node.operator, cst.Minus):
        node = node.expression
    return isinstance(node, cst.Integer)


def _drop_variable_import(ctx) -> None:
    """The `Variable` import goes once nothing uses it, unless a module beside this one takes
    all its names (`from helpers import *`) and may use it from there (still importable today)."""
    if getattr(ctx.options.get("project"), "star_imported", False):
        return
    for qualified in VARIABLE:
        module, _, name = qualified.rpartition(".")
        ctx.remove_import(module, name)


class DeprecatedOverload(Rule):
    """
    ## What it does
    Finds call forms that today's torch deprecates or changed: positional `alpha`/`value`
    overloads (`p.data.add_(-lr, grad)`), `size_average=`/`reduce=` loss arguments, renamed
    functions (`clip_grad_norm`, `nn.init.xavier_uniform`, `F.upsample`, torchvision's
    `transforms.Scale`, removed in 0.15), and
    `torch.full(size, 1)` labels for a float loss.

    ## Why is this bad?
    They warn on every call (often every step) and are removed one release at a time. Since
    torch 1.7 `torch.full` with an integer fill value makes an int64 tensor (it was float): a
    label made so for `BCELoss` or `MSELoss` fails with "Found dtype Long but expected Float".

    ## Example
    ```python
    p.data.add_(-lr, p.grad.data)
    loss = F.nll_loss(out, y, size_average=False)
    torch.nn.utils.clip_grad_norm(model.parameters(), 0.25)
    label = torch.full((batch_size,), real_label, device=device)  # real_label = 1
    loss = criterion(netD(x), label)  # criterion = nn.BCELoss()
    ```

    ## Use instead
    ```python
    p.data.add_(p.grad.data, alpha=-lr)
    loss = F.nll_loss(out, y, reduction="sum")
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
    label = torch.full((batch_size,), real_label, device=device, dtype=torch.float)
    ```
    A `torch.full` with an integer fill that reaches a call named like a loss the migration
    cannot identify is listed for review.
    """

    code = "GM208"
    done = "deprecated call form → today's form"
    name = "deprecated-overload"
    message = "deprecated call form"
    fixed_in = frozenset({"device"})

    def _deprecated(self, node: cst.CSTNode, old: str, new: str) -> None:
        """The old form and its replacement: what was done when fixing, what to do otherwise."""
        self.report(node, f"{old} → {new}" if self.fixing else f"{old} is deprecated; use {new}")

    # an overload on `.data`/`.grad` or in place (`add_`, `x.mul_(b).add(...)`), else a `torch.nn...` name
    @classmethod
    def gate(cls, facts: SourceFacts) -> bool:
        overload = facts.any_call(*_ALPHA_METHODS, *_VALUE_METHODS) and (
            facts.any_id("data", "grad") or any(name.endswith("_") for name in facts.calls))
        return overload or "nn" in facts.ids and (facts.any_call(*_OLD_NAMES) or facts.any_id("size_average", "reduce")) \
            or "transforms" in facts.ids and facts.any_call("Scale", "RandomSizedCrop") \
            or facts.any_call("full") and "torch" in facts.ids or facts.any_call("view") and facts.any_call("float", "sum")

    examples = (
        Flagged("p.data.add_(-lr, p.grad.data)\n", fixed="p.data.add_(p.grad.data, alpha=-lr)\n"),
        Flagged(
            "import torch.nn.functional as F\nl = F.nll_loss(o, y, size_average=False)\n",
            fixed='import torch.nn.functional as F\nl = F.nll_loss(o, y, reduction="sum")\n',
        ),
        Flagged(
            "import torch\ntorch.nn.utils.clip_grad_norm(ps, 0.5)\n",
            fixed="import torch\ntorch.nn.utils.clip_grad_norm_(ps, 0.5)\n",
        ),
        Flagged(  # torchvision < 0.15's names
            "from torchvision import transforms\nt = transforms.Compose([transforms.Scale(64), transforms.RandomSizedCrop(32)])\n",
            fixed="from torchvision import transforms\nt = transforms.Compose([transforms.Resize(64), "
                  "transforms.RandomResizedCrop(32)])\n",
        ),
        Flagged(
            "import torch\nimport torch.nn as nn\nreal_label = 1\ncriterion = nn.BCELoss()\n"
            "label = torch.full((8,), real_label)\nloss = criterion(torch.rand(8), label)\n",
            fixed="import torch\nimport torch.nn as nn\nreal_label = 1\ncriterion = nn.BCELoss()\n"
            "label = torch.full((8,), real_label, dtype=torch.float)\nloss = criterion(torch.rand(8), label)\n",
        ),
        Flagged(  # a loss the migration cannot see: listed
            "import torch\nlabel = torch.full((8,), 1)\nloss = loss_fn(out, label)\n",
        ),
        Flagged(  # pytorch/examples' accuracy() of 2017 on today's torch
            "import torch\ncorrect = pred.t().eq(target.view(1, -1))\nn = correct[:5].view(-1).float().sum(0)\n",
            fixed="import torch\ncorrect = pred.t().eq(target.view(1, -1))\nn = correct[:5].reshape(-1).float().sum(0)\n",
        ),
        Flagged(  # the same in a script written for torch 0.3, whose `prec1[0]` reads a one-element sum
            "import torch\nfrom torch.autograd import Variable\ncorrect = pred.t().eq(target.view(1, -1))\n"
            "n = correct[:5].view(-1).float().sum(0)\n",
            fixed="import torch\nfrom torch.autograd import Variable\ncorrect = pred.t().eq(target.view(1, -1))\n"
                  "n = correct[:5].reshape(-1).float().sum(0, keepdim=True)\n",
        ),
        Clean("import torch\nflat = x[:, :2].view(-1)\nflat[0] = 1\n"),  # written through: a view it stays
        Clean("import torch\nx.add_(y, alpha=2)\nz = torch.add(a, b)\n"),
        Clean("import torch\nignore = torch.full((8,), -100)\nloss = torch.nn.CrossEntropyLoss()(out, ignore)\n"),
        Clean("import re\nclean = ansi_escape.sub('', text)\nn = counter.sub(1, 2)\n"),
    )

    def leave_Call(self, original: cst.Call, updated: cst.Call):
        qualified = self.qualify(original.func)
        if qualified == "torch.full":
            return self._full(original, updated)
        if self._flattened_slice(original):
            self.report(original, "`.view(-1)` of a slice (`correct[:k]` of a transposed prediction) fails on "
                                  "today's torch, whose comparisons keep their input's strides: `.reshape(-1)`")
            return updated.with_changes(func=updated.func.with_changes(attr=cst.Name("reshape")))
        if qualified in _RENAMES and isinstance(updated.func, cst.Attribute):
            new = _RENAMES[qualified]
            self._deprecated(original, f"`{qualified.rsplit('.', 1)[1]}`", f"`{new}`")
            return updated.with_changes(func=updated.func.with_changes(attr=cst.Name(new)))
        positional = positional_args(updated)
        if qualified is None and is_method_call(original, *_ALPHA_METHODS) and len(positional) == 2 \
                and len(updated.args) == 2 and _legacy_tensor_overload(original):
            name = original.func.attr.value
            self._deprecated(original, f"`{name}(alpha, other)`", f"`{name}(other, alpha=alpha)`")
            alpha, other = updated.args
            return with_args(updated, [other.with_changes(comma=cst.MaybeSentinel.DEFAULT),
                                       keyword_arg("alpha", alpha.value)])
        if qualified is None and is_method_call(original, *_VALUE_METHODS) and len(positional) == 3 \
                and len(updated.args) == 3 and _legacy_tensor_overload(original):
            name = original.func.attr.value
            self._deprecated(original, f"`{name}(value, t1, t2)`", f"`{name}(t1, t2, value=value)`")
            value, t1, t2 = updated.args
            return with_args(updated, [t1, t2.with_changes(comma=cst.MaybeSentinel.DEFAULT),
                                       keyword_arg("value", value.value)])
        if self._flat_sum(original):
            self.report(original, "in torch 0.3 `.sum(0)` of a flat tensor had one element (`prec1[0]` reads it); "
                                  "today's is 0-dim, which cannot be indexed: `keepdim=True` keeps the one element")
            return with_args(updated, [*updated.args, keyword_arg("keepdim", cst.Name("True"))])
        return self._reduction(original, updated, qualified)

    def _flat_sum(self, call: cst.Call) -> bool:
        """`x.view(-1).float().sum(0)` in a script written for torch 0.3 (`era_03`), whose
        result the script then indexes (`res[0]`): one element there, 0-dim today."""
        if not (is_method_call(call, "sum") and len(call.args) == 1 and call.args[0].keyword is None
                and m.matches(call.args[0].value, m.Integer("0"))):
            return False
        receiver = call.func.value
        while m.matches(receiver, m.Call(func=m.Attribute(attr=m.Name("float") | m.Name("long") | m.Name("double")
                                                                 | m.Name("byte") | m.Name("int")), args=[])):
            receiver = receiver.func.value
        flat = m.matches(receiver, m.Call(func=m.Attribute(attr=m.Name("view") | m.Name("reshape")),
                                          args=[m.Arg(value=m.UnaryOperation(operator=m.Minus(),
                                                                            expression=m.Integer("1")))]))
        return flat and script_model(self.ctx).era_03

    def _flattened_slice(self, call: cst.Call) -> bool:
        """`correct[:k].view(-1).float().sum(0)` (the accuracy() of pytorch/examples, 2017): a
        slice flattened to be read, never written through (a reshape may copy)."""
        if not (is_method_call(call, "view") and len(call.args) == 1 and call.args[0].keyword is None
                and m.matches(call.args[0].value, m.UnaryOperation(operator=m.Minus(), expression=m.Integer("1"))) and isinstance(call.func.value, cst.Subscript) and
                any(isinstance(e.slice, cst.Slice) for e in call.func.value.slice)):
            return False
        above = script_model(self.ctx).s.parent(call)
        return isinstance(above, cst.Attribute) and above.value is call and above.attr.value in ("float", "sum", "long")

    # -- torch.full with an integer fill: int64 since torch 1.7 -----------------------------
    def _full(self, original: cst.Call, updated: cst.Call):
        fill = get_arg(original, "fill_value", 1)
        if fill is None or any(a.star for a in original.args) or get_arg(original, "dtype") is not None or \
                get_arg(original, "out") is not None or not self._int_fill(fill.value):
            return None
        use = self._float_target(original)
        if use is None:
            return None
        if use == "unsure":
            self.report(original, "`torch.full` with an integer fill value makes an int64 tensor (since torch 1.7): "
                                  "if it is a float label for the loss it reaches, pass `dtype=torch.float`",
                        review=True)
            return None
        self.report(original, f"`torch.full` with an integer fill value makes an int64 tensor since torch 1.7; "
                              f"{use} needs a float target: `dtype=torch.float`")
        if not self.fixing:
            return None
        return with_args(updated, [*updated.args, keyword_arg("dtype", torch_name(self.ctx, "float"))])

    def _int_fill(self, value: cst.BaseExpression) -> bool:
        """`1`, `-1`, or a name every binding of which is an integer literal (`real_label = 1`)."""
        if _int_literal(value):
            return True
        if not isinstance(value, cst.Name):
            return False
        s = script_model(self.ctx).s
        bindings = s.all_bindings(value.value, s.scope(value))
        return bool(bindings) and all(b.how == "assign" and isinstance(b.value, cst.BaseExpression) and
                                      _int_literal(b.value) for b in bindings)

    def _float_target(self, call: cst.Call) -> Optional[str]:
        """Where the tensor goes: the loss (as the script names it) that provably takes it as its
        target, "unsure" where it is the target of a call named like a loss that the
        migration cannot identify, None where it goes nowhere like that."""
        s = script_model(self.ctx).s
        unsure = False
        for holder in self._holders(s, call, 0):
            parent = s.parent(holder)
            grand = s.parent(parent) if isinstance(parent, cst.Arg) else None
            if not isinstance(grand, cst.Call) or not self._target_arg(grand, parent):
                continue
            func = grand.func
            if self.qualify(func) in FLOAT_LOSS_FUNCTIONS or constructed_from(
                    script_model(self.ctx), self.qualify, func, FLOAT_LOSS_CLASSES):
                return f"`{' '.join(self.ctx.module.code_for_node(func).split())}`"
            name = dotted(func.func if isinstance(func, cst.Call) else func) or ""
            if _LOSS_NAME.search(name.rsplit(".", 1)[-1]) and self.qualify(func) is None and not constructed_from(
                    script_model(self.ctx), self.qualify, func, _TorchLoss()):
                unsure = True  # not a loss of torch's own that takes indices (`CrossEntropyLoss`)
        return "unsure" if unsure else None

    @staticmethod
    def _target_arg(call: cst.Call, arg: cst.Arg) -> bool:
        if arg.keyword is not None:
            return arg.keyword.value == "target"
        return not arg.star and len(call.args) > 1 and call.args[1] is arg

    def _holders(self, s, expr: cst.BaseExpression, depth: int) -> List[cst.BaseExpression]:
        """`expr` itself and every later read of a name it is bound to (`label = torch.full(...)`
        ... `crit(out, label)`), through `label = label.to(device)`-style rebindings."""
        out = [expr]
        while True:  # `torch.full(...).to(device)`: the same tensor, moved
            above = s.parent(expr)
            call = s.parent(above) if isinstance(above, cst.Attribute) and above.attr.value in _SAME_TENSOR else None
            if not (isinstance(call, cst.Call) and call.func is above):
                break
            expr = call
            out.append(expr)
        parent = s.parent(expr)
        if depth > 3 or not (isinstance(parent, cst.Assign) and parent.value is expr and len(parent.targets) == 1
                             and isinstance(parent.targets[0].target, cst.Name)):
            return out
        name = parent.targets[0].target.value
        for node in s.index.of(cst.Name):
            if node.value != name or s.order(node) <= s.order(parent) or node is parent.targets[0].target:
                continue
            stmt = s.statement(node)
            _, bindings = s.lookup(name, s.scope(node), s.order(stmt) if stmt is not None else NEVER)
            if not any(b.stmt is parent for b in bindings):
                continue
            out.append(node)
            above = s.parent(node)
            if isinstance(above, cst.Attribute) and above.value is node and above.attr.value in _SAME_TENSOR:
                call = s.parent(above)
                if isinstance(call, cst.Call) and call.func is above:
                    out.extend(self._holders(s, call, depth + 1)[1:])
        return out

    def _reduction(self, original: cst.Call, updated: cst.Call, qualified: Optional[str]):
        if not qualified or not (qualified.startswith("torch.nn.functional.") or
                                 (qualified.startswith("torch.nn.") and qualified.endswith("Loss"))):
            return None
        size_average = get_arg(updated, "size_average")
        reduce = get_arg(updated, "reduce")
        if size_average is None and reduce is None:
            return None
        sa = literal_bool(size_average.value) if size_average else True
        rd = literal_bool(reduce.value) if reduce else True
        if sa is None or rd is None or get_arg(updated, "reduction") is not None:
            self.report(original, "`size_average`/`reduce` are deprecated; use `reduction=`", review=True)
            return None
        reduction = "none" if not rd else ("mean" if sa else "sum")
        self._deprecated(original, "`size_average`/`reduce`", f"`reduction=\"{reduction}\"`")
        args = [a for a in updated.args if a is not size_average and a is not reduce]
        return with_args(updated, [*args, keyword_arg("reduction", cst.SimpleString(f'"{reduction}"'))])


_DATA_METADATA = frozenset({"shape", "size", "dim", "dtype", "device", "ndim", "numel", "is_cuda"})
_DATA_NAMES = frozenset({"loss", "output", "outputs", "weight", "weights", "bias", "grad", "logits", "param"})


class DataAttribute(Rule):
    """
    ## What it does
    Finds `.data` on parameters and graph tensors: writes (`w.data = ...`), in-place updates
    (`p.data.add_(...)`, `m.weight.data.normal_(0, 0.02)`) and reads (`output.data.cpu()`).

    ## Why is this bad?
    `.data` is a view that autograd does not track: an in-place change through it skips the
    version check, so a backward pass that needs the old value computes wrong gradients
    without an error. `.detach()` shares the storage too but is tracked.

    ## Example
    ```python
    for p in model.parameters():
        p.data.add_(p.grad.data, alpha=-lr)
    pred = output.data.max(1)[1]
    ```

    ## Use instead
    ```python
    with torch.no_grad():
        for p in model.parameters():
            p.add_(p.grad, alpha=-lr)
    pred = output.detach().max(1)[1]
    ```
    Only receivers known to be tensors are flagged: loop variables over `parameters()`,
    `named_parameters()` or `group['params']`, `.grad`/`.weight`/`.bias`, names bound from a
    module or `torch` call, and names such as `loss`, `output`, `weight`, `grad`.
    `self.data`, `args.data` or `dataset.data` are not. `.data[0]` is GM201's,
    `Variable(h.data)` GM202's; metadata reads (`.data.shape`, `.data.size()`) are harmless.
    """

    code = "GM204"
    name = "data-attribute"
    message = "`.data` bypasses autograd; use `.detach()` to read, `with torch.no_grad():` to update"
    triggers = (".data",)

    # a `.data` attribute; what its receiver holds comes from kinds too broad to bound by facts
    @classmethod
    def gate(cls, facts: SourceFacts) -> bool:
        return ".data" in facts.text and "data" in facts.ids

    examples = (
        Flagged("for p in model.parameters():\n    p.data.add_(p.grad.data, alpha=-lr)\n"),
        Flagged("def init(m):\n    m.weight.data.normal_(0.0, 0.02)\n"),
        Flagged("output = model(x)\npred = output.data.max(1)[1]\n"),
        Flagged("import torch\nw = torch.zeros(3, requires_grad=True)\nw.data = torch.ones(3)\n"),
        Clean("n = len(train_loader.dataset)\nroot = args.data\nitems = self.data\n"),
        Clean("from torchvision import datasets\nds = datasets.MNIST('.')\nx = ds.data.float()\n"),
        Clean("print(loss.data[0])\n"),
        Clean("from torch.autograd import Variable\nh = Variable(h.data)\n"),
        Clean("batch_size = output.data.size(0)\nshape = loss.data.shape\n"),
    )

    def visit_Module(self, node: cst.Module) -> None:
        self.covered: Set[int] = set()  # statements with a reported update: their `.data` reads are part of it

    def _cover(self) -> None:
        statement = enclosing(self.ctx.ancestors, cst.BaseSmallStatement)
        if statement is not None:
            self.covered.add(id(statement))

    def _tensorish(self, expr: cst.BaseExpression) -> bool:
        if isinstance(expr, cst.Attribute):
            return expr.attr.value in ("grad", "weight", "bias")
        model = script_model(self.ctx)
        if isinstance(expr, cst.Name):
            kind = model.kind_anywhere(expr.value, expr)
            if kind in v.TENSORS:
                return True
            name = expr.value.lower()
            named = name in _DATA_NAMES or name.endswith(("_loss", "_grad")) or name.startswith("loss_")
            return named and kind not in v.MODULES | {v.LOADER, v.BATCH}
        if isinstance(expr, cst.Subscript):
            return self._tensorish(expr.value)
        return isinstance(expr, cst.Call) and model.kind(expr) in v.TENSORS

    def _data_on_tensor(self, node: cst.BaseExpression) -> bool:
        return isinstance(node, cst.Attribute) and node.attr.value == "data" and self._tensorish(node.value)

    def visit_Assign(self, node: cst.Assign) -> None:
        for target in node.targets:
            if self._data_on_tensor(target.target):
                self._cover()
                x = _short(self.ctx, target.target.value)
                self.report(target.target, f"`{x}.data = ...` swaps the tensor behind autograd's back; write "
                                           f"`with torch.no_grad(): {x}.copy_(...)`")

    def visit_Call(self, node: cst.Call) -> None:
        func = node.func
        if isinstance(func, cst.Attribute) and self._data_on_tensor(func.value) and _in_place(func.attr.value):
            self._cover()
            x = _short(self.ctx, func.value.value)
            self.report(func.value, f"in-place `{x}.data.{func.attr.value}(...)` hides the change from autograd, "
                                    f"so gradients that need the old value are silently wrong; write "
                                    f"`with torch.no_grad(): {x}.{func.attr.value}(...)`")

    def visit_AugAssign(self, node: cst.AugAssign) -> None:
        if self._data_on_tensor(node.target):
            self._cover()
            x = _short(self.ctx, node.target.value)
            self.report(node.target, f"in-place `{x}.data` update hides the change from autograd; write "
                                     f"`with torch.no_grad():` and update `{x}` itself")

    def visit_Attribute(self, node: cst.Attribute) -> None:
        if node.attr.value != "data":
            return
        ancestors = self.ctx.ancestors
        parent = ancestors[-2] if len(ancestors) > 1 else None
        grand = ancestors[-3] if len(ancestors) > 2 else None
        if isinstance(parent, (cst.AssignTarget, cst.AugAssign)) and parent.target is node:
            return  # a write: visit_Assign / visit_AugAssign
        if isinstance(parent, cst.Attribute) and parent.value is node:
            if parent.attr.value in _DATA_METADATA or (
                    _in_place(parent.attr.value) and isinstance(grand, cst.Call) and grand.func is parent):
                return
        if isinstance(parent, cst.Subscript) and parent.value is node:
            if isinstance(grand, cst.AssignTarget):
                if self._tensorish(node.value):
                    self._cover()
                    x = _short(self.ctx, node.value)
                    self.report(node, f"in-place `{x}.data[...] = ...` hides the change from autograd; write "
                                      f"`with torch.no_grad(): {x}[...] = ...`")
                return
            if _index_zero(parent):
                return  # GM201's
        if isinstance(parent, cst.Arg) and isinstance(grand, cst.Call) and \
                self.qualify(grand.func) in ("torch.autograd.Variable", "torch.autograd.variable.Variable"):
            return  # GM202
        if any(id(a) in self.covered for a in ancestors) or not self._tensorish(node.value):
            return
        x = _short(self.ctx, node.value)
        if isinstance(parent, cst.Arg) and isinstance(grand, cst.Call) and \
                (self.qualify(grand.func) or "").startswith("torch.nn.init."):
            self.report(node, f"`nn.init` functions already update in place under `torch.no_grad()`: pass `{x}` "
                              f"itself, not `{x}.data`")
            return
        self.report(node, f"`{x}.data` bypasses autograd: an in-place change to either tensor silently corrupts "
                          f"gradients; use `{x}.detach()`")


def _short(ctx, node: cst.CSTNode) -> str:
    """A node's code for a message: on one line, and cut if long."""
    code = " ".join(ctx.module.code_for_node(node).split())
    return code if len(code) <= 40 else code[:37] + "..."


def _in_place(method: str) -> bool:
    return method.endswith("_") and not method.startswith("_")
