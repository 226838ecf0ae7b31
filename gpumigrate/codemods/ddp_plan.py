"""The ddp migration's decisions for one file, made once from the script model.

Every rule of the ddp target asks this plan instead of deciding for itself, so the edits fit
together: data is sharded only when the model that trains on it is wrapped; evaluation is
sharded only when its metrics are provably reduced; a collective is inserted only where every
rank provably reaches it equally often; rank-0 gates and collectives come after
`setup_distributed()`. What cannot be established takes the safe form and becomes a review
item (`reviews`), reported by GM400.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Dict, List, Optional, Set, Tuple

import libcst as cst

from gpumigrate.analysis import script_model
from gpumigrate.analysis import values as v
from gpumigrate.analysis.launch import DISTRIBUTED_SAMPLERS, Torchrun
from gpumigrate.analysis.model import Loader, TrainedModel
from gpumigrate.analysis.structure import Function, dotted, target_names
from gpumigrate.analysis.syntax import runtime_helper
from gpumigrate.analysis.values import call_argument

_MAIN_TEST = re.compile(r"""__name__\s*==\s*['"]__main__['"]|['"]__main__['"]\s*==\s*__name__""")
_RANK0_TEST = re.compile(r"(rank\b[^=]*==\s*0|rank\s+in\s*[\[(]\s*-1\s*,\s*0|rank\s*<=\s*0|is_main_process\(\)|"
                         r"is_master|get_rank\(\)\s*==\s*0|local_rank\s+in\s*\[)")
# rank 0 of the whole job (not `local_rank == 0`, true once per machine)
_MAIN_RANK_TEST = re.compile(r"(is_main_process\(\)|get_rank\(\)\s*==\s*0|(^|[^_\w])(args\.|self\.)?(global_)?rank\s*==\s*0|"
                             r"is_master)")
# Top-level packages that are not the project's own files (for calls the migration cannot read).
_LIBRARIES = frozenset({
    "torch", "torchvision", "torchaudio", "torchtext", "numpy", "scipy", "pandas", "sklearn", "matplotlib", "PIL",
    "cv2", "tqdm", "os", "sys", "math", "time", "random", "json", "logging", "shutil", "pickle", "csv", "re",
    "argparse", "collections", "itertools", "functools", "datetime", "pathlib", "tempfile", "warnings", "copy",
    "gpumigrate", "gpumigrate_runtime", "transformers", "timm", "apex", "wandb", "tensorboardX", "visdom", "yaml", "h5py", "glob",
    "subprocess", "socket", "uuid", "typing", "io", "gc", "contextlib", "operator", "string", "struct", "signal",
})
# calls that read a file back (the other ranks must not read before rank 0 wrote it)
_READERS = frozenset({"torch.load", "imageio.imread", "imageio.v2.imread", "imageio.v3.imread", "PIL.Image.open",
                      "cv2.imread", "matplotlib.pyplot.imread", "matplotlib.image.imread", "numpy.load", "pickle.load",
                      "json.load", "scipy.io.loadmat", "skimage.io.imread", "pandas.read_csv"})
_FILESYSTEM_TESTS = ("os.path.", "os.listdir", "os.scandir", "glob.", "os.access", "os.stat")
# torch.optim's optimizers, as a project's script calls them (`optim.Adam(...)`)
_OPTIMIZER_CLASSES = frozenset({"SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "ASGD", "LBFGS", "NAdam",
                                "RAdam", "RMSprop", "Rprop", "SparseAdam"})
_UNSAFE_METHODS = re.compile(r"^(train|test|eval|evaluate|validate|step|backward|run|fit|all_reduce|barrier|reduce.*|"
                             r"broadcast.*|gather.*|update|forward)$")
_SAFE_CALLS = {"str", "int", "float", "len", "round", "abs", "min", "max", "sum", "repr", "format", "sorted", "list",
               "tuple", "dict", "type", "isinstance", "getattr", "hasattr", "enumerate", "zip", "range", "any",
               "all", "bool", "print", "unwrap_model", "get_rank", "get_world_size", "is_main_process", "vars", "open"}
_ID_CALLS = ("tempfile.mkdtemp", "tempfile.mktemp", "uuid.uuid1", "uuid.uuid4", "time.strftime", "time.asctime",
             "time.ctime", "socket.gethostname", "secrets.token_hex")
_PATH_SINKS = ("os.path.join", "os.makedirs", "os.mkdir", "open", "torch.save", "pathlib.Path", "shutil.",
               "SummaryWriter")


@dataclass
class Wrap:
    name: str  # dotted, as written in the statement: `model`, `self.net`
    before: bool  # before the anchor small statement (else after its line)
    anchor: cst.CSTNode  # a small statement (before) or a line (after)
    find_unused: bool = False
    existing: bool = False  # the script wraps it already (an earlier run, or its own DDP)


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


def ddp_plan(ctx) -> "DdpPlan":
    return ctx.shared("ddp-plan", DdpPlan)


def main_block(module: cst.Module) -> Optional[cst.If]:
    for stmt in reversed(module.body):
        if isinstance(stmt, cst.If) and _MAIN_TEST.search(cst.Module(body=[]).code_for_node(stmt.test)):
            return stmt
    return None


def _executable(stmt: cst.CSTNode) -> bool:
    """Does a module-level statement run code when the script starts (not a definition, an
    import or a constant)?"""
    if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
        return False
    if isinstance(stmt, cst.If) and _MAIN_TEST.search(cst.Module(body=[]).code_for_node(stmt.test)):
        return False
    if isinstance(stmt, cst.Try):
        body = stmt.body.body if isinstance(stmt.body, cst.IndentedBlock) else []
        return not all(isinstance(s, cst.SimpleStatementLine) and all(
            isinstance(x, (cst.Import, cst.ImportFrom)) for x in s.body) for s in body)
    if isinstance(stmt, cst.SimpleStatementLine):
        for small in stmt.body:
            if isinstance(small, (cst.Import, cst.ImportFrom, cst.Pass)):
                continue
            if isinstance(small, cst.Expr) and isinstance(small.value, (cst.SimpleString, cst.ConcatenatedString)):
                continue  # a docstring
            if isinstance(small, (cst.Assign, cst.AnnAssign)) and small.value is not None and \
                    not _has_call(small.value):
                continue  # a constant
            return True
        return False
    return True


def device_definition(stmt: cst.CSTNode, qualify, helpers: Tuple[str, ...] = ("get_device",)) -> bool:
    """`device = get_device()` of the runtime (what the device pass writes; `helpers` also
    `grad_scaler`, the amp pass's): it runs code, but does not make a script of a module that
    only defines things."""
    if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
        return False
    small = stmt.body[0]
    return isinstance(small, cst.Assign) and len(small.targets) == 1 and isinstance(small.targets[0].target, cst.Name) \
        and isinstance(small.value, cst.Call) and runtime_helper(qualify(small.value.func)) in helpers


def _has_call(node: cst.CSTNode) -> bool:
    stack = [node]
    while stack:
        current = stack.pop()
        if isinstance(current, cst.Call):
            return True
        stack.extend(current.children)
    return False


class DdpPlan:
    def __init__(self, ctx) -> None:
        self.ctx = ctx
        self.model = script_model(ctx)
        self.reviews: List[Tuple[cst.CSTNode, str]] = []
        self.notes: List[Tuple[cst.CSTNode, str]] = []  # decisions a reviewer should know about
        self.declined: Set[str] = set()  # review messages that say the file does not get --to ddp
        self._wrapped_memo: Dict[int, bool] = {}
        self._visited: Optional[Set[Tuple[str, int]]] = None  # the walk of wrapped_reference

    @property
    def s(self):
        return self.model.s

    # -- is this a training script? ------------------------------------------------------
    @cached_property
    def entry(self) -> Optional[Tuple[str, Optional[cst.If]]]:
        """Where the script starts running: ("module", None) for module-level code, ("main",
        the `if __name__ == "__main__":` block) for a script whose code all runs from there."""
        module = self.ctx.module
        if any(_executable(stmt) and not device_definition(stmt, self.model.qualify, ("get_device", "grad_scaler"))
               for stmt in module.body):
            return ("module", None)
        block = main_block(module)
        if block is not None and isinstance(block.body, cst.IndentedBlock):
            return ("main", block)
        return None

    @cached_property
    def script(self) -> bool:
        """Part of a program that uses torch: a script that runs code, or a module of its
        project that a script imports (a trainer class in solver.py: one program with it)."""
        return self.model.uses_torch and (self.entry is not None or bool(self.drivers)) or self.driver  # one
        # that imports no torch but drives a trainer module that does

    @cached_property
    def drivers(self) -> List[Any]:
        """The project's scripts beside this module that import it (rewriter/project.py)."""
        project = self.ctx.options.get("project")
        return [link for link in getattr(project, "importers", ()) if link.script]

    @cached_property
    def trained_in(self) -> List[Any]:
        """The project modules this script imports whose code trains (`.backward()`)."""
        project = self.ctx.options.get("project")
        return [link for link in getattr(project, "imports", ()) if "backward" in link.calls]

    @cached_property
    def driver(self) -> bool:
        """A script that trains through a module of its project (`Agent(...).train()`): it
        joins the process group and keeps its outputs to rank 0; the module gets the rest."""
        return self.entry is not None and not self.model.has_training and bool(self.trained_in)

    @cached_property
    def active(self) -> bool:
        """The ddp edits apply: a program that trains, here or in a module of its project.
        Scripts without training (inference, evaluation) are left to the device fixes, with
        a note."""
        if not self.script:
            return False
        if self.driver:
            for link in self.trained_in:
                if link.in_run:
                    self.notes.append((self.ctx.module.body[0], f"training happens in {link.path}: migrated with "
                                                                "this script as one program"))
                else:
                    self._decline(self.ctx.module.body[0], f"training happens in {link.path}, which this run does "
                                  "not migrate: migrate it too (`gpumigrate <its folder> --to ddp`), or each rank "
                                  "trains alone")
            return True
        if not self.model.has_training:
            if self.entry is None or self.drivers and self.entry[0] == "module":
                return False  # a module of the program (its models, its data) that a script imports: nothing to say
            first = self.ctx.module.body[0] if self.ctx.module.body else self.ctx.module
            self._decline(first, "no training found (no `.backward()` or `optimizer.step()`): nothing to distribute, "
                                 "so --to ddp made only the device changes; run it with python")
            return False
        if self.entry is None:
            for link in self.drivers:
                if not link.in_run:
                    self._decline(self.ctx.module.body[0], f"this module trains for {link.path}, which this run "
                                  "does not migrate: migrate it too (`gpumigrate <its folder> --to ddp`): it must "
                                  "call setup_distributed() first, or each rank trains alone")
        return True

    def _decline(self, where: cst.CSTNode, why: str) -> None:
        self.reviews.append((where, why))
        self.declined.add(why)

    @cached_property
    def lone_trainer(self) -> Optional[str]:
        """Why a module that trains but is no script, and that no script of this run
        imports, gets only the device changes (None: not such a module)."""
        if self.script or not self.model.uses_torch or not self.model.has_training:
            return None
        why = ("this module trains (`.backward()`), but running it runs nothing, and no script beside it imports it: "
               "--to ddp made only the device changes; migrate it with the script that runs it "
               "(`gpumigrate <their folder> --to ddp`)")
        self.declined.add(why)
        return why

    # -- models --------------------------------------------------------------------------
    @cached_property
    def wraps(self) -> List[Wrap]:
        if not self.active:
            return []
        out: List[Wrap] = []
        if self._double_backward:
            return out  # DDP cannot average gradients of a gradient: nothing is wrapped (a blocker)
        if self.driver:
            # its models train in code this file cannot read (`self.G.sample_latent()`, a gradient
            # penalty, `trainer.G.state_dict()`): a DDP wrapper there is unproven; the step hooks
            # average them whatever that code does
            return out
        for model in self.model.trained_models:
            if model.loss_module:
                continue
            wrap = self._wrap_point(model)
            if wrap is not None:
                wrap.find_unused = self._conditional_forward(model)
                out.append(wrap)
        return out

    def _conditional_forward(self, model: TrainedModel) -> bool:
        """Does the model's forward (or a forward of a module class of this file it holds)
        branch on what it is given? Then some parameters may get no gradient in a step, which
        DDP must be told (`find_unused_parameters=True`). Branches on the module's own settings
        (`if self.downsample:`) are the same every step and need no such cost."""
        cls = self.s.instance_class(cst.parse_expression(model.name), model.scope) if "." not in model.name else None
        if cls is None:
            _, bindings = self.s.lookup(model.name, model.scope)
            calls = [b.value for b in bindings if b.how == "assign" and isinstance(b.value, cst.Call)]
            names = {c.func.value for c in calls if isinstance(c.func, cst.Name)}
            classes = [self.s.classes_by_name[n] for n in names if n in self.s.classes_by_name]
        else:
            classes = [cls]
        seen: Set[int] = set()
        while classes:
            current = classes.pop()
            if id(current.node) in seen:
                continue
            seen.add(id(current.node))
            forward = self.s.method(current, "forward")
            if forward is not None and any(self._dynamic(test.test, forward) for test in self.s.own(forward.node, cst.If)):
                return True
            for bindings in current.attrs.values():  # submodules: self.block = Block(...)
                for b in bindings:
                    if isinstance(b.value, cst.Call) and isinstance(b.value.func, cst.Name) and \
                            b.value.func.value in self.s.classes_by_name:
                        classes.append(self.s.classes_by_name[b.value.func.value])
        return False

    def _dynamic(self, test: cst.BaseExpression, forward: Function) -> bool:
        """A test on the forward's inputs or locals (not only on `self.` settings and constants)."""
        skip = set()
        for node in self.s.index.subtree(test):
            if isinstance(node, cst.Attribute):
                skip.add(id(node.attr))
                if isinstance(node.value, cst.Name) and node.value.value == "self":
                    skip.add(id(node.value))
            elif isinstance(node, cst.Name) and id(node) not in skip and node.value not in ("True", "False", "None") \
                    and node.value in forward.scope.bindings:
                return True
        return False

    def _wrap_point(self, model: TrainedModel) -> Optional[Wrap]:
        """Right before the statement that builds the model's optimizer, after the model
        reached its device; when the optimizer is built elsewhere (a function of its own),
        right after the model's last binding or move. None where the script wraps it already,
        on a path torchrun takes; a wrap of its own that torchrun may not reach (`if
        args.distributed:`) gets ours too (wrap_model leaves a DDP as it is)."""
        for b in self._own_wraps(model):
            if self._taken(b):
                return Wrap(model.name, False, self.s.line(b.stmt), existing=True)
        anchors = []
        for opt in model.optimizers:
            if self.s.scope(opt.site) is model.scope:
                anchors.append(self.s.statement(opt.site))
        moves = self._moves(model)
        if anchors:
            anchor = min(anchors, key=self.s.order)
            line = self.s.line(anchor)
            later = [m for m in moves if self.s.order(m) > self.s.order(anchor)]
            if later:
                last = self._in_block(max(later, key=self.s.order), line)
                return Wrap(model.name, False, last) if last is not None else None
            return Wrap(model.name, True, anchor)
        return self._made_here(model, [b.stmt for b in self._bindings(model)], moves)

    def _made_here(self, model: TrainedModel, bindings: List[cst.CSTNode], moves: List[cst.CSTNode]) -> Optional[Wrap]:
        """Where the model is made and moved, when its optimizer is built elsewhere (a
        function it is passed to, a helper module, a `global` set in main()): right after its
        last binding or move, in the block that makes it (a move in a branch: after the
        branch), and only if nothing there has used the model yet (a call it is passed to may
        train it: the wrap must come before). None where that does not hold: the runtime then
        averages its gradients at the optimizer step instead."""
        if not bindings:
            return None
        made = self.s.line(max(bindings, key=self.s.order))
        home = self.s.block(made) if made is not None else None
        last = self._in_block(max([*bindings, *moves], key=self.s.order), made) if home is not None else None
        if last is None or isinstance(last, (cst.For, cst.While)) or self.s.order(last) < self.s.order(made):
            return None
        body = list(home.body)
        region = body[body.index(made):body.index(last) + 1]
        allowed = {id(n) for point in [*bindings, *moves] for n in self.s.index.subtree(point)}
        for line in region:
            if self.model.trains(line):
                return None
            for node in self.s.index.subtree(line):
                if id(node) not in allowed and isinstance(node, (cst.Name, cst.Attribute)) and \
                        dotted(node) == model.name and not self._is_target(node):
                    return None  # used before the wrap could go in
        return Wrap(model.name, False, last)

    def _is_target(self, node: cst.CSTNode) -> bool:
        parent = self.s.parent(node)
        return isinstance(parent, (cst.AssignTarget, cst.Global)) or isinstance(parent, cst.NameItem)

    def _own_wraps(self, model: TrainedModel) -> List[Any]:
        """The bindings that wrap `model` (`model = DistributedDataParallel(model, ...)`, or
        wrap_model): where it is bound, or, in the function that builds its optimizer, of the
        parameter it is handed as (`def train(args, model)` of the transformers examples)."""
        bindings = list(self._bindings(model))
        for opt in model.optimizers:
            scope = self.s.scope(opt.call)
            if scope is not model.scope:
                bindings += [b for name in scope.params for b in scope.bindings.get(name, ())
                             if isinstance(b.value, cst.Call) and b.value.args
                             and dotted(b.value.args[0].value) == name]
        return [b for b in bindings if b.how == "assign" and isinstance(b.value, cst.Call) and
                (self.model.qualify(b.value.func) or "").endswith(("wrap_model", "DistributedDataParallel"))]

    def _taken(self, wrap: Any) -> bool:
        """A wrap that holds under torchrun: wrap_model anywhere (an earlier run's, which went
        where the model is made, or a DDP of the script's that GM413 turned into one once its
        condition was weighed), or a DDP on a path torchrun provably takes."""
        return runtime_helper(self.model.qualify(wrap.value.func)) == "wrap_model" or \
            self.torchrun.unmet(wrap.stmt) is None

    @cached_property
    def torchrun(self) -> Torchrun:
        """The script's conditions under torchrun, its launcher options with the defaults
        GM405 gives them."""
        return Torchrun(self.model, env_defaults="GM405" in self.ctx.fixing)

    def _bindings(self, model: TrainedModel):
        if model.name.startswith("self."):
            out = []
            for c in self.s.classes.values():
                out.extend(b for b in c.attrs.get(model.name[5:], []) if b.scope is model.scope)
            return out
        return [b for b in model.scope.bindings.get(model.name, []) if b.how not in ("param", "def", "class")]

    def _moves(self, model: TrainedModel) -> List[cst.CSTNode]:
        """Statements that move the model to its device: `model.to(device)`, `model.cuda()`."""
        out = []
        for node in self.s.index.subtree(model.scope.node):
            if isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) and \
                    node.func.attr.value in ("to", "cuda", "half", "float", "double") and \
                    dotted(node.func.value) == model.name and self.s.scope(node) is model.scope:
                stmt = self.s.statement(node)
                if isinstance(stmt, (cst.Expr, cst.Assign)):
                    out.append(stmt)
        return out

    def _in_block(self, stmt: cst.CSTNode, line: cst.CSTNode) -> Optional[cst.CSTNode]:
        """The line holding `stmt` that sits in the same block as `line`."""
        block = self.s.block(line)
        current: Optional[cst.CSTNode] = self.s.line(stmt)
        while current is not None and self.s.block(current) is not block:
            current = self.s.line(self.s.parent(current)) if self.s.parent(current) is not None else None
        return current

    @cached_property
    def unwrapped(self) -> List[Tuple[cst.CSTNode, str]]:
        """What DDP does not average, and why: those parameters are averaged at the optimizer
        step instead (`averaging` says so). Each entry is (where, why not wrapped)."""
        if not self.active:
            return []
        out = []
        wrapped = {w.name for w in self.wraps}
        if self._double_backward:
            out.append((self._double_backward, "a gradient taken with create_graph=True and backpropagated again "
                                               "(a gradient penalty), which DDP does not support: no model is "
                                               "DDP-wrapped"))
            return out
        for opt in self.model.optimizers:
            if opt.functional:
                out.append((opt.site, "this optimizer trains tensors, not a module (a functional model): there is "
                                      "nothing to DDP-wrap"))
            elif not opt.resolved:
                out.append((opt.site, "which module this optimizer trains cannot be told from here: it is not "
                                      "DDP-wrapped"))
        for model in self.model.trained_models:
            if model.loss_module:
                out.append((model.optimizers[0].site, f"`{model.name}` is a loss module with parameters the "
                                                      "optimizer trains: it is not DDP-wrapped"))
            elif model.name not in wrapped:
                out.append((model.optimizers[0].site, f"`{model.name}` is not DDP-wrapped (no place before its "
                                                      "training where it is made and moved)"))
        return out

    def averaging(self) -> List[Tuple[cst.CSTNode, str]]:
        """The parameters trained data-parallel by gradient averaging at the optimizer step."""
        if not self.shard_training:
            return []
        return [(where, f"{why}; its gradients are averaged across ranks at each optimizer step instead "
                        "(data-parallel by gradient averaging: DDP's overlap of communication with backward is "
                        "lost)") for where, why in self.unwrapped]

    @cached_property
    def _double_backward(self) -> Optional[cst.Call]:
        """`torch.autograd.grad(..., create_graph=True)`: the first such call, if any."""
        for node in self.s.index.order:
            if isinstance(node, cst.Call) and self.model.qualify(node.func) in ("torch.autograd.grad",
                                                                                "torch.autograd.functional.jacobian"):
                flag = call_argument(node, "create_graph", 4)
                if flag is not None and not (isinstance(flag, cst.Name) and flag.value == "False"):
                    return node
        return None

    @cached_property
    def shard_training(self) -> bool:
        """Shard the training data of every script that trains through torch.optim
        optimizers: a model DDP wraps has its gradients averaged in backward, and every other
        parameter an optimizer steps has them averaged at the step, by the hooks
        setup_distributed() installs (runtime/averaging.py). So the ranks train one model
        whatever the analysis could prove about the script's shape. Training by hand (no
        optimizer) has no step to average at: its data stays whole."""
        return self.active and (bool(self.model.optimizers) or self._driven_by_optimizers)

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

    def _own_path(self) -> List[Tuple[cst.CSTNode, str]]:
        """One line for a script whose own distributed path (its DDP wrap, its
        DistributedSampler) sits behind a condition torchrun does not provably meet."""
        blocked = []
        for model in self.model.trained_models:
            own = self._own_wraps(model)
            if own and not any(self._taken(b) for b in own):
                blocked.append(self.torchrun.unmet(own[0].stmt))
        for loader in self.model.loaders:
            own = self._own_samplers(loader.call) if loader.role == "train" else []
            if own and all(self.torchrun.unmet(c) is not None for c in own):
                blocked.append(self.torchrun.unmet(own[0]))
        if not blocked or not self.shard_training:
            return []
        test, needed = blocked[0]
        code = " ".join(self.ctx.module.code_for_node(test).split())
        flag = self.torchrun.store_flag(test) if needed else None
        how = f"pass `{flag}` under torchrun to take it" if flag else \
            f"it is taken where `{code}` is {'true' if needed else 'false'}"
        return [(test, f"this script has its own distributed path behind `{code}`, which torchrun alone does not "
                       f"take: {how}; without it the model is wrapped by wrap_model and the training data sharded "
                       "by shard_loader, so the ranks still train one model on their own shards")]

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
        if given is not None:
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
            if self.metrics(loop) is None:
                what = self._blockers.get(id(loop))
                return f"its loop keeps more than sums (`{what}`)" if what else "its loop keeps more than sums"
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
        end = self.s.index.end[id(loop)]
        for name in temporaries - set(accumulators):
            for node in self.s.index.order[end:]:
                if isinstance(node, cst.Name) and node.value == name and self.s.scope(node) is scope:
                    _, bindings = self.s.lookup(name, scope, self.s.order(self.s.statement(node) or node))
                    if any(self.s.index.contains(loop, b.stmt) for b in bindings):
                        return self._blocked(loop, None, f"{name} is read after the loop")
        return accumulators

    def _blocked(self, loop: cst.For, node: Optional[cst.CSTNode], text: str = "") -> None:
        if node is not None:
            text = " ".join(self.ctx.module.code_for_node(node).split())
            text = text if len(text) <= 50 else text[:47] + "..."
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

    # -- where every rank goes ----------------------------------------------------------
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
            if isinstance(ancestor, (cst.For, cst.While)) and self._local_exit(ancestor):
                return False
            if isinstance(ancestor, cst.For) and id(ancestor) in self._unpadded_loops:
                return False
            child = ancestor
        return True

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
        for fn in self.s.functions.values():
            if fn.callers or not isinstance(fn.node, cst.FunctionDef) or fn.cls is not None or any(
                    isinstance(a, (cst.FunctionDef, cst.ClassDef)) for a in self.s.ancestors(fn.node)):
                continue
            refs = [n for n in self.s.index.order if isinstance(n, cst.Name) and n.value == fn.name
                    and n is not fn.node.name]
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
            if kind is None or self._per_rank_file(small.value) or self._to_devnull_file(small.value):
                return None
            verdicts.append(self._safe_args(small.value))
        if self.gated(line, main_only=True) or self._in_gated_function(line) or self.model.rank_query(line) \
                or self._in_logger(line):
            return None  # already on rank 0 only, or written per rank on purpose (`rank%d.txt`)
        return all(verdicts)

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

    def _safe(self, root: cst.CSTNode, call: cst.Call) -> bool:
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

    # -- values the ranks must agree on ---------------------------------------------------
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

    # -- checkpoints ---------------------------------------------------------------------
    def saves_here(self, stmt: cst.CSTNode) -> List[cst.Call]:
        """The `torch.save` calls of a gated line or `with open(...)` block."""
        if id(stmt) not in self.gated_lines and id(stmt) not in self.gated_withs:
            return []
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
        """Inside a method of a logger class of this file: its calls are gated instead."""
        fn = self.s.function(node)
        return fn is not None and fn.cls is not None and self.model._logger_class(fn.cls)

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
            if _opens_for_writing(node) and node.args and node.args[0].keyword is None:
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
                        and node.args and dotted(node.args[0].value) == name and self.s.scope(node) is scope:
                    line = self.s.line(node)
                    if line is not None and isinstance(line, cst.SimpleStatementLine) and \
                            not self._preceded_by_set_epoch(line):
                        out[id(line)] = name
        return out

    def _epoch_bounded(self, line: cst.CSTNode, name: str) -> bool:
        """`for i in range(len(loader)): next(it)`: each pass is one (per-rank) epoch."""
        render = self.ctx.module.code_for_node
        return any(isinstance(loop, cst.For) and f"len({name})" in render(loop.iter).replace(" ", "")
                   for loop in self.s.inside(self.s.block(line) if self.s.block(line) is not None else line, cst.For))

    def _preceded_by_set_epoch(self, line: cst.CSTNode) -> bool:
        block = self.s.block(line)
        body = list(block.body) if block is not None else []
        k = next((i for i, s in enumerate(body) if s is line), 0)
        return k > 0 and "set_epoch" in cst.Module(body=[]).code_for_node(body[k - 1])

    # -- references to wrapped models -----------------------------------------------------
    def wrapped_reference(self, expr: cst.BaseExpression) -> bool:
        """Does `expr` (a name or `self.x`) hold a model this plan wraps, where it stands?
        Uses before the wrap, and names that hold something else there (an imported module
        called `model`), do not."""
        # Reachability over assignments, returns and call arguments: one query walks each
        # node once (a node already visited adds no new fact), so recursive helpers with many
        # callers cost a linear walk, not one per path. A True is a proof and is kept; a
        # False is exact only for the query that started the walk.
        memo = self._wrapped_memo
        if id(expr) in memo:
            return memo[id(expr)]
        top = self._visited is None
        if top:
            self._visited = set()
        elif ("ref", id(expr)) in self._visited:
            return False
        self._visited.add(("ref", id(expr)))
        try:
            result = self._wrapped_reference(expr)
        finally:
            if top:
                self._visited = None
        if result or top:
            memo[id(expr)] = result
        return result

    def _wrapped_reference(self, expr: cst.BaseExpression) -> bool:
        name = dotted(expr)
        if name is None:
            return False
        for wrap in self.wraps:
            if wrap.name != name:
                continue
            model = next(t for t in self.model.trained_models if t.name == name and not t.loss_module)
            if name.startswith("self."):
                return True
            found, bindings = self.s.lookup(name, self.s.scope(expr), self.s.order(self.s.statement(expr) or expr))
            if found is model.scope:
                if self.s.scope(expr) is not model.scope:
                    return True  # a function using the global (or enclosing) model: runs later
                after = self.s.order(wrap.anchor) if wrap.before else self.s.index.end[id(wrap.anchor)]
                return self.s.order(expr) >= after
            if bindings and all(b.how == "param" for b in bindings):
                fn = self.s.functions.get(id(found.node)) if found is not None else None
                if fn is not None and self._passed_wrapped(fn, bindings[0].name):
                    return True
        if isinstance(expr, cst.Name):
            return self._returned_wrapped(expr)
        return False

    def _returned_wrapped(self, expr: cst.Name) -> bool:
        """`model, optimizer = build()` where `build` returns the model it wrapped."""
        if ("ret", id(expr)) in self._visited:
            return False
        self._visited.add(("ret", id(expr)))
        scope = self.s.scope(expr)
        found, bindings = self.s.lookup(expr.value, scope, self.s.order(self.s.statement(expr) or expr))
        for b in bindings:
            if b.how == "param" and found is not None:
                fn = self.s.functions.get(id(found.node))
                if fn is not None and self._passed_wrapped(fn, b.name):
                    return True
            if b.how not in ("assign", "unpack") or not isinstance(b.value, cst.Call):
                continue
            callee = self.s.callee(b.value)
            if callee is None:
                continue
            for ret in callee.returns:
                value = ret
                if b.how == "unpack" and isinstance(ret, (cst.Tuple, cst.List)) and b.path and \
                        b.path[0] < len(ret.elements):
                    value = ret.elements[b.path[0]].value
                if dotted(value) is not None and (self.wrapped_reference(value) or (
                        isinstance(value, cst.Name) and self._returned_wrapped(value))):
                    return True
        return False

    def _passed_wrapped(self, fn: Function, param: str) -> bool:
        position = fn.position(param)
        for call in fn.callers:
            arg = call_argument(call, param, position)
            if arg is not None and dotted(arg) is not None and self.wrapped_reference(arg):
                return True
        return False

    # -- values the ranks must agree on --------------------------------------------------
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
            out[id(node)] = self.uniform(node) and not self._in_loop(node)
        return out

    def _in_loop(self, node: cst.CSTNode) -> bool:
        for ancestor in self.s.ancestors(node):
            if isinstance(ancestor, (cst.For, cst.While)):
                return True
            if isinstance(ancestor, (cst.FunctionDef, cst.Lambda)):
                return False
        return False

    # -- what a reviewer must know -------------------------------------------------------
    def review_items(self) -> List[Tuple[cst.CSTNode, str]]:
        """Everything the migration could not prove, and the choices a human should check."""
        items = list(self.reviews)
        first = (self.model.backward_calls or self.model.step_calls or self.ctx.module.body)[0]
        # a driver's training, optimizers and data are its trainer module's to report; a trainer
        # module's optimizers may be its script's
        if not self.model.optimizers and not self.driver and not self._driven_by_optimizers:
            why = ("training found, but no torch.optim optimizer (updates by hand?): nothing is averaged across "
                   "ranks and the data is not sharded, so each rank trains by itself as one process would; rank 0 "
                   "prints and saves")
            self.declined.add(why)
            items.append((first, why))
        if self.shard_training and not self.driver and not any(l.role in ("train", "flag") for l in self.model.loaders) \
                and not self.foreign_loaders and not self.foreign_params and not self.foreign_iterations \
                and not self._rebuilt_loaders:
            items.append((first, "training data does not come from a DataLoader the migration can follow: it is not sharded; every rank "
                                 "draws its batches as the script does (the same ones where their order is seeded alike, "
                                 "others where it is not) and the gradients are averaged, so the ranks keep one model "
                                 "(correct, but no faster); shard the index range by get_rank()/get_world_size() by "
                                 "hand"))
        for loader in self.model.loaders:
            edit = self.sharded(loader.call)
            batch = call_argument(loader.call, "batch_size", 1)
            size = self.ctx.module.code_for_node(batch) if batch is not None else "1"
            if edit is not None and edit.kind in ("train", "flag"):
                items.append((loader.call, f"the effective batch size is now WORLD_SIZE x {size}: scale the "
                                           "learning rate (and schedules counted in steps) if needed"))
                if not loader.holders:
                    items.append((loader.call, "a training DataLoader built where it is iterated: `set_epoch` "
                                               "cannot reach its sampler, so every epoch has the same order; "
                                               "build it once, before the epoch loop"))
            if loader.role == "eval" and (edit is None or not edit.eval_sharded) and self.shard_training:
                why = self.why_whole(loader) or "its DataLoader call cannot take a sampler here"
                items.append((loader.call, f"evaluation not sharded ({why}): every rank evaluates the whole set "
                                           "and gets the same numbers; correct, not faster"))
            if edit is not None and edit.kind == "flag" and not edit.eval_sharded:
                items.append((loader.call, f"evaluation (`{edit.flag}` false) not sharded ({self.why_whole(loader)}): "
                                           "every rank evaluates the whole set and gets the same numbers; correct, "
                                           "not faster"))
            if loader.role == "both" and self.shard_training:
                items.append((loader.call, "this loader is used for training and for evaluation: not sharded"))
        for line_id, name in self.rebuild_points().items():
            line = next(n for n in self.s.index.order if id(n) == line_id)
            if self._epoch_bounded(line, name):
                continue
            items.append((line, f"iteration-based training: an epoch of `{name}` is now len(dataset) / WORLD_SIZE "
                                "samples per rank, and the same number of iterations trains on WORLD_SIZE times "
                                "the data"))
        for save in self._unsafe_barriers():
            items.append((save, "this save runs where not every rank goes equally often: no barrier was added, "
                                "so another rank may read the checkpoint before rank 0 wrote it"))
        for node in self._rank_local_exits():
            items.append((node, "a loop exit decided on a rank-local value (this rank's loss, an exception): "
                                "ranks may stop at different steps and DDP then hangs; decide on a reduced value"))
        items.extend((node, "a GPU chosen by index in every process: under torchrun each process needs its own "
                            "(LOCAL_RANK's), which `get_device()` without an index gives")
                     for node in self._indexed_devices())
        items.extend(self._foreign_helpers())
        seeds = [c for c in self.s.index.order if isinstance(c, cst.Call) and self.model.qualify(c.func) in (
            "torch.manual_seed", "random.seed", "numpy.random.seed")]
        if seeds and self.shard_training:
            items.append((seeds[0], "every rank seeds the same: random augmentation and dropout repeat across "
                                    "ranks; add get_rank() to the seed if they should differ"))
        items.extend(self._own_path())
        return items

    def _foreign_helpers(self) -> List[Tuple[cst.CSTNode, str]]:
        """Statements in a training or evaluation loop that only call a function imported from
        the project's own files (`progress_bar(...)` from utils.py): it may print or write on
        every rank, and the migration cannot see inside. Once per function."""
        loops = [c.node if isinstance(c.node, (cst.For, cst.While)) else next(
            (a for a in self.s.ancestors(c.node) if isinstance(a, (cst.For, cst.While))), None)
            for l in self.model.loaders for c in l.consumers]
        seen: Set[str] = set()
        out = []
        for loop in loops:
            if loop is None:
                continue
            for expr in self.s.own(loop, cst.Expr):
                call = expr.value
                if not isinstance(call, cst.Call) or not isinstance(call.func, (cst.Name, cst.Attribute)):
                    continue
                qualified = self.model.qualify(call.func) or ""
                top = qualified.split(".")[0]
                if not qualified or qualified in seen or top in _LIBRARIES or self.model.output_call(call):
                    continue
                seen.add(qualified)
                out.append((call, f"`{qualified}` comes from another file of the project: if it prints or writes, "
                                  "it does so on every rank; put it under `if is_main_process():` if it only reports"))
        return out

    def _indexed_devices(self) -> List[cst.CSTNode]:
        """`torch.device("cuda", args.gpu)`, `"cuda:1"`, `.cuda(1)`: kept as the script's choice
        (`get_device(args.gpu)`), which under DDP puts every process on the same GPU. Model
        parallelism (several indices) is reported as such instead."""
        from gpumigrate.codemods.device_plan import device_plan, torch_device_index  # device facts

        if device_plan(self.ctx).multi_index:
            return []
        out = []
        for node in self.s.index.order:
            if not isinstance(node, cst.Call):
                continue
            if self.model.qualify(node.func) == "torch.device":
                is_cuda, index = torch_device_index(node)
                second = call_argument(node, "index", 1)
                if is_cuda and ((index is not None and index > 0) or (
                        second is not None and not isinstance(second, cst.Integer)
                        and "local_rank" not in self.ctx.module.code_for_node(second).lower())):
                    out.append(node)
            elif (isinstance(node.func, cst.Attribute) and node.func.attr.value == "cuda"
                  or runtime_helper(self.model.qualify(node.func)) == "get_device") and node.args:
                # `.cuda(i)`, and what the device pass made of it and of `torch.device("cuda", i)`
                arg = node.args[0].value
                if node.args[0].keyword is None and not (isinstance(arg, cst.Integer) and arg.value == "0") \
                        and "local_rank" not in self.ctx.module.code_for_node(arg).lower() \
                        and not self.torchrun.is_none(arg):  # `--gpu` not passed: get_device() picks LOCAL_RANK's
                    out.append(node)
        return out

    def _unsafe_barriers(self) -> List[cst.Call]:
        if not self.reloads:
            return []
        out = []
        for node in self.s.index.order:
            if isinstance(node, (cst.SimpleStatementLine, cst.With)) and self.saves_here(node) and \
                    not self.uniform(node):
                out.append(self.saves_here(node)[0])
        return out

    def _rank_local_exits(self) -> List[cst.CSTNode]:
        """`break`/`continue`/`return` in a training loop, decided on a rank-local value or in
        an exception handler (an out-of-memory skip happens on one rank)."""
        out = []
        if not self.shard_training:
            return out
        for loop in self.model.training_loops_list:
            for node in self.s.own(loop, (cst.Break, cst.Continue, cst.Return)):
                for ancestor in self.s.ancestors(node):
                    if ancestor is loop:
                        break
                    if isinstance(ancestor, cst.ExceptHandler) or (
                            isinstance(ancestor, cst.If) and self.model.rank_local_test(ancestor)
                            and not self.gate_test(ancestor.test)):
                        out.append(node)
                        break
        return out



def _devnull_already(call: cst.Call) -> bool:
    """`open(path if is_main_process() else os.devnull, ...)`, from an earlier run."""
    first = call.args[0].value if call.args else None
    return isinstance(call.func, cst.Name) and call.func.value == "open" and isinstance(first, cst.IfExp) \
        and cst.Module(body=[]).code_for_node(first.orelse) == "os.devnull"


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


def _opens_for_writing(node: cst.CSTNode) -> bool:
    """A call of the builtin `open` in a writing mode."""
    return isinstance(node, cst.Call) and isinstance(node.func, cst.Name) and node.func.value == "open" \
        and v.opens_for_writing(node)
