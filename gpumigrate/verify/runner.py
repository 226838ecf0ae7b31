"""`gpumigrate verify`: the original and the migrated script run side by side, briefly, under
the probe (gpumigrate/verify/probe.py), each in a scratch copy of the script's folder, and
compared (gpumigrate/verify/checks.py).

Runs, for a target T:
  base    the original, one process, the torch it was written for emulated on the CPU;
  single  the migrated script, one process (with `GPUMIGRATE_AMP=off` when T has amp);
  dist    ddp: the migrated script under `torchrun --standalone --nproc_per_node=N` (gloo);
  ref     ddp: the original again, one process, evaluating the weights the dist run
          evaluated first and loading the checkpoints its rank 0 wrote;
  twin    fsdp: the script migrated --to ddp instead, under torchrun as dist: fsdp must
          train what ddp trains (the same batches per rank, the same averaged gradients);
  bf16    amp: the migrated script, one process, `GPUMIGRATE_AMP=bf16`.
The user's files are only read: everything a run writes lands in its own copy or temp dir.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from gpumigrate.verify.runs import PEER_GONE, clean_env, run_bounded

PROBE = Path(__file__).resolve().parent / "probe.py"
PACKAGE_ROOT = Path(__file__).resolve().parent.parent.parent
TARGETS = ("device", "ddp", "fsdp", "amp")
SKIP_DIRS = {".git", ".hg", ".svn", "__pycache__", ".venv", "venv", "env", "node_modules", ".tox", ".mypy_cache",
             ".pytest_cache", ".ipynb_checkpoints", "wandb", "mlruns"}
# errors no other cap or emulation can help with
FATAL = {"ModuleNotFoundError", "ImportError", "SyntaxError", "FileNotFoundError", "NotADirectoryError",
         "IndentationError", "TabError"}
COPY_LIMIT = 1 << 20      # larger files are linked (and copied only if a run writes them)
FILE_LIMIT = 20000        # files of the script's folder a scratch copy takes


class VerifyError(Exception):
    """Verify cannot judge: why (exit status 2)."""


@dataclass
class Options:
    script: Path
    target: str
    args: Sequence[str] = ()
    against: Optional[Path] = None
    steps: int = 5
    batches: int = 3
    nproc: int = 2
    timeout: float = 300.0
    data: str = "fake"
    samples: int = 64
    stall: Optional[float] = None   # seconds without progress that mean a hang (default: from timeout)
    keep: bool = False              # leave the scratch folder (debugging)
    fail_fast: bool = False         # stop at the first difference
    cache: bool = True              # the original's run from the cache when its folder is unchanged


@dataclass
class Probed:
    """One run under the probe."""

    name: str
    nproc: int
    returncode: Optional[int]    # None: killed at the timeout
    stdout: str
    stderr: str
    seconds: float
    work: Path                   # the scratch copy it ran in
    script: Path
    out: Path
    timeout: float
    ranks: Dict[int, dict] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return (self.returncode == 0 and sorted(self.ranks) == list(range(self.nproc))
                and all(rep.get("error") is None for rep in self.ranks.values()))

    def error(self) -> Optional[str]:
        """One line: why the run failed (the root cause first), or None."""
        if self.returncode is None:
            return f"timed out after {self.timeout:g} s"
        ranked = sorted(self.ranks.items(), key=lambda item: (  # a peer's "the other rank went away" last
            bool(PEER_GONE.search(str((item[1].get("error") or {}).get("message")))), item[0]))
        for rank, rep in ranked:
            err = rep.get("error")
            if err:
                where = self.where(err.get("traceback", ""))
                who = f"rank {rank}: " if self.nproc > 1 else ""
                return f"{who}{err['type']}: {str(err['message'])[:300]}" + (f" at {where}" if where else "")
        if self.returncode != 0:
            lines = [ln for ln in self.stderr.splitlines() if ln.strip() and "Warning" not in ln]
            return f"exit {self.returncode}: " + (lines[-1][:300] if lines else "(no output)")
        if sorted(self.ranks) != list(range(self.nproc)):
            return f"no probe report from ranks {sorted(set(range(self.nproc)) - set(self.ranks))}"
        return None

    @property
    def tmp(self) -> Path:
        """The run's TMPDIR (and its libraries' caches), beside its copy."""
        return self.work.parent / f"{self.work.name}-tmp"

    def where(self, stack: str, innermost_first: bool = False) -> Optional[str]:
        """file:line of the innermost frame of the script's own code in a traceback (or, with
        `innermost_first`, in a faulthandler dump, which lists the innermost frame first)."""
        root = str(self.script.parent) + os.sep
        found = [f"{os.path.relpath(path, root)}:{line}"
                 for path, line in re.findall(r'File "([^"]+)", line (\d+)', stack) if path.startswith(root)]
        return (found[0] if innermost_first else found[-1]) if found else None

    def rank(self, r: int = 0) -> dict:
        return self.ranks.get(r, {})

    def summary(self) -> dict:
        """What the run measured, per rank: each step's losses and (sum, sum of squares) of the
        parameters the step trained."""
        ranks = {str(r): {"losses": [s["losses"] for s in rep.get("steps") or []],
                          "parameters": [s["params"] for s in rep.get("steps") or []],
                          "optimizer": [s["optimizer"] for s in rep.get("steps") or []]}
                 for r, rep in sorted(self.ranks.items())}
        return {"nproc": self.nproc, "returncode": self.returncode, "seconds": round(self.seconds, 2),
                "error": self.error(), "steps": [len(rep.get("steps") or []) for _, rep in sorted(self.ranks.items())],
                "ranks": ranks}


# ---------------------------------------------------------------- scratch copies

UP = re.compile(r"""["'](?:\.\./)+|["']\.\.["']""")


def _tree_root(files: Sequence[Path]) -> Path:
    """The folder a scratch copy takes: the one holding the script and its project modules,
    and the folders above it that their string literals reach with `../` (data beside the
    code: `../data/cora/`), at most two."""
    root = Path(os.path.commonpath([str(f.parent) for f in files]))
    up = 0
    for path in files:
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        for match in UP.findall(text):
            up = max(up, match.count(".."))
    for _ in range(min(up, 2)):
        if root.parent != root and root.parent != Path.home():
            root = root.parent
    return root


def copy_tree(src: Path, dest: Path) -> None:
    """`src` into `dest`: small files copied, large ones linked (a run copies one before
    writing it), version control, caches and virtual environments left out."""
    count = 0
    for folder, dirs, files in os.walk(src):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")
                         and not os.path.exists(os.path.join(folder, d, "pyvenv.cfg")))
        rel = os.path.relpath(folder, src)
        target = dest / rel
        target.mkdir(parents=True, exist_ok=True)
        for name in files:
            count += 1
            if count > FILE_LIMIT:
                raise VerifyError(f"{src} holds more than {FILE_LIMIT} files; verify copies the script's folder "
                                  f"into a scratch folder: run it on a script in a smaller folder")
            path = os.path.join(folder, name)
            if os.path.islink(path) or os.path.getsize(path) > COPY_LIMIT:
                os.symlink(os.path.realpath(path), target / name)
            else:
                shutil.copy2(path, target / name)


def _inside(path: str, src: Path, copy: Path) -> str:
    """`path` in the copy where it lies inside `src`, else `path`."""
    try:
        return str(copy / Path(path).resolve().relative_to(src.resolve()))
    except ValueError:
        return path


def migrate_copy(tree: Path, script: Path, target: str) -> str:
    """Run `gpumigrate --to target` on the script and the project modules it imports, in
    `tree`; its report (stderr)."""
    from gpumigrate.rewriter.project import project_files
    files = [str(p) for p in project_files(str(script)) if str(p).startswith(str(tree))]
    cmd = [sys.executable, "-m", "gpumigrate", *files, "--to", target, "--no-cache"]
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run(cmd, cwd=str(tree), capture_output=True, text=True, env=env)
    if proc.returncode not in (0, 1):
        last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
        raise VerifyError(f"the migration failed: {last}")
    return proc.stderr


# ---------------------------------------------------------------- runs

class Session:
    """A verify session's scratch folder and its runs."""

    def __init__(self, opts: Options, progress: Optional[Callable[[str], None]] = None) -> None:
        self.opts = opts
        self.progress = progress or (lambda text: None)
        self.root = Path(tempfile.mkdtemp(prefix="gpumigrate-verify-")).resolve()
        self.runs: Dict[str, Probed] = {}
        self.migration_report = ""
        self.batches: Optional[int] = opts.batches
        self.emulate = 1
        self.fallbacks: List[str] = []  # why the original runs without a cap, or with older torch

    def close(self) -> None:
        if self.opts.keep:
            print(f"verify: the runs are kept in {self.root}", file=sys.stderr)
        else:
            shutil.rmtree(self.root, ignore_errors=True)

    def prepare(self) -> None:
        opts = self.opts
        from gpumigrate.rewriter.project import project_files
        files = project_files(str(opts.script))
        src = self.src = _tree_root(files)
        copy_tree(src, self.root / "original")
        self.original = self.root / "original" / opts.script.resolve().relative_to(src)
        if opts.against is not None:
            against_src = opts.against.resolve().parent
            copy_tree(against_src, self.root / "migrated")
            self.migrated = self.root / "migrated" / opts.against.name
        else:
            copy_tree(src, self.root / "migrated")
            self.migrated = self.root / "migrated" / opts.script.resolve().relative_to(src)
            self.progress(f"migrating --to {opts.target}")
            self.migration_report = migrate_copy(self.root / "migrated", self.migrated, opts.target)

    def config(self, emulate: bool, dist: bool) -> dict:
        opts = self.opts
        stall = opts.stall if opts.stall is not None else max(30.0, opts.timeout / 3)
        return {"seed": 0, "steps": opts.steps, "batches": self.batches, "emulate": self.emulate if emulate else 0,
                "fake_data": opts.data == "fake", "samples": opts.samples, "scratch": str(self.root),
                "stall": stall if dist else None}

    def run_original(self) -> Probed:
        """The original in one process. Where it fails, once more without the batch cap (a
        loop that steps every k batches), then with the older torch.full: the first that runs.
        A run that worked is kept in the cache, keyed by the folder's content and the options:
        verifying another migration of the same script does not run the original again."""
        key = self._original_key() if self.opts.cache else None
        cached = _load_cached(key) if key else None
        if cached is not None:
            base, self.batches, self.emulate, self.fallbacks = cached
            self.runs["original"] = base
            self.progress("the original's run: from the cache")
            return base
        base = self._run_original()
        if key and base.ok:
            _store_cached(key, base, self.batches, self.emulate, self.fallbacks)
        return base

    def _original_key(self) -> str:
        digest = hashlib.sha256()
        tree = self.root / "original"
        for path in sorted(tree.rglob("*")):
            rel = path.relative_to(tree).as_posix()
            if path.is_symlink():
                st = path.stat()
                digest.update(f"{rel}|link|{os.readlink(path)}|{st.st_size}|{st.st_mtime_ns}\n".encode())
            elif path.is_file():
                digest.update(f"{rel}|{hashlib.sha256(path.read_bytes()).hexdigest()}\n".encode())
        config = {k: v for k, v in self.config(True, False).items() if k != "scratch"}
        digest.update(json.dumps([str(self.original.relative_to(tree)), list(self.opts.args), config,
                                  self.opts.timeout, sys.version, _torch_version(), _code_fingerprint()]).encode())
        return digest.hexdigest()[:32]

    def _run_original(self) -> Probed:
        base = self.run("original", original=True)
        for attempt, (key, value) in enumerate((("batches", None), ("emulate", 2)), 2):
            error = (base.rank(0).get("error") or {}).get("type")
            if base.ok or base.returncode is None or error in FATAL:
                break
            self.fallbacks.append(f"{base.error()}: every run " + (
                "without the batch cap" if key == "batches" else "with torch.full's pre-1.7 float fill"))
            setattr(self, key, value)
            base = self.run("original", original=True, work_name=f"original-{attempt}")
        return base

    def replicated(self, target: str) -> None:
        """The script migrated --to `target` as well (fsdp's ddp twin), for `run(..., twin=True)`."""
        copy_tree(self.src, self.root / "twin")
        self.twin = self.root / "twin" / self.original.relative_to(self.root / "original")
        self.progress(f"migrating --to {target}")
        migrate_copy(self.root / "twin", self.twin, target)

    def run(self, name: str, original: bool, nproc: int = 1, env: Optional[Dict[str, str]] = None,
            probe_args: Sequence[str] = (), work_name: Optional[str] = None, twin: bool = False) -> Probed:
        opts = self.opts
        self.progress(f"running {name}" + (f" ({nproc} ranks)" if nproc > 1 else ""))
        tree = self.root / ("original" if original else "twin" if twin else "migrated")
        script = self.original if original else self.twin if twin else self.migrated
        work = self.root / "runs" / (work_name or name)
        shutil.copytree(tree, work, symlinks=True)
        local = work / script.relative_to(tree)
        out = self.root / "runs" / f"{work.name}-probe"
        probed = Probed(name, nproc, None, "", "", 0.0, work, local, out, opts.timeout)
        probed.tmp.mkdir()
        launcher = [sys.executable] if nproc == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        cmd = [*launcher, str(PROBE), *probe_args, str(out), str(local), *opts.args]
        run_env = clean_env()
        # a PYTHONPATH folder inside the copied tree (the project's own package) is the copy's
        own = [_inside(p, self.src, work) for p in run_env.get("PYTHONPATH", "").split(os.pathsep) if p]
        paths = [str(PACKAGE_ROOT), *own]
        # libraries that cache (matplotlib's fonts, torch hub, datasets) write into the run's tmp
        tmp = str(probed.tmp)
        run_env.update(OMP_NUM_THREADS="1", PYTHONHASHSEED="0", CUDA_VISIBLE_DEVICES="",
                       PYTHONPATH=os.pathsep.join(p for p in paths if p), TMPDIR=tmp, MPLCONFIGDIR=tmp,
                       XDG_CACHE_HOME=tmp, TORCH_HOME=os.path.join(tmp, "torch"), MPLBACKEND="Agg",
                       GPUMIGRATE_VERIFY=json.dumps(self.config(original, nproc > 1)))
        run_env.update(env or {})
        probed.returncode, probed.stdout, probed.stderr, probed.seconds = run_bounded(
            cmd, local.parent, run_env, opts.timeout)
        for report in sorted(out.glob("rank*.json")):
            data = json.loads(report.read_text())
            probed.ranks[data["rank"]] = data
        self.runs[name] = probed
        return probed


