"""DistributedDataParallel without the boilerplate, correct in one process and under torchrun.

Every helper is a no-op (or the plain single-process behaviour) when the script was not
launched by torchrun or srun, so a rewritten script runs unchanged as `python train.py`.
Per training step only the gradients are averaged (by DDP, or by the optimizer hooks that
`setup_distributed` installs for models DDP does not wrap: see averaging.py); otherwise only
`reduce_sum`/`reduce_mean`/`barrier`/`broadcast_object` communicate, and only when called.
"""

from __future__ import annotations

import ast
import atexit
import ctypes
import functools
import inspect
import multiprocessing
import os
import pickle
import sys
import textwrap
import threading
import time
import warnings
import weakref
from types import TracebackType
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple, Type, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import (BatchSampler, DataLoader, Dataset, IterableDataset, RandomSampler, Sampler,
                              SequentialSampler, SubsetRandomSampler)
from torch.utils.data.distributed import DistributedSampler

from gpumigrate.runtime.uneven import BARRIER, BROADCAST, REDUCE, _collective_device, _settlers, agree, finish, shadow
from gpumigrate.runtime.averaging import (_OPTIMIZERS, _PLAN, _broadcast, _install_averaging, _note_wrapped,
                                          _uninstall_averaging)
from gpumigrate.runtime.device import distributed_backend, get_device
from gpumigrate.runtime.stalls import watch_stalls


class _Launch(NamedTuple):
    rank: int
    local_rank: int
    world_size: int


def _launch() -> Optional[_Launch]:
    """How this process was started: torchrun's variables, else SLURM's srun's."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return _Launch(int(env["RANK"]), int(env.get("LOCAL_RANK", 0)), int(env["WORLD_SIZE"]))
    # SLURM_STEP_NUM_TASKS is set inside an `srun` step; SLURM_NTASKS alone is also set for
    # a plain `python train.py` in an sbatch script, which is one process.
    if "SLURM_PROCID" in env and int(env.get("SLURM_STEP_NUM_TASKS", "1")) > 1:
        if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
            raise RuntimeError(
                "srun without torchrun: set MASTER_ADDR and MASTER_PORT, e.g. "
                "export MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1) MASTER_PORT=29500"
            )
        return _Launch(int(env["SLURM_PROCID"]), int(env.get("SLURM_LOCALID", 0)), int(env["SLURM_STEP_NUM_TASKS"]))
    return None


def is_distributed() -> bool:
    """True in a process group of more than one process.

    Where a launcher started several processes but `setup_distributed()` has not run (a
    trainer module migrated without the script that drives it), the first helper that needs
    the group joins it here, with one line on rank 0, rather than let every rank train alone
    on the whole dataset. (The device is this process's already: `get_device()` reads
    LOCAL_RANK under torchrun.)"""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size() > 1
    launch = _launch()
    if launch is not None and launch.world_size > 1 and multiprocessing.parent_process() is None:
        setup_distributed()
        if launch.rank == 0:
            print("gpumigrate.runtime: joined the process group at the first distributed helper (the script that "
                  "runs this code calls no setup_distributed(): migrate it too)", file=sys.stderr, flush=True)
        return dist.is_initialized() and dist.get_world_size() > 1
    return False


_cleanup_registered = False  # cleanup_distributed is registered with atexit


def setup_distributed(use_accelerator: bool = True, backend: Optional[str] = None, *,
                      average_unwrapped: bool = True) -> torch.device:
    """Join the process group if launched by torchrun (any --nnodes) or srun; return this
    process's device.

    Each process binds its own GPU (`LOCAL_RANK`) before anything is allocated, so nothing
    lands on GPU 0 by accident. On CUDA the group takes NCCL for GPU tensors and gloo for CPU
    ones (a script whose own `--no-cuda` flag keeps the model on the CPU still works), gloo
    elsewhere. The group is destroyed at exit, also when training raises. Without a launcher
    this is `get_device()`. `use_accelerator=False` keeps every process on the CPU.

    Called at a script's top level, it is safe in DataLoader worker processes (which import
    the script again under the `spawn` start method): they do not join the group.

    A rank that fails never leaves the others waiting for it: when its script raises, the
    other ranks stop within seconds, and it exits within `GPUMIGRATE_DIST_TIMEOUT` seconds
    (default 60) even if threads of its own would keep it alive (see `_Watch`). Ranks that
    all wait in collectives that never match (a barrier one rank skipped, a step one rank
    took more) end too: once every rank has waited that long in a torch call without
    computing, at places not all the same, each prints one line naming where every rank
    waits (script line and call) and exits with status 1 (Linux; see stalls.py).

    Models not given to `wrap_model` still train as one (`average_unwrapped`, see
    gpumigrate/runtime/averaging.py): every optimizer's parameters start from rank 0's values,
    and the gradients DDP does not average are averaged across ranks at the optimizer's step,
    before GradScaler's inf check and before `clip_grad_norm_`/`clip_grad_value_`; the
    BatchNorm statistics of those models are averaged with them. Every rank must then make and
    step the same optimizers. `average_unwrapped=False` leaves such models to each rank.
    """
    launch = _launch()
    if launch is None or launch.world_size == 1 or multiprocessing.parent_process() is not None:
        return get_device() if use_accelerator else torch.device("cpu")
    timeout = _dist_timeout()  # before joining: a bad value stops every rank at once, none waits
    # get_device() takes only an accelerator the group can communicate on (not MPS): the CPU else
    device = get_device() if use_accelerator else torch.device("cpu")
    if device.type != "cpu" and device.index is not None:
        device = get_device(launch.local_rank)  # srun sets no LOCAL_RANK: the launch's own
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif device.type != "cpu":
        torch.accelerator.set_device_index(device.index)
    if not dist.is_initialized():
        dist.init_process_group(
            backend or distributed_backend(device),
            init_method="env://",
            rank=launch.rank,
            world_size=launch.world_size,
        )
    global _cleanup_registered
    if not _cleanup_registered:  # once, also for a group the script created itself
        atexit.register(cleanup_distributed)
        _cleanup_registered = True
    _watch_for_failures(timeout)
    if average_unwrapped:
        _install_averaging()
    return device


def cleanup_distributed() -> None:
    """Leave the process group (safe to call twice, or without one).

    Leaving a group that `setup_distributed` joined never takes longer than
    `GPUMIGRATE_DIST_TIMEOUT` seconds: if `destroy_process_group()` blocks (NCCL with pending
    work, a peer gone), the process ends with status 1 and one line on stderr. Then waits
    (milliseconds) until torch's gloo threads have let go of the tensors of the last
    collectives, so that the process can exit cleanly: see `_settle_gloo_threads`. The
    gradient averaging of `setup_distributed` is removed first. A rank whose script ended
    without an exception first takes part in the collectives of ranks that are still
    training, until they all end (gpumigrate/runtime/uneven.py)."""
    if _watch is not None and not _watch.failed and _watch.peer_failure is None and dist.is_initialized():
        try:
            finish()
        except Exception:  # a peer has gone (failed: its announcement says so); leave as usual
            pass
    _uninstall_averaging()
    watch = _watch
    if watch is not None and watch.thread.is_alive() and threading.current_thread() is not watch.thread:
        watch.leave()
    elif dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _settle_gloo_threads()


# Why a gloo process can abort after its script has finished ("terminate called without an
# active exception", SIGABRT, exit status -6), with or without destroy_process_group():
#
# gloo runs each collective on a worker thread ("pt_gloo_runloop"), which drops the work, and
# with it the tensors, just after the collective completes. torch keeps a tensor's Python
# object alive while C++ also holds the tensor, so that drop decrefs a Python object and needs
# the GIL. The main thread, woken by the completion, has usually taken the GIL back by then;
# the worker gets it when the main thread next releases it (blocking calls, I/O, or after
# CPython's 5 ms switch interval). If instead the interpreter starts finalizing first (the
# script ends within milliseconds of its last collective, or the worker was descheduled on a
# busy machine), CPython ends the waiting thread with pthread_exit(), whose unwinding through
# the work's noexcept destructor calls std::terminate. destroy_process_group() helps only when
# it frees the group: the group's destructor releases the GIL and joins the workers. A DDP
# model (or any reference to the group) keeps the group and its threads alive to the end.
# So cleanup_distributed, run at exit while the interpreter is intact, releases the GIL until
# the workers are idle.


def _gloo_thread_states() -> Optional[Tuple[Tuple[str, str, int], ...]]:
    """(thread id, scheduler state, context switches) of each gloo worker thread of this
    process, from /proc; None where there is no /proc (not Linux)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    states = []
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if not f.read().startswith("pt_gloo"):
                    continue
            with open(f"/proc/self/task/{tid}/status") as f:
                status = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
        except OSError:  # the thread has just ended
            continue
        switches = int(status.get("voluntary_ctxt_switches", 0)) + int(status.get("nonvoluntary_ctxt_switches", 0))
        states.append((tid, status.get("State", "?").split()[0], switches))
    return tuple(sorted(states))


