"""Lint-only rules: GM104, GM204, GM304, GM306, GM601, GM602, GM603.

Each finds a performance or correctness trap that has no safe mechanical fix: the rules
report and never rewrite. Tensor-or-not decisions come from one per-file analysis of what
each name is bound to (`_Kinds`); when it cannot tell, the rules stay silent.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Dict, FrozenSet, Iterator, List, Optional, Set, Tuple, Union

import libcst as cst

from gpumigrate.codemods.base import Clean, Flagged, Rule
from gpumigrate.codemods.helpers import enclosing, get_arg, is_method_call, literal_int, literal_str, walk
from gpumigrate.rewriter.engine import FileContext

# What a name holds. NEUTRAL: a rebinding that keeps the kind (`x = x.to(device)`).
TENSOR, PARAM, MODULE, BATCH, LOADER, UNKNOWN, NEUTRAL = (
    "tensor", "param", "module", "batch", "loader", "unknown", "neutral")

DATALOADER = ("torch.utils.data.DataLoader", "torch.utils.data.dataloader.DataLoader")
_TENSOR_NAMESPACES = ("torch.nn.functional.", "torch.linalg.", "torch.fft.", "torch.special.")
# `torch.<lowercase>` functions that do not return tensors (or may return a module).
_NOT_TENSOR_FNS = frozenset({
    "load", "compile", "device", "manual_seed", "no_grad", "enable_grad", "inference_mode",
    "set_grad_enabled", "get_default_dtype", "set_default_dtype", "is_tensor", "is_grad_enabled",
    "save", "set_num_threads", "get_num_threads", "use_deterministic_algorithms", "typename",
})
# Methods that modules and tensors share and that return the same kind of object.
_KIND_KEEPING = frozenset({"to", "cuda", "cpu", "float", "half", "double", "bfloat16", "type",
                           "requires_grad_", "share_memory", "train", "eval"})
# Methods only tensors have: calling one says the receiver is a tensor.
_TENSOR_ONLY = frozenset({"view", "view_as", "permute", "unsqueeze", "contiguous", "detach", "clone",
                          "expand", "expand_as", "long", "softmax", "log_softmax", "sigmoid",
                          "masked_fill", "index_select", "narrow", "pin_memory"})
_NOT_TENSOR_RESULT = frozenset({"item", "tolist", "numpy", "size", "dim", "numel", "data_ptr",
                                "element_size", "get_device", "is_contiguous", "parameters",
                                "named_parameters", "state_dict", "modules", "children"})

Evidence = Tuple  # ("expr", value) | ("unpack", value, path) | ("loop", iter, path) | ("kind", kind)


def _last_name(node: cst.BaseExpression) -> Optional[str]:
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        return node.attr.value
    return None


def _is_tensor_fn(qualified: str) -> bool:
    if qualified.startswith(_TENSOR_NAMESPACES):
        return qualified.rsplit(".", 1)[1][:1].islower()
    if qualified in ("torch.autograd.Variable", "torch.autograd.variable.Variable"):
        return True
    parts = qualified.split(".")
    if parts[0] != "torch":
        return False
    if len(parts) == 2:
        name = parts[1]
        return name.endswith("Tensor") or (name[:1].islower() and name not in _NOT_TENSOR_FNS)
    return len(parts) == 3 and parts[1] == "cuda" and parts[2].endswith("Tensor")


def _statements(node: cst.CSTNode) -> Iterator[cst.CSTNode]:
    """`node` and the statements (compound and small) and except handlers inside it, without
    entering nested functions and classes. No expressions: libcst's `.children` is costly."""
    if isinstance(node, (cst.Module, cst.BaseSuite)):
        for stmt in node.body:
            yield from _statements(stmt)
        return
    yield node
    if isinstance(node, cst.SimpleStatementLine):
        yield from node.body
    if not isinstance(node, cst.BaseCompoundStatement) or isinstance(node, (cst.FunctionDef, cst.ClassDef)):
        return
    if isinstance(getattr(node, "body", None), cst.BaseSuite):
        yield from _statements(node.body)
    for case in getattr(node, "cases", ()):
        yield from _statements(case.body)
    orelse = getattr(node, "orelse", None)
    if orelse is not None:
        yield from _statements(orelse if isinstance(orelse, cst.If) else orelse.body)
    for handler in getattr(node, "handlers", ()):
        yield handler
        yield from _statements(handler.body)
    final = getattr(node, "finalbody", None)
    if final is not None:
        yield from _statements(final.body)


def _target_names(target: cst.CSTNode) -> List[str]:
    if isinstance(target, cst.Name):
        return [target.value]
    if isinstance(target, (cst.Tuple, cst.List)):
        return [n for e in target.elements for n in _target_names(e.value)]
    if isinstance(target, cst.StarredElement):
        return _target_names(target.value)
    return []


