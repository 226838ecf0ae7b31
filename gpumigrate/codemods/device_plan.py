"""Where the migrated script gets its device from: one shared, per-file decision.

Every fix that needs "the device" (GM101 `.cuda()`, GM102 CUDA tensor types, GM103 hard-coded
devices, GM105 `torch.load`) asks this plan for an expression. The plan decides once per file:
reuse a `device` the script already builds, or insert exactly one `device = get_device()`
where every use can see it (after the imports, or after the script's `--no-cuda`-style flag
so that the flag still selects the CPU). A definition is reused, or placed after a flag, only
where it is bound before every use on every path (never after a use in the same function).

It also decides what each name the script binds to a CUDA device's name becomes
(`dev = "cuda"`, `self.device = f"cuda:{i}"`, `--device` defaulting to `"cuda"`): the
runtime's device, a string naming it (where the script reads the name as a string too), or
nothing (a device type such as `device_type = "cuda" if ... else "cpu"`, read by autocast).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Set, Tuple, Union

import libcst as cst

from gpumigrate.analysis import script_model
from gpumigrate.analysis.devices import (  # noqa: F401  (rules import these from the plan)
    CUDA_TYPES,
    DEVICE,
    NEUTRAL,
    STRING,
    TYPE,
    UNKNOWN,
    CudaName,
    DeviceDef,
    Flag,
    NamedDevice,
    Site,
    cuda_name,
    cuda_type_dtype,
    local_rank_index,
    named_devices,
    torch_device_index,
)
from gpumigrate.analysis.structure import Structure
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
    # names bound to CUDA device names (by the id of each value bound), and what each becomes:
    # `"device"`, the runtime's torch.device (`get_device()`: its reads as a device type take
    # `.type`); `"string"`, a string naming that device (`get_device().type`,
    # `str(get_device(1))`: the script reads it as a string too, or it is a command-line flag);
    # absent, kept (a device type); with what a reviewer must check
    named: Dict[int, NamedDevice] = field(default_factory=dict)
    modes: Dict[int, str] = field(default_factory=dict)
    reviews: Dict[int, List[Tuple[cst.CSTNode, str]]] = field(default_factory=dict)
    typed: Set[int] = field(default_factory=set)  # reads that take `.type` (a device type's)
    device_reads: Set[int] = field(default_factory=set)  # reads of the names that become devices
    # `torch.cuda.is_available()` (ids) choosing between such a name and the CPU
    # (`args.device if torch.cuda.is_available() else "cpu"`): `accelerator_available()`
    choice_calls: Set[int] = field(default_factory=set)
    _registered: bool = False

    # -- what fixes ask for -------------------------------------------------------------
    def device_expr(self, index: Optional[cst.BaseExpression], fixing: bool) -> cst.BaseExpression:
        """The expression a fix puts where the script hard-coded a CUDA device. Indices keep
        their meaning: `.cuda(1)` is the second accelerator (`get_device(1)`), `.cuda(i)` the
        i-th; no index, or index 0, is the script's device."""
        literal = literal_int(index) if index is not None else None
        if index is not None and (self.multi_index or literal is None or literal > 0) and not local_rank_index(index):
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
        first = get_arg(call, "type", 0)
        named = cuda_name(first.value) if first is not None else None
        if named is not None and named.computed is not None:  # torch.device(f"cuda:{i}")
            return self.runtime_device(named)
        _, index = torch_device_index(call)
        second = get_arg(call, "index", 1)
        args: List[cst.Arg] = []
        if second is not None and literal_int(second.value) is None and not local_rank_index(second.value):
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
        named = cuda_name(cuda)
        if named is None:  # torch.device("cuda", 1)
            return self._cuda_device(cuda)
        return self.runtime_device(named)

    def runtime_device(self, named: CudaName, fixing: bool = True) -> cst.Call:
        """`"cuda:1"` -> `get_device(1)`, `f"cuda:{i}"` -> `get_device(i)`; `"cuda"`,
        `"cuda:0"` and LOCAL_RANK's -> `get_device()`."""
        if named.computed is not None:
            index = None if local_rank_index(named.computed) else named.computed.deep_clone()
        else:
            index = cst.Integer(str(named.index)) if named.index is not None and (
                self.multi_index or named.index > 0) else None
        return cst.Call(func=runtime_name(self.ctx, "get_device", fixing), args=[cst.Arg(index)] if index else [])

    def device_name(self, named: CudaName) -> cst.BaseExpression:
        """A string naming the runtime's device, for a script that reads the name as a string:
        `"cuda"` -> `get_device().type` ("cuda", "mps", "cpu"...: compared as before),
        `"cuda:1"` -> `str(get_device(1))`."""
        device = self.runtime_device(named)
        if named.index is None and named.computed is None:
            return cst.Attribute(value=device, attr=cst.Name("type"))
        return cst.Call(func=cst.Name("str"), args=[cst.Arg(device)])

    def rewrite_named(self, value: cst.BaseExpression) -> Optional[cst.BaseExpression]:
        """The new value of a CUDA device name bound to a name the plan decided about."""
        mode = self.mode(value)
        if mode is None:
            return None
        if isinstance(value, cst.IfExp):
            return self.redefine_choice(value) if mode == DEVICE else self._name_choice(value)
        named = cuda_name(value)
        return self.runtime_device(named) if mode == DEVICE else self.device_name(named)

    def mode(self, value: cst.BaseExpression) -> Optional[str]:
        """What a CUDA device name bound to a name becomes (see `modes`), None if kept."""
        holder = self.named.get(id(value))
        return self.modes.get(id(holder)) if holder is not None else None

    def _name_choice(self, choice: cst.IfExp) -> cst.BaseExpression:
        """`"cuda" if COND else "cpu"` kept a string: the CUDA branch names the runtime's device."""
        cuda_first = _cuda_branch(choice.body)
        name = self.device_name(cuda_name(choice.body if cuda_first else choice.orelse))
        if self.availability_only(choice.test):
            return name
        cpu = choice.orelse if cuda_first else choice.body
        body, orelse = (name, cpu) if cuda_first else (cpu, name)
        return choice.with_changes(test=self.accelerator_test(choice.test), body=body, orelse=orelse)

    def holds_device(self, node: cst.BaseExpression) -> bool:
        """A read of a name the plan makes a device (or a device's name): `.cuda(dev)` moves to it."""
        return id(node) in self.device_reads

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
        moves = any(self.moves(n) for n in s.index.subtree(parent.body))
        return parent if moves and _cuda_only_in(self.ctx, s, parent) is None else None

    def moves(self, node: cst.CSTNode) -> bool:
        """A move the device rules point at the runtime's device: `.cuda()`, a CUDA tensor
        type, `.to("cuda:1")`, `.to(f"cuda:{i}")`, `.to(dev)` with `dev = "cuda"`."""
        if is_method_call(node, "cuda") or isinstance(node, cst.Attribute) and cuda_type_dtype(
                self.ctx.names.qualify(node)):
            return True
        if not is_method_call(node, "to"):
            return False
        target = get_arg(node, "device", 0)
        return target is not None and (cuda_name(target.value) is not None or self.holds_device(target.value))

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