def _settle_gloo_threads(interval: float = 0.012, timeout: float = 2.0) -> None:
    """Release the GIL until every gloo worker thread is idle, so none is left waiting for
    the GIL when the interpreter finalizes (see the comment above).

    While this sleeps the GIL is free, so a worker waiting for it takes it at once, drops its
    tensors and goes back to waiting for work. Idle: not running, and not one context switch
    over a whole `interval` (a thread still on its way to the GIL, or holding it, switches).
    One or two intervals in practice; never longer than `timeout`. Without /proc: one
    interval of sleep.
    """
    before = _gloo_thread_states()
    if before == ():
        return  # no gloo threads (one process, NCCL, or the group was freed and joined)
    deadline = time.monotonic() + timeout
    while True:
        time.sleep(interval)  # releases the GIL
        after = _gloo_thread_states()
        running = after is not None and any(state == "R" for _, state, _ in after)
        if (after == before and not running) or after == () or time.monotonic() > deadline:
            return
        before = after


# A script that joins its group itself (its own torchrun path, keeping a DDP model and so the
# group to the end) never calls cleanup_distributed: its gloo workers are settled at exit too.
atexit.register(_settle_gloo_threads)


# A rank that fails must not leave the others waiting for it in a collective (gloo waits 30
# minutes, NCCL up to forever). torchrun's agent stops the other ranks once the failed process
# has exited, and gloo's collectives raise once its connections close; neither happens while the
# process is kept alive: by a non-daemon thread (a logger, a prefetcher), which Python waits for
# before exit handlers run, or by an exit handler or a teardown that blocks. So, in a group of
# several processes joined by setup_distributed (nothing of this runs per training step):
# - The uncaught exception of the main thread (sys.excepthook, chained) is announced in the
#   group's store, and the process ends itself (os._exit(1)) if it still runs
#   GPUMIGRATE_DIST_TIMEOUT seconds later.
# - A watchdog thread per rank looks at the store once a second (a check, never a blocking get).
#   When another rank has announced a failure, it gives this rank's own collective
#   _OWN_ERROR_GRACE seconds to raise (gloo's does as soon as the failed process is gone, and a
#   traceback of its own says more), then ends the process. A rank whose script has ended is
#   never stopped, and there is no heartbeat: a rank holding the GIL for minutes only delays
#   its own watchdog.
# - cleanup_distributed has the watchdog thread leave the group and waits for it at most
#   GPUMIGRATE_DIST_TIMEOUT seconds (the thread exists from the start: Python >= 3.12 refuses to
#   start threads at exit).
# - Ranks that are all alive but wait in collectives that never match (rank 0 skipped a barrier
#   that rank 1 waits in) hang as long. The same look, while no failure is announced, asks
#   stalls.py whether every rank's main thread has been stalled in torch for
#   GPUMIGRATE_DIST_TIMEOUT seconds at places that differ (a rank writes to the store only once
#   it has been stalled nearly that long). If so, that verdict is posted where a failure would
#   be, and every rank prints where each waits and ends itself once all have printed (waiting
#   at most _RELEASE_WAIT seconds for that).
# The store lives in rank 0's process under srun (in torchrun's agent under torchrun). Once it
# is gone, a call fails (torch prints a C++ stack trace for it), so a rank that finds it gone
# stops watching, nothing else; and rank 0 announces its own end too and waits, at most
# _RELEASE_WAIT seconds, until each other rank has seen that (or left) and is done with it.

_TIMEOUT_VARIABLE = "GPUMIGRATE_DIST_TIMEOUT"
_WATCH_INTERVAL = 1.0  # seconds between two looks at the store
_OWN_ERROR_GRACE = 2.0  # gloo raised 0.3 s after a failed peer's exception in our runs
_RELEASE_WAIT = 2.5
_STALLED = "stalled"  # in place of a rank in the ended key: the ranks wait in collectives that do not match