class _Scope:
    def __init__(self, node: cst.CSTNode, parent: Optional["_Scope"]) -> None:
        self.node = node
        self.parent = parent  # the enclosing function or module scope (class bodies are skipped)
        self.params: Set[str] = set()
        self.bindings: Dict[str, List[Evidence]] = defaultdict(list)


class _Kinds:
    """Per scope (module, function, class body): every binding of every name, classified on
    demand into tensor / param / module / batch (one item of a loader) / loader / unknown."""

    def __init__(self, ctx: FileContext) -> None:
        self.ctx = ctx
        self.scopes: Dict[int, _Scope] = {}
        root = _Scope(ctx.module, None)
        self.scopes[id(ctx.module)] = root
        self._memo: Dict[Tuple[str, int], Optional[str]] = {}
        self._collect(ctx.module, root)

    # -- collection ------------------------------------------------------------------
    def _collect(self, body: cst.CSTNode, scope: _Scope) -> None:
        for node in _statements(body):
            if not isinstance(node, (cst.FunctionDef, cst.ClassDef)):
                self._bind(node, scope)
                continue
            scope.bindings[node.name.value].append(("kind", UNKNOWN))
            parent = scope
            while isinstance(parent.node, cst.ClassDef):
                parent = parent.parent  # methods do not see the class body's names
            inner = _Scope(node, parent if isinstance(node, cst.FunctionDef) else scope)
            if isinstance(node, cst.FunctionDef):
                p = node.params
                inner.params.update(param.name.value for param in [*p.posonly_params, *p.params, *p.kwonly_params])
                inner.params.update(star.name.value for star in (p.star_arg, p.star_kwarg) if isinstance(star, cst.Param))
            self.scopes[id(node)] = inner
            self._collect(node.body, inner)

    def _bind(self, node: cst.CSTNode, scope: _Scope) -> None:
        if isinstance(node, cst.Assign):
            for target in node.targets:
                self._bind_target(target.target, scope, "expr", node.value, ())
        elif isinstance(node, cst.AnnAssign) and node.value is not None:
            self._bind_target(node.target, scope, "expr", node.value, ())
        elif isinstance(node, cst.For):
            self._bind_target(node.target, scope, "loop", node.iter, ())
        elif isinstance(node, cst.With):
            for item in node.items:
                if item.asname is not None:
                    self._bind_target(item.asname.name, scope, "kind", UNKNOWN, ())
        elif isinstance(node, cst.ExceptHandler) and node.name is not None:
            self._bind_target(node.name.name, scope, "kind", UNKNOWN, ())

    def _bind_target(self, target: cst.BaseExpression, scope: _Scope, how: str, value, path: Tuple[int, ...]) -> None:
        if isinstance(target, cst.Name):
            if how == "expr" and path:
                scope.bindings[target.value].append(("unpack", value, path))
            else:
                scope.bindings[target.value].append((how, value, path) if how != "kind" else ("kind", value))
        elif isinstance(target, (cst.Tuple, cst.List)):
            for i, element in enumerate(target.elements):
                inner = element.value
                if isinstance(element, cst.StarredElement):
                    self._bind_target(inner, scope, "kind", UNKNOWN, ())
                else:
                    self._bind_target(inner, scope, how, value, path + (i,))

    # -- queries -----------------------------------------------------------------------
    def scope_at(self, ancestors) -> _Scope:
        for node in reversed(ancestors):
            if isinstance(node, (cst.FunctionDef, cst.ClassDef)) and id(node) in self.scopes:
                return self.scopes[id(node)]
        return self.scopes[id(self.ctx.module)]

    def of_name(self, name: str, scope: _Scope, seen: FrozenSet[Tuple[str, int]] = frozenset()) -> Optional[str]:
        """The kind of `name` in `scope`; None when nothing says (a parameter, an unbound name)."""
        while scope is not None and name not in scope.bindings:
            if name in scope.params:
                return None
            scope = scope.parent
        if scope is None:
            return None
        key = (name, id(scope))
        if key in seen:
            return NEUTRAL
        if not seen and key in self._memo:
            return self._memo[key]
        kinds = set()
        for evidence in scope.bindings[name]:
            kind = self._evidence(evidence, scope, seen | {key})
            if kind != NEUTRAL:
                kinds.add(kind)
        result = _merge(kinds)
        if not seen:
            self._memo[key] = result
        return result

    def _evidence(self, evidence: Evidence, scope: _Scope, seen) -> str:
        how = evidence[0]
        if how == "kind":
            return evidence[1]
        if how == "expr":
            return self.classify(evidence[1], scope, seen)
        if how == "unpack":
            return self._unpacked(evidence[1], evidence[2], scope, seen)
        return self._loop_item(evidence[1], evidence[2], scope, seen)

    def classify(self, expr: cst.BaseExpression, scope: _Scope, seen=frozenset()) -> str:
        if isinstance(expr, cst.Name):
            return self.of_name(expr.value, scope, seen) or UNKNOWN
        if isinstance(expr, cst.Subscript):
            if any(isinstance(e.slice, cst.Slice) for e in expr.slice):
                return TENSOR
            base = self.classify(expr.value, scope, seen)
            if base in (TENSOR, PARAM, BATCH) or _last_name(expr.value) in ("batch", "data", "sample") \
                    or _last_name(expr.value) in TENSOR_NAMES:
                return TENSOR
            return UNKNOWN
        if isinstance(expr, cst.Attribute):
            return PARAM if expr.attr.value in ("weight", "bias") else TENSOR if expr.attr.value == "grad" else UNKNOWN
        if not isinstance(expr, cst.Call):
            return UNKNOWN
        func = expr.func
        qualified = self.ctx.names.qualify(func)
        if qualified:
            if qualified in ("torch.nn.Parameter", "torch.nn.parameter.Parameter"):
                return PARAM
            if _is_tensor_fn(qualified):
                return TENSOR
            if qualified in DATALOADER:
                return LOADER
            return MODULE if qualified.rsplit(".", 1)[1][:1].isupper() else UNKNOWN
        if isinstance(func, cst.Attribute):
            method = func.attr.value
            receiver = self.classify(func.value, scope, seen)
            if method in _KIND_KEEPING:
                return receiver
            if method in _TENSOR_ONLY:
                return TENSOR
            if receiver in (TENSOR, PARAM) and method not in _NOT_TENSOR_RESULT:
                return TENSOR
            return UNKNOWN
        if isinstance(func, cst.Name):
            if self.of_name(func.value, scope) == MODULE:
                return TENSOR  # a module's output
            if func.value[:1].isupper():
                return MODULE  # an instance of a class of this file (or an unresolved import)
        return UNKNOWN

    def _unpacked(self, value: cst.BaseExpression, path: Tuple[int, ...], scope: _Scope, seen) -> str:
        if isinstance(value, (cst.Tuple, cst.List)):
            if path[0] < len(value.elements) and not any(isinstance(e, cst.StarredElement) for e in value.elements):
                element = value.elements[path[0]].value
                rest = path[1:]
                return self._unpacked(element, rest, scope, seen) if rest else self.classify(element, scope, seen)
            return UNKNOWN
        kind = self.classify(value, scope, seen)
        return TENSOR if kind in (TENSOR, BATCH) else UNKNOWN  # `inputs, labels = data`

    def _loop_item(self, it: cst.BaseExpression, path: Tuple[int, ...], scope: _Scope, seen) -> str:
        while isinstance(it, cst.Call) and it.args and not it.args[0].star:
            name = _last_name(it.func)
            if name in ("tqdm", "trange") or (name == "filter" and len(it.args) == 2):
                it = it.args[-1].value if name == "filter" else it.args[0].value
            elif name == "enumerate":
                if not path or path[0] == 0:
                    return UNKNOWN
                path, it = path[1:], it.args[0].value
            else:
                break
        if is_method_call(it, "parameters"):
            return PARAM if not path else UNKNOWN
        if is_method_call(it, "named_parameters"):
            return PARAM if path == (1,) else UNKNOWN
        if isinstance(it, cst.Subscript) and len(it.slice) == 1 and isinstance(it.slice[0].slice, cst.Index) \
                and literal_str(it.slice[0].slice.value) == "params":
            return PARAM if not path else UNKNOWN  # `for p in group['params']`
        if self.loader_like(it, scope, seen):
            return TENSOR if path else BATCH
        return UNKNOWN

    def loader_like(self, it: cst.BaseExpression, scope: _Scope, seen=frozenset()) -> bool:
        name = _last_name(it)
        if name is not None and "loader" in name.lower():
            return True
        return self.classify(it, scope, seen) == LOADER


