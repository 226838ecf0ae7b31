"""DistributedDataParallel: GM400-GM410.

The ddp migration keeps a script runnable as `python train.py` and makes it correct under
`torchrun --nproc_per_node=N train.py`: one process group, each trained model wrapped,
each loader sharded, metrics reduced, output and checkpoints from rank 0 only. Every helper
it calls (gpumigrate.runtime) is a no-op in a single process.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set

import libcst as cst
import libcst.matchers as m

from gpumigrate.codemods.base import Clean, Flagged, Rule
from gpumigrate.codemods.device_plan import RUNTIME, device_plan
from gpumigrate.codemods.memory import _EVAL_NAME, _calls_eval
from gpumigrate.codemods.helpers import (
    enclosing,
    findall,
    get_arg,
    is_method_call,
    keyword_arg,
    literal_bool,
    literal_str,
    remove_statement,
    same_code,
    with_args,
)

DATALOADER = ("torch.utils.data.DataLoader", "torch.utils.data.dataloader.DataLoader")
DATA_PARALLEL = ("torch.nn.DataParallel", "torch.nn.parallel.DataParallel",
                 "torch.nn.parallel.data_parallel.DataParallel")
DDP_CLASSES = ("torch.nn.parallel.DistributedDataParallel", "torch.nn.parallel.distributed.DistributedDataParallel")
_EVAL_LOADER = re.compile(r"(test|val|eval|dev)", re.I)
_TRAIN_LOADER = re.compile(r"train", re.I)


def _runtime(ctx, name: str) -> cst.Name:
    ctx.add_import(RUNTIME, name)
    return cst.Name(name)


def _main_process_test(ctx) -> cst.Call:
    return cst.Call(func=_runtime(ctx, "is_main_process"))


def _guard(ctx, stmts: List[cst.BaseStatement]) -> cst.If:
    """`if is_main_process():` around statements, the first one's comments moved above."""
    first = stmts[0]
    body = [first.with_changes(leading_lines=[]), *stmts[1:]]
    return cst.If(test=_main_process_test(ctx), body=cst.IndentedBlock(body=body), leading_lines=first.leading_lines)


def _is_main_guard(node: Optional[cst.CSTNode], names) -> bool:
    return isinstance(node, cst.If) and m.matches(node.test, m.Call(args=[])) and \
        (names.qualify(node.test.func) or "").endswith(".is_main_process")


@dataclass
class DdpAnalysis:
    models: List[str] = field(default_factory=list)  # trained models, in order
    wrap_before: Dict[int, List[str]] = field(default_factory=dict)  # id(statement) -> models to wrap there
    loaders: Dict[str, str] = field(default_factory=dict)  # name -> "train" | "eval"
    writers: Set[str] = field(default_factory=set)
    reloads: bool = False  # the script loads checkpoints: non-zero ranks wait for rank 0's save
    conditional_forward: bool = False
    already_wrapped: Set[str] = field(default_factory=set)


def _build(ctx) -> DdpAnalysis:
    names = ctx.names
    a = DdpAnalysis()
    module = ctx.module
    optimizers = [c for c in findall(module, m.Call())
                  if (names.qualify(c.func) or "").startswith("torch.optim.") and c.args]
    feeding: Dict[str, Set[str]] = {}  # param-list names -> models: params = list(a.parameters()) + ...
    for assign in findall(module, m.Assign(targets=[m.AssignTarget(m.Name())])):
        models = _parameter_owners(assign.value)
        if models:
            feeding[assign.targets[0].target.value] = models
    used: Set[str] = set()
    for call in optimizers:
        owners = _parameter_owners(call.args[0].value)
        for name in findall(call.args[0].value, m.Name()):
            owners |= feeding.get(name.value, set())
        used |= owners
    # models the script (or an earlier run) already wraps
    wrapped = {c.args[0].value.value for c in findall(module, m.Call(args=[m.Arg(m.Name()), m.ZeroOrMore()]))
               if (names.qualify(c.func) or "") in (f"{RUNTIME}.wrap_model", *DDP_CLASSES)}
    a.models = sorted(used)
    a.already_wrapped = wrapped
    # wrap each model before the first statement that hands its parameters on
    for stmt in _all_statements(module):
        here = [n for n in sorted(_parameter_owners(stmt))
                if n in used and n not in wrapped and n not in _flat(a.wrap_before)]
        if here:
            a.wrap_before[id(stmt)] = here
    for assign in findall(module, m.Assign(targets=[m.AssignTarget(m.Name())], value=m.Call())):
        target = assign.targets[0].target.value
        qualified = names.qualify(assign.value.func) or ""
        if qualified in DATALOADER:
            a.loaders[target] = _loader_kind(target, module)
        elif qualified.endswith("SummaryWriter"):
            a.writers.add(target)
    a.reloads = any(names.qualify(c.func) == "torch.load" for c in findall(module, m.Call()))
    a.conditional_forward = any(
        f.name.value == "forward" and findall(f.body, m.If())
        for f in findall(module, m.FunctionDef())
    )
    return a


def _flat(groups: Dict[int, List[str]]) -> Set[str]:
    return {n for names in groups.values() for n in names}


def _parameter_owners(node: cst.CSTNode) -> Set[str]:
    return {c.func.value.value for c in findall(node, m.Call(func=m.Attribute(value=m.Name(), attr=m.Name("parameters"))))}


def _all_statements(module: cst.Module):
    return findall(module, m.SimpleStatementLine())


