"""Files processed in worker processes, so that the run survives any input: a file that kills
its worker (a segfault in LibCST's native parser, the OOM killer) becomes that file's one-line
error, and the other files are still processed. Results come back in input order, as a serial
run gives them; writing them stays with the caller."""

from __future__ import annotations

import multiprocessing
import os
import signal
from concurrent.futures import CancelledError, Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, replace
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from gpumigrate.rewriter.cache import Cache, run_key
from gpumigrate.rewriter.engine import FileResult
from gpumigrate.rewriter.files import DEFAULT_MAX_FILE_SIZE, Stamp
from gpumigrate.rewriter.run import process_path, process_source, read_input, tune_gc


@dataclass(frozen=True)
class Task:
    """One file's work, as sent to a worker (rules are classes: pickled by name)."""

    path: str
    rules: Tuple[type, ...]
    fix: Tuple[str, ...]
    options: Optional[dict] = None
    repairs: Optional[Tuple[type, ...]] = None
    max_size: Optional[int] = DEFAULT_MAX_FILE_SIZE
    source: Optional[bytes] = None  # the bytes (stdin's, or a file read already); None: read `path`
    stamp: Optional[Stamp] = None  # of a file read already: writes check it is unchanged


def run_task(task: Task) -> FileResult:
    if task.source is not None:
        result = process_source(task.source, task.path, task.rules, task.fix, task.options, task.repairs)
        result.read_as = task.stamp
        return result
    return process_path(task.path, task.rules, task.fix, task.options, task.repairs, max_size=task.max_size)


def process_cached(tasks: Sequence[Task], jobs: Optional[int], cache: Optional[Cache]) -> Iterator[FileResult]:
    """`process_tasks`, with the results of unchanged files taken from `cache` (and the new
    ones put there). Files are read here, once: a hit costs a read and a hash."""
    tune_gc()  # for the files this process runs itself; workers tune their own
    if cache is None:
        yield from _largest_first(tasks, jobs)
        return
    runs: Dict[tuple, str] = {}
    plan: List[Tuple[Optional[FileResult], Optional[str]]] = []  # (result known now, or the key to store)
    todo: List[Task] = []
    for task in tasks:
        if task.source is not None:  # stdin: not cached
            plan.append((None, None))
            todo.append(task)
            continue
        read_in = read_input(task.path, task.max_size)
        if isinstance(read_in, FileResult):
            plan.append((read_in, None))
            continue
        source, stamp = read_in
        signature = (task.rules, task.fix, repr(sorted((task.options or {}).items())), task.repairs)
        if signature not in runs:
            runs[signature] = run_key(task.rules, task.fix, task.options, task.repairs)
        key = cache.key(runs[signature], task.path, stamp.sha256)
        hit = cache.get(key, task.path, source)
        if hit is not None:
            hit.read_as = stamp
            plan.append((hit, None))
            continue
        plan.append((None, key))
        todo.append(replace(task, source=source, stamp=stamp))
    computed = _largest_first(todo, jobs)
    for known, key in plan:
        if known is not None:
            yield known
            continue
        result = next(computed)
        if key is not None:
            cache.put(key, result)
        yield result


def default_jobs() -> int:
    """The CPUs this process may use (a container's cpuset, not the host's count)."""
    counted = getattr(os, "process_cpu_count", None)  # Python 3.13+
    if counted is not None:
        return counted() or 1
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def _largest_first(tasks: Sequence[Task], jobs: Optional[int]) -> Iterator[FileResult]:
    """`process_tasks` with the largest files started first, so that one big file does not
    run alone at the end while the other workers idle; results still in input order."""
    if len(tasks) < 2 or max(1, jobs or default_jobs()) < 2:
        yield from process_tasks(tasks, jobs)
        return

    def size(task: Task) -> int:
        if task.source is not None:
            return len(task.source)
        try:
            return os.stat(task.path).st_size
        except OSError:
            return 0

    order = sorted(range(len(tasks)), key=lambda i: -size(tasks[i]))
    done: Dict[int, FileResult] = {}
    following = 0
    for i, result in zip(order, process_tasks([tasks[i] for i in order], jobs)):
        done[i] = result
        while following in done:
            yield done.pop(following)
            following += 1