def _merge(kinds: Set[str]) -> Optional[str]:
    if not kinds:
        return None
    if kinds <= {TENSOR, PARAM}:
        return PARAM if kinds == {PARAM} else TENSOR
    return kinds.pop() if len(kinds) == 1 else UNKNOWN


def kinds(ctx: FileContext) -> _Kinds:
    return ctx.shared("lint-only-kinds", _Kinds)


def _loop_of(ancestors, start: int = -1) -> Optional[int]:
    """Index in `ancestors` of the innermost `for`/`while` whose body holds `ancestors[start]`,
    within the same function; None outside loops."""
    for i in range(len(ancestors) + start - 1, -1, -1):
        node = ancestors[i]
        if isinstance(node, (cst.FunctionDef, cst.Lambda, cst.ClassDef)):
            return None
        if isinstance(node, (cst.For, cst.While)) and ancestors[i + 1] is node.body:
            return i
    return None


def _device_kind(expr: cst.BaseExpression, qualify) -> Optional[str]:
    """'gpu', 'cpu' or None (not a device, or cannot tell) for the target of `.to(...)`."""
    text = literal_str(expr)
    if text is not None:
        return "cpu" if text.startswith("cpu") else "gpu" if text.startswith(("cuda", "mps", "xpu")) else None
    if isinstance(expr, cst.Integer):
        return "gpu"
    if isinstance(expr, cst.Call) and qualify(expr.func) == "torch.device" and expr.args:
        return _device_kind(expr.args[0].value, qualify) or "gpu"
    name = _last_name(expr)
    if name is None:
        return None
    lowered = name.lower()
    if "cpu" in lowered:
        return "cpu"
    return "gpu" if "device" in lowered or lowered in ("dev", "gpu") or lowered.startswith("cuda") else None