def _reaches(s: Structure, stmt: cst.SimpleStatementLine, sites: List[Site], name: Optional[str] = None,
             also: Sequence[cst.SimpleStatementLine] = (), main_runs: bool = True) -> bool:
    """Is a name bound by `stmt` bound before every site, on every path there? A site in the
    same function (or at module level, for a module-level name) must come after `stmt` in its
    block (not before it, not beside it in another branch; an `if`/`else` that binds it in
    every branch, `also` holding the other branches' lines, counts as binding it); a function
    nested in that function must be defined there after it; a function of the module must not
    run (from module-level code) before it, and the name must not be bound only in a branch.
    `name`: the site must see this binding, not one of its own scope's (a local `device`).
    `main_runs`: an `if __name__ == "__main__":` block runs before the functions are called
    (not so where another module imports them)."""
    small = stmt.body[0]
    scope = s.scope(small)  # where the statement runs; the name lives in `bound`
    bound = s.scopes[id(s.module)] if name is not None and name in scope.globals else scope
    line = _binding_line(s, stmt, {id(a) for a in (stmt, *also)})
    block = s.block(line)
    if block is None:
        return False
    after, block_end = s.index.end[id(line)], s.index.end[id(block)]
    early: Optional[Set[int]] = None
    for site in sites:
        inner = s.scope(site.node)
        chain, current = [], inner  # the scopes from the site's out to the statement's
        while current is not None and current is not scope:
            chain.append(current)
            current = current.parent
        if current is None or name is not None and s.lookup(name, inner)[0] is not bound:
            return False
        anchor = chain[-1].node if chain else site.node
        if not chain or not scope.is_module or isinstance(anchor, cst.ClassDef):  # a class body runs at once
            if not after <= s.order(anchor) < block_end:
                return False
            continue
        if not _unconditional(s, line, main_runs):
            return False
        if early is None:
            early = _run_before(s, line)
        if any(id(sc.node) in early for sc in chain):
            return False
    return True


