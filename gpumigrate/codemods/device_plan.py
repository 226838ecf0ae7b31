"""Where the migrated script gets its device from: one shared, per-file decision.

Every fix that needs "the device" (GM101 `.cuda()`, GM102 CUDA tensor types, GM103 hard-coded
devices, GM105 `torch.load`) asks this plan for an expression. The plan decides once per file:
reuse a `device` the script already builds, or insert exactly one `device = get_device()`
where every use can see it (after the imports, or after the script's `--no-cuda`-style flag
so that the flag still selects the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Set, Tuple

import libcst as cst

from gpumigrate.analysis import script_model
from gpumigrate.analysis.devices import (  # noqa: F401  (rules import these from the plan)
    DeviceDef,
    Flag,
    Site,
    cuda_string_index,
    cuda_type_dtype,
    torch_device_index,
)
from gpumigrate.codemods.helpers import findall, fresh_name, get_arg, literal_int, runtime_name, torch_name
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
        if isinstance(d.call, cst.IfExp):
            return self._redefine_choice(d.call)
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

    def _redefine_choice(self, choice: cst.IfExp) -> cst.BaseExpression:
        """`torch.device('cuda', i) if COND else torch.device('cpu')`: COND that only asks for
        CUDA is the runtime's job; a user's flag keeps choosing the CPU."""
        test = choice.test
        user_flag = not findall(test, m.Call(func=m.Attribute(attr=m.Name("is_available"))))
        cuda = next(b for b in (choice.body, choice.orelse) if torch_device_index(b)[0])
        call = self._cuda_device(cuda)
        if not user_flag:
            return call
        cpu = cst.Call(func=self.torch_name("device"), args=[cst.Arg(cst.SimpleString('"cpu"'))])
        return cst.IfExp(test=test.deep_clone(), body=call, orelse=cpu)

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
        return module.visit(_InsertAfter(self.define_after, stmt))


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
    plan.guard_flags = {f.code for f in flags if f.only_availability}
    plan.guard_flags.add("torch.cuda.is_available()")
    # Reuse a device the script already builds, if every use can see it.
    for d in scanner.defs:
        if _covers(d.funcs, d.top, needing):
            plan.name = d.name
            return plan
    if not needing and scanner.defs:
        plan.name = scanner.defs[0].name
        return plan
    if not needing:
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
    return plan


def _local_rank(index: cst.BaseExpression) -> bool:
    """`args.local_rank`: under torchrun that is what `get_device()` picks anyway."""
    name = cst.Module(body=[]).code_for_node(index)
    return name.endswith("local_rank") or "LOCAL_RANK" in name


def device_plan(ctx: FileContext) -> DevicePlan:
    return ctx.shared("device-plan", _build)
