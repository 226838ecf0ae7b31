"""Robustness over real code: every `.py` file of the installed torch and of the standard
library through `gpumigrate lint` and each migration target. Prints a table; exit 1 if any
goal is missed.

    python bench/robustness.py [--sample N] [--json OUT] [--modes lint,device,ddp] [-j 1] [--no-cli]
                               [PATHS...]        (default: torch and the standard library)

Goals (all 0): crashes, outputs that do not compile, outputs a second run changes, files
changed without an edit, false parse errors (files CPython compiles), CLI results that differ
from the library's. Parse errors are listed with their message: each should be a file that
is not Python 3, which `compile()` confirms.

Two passes, run side by side:
- the library, through `process_source` with the rules and repairs the CLI uses: per file
  and mode, the findings, the output, its compile(), a second run on it, and a traceback
  for any internal error. The bench runs it in one child process, a file at a time, so a
  file that segfaults or hangs it is counted and the pass goes on in a new child
  (`check_files` also runs it in-process: the test suite's sample);
- the CLI in child processes, in batches of files (`-o` takes one file, and a process per
  file costs ~2 s of imports: hours), migrating copies in a scratch directory in place,
  with its own default of worker processes: a crash (a dead child, a traceback, or a worker
  the CLI reports dead) is counted, and the files it leaves must be the library's output
  byte for byte (or the input, for a file it refused).
Errors the engine's safety nets turn into one line ("fixes dropped", LibCST not reproducing
a line, nesting too deep) are listed as "refused": not goals, but each one worth a look.

The standard library's site-packages is skipped (third-party code; torch is the third-party
sample). Test directories are kept: their deliberately broken files (bad syntax, bad
encodings, Python 2) are what the parse-error check is for.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from gpumigrate.codemods import ALL_RULES, fixed_codes, rules_for
from gpumigrate.codemods import select as select_rules
from gpumigrate.rewriter import engine
from gpumigrate.rewriter.engine import FileResult
from gpumigrate.rewriter.run import process_source

MODES = ("lint", "device", "ddp", "ddp+amp")  # ddp+amp: `--to ddp,amp`, every target's rules
ALL_MODES = (*MODES, "lint-fix")  # `lint --fix`: on request (its fixes are the targets' fixes)
# (before the files, after them)
CLI_ARGS = {"lint": (["lint"], []), "lint-fix": (["lint"], ["--fix"]),
            "device": (["migrate"], ["--to", "device", "-q"]), "ddp": (["migrate"], ["--to", "ddp", "-q"]),
            "ddp+amp": (["migrate"], ["--to", "ddp,amp", "-q"])}
BATCH = 40  # files per CLI child: big enough that imports are noise, small enough to bisect
# Seconds for one file in one mode. The slowest real file (torch's 1 MB
# common_methods_invocations.py, ddp) takes ~60 s, ~110 s on a loaded machine; a hang is a bug.
FILE_TIMEOUT = 180.0


@dataclass(frozen=True)
class Mode:
    """What the CLI runs for one mode, so that the library's results are the CLI's."""

    name: str
    rules: Tuple[type, ...]
    fix: Tuple[str, ...]
    options: Optional[dict]


def mode(name: str) -> Mode:
    """As cli.py builds them with no configuration and no --select/--ignore."""
    if name in ("lint", "lint-fix"):
        rules = tuple(select_rules([], [], lint=True))
        return Mode(name, rules, tuple(r.code for r in rules if r.fixed_in) if name == "lint-fix" else (), None)
    target = name.replace("+", ",")
    target_rules = [r for r in rules_for(target) if r in select_rules([], [], lint=False)]
    fix = set(fixed_codes(target))
    return Mode(name, tuple(target_rules), tuple(r.code for r in target_rules if r.code in fix),
                {"sync_bn": False, "keep_half": False, "runtime_module": None})


# The CLI always passes these (cli._repairs): an old file must parse to be checked at all.
REPAIRS = [rule for rule in ALL_RULES if getattr(rule, "repair", None)]


@dataclass
class Problem:
    path: str
    mode: str
    message: str
    detail: str = ""  # a traceback, a diff line, the compiler's message


@dataclass
class Report:
    files: int = 0
    modes: List[str] = field(default_factory=list)
    # path -> (our message, CPython's message or "" when CPython compiles the file)
    parse_errors: Dict[str, Tuple[str, str]] = field(default_factory=dict)
    crashes: List[Problem] = field(default_factory=list)  # internal errors and timeouts
    not_compiling: List[Problem] = field(default_factory=list)
    second_run: List[Problem] = field(default_factory=list)
    changed_without_edit: List[Problem] = field(default_factory=list)
    # the engine's safety nets caught it (file left unchanged, one-line error): bugs of a rule
    # (fixes dropped) or limits (LibCST round trip, nesting); not crashes, but listed
    refused: List[Problem] = field(default_factory=list)
    input_not_compiling: List[str] = field(default_factory=list)  # LibCST parses, CPython does not
    changed: Dict[str, int] = field(default_factory=dict)
    edits: Dict[str, int] = field(default_factory=dict)
    seconds: Dict[str, float] = field(default_factory=dict)
    slowest: List[Tuple[float, str, str]] = field(default_factory=list)
    # the CLI pass
    cli_files: int = 0
    cli_crashes: List[Problem] = field(default_factory=list)
    cli_differs: List[Problem] = field(default_factory=list)
    cli_seconds: float = 0.0
    wall_seconds: float = 0.0
    sources_changed: bool = False  # gpumigrate's sources were edited during the run
    cli_broken: str = ""  # the CLI failed on a trivial file: no CLI pass was made
    peak_rss_mb: float = 0.0  # the library pass's process
    peak_rss_children_mb: float = 0.0  # the largest CLI process (its own workers included)

    @property
    def false_parse_errors(self) -> List[str]:
        return sorted(p for p, (_, cpython) in self.parse_errors.items() if not cpython)

    def failures(self) -> Dict[str, int]:
        """Every goal, with how far it is missed (all 0: robust)."""
        return {"crashes": len(self.crashes), "outputs not compiling": len(self.not_compiling),
                "second run changes": len(self.second_run), "changed without an edit": len(self.changed_without_edit),
                "false parse errors": len(self.false_parse_errors), "CLI crashes": len(self.cli_crashes),
                "CLI differs from library": len(self.cli_differs)}


class _Timeout(BaseException):
    """Not an Exception: the engine turns those into `internal error` results. Raised in the
    main thread; if the engine runs the file in a thread of its own (run.run_deep), that
    thread finishes in the background, which is fine for a count."""


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    if seconds <= 0 or not hasattr(signal, "SIGALRM") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise _Timeout()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _compile_error(source: bytes, path: str) -> str:
    """CPython's verdict: "" if it compiles (to bytecode, as the engine's own check)."""
    try:
        compile(source, path, "exec", dont_inherit=True)  # not this module's __future__ imports
    except (SyntaxError, ValueError) as exc:  # ValueError: null bytes
        line = getattr(exc, "lineno", None)
        return f"{type(exc).__name__}: {getattr(exc, 'msg', None) or exc}" + (f" (line {line})" if line else "")
    return ""


def _run(m: Mode, source: bytes, path: str) -> FileResult:
    return process_source(source, path, m.rules, m.fix, m.options, repairs=REPAIRS)


def _traceback(m: Mode, source: bytes, path: str) -> str:
    """The internal error again, without the engine's catch-all, for its traceback."""
    @contextlib.contextmanager
    def passthrough(result, where, unit="file"):
        yield

    saved = engine.reported_as_error
    engine.reported_as_error = passthrough
    try:
        _run(m, source, path)
    except Exception:
        return "".join(traceback.format_exc(limit=-6).splitlines(True)[-14:])
    finally:
        engine.reported_as_error = saved
    return ""


