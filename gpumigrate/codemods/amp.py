"""Mixed precision: the amp migration (autocast + loss scaling, decided in amp_plan.py), and
what it replaces: NVIDIA apex's amp, hand-made `.half()` training, `torch.cuda.amp`."""

from __future__ import annotations

from typing import List, Optional, Sequence

import libcst as cst

from gpumigrate.analysis import script_model
from gpumigrate.analysis.structure import dotted
from gpumigrate.analysis.syntax import runtime_helper
from gpumigrate.codemods.amp_plan import AmpPlan, _forward_call, amp_plan
from gpumigrate.codemods.distributed import _APEX_PARALLEL
from gpumigrate.codemods.base import Clean, Flagged, Rule
from gpumigrate.codemods.helpers import call_method, get_arg, keyword_arg, literal_str, runtime_name, torch_name
from gpumigrate.rewriter.facts import SourceFacts
from gpumigrate.rewriter.lazy import matchers as m

_HEAD = "import torch\nmodel = torch.nn.Linear(4, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"


def _line(expr: cst.BaseExpression) -> cst.SimpleStatementLine:
    return cst.SimpleStatementLine(body=[cst.Expr(expr)])


def _string(text: str, like: cst.CSTNode) -> cst.SimpleString:
    """`text` quoted as the script quotes the string `like` (a key beside it)."""
    quote = "'" if isinstance(like, cst.SimpleString) and like.value.lstrip("rbuRBU").startswith("'") else '"'
    return cst.SimpleString(f"{quote}{text}{quote}")


def _scaler_call(plan: AmpPlan, method: str, args: Sequence[cst.BaseExpression]) -> cst.Call:
    return call_method(cst.Name(plan.scaler), method, [cst.Arg(a) for a in args])


