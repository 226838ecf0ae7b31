"""Speed: data loading and host-device copies that make the GPU wait. GM601-GM604.

These find slow patterns that have no mechanical fix (how many workers, whether a copy is
needed are the author's choices): lint reports them, and the device migration lists GM603
for review.
"""

from __future__ import annotations

import re
from typing import Dict, List, Optional, Set, Tuple, Union

import libcst as cst
import libcst.matchers as m

from gpumigrate.analysis import script_model
from gpumigrate.analysis.structure import target_names
from gpumigrate.analysis.values import DATALOADER
from gpumigrate.codemods.base import Clean, Flagged, Rule
from gpumigrate.codemods.helpers import (
    get_arg,
    is_method_call,
    last_name,
    literal_int,
    literal_str,
    loop_index,
    moves_to,
    walk,
)
from gpumigrate.rewriter.facts import SourceFacts


_TRAIN = re.compile(r"(^|_|pre|re)train")
_EVAL = re.compile(r"test|val|eval|infer|predict")
_ZERO_GRAD_FALSE = re.compile(r"zero_grad\(\s*(set_to_none\s*=\s*)?False")


def _dataloader_call(rule: Rule, node: cst.Call) -> bool:
    return rule.qualify(node.func) in DATALOADER and not any(a.star for a in node.args)


def _bound_to(ancestors) -> Optional[str]:
    """The name a call's result is bound to: an assignment target, a dict key, or the
    function that returns it."""
    parent = ancestors[-2] if len(ancestors) > 1 else None
    call = ancestors[-1]
    if isinstance(parent, (cst.Assign, cst.AnnAssign)) and parent.value is call:
        targets = [t.target for t in parent.targets] if isinstance(parent, cst.Assign) else [parent.target]
        names = [last_name(t) for t in targets]
        return next((n for n in names if n), None)
    if isinstance(parent, cst.DictElement) and parent.value is call:
        return literal_str(parent.key)
    if isinstance(parent, cst.Return):
        func = next((a for a in reversed(ancestors) if isinstance(a, cst.FunctionDef)), None)
        return func.name.value if func else None
    return None