def _to_target(call: cst.Call) -> Optional[cst.BaseExpression]:
    arg = get_arg(call, "device", 0)
    return arg.value if arg is not None else None


def _moves_to(call: cst.Call, qualify, kind: str) -> bool:
    """`.cuda()` / `.cpu()`, or `.to(<a device of this kind>)`; kind is "gpu" or "cpu"."""
    if is_method_call(call, "cuda" if kind == "gpu" else "cpu"):
        return True
    if is_method_call(call, "to"):
        target = _to_target(call)
        return target is not None and _device_kind(target, qualify) == kind
    return False


def _module_like_name(name: str) -> bool:
    lowered = name.lower()
    return "model" in lowered or lowered.startswith("net") or lowered.endswith("net")


TENSOR_NAMES = frozenset({"inputs", "input", "target", "targets", "label", "labels", "images", "image",
                          "imgs", "img", "x", "y"})


class DiscardedMove(Rule):
    """
    ## What it does
    Finds statements that only call `x.to(...)`, `x.cuda()` or `x.cpu()` on a tensor,
    throwing the result away.

    ## Why is this bad?
    `Module.to()` moves a module in place, but `Tensor.to()` returns a new tensor and leaves
    `x` where it was: the next line still computes on the CPU copy, or fails with "Expected
    all tensors to be on the same device".

    ## Example
    ```python
    for data, target in train_loader:
        data.to(device)
        target.to(device)
        output = model(data)
    ```

    ## Use instead
    ```python
    for data, target in train_loader:
        data, target = data.to(device), target.to(device)
        output = model(data)
    ```
    A receiver is a tensor when it is bound from a `torch` tensor function, an indexing, a
    module's output or a `(data, target)` pair unpacked from a loader, or is named like one
    (`inputs`, `target`, `labels`, `images`, `x`, `y`...). Names bound from a class call
    (modules, Hugging Face's `BatchEncoding`) and a bare `for batch in loader` item (PyG's
    `Data` and `Batch` move in place) are not flagged.
    """

    code = "GM104"
    name = "discarded-move"
    message = "`Tensor.to()` returns a new tensor; the result is discarded"
    reported_in = frozenset({"device"})
    triggers = (".to", ".cuda", ".cpu")
    examples = (
        Flagged("for data, target in train_loader:\n    data.to(device)\n    output = model(data)\n"),
        Flagged("import torch\nx = torch.randn(4, 3)\nx.cuda()\ny = x * 2\n"),
        Flagged("def step(model, inputs, labels):\n    inputs.to(device, non_blocking=True)\n    return model(inputs)\n"),
        Clean("import torch.nn as nn\nmodel = nn.Linear(3, 1)\nmodel.to(device)\nnet = Net()\nnet.cuda()\n"),
        Clean("inputs = tokenizer(texts, return_tensors='pt')\ninputs.to(device)\n"),
        Clean("for data in loader:  # torch_geometric Batch moves in place\n    data.to(device)\n"),
        Clean("import torch\nx = torch.randn(4, 3)\nx = x.to(device)\nprint(x.to(device))\n"),
        Clean("model = build_model(cfg)\nmodel.to(device)\nmodels[0].cuda()\n"),
    )

    def visit_Expr(self, node: cst.Expr) -> None:
        call = node.value
        if not is_method_call(call, "to", "cuda", "cpu"):
            return
        receiver = call.func.value
        analysis = kinds(self.ctx)
        scope = analysis.scope_at(self.ctx.ancestors)
        method = call.func.attr.value
        if isinstance(receiver, cst.Name):
            kind = analysis.of_name(receiver.value, scope)
            if not (kind in (TENSOR, PARAM) or (kind in (None, BATCH) and receiver.value in TENSOR_NAMES)):
                return
            x = receiver.value
            if kind == PARAM:
                self.report(call, f"`{x}.{method}(...)` returns a new tensor and leaves the parameter where it "
                                  f"was; move the module instead (`model.to(device)`)")
                return
            self.report(call, f"`{x}.{method}(...)` returns a new tensor; the result is discarded, so `{x}` "
                              f"stays where it was: write `{x} = {x}.{method}(...)`")
        elif isinstance(receiver, (cst.Call, cst.Subscript)) and analysis.classify(receiver, scope) == TENSOR:
            self.report(call, f"`.{method}(...)` returns a new tensor; the result is discarded: assign it")


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
        analysis = kinds(self.ctx)
        scope = analysis.scope_at(self.ctx.ancestors)
        if isinstance(expr, cst.Name):
            kind = analysis.of_name(expr.value, scope)
            if kind in (TENSOR, PARAM):
                return True
            name = expr.value.lower()
            named = name in _DATA_NAMES or name.endswith(("_loss", "_grad")) or name.startswith("loss_")
            return named and kind not in (MODULE, LOADER, BATCH)
        if isinstance(expr, cst.Subscript):
            return self._tensorish(expr.value)
        return isinstance(expr, cst.Call) and analysis.classify(expr, scope) in (TENSOR, PARAM)

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