PARSE_ERRORS = ("cannot parse", "cannot read", "cannot decode")
REFUSALS = ("fixes dropped", "cannot rewrite without changing untouched code", "nesting too deep")


def _first_difference(old: bytes, new: bytes) -> str:
    a, b = old.splitlines(), new.splitlines()
    for number, (x, y) in enumerate(zip(a, b), 1):
        if x != y:
            return f"line {number}: {x[:100]!r} -> {y[:100]!r}"
    return f"line {min(len(a), len(b)) + 1}: {len(a)} lines -> {len(b)} lines"


def check_file(path: str, modes: Sequence[Mode], report: Report, timeout: float = FILE_TIMEOUT) -> Dict[str, str]:
    """One file through each mode, in-process; problems go into `report`. Returns the sha1 of
    what each mode's CLI run must leave in the file (the input, if nothing is written)."""
    source = Path(path).read_bytes()
    cpython = None  # compiled on demand: most files need no verdict
    expected = {}
    for m in modes:
        start = time.perf_counter()
        try:
            with _time_limit(timeout):
                result = _run(m, source, path)
        except _Timeout:
            report.crashes.append(Problem(path, m.name, f"timeout: more than {timeout:.0f} s"))
            expected[m.name] = ""
            continue
        finally:
            elapsed = time.perf_counter() - start
            report.seconds[m.name] = report.seconds.get(m.name, 0.0) + elapsed
            report.slowest.append((round(elapsed, 3), path, m.name))
        output = result.new_source if result.changed and not result.error else source
        expected[m.name] = hashlib.sha1(output).hexdigest()
        if result.error:
            error = result.error
            if "internal error" in error:
                report.crashes.append(Problem(path, m.name, error, _traceback(m, source, path)))
            elif any(p in error for p in PARSE_ERRORS):
                if path not in report.parse_errors:
                    cpython = _compile_error(source, path) if cpython is None else cpython
                    report.parse_errors[path] = (error, cpython)
            elif any(r in error for r in REFUSALS):
                report.refused.append(Problem(path, m.name, error))
            else:
                report.crashes.append(Problem(path, m.name, f"unexpected error: {error}"))
            continue
        if not result.changed:
            continue
        edits = sum(1 for f in result.findings if f.fixed)
        report.changed[m.name] = report.changed.get(m.name, 0) + 1
        report.edits[m.name] = report.edits.get(m.name, 0) + edits
        if not m.fix or not edits:
            report.changed_without_edit.append(Problem(path, m.name, "changed with no fixed finding",
                                                       _first_difference(source, result.new_source)))
        cpython = _compile_error(source, path) if cpython is None else cpython
        if cpython:
            if path not in report.input_not_compiling:
                report.input_not_compiling.append(path)
        else:
            broken = _compile_error(result.new_source, path)
            if broken:
                report.not_compiling.append(Problem(path, m.name, broken))
        try:
            with _time_limit(timeout):
                again = _run(m, result.new_source, path)
        except _Timeout:
            report.second_run.append(Problem(path, m.name, f"timeout in the second run: more than {timeout:.0f} s"))
            continue
        if again.error:
            report.second_run.append(Problem(path, m.name, f"second run: {again.error}"))
        elif again.changed:
            report.second_run.append(Problem(path, m.name, "second run changes the output",
                                             _first_difference(result.new_source, again.new_source)))
    return expected


