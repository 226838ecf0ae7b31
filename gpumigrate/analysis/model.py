"""What gpumigrate believes about one script: the one file to read to learn it.

`script_model(ctx)` builds it once per file, lazily (each fact on first use), and every rule
reads it, so lint's findings and the migrations' edits rest on the same facts:

- what each name holds (`kind`): tensor, 0-dim loss or scalar, module, loss module,
  optimizer, loader, dataset, metric object, writer, device... (see values.py);
- which code trains: reaches `.backward()` or `optimizer.step()`, directly or through calls
  to functions of this file (`trains`, `training_functions`);
- which models each optimizer trains (`optimizers`, `trained_models`), through factories,
  `getattr(torch.optim, name)`, parameter groups, `list(a.parameters()) + ...`;
- which loaders train and which evaluate (`loaders`), from how each is consumed: `for`,
  `enumerate`, `zip`, `tqdm`, `iter`/`next`, through loader factories and flags;
- which statements write outputs (`output_call`);
- which values differ per process (`per_process`), which are rank-local (`rank_local`), and
  which conditions depend on them (`rank_local_test`).

Facts are proven from the code or left unknown; a rule that needs an unknown fact takes the
safe form and reports. Nothing here edits or prints.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Dict, List, Optional, Set, Tuple

import libcst as cst

from gpumigrate.analysis import values as v
from gpumigrate.analysis.structure import NEVER, Binding, Function, Scope, Structure, dotted
from gpumigrate.analysis.syntax import RUNTIME_MODULES, last_name, runtime_helper
from gpumigrate.analysis.values import Values, call_argument

_RANK_QUERIES = frozenset({"torch.distributed.get_rank", "torch.distributed.get_world_size",
                           *(f"{module}.{name}" for module in RUNTIME_MODULES
                             for name in ("get_rank", "is_main_process", "get_world_size"))})
_RANK_NAMES = re.compile(r"(^|\.|_)(local_rank|rank|gpu_id|is_master|is_main|main_process|master)$")
PER_PROCESS_CALLS = frozenset({
    "time.time", "time.strftime", "time.asctime", "time.ctime", "time.localtime", "time.gmtime",
    "time.perf_counter", "time.monotonic", "time.time_ns", "datetime.datetime.now", "datetime.datetime.today",
    "datetime.datetime.utcnow", "datetime.date.today", "uuid.uuid1", "uuid.uuid4", "socket.gethostname",
    "os.getpid", "tempfile.mkdtemp", "tempfile.mktemp", "random.random", "random.randint", "random.randrange",
    "random.choice", "random.uniform", "random.getrandbits", "secrets.token_hex", "numpy.random.randint",
    "numpy.random.rand",
})
COLLECTIVES = frozenset({"barrier", "all_reduce", "all_gather", "all_gather_object", "broadcast",
                         "broadcast_object_list", "reduce", "gather", "scatter", "all_to_all", "reduce_scatter",
                         "monitored_barrier", "gather_object", "scatter_object_list"})
RUNTIME_COLLECTIVES = frozenset({"barrier", "reduce_sum", "reduce_mean", "broadcast_object"})
_LOG_METHODS = frozenset({"debug", "info", "warning", "warn", "error", "critical", "exception", "log"})
_WRITER_METHODS = frozenset({"write", "writerow", "writerows", "writeheader", "flush", "close", "writelines",
                             "add_scalar", "add_scalars", "add_image", "add_images", "add_histogram",
                             "add_text", "add_graph", "add_figure", "add_hparams", "add_embedding",
                             "line", "image", "images", "text", "scatter", "plot", "log"} | _LOG_METHODS)
SAVE_CALLS = frozenset({"torch.save", "pickle.dump", "json.dump", "numpy.save", "numpy.savez", "numpy.savetxt",
                        "numpy.savez_compressed", "torchvision.utils.save_image", "shutil.copyfile", "shutil.copy",
                        "shutil.copy2", "shutil.move", "shutil.rmtree", "os.makedirs", "os.mkdir", "os.remove",
                        "os.rename", "os.replace", "matplotlib.pyplot.savefig", "scipy.io.savemat",
                        "imageio.imwrite", "cv2.imwrite", "torch.onnx.export", "yaml.dump", "yaml.safe_dump"})
_NO_GRAD = ("torch.no_grad", "torch.inference_mode", "torch.autograd.no_grad", "torch.autograd.grad_mode.no_grad")
_EVAL_NAME = re.compile(r"^(test|evaluate|evaluation|eval|validate|validation|valid|val|predict|inference|infer)"
                        r"(_.*)?$|^(evaluate|validate|predict|infer|test)")
_TRAIN_NAME = re.compile(r"train", re.I)
_MODEL_NAME = re.compile(r"model|net$|^net|encoder|decoder|generator|discriminator|classifier|backbone", re.I)
_BUILTIN_ITERABLES = frozenset({"iter", "range", "enumerate", "zip", "list", "tuple", "sorted", "reversed",
                                "map", "filter", "dict", "set", "open"})
_BARS = frozenset({"tqdm.tqdm", "tqdm.auto.tqdm", "tqdm.notebook.tqdm", "tqdm.trange", "tqdm.auto.trange"})
_EVAL_LOADER_NAME = re.compile(r"(test|val|eval|dev)", re.I)


@dataclass(eq=False)
class Optimizer:
    """An optimizer the script builds. `owners`: dotted names (in `scope`) whose parameters it
    trains, e.g. `model` or `self.net`; `resolved`: every parameter it takes has a known owner
    (False for a functional model, parameter lists we cannot follow, unknown factories)."""

    call: cst.Call  # where it is built (in a factory: the factory's own call)
    site: cst.Call  # the call in the caller that produces it (== call unless built by a factory)
    owners: List[Tuple[Scope, str]] = field(default_factory=list)
    resolved: bool = True
    functional: bool = False


@dataclass(eq=False)
class TrainedModel:
    """A module an optimizer trains, as named where it is bound."""

    name: str  # dotted: `model`, `self.model`
    scope: Scope
    optimizers: List[Optimizer] = field(default_factory=list)
    loss_module: bool = False


@dataclass(eq=False)
class Consumption:
    """A place that takes batches from a loader: a `for` loop (or comprehension) or `next()`."""

    node: cst.CSTNode  # the For / While / next() call
    holder: cst.BaseExpression  # the expression naming the loader or iterator there
    trains: bool
    # one batch drawn outside any loop, not to train (`images, labels = next(iter(loader))` to
    # show a few samples or read shapes): no evaluation, so it gives the loader no role
    peek: bool = False


@dataclass(eq=False)
class Loader:
    """A `DataLoader(...)` call and what the script does with what it returns."""

    call: cst.Call
    # (scope, name, the expression bound there: the DataLoader call or a factory call)
    holders: List[Tuple[Scope, str, cst.CSTNode]] = field(default_factory=list)
    consumers: List[Consumption] = field(default_factory=list)
    roles: Set[str] = field(default_factory=set)  # "train", "eval"
    # a loader factory used for both: the factory parameter that is true for training
    flag: Optional[str] = None
    flag_negated: bool = False

    @property
    def role(self) -> str:
        if self.flag is not None:
            return "flag"
        if self.roles == {"train"}:
            return "train"
        if self.roles == {"eval"}:
            return "eval"
        return "both" if self.roles else "unknown"


def script_model(ctx) -> "ScriptModel":
    return ctx.shared("script-model", ScriptModel, tree=True)


class ScriptModel:
    def __init__(self, ctx) -> None:
        self.ctx = ctx
        self.qualify = ctx.names.qualify

    @cached_property
    def s(self) -> Structure:
        """The file's scopes, bindings and calls (built on the first question that needs them)."""
        return Structure(self.ctx.module, self.ctx.index)

    @cached_property
    def values(self) -> Values:
        return Values(self.s, self.qualify)

    @cached_property
    def devices(self):
        """Where the script builds devices, the flags choosing CUDA, and what hard-codes it."""
        from gpumigrate.analysis.devices import DeviceFacts

        return DeviceFacts(self.ctx.module, self.s.index, self.ctx.names)

    # -- what names hold ----------------------------------------------------------------
    def kind(self, expr: cst.BaseExpression) -> str:
        """What `expr` (a node of the original tree) holds where it stands."""
        return self.values.of(expr)

    def kind_of_name(self, name: str, at: cst.CSTNode) -> str:
        """What `name` holds as seen from the code at `at`."""
        stmt = self.s.statement(at) or at
        return self.values.name(name, self.s.scope(at), self.s.order(stmt))

    def kind_anywhere(self, name: str, at: cst.CSTNode) -> Optional[str]:
        """What `name` may hold anywhere in the scope that binds it (all bindings merged);
        None when nothing says (an unbound name, a parameter no call of this file fills)."""
        bindings = self.s.all_bindings(name, self.s.scope(at))
        if not bindings:
            return None
        kind = self.values.bindings_kind(bindings)
        if kind in (v.UNKNOWN, v.NEUTRAL) and all(b.how == "param" for b in bindings):
            return None
        return v.UNKNOWN if kind == v.NEUTRAL else kind

    def module_like_name(self, name: str, at: cst.CSTNode) -> bool:
        """`module_like` for a name as seen from `at`."""
        kind = self.kind_anywhere(name, at)
        return kind in v.MODULES or (kind in (None, v.UNKNOWN, v.OBJECT) and bool(_MODEL_NAME.search(name)))

    def module_like(self, expr: cst.BaseExpression) -> bool:
        """A model rather than a data tensor: a module by its binding; or, where nothing says
        what it holds, an object named like one (`net`, `model`, `generator`)."""
        kind = self.kind(expr)
        if kind in v.MODULES or (isinstance(expr, cst.Call) and kind == v.OBJECT):
            return True
        if kind in (v.UNKNOWN, v.OBJECT):
            name = (dotted(expr) or "").rsplit(".", 1)[-1]
            return bool(_MODEL_NAME.search(name))
        return False

    def zero_dim(self, expr: cst.BaseExpression) -> bool:
        return self.kind(expr) in v.ZERO_DIM

    def is_loss(self, expr: cst.BaseExpression) -> bool:
        """A 0-dim tensor in the autograd graph: a criterion's result, or what `.backward()`
        is called on (which only works on a 0-dim tensor)."""
        if self.kind(expr) == v.LOSS:
            return True
        if isinstance(expr, cst.Name):
            scope = self.s.scope(expr)
            return expr.value in self.backward_names(scope) or self._summed_into_loss(expr.value, scope)
        return False

    def _summed_into_loss(self, name: str, scope: Scope) -> bool:
        """`name`, bound once in `scope`, is a term of a sum bound to a name `.backward()` is
        called on (`loss = recon + beta * kld`): backward takes one element only, and a sum
        of one element has terms of one element, so `.item()` reads each."""
        _, own = self.s.lookup(name, scope)
        if len(own) != 1 or own[0].how != "assign" or own[0].scope is not scope:
            return False
        for target in self.backward_names(scope):
            _, bindings = self.s.lookup(target, scope)
            for b in bindings:
                if b.how == "assign" and b.scope is scope and isinstance(b.value, cst.BaseExpression) \
                        and name in _sum_terms(b.value):
                    return True
        return False

    # -- checkpoints ----------------------------------------------------------------------
    def loads_pickled(self, call: cst.Call) -> bool:
        """Does this `torch.load` provably read a pickled object (a whole module, or a list or
        dict holding one), which `weights_only=True` (the default since torch 2.6) refuses?
        Its result is used as a module, or it reads the file a module was saved to."""
        parent = self.s.parent(call)
        grand = self.s.parent(parent) if parent is not None else None
        if isinstance(parent, cst.Arg) and isinstance(grand, cst.Call) and isinstance(grand.func, cst.Attribute) \
                and grand.func.attr.value == "load_state_dict":
            return False  # a state dict
        if isinstance(parent, cst.Assign) and parent.value is call:
            for target in parent.targets:
                for name in _names_in(target.target):
                    if self._used_as_module(name, parent):
                        return True
        path = self._file_of(call_argument(call, "f", 0))
        if path is None:
            return False
        for node in self.s.index.of(cst.Call):
            if self.qualify(node.func) == "torch.save" and node.args:
                if self._file_of(call_argument(node, "f", 1)) == path and self._holds_module(node.args[0].value):
                    return True
        return False

    def _used_as_module(self, name: str, assign: cst.Assign) -> bool:
        scope = self.s.scope(assign)
        for node in self.s.index.order[self.s.index.end[id(assign)]:]:
            if not (type(node) is cst.Name and node.value == name and self.s.scope(node) is scope):
                continue
            stmt = self.s.statement(node)
            _, bindings = self.s.lookup(name, scope, self.s.order(stmt) if stmt is not None else NEVER)
            if not any(b.stmt is assign for b in bindings):
                continue
            parent = self.s.parent(node)
            if isinstance(parent, cst.Call) and parent.func is node:
                return True
            if isinstance(parent, cst.Attribute) and parent.value is node and parent.attr.value in _MODULE_METHODS:
                return True
        return False

    def _holds_module(self, expr: cst.BaseExpression) -> bool:
        if self.kind(expr) in v.MODULES or (isinstance(expr, (cst.Name, cst.Attribute)) and self.module_like(expr)):
            return True
        if isinstance(expr, (cst.List, cst.Tuple)):
            return any(self._holds_module(e.value) for e in expr.elements)
        if isinstance(expr, cst.Dict):
            return any(isinstance(e, cst.DictElement) and self._holds_module(e.value) for e in expr.elements)
        return False

    def _file_of(self, expr: Optional[cst.BaseExpression]) -> Optional[str]:
        """The code naming the file behind a path or an open file (`with open(p) as f`)."""
        if expr is None:
            return None
        if isinstance(expr, cst.Name):
            _, bindings = self.s.lookup(expr.value, self.s.scope(expr), self.s.order(self.s.statement(expr)))
            for b in bindings:
                if b.how == "with" and isinstance(b.value, cst.Call) and isinstance(b.value.func, cst.Name) \
                        and b.value.func.value == "open" and b.value.args:
                    return self.ctx.module.code_for_node(b.value.args[0].value)
        return self.ctx.module.code_for_node(expr)

    # -- imports --------------------------------------------------------------------------
    @cached_property
    def uses_torch(self) -> bool:
        return any(q == "torch" or q.startswith(("torch.", *RUNTIME_MODULES))
                   for q in self.ctx.names.local.values())

    @cached_property
    def era_03(self) -> bool:
        """Written for torch 0.3 or older: `Variable`, `volatile`, `.data[0]`."""
        text = self.ctx.text
        return any(q in v.VARIABLE for q in self.ctx.names.local.values()) or "volatile" in text \
            or ".data[0]" in text

    # -- training ------------------------------------------------------------------------
    @cached_property
    def backward_calls(self) -> List[cst.Call]:
        """`.backward()` and `torch.autograd.backward(...)` calls, but those of a custom autograd
        Function's backward (a reversible block recomputing its input), which are no training."""
        return [c for c in self._backward_like if self._function_backward(c) is None]

    @cached_property
    def reentrant_backward(self) -> Optional[Function]:
        """The static `backward` of a custom autograd Function that runs a backward itself."""
        return next((fn for fn in map(self._function_backward, self._backward_like) if fn is not None), None)

    @cached_property
    def _backward_like(self) -> List[cst.Call]:
        return [node for node in self.s.index.of(cst.Call)
                if (isinstance(node.func, cst.Attribute) and node.func.attr.value == "backward")
                or self.qualify(node.func) == "torch.autograd.backward"]

    def _function_backward(self, call: cst.Call) -> Optional[Function]:
        """The static method named `backward` (a custom autograd Function's) holding `call`, or
        calling by name the function that holds it (`block.backward_pass(y, dy)`)."""
        fn = self.s.function(call)
        if fn is None:
            return None
        if fn in self._static_backwards:
            return fn
        return next((b for b in self._static_backwards
                     if any(last_name(c.func) == fn.name for c in b.calls)), None)

    @cached_property
    def _static_backwards(self) -> List[Function]:
        return [fn for fn in self.s.functions.values() if fn.name == "backward" and isinstance(fn.node, cst.FunctionDef)
                and any(isinstance(d.decorator, cst.Name) and d.decorator.value == "staticmethod"
                        for d in fn.node.decorators)]

    @cached_property
    def step_calls(self) -> List[cst.Call]:
        """`optimizer.step()` and `scaler.step(optimizer)`."""
        out = []
        for node in self.s.index.of(cst.Call):
            if type(node.func) is cst.Attribute and node.func.attr.value == "step":
                receiver = node.func.value
                kind = self.kind(receiver)
                name = (dotted(receiver) or "").lower()
                if kind == v.OPTIMIZER or (kind in (v.UNKNOWN, v.OBJECT) and ("optim" in name or "scaler" in name)):
                    out.append(node)
        return out

    @cached_property
    def has_training(self) -> bool:
        return bool(self.backward_calls or self.step_calls)

    def backward_names(self, scope: Scope) -> Set[str]:
        """Names `.backward()` is called on in `scope` (`loss.backward()`)."""
        return self._backward_names.get(id(scope.node), set())

    @cached_property
    def _backward_names(self) -> Dict[int, Set[str]]:
        out: Dict[int, Set[str]] = {}
        for call in self.backward_calls:
            if isinstance(call.func, cst.Attribute) and isinstance(call.func.value, cst.Name) and not call.args:
                out.setdefault(id(self.s.scope(call).node), set()).add(call.func.value.value)
        return out

    def feeds_backward(self, name: str, at: cst.CSTNode) -> bool:
        """Is `name` part of what `.backward()` is called on (`(a + b).backward()`,
        `torch.stack(losses).sum().backward()`)? Then keeping its graph is the point."""
        scope = self.s.scope(at)
        for call in self.backward_calls:
            if self.s.scope(call) is scope and isinstance(call.func, cst.Attribute):
                if name in self._names_behind(call.func.value, scope):
                    return True
        return False

    def _names_behind(self, expr: cst.CSTNode, scope: Scope, depth: int = 0) -> Set[str]:
        """The names `expr` reads, and those its names were assigned from in `scope`
        (`meta_loss = losses_q[-1] / n`, then `meta_loss.backward()`: `losses_q` too)."""
        names = {n.value for n in self.s.index.subtree(expr) if isinstance(n, cst.Name)}
        if depth < 3:
            for name in list(names):
                for b in scope.bindings.get(name, []):
                    if b.how == "assign" and isinstance(b.value, cst.BaseExpression):
                        names |= self._names_behind(b.value, scope, depth + 1)
        return names

    @cached_property
    def training_functions(self) -> Set[int]:
        """ids of the functions of this file that train: they reach `.backward()` or
        `optimizer.step()` themselves or through functions of this file they call."""
        direct = {id(fn.node) for call in (*self.backward_calls, *self.step_calls)
                  for fn in [self.s.function(call)] if fn is not None}
        trained = set(direct)
        changed = True
        while changed:
            changed = False
            for fn in self.s.functions.values():
                if id(fn.node) in trained:
                    continue
                if any(id(t.node) in trained for c in fn.calls for t in self.s.callees(c)):
                    trained.add(id(fn.node))
                    changed = True
        return trained

    def trains(self, node: cst.CSTNode) -> bool:
        """Does running `node` (a statement or block of the original tree) train: reach
        `.backward()` or `optimizer.step()`, directly or through calls of this file?"""
        marks = self._training_marks
        for sub in self.s.index.subtree(node):
            if id(sub) in marks:
                return True
            if isinstance(sub, cst.Call) and any(id(target.node) in self.training_functions
                                                 for target in self.s.callees(sub)):
                return True
        return False

    @cached_property
    def _training_marks(self) -> Set[int]:
        return {id(c) for c in (*self.backward_calls, *self.step_calls)}

    def function_trains(self, fn: Function) -> bool:
        return id(fn.node) in self.training_functions

    # -- evaluation ----------------------------------------------------------------------
    def evaluates(self, fn: Function) -> bool:
        """A function that evaluates: puts a model in eval mode, or is named like evaluation
        and runs a model over batches; never one that trains."""
        if self.function_trains(fn) or not isinstance(fn.node, cst.FunctionDef):
            return False
        calls_eval = any(isinstance(c.func, cst.Attribute) and c.func.attr.value == "eval" and not c.args
                         for c in fn.calls)
        return calls_eval or bool(_EVAL_NAME.match(fn.name))

    def under_no_grad(self, node: cst.CSTNode) -> bool:
        """Is `node` inside `with torch.no_grad():` or a `@torch.no_grad()` function?"""
        for ancestor in [node, *self.s.ancestors(node)]:
            items = []
            if isinstance(ancestor, cst.With):
                items = [item.item for item in ancestor.items]
            elif isinstance(ancestor, cst.FunctionDef):
                items = [d.decorator for d in ancestor.decorators]
            for item in items:
                func = item.func if isinstance(item, cst.Call) else item
                if self.qualify(func) in _NO_GRAD:
                    return True
        return False

    # -- optimizers and the models they train ----------------------------------------------
    @cached_property
    def optimizers(self) -> List[Optimizer]:
        found: List[Optimizer] = []
        seen: Set[int] = set()
        for node in self.s.index.of(cst.Call):
            if id(node) in seen or self.kind(node) != v.OPTIMIZER:
                continue
            if self.s.callee(node) is not None:
                continue  # a factory of this file: its own `torch.optim` call is the one
            seen.add(id(node))
            found.extend(self._optimizer(node))
        found.extend(self._unresolved_optimizers(seen))
        return found

    def _optimizer(self, call: cst.Call) -> List[Optimizer]:
        """One optimizer per call site: a factory's optimizer is owned by what each caller passes."""
        params = call_argument(call, "params", 0)
        fn = self.s.function(call)
        sites = [call]
        if fn is not None and self._returns(fn, call):
            sites = [c for c in fn.callers] or [call]
        out = []
        for site in sites:
            opt = Optimizer(call, site)
            if params is None:
                opt.resolved = False
            else:
                self._owners(params, self.s.scope(call), self.s.order(self.s.statement(call)), opt,
                             site if site is not call else None)
            out.append(opt)
        return out

    def _returns(self, fn: Function, call: cst.Call) -> bool:
        """Does `fn` return what `call` builds (directly, or through a name)?"""
        for ret in fn.returns:
            if ret is call:
                return True
            if isinstance(ret, cst.Name):
                _, bindings = self.s.lookup(ret.value, fn.scope)
                if any(b.how == "assign" and b.value is call for b in bindings):
                    return True
        return False

    def _unresolved_optimizers(self, seen: Set[int]) -> List[Optimizer]:
        """`optimizer = build_optimizer(cfg, model)` from elsewhere: something with `.step()`
        and `.zero_grad()`; its owners are the modules passed to the call that built it."""
        out = []
        stepped: Dict[Tuple[int, str], cst.CSTNode] = {}
        for node in self.s.index.of(cst.Call):
            if isinstance(node.func, cst.Attribute) and \
                    node.func.attr.value == "step" and isinstance(node.func.value, cst.Name):
                scope = self.s.scope(node)
                if self.kind(node.func.value) in (v.OPTIMIZER, v.SCHEDULER, v.SCALER, v.MODULE, v.LOSS_MODULE):
                    continue
                stepped.setdefault((id(scope.node), node.func.value.value), node)
        for (_, name), use in stepped.items():
            owner_scope, bindings = self.s.lookup(name, self.s.scope(use))
            calls = [b.value for b in bindings if b.how == "assign" and isinstance(b.value, cst.Call)]
            if not calls or any(id(c) in seen for c in calls):
                continue
            for call in calls:
                if self.s.callee(call) is not None or "sched" in name.lower():
                    continue
                opt = Optimizer(call, call, resolved=False)
                for arg in call.args:
                    if arg.star:
                        continue
                    kind = self.kind(arg.value)
                    if kind in v.MODULES or kind == v.PARAMS:
                        self._owners(arg.value if kind == v.PARAMS else cst.Call(
                            func=cst.Attribute(value=arg.value, attr=cst.Name("parameters"))),
                            self.s.scope(call), self.s.order(self.s.statement(call)), opt, None, synthetic=arg.value)
                out.append(opt)
        return out

    def _owners(self, expr: cst.BaseExpression, scope: Scope, at: float, opt: Optimizer,
                site: Optional[cst.Call], synthetic: Optional[cst.BaseExpression] = None, depth: int = 0) -> None:
        """Find whose parameters `expr` holds; record them on `opt` (or mark it unresolved)."""
        if depth > 12:
            opt.resolved = False
            return
        again = lambda e, sc=scope, a=at: self._owners(e, sc, a, opt, site, None, depth + 1)  # noqa: E731
        if not isinstance(expr, cst.Name) and self.kind(expr) in v.TENSORS:
            opt.functional = True  # tensors trained directly: a functional model
            opt.resolved = False
            return
        if isinstance(expr, cst.Call):
            func = expr.func
            if isinstance(func, cst.Attribute) and func.attr.value in ("parameters", "named_parameters"):
                receiver = synthetic if synthetic is not None else func.value
                root = _root(receiver)
                if root is None:
                    opt.resolved = False
                    return
                self._add_owner(root, scope, at, opt, site)
                return
            name = func.value if isinstance(func, cst.Name) else func.attr.value if isinstance(func, cst.Attribute) else ""
            if name in ("list", "tuple", "filter", "chain", "sorted", "iter") and expr.args:
                for arg in expr.args:
                    if name != "filter" or arg is expr.args[-1]:
                        again(arg.value)
                return
            if isinstance(func, cst.Attribute) and func.attr.value == "values" and isinstance(func.value, cst.Name):
                opt.functional = True  # params.values(): a dict of tensors
                opt.resolved = False
                return
            opt.resolved = False
            return
        if isinstance(expr, (cst.List, cst.Tuple)):
            for element in expr.elements:
                again(element.value)
            return
        if isinstance(expr, cst.Dict):
            for element in expr.elements:
                if isinstance(element, cst.DictElement) and isinstance(element.key, cst.SimpleString) \
                        and element.key.evaluated_value == "params":
                    again(element.value)
                elif not isinstance(element, cst.DictElement):
                    opt.resolved = False
            return
        if isinstance(expr, (cst.ListComp, cst.GeneratorExp)):
            again(expr.for_in.iter)
            return
        if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Add):
            again(expr.left)
            again(expr.right)
            return
        if isinstance(expr, cst.Name):
            found, bindings = self.s.lookup(expr.value, scope, at)
            if not bindings:
                opt.resolved = False
                return
            for b in bindings:
                if b.how in ("assign", "aug"):
                    self._owners(b.value, b.scope, b.order, opt, site, None, depth + 1)
                elif b.how == "param":
                    self._param_owners(b, opt, site, depth)
                else:
                    opt.resolved = False
            for call in self._mutations(expr.value, found, at):
                for arg in call.args:
                    self._owners(arg.value, found, self.s.order(self.s.statement(call)), opt, site, None, depth + 1)
            if any(self.kind(expr) == v.PARAM or self.values.binding(b) in (v.PARAM, v.TENSOR) for b in bindings):
                opt.functional = True
                opt.resolved = False
            return
        if isinstance(expr, cst.Attribute) and self.kind(expr) == v.PARAM:
            opt.functional = True
        opt.resolved = False

    def _param_owners(self, b: Binding, opt: Optimizer, site: Optional[cst.Call], depth: int,
                      receiver: bool = False) -> None:
        """A parameter of a factory: what the caller passes for it (the parameter list, or,
        with `receiver`, the module whose `.parameters()` the factory takes)."""
        fn = self.s.functions.get(id(b.scope.node))
        if fn is None:
            opt.resolved = False
            return
        position = fn.position(b.name)
        callers = [site] if site is not None and site in fn.callers else fn.callers
        if not callers:
            opt.resolved = False
            return
        for call in callers:
            arg = call_argument(call, b.name, position)
            if arg is None:
                opt.resolved = False
                continue
            scope, at = self.s.scope(call), self.s.order(self.s.statement(call))
            if receiver:
                root = _root(arg)
                if root is None:
                    opt.resolved = False
                else:
                    self._add_owner(root, scope, at, opt, None)
            else:
                self._owners(arg, scope, at, opt, None, None, depth + 1)

    def _mutations(self, name: str, scope: Optional[Scope], at: float) -> List[cst.Call]:
        """`params.append(...)` / `params.extend(...)` before `at` in the scope binding `name`."""
        if scope is None:
            return []
        out = []
        for node in self.s.index.subtree(scope.node):
            if isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) \
                    and node.func.attr.value in ("append", "extend", "insert", "add_param_group") \
                    and isinstance(node.func.value, cst.Name) and node.func.value.value == name \
                    and self.s.order(node) < at and self.s.scope(node) is scope:
                out.append(node)
        return out

    def _add_owner(self, root: str, scope: Scope, at: float, opt: Optimizer, site: Optional[cst.Call]) -> None:
        head = root.split(".")[0]
        if head != "self":
            found, bindings = self.s.lookup(head, scope, at)
            if found is None:
                opt.resolved = False
                return
            if len(bindings) == 1 and bindings[0].how == "param" and "." not in root:
                self._param_owners(bindings[0], opt, site, 0, receiver=True)
                return
            scope = found
        opt.owners.append((scope, root))

    @cached_property
    def trained_models(self) -> List[TrainedModel]:
        """Each module an optimizer trains, once per (scope, name)."""
        models: Dict[Tuple[int, str], TrainedModel] = {}
        for opt in self.optimizers:
            for scope, name in opt.owners:
                key = (id(scope.node), name)
                if key not in models:
                    models[key] = TrainedModel(name, scope, loss_module=self._is_loss_module(name, scope))
                if opt not in models[key].optimizers:
                    models[key].optimizers.append(opt)
        return list(models.values())

    def _is_loss_module(self, name: str, scope: Scope) -> bool:
        """A module whose output is the loss: a `Loss` class, or one whose call result is
        what `.backward()` is called on (`criterion(out, y).backward()`, `loss = criterion(...)`)."""
        if "." not in name:
            kind = self.values.name(name, scope)
            if kind == v.LOSS_MODULE:
                return True
        for node in self.s.index.of(cst.Call):
            if dotted(node.func) == name and self._scope_chain_binds(node, scope):
                parent = self.s.parent(node)
                if isinstance(parent, cst.Attribute) and parent.attr.value == "backward":
                    return True
                if isinstance(parent, cst.Assign) and len(parent.targets) == 1 and \
                        isinstance(parent.targets[0].target, cst.Name) and \
                        parent.targets[0].target.value in self.backward_names(self.s.scope(node)):
                    return True
        return False

    def _scope_chain_binds(self, node: cst.CSTNode, scope: Scope) -> bool:
        current: Optional[Scope] = self.s.scope(node)
        while current is not None:
            if current is scope:
                return True
            current = current.parent
        return False

    # -- loaders -------------------------------------------------------------------------
    @cached_property
    def loaders(self) -> List[Loader]:
        loaders: Dict[int, Loader] = {}
        for node in self.s.index.of(cst.Call):
            if self.qualify(node.func) in v.DATALOADER:
                loaders[id(node)] = Loader(node)
        if not loaders:
            return []
        for loader in loaders.values():
            self._holders(loader)
        for consumption in self._consumptions_found:
            for origin, via in self.origins(consumption.holder):
                if id(origin) in loaders:
                    loader = loaders[id(origin)]
                    loader.consumers.append(consumption)
                    if consumption.peek:
                        continue
                    role = "train" if consumption.trains else "eval"
                    loader.roles.add(role)
                    if via is not None:
                        loader._via = getattr(loader, "_via", []) + [(via, role)]  # type: ignore[attr-defined]
        for loader in loaders.values():
            if loader.roles == {"train", "eval"}:
                self._flag(loader)
            if not loader.roles:
                names = " ".join(name for _, name, _ in loader.holders) or self._factory_name(loader)
                if _TRAIN_NAME.search(names):
                    loader.roles.add("train")
                elif _EVAL_LOADER_NAME.search(names):
                    loader.roles.add("eval")
        return list(loaders.values())

    @cached_property
    def foreign_loaders(self) -> List[cst.BaseExpression]:
        """The training data the migration cannot see being made: what a name (or `self.`
        attribute) that only training loops consume is bound to, where that is a call of a
        function of another module (`train_loader = utils.get_loader(...)`) or a parameter
        no call of this file passes (a loader handed to a class from elsewhere). Each such
        expression can be rebuilt for the rank where it is bound (the runtime's
        `shard_loader`, which leaves anything but a DataLoader as it is, and says so)."""
        return self._foreign_data[0]

    @cached_property
    def foreign_iterations(self) -> List[cst.BaseExpression]:
        """Such data that evaluation reads too (`self.loader` of both train() and test()):
        the expressions training iterates (`iter(data_loader)`), rebuilt there instead
        (`shard_loader` gives the same rebuilt loader at every call)."""
        return self._foreign_data[1]

    @cached_property
    def _foreign_data(self) -> Tuple[List[cst.BaseExpression], List[cst.BaseExpression]]:
        by_holder: Dict[Tuple[int, str], List[Consumption]] = {}
        for consumption in self._consumptions_found:
            holder = consumption.holder
            name = dotted(holder) if isinstance(holder, (cst.Name, cst.Attribute)) else None
            if name is None or (isinstance(holder, cst.Attribute) and not name.startswith("self.")):
                continue
            key_scope = self.s.instance_class(holder.value, self.s.scope(holder)) if isinstance(holder, cst.Attribute) \
                else self.s.lookup(holder.value, self.s.scope(holder))[0]
            by_holder.setdefault((id(key_scope), name), []).append(consumption)
        out: List[cst.BaseExpression] = []
        evaluated: Set[int] = set()  # what evaluation reads too (`self.loader` of train() and test()): kept whole
        for consumptions in by_holder.values():
            if not all(c.trains for c in consumptions):
                evaluated.update(id(v) for v in self._bound_values(consumptions[0].holder))
        iterations: List[cst.BaseExpression] = []
        for consumptions in by_holder.values():
            if not all(c.trains for c in consumptions) or any(self.origins(c.holder) for c in consumptions):
                continue
            values = self._bound_values(consumptions[0].holder)
            if not values or not all(self._foreign(value) for value in values):
                continue
            if all(id(value) not in evaluated for value in values):
                out.extend(v for v in values if all(v is not o for o in out))
            else:  # shared with evaluation: sharded where training iterates it
                iterations.extend(self._iterated_here(consumptions))
        return out, iterations

    def _iterated_here(self, consumptions: List[Consumption]) -> List[cst.BaseExpression]:
        """What training's own loops take batches from: `loader` in `for x in loader` or in
        every `it = iter(loader)` that `next(it)` reads (none where a binding is anything else)."""
        out: List[cst.BaseExpression] = []
        for c in consumptions:
            if isinstance(c.node, cst.For):
                out.append(c.holder)
                continue
            if not isinstance(c.holder, cst.Name):
                return []
            for b in self.s.all_bindings(c.holder.value, self.s.scope(c.holder)):
                value = b.value
                if not (b.how == "assign" and isinstance(value, cst.Call) and isinstance(value.func, cst.Name) and
                        value.func.value == "iter" and len(value.args) == 1 and
                        isinstance(value.args[0].value, (cst.Name, cst.Attribute))):
                    return []
                out.append(value.args[0].value)
        return [e for k, e in enumerate(out) if all(e is not o for o in out[:k])]

    @cached_property
    def foreign_params(self) -> Dict[int, List[str]]:
        """id(function) -> its parameters that only training loops consume, directly (`for x in
        data_loader` in `def train(self, data_loader)`), in a function no call of this file
        makes: a loader handed in by another module."""
        out: Dict[int, List[str]] = {}
        by_name: Dict[Tuple[int, str], List[Consumption]] = {}
        training = [c.node for c in self._consumptions_found if c.trains and isinstance(c.node, cst.For)]
        for consumption in self._consumptions_found:
            holder = consumption.holder
            if any(inner is not consumption.node and self.s.index.contains(consumption.node, inner)
                   for inner in training):
                continue  # the tasks or datasets around the loop that draws the batches (`for task in tasks`)
            if isinstance(holder, cst.Name):
                scope, _ = self.s.lookup(holder.value, self.s.scope(holder))
                by_name.setdefault((id(scope), holder.value), []).append(consumption)
        for consumptions in by_name.values():
            holder = consumptions[0].holder
            bindings = self.s.all_bindings(holder.value, self.s.scope(holder))
            if not all(c.trains for c in consumptions) or len(bindings) != 1 or bindings[0].how != "param" \
                    or any(self.origins(c.holder) for c in consumptions) or all(map(_next_of, consumptions)):
                continue
            fn = self.s.functions.get(id(bindings[0].scope.node))
            if fn is not None and isinstance(fn.node, cst.FunctionDef) and self._handed_in(fn, holder.value, 0):
                out.setdefault(id(fn.node), []).append(holder.value)
        return out

    def _handed_in(self, fn: Any, name: str, depth: int) -> bool:
        """Parameter `name` of `fn` comes from another module: no call of this file makes `fn`,
        or every call passes it a parameter of its own function that comes from one."""
        if depth > 4:
            return False
        for call in fn.callers:
            arg = call_argument(call, name, fn.position(name))
            if arg is None or not isinstance(arg, cst.Name):
                return False
            bindings = self.s.all_bindings(arg.value, self.s.scope(arg))
            outer = self.s.functions.get(id(bindings[0].scope.node)) if len(bindings) == 1 and \
                bindings[0].how == "param" else None
            if outer is None or not self._handed_in(outer, arg.value, depth + 1):
                return False
        return True

    def _bound_values(self, holder: cst.BaseExpression, depth: int = 0) -> List[cst.BaseExpression]:
        """What `holder` is assigned (none where one of its bindings is anything else), through
        `data_loader = self.train_loader` and `data_iter = iter(data_loader)` to what those
        are assigned."""
        scope = self.s.scope(holder)
        if isinstance(holder, cst.Attribute):
            cls = self.s.instance_class(holder.value, scope)
            bindings = cls.attrs.get(holder.attr.value, []) if cls is not None else []
        else:
            bindings = self.s.all_bindings(holder.value, scope)
        out: List[cst.BaseExpression] = []
        for b in bindings:
            if b.how != "assign":
                return []
            value = b.value
            if isinstance(value, cst.Call) and isinstance(value.func, cst.Name) and value.func.value == "iter" \
                    and len(value.args) == 1 and value.args[0].keyword is None and not value.args[0].star:
                value = value.args[0].value
                if not isinstance(value, (cst.Name, cst.Attribute)):
                    return []
            if isinstance(value, cst.Name) and value is not b.value:
                through = value
            elif isinstance(value, cst.Attribute) and (dotted(value) or "").count(".") == 1 and \
                    (dotted(value) or "").startswith("self."):
                through = value
            elif isinstance(value, (cst.Call, cst.Name)) or _item_of_name(value):
                out.append(value)
                continue
            else:
                return []
            inner = self._bound_values(through, depth + 1) if depth < 2 else []
            if not inner:
                return []
            out.extend(v for v in inner if all(v is not o for o in out))
        return out

    def _foreign(self, value: cst.BaseExpression) -> bool:
        """A call of another module's function, or a parameter no call of this file passes."""
        if isinstance(value, cst.Call):
            qualified = self.qualify(value.func) or ""
            if qualified in _BARS:
                # a bar: over what it wraps (`trange(n)` counts steps, made here)
                return qualified.endswith("tqdm") and bool(value.args) and self._foreign(value.args[0].value)
            return self.s.callee(value) is None and qualified not in v.DATALOADER and \
                runtime_helper(qualified) is None and not (isinstance(value.func, cst.Name) and
                                                           value.func.value in _BUILTIN_ITERABLES) and \
                self.kind(value) in (v.LOADER, v.UNKNOWN, v.OBJECT, v.NEUTRAL)
        if isinstance(value, cst.Subscript):  # `data_loader[0]` of the (train, valid) pair handed in
            value = value.value
        _, bindings = self.s.lookup(value.value, self.s.scope(value))
        if not bindings or any(b.how != "param" for b in bindings):
            return False
        fn = self.s.functions.get(id(bindings[0].scope.node))
        return fn is not None and not fn.callers

    def loader_of(self, call: cst.Call) -> Optional[Loader]:
        return next((l for l in self.loaders if l.call is call), None)

    def _factory_name(self, loader: Loader) -> str:
        fn = self.s.function(loader.call)
        return fn.name if fn is not None else ""

    def _holders(self, loader: Loader) -> None:
        """The names a loader is bound to: `train_loader = DataLoader(...)`, or through a
        factory of this file, `train_loader = make_loader(...)` at each call (also
        `a, b = make(True), make(False)`)."""
        frontier: List[cst.CSTNode] = [loader.call]
        seen: Set[int] = set()
        while frontier:
            expr = frontier.pop()
            if id(expr) in seen:
                continue
            seen.add(id(expr))
            parent = self.s.parent(expr)
            target: Optional[cst.BaseExpression] = None
            holder: Optional[cst.CSTNode] = None
            if isinstance(parent, (cst.Assign, cst.AnnAssign)) and parent.value is expr:
                targets = [t.target for t in parent.targets] if isinstance(parent, cst.Assign) else [parent.target]
                target, holder = targets[0], parent
            elif isinstance(parent, cst.Element) and isinstance(self.s.parent(parent), cst.Tuple):
                tup = self.s.parent(parent)
                assign = self.s.parent(tup)
                if isinstance(assign, cst.Assign) and len(assign.targets) == 1 and \
                        isinstance(assign.targets[0].target, cst.Tuple) and assign.value is tup:
                    elements = assign.targets[0].target.elements
                    k = list(tup.elements).index(parent)
                    if k < len(elements):
                        target, holder = elements[k].value, assign
            elif isinstance(parent, cst.Return):
                fn = self.s.function(parent)
                if fn is not None:
                    frontier.extend(fn.callers)
            if target is None or holder is None or not dotted(target):
                continue
            name = dotted(target)
            loader.holders.append((self.s.scope(holder), name, expr))
            fn = self.s.function(holder)
            if fn is not None and isinstance(target, cst.Name) and any(
                    isinstance(r, cst.Name) and r.value == name for r in fn.returns):
                frontier.extend(fn.callers)

    @cached_property
    def _consumptions_found(self) -> List[Consumption]:
        out = []
        for node in self.s.index.order:
            kind = type(node)
            if kind is cst.For or kind is cst.CompFor:
                relay = kind is cst.For and self._relays(node)  # its batches are the caller's, where it draws them
                for holder in self._iterated(node.iter):
                    if self.kind(holder) in (v.LOADER, v.ITERATOR, v.UNKNOWN, v.NEUTRAL):
                        loop = node if isinstance(node, cst.For) else self.s.statement(node)
                        trains = self.trains(node.body) if isinstance(node, cst.For) else self._loop_trains(node)
                        trains = trains or (relay and self._drawn_in_training(self.s.function(node)))
                        # `for x, y in islice(loader, n)`: a look at a few batches (a data-dependent
                        # init), no pass over the set
                        few = isinstance(node.iter, cst.Call) and self.qualify(node.iter.func) == "itertools.islice"
                        out.append(Consumption(loop, holder, trains, peek=(relay or few) and not trains))
            elif kind is cst.Call and isinstance(node.func, cst.Name) and node.func.value == "next" \
                    and node.args and self.kind(node.args[0].value) in (v.ITERATOR, v.UNKNOWN, v.NEUTRAL):
                trains = self._loop_trains(node)
                # a generator's draws (`data_iter = iter(loader)`, `yield next(data_iter)`) are its caller's
                relay = self._generator(self.s.function(node))
                trains = trains or (relay and self._drawn_in_training(self.s.function(node)))
                out.append(Consumption(node, node.args[0].value, trains,
                                       peek=not trains and (relay or not self.in_loop(node))))
            elif kind is cst.Call and isinstance(node.func, cst.Attribute) and \
                    node.func.attr.value == "next" and not node.args and self.kind(node.func.value) == v.ITERATOR:
                out.append(Consumption(node, node.func.value, self._loop_trains(node)))  # Python 2's it.next()
            elif kind is cst.Call and node.args and self.s.callee(node) is None:
                for holder in self._handed(node):
                    out.append(Consumption(node, holder, True))
        return out

    def _drawn_in_training(self, generator: Any) -> bool:
        """A generator of this file that a training function draws from (`dataset =
        iter(sample_data(path))`, then `next(dataset)` each step), where the loader it relays is
        its own (`loader = DataLoader(...)` in its body, remade when spent): that loader trains."""
        return generator is not None and bool(generator.callers) and all(
            (fn := self.s.function(c)) is not None and self.function_trains(fn) for c in generator.callers)

    def _handed(self, call: cst.Call) -> List[cst.BaseExpression]:
        """The loaders a library's runner takes to train on: `trainer.run(loader, epochs)` where
        `trainer = Engine(step)` with a training function of this file, or was made given an
        optimizer (`create_supervised_trainer(model, optimizer, loss)`)."""
        func = call.func
        if not isinstance(func, cst.Attribute) or not isinstance(func.value, cst.Name):
            return []
        loaders = [a.value for a in call.args if isinstance(a.value, (cst.Name, cst.Attribute))
                   and a.keyword is None and self.kind(a.value) == v.LOADER]
        if not loaders:
            return []
        stmt = self.s.statement(call)
        _, bindings = self.s.lookup(func.value.value, self.s.scope(call), self.s.order(stmt) if stmt else NEVER)
        for b in bindings:
            if b.how != "assign" or not isinstance(b.value, cst.Call):
                continue
            for arg in b.value.args:
                if self.kind(arg.value) == v.OPTIMIZER:
                    return loaders
                if isinstance(arg.value, cst.Name):
                    _, defs = self.s.lookup(arg.value.value, self.s.scope(b.value))
                    fns = [self.s.functions.get(id(d.value)) for d in defs if d.how == "def"]
                    if any(fn is not None and self.function_trains(fn) for fn in fns):
                        return loaders
        return []

    def in_loop(self, node: cst.CSTNode) -> bool:
        """Is `node` inside a loop of its own function (or of the module)?"""
        for ancestor in self.s.ancestors(node):
            if isinstance(ancestor, (cst.For, cst.While)):
                return True
            if isinstance(ancestor, (cst.FunctionDef, cst.Lambda)):
                return False
        return False

    def _loop_trains(self, node: cst.CSTNode) -> bool:
        """Does the loop around `node` train (or, outside loops, its function)?"""
        for ancestor in self.s.ancestors(node):
            if isinstance(ancestor, (cst.For, cst.While)):
                return self.trains(ancestor.body)
            if isinstance(ancestor, (cst.FunctionDef, cst.Lambda)):
                break
        fn = self.s.function(node)
        stmt = self.s.line(node)
        return self.function_trains(fn) if fn is not None else bool(stmt is not None and self.trains(stmt))

    @staticmethod
    def _iterated(it: cst.BaseExpression) -> List[cst.BaseExpression]:
        """The expressions a loop takes items from: `loader` in `enumerate(tqdm(loader))`,
        both in `zip(a, b)`."""
        out: List[cst.BaseExpression] = []
        stack = [it]
        while stack:
            e = stack.pop()
            if isinstance(e, cst.Call) and isinstance(e.func, (cst.Name, cst.Attribute)):
                name = e.func.value if isinstance(e.func, cst.Name) else e.func.attr.value
                # shard_batches: the runtime's sharding where a loop iterates (an earlier run's)
                if name in ("enumerate", "tqdm", "trange", "iter", "zip", "islice", "shard_batches") and e.args:
                    stack.extend(a.value for a in (e.args if name == "zip" else e.args[:1]))
                    continue
                if name == "DataLoader":
                    out.append(e)  # `for x, y in DataLoader(...)`
                    continue
            if isinstance(e, (cst.Name, cst.Attribute)):
                out.append(e)
        return out

    def origins(self, holder: cst.BaseExpression, depth: int = 0) -> List[Tuple[cst.Call, Optional[cst.Call]]]:
        """The DataLoader calls `holder` may hold, each with the factory call it came through."""
        if depth > 8:
            return []
        if isinstance(holder, cst.Call) and self.qualify(holder.func) in v.DATALOADER:
            return [(holder, None)]
        scope = self.s.scope(holder)
        stmt = self.s.statement(holder)
        if isinstance(holder, cst.Attribute) and dotted(holder) and dotted(holder).startswith("self."):
            cls = self.s.instance_class(holder.value, scope)
            bindings = cls.attrs.get(holder.attr.value, []) if cls is not None else []
        elif isinstance(holder, cst.Name):
            _, bindings = self.s.lookup(holder.value, scope, self.s.order(stmt) if stmt is not None else NEVER)
        else:
            return []
        out: List[Tuple[cst.Call, Optional[cst.Call]]] = []
        for b in bindings:
            if b.how == "param":
                fn = self.s.functions.get(id(b.scope.node))
                if fn is None:
                    continue
                position = fn.position(b.name)
                for call in fn.callers:
                    arg = call_argument(call, b.name, position)
                    if arg is not None:
                        out.extend(self.origins(arg, depth + 1))
                continue
            if b.how not in ("assign", "unpack") or not isinstance(b.value, (cst.Call, cst.Tuple)):
                continue
            value = b.value
            if b.how == "unpack" and isinstance(value, cst.Tuple) and b.path and b.path[0] < len(value.elements):
                value = value.elements[b.path[0]].value
            if not isinstance(value, cst.Call):
                continue
            if self.qualify(value.func) in v.DATALOADER:
                out.append((value, None))
            elif isinstance(value.func, cst.Name) and value.func.value == "iter" and value.args:
                out.extend(self.origins(value.args[0].value, depth + 1))
            elif self.qualify(value.func) in _BARS and value.args:  # `pbar = tqdm(loader)`
                out.extend(self.origins(value.args[0].value, depth + 1))
            else:
                callee = self.s.callee(value)
                if callee is None:
                    continue
                for ret in callee.returns:
                    for origin in self._returned_loaders(ret, depth):
                        out.append((origin, value))
                out.extend((origin, None) for origin in self._relayed(value, callee, depth))
        return out

    def _relays(self, loop: cst.For) -> bool:
        """A loop of a generator function that yields what it draws (`def infiniteloop(loader):
        while True: for x, y in loader: yield x`): whoever draws from the generator consumes."""
        fn = self.s.function(loop)
        return fn is not None and any(self.s.function(y) is fn for y in self.s.inside(loop.body, cst.Yield))

    def _generator(self, fn: Any) -> bool:
        return fn is not None and any(self.s.function(y) is fn for y in self.s.inside(fn.node.body, cst.Yield))

    def _relayed(self, call: cst.Call, callee: Any, depth: int) -> List[cst.Call]:
        """The DataLoader calls a call of such a generator relays: what it passes for the
        parameter the generator's loop iterates (or yields from: `yield from loader`)."""
        out: List[cst.Call] = []
        names = callee.param_names()
        holders = [h for loop in self.s.inside(callee.node.body, cst.For) if self._relays(loop)
                   for h in self._iterated(loop.iter)]
        holders += [y.value.item for y in self.s.inside(callee.node.body, cst.Yield)  # `yield from loader`
                    if isinstance(y.value, cst.From) and self.s.function(y) is callee]
        if self._generator(callee):  # `data_iter = iter(loader)`, then `yield next(data_iter)`
            holders += [c.args[0].value for c in self.s.inside(callee.node.body, cst.Call)
                        if isinstance(c.func, cst.Name) and c.func.value == "iter" and len(c.args) == 1
                        and self.s.function(c) is callee]
        for holder in holders:
            if isinstance(holder, cst.Name) and holder.value in names:
                arg = call_argument(call, holder.value, callee.position(holder.value))
                if arg is not None:
                    out.extend(origin for origin, _ in self.origins(arg, depth + 1))
        return out

    def _returned_loaders(self, expr: cst.BaseExpression, depth: int) -> List[cst.Call]:
        if isinstance(expr, cst.Call) and self.qualify(expr.func) in v.DATALOADER:
            return [expr]
        if isinstance(expr, cst.Name):
            return [o for o, _ in self.origins(expr, depth + 1)]
        return []

    def _flag(self, loader: Loader) -> None:
        """A factory used for training and for evaluation (`make_loader(train=True)`): find
        its parameter that is true at every training call and false at every evaluation one."""
        via = getattr(loader, "_via", [])
        fn = self.s.function(loader.call)
        if fn is None or not via or any(site is None for site, _ in via):
            return
        names = fn.param_names()
        for position, name in enumerate(names):
            values = []
            for site, role in via:
                arg = call_argument(site, name, position)
                if not isinstance(arg, cst.Name) or arg.value not in ("True", "False"):
                    break
                values.append((arg.value == "True", role))
            else:
                if values and all(flag == (role == "train") for flag, role in values):
                    loader.flag = name
                    return
                if values and all(flag == (role == "eval") for flag, role in values):
                    loader.flag, loader.flag_negated = name, True
                    return

    # -- outputs -------------------------------------------------------------------------
    def output_call(self, call: cst.Call) -> Optional[str]:
        """What kind of output a call writes: "print", "log", "write" (to a file, csv or
        TensorBoard writer), "save" (a file: torch.save, pickle.dump, os.makedirs...), or None."""
        func = call.func
        qualified = self.qualify(func) or ""
        if isinstance(func, cst.Name) and func.value == "print" and not qualified:
            return "print"
        if qualified.startswith("logging.") and qualified.rsplit(".", 1)[1] in _LOG_METHODS:
            return "log"
        if qualified == "os.makedirs":
            exist_ok = call_argument(call, "exist_ok", 2)
            if isinstance(exist_ok, cst.Name) and exist_ok.value == "True":
                return None  # every rank may make it (no race), and none opens a file in it before it exists
        if qualified in SAVE_CALLS or qualified.endswith(".save_image"):
            return "save"
        if qualified in ("tqdm.tqdm.write", "tqdm.auto.tqdm.write", "tqdm.write"):
            return "print"
        if isinstance(func, cst.Attribute):
            method = func.attr.value
            receiver = func.value
            if method == "write" and dotted(receiver) in ("tqdm", "tqdm.tqdm"):
                return "print"
            if method in ("save_pretrained", "savefig", "to_csv") and not qualified:
                return "save"
            kind = self.kind(receiver)
            if kind == v.WRITER and method in _WRITER_METHODS:
                return "write"
            if kind == v.WRITER and isinstance(receiver, cst.Name):
                return "write"
            cls = self.s.instance_class(receiver, self.s.scope(call))
            if cls is not None and cls.name and self._logger_class(cls):
                inside = self.s.function(call)
                if isinstance(receiver, cst.Name) and receiver.value == "self" and inside is not None and \
                        inside.cls is cls:
                    return None  # `self._reset()` in the logger itself keeps its state on every rank; its own outputs are gated
                return "write"
        return None

    def _logger_class(self, cls) -> bool:
        """A class of this file whose methods only write outputs (print, files) and keep
        state: a custom logger."""
        key = ("logger", id(cls.node))
        cache = self.__dict__.setdefault("_logger_cache", {})
        if key in cache:
            return cache[key]
        cache[key] = False
        if self.values.class_kind(cls) in v.MODULES:
            return False  # a model that prints its size is no logger: `self.apply(init)` is no output
        writes = False
        for method in cls.methods.values():
            for call in method.calls:
                if self.trains(call) or self.collective(call):
                    return False
                kind = self.output_call(call)
                if kind is not None:
                    writes = True
        cache[key] = writes and not any(self.function_trains(m) for m in cls.methods.values())
        return cache[key]

    def collective(self, call: cst.Call) -> bool:
        """A call every rank must make: `dist.barrier()`, `all_reduce`, the runtime's
        reductions, broadcasts and barrier."""
        qualified = self.qualify(call.func) or ""
        name = qualified.rsplit(".", 1)[-1]
        return (qualified.startswith("torch.distributed.") and name in COLLECTIVES) or \
            runtime_helper(qualified) in RUNTIME_COLLECTIVES

    # -- per-process and rank-local values ---------------------------------------------------
    def per_process_call(self, call: cst.Call) -> bool:
        qualified = self.qualify(call.func) or ""
        return qualified in PER_PROCESS_CALLS

    def per_process(self, expr: cst.BaseExpression) -> bool:
        """Does `expr` differ per process: a clock, a random draw, a pid, a temp dir, a uuid,
        or a name bound from one (not yet agreed on with broadcast_object)?"""
        return self._per_process(expr, 0)

    def _per_process(self, expr: cst.BaseExpression, depth: int) -> bool:
        if depth > 6:
            return False
        for node in self.s.index.subtree(expr) if id(expr) in self.s.index.start else []:
            if isinstance(node, cst.Call):
                if (self.qualify(node.func) or "").endswith("broadcast_object"):
                    return False
                if self.per_process_call(node):
                    return True
            elif isinstance(node, cst.Name):
                scope = self.s.scope(node)
                stmt = self.s.statement(node)
                _, bindings = self.s.lookup(node.value, scope, self.s.order(stmt) if stmt is not None else NEVER)
                for b in bindings:
                    if b.how == "assign" and isinstance(b.value, cst.BaseExpression) and b.value is not expr and \
                            self._per_process(b.value, depth + 1):
                        return True
        return False

    def rank_query(self, node: cst.CSTNode) -> bool:
        """`get_rank()`, `is_main_process()`, `args.local_rank`, `rank == 0`: this process's
        identity."""
        for sub in self.s.index.subtree(node):
            if isinstance(sub, cst.Call) and (self.qualify(sub.func) or "") in _RANK_QUERIES:
                return True
            if isinstance(sub, (cst.Name, cst.Attribute)) and _RANK_NAMES.search(dotted(sub) or ""):
                return True
            if isinstance(sub, cst.SimpleString) and "RANK" in sub.value:
                return True
        return False

    @cached_property
    def training_loops_list(self) -> List[cst.CSTNode]:
        """Loops that take training batches (a loader's `for`, or a loop calling `next()`)."""
        out = []
        for loader in self.loaders:
            for c in loader.consumers:
                if not c.trains:
                    continue
                node = c.node if isinstance(c.node, (cst.For, cst.While)) else next(
                    (a for a in self.s.ancestors(c.node) if isinstance(a, (cst.For, cst.While))), None)
                if node is not None and node not in out:
                    out.append(node)
        return out

    @cached_property
    def training_consumptions(self) -> Set[int]:
        """ids of the loops and `next()` calls that take training batches: once the data is
        sharded, what they yield differs per rank."""
        return {id(c.node) for l in self.loaders for c in l.consumers if c.trains}

    def local_binding(self, b: Binding) -> bool:
        """Does this binding give its name a value that can differ between ranks: a training
        batch, a value computed from one (a loss, a running sum), a per-process value (a clock,
        a random draw), the rank, or what a function returning one of these gives?"""
        key = id(b)
        memo = self._local_memo
        if key in memo:
            return memo[key]
        memo[key] = False  # a cycle says nothing
        result = False
        if b.how == "loop":
            loop = b.stmt if isinstance(b.stmt, cst.For) else None
            result = (loop is not None and id(loop) in self.training_consumptions) or \
                self._local_expr(b.value, b.scope, b.order)
        elif b.how in ("assign", "unpack", "aug", "with"):
            value = b.value
            if isinstance(value, cst.Call) and id(value) in self.training_consumptions:
                result = True
            elif isinstance(value, cst.CSTNode):
                result = self._local_expr(value, b.scope, b.order)
            if not result and b.how == "aug":
                _, chain = self.s.lookup(b.name, b.scope, b.order)
                result = any(self.local_binding(c) for c in chain if c is not b)
        memo[key] = result
        return result

    @cached_property
    def _local_memo(self) -> Dict[int, bool]:
        return {}

    def _local_expr(self, expr: cst.CSTNode, scope: Scope, at: float) -> bool:
        if not isinstance(expr, cst.CSTNode) or id(expr) not in self.s.index.start:
            return False
        for node in self.s.index.subtree(expr):
            if isinstance(node, cst.Name):
                _, bindings = self.s.lookup(node.value, self.s.scope(node), at)
                if any(self.local_binding(b) for b in bindings):
                    return True
            elif isinstance(node, cst.Call):
                qualified = self.qualify(node.func) or ""
                if qualified.endswith("broadcast_object") or qualified.endswith("reduce_sum") \
                        or qualified.endswith("reduce_mean"):
                    return False  # the ranks agree on what these return
                if qualified in PER_PROCESS_CALLS or qualified in _RANK_QUERIES:
                    return True
                target = self.s.callee(node)
                if target is not None and self.local_function(target):
                    return True
            elif isinstance(node, (cst.Attribute, cst.SimpleString)) and self._names_rank(node):
                return True
        return False

    def _names_rank(self, node: cst.CSTNode) -> bool:
        if isinstance(node, cst.SimpleString):
            return "RANK" in node.value
        return bool(_RANK_NAMES.search(dotted(node) or ""))

    def local_function(self, fn: Function) -> bool:
        """Does `fn` return a rank-local value (`train()` returning its shard's mean loss)?"""
        memo = self._local_memo
        key = -id(fn.node)
        if key in memo:
            return memo[key]
        memo[key] = False
        result = False
        for ret in fn.returns:
            stmt = self.s.statement(ret)
            if self._local_expr(ret, fn.scope, self.s.order(stmt) if stmt is not None else NEVER):
                result = True
                break
        memo[key] = result
        return result

    def rank_local(self, expr: cst.CSTNode) -> bool:
        """Can `expr` (of the original tree) differ between ranks, once the training data is
        sharded?"""
        stmt = self.s.statement(expr)
        if self.rank_query(expr):
            return True
        return self._local_expr(expr, self.s.scope(expr), self.s.order(stmt) if stmt is not None else NEVER)

    def rank_local_test(self, node: cst.CSTNode) -> bool:
        """An `if`/`while` whose condition can differ between ranks."""
        test = getattr(node, "test", None)
        return test is not None and self.rank_local(test)