class LoaderNoWorkers(Rule):
    """
    ## What it does
    Finds a `DataLoader` built without `num_workers` (or with `num_workers=0`), unless it
    is an evaluation loader: bound to a name such as `val_loader`/`test_loader`, or only
    iterated by loops that do not train. A training loader (bound to a name such as
    `train_loader`, returned by `train_dataloader()`, or iterated by a loop that calls
    `.backward()` or `optimizer.step()`) is flagged whatever its name; so is a loader
    whose use the file does not show (TorchFix's TOR401 flags every loader).

    ## Why is this bad?
    With no workers every batch is read, decoded and augmented in the training process
    between steps, and the GPU waits for it: loading often costs more than the step itself.

    ## Example
    ```python
    train_loader = DataLoader(train_set, batch_size=64, shuffle=True)
    ```

    ## Use instead
    ```python
    train_loader = DataLoader(train_set, batch_size=64, shuffle=True,
                              num_workers=4, persistent_workers=True)
    ```
    Under the `spawn` start method (Windows, macOS) the script's entry point must then sit
    under `if __name__ == "__main__":`. Evaluation loaders (fast enough for most, and
    often built with `num_workers=0` on purpose), `num_workers=<expr>` and calls with
    `**kwargs` (workers may be inside) are not flagged.
    """

    code = "GM601"
    name = "loader-no-workers"
    # TorchFix's TOR401 flags every loader; GM601 all but the evaluation loaders
    torchfix = ("TOR401",)
    message = "`DataLoader` loads batches in the training process; set `num_workers`"
    triggers = ("DataLoader",)

    # a call qualified as torch's DataLoader (which loaders are evaluation needs the tree)
    @classmethod
    def gate(cls, facts: SourceFacts) -> bool:
        return facts.any_id("DataLoader") and facts.any_id("torch")

    examples = (
        Flagged("from torch.utils.data import DataLoader\ntrain_loader = DataLoader(ds, batch_size=32, shuffle=True)\n"),
        Flagged("import torch\nloader = torch.utils.data.DataLoader(ds, 32, True, None, None, 0)\n"
                "for x, y in loader:\n    loss = crit(model(x), y)\n    loss.backward()\n    optimizer.step()\n"),
        Flagged("from torch.utils.data import DataLoader\nclass M:\n    def train_dataloader(self):\n"
                "        return DataLoader(self.ds, batch_size=8)\n"),
        Clean("from torch.utils.data import DataLoader\ntrain_loader = DataLoader(ds, batch_size=32, num_workers=4)\n"),
        Clean("from torch.utils.data import DataLoader\ntest_loader = DataLoader(ds, batch_size=1000)\n"
              "for x, y in test_loader:\n    correct += (model(x).argmax(1) == y).sum()\n"),
        Clean("from torch.utils.data import DataLoader\ntrain_loader = DataLoader(ds, batch_size=32, **kwargs)\n"),
        Clean("from torch.utils.data import DataLoader\ntrain_loader = DataLoader(ds, num_workers=args.workers)\n"),
        Clean("from torch_geometric.loader import DataLoader\ntrain_loader = DataLoader(ds, batch_size=32)\n"),
        Flagged("import torch\nconstraint_loader = torch.utils.data.DataLoader(ds)\n"),  # use not seen: TOR401 too
        Clean("import torch\nval_loader = torch.utils.data.DataLoader(ds, batch_size=256)\n"),
    )

    def visit_Module(self, node: cst.Module) -> None:
        self.pending: List[Tuple[cst.CSTNode, Optional[str], List[cst.CSTNode]]] = []
        self.loops: List[Tuple[cst.For, Set[str]]] = []
        self.training: Set[int] = set()

    def visit_For(self, node: cst.For) -> None:
        names = {last_name(n) for n in walk(node.iter) if isinstance(n, (cst.Name, cst.Attribute))}
        self.loops.append((node, names))

    def visit_Call(self, node: cst.Call) -> None:
        if _trains(node):
            for a in self.ctx.ancestors:
                if isinstance(a, (cst.For, cst.While)):
                    self.training.add(id(a))
        if not _dataloader_call(self, node):
            return
        workers = get_arg(node, "num_workers", 5)
        if workers is not None and literal_int(workers.value) != 0:
            return
        where = workers if workers is not None else node
        self.pending.append((where, _bound_to(self.ctx.ancestors), list(self.ctx.ancestors)))

    def leave_Module(self, original: cst.Module, updated: cst.Module) -> None:
        trained = set().union(*(names for loop, names in self.loops if id(loop) in self.training))
        iterated = set().union(*(names for loop, names in self.loops if id(loop) not in self.training))
        for where, bound, ancestors in self.pending:
            in_training_iter = any(isinstance(a, cst.For) and id(a) in self.training and ancestors[i + 1] is a.iter
                                   for i, a in enumerate(ancestors[:-1]))
            training = in_training_iter or (bound and (_TRAIN.search(bound.lower()) or bound in trained))
            if not training and (bound is None or _EVAL.search(bound.lower()) or bound in iterated):
                continue  # an evaluation loader, or one whose use we cannot see
            if not training:
                self.report(where, "`DataLoader` without workers loads batches in the process that uses them, "
                                   "so a GPU waits on every one; set `num_workers` (e.g. 4)")
            elif isinstance(where, cst.Arg):
                self.report(where, "`num_workers=0` loads training batches in the training process, so the GPU "
                                   "waits on every one; use a few workers (e.g. 4)")
            else:
                self.report(where, "training `DataLoader` without `num_workers` loads batches in the training "
                                   "process, so the GPU waits on every one; set `num_workers` (e.g. 4)")


def _trains(call: cst.Call) -> bool:
    if is_method_call(call, "backward"):
        return True
    if not is_method_call(call, "step"):
        return False
    receiver = last_name(call.func.value) or ""
    return "opt" in receiver.lower() or "scaler" in receiver.lower()


