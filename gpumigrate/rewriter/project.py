"""A script and the modules of its project it imports are one program: which files of a
run import which modules beside them, and which run code when executed.

A training script often drives a trainer class from another module of its project
(`from solver import Solver`): migrating either file alone, a migration sees half a program.
This reads the imports with Python's own parser (no LibCST, no torch knowledge): each file's
project imports (modules found beside it or in the folders above it), and the project files
beside it that import it. The migration then decides, from the facts of each linked module
(what it calls, whether it is a script), what the file needs.
"""

from __future__ import annotations

import ast
import hashlib
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

from gpumigrate.rewriter.vendor import RUNTIME_PACKAGE, VENDORED_MODULE

_SCAN_LIMIT = 300  # files of one folder read to find who imports a file (a vendored tree is no project)
_ROOTS_UP = 3  # folders above a file where `import pkg.mod` may be rooted


@dataclass(frozen=True)
class Link:
    """A module of the project linked to a file: its path (relative to the working
    directory), what it calls (names of called functions and methods, sorted), whether it
    runs code when executed as a script, whether this run migrates it too, its digest, and
    the names it defines at top level (for `from mod import *`), the methods its classes
    define themselves ("Class.method": an object of its own with a method named like a
    tensor's), and the state its classes register and then update in place (`stateful`,
    "Class:registrar:attr": a memory bank, a queue)."""

    path: str
    calls: Tuple[str, ...]
    script: bool
    in_run: bool
    digest: str
    defines: Tuple[str, ...] = ()
    methods: Tuple[str, ...] = ()
    stateful: Tuple[str, ...] = ()
    steps: Tuple[str, ...] = ()  # functions and methods that take one training step (`_step_functions`)
    looped: Tuple[str, ...] = ()  # names of the functions and methods it calls inside a loop


@dataclass(frozen=True)
class Project:
    """The project around one file: the project modules it imports, and the project
    scripts beside it that import it. Plain sorted tuples: its repr keys the cache."""

    imports: Tuple[Link, ...] = ()
    importers: Tuple[Link, ...] = ()
    # a module beside it takes all its names (`from helpers import *`): an import this file no
    # longer uses may still be used there
    star_imported: bool = False
    # "Class.method" for the static methods that call a function of their own name (`@staticmethod
    # def backward(ctx, dy): torch.autograd.backward(y, dy)`: a backward run inside a backward), or
    # a backward calling a function of the module that does (`block.backward_pass(y, dy)`), in
    # every module its run imports, three imports deep (a model's package whose layers import a
    # module of reversible blocks)
    recursive: Tuple[str, ...] = ()
    # the imports of the project modules it takes all the names of (`from utils import *`, where
    # utils.py has `import torch`): local name -> qualified name, as its own imports are
    star_names: Tuple[Tuple[str, str], ...] = ()


@dataclass
class _Module:
    path: Path
    digest: str
    calls: Tuple[str, ...]
    script: bool
    imports: List[Path]
    defines: Tuple[str, ...] = ()
    star_imports: Tuple[Path, ...] = ()  # what `from X import *` takes all the names of
    methods: Tuple[str, ...] = ()
    stateful: Tuple[str, ...] = ()
    steps: Tuple[str, ...] = ()
    looped: Tuple[str, ...] = ()
    recursive: Tuple[str, ...] = ()  # see Project.recursive
    exports: Tuple[Tuple[str, str], ...] = ()  # its top-level absolute imports: local name -> qualified


class _Reader:
    """Modules read once for the whole run."""

    def __init__(self) -> None:
        self.modules: Dict[Path, Optional[_Module]] = {}

    def get(self, path: Path) -> Optional[_Module]:
        path = path.resolve()
        if path not in self.modules:
            self.modules[path] = _read(path)
        return self.modules[path]


_READ_LIMIT = 2 * 1024 * 1024  # a project module is read whole: no data file, FIFO or device


