"""DistributedDataParallel: GM400-GM411.

The ddp migration keeps a script runnable as `python train.py` and makes it correct under
`torchrun --nproc_per_node=N train.py`: one process group joined first, each trained model
wrapped, its training data sharded, metrics reduced where provably sums, output and
checkpoints from rank 0 only. Every runtime helper is a no-op in a single process. The
decisions come from the ddp plan (ddp_plan.py), which reads the script model; where a fact
is unknown the plan takes the safe form and GM400 reports it for review.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Set, Tuple, Union

import libcst as cst

from gpumigrate.analysis import script_model
from gpumigrate.analysis.launch import LAUNCHER_OPTIONS, launcher_variable, signed_int
from gpumigrate.analysis.model import COLLECTIVES, RUNTIME_COLLECTIVES
from gpumigrate.analysis.structure import dotted
from gpumigrate.analysis.syntax import last_name, runtime_helper
from gpumigrate.codemods.base import Clean, Flagged, Rule
from gpumigrate.codemods.ddp import FSDP_CODE, sharding  # noqa: F401  (FSDP_CODE re-exported)
from gpumigrate.codemods.ddp_plan import ddp_plan, device_definition, main_block
from gpumigrate.codemods.device_plan import _after_imports, device_plan, set_up_line
from gpumigrate.codemods.helpers import (
    defined_in,
    findall,
    fresh_name,
    get_arg,
    is_method_call,
    keyword_arg,
    literal_bool,
    name_assigns,
    remove_statement,
    runtime_name,
    same_code,
    with_args,
)
from gpumigrate.rewriter.facts import SourceFacts
from gpumigrate.rewriter.lazy import matchers as m

DATA_PARALLEL = ("torch.nn.DataParallel", "torch.nn.parallel.DataParallel",
                 "torch.nn.parallel.data_parallel.DataParallel")
DDP_CLASSES = ("torch.nn.parallel.DistributedDataParallel", "torch.nn.parallel.distributed.DistributedDataParallel")


# The option under which `lint` passes the codes selected by their full code (`--select GM409`):
# for those alone it reports what is true only once a script is migrated to DDP (ruff's
# opt-in rules). Lint reports the code as it is.
OPT_IN = "opt_in"


def after_migration(rule: Rule) -> bool:
    """Report a finding that holds only after a migration (the `module.` prefix a DataParallel
    checkpoint brings to a plain model): where the rule fixes it (the migration lists it), or
    where lint was asked for the rule by its code."""
    return rule.fixing or rule.code in rule.ctx.options.get(OPT_IN, ())


def _call(ctx, name: str, args: Sequence[cst.Arg] = (), fixing: bool = True) -> cst.Call:
    return cst.Call(func=runtime_name(ctx, name, fixing), args=list(args))


def _line(expr: cst.BaseExpression) -> cst.SimpleStatementLine:
    return cst.SimpleStatementLine(body=[cst.Expr(expr)])


def _assign(name: str, value: cst.BaseExpression) -> cst.SimpleStatementLine:
    return cst.SimpleStatementLine(body=[cst.Assign(targets=[cst.AssignTarget(cst.parse_expression(name))],
                                                    value=value)])


def _mixed_precision(ctx) -> bool:
    """The script runs under the runtime's autocast (the amp pass ran before): FSDP2 then
    keeps parameters in the same low precision for the forward (`mixed_precision=True`)."""
    return any(runtime_helper(q) in ("autocast", "grad_scaler") for q in ctx.names.local.values())


def _guard(ctx, stmts: List[cst.BaseStatement]) -> cst.If:
    """`if is_main_process():` around statements, the first one's comments moved above."""
    first = stmts[0]
    body = [first.with_changes(leading_lines=[]), *stmts[1:]]
    return cst.If(test=_call(ctx, "is_main_process"), body=cst.IndentedBlock(body=body),
                  leading_lines=first.leading_lines)


def _is_main_guard(node: Optional[cst.CSTNode]) -> bool:
    """An `if is_main_process():` (ours, or from an earlier run)."""
    return isinstance(node, cst.If) and m.matches(node.test, m.Call(args=[])) and \
        cst.Module(body=[]).code_for_node(node.test.func).endswith("is_main_process")


def split_line(line: cst.SimpleStatementLine, small: cst.BaseSmallStatement,
               inserted: Sequence[cst.SimpleStatementLine]) -> List[cst.BaseStatement]:
    """`a = 1; b = 2` with statements inserted before `b`: the line splits in two."""
    body = list(line.body)
    k = next((i for i, s in enumerate(body) if s is small), 0)
    if k == 0:
        first = list(inserted)
        first[0] = first[0].with_changes(leading_lines=line.leading_lines)
        return [*first, line.with_changes(leading_lines=[])]
    head = line.with_changes(body=[*body[:k - 1], body[k - 1].with_changes(semicolon=cst.MaybeSentinel.DEFAULT)],
                             trailing_whitespace=cst.TrailingWhitespace())
    tail = line.with_changes(body=body[k:], leading_lines=[])
    return [head, *inserted, tail]


class DdpSetup(Rule):
    """
    ## What it does
    Sets a single-process training script up for DistributedDataParallel (ddp migration
    only): `setup_distributed()` joins the process group first thing when launched by
    torchrun or srun, and each model an optimizer trains is wrapped with `wrap_model()`
    right before its optimizer is built (after it reached its device). Whatever the migration
    could not prove safe is listed here for review.

    ## Why is this bad?
    A single-process script uses one GPU however many the machine has.

    ## Example
    ```python
    model = Net().cuda()
    optimizer = optim.SGD(model.parameters(), lr=0.01)
    ```

    ## Use instead
    ```python
    device = setup_distributed()  # NCCL on GPUs, gloo on CPU; one device per process
    model = Net().to(device)
    model = wrap_model(model)     # DDP under torchrun; the model itself in one process
    optimizer = optim.SGD(model.parameters(), lr=0.01)
    ```
    Loss modules are never wrapped; a model the migration cannot wrap (a functional model,
    an optimizer whose parameters it cannot follow) keeps its data unsharded, so every rank
    still computes the same thing, and is reported.
    """

    code = "GM400"
    done = "DistributedDataParallel set-up"
    name = "ddp-setup"
    message = "single-process training: wrap the model in DistributedDataParallel"
    fixed_in = frozenset({"ddp"})
    lint = False  # a migration step, not a defect
    triggers = ("torch",)

    @staticmethod
    def wanted(options: dict) -> bool:
        """A script without torch of its own that drives a module of its project that trains."""
        return any("backward" in link.calls for link in getattr(options.get("project"), "imports", ()))
    examples = (
        Flagged(
            "import torch\nmodel = Net().cuda()\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
            "loader = torch.utils.data.DataLoader(data, batch_size=8)\n"
            "for x in loader:\n    model(x).sum().backward()\n    opt.step()\n",
            fixed="import torch\nfrom gpumigrate.runtime import distributed_sampler, setup_distributed, wrap_model\n\n"
            "device = setup_distributed()\nmodel = Net().to(device)\nmodel = wrap_model(model)\n"
            "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
            "loader = torch.utils.data.DataLoader(data, batch_size=8, sampler=distributed_sampler(data, shuffle=False))\n"
            "for x in loader:\n    model(x).sum().backward()\n    opt.step()\n",
        ),
        Flagged(  # no loader brings the data and a data test guards the step: no DDP (uneven steps)
            "import torch\nmodel = Net().cuda()\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
            "if len(memory) > 100:\n    model(x).sum().backward()\n    opt.step()\n",
            fixed="import torch\nfrom gpumigrate.runtime import setup_distributed\n\n"
            "device = setup_distributed()\nmodel = Net().to(device)\n"
            "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
            "if len(memory) > 100:\n    model(x).sum().backward()\n    opt.step()\n",
        ),
        Clean("import torch\n\nclass Net(torch.nn.Module):\n    def forward(self, x):\n        return x\n"),
    )

    def visit_Module(self, node: cst.Module) -> None:
        self.plan = ddp_plan(self.ctx)
        self.wraps = {}
        if not self.plan.script:
            if self.plan.lone_trainer:
                self.report(self.ctx.module.body[0], self.plan.lone_trainer, review=True, not_applied="ddp")
            return
        self.plan.active  # noqa: B018  (decides, and records why not)
        if self.plan.active:
            for wrap in self.plan.wraps:
                if not wrap.existing:
                    self.wraps.setdefault(id(wrap.anchor), []).append(wrap)
            if self.fixing:
                self._setup()
            for where, why in self.plan.review_items():
                self.report(where, why, review=True, not_applied="ddp" if why in self.plan.declined else "")
            if not self._set_up():  # said when the migration is made, not again by a second run
                for where, why in [*self.plan.averaging(), *self.plan.notes]:
                    self.report(where, why)
        else:
            if self.plan.own_launch_note is not None:
                self.ctx.report(self.code, self.plan.own_launch, self.plan.own_launch_note, fixed=False, review=False,
                                note=True)
            for where, why in self.plan.reviews:
                self.report(where, why, review=True, not_applied="ddp" if why in self.plan.declined else "")

    def _set_up(self) -> bool:
        """The script calls setup_distributed() already (an earlier run, or its own); a module
        its script sets up calls the runtime's helpers already (an earlier run)."""
        if self.plan.entry is None:
            return any(runtime_helper(self.qualify(c.func)) for c in findall(self.ctx.module, m.Call()))
        return any((self.qualify(c.func) or "").endswith("setup_distributed") for c in findall(self.ctx.module, m.Call()))

    def _setup(self) -> None:
        """`setup_distributed()` where the script starts: after the imports, or first in its
        `if __name__ == "__main__":` block. A device the script defines right there comes
        from it (`device = setup_distributed()`)."""
        if self._set_up() or self.plan.entry is None:
            return  # set up already; or a module of the program whose script sets it up
        kind, _ = self.plan.entry
        if kind == "module":
            self._device_line = self._device_definition()
            if self._device_line is not None:
                return  # it becomes `device = setup_distributed()` (leave_SimpleStatementLine)
        plan = device_plan(self.ctx)
        if kind == "module" and plan.define_at_top and plan.flag is None:
            plan.distributed_definition = True
            plan.need_definition()
            return
        name = runtime_name(self.ctx, "setup_distributed")
        statement = _line(cst.Call(func=name))

        def insert(module: cst.Module) -> cst.Module:
            if kind == "main":
                block = main_block(module)
                if block is None:
                    return module
                body = list(block.body.body)
                new_block = block.with_changes(body=block.body.with_changes(body=[statement, *body]))
                return module.with_changes(body=[new_block if s is block else s for s in module.body])
            at = _after_imports(module)
            body = list(module.body)
            first = statement.with_changes(leading_lines=[cst.EmptyLine()] if at else [])
            if at < len(body) and set_up_line(module, body[at]) and \
                    all(not line.comment for line in body[at].leading_lines):
                body[at] = body[at].with_changes(leading_lines=[])  # the set-up block, headed by the group
            return module.with_changes(body=body[:at] + [first] + body[at:])

        self.ctx.add_finisher("ddp-setup", insert)

    def _device_definition(self) -> Optional[cst.SimpleStatementLine]:
        """The script's first statement after its imports, if it is `device = get_device()`
        (what the device pass writes): setup_distributed() returns that device, so it takes
        the definition's place, as one run of both would have written it."""
        body = self.ctx.module.body
        at = _after_imports(self.ctx.module)
        line = body[at] if at < len(body) else None
        if line is None or not device_definition(line, self.qualify) or line.body[0].value.args:
            return None
        return line

    def _wrap_statements(self, wraps) -> List[cst.SimpleStatementLine]:
        out = []
        for wrap in wraps:
            args = [cst.Arg(cst.parse_expression(wrap.name))]
            if sharding(self.ctx):
                if _mixed_precision(self.ctx):
                    args.append(keyword_arg("mixed_precision", cst.Name("True")))
                out.append(_assign(wrap.name, _call(self.ctx, "shard_model", args, self.fixing)))
                continue
            if wrap.find_unused:
                args.append(keyword_arg("find_unused_parameters", cst.Name("True")))
            if self.ctx.options.get("sync_bn"):
                args.append(keyword_arg("sync_batchnorm", cst.Name("True")))
            out.append(_assign(wrap.name, _call(self.ctx, "wrap_model", args, self.fixing)))
        return out

    def leave_SimpleStatementLine(self, original, updated):
        if not self.plan.active:
            return None
        if original is getattr(self, "_device_line", None) and self.fixing:
            qualified = self.qualify(original.body[0].value.func)
            self.ctx.remove_import(qualified.rsplit(".", 1)[0], "get_device")
            return updated.with_changes(body=[updated.body[0].with_changes(
                value=cst.Call(func=runtime_name(self.ctx, "setup_distributed")))])
        own_init = self._own_init(original, updated)
        if own_init is not None:
            return own_init
        before = [(small, self.wraps[id(small)]) for small in original.body if id(small) in self.wraps]
        if not before:
            return None
        small, wraps = before[0]
        self._report(original, wraps)
        position = list(original.body).index(small)
        return cst.FlattenSentinel(split_line(updated, updated.body[position], self._wrap_statements(wraps)))

    def _own_init(self, original, updated) -> Optional[cst.If]:
        """A script that joins the process group itself (`dist.init_process_group(...)`):
        setup_distributed() has joined it already under torchrun, and a second init raises.
        The script's own call stays for launches setup_distributed() does not know."""
        if len(original.body) != 1 or not m.matches(original.body[0], m.Expr(m.Call(func=m.Attribute()))):
            return None
        call = original.body[0].value
        if self.qualify(call.func) != "torch.distributed.init_process_group":
            return None
        s = script_model(self.ctx).s
        guard = s.parent(s.parent(original))
        if isinstance(guard, cst.If) and any(isinstance(c, cst.Call) and self.qualify(c.func) ==
                                             "torch.distributed.is_initialized" for c in s.inside(guard.test, cst.Call)):
            return None  # guarded already (an earlier run, or the script's own care)
        self.report(call, "the script's own `init_process_group` runs only where setup_distributed() did not join "
                          "the group (a second init raises)")
        test = cst.UnaryOperation(operator=cst.Not(), expression=cst.Call(func=cst.Attribute(
            value=updated.body[0].value.func.value, attr=cst.Name("is_initialized"))))
        return cst.If(test=test, body=cst.IndentedBlock(body=[updated.with_changes(leading_lines=[])]),
                      leading_lines=updated.leading_lines)

    def _report(self, where, wraps) -> None:
        for wrap in wraps:
            if sharding(self.ctx):  # GM415 says where it is sharded
                if wrap.find_unused:
                    self.report(where, f"`{wrap.name}`'s forward branches on its inputs: FSDP2 reduces every "
                                       "parameter's gradient, and a parameter no rank used in a step gets none; "
                                       "check that a step uses the same parameters on every rank", review=True)
                continue
            why = " (a conditional forward: find_unused_parameters=True)" if wrap.find_unused else ""
            self.report(where, f"`{wrap.name}` trains in one process: wrapped in DistributedDataParallel{why}")

    def _block(self, original, updated):
        """Wraps that go after a line (the model's last move, when its optimizer is built
        elsewhere), after whatever the other fixes made of that line; or before a compound
        statement (an optimizer built in one of its branches)."""
        if not self.plan.active:
            return None
        body = list(updated.body)
        changed = False
        for line in reversed(original.body):
            wraps = self.wraps.get(id(line))
            if not wraps:
                continue
            where = self.ctx.span_of([line], body)
            if where is None:
                continue
            self._report(line, wraps)
            at = where[0] if wraps[0].before else where[1]
            body[at:at] = self._wrap_statements(wraps)
            changed = True
        return updated.with_changes(body=body) if changed else None

    leave_IndentedBlock = leave_Module = _block