class LoaderNoPinMemory(Rule):
    """
    ## What it does
    Finds `DataLoader(...)` calls without `pin_memory` in a script that copies batches to
    the GPU (`.cuda()`, `.to(device)`, `non_blocking=True`).

    ## Why is this bad?
    Copies from pageable host memory are staged through a pinned buffer and block the host;
    with `pin_memory=True` the loader's workers hand over page-locked batches, which copy
    faster and can overlap compute with `non_blocking=True`.

    ## Example
    ```python
    loader = DataLoader(ds, batch_size=64, num_workers=4)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
    ```

    ## Use instead
    ```python
    loader = DataLoader(ds, batch_size=64, num_workers=4, pin_memory=device.type == "cuda")
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    ```
    Pinning only helps CUDA copies (on a CPU-only run it warns), so tie it to the device.
    Any explicit `pin_memory=` value is the author's decision; calls with `**kwargs` are not
    flagged.
    """

    code = "GM602"
    name = "loader-no-pin-memory"
    message = "`DataLoader` without `pin_memory` in a script that copies batches to the GPU"
    triggers = ("DataLoader",)

    # a call qualified as torch's DataLoader, in a file with `.cuda()`, `.to(...)` or `non_blocking=`
    @classmethod
    def gate(cls, facts: SourceFacts) -> bool:
        return facts.any_id("DataLoader") and facts.any_id("torch") and (
            facts.any_call("cuda", "to") or facts.any_id("non_blocking"))

    examples = (
        Flagged("from torch.utils.data import DataLoader\nloader = DataLoader(ds, batch_size=64)\n"
                "for x, y in loader:\n    x, y = x.to(device), y.to(device)\n"),
        Flagged("import torch\nloader = torch.utils.data.DataLoader(ds, 64, num_workers=2)\n"
                "for x, y in loader:\n    out = model(x.cuda())\n"),
        Clean("from torch.utils.data import DataLoader\nloader = DataLoader(ds, batch_size=64, pin_memory=True)\n"
              "for x, y in loader:\n    x = x.to(device, non_blocking=True)\n"),
        Clean("from torch.utils.data import DataLoader\nloader = DataLoader(ds, batch_size=64, **kwargs)\n"
              "x = x.cuda()\n"),
        Clean("from torch.utils.data import DataLoader\nloader = DataLoader(ds, batch_size=64)\n"
              "# moved with .cuda() later\nnote = 'x.to(device)'\nx = x.to('cpu')\n"),
        Clean("from torch.utils.data import DataLoader\nloader = DataLoader(ds, pin_memory=False)\nx = x.cuda()\n"),
    )

    def visit_Module(self, node: cst.Module) -> None:
        self.pending: List[cst.Call] = []
        self.gpu = False

    def visit_Call(self, node: cst.Call) -> None:
        if not self.gpu and (moves_to(node, self.qualify, "gpu") or any(
                a.keyword is not None and a.keyword.value == "non_blocking" and _is_true(a.value) for a in node.args)):
            self.gpu = True
        if _dataloader_call(self, node) and get_arg(node, "pin_memory", 7) is None:
            self.pending.append(node)

    def leave_Module(self, original: cst.Module, updated: cst.Module) -> None:
        if not self.gpu:
            return
        for call in self.pending:
            self.report(call, "`DataLoader` without `pin_memory` in a script that copies batches to the GPU: "
                              "pageable copies are slower and block; pass `pin_memory=torch.cuda.is_available()` "
                              "and copy with `non_blocking=True`")


def _is_true(node: cst.BaseExpression) -> bool:
    return isinstance(node, cst.Name) and node.value == "True"


_FROM_HOST = ("torch.from_numpy", "torch.as_tensor", "torch.tensor")