def _loader_kind(name: str, module: cst.Module) -> str:
    if _TRAIN_LOADER.search(name):
        return "train"
    if _EVAL_LOADER.search(name):
        return "eval"
    for loop in findall(module, m.For()):
        if findall(loop.iter, m.Name(name)) and findall(loop.body, m.Call(func=m.Attribute(attr=m.Name("backward")))):
            return "train"
    return "eval"


def ddp_analysis(ctx) -> DdpAnalysis:
    return ctx.shared("ddp-analysis", _build)


def training_script(ctx) -> bool:
    """Is this file a script (it trains, or runs code at module level) rather than a module
    that scripts import? The ddp migration rewrites scripts, never the libraries they use."""
    return ctx.shared("training-script", _is_script)


def _is_script(ctx) -> bool:
    analysis = ddp_analysis(ctx)
    if analysis.models or analysis.loaders:
        return True
    for stmt in ctx.module.body:
        if isinstance(stmt, (cst.For, cst.While, cst.With)):
            return True
        if isinstance(stmt, cst.If) and m.matches(stmt.test, m.Comparison(left=m.Name("__name__"))):
            return True
        if isinstance(stmt, cst.SimpleStatementLine) and any(
                m.matches(s, m.Expr(m.Call(func=m.Name("print"))) | m.Assign(value=m.Call(
                    func=m.Attribute(attr=m.Name("parse_args"))))) for s in stmt.body):
            return True  # prints or parses its command line at module level: a script
    return False


