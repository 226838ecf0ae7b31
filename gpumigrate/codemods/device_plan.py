"""Where the migrated script gets its device from: one shared, per-file decision.

Every fix that needs "the device" (GM101 `.cuda()`, GM102 CUDA tensor types, GM103 hard-coded
devices, GM105 `torch.load`) asks this plan for an expression. The plan decides once per file:
reuse a `device` the script already builds, or insert exactly one `device = get_device()`
where every use can see it (after the imports, or after the script's `--no-cuda`-style flag
so that the flag still selects the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Set, Tuple, Union

import libcst as cst

from gpumigrate.analysis import script_model
from gpumigrate.analysis.devices import (  # noqa: F401  (rules import these from the plan)
    CUDA_TYPES,
    DeviceDef,
    Flag,
    Site,
    cuda_string_index,
    cuda_type_dtype,
    torch_device_index,
)
from gpumigrate.codemods.helpers import (
    findall,
    fresh_name,
    get_arg,
    is_method_call,
    literal_int,
    literal_str,
    runtime_name,
    torch_name,
)
from gpumigrate.rewriter.engine import FileContext
from gpumigrate.rewriter.lazy import matchers as m


@dataclass
class DevicePlan:
    ctx: FileContext
    name: Optional[str] = None  # the variable fixes refer to
    define_after: Optional[cst.SimpleStatementLine] = None  # insert the definition after this
    define_at_top: bool = False  # ... or after the module's imports
    flag: Optional[Flag] = None  # the definition honours this flag
    ignored_flag: Optional[Flag] = None  # a flag the definition could not see
    multi_index: bool = False  # model parallelism: keep `.cuda(n)` placements
    defs: List[DeviceDef] = field(default_factory=list)
    guard_flags: Set[str] = field(default_factory=set)  # `if <flag>:` guards safe to drop
    distributed_definition: bool = False  # ddp: the definition is `setup_distributed()`
    flags: List[Flag] = field(default_factory=list)
    # `torch.cuda.is_available()` calls (ids) in the flags that choose the device: they become
    # `accelerator_available()`; or why one stays (a CUDA-only call runs under its flag)
    accelerator_calls: Set[int] = field(default_factory=set)
    kept_flags: List[Tuple[cst.Call, str]] = field(default_factory=list)
    _registered: bool = False

    # -- what fixes ask for -------------------------------------------------------------
    def device_expr(self, index: Optional[cst.BaseExpression], fixing: bool) -> cst.BaseExpression:
        """The expression a fix puts where the script hard-coded a CUDA device. Indices keep
        their meaning: `.cuda(1)` is the second accelerator (`get_device(1)`), `.cuda(i)` the
        i-th; no index, or index 0, is the script's device."""
        literal = literal_int(index) if index is not None else None
        if index is not None and (self.multi_index or literal is None or literal > 0) and not _local_rank(index):
            return cst.Call(func=runtime_name(self.ctx, "get_device", fixing), args=[cst.Arg(index)])
        if fixing:
            self.need_definition()
        return cst.Name(self.name or "device")

    def torch_name(self, attr: str) -> cst.BaseExpression:
        return torch_name(self.ctx, attr)

    def definition_value(self) -> cst.BaseExpression:
        if self.distributed_definition:
            # ddp: the definition sits where the script starts, so it joins the group too
            return cst.Call(func=runtime_name(self.ctx, "setup_distributed"))
        call = cst.Call(func=runtime_name(self.ctx, "get_device"))
        if self.flag is None:
            return call
        cpu = cst.Call(func=self.torch_name("device"), args=[cst.Arg(cst.SimpleString('"cpu"'))])
        return cst.IfExp(test=self.flag.expr.deep_clone(), body=call, orelse=cpu)

    def existing_definition(self, call: cst.Call) -> Optional[DeviceDef]:
        return next((d for d in self.defs if d.call is call), None)

    def redefine(self, d: DeviceDef) -> Optional[cst.BaseExpression]:
        """The new value of a device the script defines itself, or None to keep it:
        `torch.device("cuda:0")` -> `get_device()`, `torch.device("cuda", args.gpu)` ->
        `get_device(args.gpu)`."""
        if d.choice is not None:
            return self.redefine_choice(d.choice)
        if isinstance(d.call, cst.IfExp):
            return self.redefine_choice(d.call)
        if not d.hardcoded:
            return None
        return self._cuda_device(d.call)

    def _cuda_device(self, call: cst.Call) -> cst.Call:
        _, index = torch_device_index(call)
        second = get_arg(call, "index", 1)
        args: List[cst.Arg] = []
        if second is not None and literal_int(second.value) is None and not _local_rank(second.value):
            args = [cst.Arg(second.value.deep_clone())]
        elif index is not None and (self.multi_index or index > 0):
            args = [cst.Arg(cst.Integer(str(index)))]
        return cst.Call(func=runtime_name(self.ctx, "get_device"), args=args)

    def redefine_choice(self, choice: cst.IfExp) -> cst.BaseExpression:
        """`"cuda" if COND else "cpu"` (alone, in `torch.device(...)`, or as
        `torch.device('cuda', i) if COND else torch.device('cpu')`): COND that only asks
        whether CUDA is there is the runtime's job (`get_device()`); a user's flag keeps
        choosing the CPU, and its `torch.cuda.is_available()` asks for any accelerator."""
        cuda_first = _cuda_branch(choice.body)
        accelerator = self._accelerator_device(choice.body if cuda_first else choice.orelse)
        if self.availability_only(choice.test):
            return accelerator
        cpu = cst.Call(func=self.torch_name("device"), args=[cst.Arg(cst.SimpleString('"cpu"'))])
        body, orelse = (accelerator, cpu) if cuda_first else (cpu, accelerator)
        return choice.with_changes(test=self.accelerator_test(choice.test), body=body, orelse=orelse)

    def _accelerator_device(self, cuda: cst.BaseExpression) -> cst.Call:
        if isinstance(cuda, cst.Call):
            return self._cuda_device(cuda)
        _, index = cuda_string_index(literal_str(cuda))  # "cuda:1"
        args = [cst.Arg(cst.Integer(str(index)))] if index is not None and (self.multi_index or index > 0) else []
        return cst.Call(func=runtime_name(self.ctx, "get_device"), args=args)

    def availability_only(self, test: cst.BaseExpression) -> bool:
        """Does COND only ask whether CUDA is there (`torch.cuda.is_available()`,
        `torch.cuda.device_count() > 0`, a name bound once to such a test, combined with
        `and`/`or`/`not`)? Then `get_device()` answers it, for any accelerator."""
        qualify = self.ctx.names.qualify
        for leaf in _boolean_leaves(test):
            if isinstance(leaf, cst.Call) and qualify(leaf.func) == "torch.cuda.is_available":
                continue
            if isinstance(leaf, cst.Comparison) and isinstance(leaf.left, cst.Call) and \
                    qualify(leaf.left.func) == "torch.cuda.device_count":
                continue
            if isinstance(leaf, cst.Name) and self._availability_name(leaf):
                continue
            return False
        return True

    def _availability_name(self, name: cst.Name) -> bool:
        """`use_cuda` in COND, bound once in the file's reach, to `torch.cuda.is_available()`."""
        s = script_model(self.ctx).s
        scope, bindings = s.lookup(name.value, s.scope(name), s.order(name))
        if scope is None or len(scope.bindings.get(name.value, [])) != 1:
            return False
        return any(f.only_availability and bindings[0].stmt is f.stmt.body[0] for f in self.flags)

    def accelerator_test(self, test: cst.BaseExpression) -> cst.BaseExpression:
        """COND with each `torch.cuda.is_available()` asking for any accelerator."""
        calls = [c for c in findall(test, m.Call()) if self.ctx.names.qualify(c.func) == "torch.cuda.is_available"]
        if not calls:
            return test.deep_clone()
        available = cst.Call(func=runtime_name(self.ctx, "accelerator_available"))
        return replace_calls(test, {id(c) for c in calls}, available)

    def accelerator_guard(self, call: cst.Call) -> Optional[Union[cst.If, cst.IfExp]]:
        """`x.cuda() if torch.cuda.is_available() else x`, `if torch.cuda.is_available():`
        around `.cuda()` (a guard that stays): once `.cuda()` is `.to(device)`, the guard must
        ask what `get_device()` answers, or on a Mac the model goes to MPS and the data stays
        on the CPU. The guard, where the call is such a test (not under `not`) and nothing
        under the guard needs CUDA itself."""
        s = script_model(self.ctx).s
        node, parent = call, s.parent(call)
        while isinstance(parent, cst.BooleanOperation):
            node, parent = parent, s.parent(parent)
        if not isinstance(parent, (cst.If, cst.IfExp)) or parent.test is not node:
            return None
        body = parent.body
        qualify = self.ctx.names.qualify
        moves = any(is_method_call(n, "cuda") or (isinstance(n, cst.Attribute) and cuda_type_dtype(qualify(n)))
                    for n in s.index.subtree(body))
        return parent if moves and _cuda_only_in(self.ctx, s, parent) is None else None

    def string_uses(self) -> Tuple[Set[int], List[Tuple[cst.CSTNode, str]]]:
        """A device the script named by a string (`device = "cuda" if ... else "cpu"`) is a
        torch.device once it comes from `get_device()`: where the script reads it as a string,
        `device == "cuda"` (False for any torch.device) becomes `device.type == "cuda"`, and
        `torch.autocast(device_type=device)` takes `device.type`. The ids of the names that
        take `.type`, and the reads no edit makes right (`device.startswith("cuda")`)."""
        return self.ctx.shared("device-string-uses", lambda ctx: _string_uses(self))

    def in_definition(self, call: cst.CSTNode) -> bool:
        """Is this torch.device(...) one branch of a device definition being rewritten whole?"""
        return any(isinstance(d.call, cst.IfExp) and (call is d.call.body or call is d.call.orelse) for d in self.defs)

    def need_definition(self) -> None:
        if self._registered or not (self.define_at_top or self.define_after is not None):
            return
        self._registered = True
        self.ctx.add_finisher("device-definition", self._insert)

    # -- the module edit ----------------------------------------------------------------
    def _statement(self) -> cst.SimpleStatementLine:
        return cst.SimpleStatementLine(
            body=[cst.Assign(targets=[cst.AssignTarget(cst.Name(self.name))], value=self.definition_value())]
        )

    def _insert(self, module: cst.Module) -> cst.Module:
        stmt = self._statement()
        if self.define_at_top:
            at = _after_imports(module)
            stmt = stmt.with_changes(leading_lines=[cst.EmptyLine()] if at else [])
            body = list(module.body)
            return module.with_changes(body=body[:at] + [stmt] + body[at:])
        anchor = self.define_after
        if self.accelerator_calls:  # the flag's line as its fix left it
            anchor = replace_calls(anchor, self.accelerator_calls,
                                  cst.Call(func=runtime_name(self.ctx, "accelerator_available", False)))
        return module.visit(_InsertAfter(anchor, stmt))