class DataParallelWrapper(Rule):
    """
    ## What it does
    Finds `nn.DataParallel` (any import form, with or without `device_ids`).

    ## Why is this bad?
    DataParallel is single-process and multi-threaded: the GIL and GPU 0, which gathers every
    output, make it slower than DistributedDataParallel even on one machine.

    ## Example
    ```python
    model = nn.DataParallel(model, device_ids=[0, 1])
    print(model.module.fc)
    ```

    ## Use instead
    ```python
    model = wrap_model(model)          # DistributedDataParallel under torchrun
    print(unwrap_model(model).fc)
    ```
    Checkpoints the DataParallel script wrote have `module.`-prefixed keys: their
    `load_state_dict` goes through `without_module_prefix()`, so they still load.

    `gpumigrate lint` reports the DataParallel call. What holds only once it is gone (the
    `module.` keys of its checkpoints, `model.module` of a model no longer wrapped) is in the
    ddp migration's report, and in lint only with `--select GM401`.
    """

    code = "GM401"
    done = "`nn.DataParallel` → DistributedDataParallel"
    name = "data-parallel"
    message = "`nn.DataParallel` is single-process and slower than DistributedDataParallel"
    migration_notes = "`module.` keys and `model.module` once DataParallel is gone"
    fixed_in = frozenset({"ddp"})
    triggers = ("DataParallel",)

    # a call qualified as torch.nn('s parallel) DataParallel: every part of the name is an id
    @classmethod
    def gate(cls, facts: SourceFacts) -> bool:
        return {"torch", "nn", "DataParallel"} <= facts.ids

    examples = (
        Flagged(
            "import torch.nn as nn\nmodel = nn.DataParallel(Net())\nopt = make(model.parameters())\n"
            "w = model.module.fc.weight\n",
        ),
        Clean("import torch.nn as nn\nmodel = nn.parallel.DistributedDataParallel(Net())\n"),
    )

    def visit_Module(self, node: cst.Module) -> None:
        self.wrapped = {a.targets[0].target.value for a in name_assigns(node)
                        if any(self.qualify(c.func) in DATA_PARALLEL for c in findall(a.value, m.Call()))}

    def leave_Call(self, original: cst.Call, updated: cst.Call):
        if self.qualify(original.func) in DATA_PARALLEL:
            module = get_arg(updated, "module", 0)
            if module is None:
                self.report(original, review=True)
                return None
            self.report(original)
            plan = ddp_plan(self.ctx)
            if self.fixing and plan.active and not plan.wraps:
                self.report(original, "`nn.DataParallel` removed and no model is DDP-wrapped here (the gradients are "
                                      "averaged at each optimizer step instead): `python script.py` now trains on one "
                                      "GPU; run it under torchrun (`--nproc_per_node=<GPUs>`) to use them all",
                            review=True)
            value = module.value
            return value if isinstance(value, cst.BinaryOperation) else value.with_changes(lpar=[], rpar=[])
        # a checkpoint written by the DataParallel script has `module.` keys
        if self.wrapped and is_method_call(original, "load_state_dict") and original.args \
                and _root_name(original.func.value) in self.wrapped:
            first = updated.args[0]
            if m.matches(first.value, m.Call(func=m.Name(value=m.MatchIfTrue(lambda n: n.endswith("without_module_prefix"))))):
                return None
            if not after_migration(self):  # the DataParallel script loads its own `module.` keys
                return None
            self.report(original, "the DataParallel script saved `module.`-prefixed keys: loading them through "
                                  "`without_module_prefix()` keeps its checkpoints usable")
            value = _call(self.ctx, "without_module_prefix", [cst.Arg(first.value)], self.fixing)
            return updated.with_changes(args=[first.with_changes(value=value), *updated.args[1:]])
        return None

    def leave_Attribute(self, original: cst.Attribute, updated: cst.Attribute):
        # `model.module` reaches the user's module: unwrap_model works with or without a wrapper
        if original.attr.value != "module" or not m.matches(original.value, m.Name()) \
                or original.value.value not in self.wrapped or not after_migration(self):
            return None  # `.module` of the DataParallel wrapper is right as long as it stays
        self.report(original, "`.module` exists only on a wrapped model; `unwrap_model(model)` works in one process too")
        return _call(self.ctx, "unwrap_model", [cst.Arg(updated.value)], self.fixing)

    def leave_SimpleStatementLine(self, original, updated):
        # `model = nn.DataParallel(model)` leaves `model = model`
        if len(updated.body) == 1 and isinstance(updated.body[0], cst.Assign) and len(updated.body[0].targets) == 1 \
                and any(self.qualify(c.func) in DATA_PARALLEL for c in findall(original, m.Call())) \
                and same_code(updated.body[0].targets[0].target, updated.body[0].value):
            return remove_statement(self.ctx, updated)
        return None


def _root_name(expr: cst.BaseExpression) -> Optional[str]:
    while isinstance(expr, cst.Call) and expr.args and cst.Module(body=[]).code_for_node(expr.func).endswith(
            "unwrap_model"):
        expr = expr.args[0].value
    if isinstance(expr, cst.Attribute) and expr.attr.value == "module":
        expr = expr.value
    return expr.value if isinstance(expr, cst.Name) else None