class DdpSetup(Rule):
    """
    ## What it does
    Sets a single-process training script up for DistributedDataParallel (ddp migration
    only): the device comes from `setup_distributed()`, which joins the process group when
    launched by torchrun or srun, and each trained model is wrapped with `wrap_model()`.

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
    """

    code = "GM400"
    name = "ddp-setup"
    message = "single-process training: wrap the model in DistributedDataParallel"
    fixed_in = frozenset({"ddp"})
    lint = False  # a migration step, not a defect
    triggers = ("parameters",)
    examples = (
        Flagged(
            "import torch\nmodel = Net().cuda()\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n",
            fixed="import torch\nfrom gpumigrate.runtime import setup_distributed, wrap_model\n\n"
            "device = setup_distributed()\nmodel = Net().to(device)\nmodel = wrap_model(model)\n"
            "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n",
        ),
        Clean("import torch\nmodel = Net()\nprint(sum(p.numel() for p in model.parameters()))\n"),
    )

    def visit_Module(self, node: cst.Module) -> None:
        self.analysis = ddp_analysis(self.ctx)
        # only training scripts join a process group, not the modules they import
        if self.fixing and (self.analysis.models or self.analysis.loaders):
            plan = device_plan(self.ctx)
            plan.require_definition()
            if plan.multi_index:
                self.report(node.body[0] if node.body else node, "modules on several devices (model parallelism): each is "
                            "wrapped without device_ids, and the devices per process are the script's", review=True)
            seeds = [c for c in findall(node, m.Call()) if self.qualify(c.func) in ("torch.manual_seed", "random.seed",
                                                                                     "numpy.random.seed")]
            if seeds:
                self.report(seeds[0], "every rank seeds the same: random augmentation and dropout repeat across "
                                      "ranks; add get_rank() to the seed if they should differ", review=True)
            if plan.ignored_flag is not None:
                self.report(plan.ignored_flag.stmt, f"`{plan.ignored_flag.code}` is decided where the device cannot "
                            f"see it: pass `setup_distributed(use_accelerator={plan.ignored_flag.code})` by hand "
                            "if the CPU must be forced under torchrun", review=True)

    def leave_SimpleStatementLine(self, original, updated):
        models = self.analysis.wrap_before.get(id(original))
        if not models:
            return None
        stmts = []
        unused = len(self.analysis.models) > 1 or self.analysis.conditional_forward
        for name in models:
            why = (" (several models or a conditional forward: find_unused_parameters=True)" if unused else "")
            self.report(original, f"`{name}` trains in one process: wrapped in DistributedDataParallel{why}")
            args = [cst.Arg(cst.Name(name))]
            if unused:
                args.append(keyword_arg("find_unused_parameters", cst.Name("True")))
            if self.ctx.options.get("sync_bn"):
                args.append(keyword_arg("sync_batchnorm", cst.Name("True")))
            call = cst.Call(func=_runtime(self.ctx, "wrap_model") if self.fixing else cst.Name("wrap_model"), args=args)
            stmts.append(cst.SimpleStatementLine(body=[cst.Assign(targets=[cst.AssignTarget(cst.Name(name))], value=call)]))
        stmts[0] = stmts[0].with_changes(leading_lines=updated.leading_lines)
        return cst.FlattenSentinel([*stmts, updated.with_changes(leading_lines=[])])

    def leave_Call(self, original: cst.Call, updated: cst.Call):
        plan = device_plan(self.ctx)
        definition = plan.existing_definition(original)
        if definition is None or definition.hardcoded or not plan.distributed:
            return None
        value = plan.redefine(definition)
        if value is None:
            return None
        self.report(original, "the device comes from `setup_distributed()`: one process per device under torchrun")
        return value


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
    """

    code = "GM401"
    name = "data-parallel"
    message = "`nn.DataParallel` is single-process and slower than DistributedDataParallel"
    fixed_in = frozenset({"ddp"})
    triggers = ("DataParallel",)
    examples = (
        Flagged(
            "import torch.nn as nn\nmodel = nn.DataParallel(Net())\nopt = make(model.parameters())\n"
            "w = model.module.fc.weight\n",
        ),
        Clean("import torch.nn as nn\nmodel = nn.parallel.DistributedDataParallel(Net())\n"),
    )

    def visit_Module(self, node: cst.Module) -> None:
        self.wrapped = {a.targets[0].target.value for a in findall(node, m.Assign(targets=[m.AssignTarget(m.Name())]))
                        if findall(a.value, m.Call()) and any(self.qualify(c.func) in DATA_PARALLEL for c in findall(a.value, m.Call()))}
        self.wrapped |= set(ddp_analysis(self.ctx).models)

    def leave_Call(self, original: cst.Call, updated: cst.Call):
        if self.qualify(original.func) not in DATA_PARALLEL:
            return None
        module = get_arg(updated, "module", 0)
        if module is None:
            self.report(original, review=True)
            return None
        self.report(original)
        return module.value.with_changes(lpar=[], rpar=[]) if not isinstance(module.value, (cst.BinaryOperation,)) else module.value

    def leave_Attribute(self, original: cst.Attribute, updated: cst.Attribute):
        # `model.module` reaches the user's module: unwrap_model works with or without a wrapper
        if original.attr.value != "module" or not m.matches(original.value, m.Name()) \
                or original.value.value not in self.wrapped:
            return None
        self.report(original, "`.module` exists only on a wrapped model; `unwrap_model(model)` works in one process too")
        return cst.Call(func=_runtime(self.ctx, "unwrap_model") if self.fixing else cst.Name("unwrap_model"),
                        args=[cst.Arg(updated.value)])

    def leave_SimpleStatementLine(self, original, updated):
        # `model = nn.DataParallel(model)` leaves `model = model`
        if len(updated.body) == 1 and isinstance(updated.body[0], cst.Assign) and len(updated.body[0].targets) == 1 \
                and any(self.qualify(c.func) in DATA_PARALLEL for c in findall(original, m.Call())) \
                and same_code(updated.body[0].targets[0].target, updated.body[0].value):
            return remove_statement(self.ctx, updated)
        return None


class DistributedSamplerRule(Rule):
    """
    ## What it does
    Gives every training `DataLoader` a `DistributedSampler` (its `shuffle=` moves into the
    sampler) and calls `set_epoch(loader, epoch)` at the start of each epoch; evaluation
    loaders get an unpadded shard.

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
    The batch size is per process: the effective batch is N x batch_size.
    """

    code = "GM402"
    name = "sampler-set-epoch"
    message = "each rank must see its own part of the data, in a new order each epoch"
    fixed_in = frozenset({"ddp"})
    lint = False
    triggers = ("DataLoader",)
    examples = (
        Flagged(
            "from torch.utils.data import DataLoader\ntrain_loader = DataLoader(ds, batch_size=8, shuffle=True)\n"
            "for epoch in range(3):\n    for x in train_loader:\n        step(x)\n",
        ),
        Clean("from torch.utils.data import DataLoader\nimport torch\n"
              "loader = DataLoader(ds, sampler=torch.utils.data.distributed.DistributedSampler(ds))\n"),
    )

    def visit_Module(self, node: cst.Module) -> None:
        self.analysis = ddp_analysis(self.ctx)

    def leave_Call(self, original: cst.Call, updated: cst.Call, target: Optional[str] = None):
        if self.qualify(original.func) not in DATALOADER:
            return None
        parent = self.ctx.ancestors[-1] if self.ctx.ancestors else None
        if target is None and isinstance(parent, cst.Assign) and len(parent.targets) == 1 \
                and isinstance(parent.targets[0].target, cst.Name):
            target = parent.targets[0].target.value
        kind = self.analysis.loaders.get(target, "train" if target is None else "eval")
        if any(a.star == "*" for a in original.args) or any(
                a.star == "**" and self._may_hold_sampler(a.value) for a in original.args):
            self.report(original, "DataLoader(*args/**kwargs) may set shuffle or a sampler: add "
                                  "`sampler=distributed_sampler(dataset)` by hand", review=True)
            return None
        given = get_arg(original, "sampler", 3) or get_arg(original, "batch_sampler", 4)
        if given is not None and m.matches(given.value, m.Call()) and (
                (self.qualify(given.value.func) or "").endswith(("DistributedSampler", "distributed_sampler"))):
            return None  # already sharded
        if given is not None:
            self.report(original, "custom sampler kept: make it shard the data per rank "
                                  "(e.g. DistributedSampler) or each rank sees everything", review=True)
            return None
        dataset = get_arg(updated, "dataset", 0)
        if dataset is None or not m.matches(dataset.value, m.Name() | m.Attribute()):
            if target is None or dataset is None:
                self.report(original, "dataset built inline: assign it to a name and pass "
                                      "`sampler=distributed_sampler(dataset)`", review=True)
            return None  # `loader = DataLoader(Dataset(...))`: the statement hoists the dataset
        shuffle = get_arg(updated, "shuffle", 2)
        if shuffle is not None and shuffle.keyword is None:
            self.report(original, "positional `shuffle`: pass `sampler=distributed_sampler(dataset)` by hand",
                        review=True)
            return None
        shuffling = literal_bool(shuffle.value) if shuffle is not None else False
        args = [cst.Arg(dataset.value.deep_clone())]
        if kind == "train":
            batch = get_arg(original, "batch_size", 1)
            size = self.ctx.module.code_for_node(batch.value) if batch else "1"
            self.report(original, f"training data sharded with a DistributedSampler; the effective batch size is "
                                  f"now WORLD_SIZE x {size}: scale the learning rate if needed")
            if shuffle is not None and shuffling is None:
                args.append(keyword_arg("shuffle", shuffle.value))
            elif not shuffling:
                args.append(keyword_arg("shuffle", cst.Name("False")))
        else:
            self.report(original, "evaluation data sharded without padding; metrics are summed over ranks")
            args.append(keyword_arg("shuffle", shuffle.value if shuffle is not None else cst.Name("False")))
            args.append(keyword_arg("pad", cst.Name("False")))
        sampler = keyword_arg("sampler", cst.Call(func=_runtime(self.ctx, "distributed_sampler") if self.fixing
                                                  else cst.Name("distributed_sampler"), args=args))
        return with_args(updated, [*(a for a in updated.args if a is not shuffle), sampler])

    def leave_For(self, original: cst.For, updated: cst.For):
        if not m.matches(original.target, m.Name(value=m.MatchIfTrue(lambda v: "epoch" in v.lower()))):
            return None
        scope_names = self._loaders_in_scope(original)
        if not scope_names:
            return None
        body = updated.body
        if not isinstance(body, cst.IndentedBlock):
            return None
        present = {c.args[0].value.value for c in findall(original.body, m.Call(func=m.Name("set_epoch"), args=[m.Arg(m.Name()), m.Arg()]))}
        missing = [n for n in scope_names if n not in present]
        if not missing:
            return None
        self.report(original, "DistributedSampler needs `set_epoch(epoch)` each epoch, or every epoch has the same order")
        calls = [cst.SimpleStatementLine(body=[cst.Expr(cst.Call(
            func=_runtime(self.ctx, "set_epoch") if self.fixing else cst.Name("set_epoch"),
            args=[cst.Arg(cst.Name(n)), cst.Arg(original.target)]))]) for n in missing]
        return updated.with_changes(body=body.with_changes(body=[*calls, *body.body]))

    def leave_SimpleStatementLine(self, original, updated):
        """`loader = DataLoader(TensorDataset(x, y), ...)`: the sampler needs the dataset, so
        it gets a name of its own first."""
        if not m.matches(updated, m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(m.Name())],
                                                                       value=m.Call())])):
            return None
        assign = updated.body[0]
        call = assign.value
        if self.qualify(call.func) not in DATALOADER or any(a.star == "*" for a in call.args):
            return None
        dataset = get_arg(call, "dataset", 0)
        if dataset is None or m.matches(dataset.value, m.Name() | m.Attribute()) \
                or findall(call, m.Arg(keyword=m.Name("sampler") | m.Name("batch_sampler"))):
            return None
        name = self._dataset_name(assign.targets[0].target.value)
        hoisted = cst.SimpleStatementLine(body=[cst.Assign(targets=[cst.AssignTarget(cst.Name(name))],
                                                           value=dataset.value)], leading_lines=updated.leading_lines)
        args = [a.with_changes(value=cst.Name(name)) if a is dataset else a for a in call.args]
        fixed = self.leave_Call(original.body[0].value, call.with_changes(args=args), target=assign.targets[0].target.value)
        if fixed is None:
            return None
        line = updated.with_changes(body=[assign.with_changes(value=fixed)], leading_lines=[])
        return cst.FlattenSentinel([hoisted, line])

    def _dataset_name(self, loader: str) -> str:
        base = loader[: -len("loader")].rstrip("_") if loader.endswith("loader") else loader
        base = f"{base}_dataset" if base not in ("", "data") else "dataset"
        used = self.ctx.shared("names-used", lambda ctx: {n.value for n in findall(ctx.module, m.Name())})
        name, n = base, 1
        while name in used:
            n += 1
            name = f"{base}{n}"
        return name

    def _may_hold_sampler(self, kwargs: cst.BaseExpression) -> bool:
        """`**kwargs` is safe when every dict literal it is built from lacks these keys."""
        if not isinstance(kwargs, cst.Name):
            return True
        values = [a.value for a in findall(self.ctx.module, m.Assign(targets=[m.AssignTarget(m.Name(kwargs.value))]))]
        if not values:
            return True
        for value in values:
            dicts = findall(value, m.Dict())
            if not dicts:
                return True
            for d in dicts:
                keys = [literal_str(e.key) for e in d.elements if isinstance(e, cst.DictElement)]
                if any(k is None or k in ("shuffle", "sampler", "batch_sampler") for k in keys) or \
                        any(not isinstance(e, cst.DictElement) for e in d.elements):
                    return True
        return False

    def _loaders_in_scope(self, loop: cst.For) -> List[str]:
        """Training loaders this epoch loop can see: module-level ones, or ones its own
        function builds (not inside the loop: a loader rebuilt each epoch needs no set_epoch)."""
        func = enclosing(self.ctx.ancestors, cst.FunctionDef)
        out = []
        for name, kind in sorted(self.analysis.loaders.items()):
            assign = m.Assign(targets=[m.AssignTarget(m.Name(name))])
            if kind != "train" or findall(loop.body, assign):
                continue
            if any(findall(s, assign) for s in self.ctx.module.body if not isinstance(s, (cst.FunctionDef, cst.ClassDef))) \
                    or (func is not None and findall(func.body, assign)):
                out.append(name)
        return out


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
    examples = (
        Flagged("from torch.utils.data import DataLoader\nl = DataLoader(ds, shuffle=True, sampler=s)\n"),
        Clean("from torch.utils.data import DataLoader\nl = DataLoader(ds, shuffle=False, sampler=s)\n"),
        Clean("from torch.utils.data import DataLoader\nl = DataLoader(ds, shuffle=True)\n"),
    )

    def visit_Call(self, node: cst.Call) -> None:
        if self.qualify(node.func) not in DATALOADER:
            return
        shuffle = get_arg(node, "shuffle", 2)
        if shuffle is not None and literal_bool(shuffle.value) is True and \
                (get_arg(node, "sampler", 3) is not None or get_arg(node, "batch_sampler", 4) is not None):
            self.report(shuffle)


class CheckpointEveryRank(Rule):
    """
    ## What it does
    Finds `torch.save` that would run on every rank (ddp migration: it runs on rank 0 only,
    and the saved model is unwrapped so its keys have no `module.` prefix).

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
    name = "checkpoint-every-rank"
    message = "`torch.save` on every rank: save from rank 0 only"
    fixed_in = frozenset({"ddp"})
    lint = False
    triggers = ("save",)
    examples = (
        Flagged(
            "import torch\nfor epoch in range(3):\n    torch.save(state, 'ckpt.pt')\n",
            fixed="import torch\nfrom gpumigrate.runtime import is_main_process\n\nfor epoch in range(3):\n"
            "    if is_main_process():\n        torch.save(state, 'ckpt.pt')\n",
        ),
        Clean("import torch\nfrom gpumigrate.runtime import is_main_process\nif is_main_process():\n"
              "    torch.save(state, 'ckpt.pt')\n"),
    )

    def visit_Module(self, node: cst.Module) -> None:
        self.analysis = ddp_analysis(self.ctx)

    def _saves(self, node: cst.CSTNode) -> List[cst.Call]:
        return [c for c in findall(node, m.Call()) if self.qualify(c.func) == "torch.save"]

    def _guarded(self) -> bool:
        return any(_is_main_guard(a, self.ctx.names) for a in self.ctx.ancestors)

    def _wrap(self, original, updated):
        saves = self._saves(original)
        if not saves or self._guarded() or not training_script(self.ctx):
            return None
        for save in saves:
            self.report(save)
        guarded = _guard(self.ctx, [updated])
        if self.analysis.reloads:
            # the script reads its checkpoint back: the other ranks wait for the write
            wait = cst.SimpleStatementLine(body=[cst.Expr(cst.Call(func=_runtime(self.ctx, "barrier")))])
            return cst.FlattenSentinel([guarded, wait])
        return guarded

    def leave_SimpleStatementLine(self, original, updated):
        if any(isinstance(a, cst.With) and self._opens_file(a) for a in self.ctx.ancestors):
            return None  # the `with open(...)` around it is guarded as a whole
        if not all(m.matches(s, m.Expr(m.Call())) for s in original.body):
            return None
        return self._wrap(original, updated)

    def leave_With(self, original: cst.With, updated: cst.With):
        if not self._opens_file(original):
            return None
        return self._wrap(original, updated)

    @staticmethod
    def _opens_file(node: cst.With) -> bool:
        return any(m.matches(item.item, m.Call(func=m.Name("open"))) for item in node.items)

    def leave_Call(self, original: cst.Call, updated: cst.Call):
        # torch.save(model, f): the plain module, not the wrapper
        if self.qualify(original.func) != "torch.save" or not updated.args:
            return None
        obj = updated.args[0].value
        if isinstance(obj, cst.Name) and obj.value in self.analysis.models:
            unwrapped = cst.Call(func=_runtime(self.ctx, "unwrap_model") if self.fixing else cst.Name("unwrap_model"),
                                 args=[cst.Arg(obj)])
            return updated.with_changes(args=[updated.args[0].with_changes(value=unwrapped), *updated.args[1:]])
        return None