def _read(path: Path) -> Optional[_Module]:
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode) or st.st_size > _READ_LIMIT:
            return None  # a FIFO would block the run; the engine says what it makes of the file
        data = path.read_bytes()
        tree = _parse(data)
    except (OSError, SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    calls: Set[str] = set()
    imported: List[Tuple[int, str, Tuple[str, ...]]] = []  # (level, module, names)
    on_sys_path: List[ast.Call] = []  # sys.path.insert(...) / append(...)
    looped: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.For, ast.While, ast.AsyncFor)):
            looped.update(_call_name(n) or "" for stmt in node.body for n in ast.walk(stmt) if isinstance(n, ast.Call))
        if isinstance(node, ast.Call):
            func = node.func
            name = _call_name(node)
            if name:
                calls.add(name)
            if name in ("insert", "append") and isinstance(func.value, ast.Attribute) and func.value.attr == "path" \
                    and isinstance(func.value.value, ast.Name) and func.value.value.id == "sys":
                on_sys_path.append(node)
        elif isinstance(node, ast.Import):
            imported.extend((0, alias.name, ()) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.append((node.level, node.module or "", tuple(a.name for a in node.names)))
    found: List[Path] = []
    starred: List[Path] = []
    extra = _path_folders(on_sys_path, path)
    for level, module, names in imported:
        for target in _resolve(path, level, module, names, extra):
            if target not in found and target != path.resolve():
                found.append(target)
            if names == ("*",) and target not in starred:
                starred.append(target)
    defines = tuple(sorted(node.name for node in tree.body
                           if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))))
    recursive = _recursive_methods(tree)
    # a backward that runs a backward (a custom autograd Function's) is no training step
    steps = tuple(name for name in _step_functions(tree) if name not in {r.split(".")[-1] for r in recursive})
    return _Module(path.resolve(), hashlib.sha256(data).hexdigest()[:16], tuple(sorted(calls)),
                   _runs_code(tree), found, defines, tuple(starred),
                   tuple(sorted(f"{c.name}.{f.name}" for c in tree.body if isinstance(c, ast.ClassDef)
                                for f in c.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)))),
                   stateful_classes(tree), steps, tuple(sorted(looped - {""})), recursive, _exports(tree))


def _exports(tree: ast.Module) -> Tuple[Tuple[str, str], ...]:
    """The names a module's top-level imports bind (`from mod import *` takes them too)."""
    out: Dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    out[alias.asname] = alias.name
                else:
                    out[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.update((a.asname or a.name, f"{node.module}.{a.name}") for a in node.names if a.name != "*")
    return tuple(sorted(out.items()))


def _recursive_methods(tree: ast.Module) -> Tuple[str, ...]:
    """See Project.recursive: any class of the module, at any depth."""
    out: Set[str] = set()
    # the module's functions that run a backward (`def backward_pass(self, y, dy)` of a block,
    # called from the Function's backward): looked for once a static `backward` is found
    backwards: Optional[Set[str]] = None
    for cls in ast.walk(tree):
        if not isinstance(cls, ast.ClassDef):
            continue
        for fn in cls.body:
            if not isinstance(fn, ast.FunctionDef) or not any(
                    isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list):
                continue
            if fn.name == "backward" and backwards is None:
                backwards = {f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and any(
                    isinstance(node, ast.Call) and _call_name(node) == "backward" for node in ast.walk(f))}
            names = {fn.name, *backwards} if fn.name == "backward" and backwards else {fn.name}
            if any(isinstance(node, ast.Call) and _call_name(node) in names for node in ast.walk(fn)):
                out.add(f"{cls.name}.{fn.name}")
    return tuple(sorted(out))


def _call_name(call: ast.Call) -> Optional[str]:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None


def _step_functions(tree: ast.Module) -> Tuple[str, ...]:
    """The names of the functions and methods that take one training step per call, so a
    script's loop around the calls (one that makes the data) is the training loop:
    - those that call `.backward()` outside any loop of their own (`def optimize_D(self, gen):
      ... loss.backward(); self.opt.step()`);
    - updates over data the object already holds (PPO's epochs over its rollout: `.backward()`
      only in loops over `range(...)`, and no `next()`, `yield` or `env.step(action)` to bring
      data of their own)."""
    out: Set[str] = set()

    def visit(node: ast.AST, fn: Optional[ast.AST], loops: Tuple[ast.AST, ...]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, child, ())
            elif isinstance(child, (ast.ClassDef, ast.Lambda)):
                visit(child, None, ())
            else:
                backward = isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute) and \
                    child.func.attr == "backward"
                if fn is not None and backward and (not loops or all(map(_counts, loops)) and _takes_no_data(fn)):
                    out.add(fn.name)
                visit(child, fn, loops + (child,) if isinstance(child, (ast.For, ast.While, ast.AsyncFor)) else loops)

    visit(tree, None, ())
    return tuple(sorted(out))