def _short(ctx: FileContext, node: cst.CSTNode) -> str:
    """A node's code for a message: on one line, and cut if long."""
    code = " ".join(ctx.module.code_for_node(node).split())
    return code if len(code) <= 40 else code[:37] + "..."


def _in_place(method: str) -> bool:
    return method.endswith("_") and not method.startswith("_")


def _index_zero(node: cst.Subscript) -> bool:
    return len(node.slice) == 1 and isinstance(node.slice[0].slice, cst.Index) \
        and literal_int(node.slice[0].slice.value) == 0


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
        index = _loop_of(ancestors)
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
            name = _last_name(n) if isinstance(n, (cst.Name, cst.Attribute)) else None
            if name and "epoch" in name.lower():
                return True
    return any(isinstance(n, (cst.For, cst.While)) for n in _statements(loop.body))


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
        if not node.handlers or _loop_of(self.ctx.ancestors) is None:
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
        qualified = [self.qualify(t) or _last_name(t) for t in types]
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
    for node in _statements(body):
        if isinstance(node, (cst.Assign, cst.AnnAssign)) and node.value is not None and \
                not isinstance(node.value, (cst.Integer, cst.Float, cst.SimpleString, cst.Name)):
            targets = [t.target for t in node.targets] if isinstance(node, cst.Assign) else [node.target]
            names.update(n for t in targets for n in _target_names(t))
    return names


def _leaves(path: List[cst.CSTNode]) -> bool:
    """Does the out-of-memory path re-raise or leave the loop?"""
    return any(isinstance(n, (cst.Raise, cst.Return, cst.Break)) for part in path for n in _statements(part))


def _releases(path: List[cst.CSTNode], bound: Set[str]) -> bool:
    """Does the out-of-memory path `del` (or set to None) a name the `try` body bound?"""
    for part in path:
        for node in _statements(part):
            if isinstance(node, cst.Del) and bound & set(_target_names(node.target)):
                return True
            if isinstance(node, cst.Assign) and _is_none(node.value) and \
                    bound & {n for t in node.targets for n in _target_names(t.target)}:
                return True
    return False


def _is_none(node: cst.BaseExpression) -> bool:
    return isinstance(node, cst.Name) and node.value == "None"


_TRAIN = re.compile(r"(^|_|pre|re)train")


def _dataloader_call(rule: Rule, node: cst.Call) -> bool:
    return rule.qualify(node.func) in DATALOADER and not any(a.star for a in node.args)


def _bound_to(ancestors) -> Optional[str]:
    """The name a call's result is bound to: an assignment target, a dict key, or the
    function that returns it."""
    parent = ancestors[-2] if len(ancestors) > 1 else None
    call = ancestors[-1]
    if isinstance(parent, (cst.Assign, cst.AnnAssign)) and parent.value is call:
        targets = [t.target for t in parent.targets] if isinstance(parent, cst.Assign) else [parent.target]
        names = [_last_name(t) for t in targets]
        return next((n for n in names if n), None)
    if isinstance(parent, cst.DictElement) and parent.value is call:
        return literal_str(parent.key)
    if isinstance(parent, cst.Return):
        func = next((a for a in reversed(ancestors) if isinstance(a, cst.FunctionDef)), None)
        return func.name.value if func else None
    return None