class _InsertAfter(cst.CSTTransformer):
    def __init__(self, anchor: cst.SimpleStatementLine, stmt: cst.SimpleStatementLine) -> None:
        super().__init__()
        self.anchor, self.stmt, self.done = anchor, stmt, False

    def on_visit(self, node: cst.CSTNode) -> bool:
        return not self.done and not isinstance(node, cst.BaseExpression)

    def leave_SimpleStatementLine(self, original, updated):
        if not self.done and updated.deep_equals(self.anchor):
            self.done = True
            return cst.FlattenSentinel([updated, self.stmt])
        return updated


def _after_imports(module: cst.Module) -> int:
    """Index after the leading docstring and import block."""
    at = 0
    for i, stmt in enumerate(module.body):
        if isinstance(stmt, cst.SimpleStatementLine) and all(
            isinstance(s, (cst.Import, cst.ImportFrom)) for s in stmt.body
        ):
            at = i + 1
        elif i == 0 and m.matches(stmt, m.SimpleStatementLine(body=[m.Expr(m.SimpleString())])):
            at = 1
        else:
            break
    return at


_SET_UP = ("get_device", "setup_distributed", "grad_scaler")


def set_up_line(module: cst.Module, stmt: cst.CSTNode) -> bool:
    """A line of the set-up block the migrations put after the imports: the device, the
    process group, the gradient scaler."""
    return isinstance(stmt, cst.SimpleStatementLine) and any(
        f"{helper}(" in module.code_for_node(stmt) for helper in _SET_UP)