class LegacyLauncher(Rule):
    """
    ## What it does
    Finds `--local_rank` / `--local-rank` arguments, set by the deprecated
    `python -m torch.distributed.launch`.

    ## Why is this bad?
    torchrun does not pass `--local_rank`; it sets the `LOCAL_RANK` environment variable.
    A script that reads the argument puts every process on GPU 0.

    ## Example
    ```python
    parser.add_argument("--local_rank", type=int, default=0)
    ```

    ## Use instead
    ```python
    parser.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    ```
    """

    code = "GM405"
    name = "legacy-launcher"
    message = "`--local_rank` comes from the deprecated torch.distributed.launch; torchrun sets LOCAL_RANK"
    fixed_in = frozenset({"ddp"})
    triggers = ("local_rank", "local-rank")
    examples = (
        Flagged(
            "import os\nparser.add_argument('--local_rank', type=int, default=0)\n",
            fixed="import os\nparser.add_argument('--local_rank', type=int, default=int(os.environ.get(\"LOCAL_RANK\", 0)))\n",
        ),
        Clean("parser.add_argument('--rank', type=int, default=0)\n"),
    )

    def leave_Call(self, original: cst.Call, updated: cst.Call):
        if not is_method_call(original, "add_argument") or not original.args:
            return None
        flag = literal_str(original.args[0].value)
        if flag not in ("--local_rank", "--local-rank"):
            return None
        default = get_arg(updated, "default")
        if default is not None and findall(default.value, m.SimpleString(value=m.MatchIfTrue(lambda v: "LOCAL_RANK" in v))):
            return None
        self.report(original)
        if self.fixing:
            self.ctx.add_import("os")
        value = cst.parse_expression('int(os.environ.get("LOCAL_RANK", 0))')
        args = [a for a in updated.args if a is not default]
        return with_args(updated, [*args, keyword_arg("default", value)])


