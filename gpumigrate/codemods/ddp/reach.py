"""Where every rank goes: which code only rank 0 runs already (the script's own rank-0
branches), which code every rank reaches equally often (where a collective or a barrier may
go), and which of the script's conditions torchrun meets.

Decides: `torchrun`, `gate_test`, `gated`, `gated_functions`, `locally_uniform`,
`uniform_functions`, `uniform`.

Relies on, from DdpPlan (ddp_plan.py) and its other mixins:
- `self.ctx`, `self.model`, `self.s` (ddp_plan.py);
- `self.gated_lines` (rank0.py): functions called from output lines this plan gates run on
  rank 0 only;
- `self.metrics` (reduce.py): an evaluation loop whose shard may be unpadded runs a different
  number of times on each rank.
"""

from __future__ import annotations

import re
from functools import cached_property
from typing import List, Set

import libcst as cst

from gpumigrate.analysis.launch import Torchrun
from gpumigrate.analysis.structure import Function

_LISTINGS = ("glob.", "os.listdir", "os.scandir", "os.walk")
# the names projects give their own rank-0 test (`def is_primary(): return get_rank() == 0`)
_MAIN_RANK_NAMES = r"is_(main_process|primary|main|main_rank|rank_?0|rank_zero|master)\b"  # `gm_is_main_process` too
_RANK0_TEST = re.compile(r"(rank\b[^=]*==\s*0|rank\s+in\s*[\[(]\s*-1\s*,\s*0|rank\s*<=\s*0|" + _MAIN_RANK_NAMES +
                         r"|get_rank\(\)\s*==\s*0|local_rank\s+in\s*\[)")
# rank 0 of the whole job (not `local_rank == 0`, true once per machine)
_MAIN_RANK_TEST = re.compile(r"(get_rank\(\)\s*==\s*0|(^|[^_\w])(args\.|self\.)?(global_)?rank\s*==\s*0|" +
                             _MAIN_RANK_NAMES + ")")