def _covers(funcs: Tuple[cst.FunctionDef, ...], top: int, sites: List[Site]) -> bool:
    """Is a name bound at (funcs, top) visible at every site?"""
    if not funcs:  # module level: visible in every function; at module level only afterwards
        return all(s.funcs or s.top > top for s in sites)
    return all(len(s.funcs) >= len(funcs) and s.funcs[: len(funcs)] == funcs for s in sites)


def _build(ctx: FileContext) -> DevicePlan:
    scanner = script_model(ctx).devices
    plan = DevicePlan(ctx)
    literal = scanner.indices | {s.index for s in scanner.sites if s.index is not None}
    plan.multi_index = len(literal) > 1
    plan.defs = list(scanner.defs)
    # `.cuda(i)` with a non-literal index, or any index under model parallelism, becomes
    # `get_device(i)`; every other site refers to the one device variable.
    needing = [s for s in scanner.sites if s.literal_index and not (s.index is not None and plan.multi_index)]
    flags = list(scanner.flags)
    if not flags and scanner.cuda_argument and scanner.args_name:
        name, stmt, funcs, top = scanner.args_name
        flags.append(Flag(f"{name}.cuda", cst.parse_expression(f"{name}.cuda"), stmt, funcs, top, False))
    plan.flags = flags
    plan.guard_flags = {f.code for f in flags if f.only_availability}
    plan.guard_flags.add("torch.cuda.is_available()")
    # Reuse a device the script already builds, if every use can see it.
    for d in scanner.defs:
        if _covers(d.funcs, d.top, needing):
            plan.name = d.name
            break
    else:
        if scanner.defs and not needing:
            plan.name = scanner.defs[0].name
    # the flags the script's own choice of device reads: `"cuda" if args.cuda else "cpu"`
    chosen_by = {ctx.module.code_for_node(n) for d in scanner.defs if d.choice is not None
                 and not plan.availability_only(d.choice.test) for n in _operands(d.choice.test)}
    s = script_model(ctx).s
    # ... and those that guard a `.cuda()` that becomes `.to(device)`: device and guard must agree
    chosen = [f for f in flags if f.code in chosen_by or not f.only_availability and _moves_under(ctx, s, f)]
    if plan.name is not None or not needing:
        _accelerator_flags(plan, chosen)
        return plan
    plan.name = fresh_name(ctx, "device")
    user_flags = [f for f in flags if not f.only_availability]
    flag = user_flags[-1] if user_flags else None
    if flag is not None and _covers(flag.funcs, flag.top, needing):
        plan.flag = flag
        plan.define_after = flag.stmt
        plan.guard_flags.add(flag.code)
    else:
        plan.define_at_top = True
        plan.ignored_flag = flag
    _accelerator_flags(plan, chosen + [f for f in [plan.flag] if f is not None and all(f is not c for c in chosen)])
    return plan