def _is_number(node: cst.BaseExpression) -> bool:
    return isinstance(node, (cst.Integer, cst.Float)) or (
        isinstance(node, cst.UnaryOperation) and isinstance(node.expression, (cst.Integer, cst.Float)))


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


class UnreducedMetric(_BlockRule):
    """
    ## What it does
    Sums evaluation metrics over the ranks after an evaluation loop over a sharded loader
    (ddp migration): `test_loss, correct = reduce_sum(test_loss, correct)`.

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
    """

    code = "GM406"
    name = "unreduced-metric"
    message = "a metric summed over one rank's shard is not the whole test set's: reduce it over ranks"
    fixed_in = frozenset({"ddp"})
    lint = False
    triggers = ("loader",)
    examples = (
        Flagged(
            "correct = 0\nfor x, y in test_loader:\n    correct += 1\nprint(correct)\n",
            fixed="from gpumigrate.runtime import is_main_process, reduce_sum\n\ncorrect = 0\nfor x, y in test_loader:\n"
            "    correct += 1\ncorrect = reduce_sum(correct)\nif is_main_process():\n    print(correct)\n",
        ),
        Clean("total = 0\nfor x, y in train_loader:\n    total += 1\n"),
    )

    def visit_Module(self, node: cst.Module) -> None:
        self.analysis = ddp_analysis(self.ctx)

    def _eval_loop(self, loop: Optional[cst.For]) -> bool:
        if loop is None:
            return False
        func = enclosing(self.ctx.ancestors, cst.FunctionDef)
        in_evaluation = func is not None and (bool(_EVAL_NAME.match(func.name.value)) or _calls_eval(func))
        for name in findall(loop.iter, m.Name()):
            if in_evaluation and "loader" in name.value and not _TRAIN_LOADER.search(name.value):
                return True
            kind = self.analysis.loaders.get(name.value)
            if kind == "eval" or (kind is None and "loader" in name.value and _EVAL_LOADER.search(name.value)
                                  and not _TRAIN_LOADER.search(name.value)):
                return True
        return False

    def _initialised(self) -> Set[str]:
        scope = enclosing(self.ctx.ancestors, cst.FunctionDef) or self.ctx.module
        return {a.targets[0].target.value for a in findall(scope, m.Assign(targets=[m.AssignTarget(m.Name())]))
                if _is_number(a.value) or (isinstance(a.value, cst.Call) and (self.qualify(a.value.func) or "")
                                           in ("torch.zeros", "torch.zeros_like"))}

    def _block(self, original_body, updated_body):
        parent = self.ctx.ancestors[-1] if self.ctx.ancestors else None
        if not training_script(self.ctx):
            return None
        if isinstance(parent, cst.With) and _loop_of(parent) is not None:
            return None  # `with no_grad(): for ...`: the reduction goes after the `with`
        out, changed = [], False
        originals = [_loop_of(s) for s in original_body]
        for i, stmt in enumerate(updated_body):
            out.append(stmt)
            loop = _loop_of(stmt)
            if not self._eval_loop(loop):
                continue
            accumulators = []
            for aug in findall(loop.body, m.AugAssign(target=m.Name() | m.Subscript(value=m.Name()),
                                                        operator=m.AddAssign())):
                name = aug.target.value if isinstance(aug.target, cst.Name) else aug.target.value.value
                if name not in accumulators:
                    accumulators.append(name)
            initialised = self._initialised()
            wanted = [n for n in accumulators if n in initialised]
            following = updated_body[i + 1] if i + 1 < len(updated_body) else None
            if not wanted or (following is not None and findall(following, m.Call(func=m.Name("reduce_sum")))):
                continue
            source = next((o for o in originals if o is not None and o.iter.deep_equals(loop.iter)), None)
            self.report(source or loop, f"{', '.join(wanted)} summed over one rank's shard: reduced over ranks")
            targets = cst.Tuple([cst.Element(cst.Name(n)) for n in wanted], lpar=[], rpar=[]) if len(wanted) > 1 \
                else cst.Name(wanted[0])
            call = cst.Call(func=_runtime(self.ctx, "reduce_sum") if self.fixing else cst.Name("reduce_sum"),
                            args=[cst.Arg(cst.Name(n)) for n in wanted])
            out.append(cst.SimpleStatementLine(body=[cst.Assign(targets=[cst.AssignTarget(targets)], value=call)]))
            changed = True
        return out if changed else None



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
    examples = (
        Flagged("import torch.nn as nn\nbn = nn.BatchNorm2d(8)\nm = nn.parallel.DistributedDataParallel(net)\n"),
        Clean("import torch.nn as nn\nbn = nn.BatchNorm2d(8)\n"),
        Clean("import torch.nn as nn\nbn = nn.BatchNorm2d(8)\nnet = nn.SyncBatchNorm.convert_sync_batchnorm(net)\n"
              "m = nn.parallel.DistributedDataParallel(net)\n"),
    )

    def visit_Module(self, node: cst.Module) -> None:
        text = self.ctx.text
        distributed = "DistributedDataParallel" in text or "GM400" in self.ctx.fixing
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