def _dist_timeout() -> float:
    """`GPUMIGRATE_DIST_TIMEOUT`: how many seconds (default 60) a rank that failed may take to
    exit, and leaving the process group may take at exit."""
    raw = os.environ.get(_TIMEOUT_VARIABLE, "").strip()
    if not raw:
        return 60.0
    try:
        seconds = float(raw)
    except ValueError:
        seconds = 0.0
    if not 0 < seconds < float("inf"):  # NaN too
        raise ValueError(f"{_TIMEOUT_VARIABLE}={raw!r}: use a positive number of seconds (the default is 60)")
    return min(seconds, threading.TIMEOUT_MAX)


class _Watch:
    """This process's side of the failure handling, from setup_distributed to
    cleanup_distributed (see the comment above)."""

    def __init__(self, rank: int, world_size: int, timeout: float, store: Any) -> None:
        self.rank, self.world_size, self.timeout, self.store = rank, world_size, timeout, store
        self.pid = os.getpid()
        # torchrun's agent keeps its store across restarts (--max-restarts): keys per attempt
        prefix = f"gpumigrate/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        # "<rank>\t<exception>" of the first failure, "0\t": rank 0 ended, or "stalled\t<where each rank waits>"
        self.ended_key = prefix + "ended"
        self.released_key = prefix + "released"  # how many ranks other than 0 are done with the store
        self.stopped_key = prefix + "stopped"  # how many ranks have said where the ranks wait
        self.failed = False  # this rank's main thread raised
        self.released = store is None  # this rank no longer uses the store
        self.peer_failure: Optional[Tuple[str, str, float]] = None  # (rank, exception, seen at)
        self.stalls = watch_stalls(rank, world_size, timeout, prefix) if store is not None else None
        self.stalled: Optional[str] = None  # where each rank waits, when none can go on
        self.leaving = threading.Event()
        self.error: Optional[Exception] = None  # what destroy_process_group raised
        self.thread = threading.Thread(target=self._run, name="gpumigrate-watchdog", daemon=True)

    def _run(self) -> None:
        watching = not self.released
        while not self.leaving.wait(_WATCH_INTERVAL):
            if self.failed:
                continue  # this rank failed: the timer `fail` started bounds its exit
            if watching:
                watching = self._look()
            if self.stalled is not None:
                self._stop_stalled()
            if self.peer_failure is not None and threading.main_thread().is_alive():
                rank, what, seen = self.peer_failure
                if time.monotonic() - seen >= _OWN_ERROR_GRACE:
                    _exit_now(f"rank {rank} failed ({what}); stopping rank {self.rank}")
        self._leave()

    def _look(self) -> bool:
        """One look at the store; whether to look again."""
        if not dist.is_initialized():  # the script left the group itself
            self.released = True
            return False
        try:
            if self.store.check([self.ended_key]):
                ended = self.store.get(self.ended_key)
            else:
                stalled = self.stalls.look(self.store) if self.stalls is not None else None
                if stalled is None:
                    return True
                # the first post wins (a failure announced meanwhile, another rank's verdict)
                ended = self.store.compare_set(self.ended_key, "", f"{_STALLED}\t{stalled}")
            rank, _, what = ended.decode("utf-8", "replace").partition("\t")
            if rank == _STALLED:
                self.stalled = what
                return False  # the store is still needed: see _stop_stalled
            if self.rank != 0:
                self.store.add(self.released_key, 1)  # rank 0 may leave now
        except Exception:  # the store has gone with its host: stop watching, stop no one
            pass
        else:
            if what and rank != str(self.rank):
                self.peer_failure = (rank, what, time.monotonic())
        self.released = True
        return False

    def _stop_stalled(self) -> None:
        """The ranks wait in collectives that do not match: say where, and end this process once
        every rank has said it (under torchrun the first exit ends the others; under srun rank 0's
        takes the store), waiting at most _RELEASE_WAIT seconds."""
        _say(f"the ranks wait in collectives that do not match: {self.stalled}; stopping rank {self.rank}")
        try:
            until = time.monotonic() + _RELEASE_WAIT
            said = self.store.add(self.stopped_key, 1)
            while said < self.world_size and time.monotonic() < until:
                time.sleep(0.05)
                said = self.store.add(self.stopped_key, 0)
            if self.rank == 0:
                time.sleep(0.1)  # the others' last look at the store it may hold
        except Exception:  # the store has gone: the others have said it
            pass
        os._exit(1)

    def fail(self, exc_type: Type[BaseException], exc: BaseException) -> None:
        """The main thread raised `exc`: announce it, and end the process if its exit hangs."""
        self.failed = True
        try:
            threading.Thread(target=self._exit_later, name="gpumigrate-exit-timer", daemon=True).start()
        except RuntimeError:  # no thread can start (the interpreter is shutting down)
            pass
        if not self.released:
            try:  # the first failure is the one the others report
                self.store.compare_set(self.ended_key, "", f"{self.rank}\t{_one_line(exc_type, exc)}")
            except Exception:
                pass

    def _exit_later(self) -> None:
        threading.Event().wait(self.timeout)
        running = [t.name for t in threading.enumerate() if not t.daemon and t is not threading.main_thread()]
        why = (f"non-daemon threads are still running ({', '.join(running)})" if running
               else "the process has not ended (an exit handler still running?)")
        _exit_now(f"rank {self.rank} failed; exiting after {self.timeout:g} s although {why}")

    def leave(self) -> None:
        """cleanup_distributed's work, done on the watchdog thread and waited for at most
        `timeout` seconds."""
        self.leaving.set()
        self.thread.join(self.timeout)
        if self.thread.is_alive():
            _exit_now(f"rank {self.rank} could not leave the process group within {self.timeout:g} s; "
                      "exiting without waiting longer")
        error, self.error = self.error, None
        if error is not None:
            raise error

    def _leave(self) -> None:
        try:
            if not self.released:
                self.released = True
                if self.rank == 0:  # the others stop using the store before it may go
                    self.store.compare_set(self.ended_key, "", "0\t")
                    until = time.monotonic() + _RELEASE_WAIT
                    while self.store.add(self.released_key, 0) < self.world_size - 1 and time.monotonic() < until:
                        time.sleep(0.05)
                else:
                    self.store.add(self.released_key, 1)
        except Exception:  # the store has gone: there is no one left to tell
            pass
        self.store = None  # its own connection closes now, not while the interpreter finalizes
        try:
            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
        except Exception as exc:  # raised again on the main thread, by cleanup_distributed
            self.error = exc


