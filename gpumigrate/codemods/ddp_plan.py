"""The ddp migration's decisions for one file, made once from the script model.

Every rule of the ddp target asks this plan instead of deciding for itself, so the edits fit
together: training data is sharded wherever torch.optim optimizers train (a wrapped model's
gradients are averaged by DDP, every other one's at the optimizer step); evaluation is
sharded only when its metrics are provably reduced; a collective is inserted only where every
rank provably reaches it equally often; rank-0 gates and collectives come after
`setup_distributed()`. What cannot be established takes the safe form and becomes a review
item (`reviews`), reported by GM400.

This module decides whether the file is part of a program that trains (`script`, `driver`,
`active`, `entry`) and gathers what a reviewer must know (`review_items`). `DdpPlan` holds the
plan's state (`ctx`, `model`, `s`, the review lists) and mixes in the other decisions, one
module per concern in `gpumigrate/codemods/ddp/`, each readable alone:

- `wrap.py`: where DistributedDataParallel wraps which model, and which names hold it;
- `data.py`: what to shard (samplers, loaders rebuilt per rank, `set_epoch`, per-rank sizes);
- `loops.py`: where a training loop's data is sharded as it iterates (`shard_batches`), for
  every nest that no construction-site edit of data.py shards;
- `reduce.py`: what to reduce over ranks (evaluation metrics, training sums);
- `rank0.py`: what runs on rank 0 only (outputs, checkpoints, barriers after writes) and the
  values the ranks must agree on;
- `reach.py`: where every rank goes (rank-0 branches, code every rank reaches equally often).

Importers use this module: `ddp_plan(ctx)`, `DdpPlan`, `Wrap`, `LoaderEdit`, `main_block`,
`device_definition`.
"""

from __future__ import annotations

import ast
import re
from functools import cached_property
from typing import Any, Dict, List, Optional, Set, Tuple

import libcst as cst

from gpumigrate.analysis import script_model
from gpumigrate.analysis.launch import DISTRIBUTED_SAMPLERS, Torchrun
from gpumigrate.analysis.structure import dotted
from gpumigrate.analysis.syntax import runtime_helper
from gpumigrate.analysis.values import call_argument
from gpumigrate.codemods.ddp.data import LoaderEdit, Sharding  # noqa: F401  (LoaderEdit: re-exported)
from gpumigrate.codemods.ddp.loops import BatchSite, TrainingLoops  # noqa: F401  (BatchSite: re-exported)
from gpumigrate.codemods.ddp.rank0 import RankZero
from gpumigrate.codemods.ddp.reach import Reach
from gpumigrate.codemods.ddp.reduce import Reductions
from gpumigrate.codemods.ddp.wrap import Wrap, Wraps  # noqa: F401  (Wrap: re-exported)
from gpumigrate.codemods.helpers import project_module
from gpumigrate.rewriter.project import stateful_classes

# collectives a module that keeps its state consistent across ranks calls itself
_GATHERS = frozenset({"all_gather", "all_gather_into_tensor", "concat_all_gather", "all_reduce", "broadcast"})


def _buffer_classes(stateful) -> Set[str]:
    """The classes of "Class:registrar:attr" entries whose state is a registered buffer."""
    return {entry.split(":")[0] for entry in stateful if entry.split(":")[1] == "register_buffer"}

_INIT_GROUP = ("torch.distributed.init_process_group", "torch.distributed.distributed_c10d.init_process_group")
_OWN_WRAPS = ("torch.nn.parallel.DistributedDataParallel", "torch.nn.parallel.distributed.DistributedDataParallel",
              "torch.distributed.fsdp.FullyShardedDataParallel", "torch.distributed.fsdp.fully_shard",
              "torch.distributed._composable.fsdp.fully_shard", "apex.parallel.DistributedDataParallel",
              "apex.parallel.distributed.DistributedDataParallel")
_MAIN_TEST = re.compile(r"""__name__\s*==\s*['"]__main__['"]|['"]__main__['"]\s*==\s*__name__""")
# Hyperparameter searches: each trial builds and trains a model of the hyperparameters it drew.
_SEARCHES = frozenset({"optuna.create_study", "optuna.study.create_study", "hyperopt.fmin", "ray.tune.run",
                       "ray.tune.Tuner", "ray.tune.tuner.Tuner"})

