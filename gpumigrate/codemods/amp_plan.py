"""The amp migration's one decision per file: which statements run under autocast, which
backward calls and optimizer steps go through the loss scaler, and where its one `update()`
per iteration goes. Proven or reported: the scaler's edits are all-or-nothing (a step
through the scaler on gradients that were not scaled would divide them by the scale), so any
training step the plan cannot place leaves the whole file in full precision, with a review
item saying why.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Dict, List, Optional, Set, Tuple

import libcst as cst

from gpumigrate.analysis import script_model
from gpumigrate.analysis import values as v
from gpumigrate.analysis.structure import NEVER, dotted, target_names
from gpumigrate.analysis.values import call_argument
from gpumigrate.rewriter.engine import FileContext
from gpumigrate.rewriter.lazy import matchers as m

_CLIP = ("torch.nn.utils.clip_grad_norm_", "torch.nn.utils.clip_grad_value_", "torch.nn.utils.clip_grad_norm",
         "torch.nn.utils.clip_grad.clip_grad_norm_", "torch.nn.utils.clip_grad.clip_grad_value_")
AUTOCASTS = ("torch.autocast", "torch.amp.autocast", "torch.cuda.amp.autocast", "torch.cpu.amp.autocast",
             "torch.cuda.amp.autocast_mode.autocast")
SCALERS = ("torch.amp.GradScaler", "torch.cuda.amp.GradScaler", "torch.cpu.amp.GradScaler")
APEX_SCALE_LOSS = "apex.amp.scale_loss"


@dataclass
class Slice:
    """Statements `block.body[start:end]` (of the original tree) run under autocast of `model`."""

    block: cst.CSTNode
    start: int
    end: int
    model: cst.BaseExpression


@dataclass
class Hoist:
    """The input of a binary_cross_entropy call that runs the model (`crit(net(x), y)`):
    computed under autocast into `name` before its line, which runs outside autocast."""

    call: cst.Call
    arg: int  # position in call.args
    name: str
    model: cst.BaseExpression


@dataclass
class AmpPlan:
    ctx: FileContext
    active: bool = False  # the scaler edits apply
    why_not: Optional[str] = None  # training found but left in full precision: the review item
    slices: List[Slice] = field(default_factory=list)
    backwards: Set[int] = field(default_factory=set)  # ids of `X.backward()` calls to scale
    scale_loss_withs: Set[int] = field(default_factory=set)  # apex `with amp.scale_loss(...)`
    steps: Set[int] = field(default_factory=set)  # ids of `opt.step()` calls
    update_after: Set[int] = field(default_factory=set)  # ids of statement lines
    unscale_before: Dict[int, List[str]] = field(default_factory=dict)  # clip line id -> optimizers
    numpy_after: List[cst.CSTNode] = field(default_factory=list)  # `.numpy()` of autocast values
    # `model(x).sum().backward()`: line id -> the model; the loss gets a name, computed under autocast
    inline: Dict[int, cst.BaseExpression] = field(default_factory=dict)
    inline_plain: Set[int] = field(default_factory=set)  # ... but computed outside autocast (BCE)
    loss_name: str = "loss"
    anchored: Set[Tuple[int, int]] = field(default_factory=set)  # (block, index) autocast before
    eval_numpy: List[cst.CSTNode] = field(default_factory=list)  # evaluation kept in full precision
    numpy_casts: Set[int] = field(default_factory=set)  # ids of `.numpy()` calls that get `.float()` first
    halves: List[cst.Call] = field(default_factory=list)  # `.half()` of models and loop inputs: they go
    kept_halves: List[cst.Call] = field(default_factory=list)  # other `.half()`: listed when the model's go
    scaler: str = "scaler"
    # binary_cross_entropy is unsafe to autocast (CUDA raises): its lines run outside autocast
    bce_lines: List[cst.CSTNode] = field(default_factory=list)
    bce_casts: Dict[int, List[int]] = field(default_factory=dict)  # id(call) -> args to cast to float32
    hoists: Dict[int, List[Hoist]] = field(default_factory=dict)  # id(line) -> inputs computed before it
    # (block, start, end) of every autocast region decided, BCE lines included
    claimed: List[Tuple[cst.CSTNode, int, int]] = field(default_factory=list)
    bce_review: List[cst.Call] = field(default_factory=list)  # arguments of unknown kind: not cast
    bce_functions: Dict[int, bool] = field(default_factory=dict)  # id(function node) -> computes BCE
    # The script's own precision switch (`args.fp16`): the test of every `if` around the `.half()`
    # and apex code that turned reduced precision on. Autocast and the scaler get `enabled=` it.
    switch: Optional[cst.BaseExpression] = None
    switch_after: Optional[int] = None  # id of the line binding the switch (or of the def taking it): the scaler
    # is made after it (first in it)
    switch_why_not: Optional[Tuple[cst.CSTNode, str]] = None  # a guarded switch not kept, and why
    already: Optional[cst.Call] = None  # the first torch.amp call of a script on torch.amp already
    _defined: bool = False

    @property
    def applies(self) -> bool:
        """The migration is made: `--to amp` (GM500 fixing). `lint --fix` alone cannot move a
        script to the scaler, so apex and `.half()` stay there (listed for `--to amp`)."""
        return self.active and "GM500" in self.ctx.fixing

    @cached_property
    def model(self):
        return script_model(self.ctx)

    @cached_property
    def mentions_bce(self) -> bool:
        """binary_cross_entropy can be called here at all (a cheap test before the search)."""
        return "binary_cross_entropy" in self.ctx.text or "BCELoss" in self.ctx.text

    @cached_property
    def trained(self) -> Set[str]:
        """Names of the models the optimizers train (loss modules aside)."""
        return {t.name for t in self.model.trained_models if not t.loss_module}

    # -- what the rules write -----------------------------------------------------------
    def define_scaler(self, fixing: bool) -> None:
        if not fixing or self._defined:
            return
        self._defined = True
        stmt = self.scaler_line()
        self.ctx.add_finisher("amp-scaler", lambda module: _insert_after_setup(module, stmt))

    def scaler_line(self) -> cst.SimpleStatementLine:
        """`scaler = grad_scaler()`, or `grad_scaler(enabled=args.fp16)` with the script's switch."""
        from gpumigrate.codemods.helpers import runtime_name

        return cst.SimpleStatementLine(body=[cst.Assign(
            targets=[cst.AssignTarget(cst.Name(self.scaler))],
            value=cst.Call(func=runtime_name(self.ctx, "grad_scaler"), args=self.enabled_args()))])

    def enabled_args(self) -> List[cst.Arg]:
        """`enabled=<the script's switch>` for autocast and the scaler, if it has one."""
        if self.switch is None:
            return []
        return [cst.Arg(self.switch.deep_clone().with_changes(lpar=[], rpar=[]), keyword=cst.Name("enabled"),
                        equal=cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""),
                                              whitespace_after=cst.SimpleWhitespace("")))]