_watch: Optional[_Watch] = None
_previous_excepthook: Optional[Callable[[Type[BaseException], BaseException, Optional[TracebackType]], Any]] = None


def _watch_for_failures(timeout: float) -> None:
    """Start this process's _Watch over the default group (once per group) and chain
    sys.excepthook (once)."""
    global _watch, _previous_excepthook
    if not dist.is_initialized() or dist.get_world_size() < 2:
        return
    if _watch is not None and _watch.thread.is_alive():
        return
    _watch = _Watch(dist.get_rank(), dist.get_world_size(), timeout, _watch_store())
    _watch.thread.start()
    if _previous_excepthook is None:
        _previous_excepthook = sys.excepthook
        sys.excepthook = _excepthook


def _watch_store() -> Any:
    """A client of the default group's store for the watchdog, with a connection of its own
    where torch can make one (a blocking store call of the main thread then cannot hold it
    up); None without a store (`_get_default_store` is private): nothing is announced then."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:
        return None
    try:
        return store.clone()
    except Exception:
        return store


def _excepthook(exc_type: Type[BaseException], exc: BaseException, tb: Optional[TracebackType]) -> None:
    """sys.excepthook in a group: the previous hook prints the traceback, then the failure is
    announced (see _Watch)."""
    watch = _watch
    if watch is not None and watch.stalled is not None and os.getpid() == watch.pid:
        # Another rank that said where the ranks wait has ended, and so this rank's collective
        # raised ("Connection closed by peer"): its own watchdog ends it in a moment, and the
        # traceback would only bury the line that says why.
        watch.thread.join(_RELEASE_WAIT + 1)
    try:
        (_previous_excepthook or sys.__excepthook__)(exc_type, exc, tb)
    finally:
        watch = _watch
        # Python sets sys.last_value just before it calls the hook for the exception that ends
        # the script; a library showing a handled exception with sys.excepthook(...) is no failure.
        ending = exc is getattr(sys, "last_value", None) or exc is getattr(sys, "last_exc", None)
        if (watch is not None and ending and os.getpid() == watch.pid
                and threading.current_thread() is threading.main_thread()):
            watch.fail(exc_type, exc)


def _one_line(exc_type: Type[BaseException], exc: BaseException) -> str:
    """`RuntimeError: boom`: the exception's type and the first line of its message."""
    try:
        lines = str(exc).strip().splitlines()
    except Exception:
        lines = []
    return (f"{exc_type.__name__}: {lines[0]}" if lines else exc_type.__name__)[:300]


def _exit_now(message: str) -> None:
    """End the process at once with status 1 (no exit handlers, no waiting for threads), after
    one line on stderr saying why."""
    _say(message)
    os._exit(1)


def _say(message: str) -> None:
    """One line on stderr, after what the script printed."""
    try:
        sys.stdout.flush()  # what the script printed comes first
    except Exception:  # closed, or None
        pass
    try:
        print(f"gpumigrate.runtime: {message}", file=sys.stderr, flush=True)
    except Exception:
        pass


def get_rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_world_size() -> int:
    """The number of processes (1 without a process group)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_main_process() -> bool:
    """True on rank 0, and in a single process: where printing and saving happen."""
    return get_rank() == 0


class _MutedWriter:
    """What a TensorBoard writer is on the ranks other than 0 where the script hands it on or
    reads it (`train(model, loader, writer)`, `writer.log_dir`): every method call does
    nothing, wherever it is made (a helper module's `writer.add_scalar`), and its directory is
    the one rank 0 writes to. A real writer there would write a second copy of every event, and
    create that directory as rank 0 does (tensorboardX's check-then-`makedirs` fails when both
    ranks get there together)."""

    def __init__(self, log_dir: Any = None, *args: Any, **kwargs: Any) -> None:
        self.log_dir = self.logdir = kwargs.get("log_dir", kwargs.get("logdir", log_dir))

    def get_logdir(self) -> Any:
        return self.log_dir

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _ignore

    def __enter__(self) -> "_MutedWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


def _ignore(*args: Any, **kwargs: Any) -> None:
    return None


def muted_writer(*args: Any, **kwargs: Any) -> Any:
    """A TensorBoard writer for a rank other than 0 (`SummaryWriter(path) if is_main_process()
    else muted_writer(path)`): takes the writer's arguments, writes nothing, makes no
    directory, and has the `log_dir` it was given."""
    return _MutedWriter(*args, **kwargs)


def progress_stream() -> Any:
    """Where a progress bar that the script reads (`pbar.n`) draws: tqdm's default (None:
    stderr) on rank 0, os.devnull elsewhere, so every rank's bar counts and one is shown."""
    global _DEVNULL
    if get_rank() == 0:
        return None
    if _DEVNULL is None:
        _DEVNULL = open(os.devnull, "w")
    return _DEVNULL


_DEVNULL: Any = None


def join_ranks() -> None:
    """The end of a training loop whose ranks may take different numbers of optimizer steps
    (episodes of different lengths): a rank that gets here first takes part in the others'
    steps until every rank is here, and every rank then has the parameters and optimizer
    state of one that took them all. Every rank must get here. A no-op in one process."""
    if is_distributed():
        finish()


def barrier() -> None:
    """Wait for every rank; a no-op in one process. Never call it on rank 0 only."""
    if is_distributed():
        agree(BARRIER, 0)
        dist.barrier()


