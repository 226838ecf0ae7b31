"""The PyTorch 0.4 API migration and later removals: GM201-GM208.

Scripts from 2017-2018 use idioms that today's torch rejects or silently changes:
`loss.data[0]` on a 0-dim tensor raises, `Variable` is a no-op whose `volatile` flag is
ignored (so evaluation builds graphs), `type(h) == Variable` is always False.
"""

from __future__ import annotations

import io
import tokenize
from typing import Dict, List, Optional, Set, Tuple

import libcst as cst
import libcst.matchers as m

from gpumigrate.codemods.base import Clean, Flagged, Rule
from gpumigrate.codemods.graph import loss_analysis, scope_of
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
    with_args,
)

VARIABLE = ("torch.autograd.Variable", "torch.autograd.variable.Variable")


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
    Finds `loss.data[0]`, the pre-0.4 way to read a Python number from a scalar loss.

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
    `t.data[0]` on a tensor that is not known to be a scalar is reported for review.
    """

    code = "GM201"
    name = "data-index-scalar"
    message = "`.data[0]` on a 0-dim tensor raises since torch 0.4; use `.item()`"
    fixed_in = frozenset({"device"})
    triggers = (".data[",)
    examples = (
        Flagged(
            "import torch.nn.functional as F\nloss = F.nll_loss(out, y)\nprint(loss.data[0])\n",
            fixed="import torch.nn.functional as F\nloss = F.nll_loss(out, y)\nprint(loss.item())\n",
        ),
        Flagged(
            "import torch.nn.functional as F\ntotal += F.nll_loss(out, y, reduction='sum').data[0]\n",
            fixed="import torch.nn.functional as F\ntotal += F.nll_loss(out, y, reduction='sum').item()\n",
        ),
        Flagged("first = output.data[0]\n"),  # not known to be a scalar: review
        Flagged("loss.data[0] = 1.0\n"),  # a write: review, never `loss.item() = 1.0`
        Clean("print(loss.item())\nrow = batch[0]\n"),
    )

    def leave_Subscript(self, original: cst.Subscript, updated: cst.Subscript) -> Optional[cst.BaseExpression]:
        if not (_is_data_attr(original.value) and _index_zero(original)):
            return None
        parent = self.ctx.ancestors[-1] if self.ctx.ancestors else None
        if isinstance(parent, (cst.AssignTarget, cst.AugAssign, cst.Del)) and \
                (getattr(parent, "target", None) is original):
            self.report(original, "`.data[0] = ...` writes into a tensor: index the tensor itself "
                                  "under `torch.no_grad()`", review=True)
            return None
        tensor = original.value.value
        if not loss_analysis(self.ctx).is_scalar(tensor, scope_of(self.ctx.ancestors)):
            self.report(original, "`.data[0]`: use `.item()` if this is a scalar, `.detach()[0]` if not", review=True)
            return None
        self.report(original)
        return call_method(updated.value.value, "item").with_changes(lpar=updated.lpar, rpar=updated.rpar)


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
    """

    code = "GM202"
    name = "variable-wrapper"
    message = "`Variable` is a no-op since torch 0.4; use the tensor itself"
    fixed_in = frozenset({"device"})
    triggers = ("Variable",)
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
            for qualified in VARIABLE:
                module, _, name = qualified.rpartition(".")
                self.ctx.remove_import(module, name)
        value = data.value
        if _is_data_attr(value):
            value = call_method(value.value, "detach")  # Variable(h.data): a new leaf cut from the graph
        if grad is not None and literal_bool(grad.value) is not False:
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


_NO_GRAD = ("torch.no_grad", "torch.inference_mode", "torch.autograd.no_grad", "torch.set_grad_enabled")


def under_no_grad(ctx, ancestors) -> bool:
    """Is the code at `ancestors` already inside `torch.no_grad()`/`inference_mode()`?"""
    for node in ancestors:
        items = []
        if isinstance(node, cst.With):
            items = [item.item for item in node.items]
        elif isinstance(node, cst.FunctionDef):
            items = [d.decorator for d in node.decorators]
        for item in items:
            func = item.func if isinstance(item, cst.Call) else item
            if ctx.names.qualify(func) in _NO_GRAD:
                return True
    return False