def _insert_after_setup(module: cst.Module, stmt: cst.SimpleStatementLine) -> cst.Module:
    """After the imports, and after the device (or process group) set-up the other
    migrations put there, so that the set-up reads as one block."""
    from gpumigrate.codemods.device_plan import _after_imports, set_up_line

    at = _after_imports(module)
    body = list(module.body)
    after_setup = False
    while at < len(body) and set_up_line(module, body[at]):
        at, after_setup = at + 1, True
    leading = [] if after_setup or not at else [cst.EmptyLine()]
    return module.with_changes(body=body[:at] + [stmt.with_changes(leading_lines=leading)] + body[at:])


def amp_plan(ctx: FileContext) -> AmpPlan:
    return ctx.shared("amp-plan", _build)


def _build(ctx: FileContext) -> AmpPlan:
    plan = AmpPlan(ctx)
    model = plan.model
    if not model.uses_torch or not model.has_training:
        return plan
    amp_calls = [c for c in model.s.index.of(cst.Call) if (ctx.names.qualify(c.func) or "") in AUTOCASTS + SCALERS]
    if amp_calls:  # mixed precision already (GM503 moves torch.cuda.amp to torch.amp)
        if not any((ctx.names.qualify(c.func) or "").startswith("torch.cuda.") for c in amp_calls):
            plan.already = amp_calls[0]
        return plan
    from gpumigrate.codemods.helpers import fresh_name

    try:
        _find_halves(plan)
        _plan_training(plan)
    except _NotProven as reason:  # nothing of the half-made plan applies; GM502 still lists the halves
        return AmpPlan(ctx, why_not=str(reason), halves=plan.halves, kept_halves=plan.kept_halves)
    plan.active = bool(plan.steps)
    if not plan.active:
        plan.why_not = "no `optimizer.step()` was found for its `.backward()`"
        return plan
    plan.scaler = fresh_name(ctx, "scaler")
    if plan.inline:
        plan.loss_name = fresh_name(ctx, "loss")
    _slice_evaluation(plan)
    _numpy_of_autocast(plan)
    _find_switch(plan)
    return plan


APEX_INITIALIZE = "apex.amp.initialize"


def _find_switch(plan: AmpPlan) -> None:
    """The script's precision switch, proven: every `.half()` of a model and every apex
    `amp.initialize` (what turned reduced precision on) sits in the body of an `if` testing
    one plain name (`if args.fp16:`), the same everywhere, bound by an assignment that every
    autocast and scaler edit can read (module level, or the one function that trains). Then
    running without the flag trains in float32 as before. Anything else: mixed precision is
    always on (as before this existed) and, where a guard was seen, that is listed."""
    model, s, qualify = plan.model, plan.model.s, plan.ctx.names.qualify
    turns_on = [c for c in plan.halves if model.module_like(c.func.value)] + [
        c for c in s.index.of(cst.Call) if qualify(c.func) == APEX_INITIALIZE]
    if not turns_on:
        return
    guards = [_guard(s, c) for c in turns_on]
    seen = next((g for g in guards if g is not None), None)
    if seen is None:
        return  # reduced precision was always on: it stays on
    render = cst.Module(body=[]).code_for_node
    shown = " ".join(render(seen.test).split())
    tests = sorted({" ".join(render(g.test).split()) if g is not None else "" for g in guards})
    roots = _read_names(s, seen.test)
    if "" in tests or len(tests) != 1 or len(roots) != 1:
        why = "reduced precision was also on outside it" if "" in tests else \
            "other tests switched it too (" + ", ".join(f"`if {t}:`" for t in tests) + ")" if len(tests) > 1 else \
            "its test does more than read one variable (`args.fp16`, `args.precision == 16`)"
        plan.switch_why_not = (seen, f"`if {shown}:` switched reduced precision, but {why}: mixed precision now "
                                     "always runs; pass `enabled=` to autocast() and grad_scaler() if a flag must "
                                     "keep its meaning")
        return
    flag, root = seen.test, roots.pop()
    home, bindings = s.lookup(root, s.scope(seen), s.order(seen))
    binding = bindings[0] if len(bindings) == 1 else None  # one binding that reaches the guard
    why = None
    param = binding is not None and binding.how == "param" and isinstance(home.node, cst.FunctionDef)
    if home is None or binding is None or binding.how not in ("assign", "unpack") and not param or \
            not param and not (isinstance(s.line(binding.stmt), cst.SimpleStatementLine) and
                               _always_runs(s, s.line(binding.stmt), home.node)):
        why = f"`{root}` is not assigned once, where the scaler can be made"
    elif not home.is_module and not _all_inside(plan, home.node):
        why = f"`{root}` is local to a function, and the training or its checkpoints reach beyond it"
    if why is not None:
        plan.switch_why_not = (seen, f"`if {shown}:` switched reduced precision, but {why}: mixed precision now "
                                     f"always runs; pass `enabled={shown}` to autocast() and grad_scaler() if the "
                                     "flag must keep its meaning")
        return
    plan.switch = flag
    plan.switch_after = id(home.node) if param else id(s.line(binding.stmt))  # a def: first thing in its body