class DistributedSamplerRule(Rule):
    """
    ## What it does
    Gives every training `DataLoader` a `DistributedSampler` (its `shuffle=` moves into the
    sampler) and calls `set_epoch` at the start of each epoch, or each time an iteration-based
    loop rebuilds its iterator; evaluation loaders whose metrics are sums get an unpadded
    shard. Epoch sizes computed from `len(train_set)` count this rank's share.

    ## Why is this bad?
    Without a sampler every rank trains on the whole dataset, in the same order: N times the
    work for the same result. A DistributedSampler without `set_epoch` repeats the same order
    every epoch.

    ## Example
    ```python
    train_loader = DataLoader(train_set, batch_size=64, shuffle=True)
    for epoch in range(epochs):
        train(epoch)
    ```

    ## Use instead
    ```python
    train_loader = DataLoader(train_set, batch_size=64, sampler=distributed_sampler(train_set))
    for epoch in range(epochs):
        set_epoch(train_loader, epoch)
        train(epoch)
    ```
    The batch size is per process: the effective batch is N x batch_size. Data is sharded
    only when the model that trains on it is DDP-wrapped.
    """

    code = "GM402"
    done = "data sharded per rank (DistributedSampler), reshuffled each epoch"
    name = "sampler-set-epoch"
    message = "each rank must see its own part of the data, in a new order each epoch"
    fixed_in = frozenset({"ddp"})
    lint = False
    # step: a loader from elsewhere feeding training; range/while/next: a driver's loop whose
    # steps are in a module of its project (`for it in range(n): model.optimize(gen)`)
    triggers = ("DataLoader", "backward", "step", "range(", "while ", "next(")
    examples = (
        Flagged(
            "import torch\nfrom torch.utils.data import DataLoader\n"
            "train_loader = DataLoader(ds, batch_size=8, shuffle=True)\nmodel = Net()\n"
            "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
            "for epoch in range(3):\n    for x in train_loader:\n        model(x).sum().backward()\n"
            "        opt.step()\n",
        ),
        Clean("from torch.utils.data import DataLoader\nimport torch\n"
              "loader = DataLoader(ds, sampler=torch.utils.data.distributed.DistributedSampler(ds))\n"),
    )

    def visit_Module(self, node: cst.Module) -> None:
        self.plan = ddp_plan(self.ctx)
        self.epoch_loops = self.plan.set_epoch_points() if self.plan.active else {}
        self.rebuilds = self.plan.rebuild_points() if self.plan.active else {}
        self.hoisted: dict = {}  # id(original line) -> (name, dataset expression)
        self.rows = {id(r.loop): r for r in self.plan.fixed_rows} if self.plan.active else {}
        self.row_loads = {k: name for r in self.rows.values() for k, name in r.loads.items()}
        self.loop_sites: dict = {}  # id(original For) -> its BatchSites (data, counter)
        self.iter_sites: dict = {}  # id(original expression in `iter(...)`) -> its BatchSite
        self.bound_sites: dict = {}  # id(original expression in `bar = tqdm(enumerate(...))`) -> its BatchSite
        self.step_sites: set = set()  # ids of `x += 1` step counters
        self.join_loops: set = set()  # ids of the `while` loops they end, where `join_ranks()` follows
        for site in (self.plan.batch_sites.values() if self.plan.active else ()):
            if site.kind == "iterator":
                self.iter_sites[id(site.expr)] = site
            elif site.kind == "step":
                self.step_sites.add(id(site.expr))
                # the ranks may step unevenly (a driver's modules' steps too, under tests this file
                # cannot see): they meet at its end, before what follows saves the model
                if self.plan.uneven_steps is not None or self.plan.driver:
                    self.join_loops.add(id(site.loop))
            elif site.kind == "data" and not script_model(self.ctx).s.index.contains(site.loop.iter, site.expr):
                self.bound_sites[id(site.expr)] = site  # in the wrapper a name the loop iterates is bound to
            else:
                self.loop_sites.setdefault(id(site.loop), []).append(site)

    def leave_Name(self, original: cst.Name, updated: cst.Name):
        shard = self.row_loads.get(id(original))
        return updated.with_changes(value=shard) if shard is not None else None

    def leave_Call(self, original: cst.Call, updated: cst.Call):
        if not self.plan.active:
            return None
        seeds = self.plan.environment_seeds
        if seeds and any(id(a.value) in seeds for a in original.args):
            self.report(original, "the environment is seeded per rank (`rank_seed(s)`: s * WORLD_SIZE + rank): each "
                                  "rank plays its own episodes")
            return updated.with_changes(args=[
                a.with_changes(value=_call(self.ctx, "rank_seed", (cst.Arg(a.value),), self.fixing))
                if id(o.value) in seeds else a for o, a in zip(original.args, updated.args)])
        if m.matches(original.func, m.Attribute(value=m.Attribute(attr=m.Name("sampler")), attr=m.Name("set_epoch"))) \
                and len(original.args) == 1 and not original.args[0].keyword:
            # the loader may reach the loop sharded at run time, with no DistributedSampler of its own
            self.report(original, "`loader.sampler.set_epoch(e)` becomes `set_epoch(loader, e)`: the same call "
                                  "where the sampler has one, none where the loader is sharded another way")
            return _call(self.ctx, "set_epoch", (cst.Arg(updated.func.value.value), updated.args[0]), self.fixing)
        if self.iter_sites and m.matches(original.func, m.Name("iter")) and len(original.args) == 1 and \
                id(original.args[0].value) in self.iter_sites:
            self.report(original, "the iterator that `next()` draws training batches from is this rank's part of "
                                  "the loader (`shard_batches`)")
            return updated.with_changes(args=[updated.args[0].with_changes(value=self._sharded(updated.args[0].value))])
        if self.bound_sites and any(id(a.value) in self.bound_sites for a in original.args):
            self.report(original, "training data sharded where the loop iterates it (`shard_batches`: each rank "
                                  "takes its own part, in full batches, a new order each pass)")
            return updated.with_changes(args=[a.with_changes(value=self._sharded(a.value)) if id(o.value) in
                                              self.bound_sites else a for o, a in zip(original.args, updated.args)])
        if self.plan.foreign_iterations and m.matches(original.func, m.Name("iter")) and len(original.args) == 1:
            inner = self._iterated(original.args[0].value, updated.args[0].value)
            if inner is not None:
                return updated.with_changes(args=[updated.args[0].with_changes(value=inner)])
        if self.plan.per_rank_size(original):
            self.report(original, "an epoch size from the whole dataset: this rank trains on its shard, "
                                  "`shard_length(dataset)` samples per epoch")
            return updated.with_changes(func=_call(self.ctx, "shard_length", (), self.fixing).func)
        edit = self.plan.loader_edits.get(id(original))
        if edit is None:
            return None
        if edit.problem is not None:
            if edit.problem != "already sharded" and not self.plan.iterated_sharded(original):
                self.report(original, edit.problem, review=True)
            return None
        if edit.rebuild:
            self.report(original, "training data sharded by the script's own DistributedSampler only behind its "
                                  "condition: rebuilt for this rank (`shard_loader`, which keeps that sampler where "
                                  "it is taken)")
            return _call(self.ctx, "shard_loader", [cst.Arg(updated)], self.fixing)
        dataset = get_arg(updated, "dataset", 0)
        if edit.hoist:
            # `DataLoader(TensorDataset(x, y), ...)`: the sampler needs the dataset, so it gets a name first
            named = cst.Name(self._dataset_name(original))
            self.hoisted[id(self._line(original))] = (named.value, dataset.value)
            updated = updated.with_changes(args=[a.with_changes(value=named) if a is dataset else a
                                                 for a in updated.args])
            dataset = get_arg(updated, "dataset", 0)
        shuffle = get_arg(updated, "shuffle", 2)
        shuffling = literal_bool(shuffle.value) if shuffle is not None else False
        args = [cst.Arg(dataset.value.deep_clone())]
        if edit.kind in ("train", "flag"):
            if shuffle is not None and shuffling is None:
                args.append(keyword_arg("shuffle", shuffle.value))
            elif not shuffling:
                args.append(keyword_arg("shuffle", cst.Name("False")))
        else:
            args.append(keyword_arg("shuffle", shuffle.value if shuffle is not None else cst.Name("False")))
        if edit.kind == "train":
            self.report(original, "training data sharded with a DistributedSampler")
        elif edit.kind == "flag":
            flag = cst.Name(edit.flag)
            test = cst.UnaryOperation(operator=cst.Not(), expression=flag) if edit.negated else flag
            args.append(keyword_arg("pad" if edit.eval_sharded else "shard", test))
            self.report(original, f"training data (`{edit.flag}` true) sharded with a DistributedSampler; "
                        + ("evaluation data sharded without padding" if edit.eval_sharded else
                           "evaluation data (`{}` false) kept whole on every rank".format(edit.flag)))
        else:
            args.append(keyword_arg("pad", cst.Name("False")))
            self.report(original, "evaluation data sharded without padding; its sums are reduced over ranks")
        sampler = keyword_arg("sampler", _call(self.ctx, "distributed_sampler", args, self.fixing))
        none = get_arg(updated, "sampler", 3) if self.plan.no_sampler(original) else None
        return with_args(updated, [*(a for a in updated.args if a is not shuffle and a is not none), sampler])

    def leave_Assign(self, original: cst.Assign, updated: cst.Assign):
        """`train_loader = helpers.get_loader(...)`: a loader made where the migration cannot
        see, rebuilt for this rank where it is bound."""
        if not any(original.value is value for value in self.plan.foreign_loaders):
            return None
        self.report(original.value, "training data from a loader made elsewhere: rebuilt for this rank where it is "
                                    "bound (`shard_loader`: a DistributedSampler that keeps its shuffle, batch size "
                                    "and workers, and a new order each epoch)")
        return updated.with_changes(value=_call(self.ctx, "shard_loader", [cst.Arg(updated.value)], self.fixing))

    def _iterated(self, original: cst.BaseExpression, updated: cst.BaseExpression):
        """`data_iter = iter(data_loader)` in training, where evaluation reads the same loader
        made elsewhere: training's batches come from this rank's part."""
        if id(original) not in self.plan.foreign_iterations:
            return None
        self.report(original, "training data from a loader made elsewhere, which evaluation reads too: rebuilt "
                              "for this rank where training iterates it (`shard_loader`: the same rebuilt loader "
                              "at every call, a new order each pass)")
        return _call(self.ctx, "shard_loader", [cst.Arg(updated)], self.fixing)

    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef):
        """`def train(self, data_loader):` called from another module: the loader it is handed
        is rebuilt for this rank first thing (the same rebuilt loader at every call)."""
        names = self.plan.foreign_params.get(id(original)) if self.plan.active else None
        if not names or not isinstance(updated.body, cst.IndentedBlock):
            return None
        self.report(original.name, f"training data handed in from another module (`{', '.join(names)}`): rebuilt "
                                   "for this rank on entry (`shard_loader`: a DistributedSampler that keeps its "
                                   "shuffle, batch size and workers, and a new order each epoch)")
        lines = [_assign(name, _call(self.ctx, "shard_loader", [cst.Arg(cst.Name(name))], self.fixing))
                 for name in names]
        body = list(updated.body.body)
        at = 1 if body and m.matches(body[0], m.SimpleStatementLine(body=[m.Expr(m.SimpleString() | m.ConcatenatedString())])) else 0
        return updated.with_changes(body=updated.body.with_changes(body=[*body[:at], *lines, *body[at:]]))

    def _line(self, node: cst.CSTNode) -> Optional[cst.CSTNode]:
        return script_model(self.ctx).s.line(node)

    def _loop(self, original, updated):
        rows = self.rows.get(id(original))
        if rows is not None:
            self.report(original, f"full-batch training on fixed tensors (`{'`, `'.join(rows.names)}`): their rows "
                                  "(dim 0) are split between the ranks as a DistributedSampler splits a dataset "
                                  "(`shard_rows`), and the loop trains on this rank's")
            targets = [cst.Element(cst.Name(name)) for name in rows.shards]
            split = _call(self.ctx, "shard_rows", [cst.Arg(cst.Name(name)) for name in rows.names], self.fixing)
            line = cst.SimpleStatementLine(
                body=[cst.Assign(targets=[cst.AssignTarget(cst.Tuple(targets, lpar=[], rpar=[]) if len(targets) > 1
                                                           else targets[0].value)], value=split)],
                leading_lines=updated.leading_lines)
            return cst.FlattenSentinel([line, self._sampled_loop(original, updated.with_changes(leading_lines=[]))])
        return self._sampled_loop(original, updated)

    def _sampled_loop(self, original, updated):
        phase = self.plan.phase_loops.get(id(original)) if self.plan.active else None
        if phase is not None and isinstance(original.iter, cst.Subscript):
            self.report(original.iter, f"training data, in the passes where `{self.ctx.module.code_for_node(phase)}`: "
                                       "rebuilt for this rank there (`shard_loader`); the other phases read the "
                                       "whole set, as before")
            updated = updated.with_changes(iter=_call(self.ctx, "shard_loader", [
                cst.Arg(updated.iter), keyword_arg("shard", phase.deep_clone())], self.fixing))
        if isinstance(original, cst.For) and self.plan.foreign_iterations:
            inner = self._iterated(original.iter, updated.iter)
            if inner is not None:
                updated = updated.with_changes(iter=inner)
        for site in self.loop_sites.get(id(original), ()):
            updated = self._shard_at(site, original, updated)
        holders = self.epoch_loops.get(id(original))
        if not holders or not isinstance(updated.body, cst.IndentedBlock):
            return updated
        target = original.target if isinstance(original, cst.For) and isinstance(original.target, cst.Name) else None
        self.report(original, "DistributedSampler needs `set_epoch` each epoch, or every epoch has the same order")
        calls = [_line(_call(self.ctx, "set_epoch", [cst.Arg(cst.parse_expression(h))]
                             + ([cst.Arg(target.deep_clone())] if target is not None else []), self.fixing))
                 for h in holders]
        body = updated.body
        return updated.with_changes(body=body.with_changes(body=[*calls, *body.body]))

    leave_For = _loop

    def leave_While(self, original: cst.While, updated: cst.While):
        loop = self._loop(original, updated)
        if id(original) not in self.join_loops or original.orelse is not None:
            return loop
        self.report(original, "the ranks may take different numbers of optimizer steps in this loop (their episodes "
                              "or data differ): they meet at its end (`join_ranks()`), where a rank that finished "
                              "first takes part in the others' steps, then every rank takes the training state of "
                              "the last one")
        parts = list(loop.nodes) if isinstance(loop, cst.FlattenSentinel) else [loop]
        return cst.FlattenSentinel([*parts, _line(_call(self.ctx, "join_ranks", (), self.fixing))])

    def leave_AugAssign(self, original: cst.AugAssign, updated: cst.AugAssign):
        """`it += 1` of the step counter that ends a `while` loop: `it = next_step(it)`."""
        if id(original) not in self.step_sites:
            return None
        code = self.ctx.module.code_for_node(original.target)
        self.report(original, f"training loop sharded by its step counter: `{code} = next_step({code})` counts the "
                              "WORLD_SIZE steps the ranks take together, so the loop ends when they have taken the "
                              "script's steps once (its `%` still counts this rank's own)")
        return cst.Assign(targets=[cst.AssignTarget(updated.target)],
                          value=_call(self.ctx, "next_step", [cst.Arg(updated.target.deep_clone())], self.fixing),
                          semicolon=updated.semicolon)

    def _sharded(self, expr: cst.BaseExpression, indices: bool = False) -> cst.Call:
        args = [cst.Arg(expr)] + ([keyword_arg("indices", cst.Name("True"))] if indices else [])
        return _call(self.ctx, "shard_batches", args, self.fixing)

    def _shard_at(self, site, original: cst.For, updated: cst.For) -> cst.For:
        """`for x in enumerate(loader)` -> `for x in enumerate(shard_batches(loader))`: the site's
        expression wrapped where it stands in the loop's iterable (found by the same argument
        positions in the updated tree)."""
        path, node = [], original.iter
        while node is not site.expr:
            if not isinstance(node, cst.Call):
                return updated
            k = next((i for i, a in enumerate(node.args) if script_model(self.ctx).s.index.contains(a.value, site.expr)
                      or a.value is site.expr), None)
            if k is None:
                return updated
            path.append(k)
            node = node.args[k].value

        def rebuild(expr: cst.BaseExpression, rest: List[int]) -> Optional[cst.BaseExpression]:
            if not rest:
                return self._sharded(expr, site.indices)
            if not isinstance(expr, cst.Call) or rest[0] >= len(expr.args):
                return None
            inner = rebuild(expr.args[rest[0]].value, rest[1:])
            if inner is None:
                return None
            args = list(expr.args)
            args[rest[0]] = args[rest[0]].with_changes(value=inner)
            return expr.with_changes(args=args)

        new = rebuild(updated.iter, path)
        if new is None:
            return updated
        code = " ".join(self.ctx.module.code_for_node(site.expr).split())
        if site.kind == "data":
            self.report(original.iter, f"training data sharded where this loop iterates it (`shard_batches`: each "
                                       f"rank takes its own part of what `{code}` yields, in full batches, a new "
                                       "order each pass)")
        elif site.indices:
            self.report(original.iter, f"training data indexed by this loop's counter: each rank takes its own "
                                       f"contiguous block of the values of `{code}` (`shard_batches(..., "
                                       "indices=True)`)")
        else:
            self.report(original.iter, f"training loop sharded by its counter: `shard_batches({code})` gives every "
                                       "rank every WORLD_SIZE-th value and the last (the same values on every rank), "
                                       "so the ranks together run the script's iterations once")
        return updated.with_changes(iter=new)

    def leave_SimpleStatementLine(self, original, updated):
        if not self.plan.active:
            return None
        lines: List[cst.BaseStatement] = [updated]
        hoisted = self.hoisted.pop(id(original), None)
        if hoisted is not None:
            name, value = hoisted
            lines = [_assign(name, value).with_changes(leading_lines=updated.leading_lines),
                     updated.with_changes(leading_lines=[])]
        rebuilt = self.rebuilds.get(id(original))
        if rebuilt is not None:
            self.report(original, "the iterator restarts the epoch: `set_epoch` reshuffles the DistributedSampler")
            call = _line(_call(self.ctx, "set_epoch", [cst.Arg(cst.parse_expression(rebuilt))], self.fixing))
            lines = [call.with_changes(leading_lines=lines[0].leading_lines),
                     lines[0].with_changes(leading_lines=[]), *lines[1:]]
        return cst.FlattenSentinel(lines) if len(lines) > 1 else None

    def _dataset_name(self, call: cst.Call) -> str:
        parent = script_model(self.ctx).s.parent(call)
        loader = ""
        if isinstance(parent, cst.Assign) and len(parent.targets) == 1 and isinstance(parent.targets[0].target, cst.Name):
            loader = parent.targets[0].target.value
        base = loader[: -len("loader")].rstrip("_") if loader.endswith("loader") else loader
        return fresh_name(self.ctx, f"{base}_dataset" if base not in ("", "data") else "dataset")


class ShuffleWithSampler(Rule):
    """
    ## What it does
    Finds `DataLoader(..., shuffle=True, sampler=...)`.

    ## Why is this bad?
    The two are mutually exclusive: the DataLoader raises "sampler option is mutually
    exclusive with shuffle" when it is built.

    ## Example
    ```python
    DataLoader(ds, shuffle=True, sampler=DistributedSampler(ds))
    ```

    ## Use instead
    ```python
    DataLoader(ds, sampler=DistributedSampler(ds, shuffle=True))
    ```
    """

    code = "GM403"
    name = "shuffle-with-sampler"
    message = "`shuffle=True` together with a sampler raises; shuffle in the sampler"
    reported_in = frozenset({"ddp"})
    triggers = ("sampler",)

    # torch's DataLoader called, in a file holding "sampler" (the rule runs only there: a
    # sampler passed by position need not be named)
    @classmethod
    def gate(cls, facts: SourceFacts) -> bool:
        return {"torch", "utils", "data", "DataLoader"} <= facts.ids and super().gate(facts)

    examples = (
        Flagged("from torch.utils.data import DataLoader\nl = DataLoader(ds, shuffle=True, sampler=s)\n"),
        Clean("from torch.utils.data import DataLoader\nl = DataLoader(ds, shuffle=False, sampler=s)\n"),
        Clean("from torch.utils.data import DataLoader\nl = DataLoader(ds, shuffle=True)\n"),
    )

    def visit_Call(self, node: cst.Call) -> None:
        if self.qualify(node.func) not in ("torch.utils.data.DataLoader", "torch.utils.data.dataloader.DataLoader"):
            return
        shuffle = get_arg(node, "shuffle", 2)
        if shuffle is not None and literal_bool(shuffle.value) is True and \
                (get_arg(node, "sampler", 3) is not None or get_arg(node, "batch_sampler", 4) is not None):
            self.report(shuffle)