def process_tasks(tasks: Sequence[Task], jobs: Optional[int] = None) -> Iterator[FileResult]:
    """Each task in a worker process, `jobs` at a time (default: one per CPU); results in
    input order, each as soon as it and those before it are done.

    When a worker dies the pool breaks and every unfinished task fails with it. The ones
    that may have been running are re-run one by one in a worker of their own, so a second
    death names its file; the rest go to a new pool."""
    jobs = max(1, jobs or default_jobs())
    context = multiprocessing.get_context()
    start = 0
    while start < len(tasks):
        todo = tasks[start:]
        workers = min(jobs, len(todo))
        pool = ProcessPoolExecutor(max_workers=workers, mp_context=context, initializer=_quiet_interrupt)
        broken: Optional[int] = None
        try:
            futures = [pool.submit(run_task, task) for task in todo]
            for offset, future in enumerate(futures):
                result = _outcome(future, todo[offset])
                if result is None:
                    broken = offset
                    break
                yield result
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        if broken is None:
            return
        # Tasks are handed to workers in order, at most 2 * workers + 1 at a time (running,
        # and queued for the workers): a dead worker had one of the first that many unfinished.
        unfinished = [i for i in range(broken, len(todo)) if _outcome(futures[i], todo[i]) is None]
        suspects = unfinished[:2 * workers + 1]
        solo = _Solo(context)
        try:
            for i in range(broken, suspects[-1] + 1):
                yield solo.run(todo[i]) if i in suspects else _outcome(futures[i], todo[i])
        finally:
            solo.close()
        start += suspects[-1] + 1


def _outcome(future: "Future[FileResult]", task: Task) -> Optional[FileResult]:
    """The task's result; None if the pool broke before it was done."""
    try:
        return future.result()
    except (BrokenProcessPool, CancelledError):  # cancelled: by the shutdown of a broken pool
        return None
    except Exception as exc:  # not the file's fault: a task or result that did not pickle
        return FileResult(path=task.path, source=b"", error=f"{task.path}: internal error, file left unchanged "
                                                            f"({type(exc).__name__}: {exc})")


def _quiet_interrupt() -> None:
    # Ctrl-C reaches the workers too: they just stop (the parent reports the interruption),
    # instead of each printing a KeyboardInterrupt traceback.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    tune_gc()


def _died(path: str, exitcode: Optional[int]) -> str:
    how = f"signal {-exitcode}" if exitcode is not None and exitcode < 0 else f"exit status {exitcode}"
    return f"{path}: internal error: the parser crashed ({how}); file left unchanged"


class _Solo:
    """One worker process, for tasks run one at a time: if it dies, its task is the culprit,
    and its exit status says how it died (a broken pool does not say)."""

    def __init__(self, context: Any) -> None:
        self._context = context
        self._process: Any = None
        self._conn: Any = None

    def run(self, task: Task) -> FileResult:
        if self._process is None:
            self._conn, child = self._context.Pipe()
            self._process = self._context.Process(target=_solo_main, args=(child,), daemon=True)
            self._process.start()
            child.close()
        try:
            self._conn.send(task)
            return self._conn.recv()
        except (EOFError, OSError):
            self._process.join()
            error = _died(task.path, self._process.exitcode)
            self._conn.close()
            self._process = self._conn = None
            return FileResult(path=task.path, source=b"", error=error)

    def close(self) -> None:
        if self._process is not None:
            try:
                self._conn.send(None)
            except OSError:
                pass
            self._process.join()
            self._conn.close()


def _solo_main(conn: Any) -> None:
    _quiet_interrupt()
    while True:
        task = conn.recv()
        if task is None:
            return
        conn.send(run_task(task))