class AmpSetup(Rule):
    """
    ## What it does
    Migrates a training script to mixed precision (amp migration only): the forward passes
    and losses of each training step run under `autocast(model)`, `loss.backward()` becomes
    `scaler.scale(loss).backward()`, `optimizer.step()` becomes `scaler.step(optimizer)`
    with one `scaler.update()` per iteration, and gradient clipping is preceded by
    `scaler.unscale_(optimizer)`. Checkpoints save and restore the scaler's state next to
    the optimizer's.

    ## Why is this bad?
    Full precision leaves most of a GPU's speed and half its memory unused. The runtime
    picks the precision where the script runs: float16 with loss scaling on CUDA, bfloat16
    on a CPU, none with `GPUMIGRATE_AMP=off`.

    ## Example
    ```python
    out = model(x)
    loss = crit(out, y)
    loss.backward()
    opt.step()
    ```

    ## Use instead
    ```python
    with autocast(model):
        out = model(x)
        loss = crit(out, y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    ```
    Where the steps of an iteration cannot be placed for certain (steps in different
    branches, a closure, `torch.autograd.backward`), the file stays in full precision and
    the reason is listed for review.

    A script whose `.half()` or apex code ran only behind its own flag (`if args.fp16:`)
    keeps the flag: `autocast(model, enabled=args.fp16)` and `grad_scaler(enabled=args.fp16)`,
    made right after `args` is bound. A script on `torch.amp` already gets one line saying so.

    `binary_cross_entropy` (`nn.BCELoss`) is unsafe to autocast: CUDA refuses it there. The
    lines that call it run after the autocast block, on float32 inputs
    (`crit(probs.float(), y)`; an input that runs the model, `crit(net(x), y)`, is computed
    under autocast on a line before). A value computed under autocast gets `.float()` before
    `.numpy()` where it is provably floating point: NumPy has no bfloat16.
    """

    code = "GM500"
    done = "autocast for the forward pass and loss, GradScaler for backward and step"
    name = "amp-setup"
    message = "mixed precision: autocast for the forward pass and loss, GradScaler for backward and step"
    fixed_in = frozenset({"amp"})
    lint = False
    triggers = ("backward",)
    examples = (
        Flagged(_HEAD + "for x, y in loader:\n    opt.zero_grad()\n    out = model(x)\n"
                "    loss = ((out - y) ** 2).mean()\n    loss.backward()\n    opt.step()\n",
                fixed="import torch\nfrom gpumigrate.runtime import autocast, grad_scaler\n\nscaler = grad_scaler()\n"
                "model = torch.nn.Linear(4, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                "for x, y in loader:\n    opt.zero_grad()\n    with autocast(model):\n        out = model(x)\n"
                "        loss = ((out - y) ** 2).mean()\n    scaler.scale(loss).backward()\n    scaler.step(opt)\n"
                "    scaler.update()\n"),
        Flagged(_HEAD + "for x, y in loader:\n    loss = model(x).sum()\n    loss.backward()\n"
                "    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n    opt.step()\n",
                fixed="import torch\nfrom gpumigrate.runtime import autocast, grad_scaler\n\nscaler = grad_scaler()\n"
                "model = torch.nn.Linear(4, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                "for x, y in loader:\n    with autocast(model):\n        loss = model(x).sum()\n"
                "    scaler.scale(loss).backward()\n    scaler.unscale_(opt)\n"
                "    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n    scaler.step(opt)\n"
                "    scaler.update()\n"),
        # steps in different branches: one update per iteration is not placed by rule
        Flagged(_HEAD + "d = torch.optim.SGD(model.parameters(), lr=0.1)\nfor i, (x, y) in enumerate(loader):\n"
                "    loss = model(x).sum()\n    loss.backward()\n    opt.step()\n    if i % 5 == 0:\n"
                "        d.step()\n"),
        # binary_cross_entropy after the autocast block, on float32; `.float()` before `.numpy()`
        Flagged(_HEAD + "crit = torch.nn.BCELoss()\nfor x, y in loader:\n    probs = torch.sigmoid(model(x))\n"
                "    loss = crit(probs, y)\n    loss.backward()\n    opt.step()\n"
                "    history.append(probs.detach().numpy())\n",
                fixed="import torch\nfrom gpumigrate.runtime import autocast, grad_scaler\n\nscaler = grad_scaler()\n"
                "model = torch.nn.Linear(4, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                "crit = torch.nn.BCELoss()\nfor x, y in loader:\n    with autocast(model):\n"
                "        probs = torch.sigmoid(model(x))\n    loss = crit(probs.float(), y)\n"
                "    scaler.scale(loss).backward()\n    scaler.step(opt)\n    scaler.update()\n"
                "    history.append(probs.detach().float().numpy())\n"),
        Clean(_HEAD + "scaler = torch.amp.GradScaler()\nfor x, y in loader:\n"
              "    with torch.autocast('cuda'):\n        loss = model(x).sum()\n    scaler.scale(loss).backward()\n"
              "    scaler.step(opt)\n    scaler.update()\n"),
        Clean("import torch\nmodel = torch.nn.Linear(4, 1)\nprint(model(torch.zeros(1, 4)))\n"),
    )

    def visit_Module(self, node: cst.Module) -> None:
        self.plan = amp_plan(self.ctx)
        model = script_model(self.ctx)
        if self.plan.already is not None and self.fixing:  # one line, not one per call: an information
            self.ctx.report(self.code, self.plan.already, "already uses torch.amp autocast/GradScaler: nothing to add",
                            fixed=False, review=False, note=True)
        if self.plan.why_not is not None:
            where = model.backward_calls[0] if model.backward_calls else node
            self.report(where, f"no mixed precision, the training is left as it is: {self.plan.why_not}", review=True,
                        not_applied="amp")
            return
        if not self.plan.active:
            return
        if self.plan.switch is not None:
            flag = cst.Module(body=[]).code_for_node(self.plan.switch)
            self.report(self.plan.switch, f"`{flag}` stays the precision switch: autocast and the scaler get "
                                          f"`enabled={flag}` (without it, float32 as before)")
        elif self.plan.switch_why_not is not None:
            self.report(self.plan.switch_why_not[0], self.plan.switch_why_not[1], review=True)
        for sl in self.plan.slices:
            body = list(sl.block.body)
            self.report(body[sl.start], "runs under autocast: the forward pass and loss in mixed precision",
                        through=body[sl.end - 1])
        for call in self.plan.numpy_after:
            self.report(call, "`.numpy()` of a value computed under autocast: bfloat16 (on a CPU) has no NumPy "
                              "dtype; add `.float()` before it if the value is one", review=True)
        for call in self.plan.eval_numpy[:1]:
            self.report(call, "evaluation left in full precision: its results become NumPy arrays, and bfloat16 "
                              "(on a CPU) has none; autocast its forward pass by hand if they are cast first",
                        review=True)
        # binary_cross_entropy lines: after the autocast block, on float32 inputs
        self.hoisted = {id(h.call): h for hoists in self.plan.hoists.values() for h in hoists}
        self.hoisted_values: dict = {}  # id(line) -> [(hoist, the input as rewritten)]
        for call in self.plan.bce_review[:1]:
            self.report(call, "binary_cross_entropy runs in this call on what autocast computed (reduced "
                              "precision): cast its tensor arguments with `.float()`", review=True)
        for line in self.plan.bce_lines:
            self.report(line, "binary_cross_entropy (`BCELoss`) is unsafe to autocast (CUDA refuses it): computed "
                              "after the autocast block, on float32 inputs")
        self.saved = {id(d) for d in model.s.index.order if isinstance(d, cst.Dict) and self._checkpoint(d)}
        self.restored = {id(line) for line in self._restores_optimizer()}

    def _active(self) -> bool:
        return self.plan.active

    def leave_Module(self, original: cst.Module, updated: cst.Module):
        if self._active() and self.plan.switch is None:  # registered last: the scaler goes after the device set-up
            self.plan.define_scaler(self.fixing)
        return None

    # -- backward, step, update, unscale_ -------------------------------------------------
    def leave_Call(self, original: cst.Call, updated: cst.Call):
        if not self._active():
            return None
        if id(original) in self.plan.bce_casts or id(original) in self.hoisted:
            return self._float32_inputs(original, updated)
        if id(original) in self.plan.numpy_casts:
            self.report(original, "`.numpy()` of a value computed under autocast: `.float()` first (NumPy has no "
                                  "bfloat16, and float16 would reach it silently)")
            return updated.with_changes(func=updated.func.with_changes(
                value=call_method(updated.func.value, "float")))
        if id(original) in self.plan.backwards:
            self.report(original, "`.backward()` of the scaled loss")
            receiver = updated.func.value
            return updated.with_changes(func=updated.func.with_changes(
                value=_scaler_call(self.plan, "scale", [receiver])))
        if id(original) in self.plan.steps:
            self.report(original, "the optimizer steps through the scaler (skipped when gradients overflowed)")
            return _scaler_call(self.plan, "step", [updated.func.value]).with_changes(
                lpar=updated.lpar, rpar=updated.rpar)
        return None

    def _float32_inputs(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        """`crit(probs, y)` -> `crit(probs.float(), y)`; an input that runs the model is
        computed before the line, under autocast (see leave_SimpleStatementLine)."""
        args = list(updated.args)
        hoist = self.hoisted.get(id(original))
        if hoist is not None:
            line = script_model(self.ctx).s.line(original)
            self.hoisted_values.setdefault(id(line), []).append((hoist, args[hoist.arg].value))
            args[hoist.arg] = args[hoist.arg].with_changes(value=call_method(cst.Name(hoist.name), "float"))
        for k in self.plan.bce_casts.get(id(original), []):
            args[k] = args[k].with_changes(value=call_method(args[k].value, "float"))
        return updated.with_changes(args=args)

    def _hoisted_inputs(self, original: cst.SimpleStatementLine) -> List[cst.BaseStatement]:
        """`with autocast(net): probs = net(x)` before a binary_cross_entropy line."""
        values = self.hoisted_values.pop(id(original), [])
        if not values:
            return []
        lines = [cst.SimpleStatementLine(body=[cst.Assign(targets=[cst.AssignTarget(cst.Name(h.name))], value=value)])
                 for h, value in values]
        item = cst.WithItem(item=cst.Call(func=runtime_name(self.ctx, "autocast", self.fixing),
                                          args=[cst.Arg(values[0][0].model.deep_clone()), *self.plan.enabled_args()]))
        return [cst.With(items=[item], body=cst.IndentedBlock(body=lines))]

    def leave_Dict(self, original: cst.Dict, updated: cst.Dict):
        if not self._active() or id(original) not in self.saved:
            return None
        self.report(original, "the checkpoint keeps the loss scaler's state")
        return self._save_scaler(updated)

    def leave_SimpleStatementLine(self, original, updated):
        if not self._active():
            return None
        before: List[cst.BaseStatement] = []
        after: List[cst.BaseStatement] = []
        inline = id(original) in self.plan.inline
        if inline:
            self.report(original, "the loss is named and computed under autocast")
            updated = self._name_the_loss(original, updated)
        before = self._hoisted_inputs(original)
        if id(original) in self.plan.unscale_before:
            before += [_line(_scaler_call(self.plan, "unscale_", [cst.parse_expression(o)]))
                       for o in self.plan.unscale_before[id(original)]]
        if id(original) in self.plan.update_after:
            after.append(_line(_scaler_call(self.plan, "update", [])))
        if id(original) == self.plan.switch_after and self.fixing:  # `args = parser.parse_args()`
            after.append(self.plan.scaler_line())
        if id(original) in self.restored:
            after.append(self._restore_scaler(original))
        if not before and not after and not inline:
            return None
        if before and isinstance(updated, cst.FlattenSentinel):
            first = updated.nodes[0]
            before[0] = before[0].with_changes(leading_lines=first.leading_lines)
            updated = cst.FlattenSentinel([first.with_changes(leading_lines=[]), *updated.nodes[1:]])
        elif before:
            before[0] = before[0].with_changes(leading_lines=updated.leading_lines)
            updated = updated.with_changes(leading_lines=[])
        if isinstance(updated, cst.FlattenSentinel):
            return cst.FlattenSentinel([*before, *updated.nodes, *after])
        return cst.FlattenSentinel([*before, updated, *after])

    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef):
        """`def main(fp16):` switching precision: its scaler is made first thing in it."""
        if not self._active() or not self.fixing or id(original) != self.plan.switch_after or \
                not isinstance(updated.body, cst.IndentedBlock):
            return None
        body = list(updated.body.body)
        at = 1 if body and m.matches(body[0], m.SimpleStatementLine(body=[m.Expr(m.SimpleString())])) else 0
        return updated.with_changes(body=updated.body.with_changes(body=body[:at] + [self.plan.scaler_line()] +
                                                                   body[at:]))

    def _name_the_loss(self, original: cst.SimpleStatementLine, updated: cst.SimpleStatementLine):
        """`model(x).sum().backward()` -> the loss named and computed under autocast, then
        its scaled backward (backward itself does not run under autocast). On a line of
        several statements (`opt.zero_grad(); f(x).backward(); opt.step()`) the line is cut
        there: what comes before, the autocast block, then the backward and the rest."""
        at = next(i for i, small in enumerate(updated.body) if m.matches(small, m.Expr(m.Call(
            func=m.Attribute(value=m.Call(func=m.Attribute(attr=m.Name("scale"))), attr=m.Name("backward"))))))
        backward = updated.body[at].value  # already `scaler.scale(R).backward(...)`
        scale = backward.func.value
        loss = scale.args[0].value
        name = cst.Name(self.plan.loss_name)
        compute = cst.SimpleStatementLine(body=[cst.Assign(targets=[cst.AssignTarget(name)], value=loss)])
        before = list(updated.body[:at])
        if id(original) in self.plan.inline_plain:  # binary_cross_entropy: its inputs were made before
            wrapped = compute.with_changes(leading_lines=[] if before else updated.leading_lines)
        else:
            item = cst.WithItem(item=cst.Call(func=runtime_name(self.ctx, "autocast", self.fixing),
                                              args=[cst.Arg(self.plan.inline[id(original)].deep_clone()),
                                                    *self.plan.enabled_args()]))
            wrapped = cst.With(items=[item], body=cst.IndentedBlock(body=[compute]),
                               leading_lines=[] if before else updated.leading_lines)
        rest = [updated.body[at].with_changes(value=backward.with_changes(func=backward.func.with_changes(
            value=scale.with_changes(args=[scale.args[0].with_changes(value=name)])))), *updated.body[at + 1:]]
        line = updated.with_changes(leading_lines=[], body=rest)
        if not before:
            return cst.FlattenSentinel([wrapped, line])
        before[-1] = before[-1].with_changes(semicolon=cst.MaybeSentinel.DEFAULT)
        head = cst.SimpleStatementLine(body=before, leading_lines=updated.leading_lines)
        return cst.FlattenSentinel([head, wrapped, line])

    # -- autocast -------------------------------------------------------------------------
    def leave_IndentedBlock(self, original: cst.IndentedBlock, updated: cst.IndentedBlock):
        return self._wrap(original, updated)

    def _wrap(self, original, updated):
        slices = sorted((sl for sl in self.plan.slices if sl.block is original), key=lambda sl: sl.start) \
            if self._active() else []
        if not slices:
            return None
        groups: List[List[cst.BaseStatement]] = []
        new = list(updated.body)
        at = 0
        for stmt in original.body:
            n = len(self.ctx.rewritten(stmt))
            groups.append(new[at:at + n])
            at += n
        if at != len(new):
            return None
        body: List[cst.BaseStatement] = []
        done = 0
        for sl in slices:
            body += [s for g in groups[done:sl.start] for s in g]
            inner = [s for g in groups[sl.start:sl.end] for s in g]
            inner = self.ctx.drop_removed(inner) or inner
            leading = inner[0].leading_lines
            inner[0] = inner[0].with_changes(leading_lines=[])
            item = cst.WithItem(item=cst.Call(func=runtime_name(self.ctx, "autocast", self.fixing),
                                              args=[cst.Arg(sl.model.deep_clone()), *self.plan.enabled_args()]))
            body.append(cst.With(items=[item], body=cst.IndentedBlock(body=inner), leading_lines=leading))
            done = sl.end
        body += [s for g in groups[done:] for s in g]
        return updated.with_changes(body=body)

    # -- checkpoints ----------------------------------------------------------------------
    def _is_optimizer(self, expr: cst.BaseExpression) -> bool:
        return script_model(self.ctx).kind(expr) == "optimizer" or "optim" in (dotted(expr) or "").lower()

    def _apex_state(self) -> bool:
        """apex's `amp.state_dict()`/`load_state_dict` carry the scale (GM501 moves them)."""
        return "amp" in self.ctx.names.local

    def _optimizer_state(self, expr: cst.BaseExpression) -> bool:
        return isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute) and \
            expr.func.attr.value == "state_dict" and self._is_optimizer(expr.func.value)

    def _checkpoint(self, d: cst.Dict) -> bool:
        """`{..., 'optimizer': opt.state_dict()}`: a checkpoint, wherever it goes (torch.save,
        a save_checkpoint() of the script's, a variable saved later)."""
        keys = {getattr(e.key, "evaluated_value", None) for e in d.elements if isinstance(e, cst.DictElement)}
        return "scaler" not in keys and any(isinstance(e, cst.DictElement) and self._optimizer_state(e.value)
                                            for e in d.elements) and not self._apex_state()

    def _save_scaler(self, d: cst.Dict) -> cst.Dict:
        elements = list(d.elements)
        last = elements[-1]
        entry = cst.DictElement(key=_string("scaler", d.elements[0].key),
                                value=_scaler_call(self.plan, "state_dict", []), comma=last.comma)
        between = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
        if len(elements) > 1 and isinstance(elements[-2].comma, cst.Comma) and \
                isinstance(elements[-2].comma.whitespace_after, cst.ParenthesizedWhitespace):
            between = elements[-2].comma  # one entry per line: the new one gets a line too
        elements[-1] = last.with_changes(comma=between)
        return d.with_changes(elements=elements + [entry])

    def _restores_optimizer(self) -> List[cst.SimpleStatementLine]:
        """`opt.load_state_dict(checkpoint['optimizer'])` lines: the scaler's state follows."""
        if self._apex_state():
            return []
        model = script_model(self.ctx)
        out = []
        for call in model.s.index.of(cst.Call):
            if not (isinstance(call.func, cst.Attribute) and
                    call.func.attr.value == "load_state_dict" and len(call.args) == 1):
                continue
            if not self._is_optimizer(call.func.value):
                continue
            arg = call.args[0].value
            if isinstance(arg, cst.Subscript) and isinstance(arg.value, cst.Name):
                line = model.s.line(call)
                stmt = model.s.statement(call)
                if isinstance(line, cst.SimpleStatementLine) and isinstance(stmt, cst.Expr) and stmt.value is call:
                    out.append(line)
        return out

    def _restore_scaler(self, original: cst.SimpleStatementLine) -> cst.SimpleStatementLine:
        arg = original.body[0].value.args[0].value
        source = call_method(arg.value.deep_clone(), "get", [cst.Arg(_string("scaler", arg.slice[0].slice.value))])
        self.report(original, "the scaler's state is restored with the optimizer's (absent from older checkpoints)")
        return _line(cst.Call(func=runtime_name(self.ctx, "load_scaler_state", self.fixing),
                              args=[cst.Arg(cst.Name(self.plan.scaler)), cst.Arg(source)]))