def _binding_line(s: Structure, stmt: cst.CSTNode, lines: Set[int]) -> cst.CSTNode:
    """The statement after which a name is bound on every path: `stmt`, or the `if` around it
    whose every branch (`elif`s and `else` too) binds it in one of `lines`."""
    line = stmt
    while True:
        owner = s.parent(s.block(line))
        if isinstance(owner, cst.Else):
            owner = s.parent(owner)
        if not isinstance(owner, cst.If):
            return line
        while isinstance(s.parent(owner), cst.If) and s.parent(owner).orelse is owner:
            owner = s.parent(owner)  # the head of an `elif` chain
        if not _binds_in_every_branch(owner, lines):
            return line
        line = owner


def _binds_in_every_branch(node: cst.If, lines: Set[int]) -> bool:
    def binds(suite: cst.BaseSuite) -> bool:
        return isinstance(suite, cst.IndentedBlock) and any(id(line) in lines for line in suite.body)

    if not binds(node.body):
        return False
    if isinstance(node.orelse, cst.If):
        return _binds_in_every_branch(node.orelse, lines)
    return node.orelse is not None and binds(node.orelse.body)


def _unconditional(s: Structure, stmt: cst.CSTNode, main_runs: bool = True) -> bool:
    """A module-level statement that runs whenever the script runs: not in a branch, loop or
    handler (an `if __name__ == "__main__":` block runs, where `main_runs`)."""
    for node in s.ancestors(stmt):
        if isinstance(node, (cst.If, cst.Else, cst.For, cst.While, cst.Try, cst.ExceptHandler, cst.Match)) and \
                not (main_runs and m.matches(node, m.If(test=m.Comparison(left=m.Name("__name__"))))):
            return False
    return True


def _run_before(s: Structure, stmt: cst.CSTNode) -> Set[int]:
    """The functions of this file that module-level code runs before `stmt`."""
    module = s.scopes[id(s.module)]
    at = s.order(stmt)
    roots = [f for f in (s.callee(c) for c in s.index.of(cst.Call) if s.order(c) < at and s.scope(c) is module)
             if f is not None]
    return s.calls_reaching(roots)