_COLLECTIVES = {"barrier", "all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list",
                "reduce", "gather", "scatter", "all_to_all", "reduce_scatter", "monitored_barrier"}
_RANK_TEST = re.compile(r"(rank\b[^=]*==\s*0|rank\s+in\s*[\[(]|is_main_process\(\)|is_master|get_rank\(\)\s*==\s*0)")


class CollectiveInRankBranch(Rule):
    """
    ## What it does
    Finds collective calls (`dist.barrier()`, `all_reduce`, `broadcast`, ... and the
    runtime's `barrier`/`reduce_sum`) inside `if rank == 0:` / `if is_main_process():` blocks.

    ## Why is this bad?
    Every rank must enter a collective. Inside a rank-0 branch only rank 0 does, and the
    job hangs until the NCCL/gloo timeout.

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
    examples = (
        Flagged("import torch.distributed as dist\nif dist.get_rank() == 0:\n    dist.barrier()\n"),
        Flagged("from gpumigrate.runtime import is_main_process, reduce_sum\nif is_main_process():\n"
                "    total = reduce_sum(total)\n"),
        Clean("import torch.distributed as dist\nif dist.get_rank() == 0:\n    print('saved')\ndist.barrier()\n"),
        Clean("import torch.distributed as dist\nif epoch == 0:\n    dist.barrier()\n"),
    )

    def visit_Call(self, node: cst.Call) -> None:
        qualified = self.qualify(node.func) or ""
        name = qualified.rsplit(".", 1)[-1]
        is_collective = (qualified.startswith("torch.distributed.") and name in _COLLECTIVES) or \
            qualified in (f"{RUNTIME}.barrier", f"{RUNTIME}.reduce_sum", f"{RUNTIME}.reduce_mean")
        if not is_collective:
            return
        for ancestor in self.ctx.ancestors:
            if isinstance(ancestor, cst.If) and _RANK_TEST.search(self.ctx.module.code_for_node(ancestor.test)):
                if any(n is node for n in findall(ancestor.body, m.Call())):
                    self.report(node)
                    return


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
    """

    code = "GM409"
    name = "wrapped-attribute"
    message = "custom attribute of a wrapped model: `AttributeError` under DDP; use `unwrap_model(model)`"
    fixed_in = frozenset({"ddp"})
    triggers = ("parameters", "DistributedDataParallel", "DataParallel")
    examples = (
        Flagged(
            "import torch.nn as nn\nmodel = nn.parallel.DistributedDataParallel(net)\nh = model.init_hidden(4)\n",
        ),
        Clean("import torch.nn as nn\nmodel = nn.parallel.DistributedDataParallel(net)\nmodel.train()\n"
              "ps = model.parameters()\n"),
        Clean("import torch.nn as nn\nmodel = Net()\nh = model.init_hidden(4)\n"),
    )

    def visit_Module(self, node: cst.Module) -> None:
        if self.fixing:
            self.models = set(ddp_analysis(self.ctx).models)
            return
        wrappers = DATA_PARALLEL + ("torch.nn.parallel.DistributedDataParallel",
                                    "torch.nn.parallel.distributed.DistributedDataParallel")
        self.models = {a.targets[0].target.value for a in findall(node, m.Assign(targets=[m.AssignTarget(m.Name())], value=m.Call()))
                       if self.qualify(a.value.func) in wrappers}

    def leave_Attribute(self, original: cst.Attribute, updated: cst.Attribute):
        if not (isinstance(original.value, cst.Name) and original.value.value in self.models) \
                or original.attr.value in _SAFE_ATTRIBUTES or original.attr.value.startswith("__"):
            return None
        name = original.value.value
        self.report(original, f"`{name}.{original.attr.value}` through a wrapped model raises AttributeError "
                              f"under DDP (or saves `module.`-prefixed keys); use `unwrap_model({name})`")
        func = _runtime(self.ctx, "unwrap_model") if self.fixing else cst.Name("unwrap_model")
        return updated.with_changes(value=cst.Call(func=func, args=[cst.Arg(updated.value)]))