def wrap_model(
    model: nn.Module,
    *,
    find_unused_parameters: bool = False,
    sync_batchnorm: bool = False,
    **ddp_options: Any,
) -> nn.Module:
    """Wrap a model (already on its device) in DistributedDataParallel; unchanged in one process,
    and where it is no nn.Module, a library's data-parallel wrapper already, or built of layers
    whose custom autograd Function runs a backward inside its backward (reversible layers of an
    installed package, which DDP refuses): the optimizer step averages what DDP does not. Its
    state_dict has the unwrapped model's keys.

    `device_ids` is given only for a model on a single GPU; a model spread over several
    devices (model parallelism) or on the CPU is wrapped without it (a `device_ids` or
    `output_device` among the options is not used). `sync_batchnorm`
    converts BatchNorm layers to SyncBatchNorm (worth it for small per-GPU batches). Other
    DistributedDataParallel options (`broadcast_buffers`, `bucket_cap_mb`, `static_graph`,
    ...) are passed on as they are.
    """
    if not is_distributed() or not isinstance(model, nn.Module):
        return model  # a model of plain tensors (its own `parameters()`): averaged at the optimizer step
    if isinstance(model, nn.parallel.DistributedDataParallel):
        _note_wrapped(model)  # its gradients are averaged: the optimizer hooks leave them
        return model
    if _data_parallel_of_its_own(model):
        return model  # a second wrapper would reduce every gradient twice
    if _reentrant_backward(model):
        return model  # DDP's reducer refuses a backward run inside the backward: averaged at the step
    if not any(p.requires_grad for p in model.parameters()):
        return model  # nothing to synchronise (DDP refuses such a module)
    devices = {p.device for p in model.parameters()}
    if all(d.type == "cuda" for d in devices):
        if sync_batchnorm:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    else:  # DDP takes SyncBatchNorm on GPU modules only: on CPU (gloo) BatchNorm stays per process
        model = _per_process_batchnorm(model)
    for derived in ("device_ids", "output_device"):  # the script's own, passed on in `**kwargs`
        ddp_options.pop(derived, None)
    device_ids = None
    if len(devices) == 1:
        (only,) = devices
        if only.type not in ("cpu", "mps") and only.index is not None:  # one accelerator: CUDA, XPU, ...
            device_ids = [only.index]
    wrapped = nn.parallel.DistributedDataParallel(
        model, device_ids=device_ids, find_unused_parameters=find_unused_parameters, **ddp_options
    )
    _note_wrapped(wrapped)
    _plain_keys(wrapped)
    return wrapped


def _reentrant_backward(model: nn.Module) -> bool:
    """Does a module of the model's layers define an autograd Function whose static `backward`
    runs a backward itself, directly or through a function it calls by a name with `backward`
    in it (`block.backward_pass(y, dy)`, `torch.autograd.backward(...)`)? Read from the
    source, once per module."""
    return any(_module_reenters(type(layer).__module__) for layer in model.modules())