def _vm_hwm_kb() -> int:
    """This process's own peak RSS (Linux), free of what fork inherits (see _CHILD)."""
    try:
        with open("/proc/self/status") as status:
            return int(next(line.split()[1] for line in status if line.startswith("VmHWM:")))
    except (OSError, StopIteration, ValueError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _merge(report: Report, part: dict) -> None:
    """A file's report from the library child (JSON) into `report`."""
    for name in ("crashes", "not_compiling", "second_run", "changed_without_edit", "refused"):
        getattr(report, name).extend(Problem(**p) for p in part[name])
    report.parse_errors.update({k: tuple(v) for k, v in part["parse_errors"].items()})
    report.input_not_compiling.extend(part["input_not_compiling"])
    for name in ("changed", "edits", "seconds"):
        totals = getattr(report, name)
        for key, value in part[name].items():
            totals[key] = totals.get(key, 0) + value
    report.slowest.extend(tuple(s) for s in part["slowest"])


class _LibraryChild:
    """The library pass in a child process, a file at a time: a file that kills it (a
    segfault in LibCST's native parser, a hang in native code) is counted, and the pass goes
    on in a new child, instead of ending the bench. Requests and answers are JSON lines."""

    def __init__(self, modes: Sequence[str], timeout: float) -> None:
        self.modes, self.timeout = list(modes), timeout
        self.peak_kb = 0
        self._proc: Optional[subprocess.Popen] = None

    def _start(self) -> subprocess.Popen:
        self._log = tempfile.TemporaryFile()  # its stderr: faulthandler's report on a crash
        env = dict(os.environ, PYTHONFAULTHANDLER="1")
        return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--library-child", "--modes",
                                 ",".join(self.modes), "--timeout", str(self.timeout)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=env)

    def check(self, path: str) -> Tuple[dict, Dict[str, str]]:
        if self._proc is None:
            self._proc = self._start()
        proc = self._proc
        proc.stdin.write(json.dumps(path).encode() + b"\n")
        proc.stdin.flush()
        # the child times each mode out itself; this is for a hang it cannot interrupt
        ready, _, _ = select.select([proc.stdout], [], [], 60 + 3 * self.timeout * len(self.modes))
        line = proc.stdout.readline() if ready else b""
        if line:
            answer = json.loads(line)
            self.peak_kb = max(self.peak_kb, answer["peak_kb"])
            if answer["restart"]:
                proc.wait()
                self._proc = None
            return answer["report"], answer["expected"]
        if proc.poll() is None:
            proc.kill()
        code = proc.wait()
        self._log.seek(0)
        tail = "".join(self._log.read().decode("utf-8", "replace").splitlines(True)[-12:])
        self._proc = None
        why = f"killed by signal {-code} ({signal.Signals(-code).name})" if code < 0 and ready else \
            "hung (killed)" if not ready else f"exit {code}"
        crash = asdict(Problem(path, ",".join(self.modes), f"library child {why}", tail))
        part = asdict(Report())
        part["crashes"] = [crash]
        return part, {}

    def close(self) -> None:
        if self._proc is not None:
            self._proc.stdin.close()
            self._proc.wait()