def _torch_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("torch")
    except PackageNotFoundError:
        return "?"


def _code_fingerprint() -> str:
    """The probe, the shim and the runtime: a change to any of them changes what a run records."""
    digest = hashlib.sha256()
    here = Path(__file__).resolve().parent
    for path in sorted([*here.glob("*.py"), *(here.parent / "runtime").glob("*.py")]):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _cache_folder(key: str) -> Path:
    from gpumigrate.rewriter.cache import cache_dir
    return Path(cache_dir()) / "verify" / key


def _load_cached(key: str) -> Optional[tuple]:
    folder = _cache_folder(key)
    try:
        meta = json.loads((folder / "run.json").read_text())
        ranks = {int(r): json.loads((folder / f"rank{r}.json").read_text()) for r in meta["ranks"]}
    except (OSError, ValueError, KeyError):
        return None
    run = Probed("original", 1, meta["returncode"], meta["stdout"], meta["stderr"], meta["seconds"],
                 Path(meta["work"]), Path(meta["script"]), folder, meta["timeout"], ranks)
    return run, meta["batches"], meta["emulate"], meta.get("fallbacks", [])


def _store_cached(key: str, run: Probed, batches: Optional[int], emulate: int, fallbacks: List[str]) -> None:
    folder = _cache_folder(key)
    staging: Optional[Path] = None
    try:
        folder.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        staging = Path(tempfile.mkdtemp(prefix=f"{key}.", dir=folder.parent))
        for path in run.out.iterdir():
            shutil.copy2(path, staging / path.name)
        (staging / "run.json").write_text(json.dumps({
            "returncode": run.returncode, "stdout": run.stdout, "stderr": run.stderr, "seconds": run.seconds,
            "work": str(run.work), "script": str(run.script), "timeout": run.timeout, "ranks": sorted(run.ranks),
            "batches": batches, "emulate": emulate, "fallbacks": fallbacks}))
        os.replace(staging, folder)
    except OSError:  # a cache that cannot be written is no cache
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)


def verify(opts: Options, progress: Optional[Callable[[str], None]] = None) -> "Verdict":
    from gpumigrate.verify.checks import Verdict, judge
    start = time.perf_counter()
    targets = [t.strip() for t in opts.target.split(",") if t.strip()]
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or not targets:
        raise VerifyError(f"--to {opts.target}: verify knows the targets {', '.join(TARGETS)}")
    if "ddp" in targets and "fsdp" in targets:
        raise VerifyError(f"--to {opts.target}: ddp and fsdp cannot be combined")
    session = Session(opts, progress)
    try:
        session.prepare()
        verdict: Verdict = judge(session, targets)
    finally:
        session.close()
    verdict.seconds = time.perf_counter() - start
    return verdict