@functools.lru_cache(maxsize=None)
def _module_reenters(name: str) -> bool:
    module = sys.modules.get(name)
    if module is None or name.startswith(("torch.", "gpumigrate.")):
        return False
    for value in list(vars(module).values()):
        backward = getattr(value, "backward", None)
        if not (isinstance(value, type) and issubclass(value, torch.autograd.Function) and callable(backward)):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(backward)))
        except (OSError, TypeError, SyntaxError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                func = node.func
                called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
                if "backward" in called or called == "grad":
                    return True
    return False


def _data_parallel_of_its_own(model: nn.Module) -> bool:
    """A library's data-parallel wrapper, which averages or shards gradients itself (Opacus's
    DifferentiallyPrivateDistributedDataParallel, apex's DistributedDataParallel, FSDP and
    fully_shard's FSDPModule)."""
    return any(cls.__name__.endswith(("DistributedDataParallel", "ShardedDataParallel")) or cls.__name__ == "FSDPModule"
               for cls in type(model).__mro__)


def _plain_keys(wrapped: nn.Module) -> None:
    """The wrapper's state_dict has the keys the unwrapped model has in one process, also
    where the wrapper is a submodule (`self.net = wrap_model(net)`): whatever saves it, a
    checkpoint is the same at every world size. It loads either form."""
    wrapped._register_state_dict_hook(_drop_module_level)
    wrapped._register_load_state_dict_pre_hook(_add_module_level, with_module=True)


def _drop_module_level(module: nn.Module, state: Dict[str, Any], prefix: str, local_metadata: Any) -> None:
    inner = prefix + "module."
    if not any(k.startswith(inner) for k in state):
        return
    items = list(state.items())
    state.clear()  # rebuilt in place: the caller may be a parent module filling its own dict
    for key, value in items:
        state[prefix + key[len(inner):] if key.startswith(inner) else key] = value
    metadata = getattr(state, "_metadata", None)
    if metadata is not None:  # the inner module's versions stand for the wrapper's
        for key in [k for k in metadata if k == inner[:-1] or k.startswith(inner)]:
            metadata[prefix + key[len(inner):] if key != inner[:-1] else prefix[:-1]] = metadata.pop(key)


def _add_module_level(module: nn.Module, state: Dict[str, Any], prefix: str, *_: Any) -> None:
    inner = prefix + "module."
    keys = [k for k in state if k.startswith(prefix) and not k.startswith(inner)]
    for key in keys:
        state[inner + key[len(prefix):]] = state.pop(key)


class _BatchNormAnyDim(nn.modules.batchnorm._BatchNorm):
    """BatchNorm for inputs of any rank (what a SyncBatchNorm stood for)."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")


def _per_process_batchnorm(module: nn.Module) -> nn.Module:
    """`module` with each SyncBatchNorm replaced by a plain BatchNorm holding the same
    parameters and buffers (an optimizer built before keeps training them)."""
    if isinstance(module, nn.SyncBatchNorm):
        plain = _BatchNormAnyDim(module.num_features, module.eps, module.momentum, module.affine,
                                 module.track_running_stats)
        plain._parameters, plain._buffers = module._parameters, module._buffers
        plain.training = module.training
        return plain
    for name, child in module.named_children():
        replaced = _per_process_batchnorm(child)
        if replaced is not child:
            setattr(module, name, replaced)
    return module


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's own module inside a DDP or DataParallel wrapper: reach custom attributes
    through it, and save its state_dict (no `module.` prefix)."""
    while isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        model = model.module
    return model


def without_module_prefix(state_dict: Any) -> Any:
    """A state_dict saved from a DataParallel or DDP wrapper (`module.fc.weight`) as the plain
    module's (`fc.weight`); any other state_dict, or object, is returned as it is."""
    if not isinstance(state_dict, dict) or not state_dict:
        return state_dict
    keys = list(state_dict)
    if not all(isinstance(k, str) and k.startswith("module.") for k in keys):
        return state_dict
    stripped = type(state_dict)() if isinstance(state_dict, dict) else {}
    for key, value in state_dict.items():
        stripped[key[len("module."):]] = value
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        stripped._metadata = type(metadata)((k[len("module."):] if k.startswith("module.") else k, v)
                                            for k, v in metadata.items())
    return stripped


def shard_length(dataset: Any) -> int:
    """How many samples of `dataset` this rank trains on per epoch: what `len(dataset)` was
    in one process. A padded DistributedSampler gives each of N ranks ceil(len / N)."""
    total = len(dataset)
    if not is_distributed():
        return total
    world = get_world_size()
    return (total + world - 1) // world


def shard_rows(*tensors: Any) -> Any:
    """This rank's rows of tensors a script trains on whole (full-batch training on fixed
    tensors: `model(inputs)`, `criterion(output, targets)`): rows along dim 0, split as a
    DistributedSampler without shuffling splits a dataset, every world_size-th row from this
    rank's, padded by repeating the first rows so every rank gets ceil(n / world_size). All
    tensors get the same rows, so inputs and targets stay paired; with equal shares and a
    mean loss the averaged gradient is the whole batch's, as in one process. One tensor gives
    one tensor, several a tuple; in one process they come back unchanged.

    Tensors that cannot be split alike (not all tensors, no dim 0, different lengths, fewer
    rows than ranks) come back unchanged with one warning: every rank then trains on all
    rows, which is correct, just not faster.
    """
    single = len(tensors) == 1
    if not is_distributed() or not tensors:
        return tensors[0] if single else tensors
    world = get_world_size()
    lengths = {t.shape[0] if isinstance(t, torch.Tensor) and t.dim() > 0 else None for t in tensors}
    n = next(iter(lengths))
    if len(lengths) != 1 or n is None or n < world:
        why = ("not every argument is a tensor with rows" if None in lengths else
               f"the tensors have different lengths ({', '.join(map(str, sorted(lengths)))})" if len(lengths) > 1
               else f"{n} rows for {world} ranks")
        if is_main_process() and why not in _UNSPLIT:
            _UNSPLIT.add(why)
            warnings.warn(f"gpumigrate.runtime: shard_rows: {why}; every rank trains on all rows", RuntimeWarning,
                          stacklevel=2)
        return tensors[0] if single else tensors
    share = (n + world - 1) // world
    rows = torch.arange(share * world)[get_rank()::world] % n
    # a leaf that requires grad (inputs differentiated, `autograd.grad(out, x)`) gives a leaf
    # too: an indexed view's graph would be freed by the first backward, and every step's
    # graph starts at the tensor, as in one process
    split = tuple(t[rows.to(t.device)].detach().requires_grad_() if t.is_leaf and t.requires_grad
                  else t[rows.to(t.device)] for t in tensors)
    return split[0] if single else split


_UNSPLIT: set = set()


class _Shard(Sampler):
    """Every rank_th index, without padding: each sample is evaluated exactly once."""

    def __init__(self, dataset: Dataset, rank: int, world_size: int) -> None:
        self.indices = range(rank, len(dataset), world_size)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def distributed_sampler(
    dataset: Dataset, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False, pad: bool = True,
    shard: bool = True,
) -> Optional[Sampler]:
    """The sampler a DataLoader needs to give each rank its own part of `dataset`.

    Training (`pad=True`): a DistributedSampler, which pads so every rank runs the same
    number of steps, with a new order each epoch (its order follows `seed`, the same on every
    rank, not `torch.manual_seed`): `set_epoch(loader, epoch)` sets the epoch, and an
    iteration over the loader that no `set_epoch` preceded starts the next one by itself.
    Evaluation (`pad=False`): a plain, unshuffled shard, so no sample is counted twice;
    shards differ in size by at most one, so sum the metrics with `reduce_sum` (a
    `reduce_mean` of per-rank means is biased).
    `shard=False`: every rank takes the whole dataset (a loader factory's evaluation loader
    whose metrics are not sums). In one process, or unsharded: what `DataLoader(shuffle=...)`
    would use, so results do not change.
    """
    if not shard or not is_distributed():
        return RandomSampler(dataset) if shuffle else None
    if not pad:
        return _Shard(dataset, get_rank(), get_world_size())
    return _EpochSampler(dataset, shuffle=shuffle, seed=seed, drop_last=drop_last)


class _EpochSampler(DistributedSampler):
    """A DistributedSampler with a new order at each pass, also where no `set_epoch` is called
    (the epoch loop of a loader built elsewhere is not known): an iteration that no
    `set_epoch()` preceded takes the epoch after the previous iteration's. With `set_epoch`
    before every epoch, exactly a DistributedSampler."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._passes = 0
        self._epoch_set = False

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self._epoch_set = True

    def __iter__(self) -> Iterator[int]:
        if self._passes and not self._epoch_set:
            self.epoch += 1
        self._passes += 1
        self._epoch_set = False
        return super().__iter__()


class _SubsetEpochSampler(_EpochSampler):
    """A SubsetRandomSampler's indices split as an _EpochSampler splits a dataset: a new
    shuffle of the subset each epoch, this rank's every world_size-th, padded. `indices` are
    the ones this rank draws this epoch (a script's `len(loader.sampler.indices)` counts its
    share, as `len(dataset)` does with `shard_length`)."""

    def __init__(self, subset: Sequence[int], **kwargs: Any) -> None:
        self._subset = list(subset)
        super().__init__(range(len(self._subset)), **kwargs)  # type: ignore[arg-type]

    @property
    def indices(self) -> list:
        return [self._subset[i] for i in DistributedSampler.__iter__(self)]

    def __iter__(self) -> Iterator[int]:
        return (self._subset[i] for i in super().__iter__())


def shard_loader(loader: Any, *, seed: int = 0, pad: bool = True, shard: bool = True) -> Any:
    """`loader` (a DataLoader built anywhere: a factory in another module) giving this rank
    its own part of the data each epoch; in one process, `loader` itself.

    The new loader keeps everything else `loader` had (batch size, drop_last, workers,
    collate_fn, pin_memory, timeout, worker_init_fn, generator, persistent workers, prefetch
    factor, multiprocessing context). Its sampler is a DistributedSampler that shuffles if
    `loader` did (RandomSampler; a SubsetRandomSampler's indices are shuffled and split the
    same way) and not if it read in order (SequentialSampler), and takes a new order at each
    pass over the loader unless `set_epoch` set the epoch (see `distributed_sampler`; `seed`
    is the same on every rank). `pad=False` (evaluation): every sample once, in order, shards
    differing in size by at most one.

    A list or tuple (batches the script made) is dealt out: this rank's every WORLD_SIZE-th
    item, as many on every rank. What cannot be sharded safely is returned unchanged with one
    warning naming why (every
    rank then reads all of it): an IterableDataset, a custom sampler or batch_sampler, a
    RandomSampler drawing with replacement or a number of samples, a DataLoader subclass. A
    loader already sharded (a DistributedSampler) is returned as it is. The same `loader` gives
    the same rebuilt loader at every call (a trainer that shards what it is handed, once per
    epoch, still gets a new order each epoch). `shard=False` returns `loader` (a phase that
    does not train: `shard_loader(dataloaders[phase], shard=phase == 'train')`).
    """
    if not shard or not is_distributed() or loader is None:  # None: a loader the script did not make
        return loader
    bar = _progress_bar(loader)
    if bar is not None:  # `shard_loader(tqdm(loader))`: the bar counts this rank's part
        bar.iterable = shard_loader(bar.iterable, seed=seed, pad=pad)
        try:
            bar.total = len(bar.iterable)
        except TypeError:
            pass
        return bar
    if isinstance(loader, (list, tuple)):  # batches the script made itself (`np.split(data, n // 8)`)
        return _dealt(loader, pad)
    return _cached_shard(loader, seed, pad, False)


def _dealt(batches: Union[list, tuple], pad: bool) -> Union[list, tuple]:
    """This rank's every WORLD_SIZE-th batch: training (`pad`) as many on every rank (the last
    few left out), so no rank waits in a step the others never take; evaluation every one."""
    world = get_world_size()
    end = len(batches) // world * world if pad else len(batches)
    if end == 0:
        if is_main_process():
            warnings.warn(f"gpumigrate.runtime: shard_loader: {len(batches)} batches for {world} ranks; every rank "
                          "reads all of them", RuntimeWarning, stacklevel=3)
        return batches
    return type(batches)(batches[get_rank():end:world])


def _progress_bar(obj: Any) -> Optional[Any]:
    """A tqdm bar (any of its flavours) wrapping an iterable, else None."""
    for cls in type(obj).__mro__:
        if cls.__name__ == "tqdm" and cls.__module__.startswith("tqdm"):
            return obj if getattr(obj, "iterable", None) is not None else None
    return None


def _cached_shard(loader: Any, seed: int, pad: bool, full_batches: bool) -> Any:
    """The loader rebuilt for this rank, once per (loader, options)."""
    key = (seed, pad, full_batches)
    try:
        return _SHARDED[loader][key]
    except (KeyError, TypeError):
        pass
    sharded = _shard_loader(loader, seed, pad, full_batches)
    try:
        _SHARDED.setdefault(loader, {})[key] = sharded
    except TypeError:  # not weakly referable: rebuilt at each call
        pass
    return sharded


_SHARDED: "weakref.WeakKeyDictionary[Any, Dict[Tuple[int, bool, bool], Any]]" = weakref.WeakKeyDictionary()


def _shard_loader(loader: Any, seed: int, pad: bool, full_batches: bool = False, quiet: bool = False) -> Any:
    batches = getattr(loader, "batch_sampler", None)
    sampler = batches.sampler if type(batches) is BatchSampler else getattr(loader, "sampler", None)
    if isinstance(sampler, (DistributedSampler, _Shard)):
        return loader
    why = _why_not_sharded(loader, batches, sampler)
    if why:
        if is_main_process() and not quiet:
            warnings.warn(f"gpumigrate.runtime: shard_loader: {why}; every rank reads all of it", RuntimeWarning,
                          stacklevel=3)
        return loader
    dataset = loader.dataset
    if isinstance(sampler, SubsetRandomSampler) and pad:
        sampler = _SubsetEpochSampler(sampler.indices, num_replicas=get_world_size(), rank=get_rank(), seed=seed)
    elif isinstance(sampler, SubsetRandomSampler):
        subset = list(sampler.indices)
        sampler = _Shard(subset, get_rank(), get_world_size())  # type: ignore[arg-type]
        sampler.indices = [subset[i] for i in sampler.indices]  # type: ignore[assignment]
    elif pad:
        sampler = _EpochSampler(dataset, num_replicas=get_world_size(), rank=get_rank(),
                                shuffle=isinstance(sampler, RandomSampler), seed=seed)
    else:
        sampler = _Shard(dataset, get_rank(), get_world_size())
    batch_size, drop_last = (batches.batch_size, batches.drop_last) if batches is not None else (None, False)
    if full_batches and batch_size and len(sampler) >= batch_size:  # type: ignore[arg-type]
        drop_last = True  # this rank's last partial batch: every rank has as many, none a shape the loop lacks
    return _rebuilt_loader(loader, batch_size=batch_size, sampler=sampler, drop_last=drop_last)


def _rebuilt_loader(loader: DataLoader, **sampling: Any) -> DataLoader:
    """A DataLoader over `loader`'s dataset, loading as it does, sampling as `sampling` says."""
    options = {}
    for name in ("pin_memory_device", "in_order"):  # keyword-only, in newer torch
        if hasattr(loader, name):
            options[name] = getattr(loader, name)
    return DataLoader(
        loader.dataset, num_workers=loader.num_workers, collate_fn=loader.collate_fn, pin_memory=loader.pin_memory,
        timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context, generator=loader.generator,
        # without workers DataLoader refuses a prefetch factor, which torch < 2.0 stored as 2 anyway
        prefetch_factor=loader.prefetch_factor if loader.num_workers else None,
        persistent_workers=loader.persistent_workers and loader.num_workers > 0, **sampling, **options,
    )