class _MigratedByAmp(Rule):
    """A rule whose fix is part of the amp migration (the scaler and autocast around it)."""

    plan: AmpPlan

    def report(self, node: cst.CSTNode, message: Optional[str] = None, **kwargs) -> None:
        if self.fixing and not self.plan.applies and not kwargs.get("review"):
            kwargs["review"] = True
            if "GM500" in self.ctx.fixing:  # --to amp declined the file: GM500's item says why
                message = f"{message or self.message} (not migrated: the training is left as it is)"
            else:  # `lint --fix`: only `--to amp` migrates it
                message = f"{message or self.message} (`gpumigrate --to amp` migrates it)"
        super().report(node, message, **kwargs)


_APEX_GUARD_HANDLER = (cst.Raise, cst.Pass, cst.Expr)  # `raise ImportError(...)`, `print(...)`, `pass`


class ApexAmp(_MigratedByAmp):
    """
    ## What it does
    Finds NVIDIA apex's mixed precision: `from apex import amp`, `amp.initialize`,
    `amp.scale_loss`, `amp.master_params`, `amp.state_dict`/`load_state_dict`.

    ## Why is this bad?
    apex's amp is deprecated and unmaintained; a script that imports it runs only where apex
    was built from source for that CUDA and torch. `torch.amp` does the same job everywhere.

    ## Example
    ```python
    from apex import amp
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1")
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    ```

    ## Use instead
    ```python
    with autocast(model):
        ...
    scaler.scale(loss).backward()
    ```
    (`--to amp` migrates all of it; the `try: from apex import amp / except ImportError`
    guard goes too, and so does an `if args.fp16:` whose branches are the same once apex is
    gone: one of them is kept.)
    """

    code = "GM501"
    done = "apex amp → torch.amp (autocast and GradScaler)"
    name = "apex-amp"
    message = "NVIDIA apex's amp is deprecated; use torch.amp (autocast and GradScaler)"
    fixed_in = frozenset({"amp"})
    triggers = ("apex",)

    # a name qualified as apex.* or an import from apex: `apex` is an identifier
    @classmethod
    def gate(cls, facts: SourceFacts) -> bool:
        return "apex" in facts.ids

    examples = (
        Flagged(_HEAD + "from apex import amp\nmodel, opt = amp.initialize(model, opt, opt_level='O1')\n"
                "for x, y in loader:\n    loss = model(x).sum()\n    with amp.scale_loss(loss, opt) as scaled:\n"
                "        scaled.backward()\n    opt.step()\n",
                fixed="import torch\nfrom gpumigrate.runtime import autocast, grad_scaler\n\nscaler = grad_scaler()\n"
                "model = torch.nn.Linear(4, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                "for x, y in loader:\n    with autocast(model):\n        loss = model(x).sum()\n"
                "    scaler.scale(loss).backward()\n    scaler.step(opt)\n    scaler.update()\n"),
        Flagged("try:\n    from apex import amp\nexcept ImportError:\n    raise ImportError('install apex')\n"),
        # `if args.fp16:` and its `else` are the same after the migration: one is kept
        Flagged(_HEAD + "from apex import amp\nmodel, opt = amp.initialize(model, opt)\nfor x, y in loader:\n"
                "    loss = model(x).sum()\n    if args.fp16:\n        with amp.scale_loss(loss, opt) as scaled:\n"
                "            scaled.backward()\n    else:\n        loss.backward()\n    opt.step()\n",
                fixed="import torch\nfrom gpumigrate.runtime import autocast, grad_scaler\n\nscaler = grad_scaler()\n"
                "model = torch.nn.Linear(4, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                "for x, y in loader:\n    with autocast(model):\n        loss = model(x).sum()\n"
                "    scaler.scale(loss).backward()\n    scaler.step(opt)\n    scaler.update()\n"),
        Clean("import torch\nscaler = torch.amp.GradScaler()\n"),
        Clean("import apexlib\napexlib.helper()\n"),  # not apex
    )

    def visit_Module(self, node: cst.Module) -> None:
        self.plan = amp_plan(self.ctx)
        s = script_model(self.ctx).s
        imports = {id(n) for n in s.index.order if type(n) is cst.Import or type(n) is cst.ImportFrom}
        # what is left of apex after the migration: a reviewer must remove it by hand
        self.leftovers: List[cst.CSTNode] = []
        binds_apex = any(full.split(".")[0] == "apex" for full in self.ctx.names.local.values())
        for n in s.index.order if binds_apex else ():  # a name qualifies as apex only through an import of it
            if type(n) is not cst.Attribute and type(n) is not cst.Name:
                continue
            qualified = self.qualify(n) or ""
            parent = s.parent(n)
            if qualified.split(".")[0] != "apex" or isinstance(parent, cst.Attribute) and parent.value is n:
                continue  # not apex, or the inner part of a longer name
            if any(id(a) in imports for a in s.ancestors(n)):
                continue  # the import itself
            if qualified not in _APEX_MIGRATED and qualified not in _APEX_PARALLEL:
                self.leftovers.append(n)
        for n in self.leftovers:
            self.report(n, f"`{self.qualify(n)}` (apex) has no torch equivalent the migration knows: apex stays "
                           "imported for it; replace it by hand", review=True)
        for n in s.index.order:
            if isinstance(n, cst.ImportFrom) and isinstance(n.names, cst.ImportStar) and _apex_module(n):
                self.leftovers.append(n)  # names unknown: apex stays
                self.report(n, "what this star import gives (`to_python_float`, ...) is not migrated: apex stays "
                               "imported for it; import the names used, or replace them by hand", review=True)

    def _migrating(self) -> bool:
        return self.plan.applies

    def leave_Try(self, original: cst.Try, updated: cst.Try):
        """The `try: from apex import amp / except ImportError: raise ...` guard, when nothing
        it imports is still needed."""
        body = original.body.body
        if not body or not all(isinstance(line, cst.SimpleStatementLine) for line in body):
            return None
        imported = [i for line in body for i in line.body]
        if not all(isinstance(i, (cst.Import, cst.ImportFrom)) and _apex_module(i) for i in imported):
            return None
        if original.orelse or original.finalbody or not all(
                all(isinstance(s, cst.SimpleStatementLine) and all(isinstance(i, _APEX_GUARD_HANDLER) for i in s.body)
                    for s in h.body.body) for h in original.handlers):
            return None
        if self.leftovers or any(isinstance(i, cst.ImportFrom) and isinstance(i.names, cst.ImportStar)
                                 for i in imported):
            return None  # apex is still needed (listed for review)
        self.report(original, "the apex import guard goes: mixed precision comes from torch.amp")
        if not self._migrating():
            return None
        return self.ctx.remove_statement(original)

    def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
        if not _imports_apex_amp(node):
            return
        if not any(isinstance(a, cst.Try) for a in script_model(self.ctx).s.ancestors(node)):
            self.report(node)  # (a guard's import: the guard is reported)
        if self._migrating() and self.fixing:
            self.ctx.remove_import("apex", "amp")
            self.ctx.remove_import("apex.amp")

    def leave_SimpleStatementLine(self, original, updated):
        """`model, optimizer = amp.initialize(model, optimizer, ...)`: they are what they were."""
        if len(original.body) != 1 or not isinstance(original.body[0], cst.Assign):
            return None
        assign = original.body[0]
        call = assign.value
        if not (isinstance(call, cst.Call) and self.qualify(call.func) == "apex.amp.initialize"):
            return None
        self.report(call, "`amp.initialize` goes: autocast casts per operation, the model stays float32")
        self._review_settings(call)
        flag = self._condition(original)
        if flag is not None and self.plan.switch is None and self.plan.switch_why_not is None:
            self.report(call, f"apex ran only `if {flag}:`; mixed precision now always runs: pass "
                              f"`enabled={flag}` to autocast() and grad_scaler() if the flag must keep its meaning",
                        review=True)
        if not self._migrating():
            return None
        args = [a.value for a in (get_arg(call, "models", 0), get_arg(call, "optimizers", 1)) if a is not None]
        target = assign.targets[0].target if len(assign.targets) == 1 else None
        if target is None or not args:
            return None
        value: cst.BaseExpression = args[0] if len(args) == 1 else cst.Tuple(
            elements=[cst.Element(a) for a in args], lpar=[], rpar=[])
        module = cst.Module(body=[])
        if module.code_for_node(target).replace("(", "").replace(")", "").replace(" ", "") == \
                module.code_for_node(value).replace("(", "").replace(")", "").replace(" ", ""):
            return self.ctx.remove_statement(updated)
        return updated.with_changes(body=[updated.body[0].with_changes(value=value)])

    def _condition(self, line: cst.CSTNode) -> Optional[str]:
        """The test of the `if` directly around `line`, if any."""
        s = script_model(self.ctx).s
        block = s.block(line)
        parent = s.parent(block) if block is not None else None
        return cst.Module(body=[]).code_for_node(parent.test) if isinstance(parent, cst.If) else None

    def leave_If(self, original: cst.If, updated: cst.If):
        """`if args.fp16: model, optimizer = amp.initialize(...)` leaves nothing to test."""
        if not self._migrating() or script_model(self.ctx).s.inside(original.test, cst.Call):
            return None
        if original.orelse is not None:
            return _settled_if(self, original, updated)
        body = original.body.body
        if all(isinstance(line, cst.SimpleStatementLine) and len(line.body) == 1 and isinstance(
                line.body[0], cst.Assign) and isinstance(line.body[0].value, cst.Call) and
               self.qualify(line.body[0].value.func) == "apex.amp.initialize" for line in body):
            inner = updated.body.body
            if all(m.matches(line, m.SimpleStatementLine(body=[m.Pass()])) and not line.leading_lines
                   for line in inner):
                return self.ctx.remove_statement(updated)
        return _settled_if(self, original, updated)

    def _review_settings(self, call: cst.Call) -> None:
        """What torch.amp does not keep: apex's O0 (float32) and O3 (pure float16), a static
        loss scale (GradScaler's is dynamic)."""
        level = get_arg(call, "opt_level")
        text = literal_str(level.value) if level is not None else "O1"
        if text not in ("O1", "O2"):
            shown = text or cst.Module(body=[]).code_for_node(level.value)
            self.report(call, f"opt_level {shown} becomes autocast mixed precision (apex O1/O2): O0 (float32) and "
                              "O3 (pure float16) are not kept; `GPUMIGRATE_AMP=off` runs in float32", review=True)
        scale = get_arg(call, "loss_scale")
        if scale is not None and literal_str(scale.value) != "dynamic":
            self.report(call, "a static loss_scale becomes GradScaler's dynamic scaling (it starts at 65536 and "
                              "adapts)", review=True)

    def leave_With(self, original: cst.With, updated: cst.With):
        """`with amp.scale_loss(loss, opt) as scaled: scaled.backward()` ->
        `scaler.scale(loss).backward()`."""
        if id(original) not in self.plan.scale_loss_withs:
            return None
        self.report(original.items[0].item, "`amp.scale_loss` becomes the GradScaler's `scale`")
        if not self._migrating():
            return None
        call = original.items[0].item
        loss = call.args[0].value.deep_clone()
        scaled = _scaler_call(self.plan, "scale", [loss])
        name = original.items[0].asname.name
        inner = list(updated.body.body)
        first = inner[0]
        if len(inner) == 1 and isinstance(first, cst.SimpleStatementLine) and len(first.body) == 1 and \
                isinstance(first.body[0], cst.Expr) and isinstance(first.body[0].value, cst.Call) and \
                isinstance(first.body[0].value.func, cst.Attribute) and \
                first.body[0].value.func.value.deep_equals(name):
            backward = first.body[0].value
            line = first.with_changes(body=[cst.Expr(backward.with_changes(
                func=backward.func.with_changes(value=scaled)))], leading_lines=updated.leading_lines)
            return line
        assign = cst.SimpleStatementLine(body=[cst.Assign(targets=[cst.AssignTarget(name.deep_clone())],
                                                          value=scaled)], leading_lines=updated.leading_lines)
        return cst.FlattenSentinel([assign, *inner])

    def leave_Call(self, original: cst.Call, updated: cst.Call):
        name = self.qualify(original.func)
        if name == "apex.amp.master_params":
            self.report(original, "`amp.master_params(opt)`: the optimizer's own parameters (unscaled first)")
            if self._migrating():
                return updated.with_changes(func=runtime_name(self.ctx, "optimizer_params", self.fixing))
        elif name == "apex.amp.state_dict" and not original.args:
            self.report(original, "apex's loss-scale state becomes the GradScaler's")
            if self._migrating():
                return _scaler_call(self.plan, "state_dict", [])
        elif name == "apex.amp.load_state_dict" and len(original.args) == 1:
            self.report(original, "apex's loss-scale state becomes the GradScaler's (apex checkpoints still load)")
            if self._migrating():
                return cst.Call(func=runtime_name(self.ctx, "load_scaler_state", self.fixing),
                                args=[cst.Arg(cst.Name(self.plan.scaler)), updated.args[0].with_changes(
                                    comma=cst.MaybeSentinel.DEFAULT)])
        return None