_MODULE_METHODS = frozenset({"eval", "train", "parameters", "named_parameters", "modules", "children", "to", "cuda",
                             "half", "float", "forward", "state_dict", "zero_grad", "apply"})


def _next_of(consumption: Consumption) -> bool:
    """`next(p)` itself: `p` is an iterator (a generator handed to a step that draws one batch
    per call), which no rebuilding can shard; the loop that repeats the step is what shards."""
    node = consumption.node
    return isinstance(node, cst.Call) and bool(node.args) and node.args[0].value is consumption.holder


def _item_of_name(expr: cst.BaseExpression) -> bool:
    """`pair[0]`: an item, at a constant index, of what a name holds."""
    return isinstance(expr, cst.Subscript) and isinstance(expr.value, cst.Name) and len(expr.slice) == 1 and \
        isinstance(expr.slice[0].slice, cst.Index) and isinstance(expr.slice[0].slice.value, cst.Integer)


def _sum_terms(expr: cst.BaseExpression) -> Set[str]:
    """The names added or subtracted at the top of `expr` (`a + b * c - d`: a, d)."""
    if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, (cst.Add, cst.Subtract)):
        return _sum_terms(expr.left) | _sum_terms(expr.right)
    return {expr.value} if isinstance(expr, cst.Name) else set()


def _names_in(target: cst.BaseExpression) -> List[str]:
    if isinstance(target, cst.Name):
        return [target.value]
    if isinstance(target, (cst.Tuple, cst.List)):
        return [n for e in target.elements for n in _names_in(e.value)]
    return []


def _root(expr: cst.BaseExpression) -> Optional[str]:
    """The name whose parameters `model.backbone.parameters()` hands on: `model`
    (`self.model` inside a method)."""
    name = dotted(expr)
    if name is None:
        if isinstance(expr, cst.Call) and isinstance(expr.func, cst.Name) and expr.func.value == "unwrap_model" \
                and expr.args:
            return _root(expr.args[0].value)
        return None
    parts = name.split(".")
    if parts[0] == "self":
        return ".".join(parts[:2]) if len(parts) > 1 else None
    return parts[0]