# torch.cuda calls that do not need CUDA (they wait, return 0 or nothing, or are rewritten by
# the device rules): a flag that guards only these may mean "an accelerator"
_HARMLESS = frozenset({
    "is_available", "device_count", "is_initialized", "manual_seed", "manual_seed_all", "seed", "seed_all",
    "empty_cache", "memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved",
    "memory_cached", "max_memory_cached", "reset_peak_memory_stats", "reset_max_memory_allocated",
    "memory_stats", "memory_summary", "synchronize", "set_device", *CUDA_TYPES,
})


def _accelerator_flags(plan: DevicePlan, flags: List[Flag]) -> None:
    """`args.cuda = not args.no_cuda and torch.cuda.is_available()`, read by the device's
    definition: its `torch.cuda.is_available()` becomes `accelerator_available()`, so that the
    flag means "an accelerator unless --no-cuda" and a Mac's GPU is used. Only for a flag
    that is a plain condition (names, `and`/`or`/`not`), and where no CUDA-only call
    (`torch.cuda.get_device_name()`) runs under it; such a flag is kept and said."""
    qualify = plan.ctx.names.qualify
    s = script_model(plan.ctx).s
    for flag in flags:
        value = flag.stmt.body[0].value
        leaves = list(_boolean_leaves(value))
        if not all(isinstance(leaf, (cst.Name, cst.Attribute)) or (isinstance(leaf, cst.Call) and
                   qualify(leaf.func) == "torch.cuda.is_available") for leaf in leaves):
            continue
        calls = [leaf for leaf in leaves if isinstance(leaf, cst.Call)]
        cuda_only = _cuda_only_under(plan.ctx, s, flag)
        if cuda_only is not None:
            what = "a `map_location` is chosen by it" if cuda_only == "map_location" else \
                f"`{cuda_only}` runs under it and needs CUDA"
            plan.kept_flags += [(c, f"`{flag.code}` keeps asking for CUDA only (`torch.cuda.is_available()`): "
                                    f"{what}; on a Mac or another accelerator the script stays on the CPU")
                                for c in calls]
            continue
        plan.accelerator_calls.update(id(c) for c in calls)