_APEX_MIGRATED = ("apex.amp", "apex.amp.initialize", "apex.amp.scale_loss", "apex.amp.master_params",
                  "apex.amp.state_dict", "apex.amp.load_state_dict")


def _apex_module(node: cst.CSTNode) -> bool:
    if isinstance(node, cst.ImportFrom):
        return node.module is not None and (dotted(node.module) or "").split(".")[0] == "apex"
    return isinstance(node, cst.Import) and all((dotted(a.name) or "").split(".")[0] == "apex" for a in node.names)


def _imports_apex_amp(node: cst.ImportFrom) -> bool:
    module = dotted(node.module) if node.module is not None else None
    if module == "apex" and not isinstance(node.names, cst.ImportStar):
        return any(dotted(a.name) == "amp" for a in node.names)
    return module == "apex.amp"


def _only_pass(block: cst.BaseSuite) -> bool:
    """A block of `pass` alone (comments aside: they stay, see `_comments`)."""
    if not isinstance(block, cst.IndentedBlock):
        return False
    return all(m.matches(line, m.SimpleStatementLine(body=[m.Pass()])) for line in block.body)


def _comments(node: cst.CSTNode) -> List[cst.EmptyLine]:
    """Every comment in `node`, each as a line of its own: what a removed block leaves."""
    return [cst.EmptyLine(comment=cst.Comment(c.value)) for c in m.findall(node, m.Comment())]


