"""What runs on rank 0 only, and what rank 0 decides for every rank.

Decides:
- outputs: `gated_lines` (print, logging, writers, saves that move under
  `if is_main_process():`), `output_line`, `unsafe_args` (arguments computed on every rank
  before the gated call, since they may train or communicate);
- checkpoints and written files: `saves_here`, `gated_withs` and `gated_with_saves`
  (`with open(...)` blocks that only write), `devnull_opens` (files the other ranks open on
  os.devnull), `reloads` and `reads_files` (the script reads files back), `barrier_after` and
  `barrier_after_write` (the other ranks wait for rank 0's write), `decided_on_rank0`
  (filesystem tests rank 0 decides for all);
- values the ranks must agree on: `identifier` (a per-process value used as a name),
  `broadcasts` (take rank 0's, or report).

Relies on, from DdpPlan (ddp_plan.py) and its other mixins:
- `self.model`, `self.s`, `self.active` (ddp_plan.py);
- `self.wrapped_reference` (wrap.py): an output that calls a wrapped model is not gated whole;
- `self.gated`, `self.uniform` (reach.py);
- `self.wraps` (wrap.py): under fsdp, an output reading a sharded model computes on every rank.
"""

from __future__ import annotations

import re
from functools import cached_property
from typing import Dict, List, Optional, Set

import libcst as cst

from gpumigrate.analysis import values as v
from gpumigrate.analysis.structure import Function, dotted
from gpumigrate.analysis.syntax import runtime_helper
from gpumigrate.codemods.ddp import sharding
from gpumigrate.codemods.ddp.reach import interrupt_only

# calls that read a file back (the other ranks must not read before rank 0 wrote it)
_READERS = frozenset({"torch.load", "imageio.imread", "imageio.v2.imread", "imageio.v3.imread", "PIL.Image.open",
                      "cv2.imread", "matplotlib.pyplot.imread", "matplotlib.image.imread", "numpy.load", "pickle.load",
                      "json.load", "scipy.io.loadmat", "skimage.io.imread", "pandas.read_csv"})
_FILESYSTEM_TESTS = ("os.path.", "os.listdir", "os.scandir", "glob.", "os.access", "os.stat")
_UNSAFE_METHODS = re.compile(r"^(train|test|eval|evaluate|validate|step|backward|run|fit|all_reduce|barrier|reduce.*|"
                             r"broadcast.*|gather.*|update|forward)$")
_SAFE_CALLS = {"str", "int", "float", "len", "round", "abs", "min", "max", "sum", "repr", "format", "sorted", "list",
               "tuple", "dict", "type", "isinstance", "getattr", "hasattr", "enumerate", "zip", "range", "any",
               "all", "bool", "print", "unwrap_model", "get_rank", "get_world_size", "is_main_process", "vars", "open"}
_ID_CALLS = ("tempfile.mkdtemp", "tempfile.mktemp", "uuid.uuid1", "uuid.uuid4", "time.strftime", "time.asctime",
             "time.ctime", "socket.gethostname", "secrets.token_hex")
_PATH_SINKS = ("os.path.join", "os.makedirs", "os.mkdir", "open", "torch.save", "pathlib.Path", "shutil.",
               "SummaryWriter")


