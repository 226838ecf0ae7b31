"""Where each training loop gets its data, sharded there: `for batch in shard_batches(...)`.

The construction-site edits of data.py (a sampler for a DataLoader call it can read, a loader
from elsewhere rebuilt where it is bound) need to recognise how the data was built; this
module needs only where a training loop iterates. For each optimizer step it walks out
through the loops around it (following the calls of this file that lead to it) and marks
one loop per nest, the one that brings the data, for the runtime's `shard_batches`, which
looks at what arrives when it runs (runtime/batches.py):

- a loop over data (a loader, a dataset, a list of batches, a generator) whose sharding no
  construction-site edit made: that loop's iterable, inside `enumerate`/`tqdm`/`zip`;
- a `for` over a `range` whose values index the data (`x[i:i + bs]`, `get_batch(data, i)`):
  its values dealt out in contiguous blocks (`indices=True`: batches that follow each other,
  as a carried hidden state expects, stay together);
- otherwise, where the data is made inside the loop (random draws, `next()` on a generator
  or an iterator, an environment's steps, a replay buffer's samples): the outermost `for`
  over a `range` that makes data itself (not only in loops inside it) and encloses the
  step. Where an environment is stepped, that loop (the episodes, the time steps) goes
  before any minibatch loop over what the rank collected. A counting range is strided alike
  on every rank;
- in a `while` loop a step counter ends (`while step < max_steps:`, `it += 1` and `if it >=
  max_iters: break`), the counter's increment: it counts WORLD_SIZE steps per iteration
  (`it = next_step(it)`), whatever else shards the data;
- never a loop outside one that builds the optimizer (a run repeated per seed), never an
  epoch loop around a loop already sharded, never two loops of one nest.

Decides `batch_sites` (what to wrap) and `counted_loops` (loops whose steps the data no longer
bounds: the models they train are reached as `unsharded_data` says).

Relies on, from DdpPlan (ddp_plan.py) and its other mixins: `self.model`, `self.s`,
`self.active`; `self.shard_training`, `self.sharded`, `self.loader_edits`,
`self.phase_loops`, `self.fixed_rows`, `self.foreign_loaders`, `self.foreign_iterations`,
`self.foreign_params` (data.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Dict, Iterator, List, Optional, Set

import libcst as cst

from gpumigrate.analysis import values as v
from gpumigrate.analysis.structure import dotted
from gpumigrate.analysis.syntax import last_name, runtime_helper


@dataclass
class BatchSite:
    """One expression a training loop takes its data from, to be wrapped in `shard_batches`."""

    loop: cst.CSTNode  # the For whose data it is
    expr: cst.BaseExpression  # the original expression to wrap
    # "data", "counter" (a range around data made in the loop), "iterator" (iter(x) that next()
    # draws from), "step" (`x += 1` of the step counter that ends a `while` loop)
    kind: str
    indices: bool = False  # a range whose values index the data: dealt out in blocks


# torch's (and numpy's, Python's) random draws: data made where the loop runs
_RANDOM_TORCH = frozenset({"rand", "randn", "randint", "randperm", "normal", "bernoulli", "multinomial", "poisson",
                           "rand_like", "randn_like", "randint_like"})
_RANDOM_METHODS = frozenset({"normal_", "uniform_", "random_", "bernoulli_", "exponential_", "sample", "rsample",
                             "sample_n"})
_NOT_DATA_KINDS = frozenset({v.MODULE, v.LOSS_MODULE, v.OPTIMIZER, v.OPTIMIZER_CLASS, v.SCHEDULER, v.SCALER, v.PARAMS,
                             v.STRING, v.NUMBER, v.DEVICE, v.WRITER, v.METRIC, v.CLASS, v.FUNCTION, v.PYMODULE,
                             v.PARAM, v.LOSS, v.SCALAR})
_DATA_KINDS = frozenset({v.LOADER, v.DATASET, v.ITERATOR, v.BATCH, v.TENSOR})
_DATA_NAME = re.compile(r"load|data|batch|set$|sample|train|iter|(^|_)gen|gen($|_)|^dl|_dl$|example|pair|feed|stream"
                        r"|split|chunk", re.I)
_NOT_DATA_METHODS = frozenset({"items", "keys", "values", "parameters", "named_parameters", "modules", "children",
                               "named_modules", "named_children", "buffers", "named_buffers", "state_dict"})
_WRAPPERS = frozenset({"enumerate", "tqdm", "islice", "iter"})
# a replay buffer or rollout storage filled by the loops around (the rank's own data)
_FILLS = frozenset({"append", "extend", "put", "push", "add", "insert", "store", "remember", "add_experience",
                    "put_data", "push_back", "record"})
_MAX_NESTS = 16
# functions that make data by their name (a project's or a library's: `get_batch`, `make_moons`)
_DATA_FUNCTION = re.compile(r"batch|sample|rollout|episode|^make_(moons|circles|blobs|swiss|classification|regression|"
                            r"data)|^(get|gen|generate|load|draw|fetch|create|next)_?(data|example|input|point|sequence)",
                            re.I)
# what `from random import *` (or numpy's) brings, called bare
_STAR_RANDOM = frozenset({"randrange", "randint", "shuffle", "choice", "choices", "sample", "uniform", "gauss",
                          "random", "rand", "randn", "normal", "permutation"})


class TrainingLoops:
    """Where training loops are sharded at the iteration site (a mixin of DdpPlan)."""

    @cached_property
    def batch_sites(self) -> Dict[int, BatchSite]:
        """id(original expression) -> its site, for every training loop nest this file shards
        where it iterates."""
        if not (self.active and self.shard_training):
            return {}
        out: Dict[int, BatchSite] = {}
        steps = self._driver_steps() if self.driver else list(self.model.step_calls) or list(self.model.backward_calls)
        seen: Set[tuple] = set()
        for step in steps:
            for nest in self._nests(step):
                key = tuple(id(loop) for loop in nest)
                if key in seen or self._repeated_by_a_script(nest):
                    continue
                seen.add(key)
                for site in self._sites(nest):
                    out.setdefault(id(site.expr), site)
        return out

    def _repeated_by_a_script(self, nest: List[cst.CSTNode]) -> bool:
        """A nest of counting loops in an update over data the object holds (`def train(self):
        for _ in range(self.K_epochs): ...`, PPO's epochs over its rollout) that a script of
        the run calls inside a loop of its own (the episodes that collect the rollout): the
        script's loop is the training loop, sharded there (its `steps`, project.py); sharding
        here too would split the work twice, or cut the epochs of the update."""
        if not nest or not all(self._counting(loop) for loop in nest):
            return False
        fn = self.s.function(nest[-1])
        if fn is None or not isinstance(fn.node, cst.FunctionDef) or fn.callers:
            return False
        name = fn.node.name.value
        if not any(link.in_run and name in link.looped and name in link.calls for link in self.drivers):
            return False
        for node in self.s.index.subtree(fn.node):
            if isinstance(node, (cst.Yield, cst.Await)):
                return False
            if isinstance(node, cst.Call) and (isinstance(node.func, cst.Name) and node.func.value == "next" or
                                               isinstance(node.func, cst.Attribute) and node.args and
                                               node.func.attr.value in ("step", "reset")):
                return False
        return True

    def _driver_steps(self) -> List[cst.Call]:
        """In a script that trains through a module of its project: its calls that take one
        training step there (`model.optimize_D(gen)`, on an object of a class of that module,
        a method that calls `.backward()` outside any loop of its own). A call that runs a
        whole training loop (`agent.train(env)`) is none: the module shards its own loop."""
        steps: List[cst.Call] = []
        for call in self.s.index.of(cst.Call):
            func = call.func
            if not (isinstance(func, cst.Attribute) and isinstance(func.value, cst.Name)):
                continue
            _, bindings = self.s.lookup(func.value.value, self.s.scope(call), self.s.order(call))
            made = {b.value.func.value for b in bindings if b.how == "assign" and isinstance(b.value, cst.Call)
                    and isinstance(b.value.func, cst.Name)}
            if any(made & set(link.defines) and func.attr.value in link.steps for link in self.trained_in):
                steps.append(call)
        return steps

    @cached_property
    def counted_loops(self) -> List[cst.CSTNode]:
        """Loops sharded by their counter (no loader brings their data), also where an
        earlier run did it (`shard_batches(range(...))`)."""
        found = [s.loop for s in self.batch_sites.values() if s.kind == "counter"]
        for loop in self.s.index.of(cst.For):
            for call in self._runtime_calls(loop.iter, "shard_batches"):
                if call.args and self._counter(call.args[0].value) and loop not in found:
                    found.append(loop)
        return found

    def iterated_sharded(self, call: cst.Call) -> bool:
        """Is every training pass over this DataLoader call sharded where it iterates (so what
        data.py could not edit at its construction needs no hand)?"""
        loader = self.model.loader_of(call)
        if loader is None:
            return False
        loops = {id(s.loop) for s in self.batch_sites.values() if s.kind == "data"}
        drawn = {id(s.loop) for s in self.batch_sites.values() if s.kind == "iterator"}
        training = [c for c in loader.consumers if c.trains and not c.peek]
        return bool(training) and all(
            id(c.node) in loops or any(id(a) in drawn for a in self.s.ancestors(c.node)) for c in training)

    def batch_reviews(self) -> List[tuple]:
        """What a reviewer must check where loops are sharded as they iterate."""
        out = []
        for site in self.batch_sites.values():
            code = " ".join(self.ctx.module.code_for_node(site.expr).split())
            if site.kind == "data" and isinstance(site.expr, (cst.Name, cst.Attribute)) and any(
                    isinstance(c.func, cst.Name) and c.func.value == "len" and len(c.args) == 1
                    and dotted(c.args[0].value) == dotted(site.expr) for c in self.s.index.of(cst.Call)):
                out.append((site.expr, f"`len({code})` still counts all of it, while each rank now takes "
                                       f"1/WORLD_SIZE: a number of steps or a schedule computed from it lasts "
                                       "WORLD_SIZE times longer"))
            if site.kind == "counter" and not site.indices:
                name = self._counter_target(site.loop)
                tests = [t for t in self.s.inside(site.loop.body, (cst.If, cst.While, cst.IfExp))
                         if name and any(isinstance(n, cst.Name) and n.value == name
                                         for n in self.s.index.subtree(t.test))]
                if tests:
                    out.append((tests[0], f"`{name}` now advances by WORLD_SIZE per iteration (every rank takes "
                                          f"every WORLD_SIZE-th value of `{code}`, ending on its last): check tests "
                                          "of an exact value or of a multiple WORLD_SIZE does not divide; a schedule "
                                          "stepped once per iteration advances 1/WORLD_SIZE as far"))
        return out

    @cached_property
    def environment_seeds(self) -> Dict[int, cst.BaseExpression]:
        """id(seed argument) -> it, of `env.seed(s)`, `env.reset(seed=s)` and
        `env.action_space.seed(s)` of the environments training steps, where some training
        loop is sharded by its counter: every rank would play the same episodes; each gets its
        own (`rank_seed(s)`; an earlier run's `s + get_rank()` is left)."""
        if not self.counted_loops and not any(s.kind == "step" for s in self.batch_sites.values()) and \
                not self._runtime_calls(self.ctx.module, "next_step"):
            return {}
        envs = {dotted(c.func.value) for c in self.s.index.of(cst.Call) if self._environment(c)} - {None}
        out: Dict[int, cst.BaseExpression] = {}
        for call in self.s.index.of(cst.Call):
            func = call.func
            if not isinstance(func, cst.Attribute) or func.attr.value not in ("seed", "reset"):
                continue
            owner = dotted(func.value) or ""
            if owner not in envs and not (owner.endswith((".action_space", ".observation_space"))
                                          and owner.rsplit(".", 1)[0] in envs):
                continue
            arg = next((a.value for a in call.args if a.keyword is not None and a.keyword.value == "seed"), None)
            if arg is None and func.attr.value == "seed" and call.args and call.args[0].keyword is None:
                arg = call.args[0].value
            if arg is None or (isinstance(arg, cst.Name) and arg.value == "None") or \
                    self._runtime_calls(arg, "get_rank", "rank_seed") or \
                    self._names_read(arg) & self._rank_counters(call):
                continue
            out[id(arg)] = arg
        return out

    def _rank_counters(self, node: cst.CSTNode) -> Set[str]:
        """Names that already differ per rank where `node` runs: the counter of a sharded loop
        around it (each rank takes its own values: `env.reset(seed=seed + episode)` needs no
        rank added, which would repeat another rank's seeds), and names bound in that loop from it."""
        names: Set[str] = set()
        for loop in self.s.ancestors(node):
            if isinstance(loop, cst.For) and loop in self.counted_loops:
                counter = self._counter_target(loop)
            elif isinstance(loop, cst.While):
                site = next((s for s in self.batch_sites.values() if s.kind == "step" and s.loop is loop), None)
                counter = dotted(site.expr.target) if site is not None and isinstance(site.expr, cst.AugAssign) \
                    else None
            else:
                continue
            if not counter:
                continue
            names.add(counter)
            for assign in self.s.inside(loop.body, cst.Assign):
                if counter in self._names_read(assign.value):
                    names.update(dotted(t.target) for t in assign.targets if dotted(t.target))
        return names

    # -- the loops around a step ---------------------------------------------------------
    def _nests(self, node: cst.CSTNode) -> List[List[cst.CSTNode]]:
        """The loops around `node`, innermost first, through the calls of this file that reach
        it: one list per chain of callers; each ends before a loop that builds an optimizer."""
        out: List[List[cst.CSTNode]] = []
        self._walk_out(node, [], out, 0)
        return out[:_MAX_NESTS]

    def _walk_out(self, node: cst.CSTNode, inner: List[cst.CSTNode], out: List[List[cst.CSTNode]], depth: int) -> None:
        loops: List[cst.CSTNode] = []
        for ancestor in self.s.ancestors(node):
            if isinstance(ancestor, (cst.FunctionDef, cst.Lambda, cst.ClassDef)):
                break
            if isinstance(ancestor, (cst.For, cst.While)) and self.s.index.contains(ancestor.body, node):
                if self._builds_optimizer(ancestor):
                    out.append(inner + loops)
                    return
                loops.append(ancestor)
        chain = inner + loops
        fn = self.s.function(node)
        callers = [c for c in (fn.callers if fn is not None else []) if not self.s.index.contains(fn.node, c)]
        if not callers or depth >= 4 or len(out) >= _MAX_NESTS:
            out.append(chain)
            return
        for call in callers:
            self._walk_out(call, chain, out, depth + 1)

    def _builds_optimizer(self, loop: cst.CSTNode) -> bool:
        """A loop whose body builds an optimizer: a run repeated (seeds, folds, settings), not data."""
        return any(self.s.index.contains(loop.body, o.site) for o in self.model.optimizers)

    # -- one nest ------------------------------------------------------------------------
    def _sites(self, nest: List[cst.CSTNode]) -> List[BatchSite]:
        covered = next((k for k, loop in enumerate(nest) if self._covered(loop)), None)
        if covered is not None:  # sharded already; a step counter that ends a loop around it still counts
            return self._step_counter_sites(nest[covered + 1:], [])
        data_at = next((k for k, loop in enumerate(nest) if self._data_sources(loop, nest[k + 1:])), None)
        outer = nest[data_at + 1:] if data_at is not None else nest
        episodes = [loop for loop in outer if self._counting(loop) and self._steps_environment(loop)]
        if episodes:
            return self._counter_sites(episodes[-1], nest)
        if data_at is not None:
            loop = nest[data_at]
            sites = [BatchSite(loop, expr, "data") for expr in self._data_sources(loop, nest[data_at + 1:])]
            return self._step_counter_sites(nest[data_at + 1:], sites)
        indexing = next((loop for loop in nest if self._counting(loop) and self._indexes_data(loop)), None)
        if indexing is not None:  # `for i in range(0, len(x), bs): x[i:i + bs]`: a loop over data too
            return self._counter_sites(indexing, nest)
        making = [loop for loop in nest if self._counting(loop) and self._makes_data(loop)]
        if making:
            return self._counter_sites(making[-1], nest)
        return self._step_counter_sites(nest, [])

    def _step_counter_sites(self, outer: List[cst.CSTNode], sites: List[BatchSite]) -> List[BatchSite]:
        """A `while` loop among `outer` that a step counter ends (`while step < max_steps:`,
        `it += 1` then `if it >= max_iters: break`): the counter counts WORLD_SIZE steps per
        iteration (`it = next_step(it)`), so the ranks together take the script's steps once;
        and, where nothing else shards the data, the loaders its `next()` draws from."""
        for loop in outer:
            if not isinstance(loop, cst.While):
                continue
            increment = self._step_counter(loop)
            if increment is None:
                continue
            out = [*sites, BatchSite(loop, increment, "step")]
            if not sites:
                out += [BatchSite(loop, call.args[0].value, "iterator") for call in self._drawn_iterators(loop)]
            return out
        return sites

    def _step_counter(self, loop: cst.While) -> Optional[cst.AugAssign]:
        """The one `x += 1` in the loop whose `x` its test reads, or a test that leaves it reads
        (an `if` around a `break`, a `return`, or a flag the loop's test reads)."""
        increments: Dict[str, List[cst.AugAssign]] = {}
        for node in self.s.own(loop.body, cst.AugAssign):
            if isinstance(node.operator, cst.AddAssign) and isinstance(node.value, cst.Integer) and \
                    node.value.value == "1" and dotted(node.target):
                increments.setdefault(dotted(node.target), []).append(node)
        flags = {n.value for n in self.s.index.subtree(loop.test) if isinstance(n, cst.Name)}
        for name, found in increments.items():
            if len(found) != 1:
                continue
            if name in self._names_read(loop.test):
                return found[0]
            for branch in self.s.own(loop.body, cst.If):
                if name not in self._names_read(branch.test):
                    continue
                leaves = self.s.inside(branch.body, (cst.Break, cst.Return)) or any(
                    isinstance(t.target, cst.Name) and t.target.value in flags
                    for t in self.s.inside(branch.body, cst.AssignTarget))
                if leaves:
                    return found[0]
        return None

    def _names_read(self, node: cst.CSTNode) -> Set[str]:
        return {dotted(n) for n in self.s.index.subtree(node) if isinstance(n, (cst.Name, cst.Attribute))} - {None}

    def _counter_sites(self, loop: cst.For, nest: List[cst.CSTNode]) -> List[BatchSite]:
        """The counting loop, and the loaders its `next()` draws from (each rank its shard)."""
        if self._rebuilds_on_counter(loop):
            return []  # `if it % epoch_size == 0: it_ = iter(loader)`: a strided counter would miss it
        counter: cst.BaseExpression = self._counter(loop.iter)
        if not self.s.index.contains(loop.iter, counter):  # a bar bound before the loop: the loop's name of it
            counter = self._sources(loop.iter)[0]
        sites = [BatchSite(loop, counter, "counter", indices=self._indexes_data(loop))]
        for call in self._drawn_iterators(loop):
            sites.append(BatchSite(loop, call.args[0].value, "iterator"))
        return sites

    def _covered(self, loop: cst.CSTNode) -> bool:
        """A loop whose data a construction-site edit shards (or an earlier run did)."""
        if id(loop) in self.phase_loops or any(rows.loop is loop for rows in self.fixed_rows):
            return True
        if not isinstance(loop, cst.For):
            return False
        if self._runtime_calls(loop.iter, "shard_batches", "shard_loader", "shard_rows"):
            return True
        for expr in self._sources(loop.iter):
            if any(isinstance(e, cst.Call) and runtime_helper(self.model.qualify(e.func)) in (
                    "shard_batches", "shard_loader") for e in self._unbound(expr)):
                return True  # a bar bound to a name, over a loader an earlier run sharded
            if id(expr) in self.foreign_iterations:
                return True
            for loader in self.model.loaders:
                if any(c.node is loop for c in loader.consumers):
                    edit = self.loader_edits.get(id(loader.call))
                    if edit is not None and (edit.problem is None or edit.problem == "already sharded"):
                        return True
            if self._foreign_holder(expr) or self._bound_sharded(expr):
                return True
        return False

    def _bound_sharded(self, expr: cst.BaseExpression) -> bool:
        """A name bound to a loader sharded already: rebuilt by the runtime (an earlier run), or
        given a distributed sampler by the script or an earlier run."""
        if not isinstance(expr, (cst.Name, cst.Attribute)):
            return False
        if isinstance(expr, cst.Name):  # `loader = shard_loader(loader)` first thing in a function (data.py's)
            stmt = self.s.statement(expr)
            _, reaching = self.s.lookup(expr.value, self.s.scope(expr), self.s.order(stmt) if stmt is not None else -1)
            if reaching and all(b.how == "assign" and isinstance(b.value, cst.Call) and runtime_helper(
                    self.model.qualify(b.value.func)) in ("shard_loader", "shard_batches") for b in reaching):
                return True
        values = self.model._bound_values(expr)
        for value in values:
            if not isinstance(value, cst.Call):
                return False
            if runtime_helper(self.model.qualify(value.func)) in ("shard_loader", "shard_batches"):
                continue
            if self.model.qualify(value.func) in v.DATALOADER and (self._already_sharded(value) or
                                                                   self._own_samplers(value)):
                continue
            return False
        return bool(values)

    def _foreign_holder(self, expr: cst.BaseExpression) -> bool:
        """A name bound to a loader that data.py rebuilds where it is bound or handed in."""
        if isinstance(expr, cst.Name):
            fn = self.s.function(expr)
            if fn is not None and expr.value in self.foreign_params.get(id(fn.node), ()):
                return True
        if not isinstance(expr, (cst.Name, cst.Attribute)) or not self.foreign_loaders:
            return False
        values = self.model._bound_values(expr)
        return bool(values) and all(any(value is f for f in self.foreign_loaders) for value in values)

    # -- data loops ----------------------------------------------------------------------
    def _sources(self, it: cst.BaseExpression) -> List[cst.BaseExpression]:
        """What a loop takes items from, inside `enumerate`/`tqdm`/`zip`/`islice`."""
        out: List[cst.BaseExpression] = []
        stack = [it]
        while stack:
            e = stack.pop()
            if isinstance(e, cst.Call) and isinstance(e.func, (cst.Name, cst.Attribute)) and e.args:
                name = e.func.value if isinstance(e.func, cst.Name) else e.func.attr.value
                if name == "zip":
                    stack.extend(reversed([a.value for a in e.args if not a.star]))
                    continue
                if name in _WRAPPERS and not e.args[0].star and e.args[0].keyword is None:
                    stack.append(e.args[0].value)
                    continue
            out.append(e)
        return out

    def _data_sources(self, loop: cst.CSTNode, outer: List[cst.CSTNode]) -> List[cst.BaseExpression]:
        """The data a `for` loop iterates (empty where it iterates no data)."""
        if not isinstance(loop, cst.For):
            return []
        sources = [inner for e in self._sources(loop.iter) for inner in self._unbound(e)]
        if not any(self._is_data(e, outer) for e in sources) or self._iterates_learners(loop):
            return []
        # zip(batches, targets): every iterable of the zip alike, so their items stay paired
        return [e for e in sources if self._counter(e) is None]

    def _unbound(self, expr: cst.BaseExpression) -> List[cst.BaseExpression]:
        """What a name bound to a wrapper takes items from (`data_stream = tqdm(enumerate(loader))`,
        then `for i, (x, y) in data_stream`): the loader, sharded there, so a bar over an
        `enumerate` (which hides the loader from the runtime) still counts this rank's batches."""
        if isinstance(expr, cst.Name):
            stmt = self.s.statement(expr)
            _, reaching = self.s.lookup(expr.value, self.s.scope(expr), self.s.order(stmt) if stmt is not None else -1)
            if len(reaching) == 1 and reaching[0].how == "assign" and isinstance(reaching[0].value, cst.Call) and \
                    last_name(reaching[0].value.func) in _WRAPPERS and self._counter(reaching[0].value) is None:
                sources = self._sources(reaching[0].value)
                if sources != [reaching[0].value]:
                    return sources
        return [expr]

    def _iterates_learners(self, loop: cst.For) -> bool:
        """`for i, agent in enumerate(agents): ... agent.step(...)`: the items are what trains
        (each with its own optimizer), not batches: every rank trains each of them."""
        names = {n.value for n in self.s.index.subtree(loop.target) if isinstance(n, cst.Name)}
        return any(isinstance(c.func, cst.Attribute) and isinstance(c.func.value, cst.Name)
                   and c.func.value.value in names
                   and any(self.model.function_trains(t) for t in self.s.callees(c))
                   for c in self.s.inside(loop.body, cst.Call))

    def _is_data(self, expr: cst.BaseExpression, outer: List[cst.CSTNode]) -> bool:
        if self._counter(expr) is not None or isinstance(expr, (cst.List, cst.Tuple, cst.Set, cst.Dict, cst.ListComp,
                                                                  cst.SimpleString, cst.Integer)):
            return False
        if isinstance(expr, cst.Call):
            func = expr.func
            method = func.attr.value if isinstance(func, cst.Attribute) else None
            if method in _NOT_DATA_METHODS or (self.model.qualify(func) or "").startswith(("os.", "glob.", "range")):
                return False
        kind = self.model.kind(expr)
        if kind in _NOT_DATA_KINDS:
            return False
        if self._filled_in(expr, outer):
            return False
        if kind in _DATA_KINDS:
            return True
        name = dotted(expr.func if isinstance(expr, cst.Call) else expr) or ""
        return bool(_DATA_NAME.search(name.rsplit(".", 1)[-1]))

    def _filled_in(self, expr: cst.BaseExpression, outer: List[cst.CSTNode]) -> bool:
        """Data the loops around fill (`memory.push(...)`, `self.data.append(...)`): the rank's own."""
        roots = {n for n in (dotted(e) for e in self.s.index.subtree(expr) if isinstance(e, (cst.Name, cst.Attribute)))
                 if n and n not in ("self",)}
        for loop in outer:
            for call in self.s.inside(loop, cst.Call):
                func = call.func
                if isinstance(func, cst.Attribute) and func.attr.value in _FILLS and dotted(func.value) in roots:
                    return True
        return False

    # -- counting loops ------------------------------------------------------------------
    def _counter(self, it: cst.BaseExpression, depth: int = 0) -> Optional[cst.Call]:
        """The `range(...)` (or `trange(...)`) a loop counts with, inside enumerate/tqdm, also
        through the one name bound to it (`with trange(n) as pbar: for step in pbar:`)."""
        for e in self._sources(it) if isinstance(it, cst.Call) else [it]:
            if isinstance(e, cst.Name) and depth == 0:
                stmt = self.s.statement(e)
                _, reaching = self.s.lookup(e.value, self.s.scope(e), self.s.order(stmt) if stmt is not None else -1)
                if len(reaching) == 1 and reaching[0].how in ("assign", "with") and \
                        isinstance(reaching[0].value, cst.Call):
                    return self._counter(reaching[0].value, depth + 1)
            if isinstance(e, cst.Call) and isinstance(e.func, (cst.Name, cst.Attribute)):
                name = e.func.value if isinstance(e.func, cst.Name) else e.func.attr.value
                if name in ("range", "trange", "xrange") and e.args:
                    return e
        return None

    def _counting(self, loop: cst.CSTNode) -> bool:
        return isinstance(loop, cst.For) and self._counter(loop.iter) is not None and \
            len(self._sources(loop.iter)) == 1

    def _direct_calls(self, loop: cst.For, depth: int = 0) -> Iterator[cst.Call]:
        """The calls a loop makes itself (in `while` loops and branches too), not in `for` loops
        inside it; through the functions of this file it calls, to a depth of two."""
        for node in self._own_nodes(loop.body):
            if isinstance(node, cst.Call):
                yield node
                target = self.s.callee(node)
                if target is not None and depth < 2 and isinstance(target.node, cst.FunctionDef):
                    yield from self._direct_calls_of(target.node.body, depth + 1)

    def _direct_calls_of(self, body: cst.CSTNode, depth: int) -> Iterator[cst.Call]:
        """A called function's calls: all of them, but in its loops that train (those loops
        are part of the nest, inside the loop asked about)."""
        for node in self._own_nodes(body, keep=lambda loop: not self.model.trains(loop.body)):
            if isinstance(node, cst.Call):
                yield node
                target = self.s.callee(node)
                if target is not None and depth < 2 and isinstance(target.node, cst.FunctionDef):
                    yield from self._direct_calls_of(target.node.body, depth + 1)

    def _own_nodes(self, root: cst.CSTNode, keep=None) -> Iterator[cst.CSTNode]:
        """Nodes under `root`, skipping nested `for` loops (but those `keep` says), functions,
        lambdas and classes."""
        nodes = self.s.index.subtree(root)
        end = -1
        for i, node in enumerate(nodes):
            if i < end:
                continue
            if isinstance(node, cst.For) and keep is not None and keep(node):
                continue
            if isinstance(node, (cst.For, cst.FunctionDef, cst.Lambda, cst.ClassDef)) and node is not root:
                end = i + len(self.s.index.subtree(node))
                continue
            yield node

    def _makes_data(self, loop: cst.For) -> bool:
        return any(self._making(call) for call in self._direct_calls(loop))

    def _steps_environment(self, loop: cst.For) -> bool:
        return any(self._environment(call) for call in self._direct_calls(loop))

    def _making(self, call: cst.Call) -> bool:
        """A call that makes training data where it runs."""
        func = call.func
        if isinstance(func, cst.Name) and func.value == "next":
            return True
        # a name from a star import is not qualified: its spelling says enough here
        qualified = self.model.qualify(func) or (dotted(func) or "").replace("np.random.", "numpy.random.")
        if qualified.startswith(("numpy.random.", "random.")) or \
                (qualified.startswith("torch.") and qualified.rsplit(".", 1)[-1] in _RANDOM_TORCH):
            return True
        if isinstance(func, cst.Attribute) and func.attr.value in _RANDOM_METHODS:
            return True
        if self._environment(call):
            return True
        name = func.value if isinstance(func, cst.Name) else func.attr.value if isinstance(func, cst.Attribute) else ""
        target = self.s.callee(call)
        if target is None and not qualified and name in _STAR_RANDOM:
            return True  # `from random import *`: `randrange(...)`
        if _DATA_FUNCTION.search(name) and self.model.kind(func) not in (v.MODULE, v.LOSS_MODULE):
            return True  # `get_batch(...)`, `make_circles(...)`, `sample_episode(...)`: data made per call
        if self._generator(target):
            return True
        # `model.optimize_D(real_dist_gen=gen)`: a step handed the generator it draws its batch from
        return any(isinstance(arg.value, cst.Name) and self._a_generator(arg.value) for arg in call.args)

    def _generator(self, target: Any) -> bool:
        """Is the callee `target` a generator function of this file (`def batches(): ... yield`)?"""
        return target is not None and isinstance(target.node, cst.FunctionDef) and \
            bool(self.s.own(target.node, (cst.Yield,)))

    def _a_generator(self, name: cst.Name) -> bool:
        """A name bound to what a generator function of this file returns (or to `iter(...)`
        of one): an endless source of batches, drawn by whoever is handed it."""
        _, bindings = self.s.lookup(name.value, self.s.scope(name), self.s.order(name))
        for b in bindings:
            value = b.value if b.how == "assign" else None
            if not isinstance(value, cst.Call):
                continue
            if isinstance(value.func, cst.Name) and value.func.value == "iter" and value.args and \
                    isinstance(value.args[0].value, cst.Call):
                value = value.args[0].value
            if self._generator(self.s.callee(value)):
                return True
        return False

    def _environment(self, call: cst.Call) -> bool:
        """`env.step(action)` or `env.reset()` of an environment (not an optimizer, a scheduler,
        a scaler or a meter)."""
        func = call.func
        if not isinstance(func, cst.Attribute) or func.attr.value not in ("step", "reset"):
            return False
        if func.attr.value == "step" and not call.args:
            return False
        receiver = (dotted(func.value) or "").lower()
        if re.search(r"optim|sched|scaler|meter|timer|bar|writer|logger|metric", receiver):
            return False
        return self.model.kind(func.value) not in (v.OPTIMIZER, v.SCHEDULER, v.SCALER, v.METRIC, v.MODULE,
                                                   v.LOSS_MODULE, v.WRITER)

    def _indexes_data(self, loop: cst.For) -> bool:
        """Does the loop's counter index data (`x[i:i + bs]`, `get_batch(source, i)`)?"""
        names = {n.value for n in self.s.index.subtree(loop.target) if isinstance(n, cst.Name)}
        counted = self._counter_target(loop)
        if counted:
            names = {counted}
        return self._used_as_index(loop.body, names, 0)

    def _counter_target(self, loop: cst.For) -> Optional[str]:
        """The name the range's values are bound to (`i` in `for batch, i in enumerate(range(...))`)."""
        it, target = loop.iter, loop.target
        if isinstance(it, cst.Call) and isinstance(it.func, cst.Name) and it.func.value == "enumerate" and \
                isinstance(target, cst.Tuple) and len(target.elements) == 2:
            second = target.elements[1].value
            return second.value if isinstance(second, cst.Name) else None
        return target.value if isinstance(target, cst.Name) else None

    def _used_as_index(self, body: cst.CSTNode, names: Set[str], depth: int) -> bool:
        for node in self.s.index.subtree(body):
            if isinstance(node, cst.SubscriptElement) and any(
                    isinstance(n, cst.Name) and n.value in names for n in self.s.index.subtree(node)):
                return True
            if isinstance(node, cst.Call) and depth < 2:
                target = self.s.callee(node)
                if target is None or not isinstance(target.node, cst.FunctionDef):
                    continue
                passed = set()
                for k, arg in enumerate(node.args):
                    if isinstance(arg.value, cst.Name) and arg.value.value in names and not arg.star:
                        params = target.param_names()
                        offset = 1 if target.cls is not None and params[:1] == ["self"] else 0
                        name = arg.keyword.value if arg.keyword is not None else (
                            params[k + offset] if k + offset < len(params) else None)
                        if name:
                            passed.add(name)
                if passed and self._used_as_index(target.node.body, passed, depth + 1):
                    return True
        return False

    def _rebuilds_on_counter(self, loop: cst.For) -> bool:
        """`if it % epoch_size == 0: batch_iterator = iter(loader)`: a test on the counter that
        restarts the data: with the counter strided, the test could miss the end of the data."""
        name = self._counter_target(loop)
        if name is None:
            return False
        for branch in self.s.inside(loop.body, cst.If):
            reads = any(isinstance(n, cst.Name) and n.value == name for n in self.s.index.subtree(branch.test))
            if reads and any(isinstance(c.func, cst.Name) and c.func.value == "iter"
                             for c in self.s.inside(branch.body, cst.Call)):
                return True
        return False

    def _drawn_iterators(self, loop: cst.For) -> List[cst.Call]:
        """`iter(loader)` calls whose iterator `next()` draws from in the loop, where the
        loader is a DataLoader no construction-site edit shards (each rank draws its shard)."""
        out: List[cst.Call] = []
        for call in self.s.inside(loop, cst.Call):
            if not (isinstance(call.func, cst.Name) and call.func.value == "next" and call.args
                    and isinstance(call.args[0].value, (cst.Name, cst.Attribute))):
                continue
            holder = call.args[0].value
            scope = self.s.scope(holder)
            bindings = self.s.all_bindings(holder.value, scope) if isinstance(holder, cst.Name) else \
                (getattr(self.s.instance_class(holder.value, scope), "attrs", {}) or {}).get(holder.attr.value, [])
            for b in bindings:
                value = b.value
                if b.how == "assign" and isinstance(value, cst.Call) and isinstance(value.func, cst.Name) and \
                        value.func.value == "iter" and len(value.args) == 1 and value not in out:
                    inner = value.args[0].value
                    if self.model.kind(inner) in (v.LOADER, v.UNKNOWN, v.OBJECT) and not self._sharded_loader(inner) \
                            and not self._runtime_calls(value, "shard_batches", "shard_loader"):
                        out.append(value)
        return out

    def _sharded_loader(self, expr: cst.BaseExpression) -> bool:
        """A loader a construction-site edit gives a sampler, or rebuilds."""
        origins = self.model.origins(expr) if isinstance(expr, (cst.Name, cst.Attribute)) else []
        if origins and all(self.sharded(o) is not None for o, _ in origins):
            return True
        callee = self.s.callee(expr) if isinstance(expr, cst.Call) else None
        if callee is not None and self.model._generator(callee):  # `iter(sample_data(...))`: loaders it makes
            made = [c for c in self.s.inside(callee.node.body, cst.Call) if self.model.qualify(c.func) in v.DATALOADER]
            if made and all(self.sharded(c) is not None for c in made):
                return True
        return self._foreign_holder(expr) or id(expr) in self.foreign_iterations

    def _runtime_calls(self, node: cst.CSTNode, *names: str) -> List[cst.Call]:
        return [c for c in self.s.inside(node, cst.Call) if runtime_helper(self.model.qualify(c.func)) in names]