def _guarded_by(ctx: FileContext, s, flag: Flag) -> List[Union[cst.If, cst.IfExp]]:
    """The `if`s and `... if ... else`s that test `flag`."""
    render = ctx.module.code_for_node
    return [node for node in [*s.index.of(cst.If), *s.index.of(cst.IfExp)]
            if any(render(n) == flag.code for n in _operands(node.test))]


def _moves_under(ctx: FileContext, s, flag: Flag) -> bool:
    """Does `flag` guard a `.cuda()` or a CUDA tensor type (a move the device rules fix)?"""
    return any(is_method_call(n, "cuda") or (isinstance(n, cst.Attribute) and cuda_type_dtype(ctx.names.qualify(n)))
               for node in _guarded_by(ctx, s, flag) for n in s.index.subtree(node))


def _cuda_only_under(ctx: FileContext, s, flag: Flag) -> Optional[str]:
    """A `torch.cuda.*` call that needs CUDA, or a `map_location` chosen (None on the GPU
    meant "where it was saved": CUDA), in an `if`/`... if ... else` that tests `flag`."""
    for node in _guarded_by(ctx, s, flag):
        found = _cuda_only_in(ctx, s, node)
        if found is not None:
            return found
        parent = s.parent(node)
        if isinstance(parent, cst.Arg) and parent.keyword is not None and parent.keyword.value == "map_location" \
                or any(isinstance(n, cst.Arg) and n.keyword is not None and n.keyword.value == "map_location"
                       for n in s.index.subtree(node)):
            return "map_location"
    return None


def _cuda_only_in(ctx: FileContext, s, node: cst.CSTNode) -> Optional[str]:
    for call in s.index.subtree(node):
        if isinstance(call, cst.Call):
            qualified = ctx.names.qualify(call.func) or ""
            if qualified.startswith("torch.cuda.") and qualified.count(".") == 2 and \
                    qualified.rsplit(".", 1)[1] not in _HARMLESS:
                return ctx.module.code_for_node(call.func) + "()"
    return None


_DEVICE_TYPES = ("cuda", "cpu", "mps", "xpu")