class LoaderNoWorkers(Rule):
    """
    ## What it does
    Finds a training `DataLoader` built without `num_workers` (or with `num_workers=0`):
    one bound to a name such as `train_loader` (or returned by `train_dataloader()`), or
    iterated by a loop that calls `.backward()` or `optimizer.step()`.

    ## Why is this bad?
    With no workers every batch is read, decoded and augmented in the training process
    between steps, and the GPU waits for it: loading often costs more than the step itself.

    ## Example
    ```python
    train_loader = DataLoader(train_set, batch_size=64, shuffle=True)
    ```

    ## Use instead
    ```python
    train_loader = DataLoader(train_set, batch_size=64, shuffle=True,
                              num_workers=4, persistent_workers=True)
    ```
    Under the `spawn` start method (Windows, macOS) the script's entry point must then sit
    under `if __name__ == "__main__":`. Evaluation loaders, `num_workers=<expr>` and calls
    with `**kwargs` (workers may be inside) are not flagged.
    """

    code = "GM601"
    name = "loader-no-workers"
    message = "training `DataLoader` loads batches in the training process; set `num_workers`"
    triggers = ("DataLoader",)
    examples = (
        Flagged("from torch.utils.data import DataLoader\ntrain_loader = DataLoader(ds, batch_size=32, shuffle=True)\n"),
        Flagged("import torch\nloader = torch.utils.data.DataLoader(ds, 32, True, None, None, 0)\n"
                "for x, y in loader:\n    loss = crit(model(x), y)\n    loss.backward()\n    optimizer.step()\n"),
        Flagged("from torch.utils.data import DataLoader\nclass M:\n    def train_dataloader(self):\n"
                "        return DataLoader(self.ds, batch_size=8)\n"),
        Clean("from torch.utils.data import DataLoader\ntrain_loader = DataLoader(ds, batch_size=32, num_workers=4)\n"),
        Clean("from torch.utils.data import DataLoader\ntest_loader = DataLoader(ds, batch_size=1000)\n"
              "for x, y in test_loader:\n    correct += (model(x).argmax(1) == y).sum()\n"),
        Clean("from torch.utils.data import DataLoader\ntrain_loader = DataLoader(ds, batch_size=32, **kwargs)\n"),
        Clean("from torch.utils.data import DataLoader\ntrain_loader = DataLoader(ds, num_workers=args.workers)\n"),
        Clean("from torch_geometric.loader import DataLoader\ntrain_loader = DataLoader(ds, batch_size=32)\n"),
        Clean("from torch.utils.data import DataLoader\nconstraint_loader = DataLoader(ds)\n"),
    )

    def visit_Module(self, node: cst.Module) -> None:
        self.pending: List[Tuple[cst.CSTNode, Optional[str], List[cst.CSTNode]]] = []
        self.loops: List[Tuple[cst.For, Set[str]]] = []
        self.training: Set[int] = set()

    def visit_For(self, node: cst.For) -> None:
        names = {_last_name(n) for n in walk(node.iter) if isinstance(n, (cst.Name, cst.Attribute))}
        self.loops.append((node, names))

    def visit_Call(self, node: cst.Call) -> None:
        if _trains(node):
            for a in self.ctx.ancestors:
                if isinstance(a, (cst.For, cst.While)):
                    self.training.add(id(a))
        if not _dataloader_call(self, node):
            return
        workers = get_arg(node, "num_workers", 5)
        if workers is not None and literal_int(workers.value) != 0:
            return
        where = workers if workers is not None else node
        self.pending.append((where, _bound_to(self.ctx.ancestors), list(self.ctx.ancestors)))

    def leave_Module(self, original: cst.Module, updated: cst.Module) -> None:
        trained = set().union(*(names for loop, names in self.loops if id(loop) in self.training))
        for where, bound, ancestors in self.pending:
            in_training_iter = any(isinstance(a, cst.For) and id(a) in self.training and ancestors[i + 1] is a.iter
                                   for i, a in enumerate(ancestors[:-1]))
            if not (in_training_iter or (bound and (_TRAIN.search(bound.lower()) or bound in trained))):
                continue
            if isinstance(where, cst.Arg):
                self.report(where, "`num_workers=0` loads training batches in the training process, so the GPU "
                                   "waits on every one; use a few workers (e.g. 4)")
            else:
                self.report(where, "training `DataLoader` without `num_workers` loads batches in the training "
                                   "process, so the GPU waits on every one; set `num_workers` (e.g. 4)")


def _trains(call: cst.Call) -> bool:
    if is_method_call(call, "backward"):
        return True
    if not is_method_call(call, "step"):
        return False
    receiver = _last_name(call.func.value) or ""
    return "opt" in receiver.lower() or "scaler" in receiver.lower()


