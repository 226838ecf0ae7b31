"""Running a script under gpumigrate/verify/probe.py, in one process or under torchrun, and reading
what the probe recorded. Shared by the end-to-end test modules."""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from gpumigrate.verify.runs import clean_env, run_bounded
from tests.conftest import ROOT

PROBE = ROOT / "gpumigrate" / "verify" / "probe.py"
NPROC = 2
TIMEOUT = 120  # seconds per run; a correct one takes < 10 s here, a deadlocked one never ends


def probe_env(work: Path, extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = clean_env()
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), TMPDIR=str(work / "tmp"), PYTHONHASHSEED="0")
    env.update(extra or {})
    return env


@dataclass
class Run:
    kind: str
    cmd: List[str]
    returncode: Optional[int]  # None: killed at the timeout
    stdout: str
    stderr: str
    seconds: float
    work: Path
    out: Path
    timeout: float = TIMEOUT
    ranks: Dict[int, dict] = field(default_factory=dict)

    @property
    def nproc(self) -> int:
        return NPROC if "torch.distributed.run" in self.cmd else 1

    def why(self) -> str:
        status = f"timed out after {self.timeout} s (deadlock?)" if self.returncode is None else \
            f"exit {self.returncode}"
        errors = "".join(f"\n--- rank {r}: {rep['error']['traceback'][-1500:]}" for r, rep in sorted(self.ranks.items())
                         if rep.get("error"))
        return f"{self.kind} run {status} ({' '.join(self.cmd)}){errors}\n--- stderr tail ---\n{self.stderr[-3000:]}"

    def ok(self) -> bool:
        return (self.returncode == 0 and sorted(self.ranks) == list(range(self.nproc))
                and all(rep.get("error") is None for rep in self.ranks.values()))

    def summary(self) -> str:
        if self.returncode is None:
            return f"timed out after {self.timeout} s (a deadlock: ranks waiting in different collectives?)"
        errors = "; ".join(f"rank {r}: {rep['error']['type']}: {rep['error']['message'][:300]}"
                           for r, rep in sorted(self.ranks.items()) if rep.get("error"))
        return errors or self.why()[-600:]

    def vector(self, rank: int, index: int) -> torch.Tensor:
        """The parameters of the index-th model wrap_model returned, flattened."""
        return torch.load(self.out / f"rank{rank}_model{index}.pt")

    def optim_vector(self, rank: int, index: int, initial: bool = False) -> torch.Tensor:
        """The parameters the index-th optimizer trains, flattened (at the end, or at the start)."""
        entry = self.ranks[rank]["optimizers"][index]
        return torch.load(self.out / entry["initial" if initial else "vector"])

    def checkpoint_files(self) -> List[Path]:
        """*.pt files the script left in its cwd or temp dir (not the probe's own)."""
        return sorted(p for p in self.work.rglob("*.pt") if self.out not in p.parents)


def run_probe(script: Path, work: Path, nproc: int, args: Sequence[str] = (), probe_args: Sequence[str] = (),
              kind: str = "", env: Optional[Dict[str, str]] = None, timeout: float = TIMEOUT) -> Run:
    """Copy `script` into `work` (unless it is there) and run it there under the probe: `python` for one process,
    `torchrun --standalone` for more. Its cwd and TMPDIR are inside `work`, so whatever it
    writes (also to tempfile.gettempdir() or mkdtemp) lands there."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "tmp").mkdir(exist_ok=True)
    local = work / script.name
    if local.resolve() != script.resolve():  # a project runs where its modules are
        shutil.copy(script, local)
    out = work / "probe"
    launcher = [sys.executable] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd = [*launcher, str(PROBE), *probe_args, str(out), str(local), *args]
    code, stdout, stderr, seconds = run_bounded(cmd, work, probe_env(work, env), timeout)
    run = Run(kind or f"{nproc}-process", cmd, code, stdout, stderr, seconds, work, out, timeout)
    for report in sorted(out.glob("rank*.json")):
        data = json.loads(report.read_text())
        run.ranks[data["rank"]] = data
    return run