# Top-level packages that are not the project's own files (for calls the migration cannot read).
_LIBRARIES = frozenset({
    "torch", "torchvision", "torchaudio", "torchtext", "numpy", "scipy", "pandas", "sklearn", "matplotlib", "PIL",
    "cv2", "tqdm", "os", "sys", "math", "time", "random", "json", "logging", "shutil", "pickle", "csv", "re",
    "argparse", "collections", "itertools", "functools", "datetime", "pathlib", "tempfile", "warnings", "copy",
    "gpumigrate", "gpumigrate_runtime", "transformers", "timm", "apex", "wandb", "tensorboardX", "visdom", "yaml", "h5py", "glob",
    "subprocess", "socket", "uuid", "typing", "io", "gc", "contextlib", "operator", "string", "struct", "signal",
})


def ddp_plan(ctx) -> "DdpPlan":
    return ctx.shared("ddp-plan", DdpPlan)


def main_block(module: cst.Module) -> Optional[cst.If]:
    for stmt in reversed(module.body):
        if isinstance(stmt, cst.If) and _MAIN_TEST.search(cst.Module(body=[]).code_for_node(stmt.test)):
            return stmt
    return None


def _executable(stmt: cst.CSTNode, index) -> bool:
    """Does a module-level statement run code when the script starts (not a definition, an
    import or a constant)? `index`: the file's pre-order index."""
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
                    not any(isinstance(n, cst.Call) for n in index.subtree(small.value)):
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