class CheckpointEveryRank(Rule):
    """
    ## What it does
    Finds `torch.save` that would run on every rank (ddp migration: it runs on rank 0 only,
    and the saved model, also inside a list or dict, is unwrapped so it loads without a
    process group and its keys have no `module.` prefix). Where the script reads checkpoints
    back, the other ranks wait for the write (`barrier()`), if every rank reaches the save.

    ## Why is this bad?
    N processes write the same file at once (a corrupt checkpoint, N times the I/O), and a
    wrapped model's state_dict does not load into the plain model class.

    ## Example
    ```python
    torch.save(model.state_dict(), "model.pt")
    ```

    ## Use instead
    ```python
    if is_main_process():
        torch.save(unwrap_model(model).state_dict(), "model.pt")
    ```
    """

    code = "GM404"
    done = "`torch.save` from rank 0 only"
    name = "checkpoint-every-rank"
    message = "`torch.save` on every rank: save from rank 0 only"
    fixed_in = frozenset({"ddp"})
    lint = False
    triggers = ("save",)
    examples = (
        Flagged(
            "import torch\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\nfor epoch in range(3):\n"
            "    model(x).sum().backward()\n    opt.step()\n    torch.save(state, 'ckpt.pt')\n",
        ),
        Clean("import torch\nfrom gpumigrate.runtime import is_main_process\nif is_main_process():\n"
              "    torch.save(state, 'ckpt.pt')\n"),
    )

    def visit_Module(self, node: cst.Module) -> None:
        self.plan = ddp_plan(self.ctx)
        self.models = {w.name for w in self.plan.wraps}
        self.optimizers = sharded_optimizers(self.plan, self.models) if sharding(self.ctx) else {}
        self.aliases = sharded_aliases(self.plan, self.models) if sharding(self.ctx) else set()
        self.before: Dict[int, List[cst.SimpleStatementLine]] = {}  # id of an `if` -> gathers to put above it

    def _wrap(self, original, updated):
        if not self.plan.active or not self.plan.saves_here(original):
            return None
        for save in self.plan.saves_here(original):
            self.report(save)
        first: List[cst.SimpleStatementLine] = []
        if sharding(self.ctx):
            updated, first = self._gathered(original, updated)
            if first:  # the gathering leads, with the save's comments
                first[0] = first[0].with_changes(leading_lines=updated.leading_lines)
                updated = updated.with_changes(leading_lines=[])
        guarded = _guard(self.ctx, [updated])
        self.ctx.shared("rank-zero-gates", lambda ctx: set()).add(id(guarded))  # output may join it
        # the script reads checkpoints back: the other ranks wait for the write
        after = [_line(_call(self.ctx, "barrier"))] if self.plan.barrier_after(original) else []
        return cst.FlattenSentinel([*first, guarded, *after]) if first or after else guarded

    def _gathered(self, original, updated):
        """fsdp: each state_dict of a sharded model (or of its optimizer) in a save is gathered
        whole before the rank-0 gate, on every rank (a collective), and saved by rank 0."""
        # a module saved here may be the sharded model under another name (`net = model` before
        # shard_model(model), which shards the object in place): its aliases are gathered too
        gather = _Gather(self, original, self.aliases, self.optimizers)
        updated = updated.visit(gather)
        if not gather.first or self.plan.uniform(original):
            for note in gather.notes:
                self.report(original, note)
            return updated, gather.first
        branch = self._rank_branch(original)
        bound_inside = set()
        if branch is not None:  # names the branch binds cannot be read above it
            for node in self.plan.s.inside(branch.body, (cst.Assign, cst.AugAssign, cst.AnnAssign)):
                targets = [t.target for t in node.targets] if isinstance(node, cst.Assign) else [node.target]
                bound_inside.update((dotted(t) or "").split(".")[0] for t in targets)
        if branch is not None and not any(n.value in bound_inside for stmt in gather.first
                                          for n in findall(stmt, m.Name())):
            # the script's own `if rank == 0:` around the save: gathered before it
            self.before[id(branch)] = self.before.get(id(branch), []) + gather.first
            for note in gather.notes:
                self.report(original, note)
            self.report(original, "a save in the script's own rank-0 branch: the shards are gathered before the "
                                  "branch, on every rank")
            return updated, []
        self.report(original, "gathering a sharded model's state_dict is a collective: every rank must reach "
                              "this save, which the migration cannot prove; check that all ranks take this "
                              "path together", review=True)
        return updated, gather.first

    def _rank_branch(self, node: cst.CSTNode) -> Optional[cst.If]:
        """The outermost `if` of the script's own that tests the rank around `node`, where
        every rank reaches that `if` (in the same function)."""
        found = None
        for ancestor in self.plan.s.ancestors(node):
            if isinstance(ancestor, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
                break
            if isinstance(ancestor, cst.If) and self.plan.gated(node) and not self.plan.gated(ancestor) \
                    and self.plan.s.index.contains(ancestor.body, node):
                found = ancestor
        return found if found is not None and self.plan.uniform(found) else None

    def leave_SimpleStatementLine(self, original, updated):
        if id(original) in self.plan.gated_lines:
            return self._wrap(original, updated)
        if sharding(self.ctx) and self.plan.active and self.plan.gated(original) and self.plan.torch_saves(original):
            # a save in the script's own rank-0 branch: gathered above the branch, or left (reported)
            gathered, first = self._gathered(original, updated)
            return None if first else gathered
        return None

    def leave_If(self, original: cst.If, updated: cst.If):
        first = self.before.pop(id(original), [])
        if id(original) in self.plan.decided_on_rank0:
            self.report(original.test, "a test of the filesystem around a write that rank 0 alone makes: decided "
                                       "on rank 0 for every rank (`broadcast_object`), so all take the branch and "
                                       "wait for the write there")
            updated = updated.with_changes(test=_call(self.ctx, "broadcast_object", [cst.Arg(updated.test)],
                                                      self.fixing))
        if not first:
            return updated if id(original) in self.plan.decided_on_rank0 else None
        first[0] = first[0].with_changes(leading_lines=updated.leading_lines)
        return cst.FlattenSentinel([*first, updated.with_changes(leading_lines=[])])

    def leave_With(self, original: cst.With, updated: cst.With):
        if not self.plan.gated_with_saves(original):
            return None
        return self._wrap(original, updated)

    def leave_Call(self, original: cst.Call, updated: cst.Call):
        # torch.save(model, f), torch.save([model, optimizer], f): the plain module, not the wrapper
        if self.qualify(original.func) != "torch.save" or not updated.args or not self.models:
            return None
        obj = updated.args[0]
        if sharding(self.ctx):  # a gated save gathers the model whole (_Gather); elsewhere, review
            line = self.plan.s.line(original)
            gathered = id(line) in self.plan.gated_lines or any(
                isinstance(a, cst.With) and self.plan.gated_with_saves(a) for a in self.plan.s.ancestors(original))
            if not gathered and any(n.value in self.models for n in _saved_names(obj.value)):
                self.report(original, "a sharded model saved whole pickles this rank's shards: save "
                                      "`full_model(model)` (every rank calls it)", review=True)
            return None
        new = obj.value.visit(_Unwrap(self.models, lambda: _call(self.ctx, "unwrap_model", (), self.fixing).func))
        if new.deep_equals(obj.value):
            return None
        self.report(original, "a wrapped model inside a checkpoint: saved unwrapped, so it loads without a "
                              "process group")
        return updated.with_changes(args=[obj.with_changes(value=new), *updated.args[1:]])


def _saved_names(value: cst.BaseExpression) -> List[cst.Name]:
    """The names of a saved object that are the object or its items (`[model, opt]`), not `model.x`."""
    if isinstance(value, cst.Name):
        return [value]
    if isinstance(value, (cst.List, cst.Tuple)):
        return [n for e in value.elements for n in _saved_names(e.value)]
    if isinstance(value, cst.Dict):
        return [n for e in value.elements if isinstance(e, cst.DictElement) for n in _saved_names(e.value)]
    return []


def sharded_aliases(plan, models: Set[str]) -> Set[str]:
    """fsdp: `models` and the names that are the same object (`net = model` either way,
    `model_to_save = model.module if hasattr(model, "module") else model`): sharding is in
    place, so each holds the sharded model."""
    out = set(models)
    pairs = []  # (target, the names its value may be)
    for a in plan.s.index.of(cst.Assign):
        target = dotted(a.targets[0].target) if len(a.targets) == 1 else None
        sources = _same_object(a.value)
        if target and sources:
            pairs.append((target, sources))
    for _ in range(3):  # chains of aliases
        more = {t for t, sources in pairs if sources & out} | {n for t, sources in pairs if t in out for n in sources}
        if more <= out:
            break
        out |= more
    return out


def _same_object(value: cst.BaseExpression) -> Set[str]:
    """The dotted names `value` hands back as they are: `m`, `m.module`, `unwrap_model(m)`,
    `a if c else b`; empty for anything else (a call makes another object)."""
    if isinstance(value, cst.IfExp):
        return _same_object(value.body) | _same_object(value.orelse)
    if isinstance(value, cst.Call) and isinstance(value.func, cst.Name) and value.func.value == "unwrap_model" \
            and len(value.args) == 1:
        return _same_object(value.args[0].value)
    if isinstance(value, cst.Attribute) and value.attr.value == "module":
        return _same_object(value.value)
    name = dotted(value) if isinstance(value, (cst.Name, cst.Attribute)) else None
    return {name} if name else set()


def sharded_optimizers(plan, models: Set[str]) -> Dict[str, str]:
    """fsdp: the optimizer names (as bound) that train exactly one sharded model -> that model."""
    out: Dict[str, str] = {}
    for trained in plan.model.trained_models:
        if trained.name not in models:
            continue
        for opt in trained.optimizers:
            owners = {name for _, name in opt.owners}
            above = plan.s.parent(opt.site)
            if owners == {trained.name} and opt.resolved and isinstance(above, cst.Assign) and len(above.targets) == 1:
                name = dotted(above.targets[0].target)
                if name is not None:
                    out[name] = trained.name
    return out


def gathering_call(ctx, owner: str, optimizers: Dict[str, str], fixing: bool,
                   everywhere: bool = False) -> cst.Call:
    """The runtime call that gathers `owner.state_dict()` whole: `full_state_dict(model)`, or
    `full_optimizer_state_dict(model, optimizer)` for an optimizer of `optimizers`;
    `everywhere`: on every rank (`rank0_only=False`), not rank 0 alone."""
    if owner in optimizers:
        name, args = "full_optimizer_state_dict", [cst.Arg(cst.parse_expression(optimizers[owner])),
                                                   cst.Arg(cst.parse_expression(owner))]
    else:
        name, args = "full_state_dict", [cst.Arg(cst.parse_expression(owner))]
    if everywhere:
        args.append(keyword_arg("rank0_only", cst.Name("False")))
    return _call(ctx, name, args, fixing)


def _state_dict_of(call: cst.Call) -> Optional[str]:
    """`X.state_dict()` or `unwrap_model(X).state_dict()`: X's dotted name."""
    if call.args or not m.matches(call.func, m.Attribute(attr=m.Name("state_dict"))):
        return None
    receiver = call.func.value
    if isinstance(receiver, cst.Call) and isinstance(receiver.func, cst.Name) and \
            receiver.func.value == "unwrap_model" and len(receiver.args) == 1:
        receiver = receiver.args[0].value
    return dotted(receiver)


class _Gather(cst.CSTTransformer):
    """fsdp: `model.state_dict()` (and its optimizer's) inside a save → a name bound on every
    rank, before the save's rank-0 gate, to `full_state_dict(model)`."""

    def __init__(self, rule: Rule, where: cst.CSTNode, models: Set[str], optimizers: Dict[str, str]) -> None:
        super().__init__()
        self.rule, self.where, self.models, self.optimizers = rule, where, models, optimizers
        self.first: List[cst.SimpleStatementLine] = []
        self.notes: List[str] = []  # what was gathered: reported where the gathering is kept

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.BaseExpression:
        ctx, fixing = self.rule.ctx, self.rule.fixing
        if self.rule.qualify(updated.func) == "torch.save" and updated.args:
            # torch.save(model, f), torch.save([model, opt], f): an unsharded copy of the model
            names = {id(n) for n in _saved_names(updated.args[0].value) if n.value in self.models}
            if names:
                value = updated.args[0].value.visit(_Whole(self, names))
                return updated.with_changes(args=[updated.args[0].with_changes(value=value), *updated.args[1:]])
            return updated
        owner = _state_dict_of(updated)
        if owner not in self.models and owner not in self.optimizers:
            return updated
        name = fresh_name(ctx, owner.rsplit(".", 1)[-1] + "_state")
        self.first.append(_assign(name, gathering_call(ctx, owner, self.optimizers, fixing)))
        self.notes.append(f"`{owner}.state_dict()` of a sharded model: gathered whole on every rank "
                          f"(`{name}`), saved by rank 0")
        return cst.Name(name)


class _Whole(cst.CSTTransformer):
    """The sharded models of a saved object → names bound, before the rank-0 gate, to
    `full_model(model)` (every rank gathers, rank 0 pickles a copy of the user's class)."""

    def __init__(self, gather: _Gather, names: Set[int]) -> None:
        super().__init__()
        self.gather, self.names = gather, names

    def leave_Name(self, original: cst.Name, updated: cst.Name) -> cst.BaseExpression:
        if id(original) not in self.names:
            return updated
        rule = self.gather.rule
        name = fresh_name(rule.ctx, f"{original.value}_whole")
        self.gather.first.append(_assign(name, _call(rule.ctx, "full_model", [cst.Arg(updated)], rule.fixing)))
        self.gather.notes.append(f"`{original.value}` saved whole: an unsharded copy of its own class, "
                                 f"gathered on every rank (`{name}`), pickled by rank 0")
        return cst.Name(name)


class _Unwrap(cst.CSTTransformer):
    """Wrapped model names inside a saved object (a list, tuple or dict), not `model.x`."""

    def __init__(self, models, func) -> None:
        super().__init__()
        self.models, self.func = models, func

    def visit_Attribute(self, node: cst.Attribute) -> bool:
        return False

    def visit_Call(self, node: cst.Call) -> bool:
        return False

    def leave_Name(self, original: cst.Name, updated: cst.Name):
        if original.value in self.models:
            return cst.Call(func=self.func(), args=[cst.Arg(updated)])
        return updated


class LegacyLauncher(Rule):
    """
    ## What it does
    Gives the launcher's own argparse options the values torchrun sets: `--local_rank` /
    `--local-rank` (passed by the deprecated `python -m torch.distributed.launch`) default to
    `LOCAL_RANK`, and in a script that uses torch.distributed, `--world-size`/`--world_size`
    and `--rank` with a literal "not launched" default (-1, 0, 1) default to `WORLD_SIZE` and
    `RANK`. The script's own default stays the fallback, so `python train.py` is unchanged.

    ## Why is this bad?
    torchrun passes none of them; it sets environment variables. A script that reads the
    argument puts every process on GPU 0, and one that decides on `args.world_size > 1` or
    `args.local_rank != -1` never takes its own distributed path (its DDP wrap, its
    DistributedSampler): the ranks train on the same data.

    ## Example
    ```python
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--world-size", default=-1, type=int)
    ```

    ## Use instead
    ```python
    parser.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    parser.add_argument("--world-size", default=int(os.environ.get("WORLD_SIZE", -1)), type=int)
    ```
    """

    code = "GM405"
    done = "`--local_rank`/`--rank`/`--world-size` → torchrun's LOCAL_RANK, RANK, WORLD_SIZE"
    name = "legacy-launcher"
    message = "torchrun passes no `--local_rank`, `--rank` or `--world-size`: it sets LOCAL_RANK, RANK and WORLD_SIZE"
    fixed_in = frozenset({"ddp"})
    triggers = tuple(LAUNCHER_OPTIONS)

    # `.add_argument(...)` whose first argument is the plain string of a launcher option
    @classmethod
    def gate(cls, facts: SourceFacts) -> bool:
        return facts.any_call("add_argument") and not facts.strings.isdisjoint(LAUNCHER_OPTIONS)

    examples = (
        Flagged(
            "import os\nparser.add_argument('--local_rank', type=int, default=0)\n",
            fixed="import os\nparser.add_argument('--local_rank', type=int, default=int(os.environ.get(\"LOCAL_RANK\", 0)))\n",
        ),
        Flagged(
            "import os\nparser.add_argument('--local_rank', type=int, default=-1)\n",
            fixed="import os\nparser.add_argument('--local_rank', type=int, default=int(os.environ.get(\"LOCAL_RANK\", -1)))\n",
        ),
        Flagged(
            "import os\nimport torch.distributed as dist\nparser.add_argument('--world-size', default=-1, type=int)\n"
            "parser.add_argument('--rank', default=-1, type=int)\ndist.init_process_group('gloo')\n",
            fixed="import os\nimport torch.distributed as dist\n"
                  "parser.add_argument('--world-size', default=int(os.environ.get(\"WORLD_SIZE\", -1)), type=int)\n"
                  "parser.add_argument('--rank', default=int(os.environ.get(\"RANK\", -1)), type=int)\n"
                  "dist.init_process_group('gloo')\n",
        ),
        Clean("parser.add_argument('--rank', type=int, default=0)\n"),  # no torch.distributed: some other rank
        Clean("import torch.distributed as dist\nparser.add_argument('--rank', type=int, default=8)\n"
              "dist.init_process_group('nccl')\n"),
    )

    def leave_Call(self, original: cst.Call, updated: cst.Call):
        variable = launcher_variable(original, self.ctx.text)
        if variable is None:
            return None
        self.report(original)
        if self.fixing:
            self.ctx.add_import("os")
        # the script's own default stays the fallback: `-1` often means "not distributed"
        default = get_arg(updated, "default")
        fallback = signed_int(default.value) if default is not None else None
        value = cst.parse_expression(f'int(os.environ.get("{variable}", {fallback if fallback is not None else 0}))')
        if default is not None:  # in its place, so the line keeps its order
            return updated.with_changes(args=[a.with_changes(value=value) if a is default else a for a in updated.args])
        return with_args(updated, [*updated.args, keyword_arg("default", value)])


_SPAWN = ("torch.multiprocessing.spawn", "torch.multiprocessing.spawn.spawn")
_DEVICE_COUNT = ("torch.cuda.device_count",)
_INIT_GROUP = ("torch.distributed.init_process_group", "torch.distributed.distributed_c10d.init_process_group")


class SpawnLauncher(Rule):
    """
    ## What it does
    Puts a script with its own launcher into torchrun's form: `mp.spawn(main_worker,
    nprocs=ngpus, args=(...))` becomes one call, `main_worker(get_local_rank(), ...)`, in
    each process torchrun starts, and a process count taken from `torch.cuda.device_count()`
    becomes `get_world_size()` (ddp migration).

    ## Why is this bad?
    A script that spawns one worker per GPU runs nothing on a machine without CUDA (0
    processes), hard-codes its rendezvous (`MASTER_ADDR`, `MASTER_PORT`) and cannot span
    machines. Under torchrun each process is already the worker: it joins the group
    `setup_distributed()` made (the worker's own `init_process_group` runs only where no group
    exists: `python train.py` in one process).

    ## Example
    ```python
    ngpus = torch.cuda.device_count()
    mp.spawn(main_worker, nprocs=ngpus, args=(ngpus, args))
    ```

    ## Use instead
    ```python
    ngpus = get_world_size()
    main_worker(get_local_rank(), ngpus, args)  # launch: torchrun --nproc_per_node=NUM_GPUS train.py
    ```
    """

    code = "GM416"
    done = "`mp.spawn(worker, ...)` → `worker(get_local_rank(), ...)` in each process torchrun starts"
    name = "spawn-launcher"
    message = "a script that spawns its own workers runs none without CUDA and only on one machine: launch with torchrun"
    fixed_in = frozenset({"ddp"})
    lint = False  # right on one multi-GPU machine: a migration step
    triggers = ("spawn",)
    examples = (
        Flagged("import torch\nimport torch.multiprocessing as mp\n\ndef main_worker(gpu, n, args):\n    pass\n\n"
                "ngpus = torch.cuda.device_count()\nmp.spawn(main_worker, nprocs=ngpus, args=(ngpus, None))\n",
                fixed="import torch\nimport torch.multiprocessing as mp\n"
                      "from gpumigrate.runtime import get_local_rank, get_world_size\n\n"
                      "def main_worker(gpu, n, args):\n    pass\n\n"
                      "ngpus = get_world_size()\nmain_worker(get_local_rank(), ngpus, None)\n"),
        Clean("import torch.multiprocessing as mp\nmp.set_start_method('spawn')\n"),
        Flagged("import torch.multiprocessing as mp\n\ndef launch(worker_fn, world_size, *args):\n"
                "    mp.spawn(worker_fn, args=(world_size, *args), nprocs=world_size)\n",
                fixed="import torch.multiprocessing as mp\nfrom gpumigrate.runtime import get_local_rank\n\n"
                      "def launch(worker_fn, world_size, *args):\n"
                      "    worker_fn(get_local_rank(), world_size, *args)\n"),
    )

    def visit_Module(self, node: cst.Module) -> None:
        self.counts: Set[int] = set()  # id(value) of `n = torch.cuda.device_count()` that name nprocs
        model = script_model(self.ctx)
        for call in model.s.index.of(cst.Call):
            if self._spawn(call) is None:
                continue
            nprocs = get_arg(call, "nprocs", 2)
            if nprocs is not None and isinstance(nprocs.value, cst.Name):
                bindings = model.s.all_bindings(nprocs.value.value, model.s.scope(nprocs.value))
                if bindings and all(b.how == "assign" and isinstance(b.value, cst.Call) and
                                    self.qualify(b.value.func) in _DEVICE_COUNT for b in bindings):
                    self.counts.update(id(b.value) for b in bindings)

    def _spawn(self, call: cst.Call) -> Optional[cst.Name]:
        """The worker function of `mp.spawn(fn, ...)` (a function of this file, or one a launcher
        helper is handed: `def launch(worker_fn, *args)`), or None."""
        if self.qualify(call.func) not in _SPAWN or not call.args or call.args[0].keyword or call.args[0].star:
            return None
        fn = call.args[0].value
        if not isinstance(fn, cst.Name):
            return None
        model = script_model(self.ctx)
        _, bindings = model.s.lookup(fn.value, model.s.scope(call))
        return fn if bindings and (all(b.how == "def" for b in bindings)
                                   or [b.how for b in bindings] == ["param"]) else None

    def leave_Call(self, original: cst.Call, updated: cst.Call):
        if id(original) in self.counts:
            self.report(original, "the number of processes is torchrun's: `get_world_size()`")
            return _call(self.ctx, "get_world_size", (), self.fixing)
        fn = self._spawn(original)
        if fn is None or not isinstance(script_model(self.ctx).s.parent(original), cst.Expr):
            return None
        given = get_arg(updated, "args", 1)
        extra: List[cst.Arg] = []
        if given is not None:
            if not isinstance(given.value, cst.Tuple):
                self.report(original, "mp.spawn with arguments that are not a literal tuple: call the worker as "
                                      "`worker(get_local_rank(), *args)` under torchrun by hand", review=True)
                return None
            extra = [cst.Arg(e.value, star="*" if isinstance(e, cst.StarredElement) else "")
                     for e in given.value.elements]
        self.report(original)
        return cst.Call(func=updated.args[0].value, args=[cst.Arg(_call(self.ctx, "get_local_rank", (), self.fixing)),
                                                          *extra])


class NcclBackend(Rule):
    """
    ## What it does
    Replaces a hard-coded `"nccl"` backend of the script's own `init_process_group` (passed
    there, or through a name bound to the literal) with `distributed_backend()`: NCCL for
    CUDA tensors (and gloo for CPU ones) on a CUDA machine, gloo where there is no GPU, the
    device's own backend on XPU and the like.

    ## Why is this bad?
    NCCL exists only for CUDA GPUs: `init_process_group("nccl")` raises on a laptop, a Mac or a
    CPU runner, so the script's own distributed path cannot even be tried there.

    ## Example
    ```python
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    ```

    ## Use instead
    ```python
    dist.init_process_group(distributed_backend(), rank=rank, world_size=world_size)
    ```
    """

    code = "GM417"
    done = "`\"nccl\"` → `distributed_backend()`: NCCL on CUDA, gloo elsewhere"
    name = "nccl-backend"
    message = "a hard-coded NCCL backend runs on CUDA GPUs only"
    fixed_in = frozenset({"device"})
    triggers = ("nccl",)
    examples = (
        Flagged("import torch.distributed as dist\ndist.init_process_group('nccl', rank=0, world_size=1)\n",
                fixed="import torch.distributed as dist\nfrom gpumigrate.runtime import distributed_backend\n\n"
                      "dist.init_process_group(distributed_backend(), rank=0, world_size=1)\n"),
        Flagged("from torch.distributed import init_process_group\nbackend = 'nccl'  # 'nccl', 'gloo', etc.\n"
                "init_process_group(backend=backend)\n",
                fixed="from torch.distributed import init_process_group\nfrom gpumigrate.runtime import distributed_backend\n\n"
                      "backend = distributed_backend()  # 'nccl', 'gloo', etc.\ninit_process_group(backend=backend)\n"),
        Clean("import torch.distributed as dist\ndist.init_process_group('gloo')\n"),
        Clean("import torch.distributed as dist\nbackend = 'nccl'\nprint(backend)\ndist.init_process_group(backend)\n"),
    )

    def visit_Module(self, node: cst.Module) -> None:
        self.literals: Set[int] = set()  # id of each "nccl" string to replace
        model = script_model(self.ctx)
        for call in model.s.index.of(cst.Call):
            if self.qualify(call.func) not in _INIT_GROUP:
                continue
            backend = get_arg(call, "backend", 0)
            if backend is None:
                continue
            value = backend.value
            if _nccl(value):
                self.literals.add(id(value))
            elif isinstance(value, cst.Name):
                bindings = model.s.all_bindings(value.value, model.s.scope(value))
                uses = [n for n in model.s.index.of(cst.Name) if n.value == value.value
                        and not (isinstance(model.s.parent(n), cst.Arg) and model.s.parent(n).keyword is n)
                        and not (isinstance(model.s.parent(n), cst.Attribute) and model.s.parent(n).attr is n)
                        and model.s.lookup(n.value, model.s.scope(n))[1] == bindings]
                # only where the name is the backend and nothing else reads it (a config print keeps it)
                if bindings and all(b.how == "assign" and _nccl(b.value) for b in bindings) and \
                        len(uses) == len(bindings) + 1:
                    self.literals.update(id(b.value) for b in bindings)

    def leave_SimpleString(self, original: cst.SimpleString, updated: cst.SimpleString):
        if id(original) not in self.literals:
            return None
        self.report(original)
        return _call(self.ctx, "distributed_backend", (), self.fixing)


class MpiRank(Rule):
    """
    ## What it does
    Replaces mpi4py's rank and world size (`MPI.COMM_WORLD.Get_rank()`, `Get_size()`, `.rank`,
    `.size`, also through a name bound to `MPI.COMM_WORLD`) with the runtime's `get_rank()` and
    `get_world_size()`, in a program migrated to torchrun.

    ## Why is this bad?
    torchrun starts its processes without MPI: to mpi4py each one is rank 0 of a world of one.
    Data sharded by the MPI rank is then loaded whole on every rank (each trains on all of it),
    and a GPU picked by it is the same GPU on every rank. `get_rank()` is torch.distributed's
    rank, also under `mpiexec` once the script's own MPI setup has joined the process group.

    ## Example
    ```python
    dataset = ImageDataset(files, shard=MPI.COMM_WORLD.Get_rank(), num_shards=MPI.COMM_WORLD.Get_size())
    ```

    ## Use instead
    ```python
    dataset = ImageDataset(files, shard=get_rank(), num_shards=get_world_size())
    ```
    """

    code = "GM418"
    done = "the MPI rank and size → `get_rank()` / `get_world_size()`: torchrun starts no MPI processes"
    name = "mpi-rank"
    message = "mpi4py's rank and world size are 0 and 1 in every process torchrun starts"
    fixed_in = frozenset({"ddp"})
    lint = False
    triggers = ("COMM_WORLD",)
    examples = (
        Flagged("from mpi4py import MPI\nshard, shards = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()\n",
                fixed="from mpi4py import MPI\nfrom gpumigrate.runtime import get_rank, get_world_size\n\n"
                      "shard, shards = get_rank(), get_world_size()\n"),
        Flagged("from mpi4py import MPI\ncomm = MPI.COMM_WORLD\nprint(comm.rank, comm.size)\n",
                fixed="from mpi4py import MPI\nfrom gpumigrate.runtime import get_rank, get_world_size\n\n"
                      "comm = MPI.COMM_WORLD\nprint(get_rank(), get_world_size())\n"),
        Clean("from mpi4py import MPI\ndata = MPI.COMM_WORLD.bcast(data)\n"),
        Clean("from mpi4py import MPI\ndef load(path):\n    data = open(path).read() if MPI.COMM_WORLD.Get_rank() == 0 "
              "else None\n    return MPI.COMM_WORLD.bcast(data)\n"),
    )
    _HELPERS = {"Get_rank": "get_rank", "Get_size": "get_world_size", "rank": "get_rank", "size": "get_world_size"}

    def _world(self, node: cst.BaseExpression) -> bool:
        """`MPI.COMM_WORLD`, or a name bound only to it."""
        if (self.qualify(node) or "").endswith("MPI.COMM_WORLD"):
            return True
        if not isinstance(node, cst.Name):
            return False
        model = script_model(self.ctx)
        bindings = model.s.all_bindings(node.value, model.s.scope(node))
        return bool(bindings) and all(b.how == "assign" and b.value is not None and
                                      (self.qualify(b.value) or "").endswith("MPI.COMM_WORLD") for b in bindings)

    def _mpi_path(self, node: cst.CSTNode) -> bool:
        """In a function that communicates through MPI (`comm.bcast(data)` after `if rank == 0:
        read`) or joins the process group itself (the script's MPI launch path): the rank there
        goes with MPI's own collectives, which stay; leave it."""
        model = script_model(self.ctx)
        fn = model.s.function(node)
        scope = fn.node if fn is not None else self.ctx.module
        for call in model.s.inside(scope, cst.Call):
            func = call.func
            if self.qualify(func) in _INIT_GROUP:
                return True
            if isinstance(func, cst.Attribute) and func.attr.value not in ("Get_rank", "Get_size") and \
                    self._world(func.value):
                return True
        return False

    def leave_Call(self, original: cst.Call, updated: cst.Call):
        func = original.func
        if original.args or not isinstance(func, cst.Attribute) or func.attr.value not in ("Get_rank", "Get_size") \
                or not self._world(func.value) or self._mpi_path(original):
            return None
        self.report(original)
        return _call(self.ctx, self._HELPERS[func.attr.value], (), self.fixing)

    def leave_Attribute(self, original: cst.Attribute, updated: cst.Attribute):
        if original.attr.value not in ("rank", "size") or not self._world(original.value) or \
                self._mpi_path(original):
            return None
        parent = script_model(self.ctx).s.parent(original)
        if isinstance(parent, cst.Call) and parent.func is original:
            return None
        self.report(original)
        return _call(self.ctx, self._HELPERS[original.attr.value], (), self.fixing)


def _nccl(node: Any) -> bool:
    return isinstance(node, cst.SimpleString) and node.evaluated_value == "nccl"


def _loop_of(stmt: cst.CSTNode) -> Optional[cst.For]:
    """The loop a statement is, or wraps in `with torch.no_grad():`."""
    if isinstance(stmt, cst.For):
        return stmt
    if isinstance(stmt, cst.With) and isinstance(stmt.body, cst.IndentedBlock) and len(stmt.body.body) == 1:
        return _loop_of(stmt.body.body[0])
    return None


class _BlockRule(Rule):
    """A rule that rewrites whole statement lists (module and indented blocks) at once,
    after their statements are done: to insert after a loop, or to group statements."""

    def _block(self, original_body, updated_body):
        raise NotImplementedError

    def leave_IndentedBlock(self, original: cst.IndentedBlock, updated: cst.IndentedBlock):
        body = self._block(original.body, updated.body)
        return updated.with_changes(body=body) if body is not None else None

    def leave_Module(self, original: cst.Module, updated: cst.Module):
        body = self._block(original.body, updated.body)
        return updated.with_changes(body=body) if body is not None else None


class UnreducedMetric(Rule):
    """
    ## What it does
    Sums evaluation metrics over the ranks right after an evaluation loop over a sharded
    loader (ddp migration): `test_loss, correct = reduce_sum(test_loss, correct)`. An
    evaluation loader is sharded only when every metric it feeds is such a sum.

    ## Why is this bad?
    Under DDP each rank evaluates only its shard: a metric it prints is one shard's,
    reported as if it were the whole test set's.

    ## Example
    ```python
    for x, y in test_loader:
        correct += (model(x).argmax(1) == y).sum().item()
    print(correct / len(test_loader.dataset))
    ```

    ## Use instead
    ```python
    for x, y in test_loader:
        correct += (model(x).argmax(1) == y).sum().item()
    correct = reduce_sum(correct)
    print(correct / len(test_loader.dataset))
    ```
    Metrics kept in objects (`AverageMeter`, `score.update(...)`) or lists cannot be proven
    to be sums: their loader is not sharded, every rank evaluates the whole set (the weights
    are identical, so every rank gets the same numbers), and rank 0 prints.
    """

    code = "GM406"
    done = "metric reduced over ranks"
    name = "unreduced-metric"
    message = "a metric summed over one rank's shard is not the whole test set's: reduce it over ranks"
    fixed_in = frozenset({"ddp"})
    lint = False
    triggers = ("loader",)
    examples = (
        Flagged(
            "import torch\nfrom torch.utils.data import DataLoader\ntest_loader = DataLoader(test_set)\n"
            "opt = torch.optim.SGD(model.parameters(), lr=0.1)\nmodel(x).sum().backward()\nopt.step()\n"
            "correct = 0\nfor x, y in test_loader:\n    correct += 1\n",
        ),
        Clean("total = 0\nfor x, y in train_loader:\n    total += 1\n"),
    )

    def visit_Module(self, node: cst.Module) -> None:
        self.plan = ddp_plan(self.ctx)

    def _block(self, original, updated):
        """After each loop of this block whose sums the plan reduces (or the `with` that holds
        it alone), in whatever form the other fixes left that line."""
        if not self.plan.active or not self.plan.reduce_after:
            return None
        parent = self.ctx.ancestors[-1] if self.ctx.ancestors else None
        if isinstance(parent, cst.With) and _loop_of(parent) is not None:
            return None  # `with no_grad(): for ...`: the reduction goes after the `with`
        body = list(updated.body)
        changed = False
        for line in reversed(original.body):
            loop = _loop_of(line)
            names = self.plan.reduce_after.get(id(loop)) if loop is not None else None
            if not names:
                continue
            where = self.ctx.span_of([line], body)
            if where is None:
                continue
            self.report(loop, f"{', '.join(names)} summed over one rank's shard: reduced over ranks")
            targets = cst.Tuple([cst.Element(cst.Name(n)) for n in names], lpar=[], rpar=[]) if len(names) > 1 \
                else cst.Name(names[0])
            call = _call(self.ctx, "reduce_sum", [cst.Arg(cst.Name(n)) for n in names], self.fixing)
            body.insert(where[1], cst.SimpleStatementLine(body=[cst.Assign(targets=[cst.AssignTarget(targets)],
                                                                           value=call)]))
            changed = True
        return updated.with_changes(body=body) if changed else None

    leave_IndentedBlock = leave_Module = _block


class BatchNormWithoutSync(Rule):
    """
    ## What it does
    Finds BatchNorm layers in a script trained with DistributedDataParallel without
    SyncBatchNorm.

    ## Why is this bad?
    Under DDP each process normalises with the statistics of its own per-GPU batch; with
    small per-GPU batches these are noisy and accuracy drops.

    ## Example
    ```python
    self.bn = nn.BatchNorm2d(64)
    model = DistributedDataParallel(model)
    ```

    ## Use instead
    ```python
    model = wrap_model(model, sync_batchnorm=True)  # or nn.SyncBatchNorm.convert_sync_batchnorm
    ```
    (`gpumigrate --to ddp --sync-bn` writes this.)
    """

    code = "GM407"
    name = "batchnorm-without-sync"
    message = "BatchNorm under DDP normalises per-process batches; with small per-GPU batches use SyncBatchNorm"
    reported_in = frozenset({"ddp"})
    triggers = ("BatchNorm",)

    # "DistributedDataParallel" in the text (what the rule asks in lint) and a call qualified as
    # torch.nn's BatchNorm*; SyncBatchNorm's absence is not used (the rule reads data-free text)
    @classmethod
    def gate(cls, facts: SourceFacts) -> bool:
        return "DistributedDataParallel" in facts.text and {"torch", "nn"} <= facts.ids and \
            facts.id_containing("BatchNorm")

    examples = (
        Flagged("import torch.nn as nn\nbn = nn.BatchNorm2d(8)\nm = nn.parallel.DistributedDataParallel(net)\n"),
        Clean("import torch.nn as nn\nbn = nn.BatchNorm2d(8)\n"),
        Clean("import torch.nn as nn\nbn = nn.BatchNorm2d(8)\nnet = nn.SyncBatchNorm.convert_sync_batchnorm(net)\n"
              "m = nn.parallel.DistributedDataParallel(net)\n"),
    )

    def visit_Module(self, node: cst.Module) -> None:
        text = self.ctx.text
        distributed = "DistributedDataParallel" in text or ("GM400" in self.ctx.fixing and ddp_plan(self.ctx).active)
        synced = "SyncBatchNorm" in text or "sync_batchnorm" in text or self.ctx.options.get("sync_bn")
        self.active = distributed and not synced
        self.done = False

    def visit_Call(self, node: cst.Call) -> None:
        if not self.active or self.done:
            return
        qualified = self.qualify(node.func) or ""
        if qualified.startswith("torch.nn.BatchNorm") or qualified.startswith("torch.nn.modules.batchnorm.BatchNorm"):
            self.done = True  # once per file: the advice is per model
            self.report(node, "BatchNorm under DDP normalises each process's batch; with small per-GPU batches "
                              "use SyncBatchNorm (`--sync-bn`)", review=True)


class CollectiveInRankBranch(Rule):
    """
    ## What it does
    Finds collective calls (`dist.barrier()`, `all_reduce`, `broadcast`, ... and the
    runtime's `barrier`/`reduce_sum`/`broadcast_object`) where not every rank reaches them:
    inside `if rank == 0:` / `if is_main_process():` blocks, or in functions only called
    from there.

    ## Why is this bad?
    Every rank must enter a collective. Inside a rank-0 branch only rank 0 does, and the
    job hangs until the NCCL/gloo timeout (or two ranks' collectives mismatch).

    ## Example
    ```python
    if dist.get_rank() == 0:
        torch.save(state, path)
        dist.barrier()
    ```

    ## Use instead
    ```python
    if dist.get_rank() == 0:
        torch.save(state, path)
    dist.barrier()
    ```
    """

    code = "GM408"
    name = "collective-in-rank-branch"
    message = "a collective inside a rank-0-only branch hangs the other ranks"
    reported_in = frozenset({"ddp"})
    triggers = ("rank", "main_process", "is_master")

    # a torch.distributed or runtime collective called under an `if` whose test names the rank
    # (matched in the test's text, comments too: the text triggers)
    @classmethod
    def gate(cls, facts: SourceFacts) -> bool:
        return "If" in facts.kinds and facts.any_id(*COLLECTIVES, *RUNTIME_COLLECTIVES) and (
            {"torch", "distributed"} <= facts.ids or facts.id_containing("gpumigrate")) and super().gate(facts)

    examples = (
        Flagged("import torch.distributed as dist\nif dist.get_rank() == 0:\n    dist.barrier()\n"),
        Flagged("from gpumigrate.runtime import is_main_process, reduce_sum\nif is_main_process():\n"
                "    total = reduce_sum(total)\n"),
        Flagged("import torch.distributed as dist\ndef sync():\n    dist.barrier()\n"
                "if dist.get_rank() == 0:\n    sync()\n"),
        Clean("import torch.distributed as dist\nif dist.get_rank() == 0:\n    print('saved')\ndist.barrier()\n"),
        Clean("import torch.distributed as dist\nif epoch == 0:\n    dist.barrier()\n"),
        Clean("import torch.distributed as dist\nif dist.get_rank() == 0:\n    dist.gather(x, gather_list=out)\n"
              "else:\n    dist.gather(x)\n"),
    )

    def visit_Call(self, node: cst.Call) -> None:
        model = script_model(self.ctx)
        if not model.collective(node):
            return
        plan = ddp_plan(self.ctx)
        if plan.gated(node):
            if not self._both_branches(node):
                self.report(node)
            return
        fn = model.s.function(node)
        if fn is not None and fn.callers and all(plan.gated(c) for c in fn.callers):
            self.report(node, f"a collective in `{fn.name}()`, which only rank-0 branches call: the other ranks "
                              "never reach it, and the job hangs")

    def _both_branches(self, node: cst.Call) -> bool:
        """`if is_primary(): dist.gather(x, gather_list=out)` `else: dist.gather(x)`: the
        same collective on the other ranks' branch, so every rank enters it."""
        model = script_model(self.ctx)
        name = last_name(node.func)
        for ancestor in model.s.ancestors(node):
            if isinstance(ancestor, cst.If) and ancestor.orelse is not None and \
                    not model.s.index.contains(ancestor.test, node):
                other = ancestor.orelse if model.s.index.contains(ancestor.body, node) else ancestor.body
                return any(last_name(c.func) == name and model.collective(c) for c in model.s.inside(other, cst.Call))
        return False


_SAFE_ATTRIBUTES = {
    "parameters", "named_parameters", "buffers", "named_buffers", "train", "eval", "zero_grad", "to", "cuda",
    "cpu", "modules", "named_modules", "children", "named_children", "apply", "requires_grad_", "forward",
    "register_forward_hook", "register_forward_pre_hook", "register_full_backward_hook", "training", "half",
    "float", "double", "bfloat16", "type", "no_sync", "module",
}


class WrappedAttribute(Rule):
    """
    ## What it does
    Finds custom attributes and methods reached through a DDP-wrapped model:
    `model.init_hidden(bsz)`, `model.fc`, and `model.state_dict()` (whose keys get a
    `module.` prefix).

    ## Why is this bad?
    `DistributedDataParallel` forwards only `forward` and the `nn.Module` API: anything else
    raises `AttributeError: 'DistributedDataParallel' object has no attribute ...`.

    ## Example
    ```python
    model = DistributedDataParallel(model)
    hidden = model.init_hidden(args.batch_size)
    ```

    ## Use instead
    ```python
    hidden = unwrap_model(model).init_hidden(args.batch_size)
    ```
    Only uses that run after the model is wrapped are rewritten.

    `nn.DataParallel` forwards no custom attribute either, so lint reports those through it
    as they are. The `module.` keys of a DataParallel model's `state_dict` are right as long
    as the script keeps DataParallel: they are in the ddp migration's report, and in lint
    only with `--select GM409`. Under DDP they are reported, and a ddp-migrated script's
    `wrap_model(model)` is DDP under torchrun: an attribute added to it later is reported.
    """

    code = "GM409"
    done = "attribute read through `unwrap_model(model)`"
    name = "wrapped-attribute"
    message = "custom attribute of a DataParallel/DDP-wrapped model raises `AttributeError`; use `unwrap_model(model)`"
    migration_notes = "`module.` keys of a DataParallel model's state_dict"
    fixed_in = frozenset({"ddp"})
    triggers = ("parameters", "DistributedDataParallel", "DataParallel", "wrap_model")

    # a name assigned from a call qualified as torch.nn's DataParallel or DistributedDataParallel,
    # or the runtime's wrap_model (a ddp-migrated script: DDP under torchrun)
    @classmethod
    def gate(cls, facts: SourceFacts) -> bool:
        return {"torch", "nn"} <= facts.ids and facts.any_id("DataParallel", "DistributedDataParallel") \
            or facts.any_id("wrap_model")

    examples = (
        Flagged(
            "import torch.nn as nn\nmodel = nn.parallel.DistributedDataParallel(net)\nh = model.init_hidden(4)\n",
        ),
        Clean("import torch.nn as nn\nmodel = nn.parallel.DistributedDataParallel(net)\nmodel.train()\n"
              "ps = model.parameters()\n"),
        Clean("import torch.nn as nn\nmodel = Net()\nh = model.init_hidden(4)\n"),
    )

    def visit_Module(self, node: cst.Module) -> None:
        self.plan = ddp_plan(self.ctx)
        self.data_parallel: Set[str] = set()  # names only ever bound to an `nn.DataParallel` wrapper
        self.scopes: List[Tuple[Set[str], Set[str]]] = []
        if self.fixing and "GM400" in self.ctx.fixing:  # --to ddp wraps the models (not `lint --fix`)
            # fsdp: a sharded model is still the user's class (FSDP2 wraps nothing): its
            # attributes and keys are as they were
            self.wrapped = (lambda ref: False) if sharding(self.ctx) else self.plan.wrapped_reference
            return
        wrappers = DATA_PARALLEL + DDP_CLASSES
        kinds: Dict[str, Set[bool]] = {}
        for a in name_assigns(node):
            qualified = self.qualify(a.value.func) if type(a.value) is cst.Call else None
            if qualified in wrappers or runtime_helper(qualified) == "wrap_model":
                kinds.setdefault(a.targets[0].target.value, set()).add(qualified in DATA_PARALLEL)
        self.data_parallel = {name for name, dp in kinds.items() if dp == {True}}
        self.wrap_assigns = {id(a): a.targets[0].target.value for a in name_assigns(node)
                             if a.targets[0].target.value in kinds and type(a.value) is cst.Call
                             and (self.qualify(a.value.func) in wrappers
                                  or runtime_helper(self.qualify(a.value.func)) == "wrap_model")}
        in_functions = {id(a) for fn in m.findall(node, m.FunctionDef()) for a in m.findall(fn, m.Assign())}
        # per scope (the module, then each function entered): the names it wraps, those wrapped so far
        self.scopes = [({n for i, n in self.wrap_assigns.items() if i not in in_functions}, set())]
        self.wrapped = lambda ref: isinstance(ref, cst.Name) and ref.value in kinds and not self._before_wrap(ref)

    def _before_wrap(self, ref: cst.Name) -> bool:
        """`model.init_weights()` above `model = wrap_model(model)` in the same function: the
        plain model, whatever the name holds later (lint; --to ddp asks the plan)."""
        if not getattr(self, "scopes", None):
            return False
        wraps, done = self.scopes[-1]
        if ref.value in wraps:
            return ref.value not in done
        if len(self.scopes) == 1:
            return False
        # `resume(model, path)` called only above the wraps of the functions calling it
        s = script_model(self.ctx).s
        fn = s.function(ref)
        if fn is None or not fn.callers:
            return False
        assigns = [a for a in name_assigns(self.ctx.module) if id(a) in self.wrap_assigns]
        return all(any(s.scope(a) is s.scope(call) and s.order(a) > s.order(call) for a in assigns)
                   and not any(s.scope(a) is s.scope(call) and s.order(a) < s.order(call) for a in assigns)
                   for call in fn.callers)

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        if getattr(self, "scopes", None):
            here = {self.wrap_assigns[id(a)] for a in m.findall(node, m.Assign()) if id(a) in self.wrap_assigns}
            self.scopes.append((here, set()))

    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef):
        if getattr(self, "scopes", None) and len(self.scopes) > 1:
            self.scopes.pop()
        return None

    def leave_Assign(self, original: cst.Assign, updated: cst.Assign):
        if getattr(self, "scopes", None) and id(original) in self.wrap_assigns:
            self.scopes[-1][1].add(self.wrap_assigns[id(original)])
        return None

    def leave_Attribute(self, original: cst.Attribute, updated: cst.Attribute):
        attr = original.attr.value
        if attr in _SAFE_ATTRIBUTES or attr.startswith("__") or not self.wrapped(original.value):
            return None
        name = dotted(original.value)
        data_parallel = isinstance(original.value, cst.Name) and original.value.value in self.data_parallel
        if attr in ("state_dict", "load_state_dict"):
            if data_parallel and not after_migration(self):
                return None  # a DataParallel script saves and loads its own `module.` keys: right as it is
            why = f"`{name}.{attr}` of a wrapped model has `module.`-prefixed keys; use `unwrap_model({name})`"
        elif data_parallel:  # true of the script as it is: DataParallel forwards no attributes either
            why = (f"`{name}.{attr}` through `nn.DataParallel` raises AttributeError (the wrapper has only the "
                   f"nn.Module API); use `{name}.module.{attr}` or `unwrap_model({name})`")
        else:
            why = f"`{name}.{attr}` through a wrapped model raises AttributeError under DDP; use `unwrap_model({name})`"
        self.report(original, why)
        return updated.with_changes(value=_call(self.ctx, "unwrap_model", [cst.Arg(updated.value)], self.fixing))

    def leave_Call(self, original: cst.Call, updated: cst.Call):
        """`generate(decoder, ...)` of another module of the project that does not train (no
        `.backward()` there): it gets the plain model, whose own methods it calls
        (`decoder.init_hidden(1)`), where a DDP wrapper raises AttributeError. So does a call
        that does not train on one rank only (`if args.local_rank in [-1, 0]: evaluate(model)`):
        DDP's forward broadcasts its buffers, and the other ranks never take part."""
        if "GM400" not in self.ctx.fixing or len(original.args) != len(updated.args):
            return None
        one_rank = self._one_rank(original)
        if one_rank is not None:
            return self._unwrapped_on_one_rank(original, updated, one_rank)
        if not original.args or not any(not a.star and self.wrapped(a.value) for a in original.args):
            return None
        link, _ = defined_in(self.ctx, original.func)
        if link is None or "backward" in link.calls:
            return None
        args = list(updated.args)
        for k, arg in enumerate(original.args):
            if arg.star or not self.wrapped(arg.value):
                continue
            name = dotted(arg.value)
            self.report(arg, f"`{name}` handed to {link.path}, which does not train: the plain model "
                             f"(`unwrap_model({name})`), whose own methods it may call")
            args[k] = args[k].with_changes(value=_call(self.ctx, "unwrap_model", [cst.Arg(args[k].value)],
                                                       self.fixing))
        return updated.with_changes(args=args)

    def _one_rank(self, call: cst.Call) -> Optional[cst.If]:
        """The rank-local `if` (of the script's: `if args.local_rank in [-1, 0]:`) whose body
        holds `call`, in its function, where `call` trains nothing; else None."""
        plan = self.plan
        if not plan.active or runtime_helper(self.qualify(call.func)) is not None or not (
                self._model_ref(call.func) or any(self._model_ref(a) for a in call.args)):
            return None  # (`unwrap_model(model)` itself)
        s = plan.s
        callee = s.callee(call)
        # the model's own forward, or a function of this file that does not train (an evaluation)
        if not (self._model_ref(call.func) or callee is not None and not plan.model.function_trains(callee)):
            return None
        child: cst.CSTNode = call
        for ancestor in s.ancestors(call):
            if isinstance(ancestor, (cst.FunctionDef, cst.Lambda)):
                return None
            if isinstance(ancestor, cst.If) and child is not ancestor.test and plan.model.rank_local_test(ancestor):
                return ancestor
            child = ancestor
        return None

    def _model_ref(self, node: Union[cst.Arg, cst.BaseExpression]) -> bool:
        """A name (or `self.x`) holding a wrapped model: `evaluate(model)`, `model(x)`."""
        if isinstance(node, cst.Arg):
            if node.star:
                return False
            node = node.value
        return isinstance(node, (cst.Name, cst.Attribute)) and self.wrapped(node)

    def _unwrapped_on_one_rank(self, original: cst.Call, updated: cst.Call, where: cst.If) -> cst.Call:
        test = " ".join(self.ctx.module.code_for_node(where.test).split())
        unwrap = lambda expr: _call(self.ctx, "unwrap_model", [cst.Arg(expr)], self.fixing)  # noqa: E731
        args = list(updated.args)
        for k, arg in enumerate(original.args):
            if self._model_ref(arg):
                args[k] = args[k].with_changes(value=unwrap(args[k].value))
        func = unwrap(updated.func) if self._model_ref(original.func) else updated.func
        name = dotted(original.func) if self._model_ref(original.func) else \
            next(dotted(a.value) for a in original.args if self._model_ref(a))
        self.report(original, f"`{name}` is used on some ranks only (`if {test}:`): the plain model "
                              f"(`unwrap_model({name})`), whose forward waits for no other rank")
        return updated.with_changes(func=func, args=args)


