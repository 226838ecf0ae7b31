"""Where to wrap: which trained models DistributedDataParallel wraps, at which statement, and
which uses of a name hold the wrapped model.

Decides:
- `wraps`: a `Wrap` per trained model (not loss modules): right before the statement that
  builds its optimizer, after it reached its device, or after the line that makes it where the
  optimizer is built elsewhere; `find_unused_parameters` where its forward branches on its
  inputs; the script's own wrap kept where torchrun takes it. Nothing for a driver script, or
  where a gradient is backpropagated twice (a gradient penalty);
- `unwrapped` and `averaging`: what DDP does not average, and why (the runtime averages those
  gradients at the optimizer step instead);
- `wrapped_reference`: does a name or `self.x` hold a wrapped model where it stands (through
  assignments, returns and call arguments).

Relies on, from DdpPlan (ddp_plan.py) and its other mixins:
- `self.model` (the script model), `self.s` (its structure), `self.active`, `self.driver`
  (ddp_plan.py); `self._wrapped_memo` and `self._visited`, the memo and the walk of
  `wrapped_reference`, set in `DdpPlan.__init__`;
- `self.shard_training` (data.py): `averaging` speaks only where the training data is sharded;
  `self.unsharded_data` (data.py): where no loader brings the data, models whose steps may be
  reached unevenly (`uneven_steps`) are not DDP-wrapped;
- `self.torchrun` (reach.py): is the script's own wrap on a path torchrun takes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, List, Optional, Set, Tuple

import libcst as cst

from gpumigrate.analysis.model import TrainedModel
from gpumigrate.analysis.structure import NEVER, Function, dotted
from gpumigrate.analysis.syntax import runtime_helper
from gpumigrate.analysis.values import call_argument


@dataclass
class Wrap:
    name: str  # dotted, as written in the statement: `model`, `self.net`
    before: bool  # before the anchor small statement (else after its line)
    anchor: cst.CSTNode  # a small statement (before) or a line (after)
    find_unused: bool = False
    existing: bool = False  # the script wraps it already (an earlier run, or its own DDP)


# builtins whose result depends only on their arguments' values (a test of them is no data test)
_PURE_BUILTINS = frozenset({"isinstance", "hasattr", "getattr", "int", "float", "str", "bool", "abs", "min", "max",
                            "round", "range"})


class Wraps:
    """Where DistributedDataParallel wraps which model (a mixin of DdpPlan)."""

    # -- models --------------------------------------------------------------------------
    @cached_property
    def wraps(self) -> List[Wrap]:
        if not self.active:
            return []
        out: List[Wrap] = []
        if self._double_backward or self._reentrant_backward:
            return out  # DDP cannot average gradients of a gradient, or a backward run inside one
        if self.driver:
            # its models train in code this file cannot read (`self.G.sample_latent()`, a gradient
            # penalty, `trainer.G.state_dict()`): a DDP wrapper there is unproven; the step hooks
            # average them whatever that code does
            return out
        for model in self.model.trained_models:
            if model.loss_module:
                continue
            wrap = self._wrap_point(model)
            if wrap is not None and (wrap.existing or self.uneven_steps is None):
                wrap.find_unused = self._conditional_forward(model)
                out.append(wrap)
        return out

    def _conditional_forward(self, model: TrainedModel) -> bool:
        """Does the model's forward (or a forward of a module class of this file it holds)
        branch on what it is given? Then some parameters may get no gradient in a step, which
        DDP must be told (`find_unused_parameters=True`). Branches on the module's own settings
        (`if self.downsample:`) are the same every step and need no such cost."""
        cls = self.s.instance_class(cst.parse_expression(model.name), model.scope) if "." not in model.name else None
        if cls is None:
            _, bindings = self.s.lookup(model.name, model.scope)
            calls = [b.value for b in bindings if b.how == "assign" and isinstance(b.value, cst.Call)]
            names = {c.func.value for c in calls if isinstance(c.func, cst.Name)}
            classes = [self.s.classes_by_name[n] for n in names if n in self.s.classes_by_name]
        else:
            classes = [cls]
        seen: Set[int] = set()
        while classes:
            current = classes.pop()
            if id(current.node) in seen:
                continue
            seen.add(id(current.node))
            forward = self.s.method(current, "forward")
            if forward is not None and any(self._dynamic(test.test, forward) for test in self.s.own(forward.node, cst.If)):
                return True
            for bindings in current.attrs.values():  # submodules: self.block = Block(...)
                for b in bindings:
                    if isinstance(b.value, cst.Call) and isinstance(b.value.func, cst.Name) and \
                            b.value.func.value in self.s.classes_by_name:
                        classes.append(self.s.classes_by_name[b.value.func.value])
        return False

    def _dynamic(self, test: cst.BaseExpression, forward: Function) -> bool:
        """A test on the forward's inputs or locals (not only on `self.` settings and constants)."""
        skip = set()
        for node in self.s.index.subtree(test):
            if isinstance(node, cst.Attribute):
                skip.add(id(node.attr))
                if isinstance(node.value, cst.Name) and node.value.value == "self":
                    skip.add(id(node.value))
            elif isinstance(node, cst.Name) and id(node) not in skip and node.value not in ("True", "False", "None") \
                    and node.value in forward.scope.bindings:
                return True
        return False

    def _wrap_point(self, model: TrainedModel) -> Optional[Wrap]:
        """Right before the statement that builds the model's optimizer, after the model
        reached its device; when the optimizer is built elsewhere (a function of its own),
        right after the model's last binding or move. None where the script wraps it already,
        on a path torchrun takes; a wrap of its own that torchrun may not reach (`if
        args.distributed:`) gets ours too (wrap_model leaves a DDP as it is)."""
        for b in self._own_wraps(model):
            if self._taken(b):
                return Wrap(model.name, False, self.s.line(b.stmt), existing=True)
        anchors = []
        for opt in model.optimizers:
            if self.s.scope(opt.site) is model.scope:
                anchors.append(self.s.statement(opt.site))
        moves = self._moves(model)
        if anchors:
            anchor = min(anchors, key=self.s.order)
            line = self.s.line(anchor)
            later = [m for m in moves if self.s.order(m) > self.s.order(anchor)]
            if later:
                last = self._in_block(max(later, key=self.s.order), line)
                return Wrap(model.name, False, last) if last is not None else None
            return Wrap(model.name, True, self._lifted(model, anchor) or anchor)
        return self._made_here(model, [b.stmt for b in self._bindings(model)], moves)

    def _lifted(self, model: TrainedModel, anchor: cst.CSTNode) -> Optional[cst.CSTNode]:
        """An optimizer built in one branch (`if args.optim == "SGD": ... elif ...`): the
        statement holding it, in the block that last bound the model, so that every branch
        trains the wrapped model. None where the optimizer's line is in that block, or where
        that statement reads the model before the optimizer (its test would see the wrapper)."""
        line = self.s.line(anchor)
        bound = [b for b in self._bindings(model) if self.s.order(b.stmt) < self.s.order(anchor)]
        for binding in sorted(bound, key=lambda b: self.s.order(b.stmt), reverse=True):
            home = self.s.line(binding.stmt)
            outer = self._in_block(anchor, home) if home is not None else None
            if outer is None:
                continue  # bound in a branch of its own (`if world_size > 1: model = DDP(model)`)
            if outer is line:
                return None
            for node in self.s.index.subtree(outer):
                if isinstance(node, (cst.Name, cst.Attribute)) and dotted(node) == model.name and \
                        self.s.order(node) < self.s.order(anchor):
                    return None
            return outer
        return None

    def _made_here(self, model: TrainedModel, bindings: List[cst.CSTNode], moves: List[cst.CSTNode]) -> Optional[Wrap]:
        """Where the model is made and moved, when its optimizer is built elsewhere (a
        function it is passed to, a helper module, a `global` set in main()): right after its
        last binding or move, in the block that makes it (a move in a branch: after the
        branch), and only if nothing there has used the model yet (a call it is passed to may
        train it: the wrap must come before). None where that does not hold: the runtime then
        averages its gradients at the optimizer step instead."""
        if not bindings:
            return None
        made = self.s.line(max(bindings, key=self.s.order))
        home = self.s.block(made) if made is not None else None
        last = self._in_block(max([*bindings, *moves], key=self.s.order), made) if home is not None else None
        if last is None or isinstance(last, (cst.For, cst.While)) or self.s.order(last) < self.s.order(made):
            return None
        body = list(home.body)
        region = body[body.index(made):body.index(last) + 1]
        allowed = {id(n) for point in [*bindings, *moves] for n in self.s.index.subtree(point)}
        for line in region:
            if self.model.trains(line):
                return None
            for node in self.s.index.subtree(line):
                if id(node) not in allowed and isinstance(node, (cst.Name, cst.Attribute)) and \
                        dotted(node) == model.name and not self._is_target(node):
                    return None  # used before the wrap could go in
        return Wrap(model.name, False, last)

    def _is_target(self, node: cst.CSTNode) -> bool:
        parent = self.s.parent(node)
        return isinstance(parent, (cst.AssignTarget, cst.Global)) or isinstance(parent, cst.NameItem)

    def _own_wraps(self, model: TrainedModel) -> List[Any]:
        """The bindings that wrap `model` (`model = DistributedDataParallel(model, ...)`, or
        wrap_model): where it is bound, or, in the function that builds its optimizer, of the
        parameter it is handed as (`def train(args, model)` of the transformers examples)."""
        bindings = list(self._bindings(model))
        for opt in model.optimizers:
            scope = self.s.scope(opt.call)
            if scope is not model.scope:
                bindings += [b for name in scope.params for b in scope.bindings.get(name, ())
                             if isinstance(b.value, cst.Call) and b.value.args
                             and dotted(b.value.args[0].value) == name]
        return [b for b in bindings if b.how == "assign" and isinstance(b.value, cst.Call) and
                (self.model.qualify(b.value.func) or "").endswith(("wrap_model", "shard_model",
                                                                   "DistributedDataParallel"))]

    def _taken(self, wrap: Any) -> bool:
        """A wrap that holds under torchrun: wrap_model anywhere (an earlier run's, which went
        where the model is made, or a DDP of the script's that GM413 turned into one once its
        condition was weighed), or a DDP on a path torchrun provably takes."""
        return runtime_helper(self.model.qualify(wrap.value.func)) in ("wrap_model", "shard_model") or \
            self.torchrun.unmet(wrap.stmt) is None

    def _bindings(self, model: TrainedModel):
        if model.name.startswith("self."):
            out = []
            for c in self.s.classes.values():
                out.extend(b for b in c.attrs.get(model.name[5:], []) if b.scope is model.scope)
            return out
        return [b for b in model.scope.bindings.get(model.name, []) if b.how not in ("param", "def", "class")]

    def _moves(self, model: TrainedModel) -> List[cst.CSTNode]:
        """Statements that move the model to its device: `model.to(device)`, `model.cuda()`."""
        out = []
        for node in self.s.index.subtree(model.scope.node):
            if isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) and \
                    node.func.attr.value in ("to", "cuda", "half", "float", "double") and \
                    dotted(node.func.value) == model.name and self.s.scope(node) is model.scope:
                stmt = self.s.statement(node)
                if isinstance(stmt, (cst.Expr, cst.Assign)):
                    out.append(stmt)
        return out

    def _in_block(self, stmt: cst.CSTNode, line: cst.CSTNode) -> Optional[cst.CSTNode]:
        """The line holding `stmt` that sits in the same block as `line`."""
        block = self.s.block(line)
        current: Optional[cst.CSTNode] = self.s.line(stmt)
        while current is not None and self.s.block(current) is not block:
            current = self.s.line(self.s.parent(current)) if self.s.parent(current) is not None else None
        return current

    @cached_property
    def unwrapped(self) -> List[Tuple[cst.CSTNode, str]]:
        """What DDP does not average, and why: those parameters are averaged at the optimizer
        step instead (`averaging` says so). Each entry is (where, why not wrapped)."""
        if not self.active:
            return []
        out = []
        wrapped = {w.name for w in self.wraps}
        if self._double_backward:
            out.append((self._double_backward, "a gradient taken with create_graph=True and backpropagated again "
                                               "(a gradient penalty), which DDP does not support: no model is "
                                               "DDP-wrapped"))
            return out
        if self._reentrant_backward:
            out.append((self.ctx.module.body[0] if self.ctx.module.body else self.ctx.module,
                        f"`{self._reentrant_backward}` runs a backward inside the backward (reversible layers, a "
                        "checkpoint of its own), which DDP does not support: no model is DDP-wrapped"))
            return out
        for opt in self.model.optimizers:
            if opt.functional:
                out.append((opt.site, "this optimizer trains tensors, not a module (a functional model): there is "
                                      "nothing to DDP-wrap"))
            elif not opt.resolved:
                out.append((opt.site, "which module this optimizer trains cannot be told from here: it is not "
                                      "DDP-wrapped"))
        for model in self.model.trained_models:
            if model.loss_module:
                out.append((model.optimizers[0].site, f"`{model.name}` is a loss module with parameters the "
                                                      "optimizer trains: it is not DDP-wrapped"))
            elif model.name not in wrapped and self.uneven_steps is not None:
                out.append((model.optimizers[0].site, f"`{model.name}` is not DDP-wrapped: no loader brings its "
                                                      "training data, so the ranks may step a different number of "
                                                      "times (a rank that finishes first takes part in the others' "
                                                      "steps until they finish)"))
            elif model.name not in wrapped:
                out.append((model.optimizers[0].site, f"`{model.name}` is not DDP-wrapped (no place before its "
                                                      "training where it is made and moved)"))
        return out

    @cached_property
    def uneven_steps(self) -> Optional[cst.CSTNode]:
        """Where no loader brings the training data (`unsharded_data`): the first condition
        that may let the ranks reach an optimizer step a different number of times, as their
        data differ (a `while`, an `if` on a value computed from data, `memory.size() > 2000`
        or `done`, a loop left on such a value), through the calls that lead to the step.
        Those models are not DDP-wrapped (see runtime/uneven.py). None where every step sits
        under `for` loops and tests of constants, settings and counters only: DDP stays. A step
        a script of the project reaches (`agent.train()` in its episode loop) counts as uneven:
        the averaging at the step is right however often each rank gets there."""
        if not self.unsharded_data:
            return None
        seen: Set[int] = set()
        todo: List[cst.CSTNode] = list(self.model.step_calls)
        while todo:
            node = todo.pop()
            child = node
            for ancestor in self.s.ancestors(node):
                if isinstance(ancestor, (cst.FunctionDef, cst.Lambda)):
                    break
                if isinstance(ancestor, (cst.If, cst.While)) and not self.s.index.contains(ancestor.test, child) \
                        and (isinstance(ancestor, cst.While) or self._data_test(ancestor.test)):
                    return ancestor
                if isinstance(ancestor, cst.For) and any(
                        isinstance(a, cst.If) and self._data_test(a.test)
                        for exit_ in self.s.own(ancestor, (cst.Break, cst.Return))
                        for a in self.s.ancestors(exit_) if self.s.index.contains(ancestor, a)):
                    return ancestor
                child = ancestor
            fn = self.s.function(node)
            if fn is not None and id(fn.node) not in seen:
                seen.add(id(fn.node))
                if not fn.callers and self.drivers:
                    return fn.node  # called from a script of the project, under tests this file cannot see
                todo.extend(fn.callers)
        return None

    def _data_test(self, test: cst.BaseExpression) -> bool:
        """A test on a value computed by a call (`memory.size()`, `done` from `env.step()`),
        not on constants, settings (`args.x`, `self.x`) and counters."""
        for node in self.s.index.subtree(test):
            if isinstance(node, cst.Call):
                if not (isinstance(node.func, cst.Name) and node.func.value in _PURE_BUILTINS):
                    return True
            elif isinstance(node, cst.Name) and not isinstance(self.s.parent(node), cst.Attribute):
                stmt = self.s.statement(test)
                _, bindings = self.s.lookup(node.value, self.s.scope(node), self.s.order(stmt) if stmt is not None else NEVER)
                for b in bindings:
                    if b.how in ("assign", "unpack", "aug") and isinstance(b.value, cst.CSTNode) and any(
                            isinstance(c, cst.Call) and not (isinstance(c.func, cst.Name) and c.func.value in _PURE_BUILTINS)
                            for c in self.s.index.subtree(b.value)):
                        return True
        return False

    def averaging(self) -> List[Tuple[cst.CSTNode, str]]:
        """The parameters trained data-parallel by gradient averaging at the optimizer step."""
        if not self.shard_training:
            return []
        return [(where, f"{why}; its gradients are averaged across ranks at each optimizer step instead "
                        "(data-parallel by gradient averaging: DDP's overlap of communication with backward is "
                        "lost)") for where, why in self.unwrapped]

    @cached_property
    def _reentrant_backward(self) -> Optional[str]:
        """A custom autograd Function whose backward runs a backward (`torch.autograd.backward`,
        `y.backward(dy)`), here or in a module the run imports: its "Class.backward"."""
        fn = self.model.reentrant_backward
        if fn is not None:
            return f"{fn.cls.name}.backward" if fn.cls is not None else "backward"
        project = self.ctx.options.get("project")
        return next((r for r in getattr(project, "recursive", ()) if r.endswith(".backward")), None)

    @cached_property
    def _double_backward(self) -> Optional[cst.Call]:
        """`torch.autograd.grad(..., create_graph=True)`: the first such call, if any."""
        for node in self.s.index.order:
            if isinstance(node, cst.Call) and self.model.qualify(node.func) in ("torch.autograd.grad",
                                                                                "torch.autograd.functional.jacobian"):
                flag = call_argument(node, "create_graph", 4)
                if flag is not None and not (isinstance(flag, cst.Name) and flag.value == "False"):
                    return node
        return None

    # -- references to wrapped models ----------------------------------------------------
    def wrapped_reference(self, expr: cst.BaseExpression) -> bool:
        """Does `expr` (a name or `self.x`) hold a model this plan wraps, where it stands?
        Uses before the wrap, and names that hold something else there (an imported module
        called `model`), do not."""
        # Reachability over assignments, returns and call arguments: one query walks each
        # node once (a node already visited adds no new fact), so recursive helpers with many
        # callers cost a linear walk, not one per path. A True is a proof and is kept; a
        # False is exact only for the query that started the walk.
        memo = self._wrapped_memo
        if id(expr) in memo:
            return memo[id(expr)]
        top = self._visited is None
        if top:
            self._visited = set()
        elif ("ref", id(expr)) in self._visited:
            return False
        self._visited.add(("ref", id(expr)))
        try:
            result = self._wrapped_reference(expr)
        finally:
            if top:
                self._visited = None
        if result or top:
            memo[id(expr)] = result
        return result

    def _wrapped_reference(self, expr: cst.BaseExpression) -> bool:
        name = dotted(expr)
        if name is None:
            return False
        for wrap in self.wraps:
            if wrap.name != name:
                continue
            model = next(t for t in self.model.trained_models if t.name == name and not t.loss_module)
            if name.startswith("self."):
                return True
            found, bindings = self.s.lookup(name, self.s.scope(expr), self.s.order(self.s.statement(expr) or expr))
            if found is model.scope:
                if self.s.scope(expr) is not model.scope:
                    return True  # a function using the global (or enclosing) model: runs later
                after = self.s.order(wrap.anchor) if wrap.before else self.s.index.end[id(wrap.anchor)]
                return self.s.order(expr) >= after
            if bindings and all(b.how == "param" for b in bindings):
                fn = self.s.functions.get(id(found.node)) if found is not None else None
                if fn is not None and self._passed_wrapped(fn, bindings[0].name):
                    return True
        if isinstance(expr, cst.Name):
            return self._returned_wrapped(expr)
        return False

    def _returned_wrapped(self, expr: cst.Name) -> bool:
        """`model, optimizer = build()` where `build` returns the model it wrapped."""
        if ("ret", id(expr)) in self._visited:
            return False
        self._visited.add(("ret", id(expr)))
        scope = self.s.scope(expr)
        found, bindings = self.s.lookup(expr.value, scope, self.s.order(self.s.statement(expr) or expr))
        for b in bindings:
            if b.how == "param" and found is not None:
                fn = self.s.functions.get(id(found.node))
                if fn is not None and self._passed_wrapped(fn, b.name):
                    return True
            if b.how not in ("assign", "unpack") or not isinstance(b.value, cst.Call):
                continue
            callee = self.s.callee(b.value)
            if callee is None:
                continue
            for ret in callee.returns:
                value = ret
                if b.how == "unpack" and isinstance(ret, (cst.Tuple, cst.List)) and b.path and \
                        b.path[0] < len(ret.elements):
                    value = ret.elements[b.path[0]].value
                if dotted(value) is not None and (self.wrapped_reference(value) or (
                        isinstance(value, cst.Name) and self._returned_wrapped(value))):
                    return True
        return False

    def _passed_wrapped(self, fn: Function, param: str) -> bool:
        position = fn.position(param)
        for call in fn.callers:
            arg = call_argument(call, param, position)
            if arg is not None and dotted(arg) is not None and self.wrapped_reference(arg):
                return True
        return False