class LoaderNoPinMemory(Rule):
    """
    ## What it does
    Finds `DataLoader(...)` calls without `pin_memory` in a script that copies batches to
    the GPU (`.cuda()`, `.to(device)`, `non_blocking=True`).

    ## Why is this bad?
    Copies from pageable host memory are staged through a pinned buffer and block the host;
    with `pin_memory=True` the loader's workers hand over page-locked batches, which copy
    faster and can overlap compute with `non_blocking=True`.

    ## Example
    ```python
    loader = DataLoader(ds, batch_size=64, num_workers=4)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
    ```

    ## Use instead
    ```python
    loader = DataLoader(ds, batch_size=64, num_workers=4, pin_memory=device.type == "cuda")
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    ```
    Pinning only helps CUDA copies (on a CPU-only run it warns), so tie it to the device.
    Any explicit `pin_memory=` value is the author's decision; calls with `**kwargs` are not
    flagged.
    """

    code = "GM602"
    name = "loader-no-pin-memory"
    message = "`DataLoader` without `pin_memory` in a script that copies batches to the GPU"
    triggers = ("DataLoader",)
    examples = (
        Flagged("from torch.utils.data import DataLoader\nloader = DataLoader(ds, batch_size=64)\n"
                "for x, y in loader:\n    x, y = x.to(device), y.to(device)\n"),
        Flagged("import torch\nloader = torch.utils.data.DataLoader(ds, 64, num_workers=2)\n"
                "for x, y in loader:\n    out = model(x.cuda())\n"),
        Clean("from torch.utils.data import DataLoader\nloader = DataLoader(ds, batch_size=64, pin_memory=True)\n"
              "for x, y in loader:\n    x = x.to(device, non_blocking=True)\n"),
        Clean("from torch.utils.data import DataLoader\nloader = DataLoader(ds, batch_size=64, **kwargs)\n"
              "x = x.cuda()\n"),
        Clean("from torch.utils.data import DataLoader\nloader = DataLoader(ds, batch_size=64)\n"
              "# moved with .cuda() later\nnote = 'x.to(device)'\nx = x.to('cpu')\n"),
        Clean("from torch.utils.data import DataLoader\nloader = DataLoader(ds, pin_memory=False)\nx = x.cuda()\n"),
    )

    def visit_Module(self, node: cst.Module) -> None:
        self.pending: List[cst.Call] = []
        self.gpu = False

    def visit_Call(self, node: cst.Call) -> None:
        if not self.gpu and (_moves_to(node, self.qualify, "gpu") or any(
                a.keyword is not None and a.keyword.value == "non_blocking" and _is_true(a.value) for a in node.args)):
            self.gpu = True
        if _dataloader_call(self, node) and get_arg(node, "pin_memory", 7) is None:
            self.pending.append(node)

    def leave_Module(self, original: cst.Module, updated: cst.Module) -> None:
        if not self.gpu:
            return
        for call in self.pending:
            self.report(call, "`DataLoader` without `pin_memory` in a script that copies batches to the GPU: "
                              "pageable copies are slower and block; pass `pin_memory=torch.cuda.is_available()` "
                              "and copy with `non_blocking=True`")


def _is_true(node: cst.BaseExpression) -> bool:
    return isinstance(node, cst.Name) and node.value == "True"


_FROM_HOST = ("torch.from_numpy", "torch.as_tensor", "torch.tensor")