class RankZeroOutput(_BlockRule):
    """
    ## What it does
    Runs output on rank 0 only (ddp migration): printing, logging, `tqdm.write`, CSV and
    TensorBoard writers, files the script opens for writing (the other ranks write to
    `os.devnull`), `pickle.dump`, `os.makedirs`; progress bars are turned off on the other
    ranks.

    ## Why is this bad?
    Under torchrun every line is printed N times, interleaved, and N processes write the
    same files at once.

    ## Example
    ```python
    print(f"epoch {epoch} loss {loss:.4f}")
    ```

    ## Use instead
    ```python
    if is_main_process():
        print(f"epoch {epoch} loss {loss:.4f}")
    ```
    An output statement whose arguments call code that may train or communicate is left
    for review rather than moved into a rank-0 branch.
    """

    code = "GM410"
    done = "output from rank 0 only"
    name = "rank-zero-output"
    message = "output on every rank: print and log from rank 0 only"
    fixed_in = frozenset({"ddp"})
    lint = False
    triggers = ("print", "log", "Writer", "tqdm", "write", "dump", "save", "makedirs", "mkdir")
    examples = (
        Flagged(
            "import torch\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\nmodel(x).sum().backward()\n"
            "opt.step()\nprint('epoch', epoch)\nprint('done')\n",
        ),
        Clean("from gpumigrate.runtime import is_main_process\nif is_main_process():\n    print('epoch', epoch)\n"),
    )

    def visit_Module(self, node: cst.Module) -> None:
        self.plan = ddp_plan(self.ctx)
        self.model = script_model(self.ctx)

    def _verdict(self, stmt: cst.CSTNode) -> Optional[bool]:
        if not isinstance(stmt, cst.SimpleStatementLine) or self.plan.saves_here(stmt):
            return None  # saves: GM404
        if id(stmt) in self.plan.gated_lines:
            return True
        return False if self.plan.output_line(stmt) is False else None

    def leave_SimpleStatementLine(self, original, updated):
        if not self.plan.active:
            return None
        verdict = self._verdict(original)
        if verdict is False:
            hoisted = self._hoisted(original, updated)
            if hoisted is not None:
                return hoisted
            self.report(original, "output that calls code which may train or communicate: left on every rank; "
                                  "move the call out and print its result on rank 0", review=True)
        if verdict is not True:
            return None
        self.report(original)
        guard = _guard(self.ctx, [updated])
        self.ctx.shared("rank-zero-gates", lambda ctx: set()).add(id(guard))
        if self.plan.barrier_after_write(original):  # the script reads files back: wait for the write
            return cst.FlattenSentinel([guard, _line(_call(self.ctx, "barrier"))])
        return guard

    def leave_Try(self, original: cst.Try, updated: cst.Try):
        """A barrier after a whole `try` whose body rank 0 writes in (see `barriers_after_try`)."""
        if not self.plan.active or id(original) not in self.plan.barriers_after_try:
            return None
        self.report(original, "rank 0 writes in this `try`, which an exception may leave on one rank: the other "
                              "ranks wait for the write after the whole statement")
        return cst.FlattenSentinel([updated, _line(_call(self.ctx, "barrier"))])

    def _hoisted(self, original: cst.SimpleStatementLine, updated: cst.SimpleStatementLine):
        """`writer.add_histogram('out', net(x), 0)`: the arguments that may train or
        communicate (a model's forward, an evaluation) run first, on every rank; only the
        output call goes to rank 0 (the writer may exist there alone)."""
        if len(original.body) != 1 or len(updated.body) != 1 or \
                not m.matches(updated.body[0], m.Expr(m.Call())) or original.body[0].value.func is None:
            return None
        call, new_call = original.body[0].value, updated.body[0].value
        unsafe = {id(arg) for arg in self.plan.unsafe_args(call)}
        if not unsafe or len(call.args) != len(new_call.args) or any(a.star for a in call.args):
            return None
        first: List[cst.SimpleStatementLine] = []
        args = []
        for old, new in zip(call.args, new_call.args):
            if id(old) in unsafe:
                name = fresh_name(self.ctx, "value")
                first.append(_assign(name, new.value))
                new = new.with_changes(value=cst.Name(name))
            args.append(new)
        self.report(original, "output whose arguments may train or communicate: they are computed on every rank, "
                              "the output runs on rank 0")
        guard = _guard(self.ctx, [updated.with_changes(body=[updated.body[0].with_changes(
            value=new_call.with_changes(args=args))], leading_lines=[])])
        self.ctx.shared("rank-zero-gates", lambda ctx: set()).add(id(guard))
        first[0] = first[0].with_changes(leading_lines=updated.leading_lines)
        return cst.FlattenSentinel([*first, guard])

    def leave_With(self, original: cst.With, updated: cst.With):
        if not self.plan.active or id(original) not in self.plan.gated_withs or self.plan.gated_with_saves(original):
            return None
        self.report(original, "a file written on every rank: written on rank 0 only")
        guard = _guard(self.ctx, [updated])
        self.ctx.shared("rank-zero-gates", lambda ctx: set()).add(id(guard))
        return guard

    def _block(self, original_body, updated_body):
        """Join consecutive gates this run made into one `if is_main_process():` block
        (also onto a checkpoint's gate just before)."""
        ours = self.ctx.shared("rank-zero-gates", lambda ctx: set())
        if not ours or not any(id(s) in ours for s in updated_body):
            return None
        out: List[cst.BaseStatement] = []
        for stmt in updated_body:
            previous = out[-1] if out else None
            if id(stmt) in ours and _is_main_guard(previous) and previous.orelse is None \
                    and not stmt.leading_lines and id(previous) in ours:
                merged = previous.with_changes(body=previous.body.with_changes(
                    body=[*previous.body.body, *stmt.body.body]))
                ours.add(id(merged))
                out[-1] = merged
                continue
            out.append(stmt)
        return out if len(out) != len(updated_body) else None

    def _read_on_every_rank(self, assign: cst.Assign) -> Optional[str]:
        """A use of the object `assign` binds (`writer`, `self.writer`) that is not a call of
        one of its methods (`self.writer.log_dir`, `save_config(writer)`): it must exist on every
        rank. Where the holder is used, in its scope or its class."""
        if len(assign.targets) != 1:
            return None
        holder = dotted(assign.targets[0].target)
        if holder is None:
            return None
        if "." in holder and (holder.count(".") > 1 or not holder.startswith("self.")):
            return holder  # stored on an object that goes where this file cannot follow (`config.tb_logger`)
        s = script_model(self.ctx).s
        where = s.scope(assign).node
        if "." in holder:
            cls = s.instance_class(assign.targets[0].target.value, s.scope(assign))
            where = cls.node if cls is not None else self.ctx.module
        for node in s.index.subtree(where):
            if not isinstance(node, (cst.Name, cst.Attribute)) or dotted(node) != holder or \
                    s.index.contains(assign.targets[0].target, node) or node is assign.targets[0].target:
                continue
            above = s.parent(node)
            if isinstance(above, cst.Attribute) and above.value is node:
                call = s.parent(above)
                if isinstance(call, cst.Call) and call.func is above:
                    continue  # `writer.add_scalar(...)`: an output call, gated where it runs
                return f"{holder}.{above.attr.value}"
            if isinstance(above, (cst.Arg, cst.Element, cst.Return)):
                return holder  # handed on: whoever gets it may read it
        return None

    def leave_Call(self, original: cst.Call, updated: cst.Call):
        if not self.plan.active:
            return None
        qualified = self.qualify(original.func) or ""
        if qualified in ("tqdm.tqdm", "tqdm.auto.tqdm", "tqdm.notebook.tqdm", "tqdm.trange") \
                and get_arg(original, "disable") is None:
            parent = self.ctx.ancestors[-1] if self.ctx.ancestors else None
            read = self._read_on_every_rank(parent) if isinstance(parent, cst.Assign) else None
            stream = get_arg(original, "file")
            if stream is not None and isinstance(stream.value, cst.Call) and \
                    runtime_helper(self.qualify(stream.value.func)) == "progress_stream":
                return None  # an earlier run's
            if read is not None and stream is None:
                # a disabled bar counts nothing (`-val_loss / pbar.n` divides by zero): the other
                # ranks' bars count on, drawn to os.devnull
                self.report(original, f"progress bar on every rank: `{read}` is read, so it counts on every rank "
                                      "and is drawn on rank 0 only")
                return with_args(updated, [*updated.args, keyword_arg("file", _call(self.ctx, "progress_stream"))])
            self.report(original, "progress bar on every rank: shown on rank 0 only")
            test = cst.UnaryOperation(operator=cst.Not(), expression=_call(self.ctx, "is_main_process"))
            return with_args(updated, [*updated.args, keyword_arg("disable", test)])
        parent = self.ctx.ancestors[-1] if self.ctx.ancestors else None
        if qualified.endswith("SummaryWriter") and isinstance(parent, cst.Assign):
            read = self._read_on_every_rank(parent)
            named = updated.args and (updated.args[0].keyword is None and not updated.args[0].star or
                                      get_arg(updated, "log_dir") is not None or get_arg(updated, "logdir") is not None)
            if read is not None and named:
                # None there would fail; a real writer would copy every event and race rank 0 to
                # make the directory: the others get a writer that writes nothing, with its log_dir
                self.report(original, f"TensorBoard writer on every rank: `{read}` is read outside its writes; "
                                      "created on rank 0, the other ranks get one that writes nothing")
                muted = updated.with_changes(func=_call(self.ctx, "muted_writer").func)
                return cst.IfExp(test=_call(self.ctx, "is_main_process"), body=updated, orelse=muted)
            if read is not None:  # no directory named: rank 0 makes its own, which the others cannot know
                self.report(original, f"TensorBoard writer kept on every rank: `{read}` is read outside its "
                                      "writes; only the writes run on rank 0")
                return None
            self.report(original, "TensorBoard writer on every rank: created on rank 0 only")
            return cst.IfExp(test=_call(self.ctx, "is_main_process"), body=updated, orelse=cst.Name("None"))
        if id(original) in self.plan.devnull_opens:
            path = updated.args[0]
            self.report(original, "a file written on every rank: the other ranks write to os.devnull")
            if self.fixing:
                self.ctx.add_import("os")
            value = cst.IfExp(test=_call(self.ctx, "is_main_process"), body=path.value,
                              orelse=cst.parse_expression("os.devnull"))
            return updated.with_changes(args=[path.with_changes(value=value), *updated.args[1:]])
        return None