def _same_statements(a: cst.BaseSuite, b: cst.BaseSuite) -> bool:
    """The same code, comments and layout aside."""
    if not (isinstance(a, cst.IndentedBlock) and isinstance(b, cst.IndentedBlock)):
        return False
    import ast

    from gpumigrate.rewriter.engine import parse_python

    try:
        return ast.dump(parse_python(cst.Module(body=list(a.body)).code)) == \
            ast.dump(parse_python(cst.Module(body=list(b.body)).code))
    except SyntaxError:  # `return` or `yield` of a function body: the rendered text, without comments
        render = cst.Module(body=[]).code_for_node
        plain = [c.value for c in m.findall(a, m.Comment()) + m.findall(b, m.Comment())]

        def text(block: cst.IndentedBlock) -> str:
            out = "".join(render(s) for s in block.body)
            for c in plain:
                out = out.replace(c, "")
            return "".join(out.split())
        return text(a) == text(b)


def _negated(test: cst.BaseExpression) -> cst.BaseExpression:
    if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
        return test.expression.with_changes(lpar=[], rpar=[]) if isinstance(
            test.expression, (cst.BooleanOperation, cst.Comparison, cst.Name, cst.Attribute)) else test.expression
    if not isinstance(test, (cst.Name, cst.Attribute, cst.Call, cst.Subscript)) and not test.lpar:
        test = test.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
    return cst.UnaryOperation(operator=cst.Not(), expression=test)