def _counts(loop: ast.AST) -> bool:
    """`for ... in range(...)` (or `enumerate(range(...))`): a loop that only counts."""
    it = loop.iter if isinstance(loop, ast.For) else None
    if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "enumerate" and it.args:
        it = it.args[0]
    return isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "range"


def _takes_no_data(fn: ast.AST) -> bool:
    """No `next()`, `yield` or `x.step(action)` / `x.reset(...)` (an environment) in `fn`."""
    for node in ast.walk(fn):
        if isinstance(node, (ast.Yield, ast.YieldFrom)):
            return False
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id == "next":
                return False
            if isinstance(func, ast.Attribute) and func.attr in ("step", "reset") and (node.args or node.keywords):
                return False
    return True


def _parse(data: bytes) -> ast.Module:
    """The tree of a module; one written for Python <= 3.6 with a keyword argument named
    `async` (`x.cuda(async=True)`) is read with that argument renamed: only its facts are
    read here, and the migration repairs the file itself."""
    from gpumigrate.rewriter.engine import parse_python  # one thread at a time (see there)

    try:
        return parse_python(data)
    except SyntaxError:
        if b"async" not in data:
            raise
        return parse_python(re.sub(rb"\basync(\s*=(?!=))", rb"async_\1", data))


def stateful_classes(tree: ast.Module) -> Tuple[str, ...]:
    """"Class:registrar:attr" for each attribute a top-level class names in a call on `self`
    (`self.registrar("attr", ...)`) and a method other than `__init__` updates in place
    (`self.attr.index_copy_(...)`, `self.attr[i] = ...`): state an object keeps and changes
    as it runs. The analysis decides which registrars matter."""
    out: Set[str] = set()
    for cls in tree.body:
        if not isinstance(cls, ast.ClassDef):
            continue
        named = {(n.args[0].value, n.func.attr) for n in ast.walk(cls) if isinstance(n, ast.Call)
                 and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name)
                 and n.func.value.id == "self" and n.args and isinstance(n.args[0], ast.Constant)
                 and isinstance(n.args[0].value, str)}
        if not named:
            continue
        changed: Set[str] = set()
        for method in cls.body:
            if not isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)) or method.name == "__init__":
                continue
            for n in ast.walk(method):
                if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr.endswith("_") \
                        and not n.func.attr.startswith("_"):
                    changed.add(_self_attr(n.func.value))
                elif isinstance(n, (ast.Assign, ast.AugAssign)):
                    changed.update(_self_attr(t.value) for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                                   if isinstance(t, ast.Subscript))
        out.update(f"{cls.name}:{registrar}:{attr}" for attr, registrar in named if attr in changed)
    return tuple(sorted(out))


def _self_attr(node: ast.AST) -> str:
    """`attr` for `self.attr`, else ""."""
    return node.attr if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
        node.value.id == "self" else ""