class PerRankValue(Rule):
    """
    ## What it does
    Makes values that differ per process and name things agree (ddp migration): a run
    directory from `tempfile.mkdtemp()` or a random number, a timestamped file name or a
    uuid is taken from rank 0 with `broadcast_object`, where every rank computes it. Timings
    (`time.time()` differences) are per-process on purpose and left alone.

    ## Why is this bad?
    Under torchrun every rank computes its own value: rank 0 saves a checkpoint into its
    directory and the other ranks look for it in theirs.

    ## Example
    ```python
    run_dir = tempfile.mkdtemp(prefix="run_")
    ```

    ## Use instead
    ```python
    run_dir = broadcast_object(tempfile.mkdtemp(prefix="run_"))
    ```
    """

    code = "GM411"
    done = "every rank uses rank 0's value"
    name = "per-rank-value"
    message = "a value that differs per process: every rank must use rank 0's"
    fixed_in = frozenset({"ddp"})
    lint = False
    triggers = ("tempfile", "uuid", "time", "datetime", "socket", "getpid", "random")
    examples = (
        Flagged(
            "import tempfile, torch\nrun_dir = tempfile.mkdtemp()\nopt = torch.optim.SGD(model.parameters(), lr=1)\n"
            "for epoch in range(2):\n    model(x).sum().backward()\n    opt.step()\n    save(run_dir, epoch)\n",
        ),
        Clean("import tempfile\nrun_dir = tempfile.gettempdir()\n"),
    )

    def visit_Module(self, node: cst.Module) -> None:
        self.plan = ddp_plan(self.ctx)

    def leave_Assign(self, original: cst.Assign, updated: cst.Assign):
        if not self.plan.active:
            return None
        decision = self.plan.broadcasts.get(id(original))
        if decision is None:
            return None
        if decision is False:
            self.report(original.value, "a per-process value names files here, but not every rank reaches this "
                                        "line equally often (a helper, a branch or a loop on rank-local values): "
                                        "make the ranks agree on it by hand", review=True)
            return None
        self.report(original.value)
        return updated.with_changes(value=_call(self.ctx, "broadcast_object", [cst.Arg(updated.value)], self.fixing))


