"""Ranks that all wait in collectives that never match: found by the watchdog thread of
distributed.py (`_Watch`, one look a second) and ended with one line naming where each waits.

No rank has failed, and still the job hangs without a word for gloo's 30 minutes (NCCL's:
forever): rank 0 skipped a barrier that rank 1 entered (an exception swallowed by `except
OSError: pass`) and waits in DistributedDataParallel's construction; rank 0 takes one more step
than rank 1, which waits at exit in uneven.py's `finish()`; rank 0 calls `all_reduce` where
rank 1 calls `barrier`. gloo matches messages by the collective's number and kind, so
collectives of different kinds, or one rank's nth and another's (n+1)th, never meet.

A rank is stalled while its main thread waits in a torch call that communicates (a collective,
DDP's construction, forward or backward, the runtime's own collectives) and has not moved since
the stall began: the same place, next to no CPU time (Linux: /proc/self/task/<tid>/stat;
without /proc none of this runs), no new collective begun on the default group. A rank that
computes (its CPU time advances), sleeps or reads input (not in torch) is not stalled: a rank
evaluating or saving for minutes while the others wait at a barrier stops no one. A rank
stalled for nearly the timeout publishes where it waits in the store (nothing is written
before) and reads the others'; when two looks in a row find every rank stalled for the
timeout, longer at the second look (so no rank's value is stale), at places that are not all
the same, the watchdog posts the verdict and every rank stops. Ranks that all wait at the same
place are left alone: that is one collective still under way (a large one over a slow link),
not collectives that do not match. Under NCCL most collectives return before they complete, and
a rank waits later, at a synchronisation in the script's own code (`loss.item()`), which is no
stall here: NCCL's own watchdog ends such a job at the process group's timeout.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from types import FrameType
from typing import Any, Dict, NamedTuple, Optional, Tuple

import torch.distributed as dist

# A main thread that waits for other ranks is blocked in torch's C++, called from one of these
# modules (distributed_c10d's collectives, DDP's construction and buffer broadcast, the autograd
# engine running DDP's backward), or from the runtime's own collectives. Distributed
# checkpointing writes files: waiting for slow storage is no stall.
_WAITING_IN = ("torch.distributed", "torch.nn.parallel", "torch.autograd")
_NOT_WAITING_IN = ("torch.distributed.checkpoint", "torch.distributed.elastic")
# The runtime's modules: the package `gpumigrate.runtime`, or, vendored, the one module
_RUNTIME_PACKAGE = __name__[:-len(".stalls")] if __name__.endswith(".stalls") else __name__
_RUNTIME_WAITS = ((f"{_RUNTIME_PACKAGE}.uneven", f"{_RUNTIME_PACKAGE}.averaging")
                  if _RUNTIME_PACKAGE != __name__ else (__name__,))
_BUSY = 0.05  # a main thread that used more than this share of a core since its stall began computes
_EARLY = 1.0  # seconds before the timeout at which a stalled rank publishes, so one look confirms


class Place(NamedTuple):
    """Where a rank's main thread waits."""

    where: str  # the line of the script's own code: "train.py:41"; "the end of train.py" at exit
    call: str  # what that line called, in torch or the runtime: "DistributedDataParallel.__init__"