def _read_names(s, test: cst.BaseExpression) -> Set[str]:
    """The variables a test reads (`args` for `args.fp16 and not args.cpu`); a call, a
    lambda or a comprehension in it (which may do something, or bind): no name at all."""
    if any(s.inside(test, (cst.Call, cst.Lambda, cst.ListComp, cst.SetComp, cst.DictComp, cst.GeneratorExp,
                           cst.NamedExpr, cst.Await))):
        return set()
    out = set()
    for name in s.inside(test, cst.Name):
        parent = s.parent(name)
        if not (isinstance(parent, cst.Attribute) and parent.attr is name) and name.value not in (
                "True", "False", "None"):
            out.add(name.value)
    return out


def _always_runs(s, line: cst.CSTNode, home: cst.CSTNode) -> bool:
    """Does `line` run whenever its scope does (a scaler made after it exists for what
    follows)? Not in a loop, a branch or a `try`; `if __name__ == "__main__":` aside."""
    for a in s.ancestors(line):
        if a is home:
            return True
        if isinstance(a, cst.If) and not (isinstance(home, cst.Module) and m.matches(a.test, m.Comparison(
                left=m.Name("__name__"), comparisons=[m.ComparisonTarget(m.Equal(), m.SimpleString())]))):
            return False
        if isinstance(a, (cst.For, cst.While, cst.Try, cst.Else, cst.ExceptHandler, cst.Finally)):
            return False
    return False