def _build(ctx: FileContext) -> DevicePlan:
    model = script_model(ctx)
    scanner, s = model.devices, model.s
    plan = DevicePlan(ctx)
    literal = scanner.indices | {s.index for s in scanner.sites if s.index is not None}
    plan.multi_index = len(literal) > 1
    flags = list(scanner.flags)
    if not flags and scanner.cuda_argument and scanner.args_name:
        name, stmt = scanner.args_name
        flags.append(Flag(f"{name}.cuda", cst.parse_expression(f"{name}.cuda"), stmt, False))
    plan.flags = flags
    _name_devices(plan, scanner, s)
    # a CUDA device's name bound to a name the script uses as a device type stays a string
    plan.defs = [d for d in scanner.defs if not d.string or plan.mode(d.call) is not None]
    # `.cuda(i)` with a non-literal index, or any index under model parallelism, becomes
    # `get_device(i)`; every other site refers to the one device variable.
    needing = [s for s in scanner.sites if s.literal_index and not (s.index is not None and plan.multi_index)]
    plan.guard_flags = {f.code for f in flags if f.only_availability}
    plan.guard_flags.add("torch.cuda.is_available()")
    # Reuse a device the script already builds, if it is bound before every use. A name
    # bound to "cuda" that is only printed becomes that device.
    adoptable = [d for d in scanner.defs if needing and d.string and plan.mode(d.call) is None
                 and set(plan.named[id(d.call)].uses) <= {NEUTRAL}]
    # functions another module of the project imports run without this file's main block
    main_runs = not getattr(ctx.options.get("project"), "importers", ())
    for d in [*plan.defs, *adoptable]:
        others = [o.stmt for o in plan.defs if o.name == d.name and o is not d]
        if _reaches(s, d.stmt, needing, d.name, others, main_runs):
            plan.name = d.name
            if d in adoptable:
                _adopt(plan, plan.named[id(d.call)])
            break
        if not main_runs and d in plan.defs and _reaches(s, d.stmt, needing, d.name, others):
            # bound only in the main block: the same name defined at the top too, for the importers
            plan.name, plan.define_at_top = d.name, True
            break
    else:
        if plan.defs and not needing:
            plan.name = plan.defs[0].name
    # the flags the script's own choice of device reads: `"cuda" if args.cuda else "cpu"`
    chosen_by = {ctx.module.code_for_node(n) for d in plan.defs if d.choice is not None
                 and not plan.availability_only(d.choice.test) for n in _operands(d.choice.test)}
    # ... and those that guard a `.cuda()` that becomes `.to(device)`: device and guard must agree
    chosen = [f for f in flags if f.code in chosen_by or not f.only_availability and _moves_under(plan, s, f)]
    if plan.name is not None or not needing:
        _accelerator_flags(plan, chosen)
        return plan
    plan.name = fresh_name(ctx, "device")
    user_flags = [f for f in flags if not f.only_availability]
    flag = user_flags[-1] if user_flags else None
    if flag is not None and _reaches(s, flag.stmt, needing):
        plan.flag = flag
        plan.define_after = flag.stmt
        plan.guard_flags.add(flag.code)
    else:
        plan.define_at_top = True
        plan.ignored_flag = flag
    _accelerator_flags(plan, chosen + [f for f in [plan.flag] if f is not None and all(f is not c for c in chosen)])
    return plan


def _name_devices(plan: DevicePlan, scanner, s: Structure) -> None:
    """What each name bound to a CUDA device's name becomes (`DevicePlan.modes`), by how the
    script reads it: the runtime's device where every read is a device's (`.to(dev)`),
    printed, or a device type's that `.type` keeps right (`dev == "cuda"`, `device_type=dev`);
    a string naming the device where a read needs a string (`dev.startswith("cuda")`, a
    function of another module) or may read a string bound elsewhere too; kept where no read
    is a device's but one is a device type's (`device_type = "cuda" if "cuda" in device else
    "cpu"`)."""
    for holder in named_devices(s, scanner, plan.ctx.names.qualify):
        for value in holder.values:
            plan.named[id(value)] = holder
        mode = _mode(plan, holder)
        if mode is None:
            continue
        plan.modes[id(holder)] = mode
        plan.device_reads.update(id(r) for r in holder.reads)
        if mode == DEVICE:
            plan.typed.update(id(r) for r, use in zip(holder.reads, holder.uses) if use == TYPE)
        elif not holder.flag and (STRING in holder.uses or TYPE in holder.uses):
            read = next(r for r, u in zip(holder.reads, holder.uses) if u in (STRING, TYPE))
            code = _quoted(plan.ctx.module, s, read)
            plan.reviews[id(holder)] = [(read, f"`{holder.name}` is used as a device and read as a string (`{code}`): "
                                               "it stays a string, now the name of the device `get_device()` picks "
                                               "(\"cuda\", \"mps\", \"cpu\"...); check that this reading still holds")]
        for read in holder.reads:
            _choice_calls(plan, s, read)