def _why_not_sharded(loader: Any, batches: Any, sampler: Any) -> Optional[str]:
    """Why shard_loader cannot rebuild `loader` for one rank, or None."""
    if not isinstance(loader, DataLoader):
        return f"{type(loader).__name__} is not a torch DataLoader"
    if type(loader) is not DataLoader:
        return f"a DataLoader subclass ({type(loader).__name__}) may build its own sampling"
    if isinstance(loader.dataset, IterableDataset):
        return "an IterableDataset must split its stream per rank itself"
    if batches is not None and type(batches) is not BatchSampler:
        return f"custom batch_sampler ({type(batches).__name__})"
    if type(sampler) is SubsetRandomSampler:
        return None if sampler.generator is None else "a SubsetRandomSampler with a generator of its own"
    if type(sampler) not in (RandomSampler, SequentialSampler):
        return f"custom sampler ({type(sampler).__name__})"
    if isinstance(sampler, RandomSampler) and (sampler.replacement or sampler.num_samples != len(loader.dataset)):
        return "a RandomSampler with replacement or num_samples"
    return None


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank `src`'s value of `obj` on every rank (a run directory from `tempfile.mkdtemp()`,
    a timestamp, a uuid): values that differ per process must agree before they name files.
    In one process it returns `obj`."""
    if not is_distributed():
        return obj
    agree(BROADCAST, src)
    if get_rank() != src:
        return _receive_object(src)
    # Pickled, then its length and its bytes as uint8 tensors: dist.broadcast_object_list
    # needs numpy under gloo, which the runtime does not depend on.
    device = _collective_device()
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    dist.broadcast(torch.tensor([len(payload)], dtype=torch.int64, device=device), src=src)
    dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device), src=src)
    return obj


@shadow(BROADCAST)
def _receive_object(src: int) -> Any:
    """The receiving side of `broadcast_object` (also on a rank that has finished, see uneven.py)."""
    if src == dist.get_rank():
        raise RuntimeError(f"gpumigrate.runtime: rank {src} has finished, and another rank waits for an object from it")
    device = _collective_device()
    size = torch.tensor([0], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src)
    data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(data, src=src)
    data = data.cpu().contiguous()
    return pickle.loads(ctypes.string_at(data.data_ptr(), data.numel()))  # the bytes, copied out


def _take_training_state(source: int) -> None:
    """After uneven steps (uneven.py's `finish`): every optimizer's parameters, state and
    param_groups, and the BatchNorm statistics of what it trains, as rank `source` has them.
    Matched by the optimizers' numbers (their order of construction, alike on every rank).
    The layout goes as one object, the tensors as the step hooks broadcast parameters (one
    flat broadcast per dtype: pickled, each tensor would be a `torch.save` of its own)."""
    live = {number: ref() for number, ref in _OPTIMIZERS.values() if ref() is not None}
    device = _collective_device()
    tensors: List[torch.Tensor] = []
    layout = None
    if get_rank() == source:
        def slot(tensor: torch.Tensor) -> "_Slot":
            tensors.append(tensor.detach().to(device))
            return _Slot(len(tensors) - 1)

        layout = {}
        for number, optimizer in live.items():
            plan = optimizer.__dict__.get(_PLAN)
            params = [p for g in optimizer.param_groups for p in g["params"]]
            buffers = list(plan.buffers) if plan is not None else []
            layout[number] = tuple(_mapped(part, torch.Tensor, slot)
                                   for part in (optimizer.state_dict(), params, buffers))
        layout = (layout, [(tuple(t.shape), t.dtype) for t in tensors])
    layout, specs = broadcast_object(layout, src=source)
    if get_rank() != source:
        tensors = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in specs]
    _broadcast(tensors, src=source)  # the same tensors in the same order on every rank: the same buckets
    if get_rank() == source:
        return
    for number, (state, params, buffers) in layout.items():
        optimizer = live.get(number)
        if optimizer is None:
            continue
        plan = optimizer.__dict__.get(_PLAN)
        mine = [p for g in optimizer.param_groups for p in g["params"]]
        theirs = list(plan.buffers) if plan is not None else []
        pairs = [*zip(mine, params), *(zip(theirs, buffers) if len(theirs) == len(buffers) else ())]
        with torch.no_grad():
            for here, slot in pairs:
                here.copy_(tensors[slot])
        # load_state_dict moves the state to its parameters' devices
        optimizer.load_state_dict(_mapped(state, _Slot, lambda k: tensors[k].cpu()))


_settlers.append(_take_training_state)


class _Slot(int):
    """Where a tensor of `_take_training_state`'s layout is, in the tensors broadcast after it."""


def _mapped(obj: Any, kind: type, fn: Callable[[Any], Any]) -> Any:
    """`obj` with each `kind` in its dicts, lists and tuples replaced by `fn` of it."""
    if isinstance(obj, kind):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _mapped(v, kind, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_mapped(v, kind, fn) for v in obj)
    return obj


def set_epoch(loader: Any, epoch: Optional[int] = None) -> None:
    """Tell a loader's DistributedSampler the epoch, so each epoch has a new order.

    Without `epoch` (iteration-based training that rebuilds `iter(loader)` when a pass ends)
    each call starts the next epoch: 0, 1, 2, ..."""
    sampler = getattr(loader, "sampler", loader)
    batch_sampler = getattr(loader, "batch_sampler", None)
    for candidate in (sampler, getattr(batch_sampler, "sampler", None)):
        if hasattr(candidate, "set_epoch"):
            if epoch is None:
                epoch = getattr(candidate, "_gpumigrate_next_epoch", 0)
            candidate._gpumigrate_next_epoch = epoch + 1
            candidate.set_epoch(epoch)
            return


Number = Union[int, float, torch.Tensor]


def reduce_sum(*values: Number) -> Any:
    """Sum numbers or tensors over all ranks (one collective for all of them).

    Returns the same types it was given: one value for one argument, else a tuple.
    In one process it returns its arguments unchanged, without communicating."""
    if not is_distributed():
        return values[0] if len(values) == 1 else values
    device = _collective_device()
    flat = [torch.as_tensor(v, dtype=torch.float64).detach().to(device).reshape(-1) for v in values]
    packed = torch.cat(flat)
    agree(REDUCE, packed.numel())  # a rank that has finished adds zeros
    dist.all_reduce(packed, op=dist.ReduceOp.SUM)
    out, start = [], 0
    for value, part in zip(values, flat):
        chunk = packed[start:start + part.numel()]
        start += part.numel()
        out.append(_like(value, chunk))
    return out[0] if len(out) == 1 else tuple(out)


def reduce_mean(*values: Number) -> Any:
    """The mean over ranks of each value (for per-rank averages of equal-sized shards)."""
    summed = reduce_sum(*values)
    world = get_world_size()
    if world == 1:
        return summed
    parts: Sequence[Number] = summed if len(values) > 1 else (summed,)
    means = tuple(p / world for p in parts)
    return means[0] if len(means) == 1 else means


def _like(original: Number, chunk: torch.Tensor) -> Number:
    if isinstance(original, torch.Tensor):
        return chunk.reshape(original.shape).to(device=original.device, dtype=original.dtype)
    if isinstance(original, bool):
        return bool(chunk.item())
    if isinstance(original, int):
        return int(round(chunk.item()))
    return float(chunk.item())