def _path_folders(calls: Sequence[ast.Call], path: Path) -> List[Path]:
    """Folders below the file's own that its `sys.path` calls put there (`sys.path.insert(0,
    here + '/nn/')`, `sys.path.append(os.path.join(os.path.dirname(__file__), 'lib'))`): its
    absolute imports may be rooted there. Only existing folders, named by a string literal."""
    out: List[Path] = []
    for call in calls:
        for arg in call.args:
            for const in ast.walk(arg):
                if not isinstance(const, ast.Constant) or not isinstance(const.value, str):
                    continue
                parts = [part for part in const.value.replace("\\", "/").split("/") if part not in ("", ".")]
                if parts and ".." not in parts:
                    folder = path.resolve().parent.joinpath(*parts)
                    if folder.is_dir() and folder not in out:
                        out.append(folder)
    return out


def _resolve(importer: Path, level: int, module: str, names: Sequence[str],
             extra: Sequence[Path] = ()) -> Iterable[Path]:
    """The project files an import may name: relative imports from the importer's package,
    absolute ones from folders it puts on sys.path, its folder or a folder a few levels above
    (a project run from its root). Only files that exist; never installed packages."""
    parts = module.split(".") if module else []
    if level:
        bases = [importer.resolve().parents[level - 1]] if level - 1 < len(importer.resolve().parents) else []
    else:
        bases = [*extra, *list(importer.resolve().parents)[:_ROOTS_UP + 1]]
    for base in bases:
        for candidate in _candidates(base, parts, names):
            if candidate.is_file():
                yield candidate.resolve()
                return  # the nearest root that has it


def _candidates(base: Path, parts: List[str], names: Sequence[str]) -> List[Path]:
    out = []
    if parts:
        stem = base.joinpath(*parts)
        out += [stem.with_suffix(".py"), stem / "__init__.py"]
        out += [stem / f"{name}.py" for name in names if name != "*"]  # `from pkg import mod`
    else:
        out += [base / f"{name}.py" for name in names if name != "*"]  # `from . import mod`
    return out


def _runs_code(tree: ast.Module) -> bool:
    """Does running the file as a script do anything beyond defining things: a main block,
    or module-level statements other than imports, definitions, docstrings and constants?
    The line a migration adds to a module (`device = get_device()`) keeps it a module: else a
    second run would see a new script, and what it imports would change."""
    runtime = {alias.asname or alias.name for stmt in tree.body if isinstance(stmt, ast.ImportFrom)
               and stmt.module in (RUNTIME_PACKAGE, VENDORED_MODULE) for alias in stmt.names}
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Call) and \
                isinstance(stmt.value.func, ast.Name) and stmt.value.func.id in runtime and not stmt.value.args:
            continue
        if isinstance(stmt, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef,
                             ast.Pass)):
            continue
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            continue
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None and \
                not any(isinstance(n, ast.Call) for n in ast.walk(stmt.value)):
            continue
        if isinstance(stmt, ast.Try) and all(isinstance(s, (ast.Import, ast.ImportFrom)) for s in stmt.body):
            continue
        return True
    return False