def _guard(s, node: cst.CSTNode) -> Optional[cst.If]:
    """The `if` whose body (not its `else`) holds `node`, nearest first; None where the
    nearest `if` holds it in its `else`, or none does."""
    child = node
    for a in s.ancestors(node):
        if isinstance(a, cst.If):
            return a if child is a.body else None
        if isinstance(a, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
            return None
        child = a
    return None


def _all_inside(plan: AmpPlan, function: cst.CSTNode) -> bool:
    """Do every edit that reads the scaler or autocast, and every optimizer state saved or
    loaded (the scaler's goes with it), lie in `function`'s own body?"""
    s = plan.model.s
    nodes = [c for c in s.index.of(cst.Call) if id(c) in plan.steps or id(c) in plan.backwards or
             isinstance(c.func, cst.Attribute) and c.func.attr.value in ("state_dict", "load_state_dict")]
    nodes += [sl.block for sl in plan.slices] + [w for w in s.index.of(cst.With) if id(w) in plan.scale_loss_withs]
    return all(s.scope(n).node is function for n in nodes)


class _NotProven(Exception):
    """Why the training stays in full precision."""


def _plan_training(plan: AmpPlan) -> None:
    model, s, qualify, trained = plan.model, plan.model.s, plan.ctx.names.qualify, plan.trained
    if not trained:
        raise _NotProven("no model an optimizer trains was found")
    # backward calls: `X.backward(...)` alone on its line, or apex's `with amp.scale_loss(...) as s`
    anchors: Dict[int, Tuple[cst.CSTNode, cst.CSTNode, cst.BaseExpression]] = {}  # member id -> (member, block, loss)
    for call in model.backward_calls:
        func = call.func
        if not isinstance(func, cst.Attribute) or func.attr.value != "backward" or \
                qualify(func) == "torch.autograd.backward":
            raise _NotProven("`torch.autograd.backward(...)` cannot go through the loss scaler by rule")
        stmt = s.statement(call)
        if not isinstance(stmt, cst.Expr) or stmt.value is not call:
            raise _NotProven("a `.backward()` that is not a statement of its own")
        member = s.line(call)
        scale_loss = _apex_scale_loss(plan, member, func.value)
        loss = func.value
        if scale_loss is not None:
            member = scale_loss
            plan.scale_loss_withs.add(id(scale_loss))
            loss = scale_loss.items[0].item.args[0].value
        else:
            plan.backwards.add(id(call))
            inline = _forward_call(plan, func.value, trained)
            if inline is not None:
                plan.inline[id(member)] = inline
                if any(_bce_calls(plan, member)):  # the named loss is computed after autocast
                    _float32_inputs(plan, s.block(member), [member], 0, 0, inline)
                    plan.bce_lines.append(member)
                    plan.inline_plain.add(id(member))
                continue
        anchors[id(member)] = (member, s.block(member), loss)
    for step in model.step_calls:
        receiver = step.func.value
        if "scaler" in (dotted(receiver) or "").lower():
            raise _NotProven("the script scales its loss already")
        stmt = s.statement(step)
        if step.args or not isinstance(stmt, cst.Expr) or stmt.value is not step:
            raise _NotProven(f"`{dotted(receiver) or 'optimizer'}.step(...)` is not a plain `step()` statement "
                             "(a closure, or a value used)")
        plan.steps.add(id(step))
    _place_updates(plan)
    _place_unscales(plan, qualify)
    for member, block, loss in anchors.values():
        _slice_forward(plan, member, block, trained, loss)


def _find_halves(plan: AmpPlan) -> None:
    """`.half()` of a module, and of anything inside a training or evaluation loop: autocast
    replaces them. Pure float16 kept by choice (`--keep-half`), or kept because GM502 is not
    selected, leaves the file as it is: a GradScaler refuses float16 gradients."""
    model, s = plan.model, plan.model.s
    loops = [*model.training_loops_list, *(c.node for l in model.loaders for c in l.consumers
                                           if isinstance(c.node, (cst.For, cst.While)))]
    loop_ids = {id(loop) for loop in loops}
    for call in s.index.of(cst.Call):
        if not (isinstance(call.func, cst.Attribute) and
                call.func.attr.value == "half" and not call.args):
            continue
        in_loop = any(id(a) in loop_ids or isinstance(a, (cst.For, cst.While)) and model.trains(a)
                      for a in s.ancestors(call))
        if model.module_like(call.func.value) or in_loop:
            plan.halves.append(call)
        else:
            plan.kept_halves.append(call)
    if not any(model.module_like(c.func.value) for c in plan.halves):
        return
    if plan.ctx.options.get("keep_half"):
        raise _NotProven("the model trains in pure float16 (`.half()`), kept as asked (--keep-half)")
    if "GM502" not in plan.ctx.fixing:
        raise _NotProven("the model trains in pure float16 (`.half()`) and GM502 is not selected")


def _apex_scale_loss(plan: AmpPlan, member: cst.CSTNode, receiver: cst.BaseExpression) -> Optional[cst.With]:
    """`with amp.scale_loss(loss, opt) as scaled: scaled.backward()`: the With."""
    current: Optional[cst.CSTNode] = member
    while current is not None and not isinstance(current, cst.With):
        current = plan.model.s.parent(current)
    if not isinstance(current, cst.With) or len(current.items) != 1:
        return None
    item = current.items[0]
    if isinstance(item.item, cst.Call) and plan.ctx.names.qualify(item.item.func) == APEX_SCALE_LOSS and \
            item.asname is not None and dotted(item.asname.name) == dotted(receiver):
        return current
    return None


def _loop_or_function(plan: AmpPlan, node: cst.CSTNode) -> Optional[cst.CSTNode]:
    for a in plan.model.s.ancestors(node):
        if isinstance(a, (cst.For, cst.While, cst.FunctionDef)):
            return a
    return None


def _place_updates(plan: AmpPlan) -> None:
    """One `scaler.update()` per iteration: after the last step of each loop (or function
    body), when every step there is in one block; else not proven."""
    s = plan.model.s
    groups: Dict[int, List[cst.Call]] = {}
    for step in plan.model.step_calls:
        groups.setdefault(id(_loop_or_function(plan, step)), []).append(step)
    for steps in groups.values():
        lines = [s.line(c) for c in steps]
        blocks = {id(s.block(line)) for line in lines}
        if len(blocks) != 1:
            names = ", ".join(sorted({dotted(c.func.value) or "?" for c in steps}))
            raise _NotProven(f"the steps of {names} are in different blocks: where one `scaler.update()` per "
                             "iteration goes is a decision to make by hand")
        last = max(lines, key=s.order)
        plan.update_after.add(id(last))


def _place_unscales(plan: AmpPlan, qualify) -> None:
    """`scaler.unscale_(opt)` before gradient clipping, for the optimizer that steps next:
    once on each path to the step (a clip in each branch of an `if` gets its own; a clip
    after an earlier unscale_ of its block or an enclosing one does not: unscale_ twice
    raises)."""
    s = plan.model.s
    steps = sorted(plan.model.step_calls, key=s.order)
    placed: Dict[Tuple[int, str], List[cst.CSTNode]] = {}  # (loop, optimizer) -> lines unscaled before
    for node in s.index.of(cst.Call):
        if not ((qualify(node.func) or "") in _CLIP):
            continue
        line = s.line(node)
        home = _loop_or_function(plan, node)
        after = [c for c in steps if s.order(c) > s.order(node) and _loop_or_function(plan, c) is home]
        if not after:
            raise _NotProven("gradient clipping with no optimizer step after it in the same iteration")
        opt = dotted(after[0].func.value)
        if opt is None:
            raise _NotProven("gradient clipping before a step of an optimizer without a name")
        earlier = placed.setdefault((id(home), opt), [])
        if _unscaled_before(s, line, home, {id(e) for e in earlier}):
            continue  # unscaled already on every path here
        earlier.append(line)
        plan.unscale_before.setdefault(id(line), []).append(opt)


def _unscaled_before(s, line: cst.CSTNode, home: Optional[cst.CSTNode], placed: Set[int]) -> bool:
    """Has every path from the top of `home` (a loop or function) to `line` run one of the
    `placed` lines?"""

    def runs(stmt: cst.CSTNode) -> bool:
        if id(stmt) in placed:
            return True
        if isinstance(stmt, cst.If):
            if stmt.orelse is None or not block_runs(stmt.body):
                return False
            return runs(stmt.orelse) if isinstance(stmt.orelse, cst.If) else block_runs(stmt.orelse.body)
        if isinstance(stmt, cst.With):
            return block_runs(stmt.body)
        return False

    def block_runs(block: cst.BaseSuite) -> bool:
        return isinstance(block, cst.IndentedBlock) and any(runs(stmt) for stmt in block.body)

    member = line
    while member is not None and member is not home:
        block = s.block(member)
        if block is None:
            break
        body = list(block.body)
        k = next(i for i, stmt in enumerate(body) if stmt is member)
        if any(runs(stmt) for stmt in body[:k]):
            return True
        member = s.line(block) if not isinstance(block, cst.Module) else None
        if member is not None and s.parent(block) is home:
            break
    return False


def _forward_call(plan: AmpPlan, stmt: cst.CSTNode, trained: Set[str], depth: int = 0) -> Optional[cst.BaseExpression]:
    """The trained model a statement runs (directly, or through a function of this file)."""
    s = plan.model.s
    for call in s.inside(stmt, cst.Call):
        name = dotted(call.func)
        if name in trained:
            return call.func
        if name is not None and name.endswith(".forward") and name[: -len(".forward")] in trained:
            return call.func.value
        target = s.callee(call)
        inner = _forward_call(plan, target.node, trained, depth + 1) if target is not None and depth < 3 else None
        if inner is not None:
            model = next((a.value for a in call.args if dotted(a.value) in trained), None)
            if model is not None:
                return model
            # `self.compute_loss(batch)` running `self.model`: the same object here
            if (dotted(call.func) or "").startswith("self.") and (dotted(inner) or "").startswith("self."):
                return inner
    return None


def _slice_forward(plan: AmpPlan, member: cst.CSTNode, block: cst.CSTNode, trained: Set[str],
                   loss: cst.BaseExpression) -> None:
    """Autocast from the first statement before `member` that runs a trained model (in its
    block, or an enclosing one up to the loop) through the last one that computes `loss`."""
    s = plan.model.s
    needed = {n.value for n in s.inside(loss, cst.Name)}
    while True:
        body = list(block.body)
        k = next(i for i, b in enumerate(body) if b is member)
        if (id(block), k) in plan.anchored:
            return  # the other branch of an `if` whose first branch placed it
        taken = max([end for b, _, end in plan.claimed if b is block and end <= k], default=0)
        for i in range(taken, k):
            found = _forward_call(plan, body[i], trained)
            if found is not None:
                end = next((j + 1 for j in range(k - 1, i - 1, -1) if _assigns(s, body[j]) & needed), None)
                if end is None:
                    end = k
                    while end - 1 > i and _inert(body[end - 1]) and _forward_call(plan, body[end - 1], trained) is None:
                        end -= 1  # `optimizer.zero_grad()`, `print(...)`: nothing autocast changes
                plan.slices.extend(_without_bce(plan, block, body, i, end, found))
                plan.anchored.add((id(block), k))
                plan.numpy_after.extend(_numpy_calls(plan, body[i:end] + body[k + 1:]))
                return
        parent = s.parent(block)
        if not isinstance(parent, (cst.If, cst.Else, cst.With, cst.Try)) or isinstance(parent, cst.With) and \
                id(parent) in plan.scale_loss_withs:
            break
        while parent is not None and not (s.block(parent) is not None and isinstance(
                parent, cst.BaseCompoundStatement)):
            parent = s.parent(parent)
        if parent is None:
            break
        member, block = parent, s.block(parent)
    raise _NotProven("no forward pass of the trained model before its `.backward()` in the same block")


def _assigns(s, stmt: cst.CSTNode) -> Set[str]:
    """Names a statement (or any statement inside it) binds."""
    out: Set[str] = set()
    for node in s.inside(stmt, (cst.Assign, cst.AugAssign, cst.AnnAssign)):
        targets = [t.target for t in node.targets] if isinstance(node, cst.Assign) else [node.target]
        for t in targets:
            out.update(target_names(t))
    return out


def _inert(stmt: cst.CSTNode) -> bool:
    return isinstance(stmt, cst.SimpleStatementLine) and all(isinstance(small, cst.Expr) for small in stmt.body)


def _numpy_calls(plan: AmpPlan, statements: List[cst.CSTNode]) -> List[cst.Call]:
    """`.numpy()` calls in these statements: bfloat16 has no NumPy dtype."""
    return [call for stmt in statements for call in plan.model.s.inside(stmt, cst.Call)
            if isinstance(call.func, cst.Attribute) and call.func.attr.value == "numpy"]


def _slice_evaluation(plan: AmpPlan) -> None:
    """Evaluation loops run their forward pass, and what follows it in the loop body, under
    autocast (no scaler: nothing is backpropagated). A loop that turns results into NumPy
    arrays is left in full precision (bfloat16 has no NumPy dtype) and reported."""
    model, trained = plan.model, plan.trained
    for loader in model.loaders:
        for c in loader.consumers:
            loop = c.node
            if c.trains or not isinstance(loop, cst.For) or not isinstance(loop.body, cst.IndentedBlock) or \
                    model.trains(loop):
                continue
            body = list(loop.body.body)
            start, found = None, None
            for i, stmt in enumerate(body):
                found = _forward_call(plan, stmt, trained)
                if found is not None:
                    start = i
                    break
            if start is None or any(b is loop.body for b, _, _ in plan.claimed):
                continue
            numpy = _numpy_calls(plan, body[start:])
            if numpy:
                plan.eval_numpy.extend(numpy)
                continue
            try:
                plan.slices.extend(_without_bce(plan, loop.body, body, start, len(body), found))
            except _NotProven:
                continue  # this evaluation stays in full precision


# -- binary_cross_entropy: unsafe to autocast ---------------------------------------------
# CUDA's autocast raises for binary_cross_entropy (and BCELoss) whatever its input's dtype
# ("unsafe to autocast"): a float16 sigmoid output loses the precision its log needs. CPU
# autocast (bfloat16) runs it in float32, so only a GPU shows it. The lines that call it run
# after the autocast block, on float32 inputs.
BCE_FUNCTIONS = ("torch.nn.functional.binary_cross_entropy",)
BCE_MODULES = ("torch.nn.BCELoss", "torch.nn.modules.loss.BCELoss", "torch.nn.modules.BCELoss")
_MOVES = ("cuda", "to", "cpu", "float", "train", "eval")  # `nn.BCELoss().cuda()` is still one


def constructed_from(model, qualify, expr: cst.BaseExpression, classes, depth: int = 0) -> bool:
    """Does `expr` (what a call calls) hold a module built by one of `classes` (qualified
    names: `torch.nn.BCELoss`), by one of its bindings: `crit = nn.BCELoss()`, `self.crit`
    set so in a method, a parameter some same-file call fills with one, `nn.BCELoss().cuda()`?
    (Read by the amp plan and by GM208; a fact of the script model at heart.)"""
    s = model.s
    if depth > 4:
        return False
    while isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute) and expr.func.attr.value in _MOVES:
        expr = expr.func.value
    if isinstance(expr, cst.Call):
        return qualify(expr.func) in classes
    scope = s.scope(expr)
    if isinstance(expr, cst.Name):
        stmt = s.statement(expr)
        _, bindings = s.lookup(expr.value, scope, s.order(stmt) if stmt is not None else NEVER)
    elif isinstance(expr, cst.Attribute) and isinstance(expr.value, cst.Name) and expr.value.value == "self":
        cls = s.instance_class(expr.value, scope)
        bindings = cls.attrs.get(expr.attr.value, []) if cls is not None else []
    else:
        return False
    for b in bindings:
        if b.how == "assign" and isinstance(b.value, cst.BaseExpression) and \
                constructed_from(model, qualify, b.value, classes, depth + 1):
            return True
        if b.how == "param":
            fn = s.functions.get(id(b.scope.node))
            position = fn.position(b.name) if fn is not None else -1
            for call in fn.callers if fn is not None else ():
                arg = call_argument(call, b.name, position)
                if arg is not None and constructed_from(model, qualify, arg, classes, depth + 1):
                    return True
    return False


