"""What an expression holds: a tensor, a 0-dim loss, a module, an optimizer, a loader...

Kinds come from evidence only: a call of a known torch API, a class of this file, a
binding whose value has a kind, or, for a parameter of a function of this file, the
arguments of every call that reaches it. A name whose evidence disagrees, or that nothing
says anything about, is UNKNOWN, and rules that need a kind leave it alone (or report).
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Optional, Set, Tuple

import libcst as cst

from gpumigrate.analysis.structure import NEVER, Binding, Class, Function, Scope, Structure, dotted

# The kinds.
TENSOR = "tensor"            # a tensor of unknown shape
PARAM = "parameter"          # a module's parameter (nn.Parameter, model.fc.weight)
LOSS = "loss"                # a 0-dim tensor in the autograd graph: a criterion's result
SCALAR = "scalar"            # a 0-dim tensor: a full reduction (`x.sum()`, `(p == y).sum()`)
NUMBER = "number"            # a Python number
STRING = "string"
MODULE = "module"            # an nn.Module that is not a loss
LOSS_MODULE = "loss module"  # nn.CrossEntropyLoss(), a Loss class of this file
OPTIMIZER = "optimizer"
OPTIMIZER_CLASS = "optimizer class"  # getattr(torch.optim, name)
SCHEDULER = "scheduler"
SCALER = "grad scaler"       # torch.amp.GradScaler(): `scaler.step(opt)` steps `opt`, it is no optimizer
PARAMS = "parameters"        # model.parameters(), list(...) of them
LOADER = "loader"
DATASET = "dataset"
ITERATOR = "iterator"        # iter(loader)
BATCH = "batch"              # one item of a loader
METRIC = "metric object"     # an object that accumulates a metric (AverageMeter, Score)
WRITER = "writer"            # a file opened for writing, csv writer, logger, SummaryWriter
DEVICE = "device"
OBJECT = "object"            # an instance of a class we know nothing about
FUNCTION = "function"
CLASS = "class"
PYMODULE = "python module"
UNKNOWN = "unknown"
NEUTRAL = "neutral"          # a cycle: says nothing either way

ZERO_DIM = frozenset({LOSS, SCALAR})
TENSORS = frozenset({TENSOR, PARAM, LOSS, SCALAR})
MODULES = frozenset({MODULE, LOSS_MODULE})

DATALOADER = ("torch.utils.data.DataLoader", "torch.utils.data.dataloader.DataLoader")
VARIABLE = ("torch.autograd.Variable", "torch.autograd.variable.Variable")
FUNCTIONAL_LOSSES = frozenset({
    "cross_entropy", "nll_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits",
    "kl_div", "l1_loss", "mse_loss", "smooth_l1_loss", "huber_loss", "soft_margin_loss",
    "multi_margin_loss", "multilabel_margin_loss", "multilabel_soft_margin_loss",
    "cosine_embedding_loss", "hinge_embedding_loss", "margin_ranking_loss",
    "triplet_margin_loss", "poisson_nll_loss", "gaussian_nll_loss", "ctc_loss",
})
_TENSOR_NAMESPACES = ("torch.nn.functional.", "torch.linalg.", "torch.fft.", "torch.special.")
# `torch.<lowercase>` functions that do not return tensors (or may return a module).
_NOT_TENSOR_FNS = frozenset({
    "load", "compile", "device", "manual_seed", "no_grad", "enable_grad", "inference_mode",
    "set_grad_enabled", "get_default_dtype", "set_default_dtype", "is_tensor", "is_grad_enabled",
    "save", "set_num_threads", "get_num_threads", "use_deterministic_algorithms", "typename",
    "numel", "is_floating_point", "set_printoptions", "set_default_tensor_type", "initial_seed", "seed",
})
REDUCTIONS = frozenset({"sum", "mean", "norm", "max", "min", "prod", "std", "var", "amax", "amin", "median",
                        "logsumexp", "nansum", "nanmean", "all", "any"})
# Methods that modules and tensors share and that return the same kind of object.
KIND_KEEPING = frozenset({"to", "cuda", "cpu", "float", "half", "double", "bfloat16", "type",
                          "requires_grad_", "share_memory", "train", "eval", "contiguous", "clone", "squeeze"})
# Methods only tensors have: calling one says the receiver is a tensor.
TENSOR_ONLY = frozenset({"view", "view_as", "permute", "unsqueeze", "detach", "expand", "expand_as",
                         "long", "softmax", "log_softmax", "sigmoid", "masked_fill", "index_select",
                         "narrow", "pin_memory", "argmax", "argmin", "eq", "ne", "gt", "lt", "topk",
                         "reshape", "flatten", "transpose", "t", "abs", "exp", "log", "pow", "sqrt", "tanh"})
NOT_TENSOR_RESULT = frozenset({"item", "tolist", "numpy", "size", "dim", "numel", "data_ptr",
                               "element_size", "get_device", "is_contiguous", "parameters",
                               "named_parameters", "state_dict", "modules", "children", "backward",
                               "zero_", "nelement", "stride", "storage"})
_WRITE_MODES = frozenset("wax")
_METRIC_NAME = ("meter", "metric", "score", "accuracy", "average", "confusion", "evaluator", "stats", "counter")
_METRIC_METHODS = frozenset({"update", "add", "accumulate"})
WRITER_CALLS = frozenset({"csv.writer", "csv.DictWriter", "logging.getLogger", "logging.FileHandler",
                          "visdom.Visdom", "wandb.init"})


def is_tensor_fn(qualified: str) -> bool:
    if qualified.startswith(_TENSOR_NAMESPACES):
        return qualified.rsplit(".", 1)[1][:1].islower()
    if qualified in VARIABLE:
        return True
    parts = qualified.split(".")
    if parts[0] != "torch":
        return False
    if len(parts) == 2:
        name = parts[1]
        return name.endswith("Tensor") or (name[:1].islower() and name not in _NOT_TENSOR_FNS)
    return len(parts) == 3 and parts[1] == "cuda" and parts[2].endswith("Tensor")


def merge(kinds: Iterable[str]) -> str:
    found = {k for k in kinds if k != NEUTRAL}
    if not found:
        return NEUTRAL
    if len(found) == 1:
        return found.pop()
    if found <= TENSORS:
        if found <= ZERO_DIM:
            return LOSS if found == {LOSS} else SCALAR
        return PARAM if found == {PARAM} else TENSOR
    if found <= MODULES:
        return MODULE
    if found <= {NUMBER, STRING}:
        return UNKNOWN
    return UNKNOWN


def arithmetic(a: str, b: str) -> str:
    """The kind of `a + b` (or `*`, `/`, `-`)."""
    pair = {a, b}
    if NEUTRAL in pair:
        other = pair - {NEUTRAL}
        return other.pop() if other else NEUTRAL
    if LOSS in pair and pair <= {LOSS, SCALAR, NUMBER}:
        return LOSS
    if SCALAR in pair and pair <= {SCALAR, NUMBER}:
        return SCALAR
    if pair == {NUMBER}:
        return NUMBER
    if pair & {TENSOR, PARAM} and pair <= TENSORS | {NUMBER}:
        return TENSOR
    if pair == {STRING}:
        return STRING
    return UNKNOWN


def _dim_given(call: cst.Call) -> bool:
    return any(a.keyword is None or a.keyword.value in ("dim", "axis") for a in call.args if not a.star) \
        or any(a.star for a in call.args)


def opens_for_writing(call: cst.Call) -> bool:
    """`open(path, "w")`, `open(path, mode="a")`: a file this process writes."""
    mode = None
    for i, arg in enumerate(call.args):
        if (arg.keyword is None and i == 1) or (arg.keyword is not None and arg.keyword.value == "mode"):
            mode = arg.value
    if isinstance(mode, cst.SimpleString):
        value = mode.evaluated_value
        return isinstance(value, str) and bool(set(value) & _WRITE_MODES)
    return False


class Values:
    """Kinds of expressions, names and parameters in one file (lazy, memoised)."""

    def __init__(self, structure: Structure, qualify) -> None:
        self.s = structure
        self.qualify = qualify  # import-table qualification: nn.Linear -> torch.nn.Linear
        self._memo: Dict[Tuple[int, float], str] = {}
        self._busy: Set[Tuple[int, float]] = set()
        self._class_kinds: Dict[int, str] = {}
        self._unpacking: Set[Tuple[int, Tuple[int, ...]]] = set()  # unpacked() queries under way

    # -- entry points --------------------------------------------------------------------
    def of(self, expr: cst.BaseExpression, at: Optional[float] = None) -> str:
        """What `expr` holds where it stands (or, with `at`, at that position)."""
        scope = self.s.scope(expr)
        if at is None:
            stmt = self.s.statement(expr)
            at = self.s.order(stmt) if stmt is not None else NEVER
        kind = self.expr(expr, scope, at)
        return UNKNOWN if kind == NEUTRAL else kind

    def name(self, name: str, scope: Scope, at: float = NEVER) -> str:
        kind = self._name(name, scope, at)
        return UNKNOWN if kind == NEUTRAL else kind

    def bindings_kind(self, bindings: List[Binding]) -> str:
        return merge(self.binding(b) for b in bindings) if bindings else UNKNOWN

    # -- expressions ---------------------------------------------------------------------
    def expr(self, expr: cst.BaseExpression, scope: Scope, at: float) -> str:
        return self._memoised((id(expr), at), lambda: self._expr(expr, scope, at))

    def _memoised(self, key: Tuple[int, float], compute: Callable[[], str]) -> str:
        # A value that depends on itself (a loop-carried `x = x + ...`) reads as NEUTRAL
        # while it is being computed, so cycles end.
        if key in self._memo:
            return self._memo[key]
        if key in self._busy:
            return NEUTRAL
        self._busy.add(key)
        try:
            kind = compute()
        finally:
            self._busy.discard(key)
        self._memo[key] = kind
        return kind

    def _expr(self, expr: cst.BaseExpression, scope: Scope, at: float) -> str:
        if isinstance(expr, cst.Name):
            if expr.value in ("True", "False"):
                return NUMBER
            if expr.value == "None":
                return UNKNOWN
            return self._name(expr.value, scope, at)
        if isinstance(expr, (cst.Integer, cst.Float)):
            return NUMBER
        if isinstance(expr, (cst.SimpleString, cst.FormattedString, cst.ConcatenatedString)):
            return STRING
        if isinstance(expr, cst.Lambda):
            return FUNCTION
        if isinstance(expr, cst.Call):
            return self._call(expr, scope, at)
        if isinstance(expr, cst.Attribute):
            return self._attribute(expr, scope, at)
        if isinstance(expr, cst.Subscript):
            base = self.expr(expr.value, scope, at)
            if base in (TENSOR, PARAM, BATCH) or any(isinstance(e.slice, cst.Slice) for e in expr.slice) \
                    and base not in (UNKNOWN, NEUTRAL, STRING, OBJECT):
                return TENSOR
            if base in ZERO_DIM:
                return SCALAR
            return UNKNOWN
        if isinstance(expr, cst.BinaryOperation):
            if isinstance(expr.operator, (cst.Add, cst.Subtract, cst.Multiply, cst.Divide, cst.FloorDivide,
                                          cst.Power, cst.Modulo, cst.MatrixMultiply)):
                left, right = self.expr(expr.left, scope, at), self.expr(expr.right, scope, at)
                if isinstance(expr.operator, cst.Modulo) and left == STRING:
                    return STRING
                return arithmetic(left, right)
            return UNKNOWN
        if isinstance(expr, cst.UnaryOperation):
            if isinstance(expr.operator, cst.Not):
                return UNKNOWN
            return self.expr(expr.expression, scope, at)
        if isinstance(expr, cst.Comparison):
            sides = [self.expr(expr.left, scope, at)] + [self.expr(c.comparator, scope, at) for c in expr.comparisons]
            return TENSOR if any(s in TENSORS for s in sides) else UNKNOWN
        if isinstance(expr, cst.IfExp):
            return merge([self.expr(expr.body, scope, at), self.expr(expr.orelse, scope, at)])
        return UNKNOWN

    def _attribute(self, expr: cst.Attribute, scope: Scope, at: float) -> str:
        attr = expr.attr.value
        if isinstance(expr.value, cst.Name) and expr.value.value == "self":
            cls = self.s.instance_class(expr.value, scope)
            if cls is not None and attr in cls.attrs:
                return merge(self.binding(b) for b in cls.attrs[attr])
        qualified = self.qualify(expr)
        if qualified is not None:
            return PYMODULE if qualified.count(".") == 0 else UNKNOWN
        base = self.expr(expr.value, scope, at)
        if attr == "data":
            return SCALAR if base == LOSS else base if base in TENSORS else UNKNOWN
        if attr == "grad":
            return TENSOR if base in (PARAM, TENSOR) else UNKNOWN
        if attr in ("weight", "bias") and base in MODULES | {UNKNOWN, NEUTRAL}:
            return PARAM if base != UNKNOWN else UNKNOWN
        if attr == "T" and base in TENSORS:
            return TENSOR
        if attr == "dataset" and base == LOADER:
            return DATASET
        if attr == "module" and base == MODULE:
            return MODULE
        if base == MODULE and attr not in ("training",):
            return UNKNOWN  # a submodule or a plain attribute: cannot tell
        return UNKNOWN

    def _call(self, call: cst.Call, scope: Scope, at: float) -> str:
        func = call.func
        qualified = self.qualify(func)
        if qualified:
            return self._qualified_call(qualified, call, scope, at)
        if isinstance(func, cst.Name):
            name = func.value
            if name == "open":
                return WRITER if opens_for_writing(call) else UNKNOWN
            if name in ("len", "int", "float", "round", "abs", "bool"):
                return NUMBER
            if name in ("str", "repr", "format"):
                return STRING
            if name == "iter" and call.args:
                inner = self.expr(call.args[0].value, scope, at)
                return ITERATOR if inner in (LOADER, NEUTRAL) else UNKNOWN
            if name == "next" and call.args:
                inner = self.expr(call.args[0].value, scope, at)
                return BATCH if inner == ITERATOR else UNKNOWN
            if name in ("list", "tuple", "filter", "chain", "sorted") and call.args:
                inner = self.expr(call.args[-1].value, scope, at)
                return PARAMS if inner == PARAMS else UNKNOWN
            if name == "getattr" and len(call.args) >= 2:
                holder = self.qualify(call.args[0].value) or ""
                return OPTIMIZER_CLASS if holder in ("torch.optim", "optim") or holder.startswith("torch.optim.") \
                    and not holder.startswith("torch.optim.lr_scheduler") else UNKNOWN
        if isinstance(func, cst.Call) and self.expr(func, scope, at) == OPTIMIZER_CLASS:
            return OPTIMIZER  # getattr(torch.optim, name)(params)
        callee = self.s.callee(call)
        if callee is not None:
            if callee.name == "__init__" and callee.cls is not None:
                return self.class_kind(callee.cls)
            return merge(self.expr(r, callee.scope, NEVER) for r in callee.returns) if callee.returns else UNKNOWN
        if isinstance(func, cst.Name):
            _, bindings = self.s.lookup(func.value, scope, at)
            for b in bindings:
                if b.how == "class":
                    return self.class_kind(self.s.classes[id(b.value)])
            kind = self._name(func.value, scope, at)
            if kind == OPTIMIZER_CLASS:
                return OPTIMIZER
            if kind in (MODULE, OBJECT):
                return TENSOR  # a module's output (an instance of a class from elsewhere: most often one)
            if kind == LOSS_MODULE:
                return LOSS
            if func.value[:1].isupper() and kind in (UNKNOWN, PYMODULE):
                return OBJECT
            return UNKNOWN
        if isinstance(func, cst.Attribute):
            return self._method(call, func, scope, at)
        return UNKNOWN

    def _qualified_call(self, qualified: str, call: cst.Call, scope: Scope, at: float) -> str:
        last = qualified.rsplit(".", 1)[-1]
        if qualified in VARIABLE:
            return self.expr(call.args[0].value, scope, at) if call.args else TENSOR
        if qualified.startswith("torch.nn.functional."):
            return LOSS if last in FUNCTIONAL_LOSSES else TENSOR
        if qualified in ("torch.nn.Parameter", "torch.nn.parameter.Parameter"):
            return PARAM
        if qualified.startswith("torch.nn.") and last[:1].isupper():
            if last.endswith("Loss"):
                return LOSS_MODULE
            return MODULE if not qualified.startswith("torch.nn.utils") else UNKNOWN
        if qualified.startswith("torchvision.models.") and last[:1].islower():
            return MODULE
        if qualified.startswith("torch.optim.lr_scheduler."):
            return SCHEDULER
        if last in ("GradScaler", "ShardedGradScaler") and qualified.startswith("torch.") or \
                qualified.endswith(".grad_scaler") and qualified.startswith(("gpumigrate", "gpumigrate_runtime")):
            return SCALER
        if qualified.startswith("torch.optim.") and last[:1].isupper():
            return OPTIMIZER
        if qualified in DATALOADER:
            return LOADER
        if qualified.startswith(("torch.utils.data.", "torchvision.datasets.")) and (
                last.endswith("Dataset") or last in ("Subset", "ConcatDataset", "TensorDataset")
                or qualified.startswith("torchvision.datasets.")):
            return DATASET
        if qualified == "torch.device" or qualified.endswith((".get_device", ".setup_distributed")) \
                and qualified.startswith(("gpumigrate.", "torch.device")):
            return DEVICE
        if qualified in ("torch.sum", "torch.mean", "torch.norm", "torch.max", "torch.min", "torch.prod") \
                and len([a for a in call.args if a.keyword is None]) == 1 \
                and not any(a.keyword is not None and a.keyword.value == "dim" for a in call.args):
            inner = self.expr(call.args[0].value, scope, at) if call.args else TENSOR
            return LOSS if inner == LOSS else SCALAR
        if qualified in ("torch.stack", "torch.cat"):
            return TENSOR
        if qualified in WRITER_CALLS or last == "SummaryWriter":
            return WRITER
        if is_tensor_fn(qualified):
            return TENSOR
        if qualified.startswith(("time.", "random.", "math.")) and last not in ("sleep", "seed", "shuffle"):
            return NUMBER
        return OBJECT if last[:1].isupper() else UNKNOWN

    def _method(self, call: cst.Call, func: cst.Attribute, scope: Scope, at: float) -> str:
        method = func.attr.value
        callee = self.s.callee(call)
        if callee is not None:
            return merge(self.expr(r, callee.scope, NEVER) for r in callee.returns) if callee.returns else UNKNOWN
        receiver = self.expr(func.value, scope, at)
        if method in ("parameters", "named_parameters") and receiver in MODULES | {UNKNOWN, NEUTRAL, OBJECT}:
            return PARAMS
        if method == "item":
            return NUMBER
        if method == "next" and not call.args and receiver == ITERATOR:
            return BATCH
        if method in REDUCTIONS and not _dim_given(call) and receiver in TENSORS | {BATCH}:
            return LOSS if receiver == LOSS and method in ("sum", "mean") else SCALAR
        if method == "detach" and receiver in ZERO_DIM:
            return SCALAR
        if method in KIND_KEEPING:
            if receiver == LOSS and method in ("to", "cuda", "cpu", "float", "double", "half", "squeeze", "clone"):
                return LOSS
            return receiver if receiver != NEUTRAL else NEUTRAL
        if method in ("size", "dim", "numel", "nelement"):
            return NUMBER if method != "size" or call.args else UNKNOWN
        if method in TENSOR_ONLY:
            return TENSOR
        if receiver in (TENSOR, PARAM, SCALAR, LOSS) and method not in NOT_TENSOR_RESULT:
            return TENSOR
        if receiver == MODULE and method == "forward":
            return TENSOR
        if receiver == LOSS_MODULE and method == "forward":
            return LOSS
        if receiver == OPTIMIZER_CLASS:
            return UNKNOWN
        return UNKNOWN

    # -- names and bindings -------------------------------------------------------------
    def _name(self, name: str, scope: Scope, at: float) -> str:
        _, bindings = self.s.lookup(name, scope, at)
        if not bindings:
            return UNKNOWN
        if bindings[-1].how == "aug":
            return self._accumulated(bindings)
        return merge(self.binding(b) for b in bindings)

    def _accumulated(self, chain: List[Binding]) -> str:
        """`total = 0` then `total += x`: the kind after the chain."""
        if not chain:
            return UNKNOWN
        first, *rest = chain
        kind = self.binding(first) if first.how != "aug" else UNKNOWN
        for b in ([first] if first.how == "aug" else []) + rest:
            kind = arithmetic(kind, self.expr(b.value, b.scope, b.order))
        return kind

    def binding(self, b: Binding) -> str:
        return self._memoised((id(b), -1.0), lambda: self._binding(b))

    def _binding(self, b: Binding) -> str:
        at = b.order + 0.5
        if b.how == "assign":
            return self.expr(b.value, b.scope, b.order)  # the right-hand side sees the old names
        if b.how == "unpack":
            return self.unpacked(b.value, b.path, b.scope, b.order)
        if b.how == "loop":
            return self.loop_item(b.value, b.path, b.scope, b.order)
        if b.how == "aug":
            _, chain = self.s.lookup(b.name, b.scope, at)
            return self._accumulated(chain)
        if b.how == "param":
            return self.param(b)
        if b.how == "import":
            return PYMODULE
        if b.how == "def":
            return FUNCTION
        if b.how == "class":
            return CLASS
        if b.how == "with" and isinstance(b.value, cst.Call):
            return self.expr(b.value, b.scope, b.order)
        return UNKNOWN

    def param(self, b: Binding) -> str:
        """A parameter's kind: what every same-file call passes for it (and its default)."""
        fn = self.s.functions.get(id(b.scope.node))
        if fn is None:
            return UNKNOWN
        name = b.name
        if name == "self" and fn.cls is not None:
            return self.class_kind(fn.cls)
        position = fn.position(name)
        kinds = []
        param = b.value
        if isinstance(param, cst.Param) and param.default is not None:
            kinds.append(self.expr(param.default, self.s.scope(fn.node), NEVER))
        for call in fn.callers:
            arg = _argument(call, name, position)
            if arg is None:
                continue
            caller_scope = self.s.scope(call)
            stmt = self.s.statement(call)
            kinds.append(self.expr(arg, caller_scope, self.s.order(stmt) if stmt is not None else NEVER))
        return merge(kinds) if kinds else UNKNOWN

    def unpacked(self, value: cst.BaseExpression, path: Tuple[int, ...], scope: Scope, at: float) -> str:
        if not path:
            return self.expr(value, scope, at)
        # a recursive function returning its own call (`return f(x - 1)`): no new fact
        key = (id(value), path)
        if key in self._unpacking:
            return NEUTRAL  # the other returns decide
        self._unpacking.add(key)
        try:
            return self._unpacked(value, path, scope, at)
        finally:
            self._unpacking.discard(key)

    def _unpacked(self, value: cst.BaseExpression, path: Tuple[int, ...], scope: Scope, at: float) -> str:
        if isinstance(value, (cst.Tuple, cst.List)):
            if path[0] < len(value.elements) and not any(isinstance(e, cst.StarredElement) for e in value.elements):
                return self.unpacked(value.elements[path[0]].value, path[1:], scope, at)
            return UNKNOWN
        if isinstance(value, cst.Call):
            callee = self.s.callee(value) or self._forward(value, scope)
            if callee is not None and callee.returns:
                return merge(self.unpacked(r, path, callee.scope, NEVER) for r in callee.returns)
            qualified = self.qualify(value.func) or ""
            if qualified.endswith("random_split"):
                return DATASET
            if qualified == "apex.amp.initialize":  # returns the models and optimizers it was given
                given = [a.value for a in value.args if a.keyword is None][:2]
                given += [a.value for a in value.args if a.keyword is not None and a.keyword.value in
                          ("models", "optimizers")][: 2 - len(given)]
                return self.unpacked(given[path[0]], path[1:], scope, at) if path[0] < len(given) else UNKNOWN
            if isinstance(value.func, cst.Attribute) and value.func.attr.value in ("max", "min", "topk", "sort"):
                return TENSOR
        if isinstance(value, cst.Name):
            _, bindings = self.s.lookup(value.value, scope, at)
            if len(bindings) == 1 and bindings[0].how == "assign":
                b = bindings[0]
                return self.unpacked(b.value, path, b.scope, b.order)
        kind = self.expr(value, scope, at)
        return TENSOR if kind in (TENSOR, BATCH) else UNKNOWN  # `inputs, labels = data`

    def loop_item(self, it: cst.BaseExpression, path: Tuple[int, ...], scope: Scope, at: float) -> str:
        while isinstance(it, cst.Call) and it.args and not it.args[0].star:
            name = it.func.value if isinstance(it.func, cst.Name) else \
                it.func.attr.value if isinstance(it.func, cst.Attribute) else None
            if name in ("tqdm", "trange", "iter") or (name == "filter" and len(it.args) == 2):
                it = it.args[-1].value if name == "filter" else it.args[0].value
            elif name == "enumerate":
                if not path or path[0] == 0:
                    return NUMBER if path else UNKNOWN
                path, it = path[1:], it.args[0].value
            elif name == "zip":
                if not path or path[0] >= len(it.args):
                    return UNKNOWN
                path, it = path[1:], it.args[path[0]].value
            elif name == "range":
                return NUMBER
            else:
                break
        if isinstance(it, cst.Call) and isinstance(it.func, cst.Attribute):
            if it.func.attr.value == "parameters":
                return PARAM if not path else UNKNOWN
            if it.func.attr.value == "named_parameters":
                return PARAM if path == (1,) else UNKNOWN
        if isinstance(it, cst.Subscript) and len(it.slice) == 1 and isinstance(it.slice[0].slice, cst.Index) \
                and isinstance(it.slice[0].slice.value, cst.SimpleString) \
                and it.slice[0].slice.value.evaluated_value == "params":
            return PARAM if not path else UNKNOWN  # `for p in group['params']`
        kind = self.expr(it, scope, at)
        named = (dotted(it) or "").rsplit(".", 1)[-1].lower()
        if kind in (LOADER, ITERATOR) or (kind in (UNKNOWN, NEUTRAL) and "loader" in named):
            return TENSOR if path else BATCH
        if kind == PARAMS:
            return PARAM if not path else UNKNOWN
        return UNKNOWN

    def _forward(self, call: cst.Call, scope: Scope) -> Optional[Function]:
        """`criterion(out, y)` on an instance of a module class of this file: its `forward`."""
        cls = self.s.instance_class(call.func, scope) if isinstance(call.func, cst.Name) else None
        if cls is None or self.class_kind(cls) not in MODULES:
            return None
        return self.s.method(cls, "forward")

    # -- classes -------------------------------------------------------------------------
    def class_kind(self, cls: Class) -> str:
        """An instance of a class of this file: a module (nn.Module below it), a loss module,
        a dataset, a metric object, or an object."""
        if id(cls.node) in self._class_kinds:
            return self._class_kinds[id(cls.node)]
        self._class_kinds[id(cls.node)] = OBJECT  # a cycle in the bases
        kind = OBJECT
        for base in cls.bases:
            qualified = self.qualify(base) or ""
            if isinstance(base, cst.Name) and base.value in self.s.classes_by_name:
                inherited = self.class_kind(self.s.classes_by_name[base.value])
                if inherited != OBJECT:
                    kind = inherited
                    break
            elif qualified in ("torch.nn.Module", "torch.nn.modules.module.Module") or \
                    (qualified.startswith("torch.nn.") and qualified[len("torch.nn."):][:1].isupper()):
                kind = LOSS_MODULE if qualified.endswith("Loss") else MODULE
                break
            elif qualified.startswith("torch.utils.data.") and qualified.endswith("Dataset"):
                kind = DATASET
                break
        lowered = cls.name.lower()
        if kind == MODULE and ("loss" in lowered or "criterion" in lowered):
            kind = LOSS_MODULE
        elif kind == OBJECT and (any(word in lowered for word in _METRIC_NAME)
                                 or set(cls.methods) & _METRIC_METHODS and _accumulates(cls)):
            kind = METRIC
        self._class_kinds[id(cls.node)] = kind
        return kind


def _accumulates(cls: Class) -> bool:
    """A method adds into an attribute of the object: `self.correct += ...`."""
    return any(b.how == "aug" for bindings in cls.attrs.values() for b in bindings)


def _argument(call: cst.Call, name: str, position: int) -> Optional[cst.BaseExpression]:
    for arg in call.args:
        if arg.keyword is not None and arg.keyword.value == name:
            return arg.value
    index = 0
    for arg in call.args:
        if arg.star == "*":
            return None  # the positions after *args are unknown
        if arg.keyword is not None or arg.star:
            continue
        if index == position:
            return arg.value
        index += 1
    return None


def call_argument(call: cst.Call, name: str, position: int) -> Optional[cst.BaseExpression]:
    """The expression passed for a parameter, by keyword or position (None under *args)."""
    return _argument(call, name, position)