class RankZero:
    """What rank 0 alone does, and what it decides for every rank (a mixin of DdpPlan)."""

    # -- outputs -------------------------------------------------------------------------
    @cached_property
    def gated_lines(self) -> Set[int]:
        """Output statements (print, logging, writers, saves) that move under
        `if is_main_process():`."""
        out: Set[int] = set()
        if not self.active:
            return out
        withs = self.gated_withs
        for node in self.s.index.order:
            if isinstance(node, cst.SimpleStatementLine) and self.output_line(node) is True and \
                    not any(id(a) in withs for a in self.s.ancestors(node)):
                out.add(id(node))
        return out

    def output_line(self, line: cst.SimpleStatementLine) -> Optional[bool]:
        """True: an output statement safe to move under rank 0; False: output that calls
        code which may train or communicate (review); None: not an output statement."""
        verdicts = []
        for small in line.body:
            if not (isinstance(small, cst.Expr) and isinstance(small.value, cst.Call)):
                return None
            kind = self.model.output_call(small.value)
            if kind is None or self._per_rank_file(small.value) or self._to_devnull_file(small.value) \
                    or kind == "save" and self._in_own_temp_dir(small.value) \
                    or self._reports_an_error(small.value, kind):
                return None
            verdicts.append(self._safe_args(small.value))
        if self.gated(line, main_only=True) or self._in_gated_function(line) or self.model.rank_query(line) \
                or self._in_logger(line):
            return None  # already on rank 0 only, or written per rank on purpose (`rank%d.txt`)
        return all(verdicts)

    def _reports_an_error(self, call: cst.Call, kind: str) -> bool:
        """`logging.error(traceback.format_exc())` in an `except` block: the error of whichever
        rank caught it, said on that rank (on rank 0 only, another rank's failure would pass
        unseen, and a handler that swallows it would leave that rank's training silently cut).
        `kind`: the call's `output_call`."""
        method = call.func.attr.value if isinstance(call.func, cst.Attribute) else ""
        if method not in ("error", "exception", "critical") or kind not in ("log", "write"):
            return False
        for ancestor in self.s.ancestors(call):
            if isinstance(ancestor, (cst.FunctionDef, cst.Lambda, cst.ClassDef)):
                return False
            if isinstance(ancestor, cst.ExceptHandler):
                return True
        return False

    def _to_devnull_file(self, call: cst.Call) -> bool:
        """A write to a file this plan opens on `os.devnull` on the other ranks (directly, or
        through a csv writer over it): no gate needed."""
        receiver = call.func.value if isinstance(call.func, cst.Attribute) else None
        return isinstance(receiver, cst.Name) and self._devnull_holder(receiver, 0)

    def _devnull_holder(self, name: cst.Name, depth: int) -> bool:
        _, bindings = self.s.lookup(name.value, self.s.scope(name), self.s.order(self.s.statement(name) or name))
        if not bindings or depth > 2:
            return False
        for b in bindings:
            value = b.value
            if not isinstance(value, cst.Call):
                return False
            if id(value) in self._devnull_candidates or _devnull_already(value):
                continue
            if (self.model.qualify(value.func) or "") in ("csv.writer", "csv.DictWriter") and value.args and \
                    isinstance(value.args[0].value, cst.Name) and self._devnull_holder(value.args[0].value, depth + 1):
                continue
            return False
        return True

    def _in_own_temp_dir(self, call: cst.Call) -> bool:
        """A save into a temporary directory this process made (`with TemporaryDirectory() as
        d:`, the path `os.path.join(d, 'best.pt')`): each rank's own scratch file, which it
        reads back itself (the transfer-learning tutorial's best weights). Every rank writes
        its own: gated to rank 0, the others would read a file that is not in their folder."""
        names = [n for a in call.args for n in self.s.index.subtree(a.value) if isinstance(n, cst.Name)]
        seen: Set[str] = set()
        for _ in range(3):  # through `path = os.path.join(d, ...)` and up to two more names
            more = []
            for name in names:
                if name.value in seen:
                    continue
                seen.add(name.value)
                _, bindings = self.s.lookup(name.value, self.s.scope(name), self.s.order(self.s.statement(name) or name))
                for b in bindings:
                    if b.how == "with" and isinstance(b.value, cst.Call) and \
                            self.model.qualify(b.value.func) == "tempfile.TemporaryDirectory":
                        return True
                    if b.how == "assign":
                        more.extend(n for n in self.s.index.subtree(b.value) if isinstance(n, cst.Name))
            names = more
        return False

    def _per_rank_file(self, call: cst.Call) -> bool:
        """A write to a file whose name depends on the rank (`open("log_rank%d.txt" % rank)`):
        each rank writes its own on purpose."""
        receiver = call.func.value if isinstance(call.func, cst.Attribute) else None
        if not isinstance(receiver, cst.Name):
            return False
        _, bindings = self.s.lookup(receiver.value, self.s.scope(call), self.s.order(self.s.statement(call)))
        return any(isinstance(b.value, cst.Call) and self.model.rank_query(b.value) for b in bindings)

    def _in_gated_function(self, node: cst.CSTNode) -> bool:
        fn = self.s.function(node)
        if fn is None:
            return False
        # a helper only ever called from the script's own rank-0 branches
        return bool(fn.callers) and all(self.gated(c, main_only=True) for c in fn.callers)

    def _safe_args(self, call: cst.Call) -> bool:
        return self._safe(call, call)

    def unsafe_args(self, call: cst.Call) -> List[cst.Arg]:
        """The arguments of an output call that may train or communicate (a model's forward,
        an evaluation of this file): computed on every rank before the call is gated."""
        return [arg for arg in call.args if not self._safe(arg.value, call)]

    @cached_property
    def _sharded_names(self) -> Set[str]:
        """fsdp: the names that hold a sharded model (a read of its parameters, `model.fc.weight
        .norm()`, gathers them: a collective every rank must make)."""
        return {w.name for w in self.wraps} if sharding(self.ctx) else set()

    def _safe(self, root: cst.CSTNode, call: cst.Call) -> bool:
        # a save gathers its sharded models itself (GM404: full_state_dict, full_model)
        if self._sharded_names and self.model.qualify(call.func) != "torch.save" and any(
                isinstance(n, (cst.Name, cst.Attribute)) and dotted(n) in self._sharded_names
                for n in self.s.index.subtree(root)):
            return False
        for node in self.s.index.subtree(root):
            if node is call or not isinstance(node, cst.Call):
                continue
            if dotted(node.func) is not None and self.wrapped_reference(node.func):
                return False  # a wrapped model's forward may communicate (buffer broadcasts)
            target = self.s.callee(node)
            if target is not None:
                if self._communicates_or_trains(target):
                    return False
                continue
            func = node.func
            if isinstance(func, cst.Name):
                if func.value not in _SAFE_CALLS:
                    return False
            elif isinstance(func, cst.Attribute):
                qualified = self.model.qualify(func) or ""
                if qualified.startswith(("math.", "time.", "os.", "datetime.", "json.", "numpy.", "torch.")) and \
                        not self.model.collective(node):
                    continue
                if _UNSAFE_METHODS.match(func.attr.value):
                    return False
            else:
                return False
        return True

    def _communicates_or_trains(self, fn: Function) -> bool:
        reach = self.s.calls_reaching([fn])
        for fid in reach:
            target = next((f for f in self.s.functions.values() if id(f.node) == fid), None)
            if target is None:
                continue
            if self.model.function_trains(target):
                return True
            for call in target.calls:
                if self.model.collective(call) or self._consumes_loader(call) or (
                        dotted(call.func) is not None and self.wrapped_reference(call.func)):
                    return True
        return False

    def _consumes_loader(self, call: cst.Call) -> bool:
        stmt = self.s.statement(call)
        return any(self.s.index.contains(c.node, call) or c.node is call
                   for l in self.model.loaders for c in l.consumers) if stmt is not None else False

    # -- checkpoints and written files ---------------------------------------------------
    def saves_here(self, stmt: cst.CSTNode) -> List[cst.Call]:
        """The `torch.save` calls of a gated line or `with open(...)` block."""
        if id(stmt) not in self.gated_lines and id(stmt) not in self.gated_withs:
            return []
        return self.torch_saves(stmt)

    def torch_saves(self, stmt: cst.CSTNode) -> List[cst.Call]:
        """The `torch.save` calls in `stmt`, gated or not."""
        return [c for c in self.s.inside(stmt, cst.Call) if self.model.qualify(c.func) == "torch.save"]

    @cached_property
    def reloads(self) -> bool:
        """The script reads checkpoints back (`torch.load`): after a save, the other ranks
        must wait for rank 0's write."""
        return any(isinstance(n, cst.Call) and self.model.qualify(n.func) == "torch.load" for n in self.s.index.order)

    def barrier_after(self, stmt: cst.CSTNode) -> bool:
        return self.reloads and self.uniform(stmt) and not self._on_the_filesystem(stmt)

    def _on_the_filesystem(self, stmt: cst.CSTNode) -> bool:
        """Under a test of the filesystem (`if not os.path.isdir(d): os.mkdir(d)`) that rank 0
        does not decide for all: its write changes what the others find, so they may not go
        where it went."""
        for ancestor in self.s.ancestors(stmt):
            if isinstance(ancestor, (cst.FunctionDef, cst.Lambda)):
                return False
            if isinstance(ancestor, (cst.If, cst.While)) and self._tests_the_filesystem(ancestor) and \
                    id(ancestor) not in self.decided_on_rank0:
                return True
        return False

    def _tests_the_filesystem(self, node: cst.CSTNode) -> bool:
        if isinstance(node.test, cst.Call) and runtime_helper(self.model.qualify(node.test.func)) == "broadcast_object":
            return False  # decided on rank 0 already
        return any((self.model.qualify(c.func) or "").startswith(_FILESYSTEM_TESTS) or
                   isinstance(c.func, cst.Attribute) and c.func.attr.value in ("exists", "is_dir", "is_file", "glob")
                   for c in self.s.inside(node.test, cst.Call))

    @cached_property
    def decided_on_rank0(self) -> Set[int]:
        """`if not os.path.exists(path):` around a write that moves to rank 0, in a script that
        reads files back, where every rank goes equally often: rank 0 decides the test for all
        (`broadcast_object`), so every rank takes the branch and waits for the write there."""
        out: Set[int] = set()
        if not self.active or not self.reads_files:
            return out
        for node in self.s.index.order:
            if isinstance(node, cst.If) and not node.orelse and self._tests_the_filesystem(node) and \
                    self.uniform(node) and not any(
                        isinstance(a, (cst.If, cst.While)) and self._tests_the_filesystem(a)
                        for a in self.s.ancestors(node)) and any(
                        self.model.output_call(c) == "save" and (id(self.s.line(c)) in self.gated_lines or
                                                                self.saves_here(self.s.line(c)))
                        for c in self.s.inside(node.body, cst.Call)):
                out.add(id(node))
        return out

    @cached_property
    def reads_files(self) -> bool:
        """The script reads back files it may have written (images made into a GIF at the end,
        a pickle): after a write on rank 0 the other ranks must wait for it."""
        return self.reloads or any(isinstance(n, cst.Call) and (self.model.qualify(n.func) or "") in _READERS
                                   for n in self.s.index.order)

    @cached_property
    def barriers_after_try(self) -> Set[int]:
        """ids of `try` statements after which a barrier goes: rank 0 saves or writes in their
        body, which every rank reaches but an exception may leave on one rank (`try:
        os.makedirs(d) except OSError: pass`, with the folder there already): a barrier inside
        would wait for a rank that never comes; after the whole statement, every rank gets there."""
        out: Set[int] = set()
        if not self.active or not self.reads_files:
            return out
        for node in self.s.index.of(cst.Try):
            if interrupt_only(node) or not self.uniform(node) or self._on_the_filesystem(node):
                continue  # (Ctrl-C stops every rank: the barriers inside stay where they are)
            if any(self.model.output_call(c) == "save" for c in self.s.inside(node.body, cst.Call)) and \
                    not self._barrier_follows(node):
                out.add(id(node))
        return out

    def _barrier_follows(self, stmt: cst.CSTNode) -> bool:
        """The statement after `stmt` in its block is a barrier (an earlier run's)."""
        block = self.s.block(stmt)
        body = list(block.body) if block is not None else []
        k = next((i for i, member in enumerate(body) if member is stmt), len(body))
        after = body[k + 1] if k + 1 < len(body) else None
        return isinstance(after, cst.SimpleStatementLine) and any(
            isinstance(small, cst.Expr) and isinstance(small.value, cst.Call) and
            runtime_helper(self.model.qualify(small.value.func)) == "barrier" for small in after.body)

    def barrier_after_write(self, stmt: cst.CSTNode) -> bool:
        """A file written on rank 0 (`plt.savefig`, `save_image`, `pickle.dump`) where every rank
        goes equally often, in a script that reads files back: a barrier after it."""
        return self.reads_files and any(self.model.output_call(c) == "save" for c in self.s.inside(stmt, cst.Call)) \
            and self.uniform(stmt) and not self._on_the_filesystem(stmt)

    @cached_property
    def gated_withs(self) -> Set[int]:
        """`with open(path, "w") as f:` blocks that only write: the whole block runs on rank 0."""
        out: Set[int] = set()
        if not self.active:
            return out
        for node in self.s.index.order:
            if isinstance(node, cst.With) and any(_opens_for_writing(i.item) for i in node.items) \
                    and self._writes_only(node) \
                    and not self.gated(node, main_only=True) and not self._in_gated_function(node) \
                    and not any(self.model.rank_query(i.item) for i in node.items) and not self._in_logger(node):
                out.add(id(node))
        return out

    def _in_logger(self, node: cst.CSTNode) -> bool:
        """Inside a method of a logger class of this file: its calls are gated instead (not in
        a helper module, whose callers are in other files)."""
        fn = self.s.function(node)
        return fn is not None and fn.cls is not None and not self.helper_module and self.model._logger_class(fn.cls)

    def gated_with_saves(self, node: cst.With) -> bool:
        """A gated `with open(...)` block holding a checkpoint save (GM404's; others GM410's)."""
        return id(node) in self.gated_withs and any(
            self.model.qualify(c.func) == "torch.save" for c in self.s.inside(node, cst.Call))

    def _writes_only(self, node: cst.With) -> bool:
        for stmt in self.s.inside(node.body, (cst.BaseSmallStatement, cst.BaseCompoundStatement)):
            if isinstance(stmt, cst.Expr) and isinstance(stmt.value, cst.Call):
                if self.model.output_call(stmt.value) is None and not (
                        isinstance(stmt.value.func, cst.Attribute) and isinstance(stmt.value.func.value, cst.Name)):
                    return False
                if not self._safe_args(stmt.value):
                    return False
            elif isinstance(stmt, (cst.Assign, cst.AugAssign)):
                if self.model.trains(stmt) or any(self.model.collective(c) for c in self.s.inside(stmt, cst.Call)):
                    return False
            elif isinstance(stmt, (cst.For, cst.If, cst.Pass)):
                continue
            else:
                return False
        return not self.model.trains(node)

    @cached_property
    def _devnull_candidates(self) -> Set[int]:
        """Files opened for writing on every rank, outside any rank-0 code and not per rank."""
        out: Set[int] = set()
        if not self.active:
            return out
        for node in self.s.index.order:
            opens = _opens_for_writing(node) or isinstance(node, cst.Call) and \
                self.model.qualify(node.func) in _FILE_HANDLERS  # a logging handler opens its file when made
            if opens and node.args and node.args[0].keyword is None and not node.args[0].star:
                parent = self.s.parent(node)
                if isinstance(parent, cst.WithItem) and id(self.s.parent(parent)) in self.gated_withs:
                    continue
                if self.gated(node, main_only=True) or self._in_gated_function(node) or self._in_logger(node) \
                        or self.model.rank_query(node):
                    continue
                out.add(id(node))
        return out

    @cached_property
    def devnull_opens(self) -> Set[int]:
        """`f = open(path, "w")` on every rank: the other ranks write to os.devnull instead
        (an open inside an output statement this plan gates needs none)."""
        return {i for i in self._devnull_candidates
                if id(self.s.line(self._node(i))) not in self.gated_lines}

    def _node(self, node_id: int) -> cst.CSTNode:
        return next(n for n in self.s.index.order if id(n) == node_id)

    # -- values the ranks must agree on --------------------------------------------------
    def identifier(self, assign: cst.Assign) -> bool:
        """A per-process value used as a name: a run directory, a file name, an id; not a
        timing. Those need rank 0's value on every rank."""
        value = assign.value
        for node in self.s.index.subtree(value):
            if isinstance(node, cst.Call):
                qualified = self.model.qualify(node.func) or ""
                if qualified in _ID_CALLS:
                    return True
                if isinstance(node.func, cst.Name) and node.func.value in ("str", "format", "repr"):
                    if any(self.model.per_process(a.value) for a in node.args):
                        return True
                if qualified.startswith(_PATH_SINKS) or qualified == "os.path.join":
                    return True
            if isinstance(node, (cst.FormattedString, cst.SimpleString)):
                return True
        names = [t.target.value for t in assign.targets if isinstance(t.target, cst.Name)]
        scope = self.s.scope(assign)
        for node in self.s.index.subtree(scope.node):
            if isinstance(node, cst.Name) and node.value in names and self.s.order(node) > self.s.order(assign):
                parent = self.s.parent(node)
                for ancestor in [parent, *self.s.ancestors(parent)] if parent is not None else []:
                    if isinstance(ancestor, (cst.FormattedString,)):
                        return True
                    if isinstance(ancestor, cst.Call):
                        qualified = self.model.qualify(ancestor.func) or ""
                        name = ancestor.func.value if isinstance(ancestor.func, cst.Name) else ""
                        if qualified.startswith(_PATH_SINKS) or name in ("open", "str") or \
                                qualified.endswith("SummaryWriter"):
                            return True
                        break
                    if isinstance(ancestor, cst.BinaryOperation) and isinstance(ancestor.operator, (cst.Add, cst.Modulo)):
                        if any(isinstance(x, (cst.SimpleString, cst.FormattedString)) for x in (ancestor.left, ancestor.right)):
                            return True
                    if isinstance(ancestor, (cst.BaseSmallStatement, cst.BaseCompoundStatement)):
                        break
        return False

    @cached_property
    def broadcasts(self) -> Dict[int, bool]:
        """Assignments of per-process identifiers (by id): True to take rank 0's value,
        False to report (not every rank reaches the line equally often)."""
        out: Dict[int, bool] = {}
        if not self.active:
            return out
        for node in self.s.index.order:
            if not isinstance(node, cst.Assign) or not any(self.model.per_process_call(c)
                                                           for c in self.s.inside(node.value, cst.Call)):
                continue
            if any((self.model.qualify(c.func) or "").endswith("broadcast_object")
                   for c in self.s.inside(node.value, cst.Call)):
                continue
            if not self.identifier(node):
                continue
            out[id(node)] = self.uniform(node) and not self.model.in_loop(node)
        return out


def _devnull_already(call: cst.Call) -> bool:
    """`open(path if is_main_process() else os.devnull, ...)`, from an earlier run."""
    first = call.args[0].value if call.args else None
    return isinstance(call.func, cst.Name) and call.func.value == "open" and isinstance(first, cst.IfExp) \
        and cst.Module(body=[]).code_for_node(first.orelse) == "os.devnull"


_FILE_HANDLERS = frozenset({"logging.FileHandler", "logging.handlers.RotatingFileHandler",
                            "logging.handlers.TimedRotatingFileHandler", "logging.handlers.WatchedFileHandler"})


def _opens_for_writing(node: cst.CSTNode) -> bool:
    """A call of the builtin `open` in a writing mode."""
    return isinstance(node, cst.Call) and isinstance(node.func, cst.Name) and node.func.value == "open" \
        and v.opens_for_writing(node)