def _settled_if(rule: "_MigratedByAmp", original: cst.If, updated: cst.If):
    """An `if FLAG:` the amp migration left with nothing to choose (`if args.fp16:` around
    apex's `scale_loss` and `else: loss.backward()`, both now `scaler.scale(loss).backward()`;
    `if args.half: model.half()`, now empty): identical branches become the one, an emptied
    body goes (its `else` runs `if not FLAG:`). Only for a test without calls (evaluating it
    does nothing else), and only where the migration made them so."""
    s = script_model(rule.ctx).s
    if not rule.plan.applies or not isinstance(updated.body, cst.IndentedBlock) or \
            s.inside(original.test, cst.Call):
        return None
    test = " ".join(cst.Module(body=[]).code_for_node(original.test).split())
    orelse = updated.orelse
    # the comments of what goes stay, above what is left (a stale comment beats a lost one)
    if _only_pass(updated.body) and not _only_pass(original.body):
        if orelse is None or isinstance(orelse, cst.Else) and _only_pass(orelse.body):
            rule.report(original, f"`if {test}:` has nothing left to do after the migration: it goes")
            return rule.ctx.remove_statement(updated.with_changes(
                leading_lines=[*updated.leading_lines, *_comments(updated.body), *(
                    _comments(orelse) if orelse is not None else [])]))
        if isinstance(orelse, cst.Else) and isinstance(orelse.body, cst.IndentedBlock) and not orelse.leading_lines:
            rule.report(original, f"`if {test}:` has nothing left to do after the migration: its `else` runs "
                                  f"`if not ...:`")
            return updated.with_changes(test=_negated(updated.test), body=orelse.body, orelse=None,
                                        leading_lines=[*updated.leading_lines, *_comments(updated.body)])
        return None
    if isinstance(orelse, cst.Else) and isinstance(original.orelse, cst.Else) and not orelse.leading_lines and \
            not _comments(cst.IndentedBlock(body=[], footer=updated.body.footer)) and \
            _same_statements(updated.body, orelse.body) and not _same_statements(original.body, original.orelse.body):
        rule.report(original, f"`if {test}:` and its `else` do the same after the migration: one is kept")
        stmts = list(updated.body.body)
        stmts[0] = stmts[0].with_changes(leading_lines=[  # and the dropped branch's comments after its own
            *updated.leading_lines, *_comments(updated.body.header), *stmts[0].leading_lines, *_comments(orelse)])
        return cst.FlattenSentinel(stmts)
    return None


def _whole_line(small: cst.CSTNode, call: Optional[cst.CSTNode], halves: set) -> bool:
    """`model.half()` or `x = x.half()`: a statement that is nothing but one of `halves`."""
    if call is None or id(call) not in halves or getattr(small, "value", None) is not call:
        return False
    if isinstance(small, cst.Expr):
        return True
    return isinstance(small, cst.Assign) and len(small.targets) == 1 and \
        small.targets[0].target.deep_equals(call.func.value)