def _library_child(modes: Sequence[str], timeout: float) -> None:
    """The child's side of _LibraryChild."""
    chosen = [mode(name) for name in modes]
    for line in sys.stdin:
        path = json.loads(line)
        part = Report()
        try:
            expected = check_file(path, chosen, part, timeout)
        except OSError as exc:
            part.crashes.append(Problem(path, "read", f"cannot read: {exc}"))
            expected = {}
        # after a timeout the engine's own thread may still be running the file: start afresh
        restart = any(p.message.startswith("timeout") for p in part.crashes + part.second_run)
        answer = {"report": asdict(part), "expected": expected, "peak_kb": _vm_hwm_kb(), "restart": restart}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()
        if restart:
            os._exit(0)


def check_files(paths: Sequence[str], modes: Sequence[str] = MODES, timeout: float = FILE_TIMEOUT,
                report: Optional[Report] = None, progress: bool = False,
                isolated: bool = False) -> Tuple[Report, Dict[str, Dict[str, str]]]:
    """The library pass over `paths` (the bench's core, also run by the test suite): in this
    process, or `isolated` in a child process that a crash cannot take the bench down with.
    Returns the report and, per file, the sha1 of each mode's expected CLI result."""
    report = report or Report()
    report.files = len(paths)
    report.modes = list(modes)
    chosen = [mode(name) for name in modes]
    expected = {}
    child = _LibraryChild(modes, timeout) if isolated else None
    try:
        for number, path in enumerate(paths, 1):
            if child is not None:
                part, expected[path] = child.check(path)
                _merge(report, part)
            else:
                try:
                    expected[path] = check_file(path, chosen, report, timeout)
                except OSError as exc:
                    report.crashes.append(Problem(path, "read", f"cannot read: {exc}"))
            if progress and number % 200 == 0:
                print(f"  library: {number}/{len(paths)} files", file=sys.stderr, flush=True)
    finally:
        if child is not None:
            child.close()
    report.peak_rss_mb = (child.peak_kb if child is not None else _vm_hwm_kb()) / 1024
    report.slowest = sorted(report.slowest, reverse=True)[:10]
    return report, expected


