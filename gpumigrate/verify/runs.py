"""Running a command with a hard time limit, and a torchrun launch's whole process tree."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

# A launcher's variables in the caller's environment must not leak into the runs.
LAUNCH_VARS = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
               "MASTER_ADDR", "MASTER_PORT"}


# what a rank says when its peer, not itself, went away (gloo's errors, the runtime's stop): the
# root cause is another rank's error, or the ranks called different collectives
PEER_GONE = re.compile(r"Connection (reset|closed) by peer|remote worker|stopping rank|failed \(|collective mismatch|"
                       r"Socket Timeout|wait timeout|Timed out waiting", re.I)


def clean_env() -> Dict[str, str]:
    """This process's environment without a launcher's or a scheduler's variables."""
    return {k: v for k, v in os.environ.items()
            if k not in LAUNCH_VARS and not k.startswith(("TORCHELASTIC_", "SLURM_"))}


def _descendants(pid: int) -> List[int]:
    """Every process below `pid` (from /proc; empty where there is none)."""
    children: Dict[int, List[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def run_bounded(cmd: Sequence[str], cwd: Path, env: Dict[str, str],
                timeout: float) -> Tuple[Optional[int], str, str, float]:
    """`cmd` in a session of its own: (exit status, stdout, stderr, seconds). Past `timeout`
    every process it started is killed and the status is None."""
    start = time.perf_counter()
    proc = subprocess.Popen(list(cmd), cwd=str(cwd), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        code: Optional[int] = proc.returncode
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        try:
            stdout, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            stdout, stderr = "", "(output lost: a process survived the kill)"
        code = None
    return code, stdout, stderr, time.perf_counter() - start


def kill_tree(proc: subprocess.Popen) -> None:
    """torchrun starts each worker in a session of its own: killing torchrun's process group
    leaves them running (and holding the output pipes), so kill every descendant by pid."""
    for pid in [proc.pid, *_descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
