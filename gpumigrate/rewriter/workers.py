"""Files processed in worker processes, so that the run survives any input: a file that kills
its worker (a segfault in LibCST's native parser, the OOM killer) or takes longer than the
per-file time limit becomes that file's one-line error, and the other files are still
processed. Results come back in input order, as a serial run gives them; writing them stays
with the caller.

A worker takes one file at a time, so whatever happens to it is that file's doing, and it
ends with the run: a parent that is killed (SIGTERM, SIGKILL, the OOM killer) leaves no
worker running on.
"""

from __future__ import annotations

import collections
import hashlib
import multiprocessing
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, replace
from multiprocessing.connection import wait
from typing import Any, Deque, Dict, Iterator, List, Optional, Sequence, Tuple

from gpumigrate.rewriter.cache import Cache, run_key
from gpumigrate.rewriter.engine import FileResult
from gpumigrate.rewriter.files import DEFAULT_MAX_FILE_SIZE, Stamp
from gpumigrate.rewriter.run import process_passes, process_path, read_input, tune_gc


@dataclass(frozen=True)
class Task:
    """One file's work, as sent to a worker (rules are classes: pickled by name): its passes,
    in order, each (the rules it runs, the codes it fixes); lint is one pass."""

    path: str
    passes: Tuple[Tuple[Tuple[type, ...], Tuple[str, ...]], ...]
    options: Optional[dict] = None
    repairs: Optional[Tuple[type, ...]] = None
    max_size: Optional[int] = DEFAULT_MAX_FILE_SIZE
    source: Optional[bytes] = None  # the bytes (stdin's, or a file read already); None: read `path`
    stamp: Optional[Stamp] = None  # of a file read already: writes check it is unchanged

    def codes(self) -> frozenset:
        """The codes this task's results may hold."""
        return frozenset(r.code for rules, _ in self.passes for r in (*rules, *(self.repairs or ())))


def one_pass(rules: Sequence[type], fix: Sequence[str]) -> Tuple[Tuple[Tuple[type, ...], Tuple[str, ...]], ...]:
    return ((tuple(rules), tuple(fix)),)


def run_task(task: Task) -> FileResult:
    if task.source is not None:
        result = process_passes(task.source, task.path, task.passes, task.options, task.repairs)
        result.read_as = task.stamp
        return result
    return process_path(task.path, task.passes, task.options, task.repairs, max_size=task.max_size)


def process_cached(tasks: Sequence[Task], jobs: Optional[int], cache: Optional[Cache],
                   timeout: Optional[float] = None) -> Iterator[FileResult]:
    """`process_tasks`, with the results of unchanged files taken from `cache` (and the new
    ones put there). Files are read here, once: a hit costs a read and a hash.

    A cached rewrite is used only where the cache also shows it idempotent (the entry of the
    rewritten bytes changes nothing); the first time, that entry is computed."""
    tune_gc()  # for the files this process runs itself; workers tune their own
    if cache is None:
        yield from process_tasks(tasks, jobs, timeout)
        return
    runs: Dict[tuple, str] = {}
    # Per task, in input order: ("known", result) | ("fresh", key or None) |
    # ("confirm", cached result, key of its rewrite, the fresh task if it is not confirmed)
    plan: List[tuple] = []
    todo: List[Task] = []
    for task in tasks:
        if task.source is not None:  # stdin: not cached
            plan.append(("fresh", None))
            todo.append(task)
            continue
        read_in = read_input(task.path, task.max_size)
        if isinstance(read_in, FileResult):
            plan.append(("known", read_in))
            continue
        source, stamp = read_in
        signature = (task.passes, repr(sorted((task.options or {}).items())), task.repairs)
        if signature not in runs:
            runs[signature] = run_key(task.passes, task.options, task.repairs)
        run, codes, fresh = runs[signature], task.codes(), replace(task, source=source, stamp=stamp)
        key = cache.key(run, task.path, stamp.sha256)
        hit = cache.get(key, task.path, source, codes)
        confirmed = cache.confirms(run, hit, codes) if hit is not None and hit.changed else True
        if hit is not None and confirmed:
            hit.read_as = stamp
            plan.append(("known", hit))
        elif hit is not None and confirmed is None:
            hit.read_as = stamp
            assert hit.new_source is not None
            plan.append(("confirm", hit, cache.key(run, task.path, hashlib.sha256(hit.new_source).digest()), fresh))
            todo.append(replace(task, source=hit.new_source, stamp=None))
        else:
            plan.append(("fresh", key))
            todo.append(fresh)
    computed = process_tasks(todo, jobs, timeout)
    for kind, *detail in plan:
        if kind == "known":
            yield detail[0]
        elif kind == "fresh":
            result = next(computed)
            if detail[0] is not None:
                cache.put(detail[0], result)
            yield result
        else:
            hit, again_key, fresh = detail
            again = next(computed)
            cache.put(again_key, again)
            if again.error is None and not again.changed:
                yield hit
            else:  # not shown idempotent: what a fresh run gives
                yield next(process_tasks([fresh], 1, timeout))