class HostDeviceRoundtrip(Rule):
    """
    ## What it does
    Finds tensors that a loop body moves to the host with `.cpu()` and back to the device
    with `.cuda()` / `.to(device)`: chained (`x.cpu().cuda()`, also through `.numpy()` and
    `torch.from_numpy`) or through a name (`y = x.cpu()` ... `y.to(device)`).

    ## Why is this bad?
    Each iteration pays two copies over PCIe and two device synchronizations for data that
    could have stayed on the GPU.

    ## Example
    ```python
    for x, y in loader:
        out = model(x.to(device))
        probs = out.softmax(1).cpu()
        loss = criterion(probs.to(device), y.to(device))
    ```

    ## Use instead
    ```python
    for x, y in loader:
        out = model(x.to(device))
        probs = out.softmax(1)
        loss = criterion(probs, y.to(device))
        probs_host = probs.detach().cpu()  # only where the host really needs it
    ```
    Only moves within one loop body, in source order, are paired; a name rebound in
    between breaks the pair. Modules (`model = model.cpu()` to save a checkpoint, then
    back) are not flagged.
    """

    code = "GM603"
    name = "host-device-roundtrip"
    message = "tensor moved to the host and back to the device inside a loop"
    reported_in = frozenset({"device"})
    triggers = ("cpu",)

    # in a loop, `.cuda()`/`.to(...)` of what `.cpu()` or `.to(<cpu device>)` moved: a cpu device is
    # a "cpu..." literal or a name containing "cpu"
    @classmethod
    def gate(cls, facts: SourceFacts) -> bool:
        return facts.has_loop() and facts.any_call("cuda", "to") and (
            any("cpu" in i.lower() for i in facts.ids) or any(s.startswith("cpu") for s in facts.strings))

    examples = (
        Flagged("for x in loader:\n    y = model(x).cpu()\n    z = y.cuda()\n"),
        Flagged("import torch\nwhile True:\n    h = torch.from_numpy(h.cpu().numpy()).to(device)\n"),
        Flagged("for x in loader:\n    x = x.cpu()\n    stats.update(x)\n    x = x.to(device)\n"),
        Clean("for x in loader:\n    y = model(x)\n    preds.append(y.cpu())\n    z = x.cuda()\n"),
        Clean("y = x.cpu()\nfor i in range(3):\n    z = y.cuda()\n"),
        Clean("for x in loader:\n    y = x.cpu()\n    y = augment(x)\n    y = y.cuda()\n"),
        Clean("for epoch in range(10):\n    model = model.cpu()\n    save(model)\n    model = model.cuda()\n"),
        Clean("for x in loader:\n    y = x.cpu().to(torch.float64)\n    z = y.numpy()\n"),
        Clean("y = x.cpu().cuda()\n"),
    )

    def visit_Module(self, node: cst.Module) -> None:
        # statement (or compound header) -> names holding a host copy when it runs, in loops only
        self.host_at: Dict[int, Dict[str, cst.Call]] = {}

    def _loop(self, node: Union[cst.For, cst.While]) -> None:
        if loop_index(self.ctx.ancestors) is not None:
            return  # the outermost loop's scan covers nested ones
        host: Dict[str, cst.Call] = {}
        if isinstance(node, cst.For):
            self._unbind(node.target, host)
        self._suite(node.body, host)

    visit_For = visit_While = _loop

    def _suite(self, suite: cst.BaseSuite, host: Dict[str, cst.Call]) -> None:
        for stmt in suite.body:
            self._statement(stmt, host)

    def _statement(self, stmt: cst.CSTNode, host: Dict[str, cst.Call]) -> None:
        """Follow the statements in source order; branches are read one after the other."""
        self.host_at[id(stmt)] = dict(host)
        if isinstance(stmt, cst.SimpleStatementLine):
            for small in stmt.body:
                self._statement(small, host)
        elif isinstance(stmt, (cst.Assign, cst.AnnAssign)) and stmt.value is not None:
            targets = [t.target for t in stmt.targets] if isinstance(stmt, cst.Assign) else [stmt.target]
            moved = self._chain(stmt.value)[0]
            for target in targets:
                self._unbind(target, host)
                if moved is not None and isinstance(target, cst.Name) and not self._module(target.value):
                    host[target.value] = moved
        elif isinstance(stmt, cst.Del):
            self._unbind(stmt.target, host)
        elif isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
            host.pop(stmt.name.value, None)
        elif isinstance(stmt, cst.BaseCompoundStatement):
            if isinstance(stmt, cst.For):
                self._unbind(stmt.target, host)
            for item in getattr(stmt, "items", ()):  # with ... as x
                if item.asname is not None:
                    self._unbind(item.asname.name, host)
            if isinstance(getattr(stmt, "body", None), cst.BaseSuite):
                self._suite(stmt.body, host)
            for case in getattr(stmt, "cases", ()):
                self._suite(case.body, host)
            orelse = getattr(stmt, "orelse", None)
            if isinstance(orelse, cst.If):
                self._statement(orelse, host)
            elif orelse is not None:
                self._suite(orelse.body, host)
            for handler in getattr(stmt, "handlers", ()):
                self._suite(handler.body, host)
            if getattr(stmt, "finalbody", None) is not None:
                self._suite(stmt.finalbody.body, host)

    def _unbind(self, target: cst.CSTNode, host: Dict[str, cst.Call]) -> None:
        for name in target_names(target):
            host.pop(name, None)

    def _chain(self, expr: cst.BaseExpression) -> Tuple[Optional[cst.Call], Optional[str]]:
        """The first host move (`.cpu()`) down `expr`'s receiver chain, and the chain's root name."""
        moved, node = None, expr
        while True:
            if isinstance(node, cst.Call):
                if moved is None and moves_to(node, self.qualify, "cpu"):
                    moved = node
                if self.qualify(node.func) in _FROM_HOST and node.args:
                    node = node.args[0].value
                elif isinstance(node.func, cst.Attribute):
                    node = node.func.value
                else:
                    return moved, None
            elif isinstance(node, (cst.Attribute, cst.Subscript)):
                node = node.value
            else:
                return moved, node.value if isinstance(node, cst.Name) else None

    def _module(self, name: str) -> bool:
        return script_model(self.ctx).module_like_name(name, self.ctx.ancestors[-1])

    def visit_Call(self, node: cst.Call) -> None:
        if not moves_to(node, self.qualify, "gpu") or loop_index(self.ctx.ancestors) is None:
            return
        moved, root = self._chain(node.func.value)
        if root is not None and self._module(root):
            return
        if moved is not None:
            self.report(node, "`.cpu()` then back to the device: every iteration copies this tensor to the host "
                              "and back; keep it on the device (`.detach()`/`.clone()` if you need a copy)")
            return
        host = next((self.host_at[id(a)] for a in reversed(self.ctx.ancestors) if id(a) in self.host_at), {})
        if root in host:
            line = self.ctx.position(host[root])[0]
            self.report(node, f"`{root}` was moved to the host with `.cpu()` on line {line} and comes back to "
                              f"the device here, every iteration; keep it on the device and copy to the host "
                              f"only what the host needs")