def projects(paths: Sequence[str]) -> Dict[str, Project]:
    """The project of each of `paths` (the files of a run), by path; files that link to no
    other module of their project are left out."""
    reader = _Reader()
    in_run = {Path(p).resolve() for p in paths}
    out: Dict[str, Project] = {}
    folders: Dict[Path, Tuple[Dict[Path, List[_Module]], Set[Path]]] = {}  # -> (importing scripts, star-imported)
    # the scripts of the run, with what they import through packages (`from trainer import
    # Trainer`, where trainer/__init__.py takes it from trainer/loop.py): a module's importers
    # beyond its own folder (a script in scripts/ that puts the project root on sys.path)
    run_scripts = [m for m in (reader.get(p) for p in in_run) if m is not None and m.script]
    reached = {m.path: _reached(m, reader) for m in run_scripts}
    for raw in paths:
        path = Path(raw).resolve()
        module = reader.get(path)
        if module is None:
            continue
        imports = [link for link in (_link(reader.get(t), in_run) for t in _through_packages(module.imports, reader))
                   if link is not None]
        folder = path.parent
        if folder not in folders:
            folders[folder] = _folder_links(folder, reader)
        scripts, star_imported = folders[folder]
        drivers = {other.path: other for other in scripts.get(path, ()) if other.path != path}
        drivers.update((m.path, m) for m in run_scripts if m.path != path and path in reached[m.path])
        importers = [link for link in (_link(other, in_run) for other in drivers.values()) if link is not None]
        starred = path in star_imported
        recursive = sorted({r for p in _reached(module, reader) for r in getattr(reader.get(p), "recursive", ())})
        star_names = tuple(sorted({pair for t in module.star_imports for pair in getattr(reader.get(t), "exports", ())}))
        if imports or importers or starred or star_names:
            out[raw] = Project(tuple(sorted(imports, key=lambda l: l.path)), tuple(sorted(importers, key=lambda l: l.path)),
                               starred, tuple(recursive), star_names)
    return out


def _reached(script: _Module, reader: _Reader, depth: int = 3) -> Set[Path]:
    """The project modules a script's run imports, through the modules it imports (a solver
    that imports the network module, whose helpers print), to `depth` imports away."""
    found: Set[Path] = set()
    layer = _through_packages(script.imports, reader)
    for _ in range(depth):
        layer = [p for p in layer if p not in found and p != script.path]
        found.update(layer)
        nxt: List[Path] = []
        for path in layer:
            module = reader.get(path)
            if module is not None and not module.script:  # a script it imports runs its own program
                nxt.extend(_through_packages(module.imports, reader))
        layer = nxt
    return found


def _through_packages(imports: Sequence[Path], reader: _Reader) -> List[Path]:
    """`imports`, and what the packages among them take from their own modules (a package's
    `__init__.py` that re-exports `from .loop import Trainer`), to a depth of three."""
    out = list(imports)
    todo = [(p, 0) for p in imports if p.name == "__init__.py"]
    while todo:
        package, depth = todo.pop()
        module = reader.get(package)
        for target in module.imports if module is not None and depth < 3 else ():
            if target not in out and target.parent == package.parent or target.parent.parent == package.parent:
                if target not in out:
                    out.append(target)
                if target.name == "__init__.py":
                    todo.append((target, depth + 1))
    return out


def _folder_links(folder: Path, reader: _Reader) -> Tuple[Dict[Path, List[_Module]], Set[Path]]:
    """For the modules of `folder` (once per folder, not once per file): the scripts of the
    folder that import each, and the modules some file of the folder star-imports."""
    try:
        siblings = sorted(p for p in folder.iterdir() if p.suffix == ".py" and p.is_file())[:_SCAN_LIMIT]
    except OSError:
        siblings = []
    scripts: Dict[Path, List[_Module]] = {}
    starred: Set[Path] = set()
    for sibling in siblings:
        other = reader.get(sibling)
        if other is None:
            continue
        starred.update(other.star_imports)
        if other.script:
            for target in other.imports:
                scripts.setdefault(target, []).append(other)
    return scripts, starred


def _link(module: Optional[_Module], in_run: Set[Path]) -> Optional[Link]:
    if module is None:
        return None
    try:
        shown = os.path.relpath(module.path)
    except ValueError:  # another drive
        shown = str(module.path)
    return Link(shown, module.calls, module.script, module.path in in_run, module.digest, module.defines,
                module.methods, module.stateful, module.steps, module.looped)


def project_files(path: str) -> List[Path]:
    """`path` and every project module it imports, directly or through another one (resolved
    paths, `path` first): the files a migration of the program rewrites."""
    reader = _Reader()
    first = Path(path).resolve()
    found, todo = [first], [first]
    while todo:
        module = reader.get(todo.pop())
        for target in module.imports if module is not None else ():
            if target not in found and target.suffix == ".py":
                found.append(target)
                todo.append(target)
    return found