class MakedirsRace(Rule):
    """
    ## What it does
    Adds `exist_ok=True` to `os.makedirs(d)` under `if not os.path.exists(d):` (or
    `os.path.isdir`), in every file of a ddp migration (helper modules too).

    ## Why is this bad?
    Every rank runs the check, and all of them may find the folder missing before the first
    one makes it: the others then fail with `FileExistsError`.

    ## Example
    ```python
    if not os.path.exists(ckpt_dir):
        os.makedirs(ckpt_dir)
    ```

    ## Use instead
    ```python
    if not os.path.exists(ckpt_dir):
        os.makedirs(ckpt_dir, exist_ok=True)
    ```
    """

    code = "GM414"
    done = "`os.makedirs(..., exist_ok=True)`: ranks no longer race"
    name = "makedirs-race"
    message = "ranks racing to make the same folder: all but the first fail with FileExistsError"
    fixed_in = frozenset({"ddp"})
    lint = False
    triggers = ("makedirs",)
    examples = (
        Flagged("import os\nif not os.path.exists(d):\n    os.makedirs(d)\n",
                fixed="import os\nif not os.path.exists(d):\n    os.makedirs(d, exist_ok=True)\n"),
        Clean("import os\nos.makedirs(d, exist_ok=True)\n"),
        Clean("import os\nif not os.path.exists(a):\n    os.makedirs(b)\n"),
    )

    def leave_Call(self, original: cst.Call, updated: cst.Call):
        if self.qualify(original.func) != "os.makedirs" or not original.args or get_arg(original, "exist_ok", 2):
            return None
        guard = next((a for a in reversed(self.ctx.ancestors) if isinstance(a, cst.If)), None)
        test = guard.test if guard is not None else None
        if not (isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not)
                and isinstance(test.expression, cst.Call) and test.expression.args
                and self.qualify(test.expression.func) in ("os.path.exists", "os.path.isdir")):
            return None
        code = self.ctx.module.code_for_node
        if code(test.expression.args[0].value) != code(original.args[0].value):
            return None
        self.report(original, "`exist_ok=True`: ranks racing to make the same folder no longer fail")
        return with_args(updated, [*updated.args, keyword_arg("exist_ok", cst.Name("True"))])