_SAFE_CALLS = {"str", "int", "float", "len", "round", "abs", "min", "max", "sum", "repr", "format", "sorted", "list",
               "tuple", "dict", "type", "isinstance", "getattr", "hasattr", "enumerate", "zip", "range", "any",
               "all", "bool", "print", "unwrap_model", "get_rank", "get_world_size", "is_main_process"}
_UNSAFE_METHODS = re.compile(r"^(train|test|eval|evaluate|validate|step|backward|run|fit|all_reduce|barrier|reduce.*)$")
_LOG_METHODS = {"debug", "info", "warning", "warn", "error", "critical", "exception", "log"}


class RankZeroOutput(_BlockRule):
    """
    ## What it does
    Runs printing, logging and TensorBoard writing on rank 0 only, and turns progress bars
    off on the other ranks (ddp migration).

    ## Why is this bad?
    Under torchrun every line is printed N times, interleaved, and N processes write the
    same TensorBoard files.

    ## Example
    ```python
    print(f"epoch {epoch} loss {loss:.4f}")
    ```

    ## Use instead
    ```python
    if is_main_process():
        print(f"epoch {epoch} loss {loss:.4f}")
    ```
    A print whose arguments call user code (which may train, or communicate) is left for
    review rather than moved into a rank-0 branch.
    """

    code = "GM410"
    name = "rank-zero-output"
    message = "output on every rank: print and log from rank 0 only"
    fixed_in = frozenset({"ddp"})
    lint = False
    triggers = ("print", "log", "Writer", "tqdm")
    examples = (
        Flagged(
            "print('epoch', epoch)\nprint('done')\n",
            fixed="from gpumigrate.runtime import is_main_process\n\nif is_main_process():\n"
            "    print('epoch', epoch)\n    print('done')\n",
        ),
        Clean("from gpumigrate.runtime import is_main_process\nif is_main_process():\n    print('epoch', epoch)\n"),
    )

    def visit_Module(self, node: cst.Module) -> None:
        self.writers = set(ddp_analysis(self.ctx).writers)
        self.loggers = {a.targets[0].target.value for a in findall(node, m.Assign(targets=[m.AssignTarget(m.Name())], value=m.Call()))
                        if self.qualify(a.value.func) == "logging.getLogger"}

    def _output(self, stmt: cst.CSTNode) -> Optional[bool]:
        """True: an output statement safe to move under rank 0; False: output calling user
        code (review); None: not output."""
        if not isinstance(stmt, cst.SimpleStatementLine) or not all(m.matches(s, m.Expr(m.Call())) for s in stmt.body):
            return None
        verdicts = [self._output_call(s.value) for s in stmt.body]
        if any(v is None for v in verdicts):
            return None
        return all(verdicts)

    def _output_call(self, call: cst.Call) -> Optional[bool]:
        func = call.func
        qualified = self.qualify(func) or ""
        is_output = (m.matches(func, m.Name("print"))
                     or (qualified.startswith("logging.") and qualified.rsplit(".", 1)[1] in _LOG_METHODS)
                     or (isinstance(func, cst.Attribute) and isinstance(func.value, cst.Name)
                         and (func.value.value in self.writers
                              or (func.value.value in self.loggers and func.attr.value in _LOG_METHODS))))
        if not is_output:
            return None
        return all(self._safe(c) for c in findall(cst.Tuple([cst.Element(a.value) for a in call.args]) if call.args
                                                     else cst.Tuple([]), m.Call()))

    def _safe(self, call: cst.Call) -> bool:
        func = call.func
        if isinstance(func, cst.Name):
            return func.value in _SAFE_CALLS
        if isinstance(func, cst.Attribute):
            qualified = self.qualify(func) or ""
            if qualified.startswith(("math.", "time.", "os.", "datetime.", "json.")):
                return True
            return not _UNSAFE_METHODS.match(func.attr.value)
        return False

    def _block(self, original_body, updated_body):
        parent = self.ctx.ancestors[-1] if self.ctx.ancestors else None
        if _is_main_guard(parent, self.ctx.names) or not training_script(self.ctx):
            return None
        for stmt in original_body:
            verdict = self._output(stmt)
            if verdict is True:
                self.report(stmt)
            elif verdict is False:
                self.report(stmt, "output that calls user code: left on every rank; move the call out and "
                                  "print its result on rank 0", review=True)
        out, run, changed = [], [], False
        for stmt in [*updated_body, None]:
            if stmt is not None and self._output(stmt) is True:
                run.append(stmt)
                continue
            if run:
                previous = out[-1] if out else None
                if _is_main_guard(previous, self.ctx.names) and previous.orelse is None \
                        and not run[0].leading_lines:
                    # join the rank-0 block just before (e.g. a checkpoint save)
                    out[-1] = previous.with_changes(body=previous.body.with_changes(
                        body=[*previous.body.body, *run]))
                else:
                    out.append(_guard(self.ctx, run))
                run, changed = [], True
            if stmt is not None:
                out.append(stmt)
        return out if changed and self.fixing else None


    def leave_Call(self, original: cst.Call, updated: cst.Call):
        qualified = self.qualify(original.func) or ""
        if not qualified or not training_script(self.ctx):
            return None
        if qualified in ("tqdm.tqdm", "tqdm.auto.tqdm", "tqdm.notebook.tqdm") and get_arg(original, "disable") is None:
            self.report(original, "progress bar on every rank: shown on rank 0 only")
            test = cst.UnaryOperation(operator=cst.Not(), expression=_main_process_test(self.ctx))
            return with_args(updated, [*updated.args, keyword_arg("disable", test)])
        parent = self.ctx.ancestors[-1] if self.ctx.ancestors else None
        if qualified.endswith("SummaryWriter") and isinstance(parent, cst.Assign):
            self.report(original, "TensorBoard writer on every rank: created on rank 0 only")
            return cst.IfExp(test=_main_process_test(self.ctx), body=updated, orelse=cst.Name("None"))
        return None