class HalfTraining(_MigratedByAmp):
    """
    ## What it does
    Finds training in float16 made by hand: `model.half()` on a model an optimizer trains,
    and `.half()` on its inputs.

    ## Why is this bad?
    Pure float16 training underflows small gradients to zero and, with BatchNorm, fails to
    converge; there is no loss scaling. Autocast runs each operation in the precision that
    suits it, with float32 weights.

    ## Example
    ```python
    model = Net().half()
    for x, y in loader:
        loss = crit(model(x.half()), y)
    ```

    ## Use instead
    ```python
    model = Net()
    for x, y in loader:
        with autocast(model):
            loss = crit(model(x), y)
    ```
    `--keep-half` keeps pure float16; GM305 then keeps BatchNorm in float32. An `if
    args.half:` left with nothing to do goes (its `else`, if any, runs `if not args.half:`;
    its comments stay). Where every `.half()` of a model ran only `if args.half:`, the flag
    keeps its meaning: autocast and the scaler get `enabled=args.half`, so a run without it
    trains in float32 as before.
    """

    code = "GM502"
    done = "`.half()` training → autocast with float32 weights"
    name = "half-without-scaling"
    message = "`.half()` training has no loss scaling and float16 weights; use autocast (--to amp)"
    fixed_in = frozenset({"amp"})
    triggers = ("half",)

    # an argument-less `.half()` in a file the amp plan reads: torch (or the runtime) imported,
    # and a `.backward()` or `.step()` call
    @classmethod
    def gate(cls, facts: SourceFacts) -> bool:
        return facts.any_call("half") and ("torch" in facts.ids or facts.id_containing("gpumigrate")) and (
            facts.any_call("step") or "backward" in facts.ids)

    examples = (
        Flagged(_HEAD + "model.half()\nfor x, y in loader:\n    loss = model(x.half()).sum()\n    loss.backward()\n"
                "    opt.step()\n",
                fixed="import torch\nfrom gpumigrate.runtime import autocast, grad_scaler\n\nscaler = grad_scaler()\n"
                "model = torch.nn.Linear(4, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                "for x, y in loader:\n    with autocast(model):\n        loss = model(x).sum()\n"
                "    scaler.scale(loss).backward()\n    scaler.step(opt)\n    scaler.update()\n"),
        # `if args.half:` left empty goes; an emptied branch's `else` runs `if not ...:`
        Flagged(_HEAD + "if args.half:\n    model.half()\nfor x, y in loader:\n    if args.half:\n"
                "        x = x.half()\n    else:\n        x = x.float()\n    loss = model(x).sum()\n"
                "    loss.backward()\n    opt.step()\n",
                fixed="import torch\nfrom gpumigrate.runtime import autocast, grad_scaler\n\nscaler = grad_scaler()\n"
                "model = torch.nn.Linear(4, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                "for x, y in loader:\n    if not args.half:\n        x = x.float()\n    with autocast(model):\n"
                "        loss = model(x).sum()\n    scaler.scale(loss).backward()\n    scaler.step(opt)\n"
                "    scaler.update()\n"),
        # the script's own switch stays one: `enabled=` it
        Flagged(_HEAD + "half = True\nif half:\n    model.half()\nfor x, y in loader:\n    loss = model(x.half()).sum()\n"
                "    loss.backward()\n    opt.step()\n",
                fixed="import torch\nfrom gpumigrate.runtime import autocast, grad_scaler\n\n"
                "model = torch.nn.Linear(4, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\nhalf = True\n"
                "scaler = grad_scaler(enabled=half)\nfor x, y in loader:\n    with autocast(model, enabled=half):\n"
                "        loss = model(x).sum()\n    scaler.scale(loss).backward()\n    scaler.step(opt)\n"
                "    scaler.update()\n"),
        Clean("import torch\nx = torch.zeros(2).half()\n"),  # no training: nothing to migrate
    )

    def visit_Module(self, node: cst.Module) -> None:
        self.plan = amp_plan(self.ctx)
        self.halves = {id(c) for c in self.plan.halves}
        model = script_model(self.ctx)
        if self.plan.applies and any(model.module_like(c.func.value) for c in self.plan.halves):
            for call in self.plan.kept_halves:  # data made float16 once, outside the loops
                self.report(call, "`.half()` kept: if this feeds the model, drop it (the model is float32 now; "
                                  "autocast casts per operation, evaluation outside autocast does not)", review=True)

    def leave_SimpleStatementLine(self, original, updated):
        """`model.half()` alone on its line goes, and so does `x = x.half()`; so does a
        `keep_batchnorm_fp32(model)` (GM305's guard, from a device pass or an earlier run):
        the model it guarded is float32 now."""
        small = original.body[0] if len(original.body) == 1 else None
        if small is not None and self._obsolete_guard(small):
            self.report(small.value)
            self.ctx.remove_import(self.qualify(small.value.func).rsplit(".", 1)[0], "keep_batchnorm_fp32")
            return self.ctx.remove_statement(updated)
        if small is None or not _whole_line(small, getattr(small, "value", None), self.halves):
            return None
        self.report(small.value)
        return self.ctx.remove_statement(updated) if self.plan.applies else None

    def _obsolete_guard(self, small: cst.BaseSmallStatement) -> bool:
        if not (self.plan.applies and self.fixing and m.matches(small, m.Expr(m.Call(args=[m.Arg(m.Name())])))):
            return False
        model = script_model(self.ctx)
        return runtime_helper(self.qualify(small.value.func)) == "keep_batchnorm_fp32" and \
            model.module_like(small.value.args[0].value) and any(model.module_like(c.func.value) for c in self.plan.halves)

    def leave_If(self, original: cst.If, updated: cst.If):
        """`else: x = x.half()` emptied: the `else` goes."""
        if not self.plan.applies:
            return None
        if isinstance(original.orelse, cst.Else) and isinstance(updated.orelse, cst.Else):
            before, after = original.orelse.body.body, updated.orelse.body.body
            emptied = len(after) == 1 and m.matches(after[0], m.SimpleStatementLine(body=[m.Pass()])) and \
                not m.matches(before[0], m.SimpleStatementLine(body=[m.Pass()]))
            if emptied and not after[0].leading_lines and all(
                    any(id(c) in self.halves for c in script_model(self.ctx).s.inside(stmt, cst.Call))
                    for stmt in before):
                updated = updated.with_changes(orelse=None)
                return _settled_if(self, original.with_changes(orelse=None), updated) or updated
        return _settled_if(self, original, updated)

    def leave_Call(self, original: cst.Call, updated: cst.Call):
        if id(original) not in self.halves:
            return None
        if _whole_line(script_model(self.ctx).s.statement(original), original, self.halves):
            return None  # the whole line goes (above)
        self.report(original)
        if not self.plan.applies:
            return None
        receiver = updated.func.value
        return receiver.with_changes(lpar=updated.lpar or receiver.lpar, rpar=updated.rpar or receiver.rpar) \
            if isinstance(receiver, (cst.Name, cst.Attribute, cst.Call, cst.Subscript)) else receiver