def _within(name: str, packages: Tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def _module(frame: FrameType) -> str:
    name = frame.f_globals.get("__name__")
    return name if isinstance(name, str) else ""


def _qualname(frame: FrameType) -> str:
    return getattr(frame.f_code, "co_qualname", frame.f_code.co_name)  # co_qualname: Python >= 3.11


_library_dirs: Optional[Tuple[str, ...]] = None


def _library_directories() -> Tuple[str, ...]:
    """Where the standard library and installed packages live (found once)."""
    global _library_dirs
    if _library_dirs is None:
        import site
        import sysconfig

        paths = [sysconfig.get_paths().get(key) for key in ("stdlib", "platstdlib", "purelib", "platlib")]
        try:
            paths += [*site.getsitepackages(), site.getusersitepackages()]
        except Exception:  # a site module without them (old virtualenv)
            pass
        _library_dirs = tuple(sorted({os.path.join(norm(p), "") for p in paths if p
                                      for norm in (os.path.abspath, os.path.realpath)}))
    return _library_dirs


def _is_torch_or_runtime(name: str) -> bool:
    return _within(name, ("torch", _RUNTIME_PACKAGE))


def _is_users(frame: FrameType) -> bool:
    """Whether `frame` runs the script's own code: not torch, not the runtime, not the standard
    library or an installed package."""
    path = frame.f_code.co_filename
    return not (_is_torch_or_runtime(_module(frame)) or path.startswith("<frozen")
                or path.startswith(_library_directories()))


def _is_called(frame: FrameType) -> bool:
    """A function of torch or the runtime a script calls by name: not private, not a decorator's
    closure (c10d's logging wrapper), not nn.Module's call plumbing."""
    qualname = _qualname(frame)
    last = qualname.rpartition(".")[2]
    private = last.startswith(("_", "<")) and not (last.startswith("__") and last.endswith("__"))
    return _is_torch_or_runtime(_module(frame)) and "<locals>" not in qualname and not private


def waiting_place(thread: threading.Thread) -> Optional[Tuple[Place, Tuple[str, int]]]:
    """Where `thread` waits in a torch call that communicates, with its innermost frame (file,
    line); None when its innermost frame is not in one."""
    frame: Optional[FrameType] = sys._current_frames().get(thread.ident)  # type: ignore[arg-type]
    if frame is None:
        return None
    name = _module(frame)
    if not (name in _RUNTIME_WAITS or (_within(name, _WAITING_IN) and not _within(name, _NOT_WAITING_IN))):
        return None
    innermost = (frame.f_code.co_filename, frame.f_lineno)
    call = _qualname(frame)
    while frame is not None and not _is_users(frame):
        if _is_called(frame):
            call = _qualname(frame)  # the outermost one is what the script's line called
        frame = frame.f_back
    if frame is not None:
        where = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
    else:  # the script has ended (its exit handlers run: cleanup_distributed), or is all library code
        script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "the script"
        where = script if thread.is_alive() else f"the end of {script}"
    return Place(where, call), innermost


_ticks: Optional[int] = None


def _cpu_seconds(tid: Optional[int]) -> Optional[float]:
    """The CPU time (user and system) thread `tid` of this process has used; None without /proc."""
    global _ticks
    try:
        if _ticks is None:
            _ticks = os.sysconf("SC_CLK_TCK")
        with open(f"/proc/self/task/{tid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()  # after the thread's name, which may hold spaces
        return (int(fields[11]) + int(fields[12])) / _ticks
    except (AttributeError, OSError, ValueError, IndexError):  # AttributeError: no os.sysconf (Windows)
        return None


def _collectives_begun() -> Optional[int]:
    """How many collectives this rank has begun on the default group (torch's private sequence
    number, read only; None where torch has none)."""
    try:
        return int(dist.distributed_c10d._get_default_group()._get_sequence_number_for_group())
    except Exception:
        return None


class _Stall(NamedTuple):
    place: Place
    innermost: Tuple[str, int]
    begun: Optional[int]  # _collectives_begun() then
    since: float  # time.monotonic() of the first look that found it
    cpu: float  # the main thread's CPU seconds then


class Stalls:
    """This rank's side (see the module docstring): how long its main thread has been stalled,
    published under `prefix` in the group's store once that nears the timeout."""

    def __init__(self, rank: int, world_size: int, timeout: float, prefix: str) -> None:
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self.keys = [f"{prefix}stalled/{r}" for r in range(world_size)]  # "<seconds>\t<where>\t<call>", or ""
        self.main = threading.main_thread()
        self.stall: Optional[_Stall] = None
        self.published = False  # this rank's key holds a stall
        self.seen: Dict[int, float] = {}  # each other rank's stall seconds at the previous look

    def _stalled(self) -> Tuple[Optional[Place], float]:
        """Where the main thread is stalled and for how many seconds; (None, 0) if it is not."""
        now, found = time.monotonic(), waiting_place(self.main)
        cpu = _cpu_seconds(self.main.native_id) if found is not None else None
        if found is None or cpu is None:
            self.stall = None
            return None, 0.0
        place, innermost = found
        begun, stall = _collectives_begun(), self.stall
        if (stall is None or (stall.place, stall.innermost, stall.begun) != (place, innermost, begun)
                or cpu - stall.cpu > _BUSY * (now - stall.since)):
            self.stall = stall = _Stall(place, innermost, begun, now, cpu)
        return place, now - stall.since

    def look(self, store: Any) -> Optional[str]:
        """One look: where each rank waits ("rank 0 at train.py:41 (barrier), rank 1 at ...")
        when every rank has been stalled for the timeout at places not all the same; else
        None. A store that fails raises (the watchdog stops looking then)."""
        try:
            place, seconds = self._stalled()
        except Exception:  # never let this stop the watchdog's look for failures
            place, seconds = None, 0.0
        if place is None or seconds < self.timeout - _EARLY:
            if self.published:
                store.set(self.keys[self.rank], "")
                self.published = False
            self.seen.clear()
            return None
        store.set(self.keys[self.rank], f"{seconds:.1f}\t{place.where}\t{place.call}")
        self.published = True
        others = [r for r in range(self.world_size) if r != self.rank]
        keys = [self.keys[r] for r in others]
        if not store.check(keys):  # a rank that was never stalled this long (a get would wait for it)
            return None
        values = store.multi_get(keys) if hasattr(store, "multi_get") else [store.get(key) for key in keys]
        places = {self.rank: place}
        confirmed = seconds >= self.timeout
        for rank, value in zip(others, values):
            text, _, rest = value.decode("utf-8", "replace").partition("\t")
            try:
                theirs = float(text)
            except ValueError:  # "": not stalled
                theirs = -1.0
            confirmed = confirmed and self.timeout <= theirs and self.seen.get(rank, theirs) < theirs
            self.seen[rank] = theirs
            places[rank] = Place(*rest.partition("\t")[::2])
        if not confirmed or len(set(places.values())) < 2:
            return None
        return ", ".join(f"rank {rank} at {p.where} ({p.call})" for rank, p in sorted(places.items()))


def watch_stalls(rank: int, world_size: int, timeout: float, prefix: str) -> Optional[Stalls]:
    """A `Stalls` for this rank; None where threads' CPU times cannot be read (no /proc)."""
    if _cpu_seconds(threading.main_thread().native_id) is None:
        return None
    return Stalls(rank, world_size, timeout, prefix)