def _string_uses(plan: DevicePlan) -> Tuple[Set[int], List[Tuple[cst.CSTNode, str]]]:
    defs = {id(d.stmt.body[0]): d for d in plan.defs if d.string}
    typed: Set[int] = set()
    reviews: List[Tuple[cst.CSTNode, str]] = []
    if not defs:
        return typed, reviews
    s = script_model(plan.ctx).s
    names = {d.name for d in defs.values()}
    render = plan.ctx.module.code_for_node
    for node in s.index.of(cst.Name):
        if node.value not in names:
            continue
        _, bindings = s.lookup(node.value, s.scope(node), s.order(node))
        ours = [b for b in bindings if id(b.stmt) in defs]
        if not ours or any(node is t.target for b in ours for t in b.stmt.targets):
            continue
        parent = s.parent(node)
        if isinstance(parent, cst.ComparisonTarget):
            parent = s.parent(parent)
        need_type = False
        if isinstance(parent, cst.Comparison):
            others = [o for o in (parent.left, *(t.comparator for t in parent.comparisons)) if o is not node]
            if not all(_device_types(o) for o in others):
                reviews.append((parent, f"`{node.value}` is a torch.device now (`get_device()`), not a string: "
                                        f"check `{render(parent)}`"))
                continue
            need_type = True
        elif isinstance(parent, cst.Arg) and parent.value is node and parent.keyword is not None \
                and parent.keyword.value == "device_type":
            need_type = True
        elif isinstance(parent, cst.Attribute) and parent.value is node and hasattr(str, parent.attr.value) \
                or isinstance(parent, (cst.BinaryOperation, cst.Subscript)):
            reviews.append((parent, f"`{node.value}` is a torch.device now (`get_device()`), not a string: "
                                    f"check `{render(parent)}`"))
            continue
        if need_type and len(ours) < len(bindings):  # a string here too, at times
            reviews.append((parent, f"`{node.value}` is a torch.device or a string here: check `{render(parent)}`"))
        elif need_type:
            typed.add(id(node))
    return typed, reviews


def _device_types(node: cst.BaseExpression) -> bool:
    """"cuda", or ("cuda", "mps"): device types, which `device.type` is compared with."""
    if isinstance(node, (cst.Tuple, cst.List, cst.Set)):
        return bool(node.elements) and all(_device_types(e.value) for e in node.elements)
    return literal_str(node) in _DEVICE_TYPES


def _operands(test: cst.BaseExpression) -> List[cst.BaseExpression]:
    """The names and attributes a condition reads (`args.cuda`, `args`, `use_cuda`; not the
    `cuda` of `torch.cuda`)."""
    found = findall(test, m.OneOf(m.Name(), m.Attribute()))
    attrs = {id(n.attr) for n in found if isinstance(n, cst.Attribute)}
    return [n for n in found if id(n) not in attrs]


def _boolean_leaves(node: cst.BaseExpression):
    """The operands of a condition made with `and`, `or` and `not`."""
    if isinstance(node, cst.BooleanOperation):
        yield from _boolean_leaves(node.left)
        yield from _boolean_leaves(node.right)
    elif isinstance(node, cst.UnaryOperation) and isinstance(node.operator, cst.Not):
        yield from _boolean_leaves(node.expression)
    else:
        yield node


def _cuda_branch(node: cst.BaseExpression) -> bool:
    """"cuda[:n]", or `torch.device("cuda", ...)`: the branch of a choice that picks CUDA."""
    if isinstance(node, cst.Call):
        return torch_device_index(node)[0]
    return cuda_string_index(literal_str(node))[0]


def replace_calls(node: cst.BaseExpression, ids: Set[int], new: cst.BaseExpression) -> cst.BaseExpression:
    """`node` with the calls whose ids are given (nodes of the original tree) replaced by `new`."""
    class Swap(cst.CSTTransformer):
        def leave_Call(self, original, updated):
            return new.deep_clone() if id(original) in ids else updated
    return node.visit(Swap())


def _local_rank(index: cst.BaseExpression) -> bool:
    """`args.local_rank`: under torchrun that is what `get_device()` picks anyway."""
    name = cst.Module(body=[]).code_for_node(index)
    return name.endswith("local_rank") or "LOCAL_RANK" in name


def device_plan(ctx: FileContext) -> DevicePlan:
    return ctx.shared("device-plan", _build)