# The CLI, reporting its own peak RSS on the way out. getrusage(RUSAGE_CHILDREN) cannot give
# it: Linux carries the parent's high-water mark into a child through fork (or vfork) and exec,
# so every child would "peak" at the bench's own size. VmHWM belongs to the child's memory.
_PEAK = "robustness-peak-rss-kb="
_CHILD = f"""
import atexit, sys

def peak():
    import resource  # its workers: they fork from it, so they inherit no more than its own peak
    kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    try:
        with open("/proc/self/status") as status:
            kb = max(kb, int(next(line.split()[1] for line in status if line.startswith("VmHWM:"))))
    except (OSError, StopIteration, ValueError):
        pass
    sys.stderr.write("\\n{_PEAK}" + str(kb) + "\\n")

atexit.register(peak)
from gpumigrate.cli import main
sys.argv[0] = "gpumigrate"
main()
"""
_child_peak_kb = 0
_peak_lock = threading.Lock()


def _cli(args: List[str], timeout: float) -> Tuple[Optional[int], str]:
    global _child_peak_kb
    env = dict(os.environ, NO_COLOR="1", PYTHONFAULTHANDLER="1")  # a segfault prints where it was
    # A session of its own: on a timeout its worker processes must die with it, not spin on.
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env=env, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return None, ""
    stderr, found, peak = err.decode("utf-8", "replace").rpartition(_PEAK)
    if not found:
        return proc.returncode, peak
    with _peak_lock:
        _child_peak_kb = max(_child_peak_kb, int(peak.strip() or 0))
    return proc.returncode, stderr


def _crashed(code: Optional[int], stderr: str) -> str:
    if code is None:
        return "timeout"
    if code < 0:
        return f"killed by signal {-code} ({signal.Signals(-code).name})"
    if code not in (0, 1, 2):
        return f"exit {code}"
    if "Traceback (most recent call last)" in stderr or "Fatal Python error" in stderr:
        return "traceback"
    return ""


def _internal_errors(stderr: str, copies: Dict[str, str]) -> List[Tuple[str, str]]:
    """(original, line) for each file the CLI reports an internal error for: a worker that
    died (the CLI survives it and says so), or a bug its catch-all turned into one line."""
    found = []
    for line in stderr.splitlines():
        if line.startswith("error: ") and "internal error" in line:
            copy = line[len("error: "):].split(":", 1)[0]
            if copy in copies:
                found.append((copies[copy], line))
    return found


