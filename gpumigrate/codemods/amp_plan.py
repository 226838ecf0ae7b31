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
from gpumigrate.analysis.structure import dotted, target_names
from gpumigrate.rewriter.engine import FileContext

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
    loss_name: str = "loss"
    anchored: Set[Tuple[int, int]] = field(default_factory=set)  # (block, index) autocast before
    eval_numpy: List[cst.CSTNode] = field(default_factory=list)  # evaluation kept in full precision
    halves: List[cst.Call] = field(default_factory=list)  # `.half()` of models and loop inputs: they go
    kept_halves: List[cst.Call] = field(default_factory=list)  # other `.half()`: listed when the model's go
    scaler: str = "scaler"
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
    def trained(self) -> Set[str]:
        """Names of the models the optimizers train (loss modules aside)."""
        return {t.name for t in self.model.trained_models if not t.loss_module}

    # -- what the rules write -----------------------------------------------------------
    def define_scaler(self, fixing: bool) -> None:
        if not fixing or self._defined:
            return
        self._defined = True
        from gpumigrate.codemods.helpers import runtime_name

        stmt = cst.SimpleStatementLine(body=[cst.Assign(
            targets=[cst.AssignTarget(cst.Name(self.scaler))],
            value=cst.Call(func=runtime_name(self.ctx, "grad_scaler")))])
        self.ctx.add_finisher("amp-scaler", lambda module: _insert_after_setup(module, stmt))


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
    if any((ctx.names.qualify(c.func) or "") in AUTOCASTS + SCALERS for c in model.s.index.of(cst.Call)):
        return plan  # mixed precision already (GM503 moves torch.cuda.amp to torch.amp)
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
    return plan


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
        taken = max([sl.end for sl in plan.slices if sl.block is block and sl.end <= k], default=0)
        for i in range(taken, k):
            found = _forward_call(plan, body[i], trained)
            if found is not None:
                end = next((j + 1 for j in range(k - 1, i - 1, -1) if _assigns(s, body[j]) & needed), None)
                if end is None:
                    end = k
                    while end - 1 > i and _inert(body[end - 1]) and _forward_call(plan, body[end - 1], trained) is None:
                        end -= 1  # `optimizer.zero_grad()`, `print(...)`: nothing autocast changes
                plan.slices.append(Slice(block, i, end, found))
                plan.anchored.add((id(block), k))
                plan.numpy_after.extend(_numpy_calls(plan, body[k + 1:]))
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
            if start is None or any(sl.block is loop.body for sl in plan.slices):
                continue
            numpy = _numpy_calls(plan, body[start:])
            if numpy:
                plan.eval_numpy.extend(numpy)
                continue
            plan.slices.append(Slice(loop.body, start, len(body), found))