class HostDeviceRoundtrip(Rule):
    """
    ## What it does
    Finds tensors that a loop body moves to the host with `.cpu()` and back to the device
    with `.cuda()` / `.to(device)`: chained (`x.cpu().cuda()`, also through `.numpy()` and
    `torch.from_numpy`) or through a name (`y = x.cpu()` ... `y.to(device)`).

    ## Why is this bad?
    Each iteration pays two copies over PCIe and two device synchronizations for data that
    could have stayed on the GPU.

    ## Example
    ```python
    for x, y in loader:
        out = model(x.to(device))
        probs = out.softmax(1).cpu()
        loss = criterion(probs.to(device), y.to(device))
    ```

    ## Use instead
    ```python
    for x, y in loader:
        out = model(x.to(device))
        probs = out.softmax(1)
        loss = criterion(probs, y.to(device))
        probs_host = probs.detach().cpu()  # only where the host really needs it
    ```
    Only moves within one loop body, in source order, are paired; a name rebound in
    between breaks the pair. Modules (`model = model.cpu()` to save a checkpoint, then
    back) are not flagged.
    """

    code = "GM603"
    name = "host-device-roundtrip"
    message = "tensor moved to the host and back to the device inside a loop"
    reported_in = frozenset({"device"})
    triggers = ("cpu",)
    examples = (
        Flagged("for x in loader:\n    y = model(x).cpu()\n    z = y.cuda()\n"),
        Flagged("import torch\nwhile True:\n    h = torch.from_numpy(h.cpu().numpy()).to(device)\n"),
        Flagged("for x in loader:\n    x = x.cpu()\n    stats.update(x)\n    x = x.to(device)\n"),
        Clean("for x in loader:\n    y = model(x)\n    preds.append(y.cpu())\n    z = x.cuda()\n"),
        Clean("y = x.cpu()\nfor i in range(3):\n    z = y.cuda()\n"),
        Clean("for x in loader:\n    y = x.cpu()\n    y = augment(x)\n    y = y.cuda()\n"),
        Clean("for epoch in range(10):\n    model = model.cpu()\n    save(model)\n    model = model.cuda()\n"),
        Clean("for x in loader:\n    y = x.cpu().to(torch.float64)\n    z = y.numpy()\n"),
        Clean("y = x.cpu().cuda()\n"),
    )

    def visit_Module(self, node: cst.Module) -> None:
        # statement (or compound header) -> names holding a host copy when it runs, in loops only
        self.host_at: Dict[int, Dict[str, cst.Call]] = {}

    def _loop(self, node: Union[cst.For, cst.While]) -> None:
        if _loop_of(self.ctx.ancestors) is not None:
            return  # the outermost loop's scan covers nested ones
        host: Dict[str, cst.Call] = {}
        if isinstance(node, cst.For):
            self._unbind(node.target, host)
        self._suite(node.body, host)

    visit_For = visit_While = _loop

    def _suite(self, suite: cst.BaseSuite, host: Dict[str, cst.Call]) -> None:
        for stmt in suite.body:
            self._statement(stmt, host)

    def _statement(self, stmt: cst.CSTNode, host: Dict[str, cst.Call]) -> None:
        """Follow the statements in source order; branches are read one after the other."""
        self.host_at[id(stmt)] = dict(host)
        if isinstance(stmt, cst.SimpleStatementLine):
            for small in stmt.body:
                self._statement(small, host)
        elif isinstance(stmt, (cst.Assign, cst.AnnAssign)) and stmt.value is not None:
            targets = [t.target for t in stmt.targets] if isinstance(stmt, cst.Assign) else [stmt.target]
            moved = self._chain(stmt.value)[0]
            for target in targets:
                self._unbind(target, host)
                if moved is not None and isinstance(target, cst.Name) and not self._module(target.value):
                    host[target.value] = moved
        elif isinstance(stmt, cst.Del):
            self._unbind(stmt.target, host)
        elif isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
            host.pop(stmt.name.value, None)
        elif isinstance(stmt, cst.BaseCompoundStatement):
            if isinstance(stmt, cst.For):
                self._unbind(stmt.target, host)
            for item in getattr(stmt, "items", ()):  # with ... as x
                if item.asname is not None:
                    self._unbind(item.asname.name, host)
            if isinstance(getattr(stmt, "body", None), cst.BaseSuite):
                self._suite(stmt.body, host)
            for case in getattr(stmt, "cases", ()):
                self._suite(case.body, host)
            orelse = getattr(stmt, "orelse", None)
            if isinstance(orelse, cst.If):
                self._statement(orelse, host)
            elif orelse is not None:
                self._suite(orelse.body, host)
            for handler in getattr(stmt, "handlers", ()):
                self._suite(handler.body, host)
            if getattr(stmt, "finalbody", None) is not None:
                self._suite(stmt.finalbody.body, host)

    def _unbind(self, target: cst.CSTNode, host: Dict[str, cst.Call]) -> None:
        for name in _target_names(target):
            host.pop(name, None)

    def _chain(self, expr: cst.BaseExpression) -> Tuple[Optional[cst.Call], Optional[str]]:
        """The first host move (`.cpu()`) down `expr`'s receiver chain, and the chain's root name."""
        moved, node = None, expr
        while True:
            if isinstance(node, cst.Call):
                if moved is None and _moves_to(node, self.qualify, "cpu"):
                    moved = node
                if self.qualify(node.func) in _FROM_HOST and node.args:
                    node = node.args[0].value
                elif isinstance(node.func, cst.Attribute):
                    node = node.func.value
                else:
                    return moved, None
            elif isinstance(node, (cst.Attribute, cst.Subscript)):
                node = node.value
            else:
                return moved, node.value if isinstance(node, cst.Name) else None

    def _module(self, name: str) -> bool:
        if _module_like_name(name):
            return True
        analysis = kinds(self.ctx)
        return analysis.of_name(name, analysis.scope_at(self.ctx.ancestors)) == MODULE

    def visit_Call(self, node: cst.Call) -> None:
        if not _moves_to(node, self.qualify, "gpu") or _loop_of(self.ctx.ancestors) is None:
            return
        moved, root = self._chain(node.func.value)
        if root is not None and self._module(root):
            return
        if moved is not None:
            self.report(node, "`.cpu()` then back to the device: every iteration copies this tensor to the host "
                              "and back; keep it on the device (`.detach()`/`.clone()` if you need a copy)")
            return
        host = next((self.host_at[id(a)] for a in reversed(self.ctx.ancestors) if id(a) in self.host_at), {})
        if root in host:
            line = self.ctx.position(host[root])[0]
            self.report(node, f"`{root}` was moved to the host with `.cpu()` on line {line} and comes back to "
                              f"the device here, every iteration; keep it on the device and copy to the host "
                              f"only what the host needs")


LINT_ONLY_RULES = (DiscardedMove, DataAttribute, EmptyCacheInLoop, OomRetryLeak, LoaderNoWorkers,
                   LoaderNoPinMemory, HostDeviceRoundtrip)