def _cli_batch(m: str, batch: Sequence[Tuple[str, Path]], timeout: float) -> Tuple[List[Problem], Dict[str, bytes]]:
    """One child over copies of `batch` (original, copy); a crash is pinned on its file(s) by
    running each file alone. Returns crashes and, per original, what the CLI left: its sha1,
    or the bytes themselves where it changed the file (few: kept to show a difference)."""
    crashes = []

    def fresh(files: Sequence[Tuple[str, Path]]) -> None:
        for original, copy in files:
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(original, copy)

    fresh(batch)
    before, after = CLI_ARGS[m]
    # a batch takes about as long as its slowest file: a hang costs this, then `timeout` alone
    code, stderr = _cli([*before, *(str(c) for _, c in batch), *after], timeout=60 + 2 * timeout)
    copies = {str(c): original for original, c in batch}
    if _crashed(code, stderr):
        for original, copy in batch:
            fresh([(original, copy)])
            code, stderr = _cli([*before, str(copy), *after], timeout=timeout + 60)
            why = _crashed(code, stderr)
            if why:
                crashes.append(Problem(original, m, f"CLI {why}", "".join(stderr.splitlines(True)[-12:])))
            else:
                crashes.extend(Problem(o, m, "CLI internal error", line) for o, line in _internal_errors(stderr, copies))
    else:
        crashes.extend(Problem(o, m, "CLI internal error", line) for o, line in _internal_errors(stderr, copies))
    left = {}
    for original, copy in batch:
        try:
            data = copy.read_bytes()
            left[original] = data if data != Path(original).read_bytes() else hashlib.sha1(data).hexdigest()
        except OSError:
            left[original] = "missing"
        with contextlib.suppress(OSError):
            copy.unlink()
    return crashes, left


def cli_smoke_test(scratch: Path, modes: Sequence[str]) -> str:
    """"" if the CLI handles a trivial file in every mode; else why not. A CLI broken for all
    input would otherwise make every batch "crash" and be bisected file by file: hours."""
    probe = scratch / "smoke" / "probe.py"
    probe.parent.mkdir(parents=True, exist_ok=True)
    for m in modes:
        probe.write_text("import torch\nx = torch.zeros(2).cuda()\n")
        before, after = CLI_ARGS[m]
        code, stderr = _cli([*before, str(probe), *after], timeout=120)
        why = _crashed(code, stderr) or ("exit 2" if code == 2 else "")
        if why:
            return f"{' '.join([*before, 'probe.py', *after])}: {why}: " + " | ".join(stderr.strip().splitlines()[-3:])
    return ""


def check_cli(paths: Sequence[str], modes: Sequence[str], scratch: Path, jobs: int = 1,
              timeout: float = FILE_TIMEOUT) -> Tuple[List[Problem], Dict[str, Dict[str, object]], float]:
    """The CLI pass: crashes, and per mode and original file what the CLI left (_cli_batch)."""
    start = time.perf_counter()
    tasks = []
    for m in modes:
        for first in range(0, len(paths), BATCH):
            batch = [(p, scratch / m / f"{first // BATCH}" / f"{i}_{Path(p).name}")
                     for i, p in enumerate(paths[first:first + BATCH])]
            tasks.append((m, batch))
    crashes: List[Problem] = []
    left: Dict[str, Dict[str, object]] = {m: {} for m in modes}
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for (m, _), (found, hashes) in zip(tasks, pool.map(lambda t: _cli_batch(t[0], t[1], timeout), tasks)):
            crashes.extend(found)
            left[m].update(hashes)
    return crashes, left, time.perf_counter() - start


def _cli_difference(m: Mode, path: str, cli_output: bytes) -> str:
    source = Path(path).read_bytes()
    result = _run(m, source, path)
    library = result.new_source if result.changed and not result.error else source
    return (f"library: {'error: ' + result.error if result.error else 'changed' if result.changed else 'unchanged'}; "
            f"CLI: {'changed' if cli_output != source else 'unchanged'}; library -> CLI at "
            + _first_difference(library, cli_output))


def default_paths() -> Dict[str, str]:
    """Found without importing torch, which would add ~200 MB to this process's peak RSS."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("torch is not installed")
    return {"torch": list(spec.submodule_search_locations)[0], "stdlib": sysconfig.get_paths()["stdlib"]}


def python_files(root: str) -> List[str]:
    """Every `.py` file under `root`, sorted; not site-packages, __pycache__ or hidden folders."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in ("site-packages", "__pycache__") and not d.startswith(".")]
        found.extend(os.path.join(folder, f) for f in files if f.endswith(".py"))
    return sorted(found)