def _holds_bce(plan: AmpPlan, expr: cst.BaseExpression) -> bool:
    """One binding to a `BCELoss` is enough: computing a loss outside autocast on float32
    inputs is right for any loss."""
    return constructed_from(plan.model, plan.ctx.names.qualify, expr, BCE_MODULES)


def is_bce_call(plan: AmpPlan, call: cst.Call) -> bool:
    """`F.binary_cross_entropy(p, y)`, `nn.BCELoss()(p, y)`, `criterion(p, y)` with a
    `criterion` bound to `nn.BCELoss()`."""
    if plan.ctx.names.qualify(call.func) in BCE_FUNCTIONS:
        return True
    return _holds_bce(plan, call.func) and bool(call.args)


def _bce_calls(plan: AmpPlan, stmt: cst.CSTNode, depth: int = 0) -> Tuple[List[cst.Call], List[cst.Call]]:
    """The binary_cross_entropy calls of a statement, and its calls of same-file functions
    that make one (up to three calls deep)."""
    direct: List[cst.Call] = []
    through: List[cst.Call] = []
    if not plan.mentions_bce:
        return direct, through
    for call in plan.model.s.inside(stmt, cst.Call):
        if is_bce_call(plan, call):
            direct.append(call)
        elif _calls_bce(plan, call, depth):
            through.append(call)
    return direct, through


