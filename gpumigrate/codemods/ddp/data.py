"""What to shard: which DataLoaders get a distributed sampler, which loaders are rebuilt for
the rank where they are bound, where `set_epoch` goes, and which sizes count this rank's share.

Decides:
- `shard_training`: the training data is sharded at all (a script that trains through
  torch.optim optimizers, its own or its drivers'); `unsharded_data`: it trains on data that
  no loader brings (nothing to shard, and no model is DDP-wrapped);
- `loader_edits` and `sharded`: a `LoaderEdit` per DataLoader call (training, evaluation, or a
  factory with a train/eval flag), or why it cannot take a sampler (reported, nothing edited);
- `foreign_loaders`, `foreign_iterations`, `foreign_params`: training loaders made where this
  file cannot see, rebuilt with `shard_loader` where bound;
- `why_whole`: why an evaluation loader stays whole (its loops keep more than sums, not every
  rank runs them alike, or they run the wrapped model with autograd on);
- `sharded_holders`, `set_epoch_points`, `rebuild_points` (epochs), `per_rank_size`
  (`len(train_set)` that becomes this rank's share).

Relies on, from DdpPlan (ddp_plan.py) and its other mixins:
- `self.ctx`, `self.model`, `self.s`, `self.active`, `self.drivers` (ddp_plan.py);
- `self.wrapped_reference` (wrap.py): an evaluation loop that runs a wrapped model;
- `self.metrics`, `self._blockers` (reduce.py): an evaluation loader is sharded only where its
  loops keep sums that are reduced; `self._divisors_of_sums` (reduce.py): a size that a reduced
  training sum is divided by stays the whole set's;
- `self.uniform`, `self.torchrun` (reach.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Dict, List, Optional, Set, Tuple

import libcst as cst

from gpumigrate.analysis.launch import DISTRIBUTED_SAMPLERS
from gpumigrate.analysis.model import Loader
from gpumigrate.analysis.structure import Binding, Scope, dotted
from gpumigrate.analysis.syntax import runtime_helper
from gpumigrate.analysis import values as v
from gpumigrate.analysis.values import call_argument
from gpumigrate.codemods.helpers import fresh_name

# torch.optim's optimizers, as a project's script calls them (`optim.Adam(...)`)
_OPTIMIZER_CLASSES = frozenset({"SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "ASGD", "LBFGS", "NAdam",
                                "RAdam", "RMSprop", "Rprop", "SparseAdam"})

# what a loss may read beside the forward's outputs and the rows split (`view(-1, n_class)`)
_NOT_ROWS = frozenset({v.NUMBER, v.STRING, v.MODULE, v.LOSS_MODULE, v.DEVICE})
# nn.Module's own methods: not a forward of the model's, whatever they are given
_MODULE_API = frozenset({"parameters", "named_parameters", "buffers", "named_buffers", "children", "modules",
                         "named_modules", "state_dict", "load_state_dict", "to", "cuda", "cpu", "half", "float",
                         "double", "type", "train", "eval", "apply", "zero_grad", "requires_grad_", "register_buffer",
                         "register_parameter", "register_forward_hook", "register_forward_pre_hook", "add_module",
                         "get_submodule", "get_parameter", "share_memory", "extra_repr"})


@dataclass
class FixedRows:
    """Fixed tensors a loop trains on whole: their rows are split before `loop`."""

    loop: cst.CSTNode
    names: List[str]
    shards: List[str]  # the per-rank names, as `names`
    loads: Dict[int, str] = field(default_factory=dict)  # id(a Name in the loop reading one) -> its shard


@dataclass
class LoaderEdit:
    kind: str  # "train", "eval", "flag"
    flag: Optional[str] = None
    negated: bool = False
    eval_sharded: bool = False
    problem: Optional[str] = None  # why the sampler cannot be added here: reported, nothing edited
    hoist: bool = False  # the dataset is built inline: it gets a name of its own first
    # the script's own DistributedSampler, behind a condition torchrun may not meet: the loader
    # is rebuilt with shard_loader, which keeps that sampler where it is taken
    rebuild: bool = False


class Sharding:
    """What data each rank gets (a mixin of DdpPlan)."""

    # -- training data -------------------------------------------------------------------
    @cached_property
    def shard_training(self) -> bool:
        """Shard the training data of every script that trains through torch.optim
        optimizers: a model DDP wraps has its gradients averaged in backward, and every other
        parameter an optimizer steps has them averaged at the step, by the hooks
        setup_distributed() installs (runtime/averaging.py). So the ranks train one model
        whatever the analysis could prove about the script's shape, however the optimizer was
        made (a factory, a config, a project's Optimizer subclass stepped by `first_step()` and
        `second_step()`: its base optimizer's step is hooked too). Training by hand (no
        optimizer step at all) has no step to average at: its data stays whole."""
        return self.active and (bool(self.model.optimizers) or self._driven_by_optimizers or self._steps_an_optimizer
                                or self.driver and any(link.steps and "step" in link.calls for link in self.trained_in))

    @cached_property
    def _steps_an_optimizer(self) -> bool:
        """A `.step()` (or `first_step()`/`second_step()`, SAM's) on something that is not a
        scheduler, a scaler, a metric, a module or an environment: an optimizer the analysis
        could not follow to its construction."""
        for call in self.s.index.of(cst.Call):
            func = call.func
            if not isinstance(func, cst.Attribute) or func.attr.value not in ("step", "first_step", "second_step"):
                continue
            receiver = (dotted(func.value) or "").lower()
            if func.attr.value == "step" and (call.args and not any(a.keyword and a.keyword.value == "closure"
                                                                   for a in call.args)):
                continue  # `env.step(action)`, `scheduler.step(metric)`
            if any(w in receiver for w in ("sched", "scaler", "env", "meter", "timer", "bar", "lr")):
                continue
            if self.model.kind(func.value) in (v.SCHEDULER, v.SCALER, v.METRIC, v.MODULE, v.LOSS_MODULE, v.WRITER):
                continue
            return True
        return False

    @cached_property
    def unsharded_data(self) -> bool:
        """Training data that comes from no loader the migration shards (an environment's
        rollouts, tensors built by hand, batches drawn at random): each rank draws its own as
        the script does, and nothing makes the ranks reach the optimizer step equally often
        (`if len(memory) > 2000: train()`, `while not done: update()`). Such models are not
        DDP-wrapped: the step averaging lets a rank that finishes first take part until the
        others finish (runtime/uneven.py), which DDP's averaging inside backward cannot."""
        return (self.shard_training and not self.driver and not self.phase_loops
                and not any(l.role in ("train", "flag") for l in self.model.loaders)
                and not self.foreign_loaders and not self.foreign_params and not self.foreign_iterations
                and not self._rebuilt_loaders)

    @cached_property
    def fixed_rows(self) -> List[FixedRows]:
        """Full-batch training on fixed tensors (`output = model(inputs)`, `loss =
        criterion(output, targets)` in a loop, on tensors the loop never rebinds): their rows
        are split between the ranks before the loop (`shard_rows`, a DistributedSampler's
        split of dim 0), and the loop reads the shards. With no loader to shard, this is what
        makes such a script data-parallel; the runtime leaves tensors it cannot split alike
        whole, and the review asks the user to check that dim 0 is the batch."""
        if not self.unsharded_data:
            return []
        found: Dict[int, FixedRows] = {}
        for call in self.model.backward_calls:
            hit = self._fixed_rows(call)
            if hit is None:
                continue
            loop, names = hit
            rows = found.setdefault(id(loop), FixedRows(loop, [], []))
            rows.names.extend(n for n in names if n not in rows.names)
        for rows in found.values():
            rows.shards = [fresh_name(self.ctx, f"{name}_shard") for name in rows.names]
            shard = dict(zip(rows.names, rows.shards))
            for node in self.s.own(rows.loop, cst.Name):
                parent = self.s.parent(node)
                if node.value in shard and not (isinstance(parent, cst.Attribute) and parent.attr is node) \
                        and not (isinstance(parent, cst.Arg) and parent.keyword is node):
                    rows.loads[id(node)] = shard[node.value]
        return list(found.values())

    def row_splits(self) -> List[Tuple[cst.CSTNode, List[str]]]:
        """(loop, tensors) for every loop that trains on this rank's rows of fixed tensors:
        split by this run (`fixed_rows`) or by an earlier one (`x_shard = shard_rows(x)` just
        before the loop)."""
        if not self.active:
            return []
        splits = [(rows.loop, rows.names) for rows in self.fixed_rows]
        for call in self.s.index.of(cst.Call):
            if runtime_helper(self.model.qualify(call.func)) != "shard_rows":
                continue
            line = self.s.line(call)
            block = self.s.block(line) if line is not None else None
            body = list(block.body) if block is not None else []
            at = next((i for i, member in enumerate(body) if member is line), len(body))
            if at + 1 < len(body) and isinstance(body[at + 1], (cst.For, cst.While)):
                splits.append((body[at + 1], [a.value.value for a in call.args if isinstance(a.value, cst.Name)]))
        return splits

    def _fixed_rows(self, backward: cst.Call) -> Optional[Tuple[cst.CSTNode, List[str]]]:
        """The loop to split rows before, and the fixed tensors, of `loss.backward()` where
        `loss` is a call on a forward's outputs and fixed tensors, or a forward of fixed
        tensors itself; None for any other shape."""
        func = backward.func
        if backward.args or not (isinstance(func, cst.Attribute) and isinstance(func.value, cst.Name)):
            return None
        scope = self.s.scope(backward)
        loops = []
        for node in self.s.ancestors(backward):
            if isinstance(node, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
                break
            if isinstance(node, (cst.For, cst.While)):
                loops.append(node)
        if not loops:
            return None
        inner = loops[0]

        losses = self._bound_in(func.value.value, scope, inner)
        if len(losses) != 1 or losses[0].how != "assign" or losses[0].order > self.s.order(backward):
            return None
        loss = losses[0].value
        if isinstance(loss, cst.UnaryOperation) and isinstance(loss.operator, cst.Minus):
            loss = loss.expression  # `-torch.mean(log_prob)`
        if not isinstance(loss, cst.Call):
            return None
        while isinstance(loss.func, cst.Attribute) and loss.func.attr.value in ("mean", "sum") and not loss.args \
                and isinstance(loss.func.value, cst.Call):
            loss = loss.func.value  # `model.loss(x, y).mean()`: the per-sample losses it reduces
        forward, outputs = loss, set()
        inline = [c for arg in loss.args for c in self.s.inside(arg.value, cst.Call) if self._fixed_forward(c, inner)]
        if len(inline) == 1:  # `criterion(model(x), y)`
            forward = inline[0]
        elif not self._fixed_forward(loss, inner):
            reads = {n.value for n in self._reads(loss)}
            forwards = []
            for name in reads:
                for b in self._bound_in(name, scope, inner):
                    if b.how in ("assign", "unpack") and isinstance(b.value, (cst.Call, cst.IfExp)) \
                            and b.order < losses[0].order \
                            and self._fixed_forward(b.value, inner):
                        forwards.append(b)
            outputs = {b.name for b in forwards}
            if len({id(b.value) for b in forwards}) != 1 or \
                    any(self._bound_in(n, scope, inner) for n in reads - outputs):
                return None  # no forward, several, or the loss reads other values the loop makes
            forward = forwards[0].value
        names = []
        for name in dict.fromkeys(n.value for n in (*self._reads(forward), *self._reads(loss))):
            kind = self.model.kind_of_name(name, forward)
            if name in outputs or kind in _NOT_ROWS:
                continue
            if kind not in v.TENSORS:
                return None  # a value of unknown shape beside the rows split
            names.append(name)
        if not names:
            return None
        placed = None
        for loop in loops:
            if any(self._bound_in(n, scope, loop) for n in names):
                break
            placed = loop
        return (placed, names) if placed is not None else None

    def _fixed_forward(self, call: cst.BaseExpression, loop: cst.CSTNode) -> bool:
        """`model(a, b)` (or a method of the model's, `model.time_derivative(x)`; or one of
        two such calls, `model.rk4(x) if rk4 else model.f(x)`): a model called on names the
        loop does not bind, each a tensor."""
        if isinstance(call, cst.IfExp):
            return self._fixed_forward(call.body, loop) and self._fixed_forward(call.orelse, loop)
        if not isinstance(call, cst.Call) or not call.args:
            return False
        func = call.func
        method = isinstance(func, cst.Attribute) and func.attr.value not in _MODULE_API and \
            self.model.kind(func.value) != v.LOSS_MODULE and self.model.module_like(func.value)
        if not method and (not self.model.module_like(func) or self.model.kind(func) == v.LOSS_MODULE):
            return False
        scope = self.s.scope(call)
        for arg in call.args:
            if arg.star or not isinstance(arg.value, cst.Name) or \
                    self.model.kind_of_name(arg.value.value, call) not in v.TENSORS:
                return False
            if self._bound_in(arg.value.value, scope, loop):
                return False
        return True

    def _bound_in(self, name: str, scope: Scope, loop: cst.CSTNode) -> List[Binding]:
        """The bindings of `name` in `scope` made inside `loop`."""
        return [b for b in scope.bindings.get(name, []) if any(a is loop for a in self.s.ancestors(b.stmt))]

    def _reads(self, call: cst.BaseExpression) -> List[cst.Name]:
        """The names a call's arguments read (not attribute names or keywords); of both calls
        of `a(x) if test else b(x)`."""
        if isinstance(call, cst.IfExp):
            return [*self._reads(call.body), *self._reads(call.orelse)]
        if not isinstance(call, cst.Call):
            return []
        out = []
        for arg in call.args:
            for node in self.s.index.subtree(arg.value):
                if isinstance(node, cst.Name):
                    parent = self.s.parent(node)
                    if not (isinstance(parent, cst.Attribute) and parent.attr is node):
                        out.append(node)
        return out

    @cached_property
    def phase_loops(self) -> Dict[int, cst.BaseExpression]:
        """id(loop) -> the test that its phase trains, for `for x, y in dataloaders[phase]:`
        over a dict of DataLoaders whose training (every `.backward()` and step in the loop)
        runs only under `if phase == 'train':` (the transfer-learning tutorial's phases). The
        loop's loader is rebuilt for the rank where that test holds (`shard_loader(...,
        shard=phase == 'train')`): exactly the passes that train are sharded, evaluation
        phases read the whole set as before."""
        if not (self.active and self.shard_training):
            return {}
        out: Dict[int, cst.BaseExpression] = {}
        for loop in self.s.index.of(cst.For):
            it = loop.iter
            if isinstance(it, cst.Call) and it.args and runtime_helper(self.model.qualify(it.func)) == "shard_loader":
                it = it.args[0].value  # rebuilt by an earlier run
            if not (isinstance(it, cst.Subscript) and isinstance(it.value, cst.Name) and len(it.slice) == 1
                    and isinstance(it.slice[0].slice, cst.Index) and isinstance(it.slice[0].slice.value, cst.Name)):
                continue
            key = it.slice[0].slice.value.value
            if not self._dict_of_loaders(it.value) or not self.model.trains(loop.body):
                continue
            training = [c for c in (*self.model.backward_calls, *self.model.step_calls)
                        if any(a is loop for a in self.s.ancestors(c))]
            tests = [self._phase_test(c, loop, key) for c in training]
            if training and all(t is not None for t in tests) and \
                    len({self.ctx.module.code_for_node(t) for t in tests}) == 1:
                out[id(loop)] = tests[0]
        return out

    def _dict_of_loaders(self, name: cst.Name) -> bool:
        """`name` is bound only to `{x: DataLoader(...) for x in ...}` or a dict of DataLoader calls."""
        bindings = self.s.all_bindings(name.value, self.s.scope(name))
        if not bindings:
            return False
        for b in bindings:
            value = b.value
            if b.how != "assign":
                return False
            values = [value.value] if isinstance(value, cst.DictComp) else \
                [e.value for e in value.elements] if isinstance(value, cst.Dict) else []
            if not values or not all(isinstance(x, cst.Call) and self.model.qualify(x.func) in v.DATALOADER
                                     for x in values):
                return False
        return True

    def _phase_test(self, call: cst.Call, loop: cst.For, key: str) -> Optional[cst.BaseExpression]:
        """The `key == 'train'` test of the `if` inside `loop` whose body `call` runs in."""
        inside = list(self.s.ancestors(call))
        for node in inside:
            if node is loop:
                return None
            if isinstance(node, cst.If) and any(a is node.body for a in inside):
                test = node.test
                if isinstance(test, cst.Comparison) and isinstance(test.left, cst.Name) and test.left.value == key \
                        and len(test.comparisons) == 1 and isinstance(test.comparisons[0].operator, cst.Equal) \
                        and isinstance(test.comparisons[0].comparator, cst.SimpleString):
                    return test
        return None

    @cached_property
    def _driven_by_optimizers(self) -> bool:
        """A trainer module, imported by scripts that build torch.optim optimizers and build
        none itself: it steps theirs; the step hooks average them whatever they are."""
        return not self.model.optimizers and any(set(link.calls) & _OPTIMIZER_CLASSES for link in self.drivers)

    # -- loaders -------------------------------------------------------------------------
    @cached_property
    def foreign_loaders(self) -> List[cst.BaseExpression]:
        """Training loaders made where this file cannot see: rebuilt per rank where bound."""
        return self.model.foreign_loaders if self.shard_training else []

    @cached_property
    def foreign_iterations(self) -> Set[int]:
        """ids of what training iterates that evaluation's data is too: rebuilt there."""
        return {id(e) for e in self.model.foreign_iterations} if self.shard_training else set()

    @cached_property
    def foreign_params(self) -> Dict[int, List[str]]:
        """id(function) -> its parameters that are training loaders handed in from elsewhere
        (`def train(self, data_loader, epochs)` called by the script): rebuilt per rank first
        thing in the function (`shard_loader` gives the same rebuilt loader for the same loader
        at every call, so its order still changes each epoch)."""
        return self.model.foreign_params if self.shard_training else {}

    @cached_property
    def _rebuilt_loaders(self) -> bool:
        """An earlier run rebuilt a loader for the rank (`shard_loader(...)`)."""
        return any(runtime_helper(self.model.qualify(c.func)) == "shard_loader" for c in self.s.index.of(cst.Call))

    @cached_property
    def loader_edits(self) -> Dict[int, LoaderEdit]:
        edits: Dict[int, LoaderEdit] = {}
        if not self.active:
            return edits
        for loader in self.model.loaders:
            role = loader.role
            if role == "train":
                if self.shard_training:
                    edits[id(loader.call)] = LoaderEdit("train")
            elif role == "flag":
                if self.shard_training:
                    edits[id(loader.call)] = LoaderEdit("flag", loader.flag, loader.flag_negated,
                                                        eval_sharded=self._eval_shardable(loader))
            elif role == "eval":
                if self._eval_shardable(loader):
                    edits[id(loader.call)] = LoaderEdit("eval", eval_sharded=True)
        for call_id, edit in edits.items():
            loader = next(l for l in self.model.loaders if id(l.call) == call_id)
            own = self._own_samplers(loader.call) if edit.kind == "train" else []
            if own:  # the script shards it itself where torchrun takes that path; elsewhere, we do
                taken = any(self.torchrun.unmet(c) is None for c in own) or self._in_shard_loader(loader.call)
                edit.problem, edit.rebuild = ("already sharded", False) if taken else (None, True)
                continue
            edit.problem, edit.hoist = self._sampler_problem(loader.call)
            if edit.problem is None and self._already_sharded(loader.call):
                edit.problem = "already sharded"
        return edits

    def sharded(self, call: cst.Call) -> Optional[LoaderEdit]:
        """The edit of a DataLoader call that gets a distributed sampler, or None."""
        edit = self.loader_edits.get(id(call))
        return edit if edit is not None and edit.problem is None else None

    def _own_samplers(self, call: cst.Call) -> List[cst.Call]:
        """The script's own DistributedSampler calls that may be this DataLoader's sampler:
        `sampler=s` where `s` is bound to one on some path, or a conditional expression with one."""
        given = call_argument(call, "sampler", 3)
        values = [given] if given is not None else []
        if isinstance(given, cst.Name):
            values = [b.value for b in self.s.all_bindings(given.value, self.s.scope(given)) if b.how == "assign"]
        return [c for value in values for c in self.s.inside(value, cst.Call)
                if self.model.qualify(c.func) in DISTRIBUTED_SAMPLERS]

    def _in_shard_loader(self, call: cst.Call) -> bool:
        """`shard_loader(DataLoader(...))`: rebuilt by an earlier run."""
        arg = self.s.parent(call)
        outer = self.s.parent(arg) if isinstance(arg, cst.Arg) else None
        return isinstance(outer, cst.Call) and runtime_helper(self.model.qualify(outer.func)) == "shard_loader"

    def _already_sharded(self, call: cst.Call) -> bool:
        given = call_argument(call, "sampler", 3) or call_argument(call, "batch_sampler", 4)
        return isinstance(given, cst.Call) and (self.model.qualify(given.func) or dotted(given.func) or "").endswith(
            ("DistributedSampler", "distributed_sampler"))

    def _sampler_problem(self, call: cst.Call) -> Tuple[Optional[str], bool]:
        """Why `sampler=distributed_sampler(dataset)` cannot be added to this call, if it cannot."""
        if any(a.star == "*" for a in call.args):
            return "DataLoader(*args) may set shuffle or a sampler: add `sampler=distributed_sampler(dataset)` " \
                   "by hand", False
        if any(a.star == "**" and self._may_hold_sampler(a.value) for a in call.args):
            return "DataLoader(**kwargs) may set shuffle or a sampler: add `sampler=distributed_sampler(dataset)` " \
                   "by hand", False
        given = call_argument(call, "sampler", 3) or call_argument(call, "batch_sampler", 4)
        if given is not None and not self.no_sampler(call):
            if self._already_sharded(call):
                return None, False
            return "custom sampler kept: make it shard the data per rank (e.g. DistributedSampler) or each rank " \
                   "sees everything", False
        dataset = call_argument(call, "dataset", 0)
        if dataset is None:
            return "no dataset argument found: pass `sampler=distributed_sampler(dataset)` by hand", False
        shuffle = next((a for i, a in enumerate(a for a in call.args if a.keyword is None) if i == 2), None)
        if shuffle is not None:
            return "positional `shuffle`: pass `sampler=distributed_sampler(dataset)` by hand", False
        if isinstance(dataset, (cst.Name, cst.Attribute)):
            return None, False
        line = self.s.line(call)
        if isinstance(line, cst.SimpleStatementLine) and len(line.body) == 1 and \
                isinstance(self.s.block(line), (cst.Module, cst.IndentedBlock)):
            return None, True
        return "dataset built inline: assign it to a name and pass `sampler=distributed_sampler(dataset)`", False

    def no_sampler(self, call: cst.Call) -> bool:
        """`sampler=train_sampler` where `train_sampler` is None on every path (the ImageNet
        recipe's `train_sampler = None` kept for a distributed branch the script lacks): the
        loader has no sampler, and the argument makes way for the distributed one."""
        given = call_argument(call, "sampler", 3)
        if given is None or call_argument(call, "batch_sampler", 4) is not None:
            return False
        if isinstance(given, cst.Name) and given.value == "None":
            return True
        bindings = self.s.all_bindings(given.value, self.s.scope(given)) if isinstance(given, cst.Name) else []
        return bool(bindings) and all(b.how == "assign" and isinstance(b.value, cst.Name) and b.value.value == "None"
                                      for b in bindings)

    def _may_hold_sampler(self, kwargs: cst.BaseExpression) -> bool:
        """`**kwargs` is safe when every dict literal it is built from lacks these keys."""
        if not isinstance(kwargs, cst.Name):
            return True
        _, bindings = self.s.lookup(kwargs.value, self.s.scope(kwargs))
        values = [b.value for b in self.s.all_bindings(kwargs.value, self.s.scope(kwargs)) if b.how == "assign"]
        if not values:
            return True
        for value in values:
            dicts = [n for n in self.s.index.subtree(value) if isinstance(n, cst.Dict)]
            if not dicts:
                return True
            for d in dicts:
                keys = [e.key.evaluated_value if isinstance(e, cst.DictElement) and isinstance(e.key, cst.SimpleString)
                        else None for e in d.elements]
                if any(k is None or k in ("shuffle", "sampler", "batch_sampler") for k in keys):
                    return True
        return False

    def _eval_shardable(self, loader: Loader) -> bool:
        return self.why_whole(loader) is None

    def why_whole(self, loader: Loader) -> Optional[str]:
        """Why an evaluation loader cannot be sharded, or None: every loop over it must keep
        plain sums, run on every rank alike, and run under no_grad (with autograd on, each
        forward of a DDP model broadcasts buffers, a collective, and unequal shards would leave
        a rank waiting)."""
        from gpumigrate.codemods.memory import under_no_grad_after_migration  # a device-target fact

        loops = [c.node for c in loader.consumers if not c.trains]
        if not loops:
            return "it is never iterated where the migration can see"
        if any(not isinstance(l, cst.For) for l in loops):
            return "it is consumed with next(), not a for loop"
        for loop in loops:
            others = [other for other in self.model.loaders if other is not loader and other.role != "eval"
                      and any(c.node is loop for c in other.consumers)]
            if others:  # a count summed over ranks must count a sharded loader's samples only
                return "its loop also evaluates a loader that trains or is kept whole (`{}`)".format(
                    next((name for _, name, _ in others[0].holders), "another loader"))
            if self.metrics(loop) is None:
                return self._blockers.get(id(loop)) or "its loop keeps more than sums"
            if not self.uniform(loop):
                return "not every rank runs its loop equally often"
            if self._calls_wrapped(loop) and not under_no_grad_after_migration(self.ctx, loop):
                return "its loop runs the wrapped model with autograd on (no torch.no_grad())"
        return None

    def _calls_wrapped(self, node: cst.CSTNode, depth: int = 0) -> bool:
        """Does running `node` call a model this plan wraps (directly or through functions of
        this file)?"""
        for call in self.s.inside(node, cst.Call):
            if dotted(call.func) is not None and self.wrapped_reference(call.func):
                return True
            target = self.s.callee(call)
            if target is not None and depth < 4 and self._calls_wrapped(target.node, depth + 1):
                return True
        return False

    @cached_property
    def sharded_holders(self) -> List[Tuple[Loader, str, object]]:
        """(loader, name, scope) of every name holding a sharded training loader."""
        out = []
        for loader in self.model.loaders:
            edit = self.sharded(loader.call)
            if edit is None or edit.kind == "eval":
                continue
            for scope, name, stmt in loader.holders:
                if edit.kind == "flag" and not self._holder_trains(loader, stmt):
                    continue
                out.append((loader, name, scope))
        return out

    def _holder_trains(self, loader: Loader, source: cst.CSTNode) -> bool:
        """Is the factory call `source` one whose loader trains?"""
        for consumer in loader.consumers:
            if consumer.trains:
                for origin, via in self.model.origins(consumer.holder):
                    if via is source:
                        return True
        return False

    # -- per-rank sizes ------------------------------------------------------------------
    def _dataset_size(self, call: cst.Call) -> bool:
        """`len(train_set)` or `len(loader.dataset)` in arithmetic, where the set is a sharded
        training loader's."""
        if not (isinstance(call.func, cst.Name) and call.func.value == "len" and len(call.args) == 1):
            return False
        if not isinstance(self.s.parent(call), cst.BinaryOperation):
            return False
        arg = call.args[0].value
        sharded = {id(loader.call) for loader, _, _ in self.sharded_holders}
        if isinstance(arg, cst.Attribute) and arg.attr.value == "dataset" and dotted(arg.value):
            origins = self.model.origins(arg.value)
            return bool(origins) and all(id(o) in sharded for o, _ in origins) and self._trains_here(origins, arg.value)
        if dotted(arg) is None:
            return False
        for loader, _, _ in self.sharded_holders:
            dataset = call_argument(loader.call, "dataset", 0)
            if dataset is not None and dotted(dataset) == dotted(arg) and \
                    self.s.lookup(dotted(arg).split(".")[0], self.s.scope(call))[0] is \
                    self.s.lookup(dotted(arg).split(".")[0], self.s.scope(loader.call))[0]:
                return True
        return False

    def _trains_here(self, origins, holder: cst.BaseExpression) -> bool:
        """A flag factory's loader holds training data only where it was built for training."""
        for origin, via in origins:
            edit = self.sharded(origin)
            if edit is None or (edit.kind == "flag" and via is not None and not self._holder_trains(
                    next(l for l in self.model.loaders if l.call is origin), via)):
                return False
        return True

    def per_rank_size(self, call: cst.Call) -> bool:
        """An epoch size from the whole training set (`len(train_set) // batch`): this rank's
        share counts instead (`shard_length(train_set)`). A training sum divided by it is
        reduced over ranks instead (`training_sums`), and keeps the whole size."""
        return self._dataset_size(call) and id(call) not in self._divisors_of_sums

    # -- epochs --------------------------------------------------------------------------
    def set_epoch_points(self) -> Dict[int, List[str]]:
        """Loops (by id) at whose top `set_epoch(loader, epoch)` goes: the innermost loop around
        each consumption of a sharded training loader that does not itself iterate it, in the
        scope that holds the loader (following calls out of functions)."""
        out: Dict[int, List[str]] = {}
        for loader, name, scope in [*self.sharded_holders, *self._own_sampler_holders]:
            for consumer in loader.consumers:
                if not consumer.trains or not isinstance(consumer.node, cst.For):
                    continue
                for loop in self._loops_around(consumer.node, scope, consumer.node, 0):
                    if self._has_set_epoch(loop, name):
                        continue
                    names = out.setdefault(id(loop), [])
                    if name not in names:
                        names.append(name)
        return out

    @cached_property
    def _own_sampler_holders(self) -> List[Tuple[Loader, str, object]]:
        """Training loaders the script shards itself (its DistributedSampler, on the path
        torchrun takes): that sampler needs `set_epoch` as much as ours."""
        return [(loader, name, scope) for loader in self.model.loaders
                if getattr(self.loader_edits.get(id(loader.call)), "problem", None) == "already sharded"
                and self._own_samplers(loader.call) for scope, name, _ in loader.holders]

    def _loops_around(self, node: cst.CSTNode, scope, skip: cst.CSTNode, depth: int) -> List[cst.CSTNode]:
        for ancestor in self.s.ancestors(node):
            if isinstance(ancestor, (cst.For, cst.While)) and ancestor is not skip:
                return [ancestor] if self.s.scope(ancestor) is scope else []
            if isinstance(ancestor, (cst.FunctionDef, cst.Lambda)):
                break
        fn = self.s.function(node)
        if fn is None or depth > 5:
            return []
        return [loop for call in fn.callers for loop in self._loops_around(call, scope, skip, depth + 1)]

    def _has_set_epoch(self, loop: cst.CSTNode, name: str) -> bool:
        for call in self.s.inside(loop, cst.Call):
            if isinstance(call.func, (cst.Name, cst.Attribute)) and \
                    cst.Module(body=[]).code_for_node(call.func).endswith("set_epoch"):
                return True
        return False

    def rebuild_points(self) -> Dict[int, str]:
        """Lines `it = iter(loader)` of a sharded training loader consumed with `next()`:
        `set_epoch(loader)` goes before each, so every restart reshuffles."""
        out: Dict[int, str] = {}
        for loader, name, scope in self.sharded_holders:
            if not any(isinstance(c.node, cst.Call) and c.trains for c in loader.consumers):
                continue
            for node in self.s.index.order:
                if isinstance(node, cst.Call) and isinstance(node.func, cst.Name) and node.func.value == "iter" \
                        and node.args and dotted(node.args[0].value) == name and self.s.scope(node) is scope \
                        and not self._peeked(node):
                    line = self.s.line(node)
                    if line is not None and isinstance(line, cst.SimpleStatementLine) and \
                            not self._preceded_by_set_epoch(line):
                        out[id(line)] = name
        return out

    def _peeked(self, call: cst.Call) -> bool:
        """`next(iter(loader))` outside loops: one batch to look at, no iterator to restart."""
        parent = self.s.parent(self.s.parent(call))
        return isinstance(parent, cst.Call) and isinstance(parent.func, cst.Name) and parent.func.value == "next" \
            and not self.model.in_loop(call)

    def _epoch_bounded(self, line: cst.CSTNode, name: str) -> bool:
        """`for i in range(len(loader)): next(it)`: each pass is one (per-rank) epoch; or the
        loop that draws with `next()` is sharded by its counter (each rank takes 1/WORLD_SIZE
        of the iterations)."""
        render = self.ctx.module.code_for_node
        loops = self.s.inside(self.s.block(line) if self.s.block(line) is not None else line, cst.For)
        if any(f"len({name})" in render(loop.iter).replace(" ", "") for loop in loops):
            return True
        iterators = {dotted(t.target) for t in getattr(line.body[0], "targets", ())}  # `it = iter(loader)`
        return any(self.s.index.contains(loop, c.node) for loader in self.model.loaders for c in loader.consumers
                   if isinstance(c.node, cst.Call) and c.trains and dotted(c.holder) in iterators
                   for loop in self.counted_loops)

    def _preceded_by_set_epoch(self, line: cst.CSTNode) -> bool:
        block = self.s.block(line)
        body = list(block.body) if block is not None else []
        k = next((i for i, s in enumerate(body) if s is line), 0)
        return k > 0 and "set_epoch" in cst.Module(body=[]).code_for_node(body[k - 1])