def sample(paths: Sequence[str], n: int) -> List[str]:
    """Every k-th path of the sorted list: deterministic, and spread over all packages."""
    ordered = sorted(paths)
    if n <= 0 or n >= len(ordered):
        return ordered
    step = len(ordered) / n
    return [ordered[int(i * step)] for i in range(n)]


def _sources() -> str:
    """A fingerprint of gpumigrate's code: the CLI children import it afresh, this process
    once, so an edit during a run (a shared working tree) makes the two disagree."""
    digest = hashlib.sha1()
    for path in sorted(Path(engine.__file__).parent.parent.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def run(paths: Sequence[str], modes: Sequence[str] = MODES, cli: bool = True, jobs: int = 1,
        timeout: float = FILE_TIMEOUT, progress: bool = True) -> Report:
    """Both passes side by side: the CLI children in threads, the library in this one."""
    start = time.perf_counter()
    sources = _sources()
    report = Report()
    scratch = Path(tempfile.mkdtemp(prefix="gpumigrate-robustness-"))
    try:
        cli_result = {}
        worker = None
        report.cli_broken = cli_smoke_test(scratch, modes) if cli else ""
        if cli and not report.cli_broken:
            def cli_pass() -> None:
                cli_result["value"] = check_cli(paths, modes, scratch, jobs, timeout)
            worker = threading.Thread(target=cli_pass, daemon=True)
            worker.start()
        report, expected = check_files(paths, modes, timeout, report, progress=progress, isolated=True)
        if worker is not None:
            worker.join()
            crashes, left, report.cli_seconds = cli_result["value"]
            report.cli_files = len(paths)
            report.cli_crashes = crashes
            crashed = {(c.path, c.mode) for c in crashes}
            for m in modes:
                for path in paths:
                    want, got = expected.get(path, {}).get(m), left[m].get(path)
                    if isinstance(got, bytes):
                        got, data = hashlib.sha1(got).hexdigest(), got
                    else:
                        data = Path(path).read_bytes()
                    if want and got and want != got and (path, m) not in crashed:
                        report.cli_differs.append(Problem(path, m, "the CLI left other bytes than the library's output",
                                                          _cli_difference(mode(m), path, data)))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report.wall_seconds = time.perf_counter() - start
    report.sources_changed = _sources() != sources
    report.peak_rss_children_mb = _child_peak_kb / 1024
    return report


def table(report: Report) -> str:
    modes = report.modes

    def per_mode(problems: List[Problem]) -> List[str]:
        return [str(sum(1 for p in problems if m in p.mode.split(","))) for m in modes]

    false = len(report.false_parse_errors)
    rows = [
        ("files", [str(report.files)] + [""] * (len(modes) - 1)),
        ("parse errors (false: CPython compiles)", [f"{len(report.parse_errors)} ({false} false)"] + [""] * (len(modes) - 1)),
        ("crashes (library)", per_mode(report.crashes)),
        ("crashes (CLI child)", per_mode(report.cli_crashes) if report.cli_files else ["-"] * len(modes)),
        ("changed files", [str(report.changed.get(m, 0)) for m in modes]),
        ("edits", [str(report.edits.get(m, 0)) for m in modes]),
        ("outputs not compiling", per_mode(report.not_compiling)),
        ("second run changes", per_mode(report.second_run)),
        ("changed without an edit", per_mode(report.changed_without_edit)),
        ("refused (safety nets)", per_mode(report.refused)),
        ("CLI differs from library", per_mode(report.cli_differs) if report.cli_files else ["-"] * len(modes)),
        ("library seconds", [f"{report.seconds.get(m, 0):.0f}" for m in modes]),
    ]
    width = max(len(label) for label, _ in rows)
    lines = [f"{'':<{width}}  " + "  ".join(f"{m:>10}" for m in modes)]
    lines += [f"{label:<{width}}  " + "  ".join(f"{v:>10}" for v in values) for label, values in rows]
    lines.append(f"wall {report.wall_seconds:.0f} s (CLI pass {report.cli_seconds:.0f} s); peak RSS "
                 f"{report.peak_rss_mb:.0f} MB (bench), {report.peak_rss_children_mb:.0f} MB (largest CLI child)")
    if report.cli_broken:
        lines.append(f"WARNING: no CLI pass: the CLI fails on a trivial file ({report.cli_broken})")
    if report.sources_changed:
        lines.append("WARNING: gpumigrate's sources changed during the run: the CLI children may have run other code "
                     "than the library pass (CLI differs is then unreliable); run again")
    return "\n".join(lines)


def details(report: Report) -> str:
    out = []
    if report.parse_errors:
        out.append(f"\nparse errors ({len(report.parse_errors)}): ours | CPython's")
        for path, (ours, cpython) in sorted(report.parse_errors.items()):
            out.append(f"  {ours}\n      CPython: {cpython or 'COMPILES (a false parse error)'}")
    for title, problems in (("crashes (library)", report.crashes), ("crashes (CLI)", report.cli_crashes),
                            ("outputs not compiling", report.not_compiling), ("second run", report.second_run),
                            ("changed without an edit", report.changed_without_edit),
                            ("refused by a safety net", report.refused), ("CLI differs", report.cli_differs)):
        if problems:
            out.append(f"\n{title} ({len(problems)}):")
            for p in problems:
                out.append(f"  [{p.mode}] {p.path}: {p.message}")
                out.extend(f"      {line}" for line in p.detail.splitlines())
    if report.input_not_compiling:
        out.append(f"\ninputs LibCST parses but CPython does not compile ({len(report.input_not_compiling)}):")
        out.extend(f"  {p}" for p in report.input_not_compiling)
    if report.slowest:
        out.append("\nslowest (seconds, file, mode):")
        out.extend(f"  {s:6.2f}  {p}  {m}" for s, p, m in report.slowest)
    return "\n".join(out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", help="files or folders (default: torch and the standard library)")
    parser.add_argument("--sample", type=int, default=0, metavar="N", help="every k-th of the sorted files, N in all")
    parser.add_argument("--json", metavar="OUT", help="write the full report as JSON")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(ALL_MODES)}")
    parser.add_argument("-j", "--jobs", type=int, default=1, help="CLI children at a time (beside the library pass)")
    parser.add_argument("--no-cli", action="store_true", help="skip the CLI pass")
    parser.add_argument("--timeout", type=float, default=FILE_TIMEOUT, help="seconds per file and mode")
    parser.add_argument("--library-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.library_child:
        _library_child(args.modes.split(","), args.timeout)
        return 0
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in ALL_MODES]
    if unknown:
        parser.error(f"unknown mode {unknown[0]!r}")
    roots = args.paths or list(default_paths().values())
    paths = sorted({str(Path(f).absolute()) for root in roots
                    for f in (python_files(root) if os.path.isdir(root) else [root])})
    paths = sample(paths, args.sample)
    where = ", ".join(roots) if len(roots) <= 3 else f"{len(roots)} paths"
    print(f"{len(paths)} files from {where}; modes {', '.join(modes)}", file=sys.stderr, flush=True)
    report = run(paths, modes, cli=not args.no_cli, jobs=args.jobs, timeout=args.timeout)
    print(table(report))
    print(details(report))
    if args.json:
        Path(args.json).write_text(json.dumps({**asdict(report), "failures": report.failures()}, indent=1))
    return 1 if any(report.failures().values()) else 0


if __name__ == "__main__":
    sys.exit(main())