def _calls_bce(plan: AmpPlan, call: cst.Call, depth: int = 0) -> bool:
    """Does this call run a same-file function (or module's forward) that computes
    binary_cross_entropy?"""
    s = plan.model.s
    target = s.callee(call)
    if target is None and isinstance(call.func, (cst.Name, cst.Attribute)):  # a module of this file
        cls = s.instance_class(call.func, s.scope(call))
        target = s.method(cls, "forward") if cls is not None else None
    if target is None or depth >= 3:
        return False
    key = id(target.node)
    if key not in plan.bce_functions:
        plan.bce_functions[key] = False  # recursion: not (yet) known to
        plan.bce_functions[key] = any(_bce_calls(plan, target.node, depth + 1))
    return plan.bce_functions[key]


def _bce_args(call: cst.Call) -> List[int]:
    """Positions in call.args of the input and the target."""
    out = []
    for position, keyword in ((0, "input"), (1, "target")):
        for k, arg in enumerate(call.args):
            if arg.keyword is not None and arg.keyword.value == keyword or \
                    arg.keyword is None and not arg.star and k == position:
                out.append(k)
    return out


def _hoistable(plan: AmpPlan, call: cst.Call, line: cst.CSTNode) -> bool:
    """Can the input of `call` be computed on a line of its own before `line`, in the same
    order? Not inside a lambda, a comprehension or a conditional part of an expression."""
    if not isinstance(line, cst.SimpleStatementLine) or len(line.body) != 1:
        return False
    for a in plan.model.s.ancestors(call):
        if a is line:
            return True
        if isinstance(a, (cst.Lambda, cst.ListComp, cst.SetComp, cst.DictComp, cst.GeneratorExp, cst.IfExp,
                          cst.BooleanOperation)):
            return False
    return False