class ZeroGradToZero(Rule):
    """
    ## What it does
    Finds `zero_grad(set_to_none=False)` (TorchFix TOR402).

    ## Why is this bad?
    Writing zeros into every gradient costs a kernel and memory traffic per parameter
    each step; setting them to `None` (the default since torch 2.0) costs nothing, and the
    next backward allocates them.

    ## Example
    ```python
    optimizer.zero_grad(set_to_none=False)
    ```

    ## Use instead
    ```python
    optimizer.zero_grad()
    ```
    Lint-only: code that reads `.grad` after zeroing (a norm, a hook, an in-place `add_`)
    would find `None` instead of zeros; the author checks.
    """

    code = "GM604"
    name = "zero-grad-to-zero"
    torchfix = ("TOR402",)
    message = "`zero_grad(set_to_none=False)` writes zeros into every gradient; `zero_grad()` sets them to None"
    triggers = ("zero_grad",)

    examples = (
        Flagged("optimizer.zero_grad(set_to_none=False)\n"),
        Flagged("model.zero_grad(False)\n"),
        Clean("optimizer.zero_grad()\nmodel.zero_grad(set_to_none=True)\n"),
    )

    @classmethod
    def gate(cls, facts: SourceFacts) -> bool:  # every training script calls zero_grad: look for False
        return facts.any_call("zero_grad") and _ZERO_GRAD_FALSE.search(facts.text) is not None

    def visit_Call(self, node: cst.Call) -> None:
        if is_method_call(node, "zero_grad"):
            arg = get_arg(node, "set_to_none", 0)
            if arg is not None and m.matches(arg.value, m.Name("False")):
                self.report(node)