_PER_RANK = {"tempfile.mkdtemp", "tempfile.mktemp", "uuid.uuid1", "uuid.uuid4", "time.time", "time.strftime",
             "time.asctime", "datetime.datetime.now", "datetime.datetime.today", "datetime.date.today",
             "socket.gethostname", "os.getpid"}


class PerRankValue(Rule):
    """
    ## What it does
    Makes values that differ per process agree (ddp migration): a run directory from
    `tempfile.mkdtemp()`, a timestamp or a uuid is taken from rank 0 with
    `broadcast_object`.

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
    name = "per-rank-value"
    message = "a value that differs per process: every rank must use rank 0's"
    fixed_in = frozenset({"ddp"})
    lint = False
    triggers = ("tempfile", "uuid", "time", "datetime", "socket", "getpid")
    examples = (
        Flagged(
            "import tempfile\nrun_dir = tempfile.mkdtemp()\nfor epoch in range(2):\n    save(run_dir, epoch)\n",
            fixed="import tempfile\nfrom gpumigrate.runtime import broadcast_object\n\n"
            "run_dir = broadcast_object(tempfile.mkdtemp())\nfor epoch in range(2):\n    save(run_dir, epoch)\n",
        ),
        Clean("import tempfile\nrun_dir = tempfile.gettempdir()\n"),
    )

    def leave_Assign(self, original: cst.Assign, updated: cst.Assign):
        calls = [c for c in findall(original.value, m.Call()) if self.qualify(c.func) in _PER_RANK]
        if not calls or not training_script(self.ctx) or m.matches(original.value, m.Call(func=m.Name("broadcast_object"))):
            return None
        if any(isinstance(a, (cst.For, cst.While)) for a in self.ctx.ancestors):
            self.report(original.value, "a value that differs per process, computed in a loop: make the ranks "
                                        "agree on it (broadcast_object) outside the loop", review=True)
            return None
        self.report(original.value)
        func = _runtime(self.ctx, "broadcast_object") if self.fixing else cst.Name("broadcast_object")
        return updated.with_changes(value=cst.Call(func=func, args=[cst.Arg(updated.value)]))