def _float32_inputs(plan: AmpPlan, block: cst.CSTNode, body: List[cst.CSTNode], start: int, j: int,
                    found: cst.BaseExpression) -> None:
    """Line `j` (outside autocast now) calls binary_cross_entropy: its input, and any target
    computed under autocast, go in float32; an input that runs the model is computed under
    autocast on a line before it."""
    s, trained = plan.model.s, plan.trained
    line = body[j]
    computed = set().union(*(_assigns(s, body[k]) for k in range(start, j))) if j > start else set()
    direct, through = _bce_calls(plan, line)
    for call in direct:
        positions = _bce_args(call)
        for k in positions:
            value = call.args[k].value
            runs = _forward_call(plan, value, trained)
            if k == positions[0] and runs is not None:
                if not _hoistable(plan, call, line):
                    continue  # the model runs in float32 here: right, if slower
                hoists = plan.hoists.setdefault(id(line), [])
                from gpumigrate.codemods.helpers import fresh_name

                name = fresh_name(plan.ctx, "probs" if not hoists else f"probs_{len(hoists) + 1}")
                hoists.append(Hoist(call, k, name, runs))
            elif k == positions[0] or runs is not None or {n.value for n in s.inside(value, cst.Name)} & computed:
                if not _is_float(value):
                    plan.bce_casts.setdefault(id(call), []).append(k)
    for call in through:  # `loss = bce_loss(out, y)`, with BCE inside: its tensors in float32
        for k, arg in enumerate(call.args):
            names = {n.value for n in s.inside(arg.value, cst.Name)}
            if not names & computed or arg.star or _is_float(arg.value):
                continue
            if plan.model.kind(arg.value) not in (v.TENSOR, v.LOSS):
                raise _NotProven(f"`{dotted(call.func) or 'a function'}(...)` computes binary_cross_entropy "
                                 "(unsafe to autocast) on what the autocast block computed, and it is not "
                                 "clear which of its arguments are tensors to cast to float32")
            plan.bce_casts.setdefault(id(call), []).append(k)


def _is_float(value: cst.BaseExpression) -> bool:
    return isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute) and \
        value.func.attr.value == "float" and not value.args


def _without_bce(plan: AmpPlan, block: cst.CSTNode, body: List[cst.CSTNode], start: int, end: int,
                 found: cst.BaseExpression) -> List[Slice]:
    """The autocast region `body[start:end]`, less the lines that call binary_cross_entropy
    (they run after it, on float32 inputs): the runs between them that run a model."""
    plan.claimed.append((block, start, end))
    bce = [j for j in range(start, end) if any(_bce_calls(plan, body[j]))]
    if not bce:
        return [Slice(block, start, end, found)]
    for j in bce:
        _float32_inputs(plan, block, body, start, j, found)
        plan.bce_lines.append(body[j])
    out, run = [], start
    for stop in [*bce, end]:
        if run < stop:
            model = next((f for f in (_forward_call(plan, body[k], plan.trained) for k in range(run, stop))
                          if f is not None), None)
            if model is not None:
                out.append(Slice(block, run, stop, model))
        run = stop + 1
    return out


# -- `.numpy()` of what autocast computed -------------------------------------------------
# NumPy has no bfloat16 (`TypeError: Got unsupported ScalarType BFloat16`), and float16
# reaches it silently. A value the autocast block computed gets `.float()` before `.numpy()`
# where it is provably floating point: it comes from the model's output (or another value
# computed under autocast) through operations that keep a floating dtype. Indices
# (`argmax`), comparisons and anything else are left as they are, and listed.
_FLOAT_KEEPING = frozenset({
    "detach", "cpu", "clone", "contiguous", "squeeze", "unsqueeze", "view", "view_as", "reshape", "permute",
    "transpose", "t", "flatten", "mean", "sum", "std", "var", "exp", "log", "sigmoid", "tanh", "softmax",
    "log_softmax", "abs", "neg", "sqrt", "pow", "mul", "div", "add", "sub", "clamp", "clamp_min", "clamp_max",
    "relu", "expand", "expand_as", "squeeze_", "unsqueeze_", "cumsum", "norm", "logsumexp", "prod"})
_FLOAT_FUNCTIONS = frozenset({"sigmoid", "tanh", "softmax", "log_softmax", "exp", "log", "relu", "abs",
                              "flatten", "squeeze", "unsqueeze", "mean", "sum"})
_LAYOUT = frozenset({"detach", "cpu", "clone", "contiguous", "squeeze", "unsqueeze", "view", "reshape", "flatten",
                     "permute", "transpose", "t"})
_NOT_FLOATING = frozenset({"argmax", "argmin", "long", "int", "bool", "byte", "eq", "ne", "gt", "lt", "ge", "le",
                           "float", "double", "nonzero", "sign"})  # `.float()`: cast already
_ARITHMETIC = (cst.Add, cst.Subtract, cst.Multiply, cst.Divide, cst.Power)