class DdpPlan(Wraps, Sharding, TrainingLoops, Reductions, RankZero, Reach):
    """One file's ddp decisions, built once by `ddp_plan(ctx)`. Here: the plan's state, whether
    the file is part of a program that trains, and what a reviewer must know; the other decisions
    come from the mixins, one module per concern in gpumigrate/codemods/ddp/."""

    def __init__(self, ctx) -> None:
        self.ctx = ctx
        self.model = script_model(ctx)
        self.reviews: List[Tuple[cst.CSTNode, str]] = []
        self.notes: List[Tuple[cst.CSTNode, str]] = []  # decisions a reviewer should know about
        self.declined: Set[str] = set()  # review messages that say the file does not get --to ddp
        self._wrapped_memo: Dict[int, bool] = {}
        self._visited: Optional[Set[Tuple[str, int]]] = None  # the walk of wrapped_reference
        self.own_launch_note: Optional[str] = None  # said where the script distributes itself
        self.library_training: Optional[cst.Call] = None  # the optimizer a library trains with (no backward here)

    @property
    def s(self):
        return self.model.s

    # -- is this a training script? ------------------------------------------------------
    @cached_property
    def entry(self) -> Optional[Tuple[str, Optional[cst.If]]]:
        """Where the script starts running: ("module", None) for module-level code, ("main",
        the `if __name__ == "__main__":` block) for a script whose code all runs from there."""
        module = self.ctx.module
        if any(_executable(stmt, self.s.index) and not device_definition(stmt, self.model.qualify, ("get_device", "grad_scaler"))
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
    def own_launch(self) -> Optional[cst.Call]:
        """The script's own `init_process_group` where torchrun runs it as written (`ddp =
        int(os.environ.get('RANK', -1)) != -1` then `if ddp: init_process_group(...)`, through
        the calls of this file that reach it): a script that already distributes itself under
        torchrun, wraps its model there itself (DDP, FSDP) and splits the work there (its
        DistributedSampler, a count divided by the world size). Its path is kept whole (its
        group, its DDP wrap, its split of the work):
        the migration adds no second group and no second wrap. A path torchrun does not take as
        written (`if args.distributed:` from options torchrun does not pass, or a worker that
        `mp.spawn` starts) is another matter: see DdpSetup._own_init and GM405."""
        as_written = Torchrun(self.model, env_defaults=False)
        calls = list(self.s.index.of(cst.Call))
        init = next((c for c in calls if self.model.qualify(c.func) in _INIT_GROUP and self._reached(c, as_written, 0)),
                    None)
        # and it trains data-parallel there itself (its DDP or FSDP wrap): a group alone, with
        # each rank training by itself, is no path to keep
        # (its DDP may be `wrap_model` already: GM413 of a first pass, which keeps the wrap where it is)
        if init is None or not any((self.model.qualify(c.func) in _OWN_WRAPS or runtime_helper(
                self.model.qualify(c.func)) in ("wrap_model", "shard_model")) and self._reached(c, as_written, 0)
                                   for c in calls):
            return None
        # and splits the work itself there: its DistributedSampler, or a count divided by the world
        # size (nanoGPT's gradient accumulation steps); else the migration's sharding is wanted
        if any(self.model.qualify(c.func) in DISTRIBUTED_SAMPLERS and self._reached(c, as_written, 0) for c in calls):
            return init
        for node in self.s.index.of(cst.AugAssign):
            if isinstance(node.operator, (cst.FloorDivideAssign, cst.DivideAssign)) and \
                    as_written.is_world_size(node.value) and self._reached(node, as_written, 0):
                return init
        return None

    def _reached(self, node: cst.CSTNode, torchrun: Torchrun, depth: int) -> bool:
        """Does torchrun provably run `node` (its conditions, and some call that leads to its function)?"""
        if torchrun.runs(node) is not True:
            return False
        fn = self.s.function(node)
        if fn is None:
            return True
        return depth < 4 and any(self._reached(call, torchrun, depth + 1) for call in fn.callers)

    @cached_property
    def active(self) -> bool:
        """The ddp edits apply: a program that trains, here or in a module of its project.
        Scripts without training (inference, evaluation) are left to the device fixes, with
        a note; so are scripts that distribute themselves under torchrun (`own_launch`)."""
        if not self.script:
            return self.helper_module  # a utility module of the program that imports no torch (its log printer)
        if self.own_launch is not None:
            line = self.ctx.module.code_for_node(self.own_launch.func)
            self.own_launch_note = (f"this script joins the process group itself where torchrun runs it (`{line}(...)`): "
                                    "--to ddp keeps its distributed path as it is (its group, its DDP wrap, how it "
                                    "splits the work) and made the device changes only; launch it with `torchrun "
                                    "--nproc_per_node=NUM_GPUS <script> ARGS`")
            return False
        search = next((c for c in self.s.index.of(cst.Call) if self.model.qualify(c.func) in _SEARCHES), None)
        if search is not None:
            self._decline(search, "a hyperparameter search: under torchrun each rank would run trials of its own "
                                  "(different models, pruned at different steps), which DDP cannot join; --to ddp made "
                                  "only the device changes: run the search with python, or distribute each trial with "
                                  "the library's own support (optuna's TorchDistributedTrial)")
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
                # a module of the program (its models, its data, its utilities) that a script imports: what it
                # prints and writes, every rank would (a `print_network(model)`, a run folder made with
                # exist_ok=False): gated to rank 0 where the script is migrated in this run
                return self.helper_module
            first = self.ctx.module.body[0] if self.ctx.module.body else self.ctx.module
            if self.model.optimizers:
                # a library trains with the script's optimizer (ignite's create_supervised_trainer, a
                # Trainer object): the runtime averages the gradients at each of its steps
                self.library_training = self.model.optimizers[0].call
                return True
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

    @cached_property
    def helper_module(self) -> bool:
        """A module that does not train, imported by a script this run migrates, that prints or
        writes: its outputs move to rank 0 like the script's. It gets nothing else: no
        collective (its functions' callers are in another file, so none is provably reached by
        every rank), no set-up (the script's)."""
        return not self.model.has_training and any(link.in_run for link in self.drivers) and \
            any(self.model.output_call(c) for c in self.s.index.of(cst.Call))

    def _one_step(self, call: cst.CSTNode) -> bool:
        """A backward call under no loop of its own function (one call, one step), or in an
        update a script of the run repeats in its loop (`_repeated_by_a_script`)."""
        if any(self._repeated_by_a_script(nest) for nest in self._nests(call)):
            return True
        for ancestor in self.s.ancestors(call):
            if isinstance(ancestor, (cst.FunctionDef, cst.Lambda)):
                return isinstance(ancestor, cst.FunctionDef)
            if isinstance(ancestor, (cst.For, cst.While)):
                return False
        return False

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

    # -- what a reviewer must know -------------------------------------------------------
    def review_items(self) -> List[Tuple[cst.CSTNode, str]]:
        """Everything the migration could not prove, and the choices a human should check."""
        items = list(self.reviews)
        if self.helper_module:
            return items  # it trains nothing: what follows is about training
        if self.library_training is not None:
            sharded = any(e.kind in ("train", "flag") and e.problem is None for e in self.loader_edits.values())
            items.append((self.library_training, "the training loop is a library's (no `.backward()` here): the "
                          "process group is set up and the gradients are averaged at each step of this optimizer, "
                          "so the ranks keep one model; " + (
                              "check that the loader given a distributed_sampler here is the one the library trains on"
                              if sharded else "the data the library iterates is not sharded (each rank draws its own "
                              "order: correct, not faster); for a speed-up give its training loader "
                              "`sampler=distributed_sampler(dataset)`")))
        first = (self.model.backward_calls or self.model.step_calls or self.ctx.module.body)[0]
        # a driver's training, optimizers and data are its trainer module's to report; a trainer
        # module's optimizers may be its script's
        if not self.model.optimizers and not self.driver and not self._driven_by_optimizers and \
                not self._steps_an_optimizer:
            why = ("training found, but no torch.optim optimizer (updates by hand?): nothing is averaged across "
                   "ranks and the data is not sharded, so each rank trains by itself as one process would; rank 0 "
                   "prints and saves")
            self.declined.add(why)
            items.append((first, why))
        splits = self.row_splits()
        for loop, names in splits:
            items.append((loop, f"the rows (dim 0) of `{'`, `'.join(names)}` are split between the ranks (kept whole, "
                                "with a warning, where they are fewer than the ranks or differ in length): check "
                                "that dim 0 is the batch (samples, not time steps or features); what the loop "
                                "computes from them (a printed loss, a metric) is this rank's share"))
        covered = [call for call in self.model.backward_calls
                   if any(a is loop for loop, _ in splits for a in self.s.ancestors(call))]
        items.extend(self.batch_reviews())
        stepped_by = [link.path for link in self.drivers if link.in_run]
        if self.unsharded_data and len(covered) < len(self.model.backward_calls) and not self.batch_sites \
                and not self.counted_loops and stepped_by and all(self._one_step(c) for c in self.model.backward_calls):
            items.append((first, f"this module takes one training step per call; the loop that repeats it is in "
                                 f"{stepped_by[0]}, whose report says whether it is sharded there (`shard_batches`: "
                                 "each rank takes its share of the steps) or why not"))
        elif self.unsharded_data and len(covered) < len(self.model.backward_calls) and not self.batch_sites \
                and not self.counted_loops:
            items.append((first, "training data does not come from a DataLoader the migration can follow: it is not sharded; every rank "
                                 "draws its batches as the script does (the same ones where their order is seeded alike, "
                                 "others where it is not, as an environment's episodes) and the gradients are averaged, "
                                 "so the ranks keep one model, trained on more data only where their batches differ; for "
                                 "a speed-up, shard the index range by get_rank()/get_world_size() by hand"))
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
            if loader.role == "both" and self.shard_training and not self.iterated_sharded(loader.call):
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
        if seeds and self.shard_training and not any(n is seeds[0] for n, _ in self.notes):
            self.notes.append((seeds[0], "every rank seeds the same; under torchrun the runtime parts the ranks' "
                                         "random streams at the first training loop or step (each reseeded from a "
                                         "draw of its own plus the rank), so augmentation, dropout and random "
                                         "draws differ per rank, and a seed still repeats a run for a world size"))
        items.extend(self._own_path())
        if self.shard_training:
            items.extend((call, f"`{name}` keeps state in buffers its methods update in place (a memory bank, a "
                                "queue): each rank updates its own copy from its own samples; gather the updates "
                                "across ranks (all_gather) if they should be one")
                         for call, name in self._stateful_objects())
        return items

    def _stateful_objects(self) -> List[Tuple[cst.Call, str]]:
        """Objects this file builds from a class with buffers it updates as it runs (read
        from this file, or from the project module it is imported from), unless that module
        gathers across ranks itself (MoCo's queue takes every rank's keys)."""
        classes: Set[str] = set()
        for link in getattr(self.ctx.options.get("project"), "imports", ()):
            if not _GATHERS & set(link.calls):
                classes.update(_buffer_classes(link.stateful))
        if "register_buffer" in self.ctx.text and not _GATHERS & {
                dotted(c.func).rsplit(".", 1)[-1] for c in self.s.index.of(cst.Call) if dotted(c.func)}:
            try:
                classes.update(_buffer_classes(stateful_classes(ast.parse(self.ctx.text))))
            except (SyntaxError, ValueError):  # the text before a repair (`async=True`): the tree is LibCST's
                pass
        if not classes:
            return []
        return [(call, call.func.value) for call in self.s.index.of(cst.Call)
                if isinstance(call.func, cst.Name) and call.func.value in classes]

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
                link = project_module(self.ctx, qualified.rsplit(".", 1)[0]) if "." in qualified else None
                if link is not None and link.in_run:
                    continue  # migrated in this run: its own prints and writes are gated there
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
