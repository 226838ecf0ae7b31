"""What to reduce: the sums that ranks add up over their own shards, all-reduced right after
the loop that accumulates them, so the numbers the script prints are the whole set's.

Decides:
- `metrics`: the sums an evaluation loop keeps (`+=` into numbers or zero tensors bound before
  it), if they are all it keeps; why not, in `_blockers`, for the review;
- `reductions`: evaluation loops over sharded loaders -> their sums;
- `training_sums`: training loops -> running sums the script only divides by the whole
  training set's size after the loop;
- `reduce_after`: both, by loop.

Relies on, from DdpPlan (ddp_plan.py) and its other mixins:
- `self.ctx`, `self.model`, `self.s` (ddp_plan.py);
- `self.shard_training`, `self.sharded`, `self._dataset_size` (data.py);
- `self.uniform` (reach.py): a training sum is reduced only where every rank runs its loop.
"""

from __future__ import annotations

from functools import cached_property
from typing import Dict, List, Optional, Set, Tuple

import libcst as cst

from gpumigrate.analysis.structure import Function, target_names


class Reductions:
    """What is summed over ranks, and after which loop (a mixin of DdpPlan)."""

    # -- evaluation metrics --------------------------------------------------------------
    @cached_property
    def _blockers(self) -> Dict[int, str]:
        return {}

    def metrics(self, loop: cst.For) -> Optional[List[str]]:
        """The sums an evaluation loop accumulates, if they are all it keeps: `+=` into numbers
        (or zero tensors) bound before the loop, and nothing else that outlives an iteration
        (no metric objects, lists, files). None when that cannot be proven."""
        cache = self.__dict__.setdefault("_metrics", {})
        if id(loop) in cache:
            return cache[id(loop)]
        cache[id(loop)] = result = self._metrics_of(loop)
        return result

    def _metrics_of(self, loop: cst.For) -> Optional[List[str]]:
        scope = self.s.scope(loop)
        accumulators: List[str] = []
        temporaries: Set[str] = set()
        self._offender: Optional[cst.CSTNode] = None
        if not self._plain_block(loop.body, accumulators, temporaries):
            return self._blocked(loop, self._offender)
        for name in accumulators:
            _, bindings = self.s.lookup(name, scope, self.s.order(loop))
            if not bindings or not all(b.how in ("assign", "aug", "unpack") for b in bindings) or \
                    not any(_initial_zero(b, self.model.qualify) for b in bindings):
                return self._blocked(loop, None, f"{name} does not start from a number")
        own = set(target_names(loop.target))  # the loop's own variables: this rank's count of batches
        read = self._read_after(loop, scope, (temporaries | own) - set(accumulators))
        if read is not None:
            what, counted = read[0], read[0] in own or read[1]
            return self._blocked(loop, None, f"`{what}` after the loop counts this rank's batches only" if counted
                                 else f"{what} is read after the loop")
        return accumulators

    def _read_after(self, loop: cst.For, scope, names: Set[str]) -> Optional[Tuple[str, bool]]:
        """(what, is it `len(loader)`) for the first of `names` (bound in the loop) that code
        after the loop in its scope reads as the loop left it, or `len(loader)` of the loader
        the loop iterates: one pass over what follows. A sum reduced over ranks and divided by such a per-rank count
        (`total / (i + 1)`) is N times too large."""
        iterated = loop.iter
        while isinstance(iterated, cst.Call) and iterated.args:  # enumerate(loader), tqdm(loader)
            iterated = iterated.args[0].value
        loader = iterated.value if isinstance(iterated, cst.Name) else None
        for node in self.s.index.order[self.s.index.end[id(loop)]:]:
            if isinstance(node, cst.Name) and node.value in names and self.s.scope(node) is scope:
                _, bindings = self.s.lookup(node.value, scope, self.s.order(self.s.statement(node) or node))
                if any(self.s.index.contains(loop, b.stmt) for b in bindings):
                    return node.value, False
            if loader is not None and isinstance(node, cst.Call) and isinstance(node.func, cst.Name) and \
                    node.func.value == "len" and len(node.args) == 1 and isinstance(node.args[0].value, cst.Name) \
                    and node.args[0].value.value == loader and self.s.scope(node) is scope:
                return f"len({loader})", True
        return None

    def _blocked(self, loop: cst.For, node: Optional[cst.CSTNode], text: str = "") -> None:
        """Record why the loop's sums cannot be reduced: the statement that keeps more than
        sums (`node`), or a reason (`text`); the review quotes it."""
        if node is not None:
            code = " ".join(self.ctx.module.code_for_node(node).split())
            text = f"its loop keeps more than sums (`{code if len(code) <= 50 else code[:47] + '...'}`)"
        self._blockers[id(loop)] = text
        return None

    def _plain_block(self, suite: cst.BaseSuite, accumulators: List[str], temporaries: Set[str]) -> bool:
        body = suite.body if isinstance(suite, cst.IndentedBlock) else [suite]
        for stmt in body:
            if isinstance(stmt, (cst.SimpleStatementLine, cst.SimpleStatementSuite)):
                for small in stmt.body:
                    if not self._plain_small(small, accumulators, temporaries):
                        self._offender = small
                        return False
            elif isinstance(stmt, cst.If):
                branch: Optional[cst.CSTNode] = stmt
                while isinstance(branch, cst.If):
                    if not self._plain_block(branch.body, accumulators, temporaries):
                        return False
                    branch = branch.orelse
                if isinstance(branch, cst.Else) and not self._plain_block(branch.body, accumulators, temporaries):
                    return False
            elif isinstance(stmt, cst.With):
                if not self._plain_block(stmt.body, accumulators, temporaries):
                    return False
            elif isinstance(stmt, cst.For):
                temporaries.update(n for n in target_names(stmt.target))
                if stmt.orelse is not None or not self._plain_block(stmt.body, accumulators, temporaries):
                    return False
            else:
                self._offender = stmt
                return False
        return True

    def _plain_small(self, small: cst.BaseSmallStatement, accumulators: List[str], temporaries: Set[str]) -> bool:
        if isinstance(small, (cst.Pass, cst.Continue)):
            return True
        if isinstance(small, cst.Assign):
            for target in small.targets:
                names = target_names(target.target)
                if not names or not isinstance(target.target, (cst.Name, cst.Tuple, cst.List)):
                    return False
                temporaries.update(names)
            return not self._side_effects(small.value)
        if isinstance(small, cst.AugAssign) and isinstance(small.operator, cst.AddAssign):
            target = small.target
            if isinstance(target, cst.Subscript) and isinstance(target.value, cst.Name):
                target = target.value  # confusion[t, p] += 1 on a zero tensor
            if not isinstance(target, cst.Name) or self._side_effects(small.value):
                return False
            if target.value not in accumulators:
                accumulators.append(target.value)
            return True
        if isinstance(small, cst.Expr) and isinstance(small.value, cst.Call):
            return self.model.output_call(small.value) in ("print", "log") or \
                (isinstance(small.value.func, cst.Attribute) and small.value.func.attr.value in ("set_postfix",
                                                                                               "set_description"))
        return False

    def _side_effects(self, expr: cst.BaseExpression) -> bool:
        """Calls that may keep per-batch state somewhere (`score.update(...)`, `preds.append`)."""
        for node in self.s.index.subtree(expr):
            if isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) and \
                    node.func.attr.value in ("append", "extend", "update", "add", "write", "insert", "add_"):
                return True
            if isinstance(node, cst.Call):
                target = self.s.callee(node)
                if target is not None and self._mutates(target):
                    return True
        return False

    def _mutates(self, fn: Function) -> bool:
        """Does a function change state that outlives it (a parameter's, a global's, an
        attribute's), rather than only its own locals?"""
        for c in fn.calls:
            if isinstance(c.func, cst.Attribute) and c.func.attr.value in ("append", "extend", "update", "write", "add"):
                receiver = c.func.value
                local = isinstance(receiver, cst.Name) and any(
                    b.how in ("assign", "unpack", "loop") for b in fn.scope.bindings.get(receiver.value, []))
                if not local:
                    return True
        return bool(self.s.own(fn.node, (cst.Global, cst.Nonlocal)))

    @cached_property
    def reductions(self) -> Dict[int, List[str]]:
        """Evaluation loops over sharded loaders -> the sums to reduce right after them."""
        out: Dict[int, List[str]] = {}
        for loader in self.model.loaders:
            edit = self.sharded(loader.call)
            if edit is None or not edit.eval_sharded:
                continue
            for consumer in loader.consumers:
                if not consumer.trains and isinstance(consumer.node, cst.For):
                    names = self.metrics(consumer.node) or []
                    if names:
                        out[id(consumer.node)] = names
        return out

    # -- training sums -------------------------------------------------------------------
    @cached_property
    def _sums(self) -> Tuple[Dict[int, List[str]], Set[int]]:
        """Training loops -> running sums (`running_loss += loss.item() * n`) that the script
        only ever divides by the whole training set's size after the loop: reduced over ranks
        right after it, the average stays the true one."""
        loops: Dict[int, List[str]] = {}
        divisors: Set[int] = set()
        if not self.shard_training:
            return loops, divisors
        for node in self.s.index.order:
            if not isinstance(node, cst.Call) or not self._dataset_size(node):
                continue
            division = self.s.parent(node)
            if not (isinstance(division.operator, cst.Divide) and division.right is node
                    and isinstance(division.left, cst.Name)):
                continue
            name = division.left.value
            scope = self.s.scope(node)
            _, bindings = self.s.lookup(name, scope, self.s.order(self.s.statement(node)))
            loop = self._training_loop_of(bindings)
            if loop is None or not self.uniform(loop) or not self._only_divided(name, loop, scope):
                continue
            names = loops.setdefault(id(loop), [])
            if name not in names:
                names.append(name)
        for node in self.s.index.order:
            if isinstance(node, cst.Call) and self._dataset_size(node):
                division = self.s.parent(node)
                if isinstance(division.left, cst.Name) and any(division.left.value in names and
                                                               self._after_loop(division, loop_id)
                                                               for loop_id, names in loops.items()):
                    divisors.add(id(node))
        return loops, divisors

    @property
    def _divisors_of_sums(self) -> Set[int]:
        return self._sums[1]

    @property
    def training_sums(self) -> Dict[int, List[str]]:
        return self._sums[0]

    def _after_loop(self, node: cst.CSTNode, loop_id: int) -> bool:
        loop = next((n for n in self.s.index.order if id(n) == loop_id), None)
        return loop is not None and self.s.order(node) >= self.s.index.end[id(loop)] and \
            self.s.scope(node) is self.s.scope(loop)

    def _training_loop_of(self, bindings) -> Optional[cst.For]:
        """The training loop a running sum is accumulated in: `x = 0` before it, `x += ...`
        inside it."""
        augs = [b for b in bindings if b.how == "aug"]
        if not augs or not any(_initial_zero(b, self.model.qualify) for b in bindings):
            return None
        loops = set()
        for b in augs:
            loop = next((a for a in self.s.ancestors(b.stmt) if isinstance(a, (cst.For, cst.While))), None)
            if not isinstance(loop, cst.For) or id(loop) not in self.model.training_consumptions:
                return None
            loops.add(loop)
        return loops.pop() if len(loops) == 1 else None

    def _only_divided(self, name: str, loop: cst.For, scope) -> bool:
        """After the loop, `name` is only ever divided by the training set's size."""
        end = self.s.index.end[id(loop)]
        for node in self.s.index.order[end:]:
            if isinstance(node, cst.Name) and node.value == name and self.s.scope(node) is scope:
                parent = self.s.parent(node)
                if isinstance(parent, (cst.AssignTarget, cst.AugAssign)) and getattr(parent, "target", None) is node:
                    return True  # rebound: what follows is another sum
                if not (isinstance(parent, cst.BinaryOperation) and parent.left is node and
                        isinstance(parent.right, cst.Call) and self._dataset_size(parent.right)):
                    return False
        return True

    @cached_property
    def reduce_after(self) -> Dict[int, List[str]]:
        """Loops (by id) after which sums are reduced over ranks: evaluation metrics of
        sharded evaluation loaders, and training sums averaged over the whole training set."""
        out = {k: list(v) for k, v in self.reductions.items()}
        for loop, names in self.training_sums.items():
            out.setdefault(loop, []).extend(n for n in names if n not in out.get(loop, []))
        return out


def _initial_zero(b, qualify) -> bool:
    """`total = 0`, `total, correct = 0.0, 0`, `confusion = torch.zeros(...)`: a sum's start."""
    if b.how == "assign":
        return _zero(b.value, qualify)
    if b.how == "unpack" and isinstance(b.value, (cst.Tuple, cst.List)) and len(b.path) == 1 \
            and b.path[0] < len(b.value.elements):
        return _zero(b.value.elements[b.path[0]].value, qualify)
    return False


def _zero(value, qualify) -> bool:
    if isinstance(value, (cst.Integer, cst.Float)):
        return True
    if isinstance(value, cst.UnaryOperation) and isinstance(value.expression, (cst.Integer, cst.Float)):
        return True
    if isinstance(value, cst.Call) and (qualify(value.func) or "") in ("torch.zeros", "torch.zeros_like", "torch.tensor"):
        return True
    if isinstance(value, cst.Assign):
        return _zero(value.value, qualify)
    return False
