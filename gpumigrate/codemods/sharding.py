"""The fsdp migration (GM415): the ddp migration with each trained model sharded by FSDP2.

The ddp rules do the work (codemods/distributed.py asks `sharding(ctx)`): `shard_model(model)`
where `wrap_model(model)` would go, right before the optimizer is built; a checkpoint's
`model.state_dict()` gathered on every rank before rank 0 saves it. This rule marks the
migration as fsdp and lists what sharding changes that the migration cannot settle.
"""

from __future__ import annotations

from typing import Dict, Set

import libcst as cst

from gpumigrate.analysis.structure import dotted
from gpumigrate.codemods.base import Clean, Flagged, Rule
from gpumigrate.codemods.ddp_plan import ddp_plan
from gpumigrate.codemods.ddp import FSDP_CODE
from gpumigrate.codemods.distributed import _state_dict_of, gathering_call, sharded_aliases, sharded_optimizers


_BATCHNORMS = frozenset({"BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm"})
# builtins that look at a module without running it
_INSPECT = frozenset({"hasattr", "getattr", "isinstance", "type", "id", "print", "repr", "str", "len"})
# a sharded module's attributes whose use gathers its parameters
_GATHERING = frozenset({"forward", "parameters", "named_parameters", "state_dict", "weight", "bias"})