def calls_backward(node: cst.CSTNode) -> bool:
    return bool(findall(node, m.Call(func=m.Attribute(attr=m.Name("backward")))))


def has_no_grad_decorator(func: cst.FunctionDef) -> bool:
    """Spelled any way (the import may be one this run adds, unknown to the import table)."""
    render = cst.Module(body=[]).code_for_node
    return any(render(d.decorator).replace(" ", "").endswith(("no_grad()", "inference_mode()"))
               for d in func.decorators)


def no_grad_decorator(ctx) -> cst.Decorator:
    local = ctx.names.local_name_for("torch.no_grad")
    if local is None:
        ctx.add_import("torch")
        local = "torch.no_grad"
    return cst.Decorator(decorator=cst.parse_expression(f"{local}()"))


def no_grad_with(ctx, stmt: cst.BaseStatement) -> cst.With:
    local = ctx.names.local_name_for("torch.no_grad")
    if local is None:
        ctx.add_import("torch")
        local = "torch.no_grad"
    return cst.With(
        items=[cst.WithItem(cst.parse_expression(f"{local}()"))],
        body=cst.IndentedBlock(body=[stmt.with_changes(leading_lines=[])]),
        leading_lines=stmt.leading_lines,
    )


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
    """

    code = "GM203"
    name = "volatile-flag"
    message = "`volatile=True` has no effect since torch 0.4; run this code under `torch.no_grad()`"
    fixed_in = frozenset({"device"})
    triggers = ("volatile",)
    examples = (
        Flagged(
            "import torch\nfrom torch.autograd import Variable\ndef test(x):\n    return model(Variable(x, volatile=True))\n",
            fixed="import torch\n@torch.no_grad()\ndef test(x):\n    return model(x)\n",
        ),
        Flagged(
            "import torch\nfor x in xs:\n    y = model(torch.autograd.Variable(x, volatile=True))\n",
            fixed="import torch\nwith torch.no_grad():\n    for x in xs:\n        y = model(x)\n",
        ),
        Clean("import torch\nx = Variable(x, volatile=False)\n"),
    )

    def visit_Module(self, node: cst.Module) -> None:
        self.functions: Set[int] = set()
        self.statements: Set[int] = set()

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
        if under_no_grad(self.ctx, self.ctx.ancestors):
            self.report(node, "`volatile=True` has no effect since torch 0.4 (already under no_grad here)")
            return
        func = enclosing(self.ctx.ancestors, cst.FunctionDef)
        if func is not None and calls_backward(func):
            self.report(node, "`volatile=True` has no effect; this function also trains: wrap its "
                              "evaluation part in `with torch.no_grad():`", review=True)
            return
        self.report(node)
        if func is not None:
            self.functions.add(id(func))
        else:
            top = self.ctx.ancestors[1]  # the module-level statement holding the call
            self.statements.add(id(top))

    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef):
        if id(original) not in self.functions or has_no_grad_decorator(updated):
            return None
        return updated.with_changes(decorators=[*updated.decorators, no_grad_decorator(self.ctx)])

    def _wrap(self, original, updated):
        if id(original) not in self.statements or len(self.ctx.ancestors) != 1:
            return None
        return no_grad_with(self.ctx, updated)

    leave_For = leave_While = leave_If = leave_SimpleStatementLine = _wrap


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
    name = "async-kwarg"
    message = "`async=` is a syntax error since Python 3.7; use `non_blocking=`"
    fixed_in = frozenset({"device"})
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
    name = "variable-type-check"
    message = "`type(h) == Variable` is always False since torch 0.4; use `isinstance(h, torch.Tensor)`"
    fixed_in = frozenset({"device"})
    triggers = ("Variable",)
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
            self.ctx.remove_import("torch.autograd", "Variable")
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
            self.ctx.remove_import("torch.autograd", "Variable")
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
    name = "data-accumulator-index"
    message = "accumulated `.data` is a 0-dim tensor since torch 0.4: `total[0]` raises; accumulate `.item()`"
    fixed_in = frozenset({"device"})
    triggers = (".data",)
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
        accumulated = {
            aug.target.value
            for aug in findall(node, m.AugAssign(target=m.Name(), operator=m.AddAssign()))
            if self._data_leaves(aug.value)
        }
        indexed = {
            sub.value.value for sub in findall(node, m.Subscript(value=m.Name())) if _index_zero(sub)
        }
        self.names = accumulated & indexed

    @staticmethod
    def _data_leaves(value: cst.BaseExpression) -> List[cst.Attribute]:
        """`.data` reads that are the value itself or an operand of arithmetic."""
        if _is_data_attr(value):
            return [value]
        if isinstance(value, cst.BinaryOperation):
            return DataAccumulatorIndex._data_leaves(value.left) + DataAccumulatorIndex._data_leaves(value.right)
        return []

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
}


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


class DeprecatedOverload(Rule):
    """
    ## What it does
    Finds call forms that today's torch deprecates: positional `alpha`/`value` overloads
    (`p.data.add_(-lr, grad)`), `size_average=`/`reduce=` loss arguments, and renamed
    functions (`clip_grad_norm`, `nn.init.xavier_uniform`, `F.upsample`).

    ## Why is this bad?
    They warn on every call (often every step) and are removed one release at a time.

    ## Example
    ```python
    p.data.add_(-lr, p.grad.data)
    loss = F.nll_loss(out, y, size_average=False)
    torch.nn.utils.clip_grad_norm(model.parameters(), 0.25)
    ```

    ## Use instead
    ```python
    p.data.add_(p.grad.data, alpha=-lr)
    loss = F.nll_loss(out, y, reduction="sum")
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
    ```
    """

    code = "GM208"
    name = "deprecated-overload"
    message = "deprecated call form"
    fixed_in = frozenset({"device"})
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
        Clean("import torch\nx.add_(y, alpha=2)\nz = torch.add(a, b)\n"),
        Clean("import re\nclean = ansi_escape.sub('', text)\nn = counter.sub(1, 2)\n"),
    )

    def leave_Call(self, original: cst.Call, updated: cst.Call):
        qualified = self.qualify(original.func)
        if qualified in _RENAMES and isinstance(updated.func, cst.Attribute):
            new = _RENAMES[qualified]
            self.report(original, f"`{qualified.rsplit('.', 1)[1]}` is deprecated; use `{new}`")
            return updated.with_changes(func=updated.func.with_changes(attr=cst.Name(new)))
        positional = positional_args(updated)
        if qualified is None and is_method_call(original, *_ALPHA_METHODS) and len(positional) == 2 \
                and len(updated.args) == 2 and _legacy_tensor_overload(original):
            self.report(original, f"`{original.func.attr.value}(alpha, other)` is deprecated; use "
                                  f"`{original.func.attr.value}(other, alpha=alpha)`")
            alpha, other = updated.args
            return with_args(updated, [other.with_changes(comma=cst.MaybeSentinel.DEFAULT),
                                       keyword_arg("alpha", alpha.value)])
        if qualified is None and is_method_call(original, *_VALUE_METHODS) and len(positional) == 3 \
                and len(updated.args) == 3 and _legacy_tensor_overload(original):
            self.report(original, f"`{original.func.attr.value}(value, t1, t2)` is deprecated; use "
                                  f"`{original.func.attr.value}(t1, t2, value=value)`")
            value, t1, t2 = updated.args
            return with_args(updated, [t1, t2.with_changes(comma=cst.MaybeSentinel.DEFAULT),
                                       keyword_arg("value", value.value)])
        return self._reduction(original, updated, qualified)

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
        self.report(original, "`size_average`/`reduce` are deprecated; use `reduction=`")
        reduction = "none" if not rd else ("mean" if sa else "sum")
        args = [a for a in updated.args if a is not size_average and a is not reduce]
        return with_args(updated, [*args, keyword_arg("reduction", cst.SimpleString(f'"{reduction}"'))])
