"""Where the migrated script gets its device from: one shared, per-file decision.

Every fix that needs "the device" (GM101 `.cuda()`, GM102 CUDA tensor types, GM103 hard-coded
devices, GM105 `torch.load`) asks this plan for an expression. The plan decides once per file:
reuse a `device` the script already builds, or insert exactly one `device = get_device()`
where every use can see it (after the imports, or after the script's `--no-cuda`-style flag
so that the flag still selects the CPU).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import List, Optional, Set, Tuple

import libcst as cst
import libcst.matchers as m

from gpumigrate.codemods.helpers import findall, get_arg, is_method_call, keyword_arg, literal_int, literal_str
from gpumigrate.rewriter.engine import FileContext

RUNTIME = "gpumigrate.runtime"
CUDA_TYPES = {
    "FloatTensor": "float32", "DoubleTensor": "float64", "HalfTensor": "float16",
    "BFloat16Tensor": "bfloat16", "LongTensor": "int64", "IntTensor": "int32",
    "ShortTensor": "int16", "CharTensor": "int8", "ByteTensor": "uint8", "BoolTensor": "bool",
}
_CUDA_STRING = re.compile(r"^cuda(?::(\d+))?$")


def cuda_string_index(value: Optional[str]) -> Tuple[bool, Optional[int]]:
    """("cuda:1") -> (True, 1); ("cuda") -> (True, None); anything else -> (False, None)."""
    match = _CUDA_STRING.match(value or "")
    if not match:
        return False, None
    return True, int(match.group(1)) if match.group(1) else None


def torch_device_index(call: cst.Call) -> Tuple[bool, Optional[int]]:
    """torch.device("cuda:1") / torch.device("cuda", 1) -> (True, 1)."""
    first = get_arg(call, "type", 0)
    is_cuda, index = cuda_string_index(literal_str(first.value) if first else None)
    second = get_arg(call, "index", 1)
    if second is not None:
        index = literal_int(second.value)
    return is_cuda, index


def cuda_type_dtype(qualified: Optional[str]) -> Optional[str]:
    if qualified and qualified.startswith("torch.cuda."):
        return CUDA_TYPES.get(qualified[len("torch.cuda."):])
    return None


@dataclass
class DeviceDef:
    name: str
    stmt: cst.SimpleStatementLine
    call: cst.BaseExpression  # torch.device(...), get_device(...), or an IfExp choosing between devices
    funcs: Tuple[cst.FunctionDef, ...]
    top: int  # statement order in the file
    hardcoded: bool


@dataclass
class Flag:
    code: str  # how the script spells it: `args.cuda`, `use_cuda`
    expr: cst.BaseExpression
    stmt: cst.SimpleStatementLine
    funcs: Tuple[cst.FunctionDef, ...]
    top: int
    only_availability: bool  # `cuda = torch.cuda.is_available()`: not a user choice


@dataclass
class Site:
    top: int
    funcs: Tuple[cst.FunctionDef, ...]
    index: Optional[int]
    literal_index: bool  # no index, or a literal one


class _Scanner(cst.CSTVisitor):
    def __init__(self, ctx: FileContext) -> None:
        super().__init__()
        self.ctx = ctx
        self.funcs: List[cst.FunctionDef] = []
        self.top = -1
        self.stmt: Optional[cst.SimpleStatementLine] = None
        self.sites: List[Site] = []
        self.defs: List[DeviceDef] = []
        self.flags: List[Flag] = []
        self.bound: Set[str] = set()
        self.args_name: Optional[Tuple[str, cst.SimpleStatementLine, tuple, int]] = None
        self.cuda_argument = False
        self.indices: Set[int] = set()
        self.def_calls: Set[int] = set()  # a definition's own torch.device(...) is not a use

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.bound.add(node.name.value)
        self.funcs.append(node)

    def leave_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.funcs.pop()

    def visit_Param(self, node: cst.Param) -> None:
        self.bound.add(node.name.value)

    def visit_SimpleStatementLine(self, node: cst.SimpleStatementLine) -> None:
        self.top += 1  # statements in source order: "after" for module-level names
        self.stmt = node
        if len(node.body) == 1 and isinstance(node.body[0], cst.Assign) and len(node.body[0].targets) == 1:
            self._assignment(node, node.body[0].targets[0].target, node.body[0].value)

    def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
        for target in findall(node.target, m.Name()):
            self.bound.add(target.value)

    def visit_For(self, node: cst.For) -> None:
        for target in findall(node.target, m.Name()):
            self.bound.add(target.value)

    def _here(self) -> Tuple[Tuple[cst.FunctionDef, ...], int]:
        return tuple(self.funcs), self.top

    def _assignment(self, stmt: cst.SimpleStatementLine, target: cst.BaseExpression, value: cst.BaseExpression) -> None:
        names = self.ctx.names
        funcs, top = self._here()
        if isinstance(target, cst.Name) and isinstance(value, cst.Call):
            qualified = names.qualify(value.func)
            if qualified == "torch.device":
                first = get_arg(value, "type", 0)
                is_cuda, _ = cuda_string_index(literal_str(first.value) if first else None)
                self.defs.append(DeviceDef(target.value, stmt, value, funcs, top, hardcoded=is_cuda))
                self.def_calls.add(id(value))
                return
            if qualified in (f"{RUNTIME}.get_device", f"{RUNTIME}.setup_distributed"):
                self.defs.append(DeviceDef(target.value, stmt, value, funcs, top, hardcoded=False))
                return
            if qualified in ("argparse.ArgumentParser.parse_args",) or is_method_call(value, "parse_args"):
                self.args_name = (target.value, stmt, funcs, top)
        if isinstance(target, cst.Name) and isinstance(value, cst.IfExp):
            # device = torch.device('cuda', args.local_rank) if torch.cuda.is_available() else torch.device('cpu')
            branches = [b for b in (value.body, value.orelse)
                        if isinstance(b, cst.Call) and names.qualify(b.func) == "torch.device"]
            if len(branches) == 2:
                hardcoded = any(torch_device_index(b)[0] for b in branches)
                self.defs.append(DeviceDef(target.value, stmt, value, funcs, top, hardcoded=hardcoded))
                self.def_calls.update(id(b) for b in branches)
                self.def_calls.add(id(value))
                return
        if isinstance(target, (cst.Name, cst.Attribute)) and not _mentions_device(value, names):
            availability = [c for c in findall(value, m.Call()) if names.qualify(c.func) == "torch.cuda.is_available"]
            if availability:
                inside = {id(n) for call in availability for n in findall(call, m.Name())}
                only = all(
                    n.value in ("True", "False") for n in findall(value, m.Name()) if id(n) not in inside
                )
                code = self.ctx.module.code_for_node(target)
                self.flags.append(Flag(code, target, stmt, funcs, top, only))

    def visit_Call(self, node: cst.Call) -> None:
        names = self.ctx.names
        funcs, top = self._here()
        if is_method_call(node, "cuda"):
            arg = get_arg(node, "device", 0)
            index = literal_int(arg.value) if arg else None
            self.sites.append(Site(top, funcs, index, arg is None or index is not None))
            return
        if is_method_call(node, "add_argument"):
            first = get_arg(node, "", 0)
            if first and literal_str(first.value) == "--cuda":
                self.cuda_argument = True
            return
        qualified = names.qualify(node.func)
        if qualified == "torch.device":
            is_cuda, index = torch_device_index(node)
            if is_cuda and id(node) not in self.def_calls:
                self.sites.append(Site(top, funcs, index, True))
            elif is_cuda and index is not None:
                self.indices.add(index)  # a definition's index counts toward model parallelism
            return
        if qualified == "torch.load" and get_arg(node, "map_location", 1) is None:
            self.sites.append(Site(top, funcs, None, True))
        if cuda_type_dtype(qualified):
            self.sites.append(Site(top, funcs, None, True))
        for arg in node.args:
            if arg.keyword is None or arg.keyword.value == "device":
                is_cuda, index = cuda_string_index(literal_str(arg.value))
                if is_cuda and (arg.keyword is not None or is_method_call(node, "to")):
                    self.sites.append(Site(top, funcs, index, True))

    def visit_Attribute(self, node: cst.Attribute) -> None:
        if cuda_type_dtype(self.ctx.names.qualify(node)):
            funcs, top = self._here()
            self.sites.append(Site(top, funcs, None, True))


def _mentions_device(value: cst.BaseExpression, names) -> bool:
    return any(names.qualify(c.func) == "torch.device" for c in findall(value, m.Call()))


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
    _registered: bool = False

    # -- what fixes ask for -------------------------------------------------------------
    def device_expr(self, index: Optional[cst.BaseExpression], fixing: bool) -> cst.BaseExpression:
        """The expression a fix puts where the script hard-coded a CUDA device."""
        literal = literal_int(index) if index is not None else None
        if index is not None and (self.multi_index or literal is None):
            if fixing:
                self.ctx.add_import(RUNTIME, "get_device")
            return cst.Call(func=cst.Name("get_device"), args=[cst.Arg(index)])
        if fixing:
            self._need_definition()
        return cst.Name(self.name or "device")

    def torch_name(self, attr: str) -> cst.BaseExpression:
        local = self.ctx.names.local_name_for(f"torch.{attr}")
        if local is None:
            self.ctx.add_import("torch")
            local = f"torch.{attr}"
        return cst.parse_expression(local)

    @property
    def distributed(self) -> bool:
        """The ddp migration: the device comes from `setup_distributed()`, which also joins
        the process group (GM400 is the DDP set-up rule)."""
        if "GM400" not in self.ctx.fixing:
            return False
        from gpumigrate.codemods.distributed import training_script  # the ddp rules build on this module

        return training_script(self.ctx)

    def definition_value(self, index: Optional[int] = None) -> cst.BaseExpression:
        flag = self.flag.expr.deep_clone() if self.flag is not None else None
        if self.distributed:
            self.ctx.add_import(RUNTIME, "setup_distributed")
            args = [keyword_arg("use_accelerator", flag)] if flag is not None else []
            return cst.Call(func=cst.Name("setup_distributed"), args=args)
        self.ctx.add_import(RUNTIME, "get_device")
        args = [cst.Arg(cst.Integer(str(index)))] if (self.multi_index and index is not None) else []
        call = cst.Call(func=cst.Name("get_device"), args=args)
        if flag is None:
            return call
        cpu = cst.Call(func=self.torch_name("device"), args=[cst.Arg(cst.SimpleString('"cpu"'))])
        return cst.IfExp(test=flag, body=call, orelse=cpu)

    def existing_definition(self, call: cst.Call) -> Optional[DeviceDef]:
        return next((d for d in self.defs if d.call is call), None)

    def redefine(self, d: DeviceDef) -> Optional[cst.BaseExpression]:
        """The new value of a device the script defines itself, or None to keep it.

        `torch.device("cuda:0")` -> `get_device()`; under ddp every definition becomes
        `setup_distributed(...)`, keeping a `use_cuda`-style choice of the CPU."""
        if isinstance(d.call, cst.IfExp):
            return self._redefine_choice(d.call)
        if not self.distributed:
            if not d.hardcoded:
                return None
            _, index = torch_device_index(d.call)
            self.ctx.add_import(RUNTIME, "get_device")
            args = [cst.Arg(cst.Integer(str(index)))] if self.multi_index and index is not None else []
            return cst.Call(func=cst.Name("get_device"), args=args)
        if self.ctx.names.qualify(d.call.func) == f"{RUNTIME}.setup_distributed":
            return None
        first = get_arg(d.call, "type", 0)
        chooses = first is not None and isinstance(first.value, cst.IfExp) and all(
            literal_str(b) is not None for b in (first.value.body, first.value.orelse))
        if not (d.hardcoded or chooses or self.ctx.names.qualify(d.call.func) == f"{RUNTIME}.get_device"):
            return None  # torch.device(args.device), torch.device(kind, i): the user's own choice
        self.ctx.add_import(RUNTIME, "setup_distributed")
        args = []
        test = first.value.test if chooses else None
        if test is not None and not findall(test, m.Call(func=m.Attribute(attr=m.Name("is_available")))):
            args = [keyword_arg("use_accelerator", test.deep_clone())]
        return cst.Call(func=cst.Name("setup_distributed"), args=args)

    def _redefine_choice(self, choice: cst.IfExp) -> cst.BaseExpression:
        """`torch.device('cuda', i) if COND else torch.device('cpu')`: COND that only asks for
        CUDA is the runtime's job; a user's flag keeps choosing the CPU."""
        test = choice.test
        user_flag = not findall(test, m.Call(func=m.Attribute(attr=m.Name("is_available"))))
        if self.distributed:
            self.ctx.add_import(RUNTIME, "setup_distributed")
            args = [keyword_arg("use_accelerator", test.deep_clone())] if user_flag else []
            return cst.Call(func=cst.Name("setup_distributed"), args=args)
        self.ctx.add_import(RUNTIME, "get_device")
        call = cst.Call(func=cst.Name("get_device"))
        if not user_flag:
            return call
        cpu = cst.Call(func=self.torch_name("device"), args=[cst.Arg(cst.SimpleString('"cpu"'))])
        return cst.IfExp(test=test.deep_clone(), body=call, orelse=cpu)

    def in_definition(self, call: cst.CSTNode) -> bool:
        """Is this torch.device(...) one branch of a device definition being rewritten whole?"""
        return any(isinstance(d.call, cst.IfExp) and (call is d.call.body or call is d.call.orelse) for d in self.defs)

    def require_definition(self) -> None:
        """ddp: every script joins the process group, with or without device uses."""
        if self.name is None or self.define_at_top or self.define_after is not None:
            self._need_definition()

    def _need_definition(self) -> None:
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


def _covers(funcs: Tuple[cst.FunctionDef, ...], top: int, sites: List[Site]) -> bool:
    """Is a name bound at (funcs, top) visible at every site?"""
    if not funcs:  # module level: visible in every function; at module level only afterwards
        return all(s.funcs or s.top > top for s in sites)
    return all(len(s.funcs) >= len(funcs) and s.funcs[: len(funcs)] == funcs for s in sites)


def _build(ctx: FileContext) -> DevicePlan:
    scanner = _Scanner(ctx)
    ctx.module.visit(scanner)
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
    if not needing and not plan.distributed:
        return plan
    plan.name = "device" if "device" not in scanner.bound else "torch_device"
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


def device_plan(ctx: FileContext) -> DevicePlan:
    return ctx.shared("device-plan", _build)