class _AutocastValues:
    """Which expressions hold a floating-point value the autocast regions computed."""

    def __init__(self, plan: AmpPlan) -> None:
        self.plan, self.s = plan, plan.model.s
        index = self.s.index
        self.regions = [(index.start[id(stmt)], index.end[id(stmt)])
                        for sl in plan.slices for stmt in list(sl.block.body)[sl.start:sl.end]]

    def inside(self, node: cst.CSTNode) -> bool:
        at = self.s.index.start.get(id(node), -1)
        return any(a <= at < b for a, b in self.regions)

    def floating(self, expr: cst.BaseExpression, depth: int = 0) -> bool:
        if depth > 12:
            return False
        qualify = self.plan.ctx.names.qualify
        if isinstance(expr, cst.Call):
            func = expr.func
            if isinstance(func, (cst.Name, cst.Attribute)) and dotted(func) in self.plan.trained:
                return self.inside(expr)  # the model's output, where it ran under autocast
            if isinstance(func, cst.Attribute) and func.attr.value in _FLOAT_KEEPING and \
                    qualify(func) is None:
                return self.floating(func.value, depth + 1)
            name = qualify(func) or ""
            if name.startswith(("torch.", "torch.nn.functional.")) and name.rsplit(".", 1)[1] in _FLOAT_FUNCTIONS \
                    and expr.args and not expr.args[0].keyword:
                return self.floating(expr.args[0].value, depth + 1)
            return False
        if isinstance(expr, cst.Attribute) and expr.attr.value in ("data", "T"):
            return self.floating(expr.value, depth + 1)
        if isinstance(expr, cst.Subscript):
            return self.floating(expr.value, depth + 1)
        if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, _ARITHMETIC):
            return self.floating(expr.left, depth + 1) or self.floating(expr.right, depth + 1)
        if isinstance(expr, cst.UnaryOperation) and isinstance(expr.operator, cst.Minus):
            return self.floating(expr.expression, depth + 1)
        if isinstance(expr, cst.Name):
            stmt = self.s.statement(expr)
            _, bindings = self.s.lookup(expr.value, self.s.scope(expr), self.s.order(stmt) if stmt else NEVER)
            return bool(bindings) and all(self._binding(b, depth) for b in bindings)
        return False

    def maybe_reduced(self, expr: cst.BaseExpression) -> bool:
        """Could this be a reduced-precision value of the autocast regions: it reads a name
        bound there, and is not an index or a mask (`argmax`, `long`, a comparison)?"""
        current = expr
        while True:
            if isinstance(current, cst.Call) and isinstance(current.func, cst.Attribute):
                method = current.func.attr.value
                if method in _NOT_FLOATING:
                    return False
                if method not in _LAYOUT:
                    break
                current = current.func.value
            elif isinstance(current, cst.Attribute) and current.attr.value == "data" or isinstance(
                    current, cst.Subscript):
                current = current.value
            else:
                break
        if isinstance(current, cst.Comparison):
            return False
        return self.reads(expr)

    def reads(self, expr: cst.BaseExpression) -> bool:
        """Does `expr` read a name bound in an autocast region?"""
        for name in self.s.inside(expr, cst.Name) if id(expr) in self.s.index.start else ():
            stmt = self.s.statement(name)
            _, bindings = self.s.lookup(name.value, self.s.scope(name), self.s.order(stmt) if stmt else NEVER)
            if any(self.inside(b.stmt) for b in bindings):
                return True
        return False

    def _binding(self, b, depth: int) -> bool:
        if b.how == "assign" and isinstance(b.value, cst.BaseExpression):
            if self.inside(b.stmt) and self.plan.model.kind(b.value) == v.LOSS:
                return True  # a loss computed under autocast
            return self.floating(b.value, depth + 1)
        if b.how == "unpack" and isinstance(b.value, cst.Call) and self.inside(b.stmt):
            func = b.value.func
            # `out, hidden = model(x)`: the first item of a model's output
            return isinstance(func, (cst.Name, cst.Attribute)) and dotted(func) in self.plan.trained and \
                tuple(b.path[:1]) == (0,)
        return False


def _bce_after_autocast(plan: AmpPlan, values: _AutocastValues) -> None:
    """binary_cross_entropy anywhere else (`F.binary_cross_entropy(p, y).backward()` after
    the block that computed `p`) on what autocast computed: those arguments in float32 too
    (its input and target must have one dtype outside autocast)."""
    s = plan.model.s
    done = {id(n) for line in plan.bce_lines for n in s.inside(line, cst.Call)}
    for call in s.index.of(cst.Call) if plan.mentions_bce else ():
        if id(call) in done or values.inside(call):
            continue
        direct = is_bce_call(plan, call)
        if direct:
            positions = _bce_args(call)
        elif _calls_bce(plan, call):
            positions = [k for k, arg in enumerate(call.args) if not arg.star]
        else:
            continue
        for k in positions:
            value = call.args[k].value
            if _is_float(value) or not values.reads(value) or k in plan.bce_casts.get(id(call), []):
                continue
            if not direct and plan.model.kind(value) not in (v.TENSOR, v.LOSS):
                plan.bce_review.append(call)
                continue
            plan.bce_casts.setdefault(id(call), []).append(k)


def _numpy_of_autocast(plan: AmpPlan) -> None:
    """`.float()` before the `.numpy()` of a floating value the autocast regions computed;
    the other `.numpy()` calls after a training step stay listed for review."""
    if not plan.slices:
        return
    values = _AutocastValues(plan)
    _bce_after_autocast(plan, values)
    for call in plan.model.s.index.of(cst.Call):
        func = call.func
        if isinstance(func, cst.Attribute) and func.attr.value == "numpy" and not call.args and \
                values.floating(func.value):
            plan.numpy_casts.add(id(call))
    plan.numpy_after = [c for c in plan.numpy_after if id(c) not in plan.numpy_casts and
                        values.maybe_reduced(c.func.value)]