class Reach:
    """Which code every rank runs equally often, and which rank 0 alone runs (a mixin of DdpPlan)."""

    # -- where every rank goes -----------------------------------------------------------
    @cached_property
    def torchrun(self) -> Torchrun:
        """The script's conditions under torchrun, its launcher options with the defaults
        GM405 gives them."""
        return Torchrun(self.model, env_defaults="GM405" in self.ctx.fixing)

    def gate_test(self, test: cst.BaseExpression) -> bool:
        """A condition that is true on rank 0 only (`is_main_process()`, `rank == 0`)."""
        return bool(_RANK0_TEST.search(self.ctx.module.code_for_node(test)))

    def gated(self, node: cst.CSTNode, main_only: bool = False) -> bool:
        """Is `node` inside a branch that depends on the rank (the script's own `if rank == 0:`,
        `if args.local_rank == 0:`)? `main_only`: a branch only the job's rank 0 takes. Not one
        that every rank takes under torchrun (`if not args.distributed or dist.get_rank() == 0:`
        without `--distributed`)."""
        test = _MAIN_RANK_TEST if main_only else _RANK0_TEST
        for ancestor in self.s.ancestors(node):
            if isinstance(ancestor, cst.If) and test.search(self.ctx.module.code_for_node(ancestor.test)) and \
                    not self.s.index.contains(ancestor.test, node) and self.torchrun.truth(ancestor.test) is not True:
                return True
        return False

    def locally_uniform(self, node: cst.CSTNode) -> bool:
        """Within its function, does every rank run `node` equally often?"""
        child = node
        for ancestor in self.s.ancestors(node):
            if isinstance(ancestor, (cst.FunctionDef, cst.Lambda)):
                return True
            if isinstance(ancestor, (cst.If, cst.While)) and not self.s.index.contains(ancestor.test, child):
                if self.gate_test(ancestor.test) or self.model.rank_local_test(ancestor):
                    return False
            if isinstance(ancestor, cst.ExceptHandler):
                return False
            if isinstance(ancestor, cst.Try) and child is ancestor.body and not interrupt_only(ancestor):
                return False  # an exception on one rank (a folder rank 0 made, a file) skips the rest there
            if isinstance(ancestor, (cst.For, cst.While)) and self._local_exit(ancestor):
                return False
            if isinstance(ancestor, cst.For) and id(ancestor) in self._unpadded_loops:
                return False
            if isinstance(ancestor, cst.For) and child is not ancestor.iter and self._lists_files(ancestor.iter):
                return False  # `for f in glob.glob('*.pkl')`: rank 0's writes change what each rank finds
            child = ancestor
        return True

    def _lists_files(self, expr: cst.BaseExpression) -> bool:
        """A listing of the filesystem (`glob.glob(...)`, `os.listdir(d)`, `path.iterdir()`),
        or a name bound to one."""
        def listing(node: cst.CSTNode) -> bool:
            return any((self.model.qualify(c.func) or "").startswith(_LISTINGS) or isinstance(c.func, cst.Attribute)
                       and c.func.attr.value in ("glob", "rglob", "iterdir") for c in self.s.inside(node, cst.Call))

        if listing(expr):
            return True
        for name in self.s.inside(expr, cst.Name):
            _, bindings = self.s.lookup(name.value, self.s.scope(name))
            if any(b.how in ("assign", "unpack") and isinstance(b.value, cst.CSTNode) and listing(b.value)
                   for b in bindings):
                return True
        return False

    @cached_property
    def _unpadded_loops(self) -> Set[int]:
        """Evaluation loops that may get an unpadded shard: ranks run them a different number
        of times (decided before sharding, so that sharding can ask about uniformity)."""
        return {id(c.node) for l in self.model.loaders if l.role in ("eval", "flag") for c in l.consumers
                if not c.trains and isinstance(c.node, cst.For) and self.metrics(c.node) is not None}

    def _local_exit(self, loop) -> bool:
        """A `break`/`continue`/`return` under a rank-local condition in this loop."""
        for node in self.s.own(loop, (cst.Break, cst.Continue, cst.Return)):
            for ancestor in self.s.ancestors(node):
                if ancestor is loop:
                    break
                if isinstance(ancestor, cst.If) and self.model.rank_local_test(ancestor):
                    return True
                if isinstance(ancestor, cst.ExceptHandler):
                    return True
        return False

    @cached_property
    def uniform_functions(self) -> Set[int]:
        """Functions every rank runs equally often: called only from such code, never from
        a rank-0 branch, a rank-local branch, or an output statement this plan gates."""
        gated = self.gated_functions
        uniform: Set[int] = {id(fn.node) for fn in self._launched_once}
        candidates = [fn for fn in self.s.functions.values() if fn.callers and id(fn.node) not in gated]
        changed = True
        while changed:
            changed = False
            for fn in candidates:
                if id(fn.node) in uniform:
                    continue
                ok = True
                for call in fn.callers:
                    if not self.locally_uniform(call) or self.gated(call):
                        ok = False
                        break
                    caller = self.s.function(call)
                    if caller is not None and id(caller.node) not in uniform:
                        ok = False
                        break
                if ok:
                    uniform.add(id(fn.node))
                    changed = True
        return uniform

    @cached_property
    def _launched_once(self) -> List[Function]:
        """Functions no call of this file makes, handed once to a launcher by module-level
        code that every rank runs once (`fire.Fire(demo)`, `mp.spawn(main_worker, ...)`,
        `app.run(main)`): each rank runs them once."""
        out = []
        candidates = [fn for fn in self.s.functions.values() if not fn.callers and isinstance(fn.node, cst.FunctionDef)
                      and fn.cls is None and not any(isinstance(a, (cst.FunctionDef, cst.ClassDef))
                                                           for a in self.s.ancestors(fn.node))]
        if not candidates:
            return out
        names = {fn.name for fn in candidates}
        uses: dict = {}  # one pass over the file, not one per function
        for n in self.s.index.of(cst.Name):
            if n.value in names:
                uses.setdefault(n.value, []).append(n)
        for fn in candidates:
            refs = [n for n in uses.get(fn.name, ()) if n is not fn.node.name]
            if len(refs) != 1 or not isinstance(self.s.parent(refs[0]), cst.Arg):
                continue
            call = self.s.parent(self.s.parent(refs[0]))
            if isinstance(call, cst.Call) and self.s.function(call) is None and self.locally_uniform(call) and \
                    not self.gated(call) and not any(isinstance(a, (cst.For, cst.While)) for a in self.s.ancestors(call)):
                out.append(fn)
        return out

    @cached_property
    def gated_functions(self) -> Set[int]:
        """Functions reached from rank-0-only code: the script's own rank-0 branches and the
        output statements this plan moves under `is_main_process()`."""
        roots: List[Function] = []
        for node in self.s.index.order:
            if isinstance(node, cst.Call):
                target = self.s.callee(node)
                if target is not None and (self.gated(node) or id(self.s.line(node)) in self.gated_lines):
                    roots.append(target)
        return self.s.calls_reaching(roots)

    def uniform(self, node: cst.CSTNode) -> bool:
        """Does every rank reach `node` equally often, after `setup_distributed()`?"""
        if not self.locally_uniform(node) or self.gated(node):
            return False
        fn = self.s.function(node)
        return fn is None or id(fn.node) in self.uniform_functions


def interrupt_only(node: cst.Try) -> bool:
    """A `try` whose handlers catch only KeyboardInterrupt (`except KeyboardInterrupt: print(
    'Exiting from training early')`): Ctrl-C stops every rank alike."""
    return bool(node.handlers) and all(
        isinstance(h.type, cst.Name) and h.type.value == "KeyboardInterrupt" for h in node.handlers)