_APEX_PARALLEL = {
    "apex.parallel.DistributedDataParallel": "wrap_model",
    "apex.parallel.distributed.DistributedDataParallel": "wrap_model",
    "apex.parallel.convert_syncbn_model": "torch.nn.SyncBatchNorm.convert_sync_batchnorm",
    "apex.parallel.SyncBatchNorm": "torch.nn.SyncBatchNorm",
}
# apex DDP's own tuning knobs: torch's DDP buckets and overlaps its all-reduces by itself
_APEX_DDP_ONLY = frozenset({"delay_allreduce", "message_size", "allreduce_trigger_params", "shared_param",
                            "retain_allreduce_buffers", "allreduce_always_fp32", "num_allreduce_streams",
                            "allreduce_communicators", "gradient_average", "gradient_predivide_factor",
                            "prof"})


class ApexParallel(Rule):
    """
    ## What it does
    Finds NVIDIA apex's `apex.parallel.DistributedDataParallel`, `convert_syncbn_model` and
    `SyncBatchNorm`.

    ## Why is this bad?
    apex is unmaintained and must be built from source for each CUDA and torch; torch has had
    the same classes since 1.1, and they run on CPUs (gloo) too.

    ## Example
    ```python
    from apex.parallel import DistributedDataParallel as DDP, convert_syncbn_model
    model = convert_syncbn_model(model)
    model = DDP(model, delay_allreduce=True)
    ```

    ## Use instead
    ```python
    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = wrap_model(model)  # from gpumigrate.runtime: torch's DistributedDataParallel
    ```
    apex-only tuning arguments (`delay_allreduce`, `message_size`, ...) go: torch's DDP
    buckets gradients and overlaps their all-reduce with backward by itself. On CPUs (gloo)
    `wrap_model` keeps BatchNorm per process, as DDP takes SyncBatchNorm on GPUs only.
    """

    code = "GM412"
    done = "apex.parallel → torch.nn DistributedDataParallel / SyncBatchNorm"
    name = "apex-parallel"
    message = "apex.parallel is unmaintained; torch.nn has DistributedDataParallel and SyncBatchNorm"
    fixed_in = frozenset({"ddp", "amp"})  # amp: a migrated apex script needs no apex at all
    triggers = ("apex",)

    # a call qualified as apex.parallel's DistributedDataParallel, convert_syncbn_model or SyncBatchNorm
    @classmethod
    def gate(cls, facts: SourceFacts) -> bool:
        return {"apex", "parallel"} <= facts.ids and facts.any_id(
            "DistributedDataParallel", "convert_syncbn_model", "SyncBatchNorm")

    examples = (
        Flagged("import torch\nfrom apex.parallel import DistributedDataParallel as DDP\n"
                "model = DDP(net, delay_allreduce=True)\n",
                fixed="import torch\nfrom gpumigrate.runtime import wrap_model\n\nmodel = wrap_model(net)\n"),
        Flagged("import torch\nimport apex\nmodel = apex.parallel.convert_syncbn_model(net)\n",
                fixed="import torch\nmodel = torch.nn.SyncBatchNorm.convert_sync_batchnorm(net)\n"),
        Clean("import torch\nmodel = torch.nn.parallel.DistributedDataParallel(net)\n"),
    )

    def leave_Call(self, original: cst.Call, updated: cst.Call):
        name = self.qualify(original.func)
        if name not in _APEX_PARALLEL:
            return None
        dropped = [a.keyword.value for a in original.args if a.keyword is not None and a.keyword.value in _APEX_DDP_ONLY]
        why = f" (apex-only {', '.join(dropped)} dropped: torch's DDP overlaps its all-reduces itself)" if dropped else ""
        self.report(original, f"{self.message}{why}")
        if self.fixing:
            self.ctx.add_import("torch")
            module = dotted(original.func) or ""
            if isinstance(original.func, cst.Name):
                imported = next(q for local, q in self.ctx.names.local.items() if local == original.func.value)
                module_name, obj = imported.rsplit(".", 1)
                self.ctx.remove_import(module_name, obj, original.func.value if obj != original.func.value else None)
            elif module.startswith("apex."):
                self.ctx.remove_import("apex")
        kept = [a for a in updated.args if a.keyword is None or a.keyword.value not in _APEX_DDP_ONLY]
        if kept:
            kept[-1] = kept[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
        target = _APEX_PARALLEL[name]
        if target == "wrap_model":
            module = get_arg(updated, "module", 0)
            return _call(self.ctx, "wrap_model", [cst.Arg(module.value)] if module is not None else [], self.fixing)
        return updated.with_changes(func=cst.parse_expression(target), args=kept)


# DistributedDataParallel's arguments that wrap_model takes or derives from the model itself
_DDP_DEVICE_ARGS = ("device_ids", "output_device")


class DdpDeviceIds(Rule):
    """
    ## What it does
    Turns the script's own `DistributedDataParallel(model, device_ids=[...], output_device=...)`
    (with at most `find_unused_parameters` besides) into `wrap_model(model)` (ddp migration).

    ## Why is this bad?
    `device_ids` names a GPU: DDP refuses it for a model on the CPU (torchrun with gloo), and
    an index from `--gpu` or `--local_rank` must match where the model is. wrap_model takes
    the model's own device (none on the CPU), and leaves a model wrapped already as it is.

    ## Example
    ```python
    model = DistributedDataParallel(model, device_ids=[args.local_rank], output_device=args.local_rank)
    ```

    ## Use instead
    ```python
    model = wrap_model(model)  # from gpumigrate.runtime
    ```
    Other DDP options (`broadcast_buffers`, `bucket_cap_mb`, ...) go to wrap_model as they
    are, and so do `*args, **kwargs` (wrap_model does not use a device they name); a call with
    a process group of its own is kept. In a script that
    converts BatchNorm to SyncBatchNorm, a plain
    `DistributedDataParallel(model)` becomes `wrap_model(model)` too: DDP refuses SyncBatchNorm
    on the CPU, and wrap_model keeps BatchNorm per process there.
    """

    code = "GM413"
    done = "`device_ids` dropped: `wrap_model` takes the model's own device"
    name = "ddp-device-ids"
    message = "DistributedDataParallel with `device_ids` runs on GPUs only; wrap_model takes the model's own device"
    fixed_in = frozenset({"ddp"})
    lint = False  # right on GPUs: a migration step
    triggers = ("device_ids", "convert_sync_batchnorm")

    @classmethod
    def gate(cls, facts: SourceFacts) -> bool:
        return "DistributedDataParallel" in facts.ids and super().gate(facts)

    examples = (
        Flagged("import torch\nmodel = torch.nn.parallel.DistributedDataParallel(net, device_ids=[rank], "
                "output_device=rank, find_unused_parameters=True)\n",
                fixed="import torch\nfrom gpumigrate.runtime import wrap_model\n\n"
                      "model = wrap_model(net, find_unused_parameters=True)\n"),
        Flagged("import torch\nnet = torch.nn.SyncBatchNorm.convert_sync_batchnorm(net)\n"
                "model = torch.nn.parallel.DistributedDataParallel(net)\n",
                fixed="import torch\nfrom gpumigrate.runtime import wrap_model\n\n"
                      "net = torch.nn.SyncBatchNorm.convert_sync_batchnorm(net)\nmodel = wrap_model(net)\n"),
        Clean("import torch\nmodel = torch.nn.parallel.DistributedDataParallel(net)\n"),
        Flagged("import torch\nmodel = torch.nn.parallel.DistributedDataParallel(net, device_ids=[0], "
                "broadcast_buffers=False)\n",
                fixed="import torch\nfrom gpumigrate.runtime import wrap_model\n\n"
                      "model = wrap_model(net, broadcast_buffers=False)\n"),
        Clean("import torch\nmodel = torch.nn.parallel.DistributedDataParallel(net, **opts)\n"),
        Flagged("import torch\nmodel = torch.nn.parallel.DistributedDataParallel(net, device_ids=ids, *args, **opts)\n",
                fixed="import torch\nfrom gpumigrate.runtime import wrap_model\n\n"
                      "model = wrap_model(net, *args, **opts)\n"),
    )

    def visit_Module(self, node: cst.Module) -> None:
        # names bound to a DDP this rule replaces: `.module` of them exists only on a wrapper,
        # which wrap_model makes under torchrun alone (in one process it returns the model)
        self.replaced: Set[str] = set()
        for call in script_model(self.ctx).s.index.of(cst.Call):
            parent = script_model(self.ctx).s.parent(call)
            if self._replaces(call) and isinstance(parent, cst.Assign) and parent.value is call:
                self.replaced.update(dotted(t.target) or "" for t in parent.targets)

    def _replaces(self, call: cst.Call) -> bool:
        if self.qualify(call.func) not in DDP_CLASSES or not call.args or call.args[0].keyword or call.args[0].star:
            return False
        given = _ddp_arguments(call)
        if "process_group" in given:  # a group of its own: kept
            return False
        rest = call.args[1:]
        if any(a.star == "*" for a in rest) and any(a.keyword is None and not a.star for a in rest):
            return False  # `*args` after a positional device_ids: more positions wrap_model has not
        return bool(set(given) & set(_DDP_DEVICE_ARGS)) or "convert_sync_batchnorm" in self.ctx.text

    def leave_Attribute(self, original: cst.Attribute, updated: cst.Attribute):
        if original.attr.value != "module" or (dotted(original.value) or "") not in self.replaced - {""}:
            return None
        parent = script_model(self.ctx).s.parent(original)
        if isinstance(parent, cst.Call) and parent.func is original:
            return None
        self.report(original, "`.module` exists only on a DistributedDataParallel wrapper, which wrap_model makes under "
                              "torchrun only: `unwrap_model(model)` works in one process too")
        return _call(self.ctx, "unwrap_model", [cst.Arg(updated.value)], self.fixing)

    def leave_Call(self, original: cst.Call, updated: cst.Call):
        if not self._replaces(original):
            return None
        if not set(_ddp_arguments(original)) & set(_DDP_DEVICE_ARGS):
            self.report(original, "DistributedDataParallel of a model with SyncBatchNorm runs on GPUs only; "
                                  "wrap_model keeps BatchNorm per process on the CPU")
        else:
            self.report(original)
        args = [cst.Arg(updated.args[0].value)]
        # its other options stay, and `*args, **kwargs` (only empty `*args` could follow device_ids=)
        args += [keyword_arg(a.keyword.value, a.value) if a.keyword is not None else cst.Arg(a.value, star=a.star)
                 for a in updated.args[1:]
                 if (a.keyword is not None and a.keyword.value not in _DDP_DEVICE_ARGS) or a.star]
        return _call(self.ctx, "wrap_model", args, self.fixing)


def _ddp_arguments(call: cst.Call) -> List[str]:
    """The names of the arguments a DistributedDataParallel call gives after the module ("*" for
    `*args` and `**kwargs`)."""
    return [a.keyword.value if a.keyword is not None else _DDP_DEVICE_ARGS[i] if i < 2 and not a.star else "*"
            for i, a in enumerate(call.args[1:])]