_CUDA_AMP = {"torch.cuda.amp.autocast": "autocast", "torch.cuda.amp.autocast_mode.autocast": "autocast",
             "torch.cuda.amp.GradScaler": "GradScaler", "torch.cuda.amp.grad_scaler.GradScaler": "GradScaler"}
# torch.cuda.amp.autocast(enabled=True, dtype=torch.float16, cache_enabled=True): torch.autocast
# takes the device first, so positional arguments become keywords
_AUTOCAST_POSITIONS = ("enabled", "dtype", "cache_enabled")


def _keywords(args: Sequence[cst.Arg], positions: Sequence[str]):
    """[(keyword, value)] for a call's arguments, or None with *args/**kwargs."""
    out = []
    for i, arg in enumerate(args):
        if arg.star:
            return None
        if arg.keyword is None:
            if i >= len(positions):
                return None
            out.append((positions[i], arg.value))
        else:
            out.append((arg.keyword.value, arg.value))
    return out


def _last(args: Sequence[cst.Arg]) -> List[cst.Arg]:
    """The arguments with no comma after the last (it may have moved)."""
    out = list(args)
    if out:
        out[-1] = out[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
    return out


class DeprecatedCudaAmp(Rule):
    """
    ## What it does
    Finds `torch.cuda.amp.autocast(...)` and `torch.cuda.amp.GradScaler(...)`.

    ## Why is this bad?
    Both are deprecated for `torch.amp` (torch warns at every call), and both are CUDA only:
    on a CPU or a Mac the script silently trains in full precision.

    ## Example
    ```python
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)
    with torch.cuda.amp.autocast(enabled=args.amp):
        loss = crit(model(x), y)
    ```

    ## Use instead
    ```python
    scaler = grad_scaler(enabled=args.amp)
    with autocast(model, enabled=args.amp):
        loss = crit(model(x), y)
    ```
    (from gpumigrate.runtime: the device and dtype are chosen where the script runs.) Calls
    with other arguments keep them, as `torch.autocast("cuda", ...)` and
    `torch.amp.GradScaler("cuda", ...)`.
    """

    code = "GM503"
    done = "`torch.cuda.amp` → `torch.amp`"
    name = "deprecated-cuda-amp"
    message = "`torch.cuda.amp` is deprecated and CUDA-only; use `torch.amp`"
    fixed_in = frozenset({"amp"})
    triggers = ("amp",)
    torchfix = ("TOR101",)  # TorchFix's deprecated-function check, for these symbols

    # a call qualified as torch.cuda.amp's autocast or GradScaler
    @classmethod
    def gate(cls, facts: SourceFacts) -> bool:
        return {"torch", "cuda", "amp"} <= facts.ids and facts.any_id("autocast", "GradScaler")

    examples = (
        Flagged("import torch\nscaler = torch.cuda.amp.GradScaler(enabled=True)\n",
                fixed="import torch\nfrom gpumigrate.runtime import grad_scaler\n\n"
                "scaler = grad_scaler(enabled=True)\n"),
        Flagged("import torch\nwith torch.cuda.amp.autocast(dtype=torch.bfloat16):\n    y = f(x)\n",
                fixed="import torch\nwith torch.autocast(\"cuda\", dtype=torch.bfloat16):\n    y = f(x)\n"),
        Clean("import torch\nwith torch.autocast('cuda'):\n    y = f(x)\n"),
    )

    def visit_Module(self, node: cst.Module) -> None:
        model = script_model(self.ctx)
        self.calls = [c for c in model.s.index.of(cst.Call) if self.qualify(c.func) in _CUDA_AMP]
        self.forwards = {id(c): self._forward_in_with(c, model) for c in self.calls if "autocast" in _CUDA_AMP[
            self.qualify(c.func)]}
        # One form for the whole file: the runtime's (any device) only if every call can take
        # it; else torch.amp on CUDA everywhere, so that autocast and the scaler agree on
        # the precision (fp16 autocast with a scaler switched off would not scale).
        self.agnostic = bool(self.calls) and all(self._agnostic(c) for c in self.calls)

    def _agnostic(self, call: cst.Call) -> bool:
        if _CUDA_AMP[self.qualify(call.func)] == "GradScaler":
            return all(a.keyword is not None and a.keyword.value == "enabled" for a in call.args)
        keywords = _keywords(call.args, _AUTOCAST_POSITIONS)
        return keywords is not None and all(k == "enabled" for k, _ in keywords) and \
            self.forwards.get(id(call)) is not None

    def leave_Call(self, original: cst.Call, updated: cst.Call):
        kind = _CUDA_AMP.get(self.qualify(original.func) or "")
        if kind is None:
            return None
        cuda = cst.Arg(cst.SimpleString('"cuda"'))
        if kind == "GradScaler":
            self.report(original)
            if self.agnostic:
                return cst.Call(func=runtime_name(self.ctx, "grad_scaler", self.fixing), args=_last(updated.args))
            return cst.Call(func=torch_name(self.ctx, "amp.GradScaler", self.fixing), args=[cuda, *updated.args])
        keywords = _keywords(updated.args, _AUTOCAST_POSITIONS)
        if keywords is None:  # *args or **kwargs: keep them as they are, after the device
            self.report(original)
            return cst.Call(func=torch_name(self.ctx, "autocast", self.fixing), args=[cuda, *updated.args])
        args = [keyword_arg(k, v) for k, v in keywords]
        if self.agnostic:
            self.report(original)
            return cst.Call(func=runtime_name(self.ctx, "autocast", self.fixing),
                            args=_last([cst.Arg(self.forwards[id(original)].deep_clone()), *args]))
        self.report(original)
        if self.fixing:
            self.report(original, "kept on CUDA (`torch.autocast(\"cuda\")`), as the arguments or the model of "
                                  "this file's autocasts are not plain: on a CPU or a Mac it runs in float32",
                        review=True)
        return cst.Call(func=torch_name(self.ctx, "autocast", self.fixing), args=_last([cuda, *args]))

    def _forward_in_with(self, call: cst.Call, model) -> Optional[cst.BaseExpression]:
        """The trained model the `with` this call opens runs first."""
        parent = model.s.parent(call)
        with_node = model.s.parent(parent) if isinstance(parent, cst.WithItem) else None
        if not isinstance(with_node, cst.With):
            return None
        plan = amp_plan(self.ctx)
        for stmt in with_node.body.body:
            found = _forward_call(plan, stmt, plan.trained)
            if found is not None:
                return found
        return None