def _quoted(module: cst.Module, s: Structure, read: cst.CSTNode) -> str:
    """The expression around a read, as a review quotes it: `"cuda" in device`, not the line."""
    node = read
    while True:
        parent = s.parent(node)
        if parent is None or isinstance(parent, (cst.BaseSmallStatement, cst.BaseCompoundStatement,
                                                 cst.BaseSuite, cst.Module)):
            break
        if isinstance(parent, cst.BaseExpression) and len(module.code_for_node(parent)) > 60:
            break
        node = parent
    return " ".join(module.code_for_node(node).split())


def _mode(plan: DevicePlan, holder: NamedDevice) -> Optional[str]:
    uses = holder.uses
    choices = [v for v in holder.values if isinstance(v, cst.IfExp)]
    if DEVICE not in uses and (TYPE in uses or STRING in uses):
        # a device type: kept, unless it only asks whether CUDA is there (`"cuda" if
        # torch.cuda.is_available() else "cpu"`): then it is the type of the runtime's device
        if not holder.flag and choices and len(choices) == len(holder.values) and \
                all(plan.availability_only(c.test) for c in choices):
            return STRING
        return None
    if DEVICE not in uses and (holder.flag or not choices):
        return None  # a name never used as a device
    if holder.flag or STRING in uses or UNKNOWN in uses or \
            any(use == TYPE and mixed for use, mixed in zip(uses, holder.mixed)):
        return STRING
    return DEVICE


def _adopt(plan: DevicePlan, holder: NamedDevice) -> None:
    """A name bound to "cuda" and only printed, which the fixes now use as the device."""
    plan.modes[id(holder)] = DEVICE
    plan.device_reads.update(id(r) for r in holder.reads)


def _choice_calls(plan: DevicePlan, s: Structure, read: cst.BaseExpression) -> None:
    """`args.device if torch.cuda.is_available() else "cpu"`: once the name holds the
    runtime's device, the choice asks what `get_device()` answers (on a Mac: MPS)."""
    parent = s.parent(read)
    if not isinstance(parent, cst.IfExp) or parent.test is read:
        return
    other = parent.orelse if parent.body is read else parent.body
    if isinstance(other, cst.Call) and plan.ctx.names.qualify(other.func) == "torch.device" and other.args:
        other = other.args[0].value  # torch.device("cpu")
    if literal_str(other) != "cpu":
        return
    plan.choice_calls.update(id(c) for c in findall(parent.test, m.Call())
                             if plan.ctx.names.qualify(c.func) == "torch.cuda.is_available")


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


def _moves_under(plan: DevicePlan, s, flag: Flag) -> bool:
    """Does `flag` guard a `.cuda()`, a CUDA tensor type or a `.to("cuda")` (a move the
    device rules fix)?"""
    return any(plan.moves(n) for node in _guarded_by(plan.ctx, s, flag) for n in s.index.subtree(node))


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
    """"cuda[:n]", f"cuda:{i}", or `torch.device("cuda", ...)`: the branch of a choice that picks CUDA."""
    if isinstance(node, cst.Call) and cuda_name(node) is None:
        return torch_device_index(node)[0]
    return cuda_name(node) is not None


def replace_calls(node: cst.BaseExpression, ids: Set[int], new: cst.BaseExpression) -> cst.BaseExpression:
    """`node` with the calls whose ids are given (nodes of the original tree) replaced by `new`."""
    class Swap(cst.CSTTransformer):
        def leave_Call(self, original, updated):
            return new.deep_clone() if id(original) in ids else updated
    return node.visit(Swap())


def device_plan(ctx: FileContext) -> DevicePlan:
    return ctx.shared("device-plan", _build)