def default_jobs() -> int:
    """The CPUs this process may use (a container's cpuset, not the host's count)."""
    counted = getattr(os, "process_cpu_count", None)  # Python 3.13+
    if counted is not None:
        return counted() or 1
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def process_tasks(tasks: Sequence[Task], jobs: Optional[int] = None,
                  timeout: Optional[float] = None) -> Iterator[FileResult]:
    """Each task in a worker process, `jobs` at a time (default: one per CPU); results in
    input order, each as soon as it and those before it are done. A task that runs longer
    than `timeout` seconds has its worker killed and is its file's error.

    Tasks start in input order too, so the first result comes after the first file, not
    after the whole run (largest-first scheduling balanced the tail a little, but held
    every line back until the small first file's turn came, at the end)."""
    jobs = max(1, jobs or default_jobs())
    order = list(range(len(tasks)))
    pool = _Pool(min(jobs, len(tasks)), timeout)
    done: Dict[int, FileResult] = {}
    following = 0
    try:
        for index, result in pool.run(tasks, order):
            done[index] = result
            while following in done:
                yield done.pop(following)
                following += 1
    finally:
        pool.close()


class _Worker:
    """One worker process and the pipe it takes tasks from and sends results on."""

    def __init__(self, context: Any) -> None:
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_worker_main, args=(child,), daemon=True)
        self.process.start()
        child.close()

    def stop(self) -> None:
        """Ask an idle worker to exit; kill it if it does not."""
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.process.join(timeout=5)
        self.kill()

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        self.conn.close()

    def died(self, path: str) -> str:
        self.kill()
        code = self.process.exitcode
        how = f"signal {-code}" if code is not None and code < 0 else f"exit status {code}"
        return f"{path}: internal error: the parser crashed ({how}); file left unchanged"


class _Pool:
    """Up to `size` workers, each given a task as soon as it is free."""

    def __init__(self, size: int, timeout: Optional[float]) -> None:
        self.size = max(1, size)
        self.timeout = timeout
        self.context = multiprocessing.get_context()
        self.idle: List[_Worker] = []
        self.busy: Dict[_Worker, Tuple[int, Optional[float]]] = {}  # worker -> (task index, deadline)

    def run(self, tasks: Sequence[Task], order: Sequence[int]) -> Iterator[Tuple[int, FileResult]]:
        """(index, result) of each task, as each finishes."""
        queue: Deque[int] = collections.deque(order)
        while queue or self.busy:
            while queue and len(self.busy) < self.size:
                index = queue.popleft()
                worker = self.idle.pop() if self.idle else _Worker(self.context)
                try:
                    worker.conn.send(tasks[index])
                except OSError:  # it died idle: this task did not kill it, give it another
                    worker.kill()
                    queue.appendleft(index)
                    continue
                deadline = None if self.timeout is None else time.monotonic() + self.timeout
                self.busy[worker] = (index, deadline)
            deadlines = [d for _, d in self.busy.values() if d is not None]
            wait_for = None if not deadlines else max(0.0, min(deadlines) - time.monotonic())
            wait([obj for w in self.busy for obj in (w.conn, w.process.sentinel)], timeout=wait_for)
            now = time.monotonic()
            for worker, (index, deadline) in list(self.busy.items()):
                result = self._collect(worker, tasks[index], deadline, now)
                if result is not None:
                    del self.busy[worker]
                    yield index, result

    def _collect(self, worker: _Worker, task: Task, deadline: Optional[float], now: float) -> Optional[FileResult]:
        """The worker's result if it is done, died or ran out of time; None while it works."""
        if worker.conn.poll():
            try:
                result = worker.conn.recv()
            except (EOFError, OSError):
                return FileResult(path=task.path, source=b"", error=worker.died(task.path))
            self.idle.append(worker)
            return result
        if not worker.process.is_alive():
            return FileResult(path=task.path, source=b"", error=worker.died(task.path))
        if deadline is not None and now >= deadline:
            worker.kill()
            return FileResult(path=task.path, source=b"", error=f"{task.path}: skipped: took longer than "
                                                                f"{self.timeout:g} s (file-timeout); file left unchanged")
        return None

    def close(self) -> None:
        for worker in self.busy:  # an interrupted run: their results are not wanted
            worker.kill()
        for worker in self.idle:
            worker.stop()
        self.busy.clear()
        self.idle.clear()


def _worker_main(conn: Any) -> None:
    _end_with_parent()
    # Ctrl-C reaches the workers too: they just stop (the parent reports the interruption),
    # instead of each printing a KeyboardInterrupt traceback.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    tune_gc()
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        result = run_task(task)
        try:
            conn.send(result)
        except Exception as exc:  # not the file's fault: a result that did not pickle
            conn.send(FileResult(path=task.path, source=b"", error=f"{task.path}: internal error, file left "
                                                                   f"unchanged ({type(exc).__name__}: {exc})"))


def _end_with_parent() -> None:
    """Exit when the process that started this worker is gone, however it ended: on Linux
    the kernel sends SIGKILL at once (PR_SET_PDEATHSIG); everywhere, a thread waits on the
    parent's sentinel, a pipe that closes when the parent exits."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # 1: PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    parent = multiprocessing.parent_process()
    if parent is None:
        return
    if not parent.is_alive():  # gone before the kernel was told
        os._exit(1)

    def watch() -> None:
        wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="gpumigrate-parent-watch", daemon=True).start()