class FsdpShard(Rule):
    """
    ## What it does
    Shards each model an optimizer trains across the ranks with FSDP2 (fsdp migration only):
    everything the ddp migration does (`setup_distributed()`, sharded data, rank-0 outputs,
    reduced metrics), with `shard_model(model)` where ddp would write `wrap_model(model)`,
    right before the optimizer is built. A checkpoint's `model.state_dict()` (and its
    optimizer's) is gathered whole on every rank (`full_state_dict`), then saved by rank 0,
    so the file loads into the original model class.

    ## Why is this bad?
    DDP keeps a whole copy of the model, its gradients and its optimizer state on every GPU:
    a model that does not fit on one GPU does not train. FSDP2 keeps 1/N of each on each of N.

    ## Example
    ```python
    model = Net().cuda()
    optimizer = optim.AdamW(model.parameters())
    torch.save(model.state_dict(), "model.pt")
    ```

    ## Use instead
    ```python
    device = setup_distributed()
    model = Net().to(device)
    model = shard_model(model)          # fully_shard per repeated block, then the root
    optimizer = optim.AdamW(model.parameters())
    model_state = full_state_dict(model)  # every rank: a collective
    if is_main_process():
        torch.save(model_state, "model.pt")
    ```
    Listed for review: a model it does not shard, a direct `model.forward(...)` call (it skips
    the hooks that gather the parameters), a `state_dict()` of a sharded model that is not
    saved where the migration gathers it (it holds this rank's shards).
    """

    code = FSDP_CODE
    done = "FSDP2 sharding"
    name = "fsdp-shard"
    message = "a model trained whole on every rank: shard it (FSDP2)"
    fixed_in = frozenset({"fsdp"})
    lint = False  # a migration step, not a defect
    triggers = ("torch",)

    examples = (
        Flagged(
            "import torch\nmodel = Net().cuda()\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
            "loader = torch.utils.data.DataLoader(data, batch_size=8)\n"
            "for x in loader:\n    model(x).sum().backward()\n    opt.step()\n"
            "torch.save(model.state_dict(), 'model.pt')\n",
            fixed="import torch\nfrom gpumigrate.runtime import distributed_sampler, full_state_dict, is_main_process, "
                  "setup_distributed, shard_model\n\ndevice = setup_distributed()\nmodel = Net().to(device)\n"
                  "model = shard_model(model)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                  "loader = torch.utils.data.DataLoader(data, batch_size=8, sampler=distributed_sampler(data, "
                  "shuffle=False))\nfor x in loader:\n    model(x).sum().backward()\n    opt.step()\n"
                  "model_state = full_state_dict(model)\nif is_main_process():\n    torch.save(model_state, 'model.pt')\n",
        ),
        Clean("import torch\nmodel = Net()\nprint(model(torch.zeros(1, 4)))\n"),  # nothing trains
    )

    def visit_Module(self, node: cst.Module) -> None:
        self.whole: Dict[int, str] = {}  # id of a `X.state_dict()` every rank runs -> X
        self.optimizers: Dict[str, str] = {}
        plan = ddp_plan(self.ctx)
        if not plan.active:
            return
        models = {w.name for w in plan.wraps}
        for wrap in plan.wraps:
            if not wrap.existing:
                self.report(wrap.anchor, f"`{wrap.name}` trains whole on every rank: sharded across the ranks "
                                         "(FSDP2), before its optimizer is built")
        for trained in plan.model.trained_models:
            if not trained.loss_module and trained.name not in models:
                where = trained.optimizers[0].site if trained.optimizers else node.body[0]
                self.report(where, f"`{trained.name}` is not sharded (the migration found no place to shard it "
                                   "before its optimizer): it stays whole on every rank, its gradients averaged "
                                   "as under ddp", review=True)
        if not models:
            return
        if any(n.value in _BATCHNORMS for n in plan.s.index.of(cst.Name)):
            self.report(node.body[0], "BatchNorm's running statistics are averaged across the ranks at each step "
                                      "(FSDP keeps buffers per rank; under ddp they would be rank 0's): "
                                      "evaluations differ slightly from a ddp run's")
        self.optimizers = sharded_optimizers(plan, models)
        aliases = sharded_aliases(plan, models)
        gathered = self._gathered_lines(plan)
        s = plan.s
        self._rank_local_reads(plan, models, gathered)
        for call in s.index.of(cst.Call):
            func = call.func
            if isinstance(func, cst.Attribute) and func.attr.value == "forward" and dotted(func.value) in models:
                self.report(call, f"`{dotted(func.value)}.forward(...)` skips the hooks that gather a sharded "
                                  f"model's parameters: call `{dotted(func.value)}(...)`", review=True)
                continue
            owner = _state_dict_of(call)
            if (owner in aliases or owner in self.optimizers) and id(s.line(call)) not in gathered:
                if plan.uniform(call):
                    self.whole[id(call)] = owner
                    self.report(call, f"`{owner}.state_dict()` of a sharded model: gathered whole on every rank, "
                                      "as one process had it (`rank0_only=False`: a full copy on each rank's CPU)")
                else:
                    self.report(call, f"`{owner}.state_dict()` of a sharded model holds this rank's shards "
                                      "(DTensors), and not every rank provably runs this code to gather them: make "
                                      "every rank call `full_state_dict(model)` here", review=True)

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.BaseExpression:
        """`model.state_dict()` that every rank runs (a checkpoint dict handed to a helper that
        saves it, a copy of the best weights): the whole state, on every rank."""
        owner = self.whole.get(id(original)) if self.fixing else None
        if owner is None:
            return updated
        return gathering_call(self.ctx, owner, self.optimizers, self.fixing, everywhere=True)

    def _rank_local_reads(self, plan, models: Set[str], gathered: Set[int]) -> None:
        """A sharded model used in code only some ranks run (the script's own `if rank == 0:`,
        or a function only such code calls): its forward, or a read of its parameters,
        gathers them from every rank, which never come."""
        s, seen = plan.s, set()
        gated_functions = plan.gated_functions
        for node in [*s.index.of(cst.Name), *s.index.of(cst.Attribute)]:
            if dotted(node) not in models or not self._gathers(s, node):
                continue
            line = s.line(node)
            fn = s.function(node)
            if id(line) in seen or id(line) in gathered or not (
                    plan.gated(node) or fn is not None and id(fn.node) in gated_functions):
                continue
            seen.add(id(line))
            self.report(node, f"`{dotted(node)}` is sharded, and this code runs on some ranks only: its forward or "
                              "a read of its parameters gathers them from every rank, which are not there; run it "
                              "on every rank, or use `full_state_dict`/`full_model` (every rank) first", review=True)

    @staticmethod
    def _gathers(s, node: cst.CSTNode) -> bool:
        """Does this use of a sharded model gather its parameters: its forward (called, or
        handed to a function), or a read of its parameters (`model.fc.weight`,
        `model.parameters()`)? Not `model.num_classes` or `model.eval()`."""
        above = s.parent(node)
        if isinstance(above, cst.Call) and above.func is node:
            return True
        if isinstance(above, cst.Arg):  # handed to a function, which may run it; not to these
            call = s.parent(above)
            return not (isinstance(call, cst.Call) and isinstance(call.func, cst.Name) and call.func.value in _INSPECT)
        if not isinstance(above, cst.Attribute) or above.value is not node:
            return False
        if above.attr.value in _GATHERING:
            return True
        return isinstance(s.parent(above), cst.Attribute)  # `model.fc.weight`: a submodule's tensors

    @staticmethod
    def _gathered_lines(plan) -> Set[int]:
        """The lines whose saves GM404 gathers, or reports (a save line it gates, one in the
        script's own rank-0 branch, or a line of a `with open(...)` block that only writes)."""
        out: Set[int] = set()
        for node in plan.s.index.order:
            if isinstance(node, cst.SimpleStatementLine) and (
                    id(node) in plan.gated_lines and plan.saves_here(node) or plan.gated(node) and plan.torch_saves(node)):
                out.add(id(node))
            elif isinstance(node, cst.With) and plan.gated_with_saves(node):
                out.update(id(n) for n in plan.s.inside(node, cst.SimpleStatementLine))
        return out
