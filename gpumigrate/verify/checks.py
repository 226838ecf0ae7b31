"""The comparisons of a verify session, each a `Check` that names the quantity it measured.

Tolerances: losses and parameters as `torch.testing.assert_close` for float32 (rtol 1.3e-6,
atol 1e-5); printed numbers to one unit of their last printed digit (plus 1e-5 relative);
parameters across ranks 1e-6 relative; a bfloat16 run's first losses within 3.2e-2
relative of the float32 run's.
"""

from __future__ import annotations

import math
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Optional, Sequence, Tuple

from gpumigrate.verify.runs import PEER_GONE

if TYPE_CHECKING:
    from gpumigrate.verify.runner import Probed, Session

RTOL, ATOL = 1.3e-6, 1e-5
RANK_RTOL = 1e-6
BF16_RTOL, BF16_STEPS = 3.2e-2, 3
NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?(?![\d.])|\bnan\b|\binf\b")
TIME_UNIT = re.compile(r"(ms|s|sec|secs|min|h)\b")
# a number whose neighbourhood says it measures time, speed or a date: it differs from run to run
VOLATILE = re.compile(r"time|sec|\bs\b|ms|elapsed|eta|speed|/s\b|s/|throughput|fps|took|date|clock|"
                      r"\d:\d\d|\d{4}-\d\d|mb\b|gb\b|memory|mem\b", re.I)


@dataclass
class Check:
    name: str
    status: str                      # pass | fail | skip
    detail: str
    line: Optional[str] = None       # file:line of the migrated script where the quantity is computed
    values: Dict[str, Any] = field(default_factory=dict)

    def as_json(self) -> dict:
        return {"name": self.name, "status": self.status, "detail": self.detail, "line": self.line,
                "values": self.values}


@dataclass
class Verdict:
    script: str
    target: str
    status: str                      # equivalent | different | unknown
    reason: str
    checks: List[Check] = field(default_factory=list)
    runs: Dict[str, dict] = field(default_factory=dict)
    seconds: float = 0.0
    migration_report: str = ""

    @property
    def exit_code(self) -> int:
        return {"equivalent": 0, "different": 1}.get(self.status, 2)

    def as_json(self) -> dict:
        return {"script": self.script, "target": self.target, "verdict": self.status, "exit_code": self.exit_code,
                "reason": self.reason, "seconds": round(self.seconds, 2), "checks": [c.as_json() for c in self.checks],
                "runs": self.runs}


# ---------------------------------------------------------------- the session

def judge(session: "Session", targets: List[str]) -> Verdict:
    opts = session.opts
    script = str(opts.script)
    verdict = Verdict(script, ",".join(targets), "unknown", "", migration_report=session.migration_report)
    amp = "amp" in targets
    base = session.run_original()
    verdict.runs["original"] = base.summary()
    if not base.ok:
        verdict.reason = _cannot_judge(base, opts)
        return verdict
    for why in session.fallbacks:  # said, so a reader knows what the runs were
        verdict.checks.append(Check("original under the caps", "skip", f"the original fails: {why}"))
    full = {"GPUMIGRATE_AMP": "off"} if amp else None  # exact comparisons in float32; bf16 has its own run
    single = session.run("migrated", original=False, env=full)
    checks = verdict.checks
    checks += _unless_noise(session, base, same_run(base, single, "migrated, one process"
                                                     + (", GPUMIGRATE_AMP=off" if amp else "")))
    checks.append(retained_graphs(single, base))

    def settled() -> bool:  # --fail-fast: the runs after the first difference are not made
        return opts.fail_fast and any(c.status == "fail" for c in checks)

    if ("ddp" in targets or "fsdp" in targets) and not settled():
        dist = session.run("torchrun", original=False, nproc=opts.nproc, env=full)
        checks += ddp_checks(session, base, dist, opts.fail_fast)
    if "fsdp" in targets and dist.ok and not settled():
        session.replicated("ddp,amp" if amp else "ddp")
        twin = session.run("torchrun-ddp", original=False, nproc=opts.nproc, env=full, twin=True)
        checks.append(sharded_like_replicated(dist, twin))
    if amp and not settled():
        bf16 = session.run("bf16", original=False, env={"GPUMIGRATE_AMP": "bf16"})
        checks.append(bf16_band(base, bf16))
        checks.append(scaler_state([single, *([session.runs["torchrun"]] if "torchrun" in session.runs else [])]))
    return _conclude(verdict, session)


def _conclude(verdict: Verdict, session: "Session") -> Verdict:
    checks = verdict.checks
    verdict.runs = {name: run.summary() for name, run in session.runs.items()}
    failed = [c for c in checks if c.status == "fail"]
    timed_out = [r for r in session.runs.values() if r.returncode is None and not _stalled(r)]
    if failed:
        verdict.status = "different"
        first = failed[0]
        verdict.reason = f"{first.name}: {first.detail}" + (f" ({first.line})" if first.line else "")
    elif timed_out:
        verdict.reason = f"the {timed_out[0].name} run {timed_out[0].error()}: raise --timeout"
    else:
        verdict.status = "equivalent"
        verdict.reason = f"{sum(c.status == 'pass' for c in checks)} checks pass"
        if any(REPORTED in c.detail for c in checks):
            verdict.reason += "; not data-parallel, as the migration's report says"
    return verdict


def _unless_noise(session: "Session", base: "Probed", checks: List[Check]) -> List[Check]:
    """Where the migrated script differs from the original, the original runs once more: a
    quantity that differs between two runs of the original itself (a seed from the clock, an
    environment of its own) is noise, not a difference of the migration."""
    compared = {"optimizer steps", "loss", "parameters", "printed output"}
    if not any(c.status == "fail" and c.name in compared for c in checks):
        return checks
    again = session.run("original again", original=True, work_name="original-again")
    if not again.ok:
        return checks
    noisy = {c.name: c for c in same_run(base, again, "the original again") if c.status == "fail"}
    for i, check in enumerate(checks):
        if check.status == "fail" and check.name in noisy:
            checks[i] = Check(check.name, "skip", f"the original itself differs from run to run "
                              f"({noisy[check.name].detail}): seed what it draws to compare this")
    return checks


def _cannot_judge(base: "Probed", opts: Any) -> str:
    error = base.error() or "no report"
    text = f"the original fails on its own: {error}"
    err = (base.rank(0).get("error") or {})
    if err.get("type") in ("FileNotFoundError", "NotADirectoryError") or "No such file" in str(err.get("message")):
        hint = ("it reads files that are not there; pass their paths as script arguments after `--`"
                if opts.data == "real" else
                "it reads data verify cannot fake; run with `--data real` where the files are in place, "
                "or pass their paths as script arguments after `--`")
        text += f" ({hint})"
    elif err.get("type") in ("ModuleNotFoundError", "ImportError"):
        text += " (install what it imports in this environment)"
    elif "fake samples" in base.stderr:  # a split or a batch larger than the faked dataset?
        text += (f" (its datasets were faked with --samples {opts.samples} training samples: a script that splits "
                 f"off or needs more takes a larger --samples, or --data real)")
    elif base.returncode is None:
        text += " (raise --timeout)"
    return text


def _stalled(run: "Probed") -> bool:
    return any((rep.get("error") or {}).get("type") == "Stall" for rep in run.ranks.values())


# ---------------------------------------------------------------- one process against the original

def same_run(base: "Probed", other: "Probed", label: str) -> List[Check]:
    """The migrated script in one process does what the original does."""
    if other.returncode is None:  # too slow to judge, not a difference
        return [Check("run", "skip", f"{label}: {other.error()}")]
    if not other.ok:
        where = _error_where(other)
        return [Check("run", "fail", f"{label}: {other.error()}", where)]
    checks = [Check("run", "pass", f"{label}: exits like the original ({other.seconds:.1f} s)")]
    a, b = base.rank(0).get("steps") or [], other.rank(0).get("steps") or []
    if len(a) != len(b):
        last = (b or a)[-1]
        checks.append(Check("optimizer steps", "fail", f"the original takes {len(a)} optimizer steps, the migrated "
                            f"script {len(b)}", last.get("step_at"), {"original": len(a), "migrated": len(b)}))
    else:
        checks.append(Check("optimizer steps", "pass", f"{len(a)} steps, the same optimizers in the same order"
                            if [s["optimizer"] for s in a] == [s["optimizer"] for s in b] else f"{len(a)} steps"))
    checks.append(_losses(a or _pending(base), b or _pending(other)))
    rtol, atol = _tolerance(a, b)
    checks.append(_parameters(base, other, _band(rtol, len(a)), atol))
    checks.append(_printed(base, other, _band(rtol, len(a)) if rtol > RTOL else 1e-5))
    return checks


def _band(rtol: float, steps: int) -> float:
    """In reduced precision the rounding of each step adds up: the band widens with the steps."""
    return rtol * max(1, steps) if rtol > RTOL else rtol


def _pending(run: "Probed") -> List[dict]:
    """A script without an optimizer (SGD by hand): its backward values, as one step."""
    losses = run.rank(0).get("pending_losses") or []
    return [{"losses": losses, "optimizer": None}] if losses else []


def _error_where(run: "Probed") -> Optional[str]:
    for rep in run.ranks.values():
        err = rep.get("error")
        if err:
            return run.where(err.get("traceback", ""))
    return None


def _close(a: float, b: float, rtol: float = RTOL, atol: float = ATOL) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= atol + rtol * abs(b)


TOLERANCES = {"float16": (1e-3, 1e-5), "bfloat16": (1.6e-2, 1e-5)}  # torch.testing's, by dtype


def _tolerance(*runs: Sequence[dict]) -> Tuple[float, float]:
    """assert_close's (rtol, atol) for the lowest precision the losses or parameters had."""
    dtypes = {d for steps in runs for s in steps for d in s.get("dtypes") or ()}
    found = [TOLERANCES[d] for d in TOLERANCES if d in dtypes]
    return max(found) if found else (RTOL, ATOL)


def _losses(a: List[dict], b: List[dict]) -> Check:
    compared, worst = 0, 0.0
    rtol, atol = _tolerance(a, b)
    for step, (x, y) in enumerate(zip(a, b), 1):
        if len(x["losses"]) != len(y["losses"]):
            return Check("loss", "fail", f"step {step}: the original calls backward() {len(x['losses'])} times, the "
                         f"migrated script {len(y['losses'])} times", y.get("backward_at") or y.get("step_at"))
        band = _band(rtol, step)
        for i, (u, v) in enumerate(zip(x["losses"], y["losses"])):
            compared += 1
            if not _close(v, u, band, atol):
                which = f" (backward {i + 1})" if len(x["losses"]) > 1 else ""
                return Check("loss", "fail", f"step {step}{which}: loss {v:.8g}, the original's {u:.8g}",
                             y.get("backward_at"), {"step": step, "original": u, "migrated": v})
            worst = max(worst, abs(u - v))
    if not compared:
        return Check("loss", "skip", "no scalar loss reached backward()")
    over = f"{min(len(a), len(b))} steps" if a and a[0]["optimizer"] is not None else "the run (no optimizer)"
    return Check("loss", "pass", f"{compared} losses over {over}, max |diff| {worst:.3g}",
                 values={"max_abs_diff": worst})


def _vectors(run: "Probed", rank: int = 0) -> List[Any]:
    import torch
    return [torch.load(run.out / o["vector"]) for o in run.rank(rank).get("optimizers") or []]


def _parameters(base: "Probed", other: "Probed", rtol: float = RTOL, atol: float = ATOL) -> Check:
    va, vb = _vectors(base), _vectors(other)
    if not va:
        return Check("parameters", "skip", "the original builds no optimizer")
    if len(va) != len(vb):
        return Check("parameters", "fail", f"the original builds {len(va)} optimizers, the migrated script {len(vb)}")
    worst = 0.0
    for i, (x, y) in enumerate(zip(va, vb)):
        if x.shape != y.shape:
            return Check("parameters", "fail", f"optimizer {i} trains {y.numel()} parameters, the original's "
                         f"{x.numel()}")
        if x.numel():
            diff = (x - y).abs()
            bad = diff > atol + rtol * x.abs()
            # reduced precision: elementwise, the drift of a few steps is noise; the whole is not
            noise = rtol > RTOL and float(diff.norm()) <= rtol * float(x.norm()) + atol * x.numel() ** 0.5
            if not noise and bool(bad.any()):
                return Check("parameters", "fail", f"after the last step, optimizer {i}'s parameters differ from the "
                             f"original's by up to {float(diff.max()):.3g} ({int(bad.sum())} of {x.numel()})",
                             values={"optimizer": i, "max_abs_diff": float(diff.max())})
            worst = max(worst, float(diff.max()))
    return Check("parameters", "pass", f"{len(va)} optimizer(s), {sum(v.numel() for v in va)} parameters, max |diff| "
                 f"{worst:.3g}", values={"max_abs_diff": worst})


# a 0-dim tensor printed whole (`tensor(0.5230, grad_fn=<DivBackward0>)`) is its number: a
# migration that accumulates `.item()` prints `0.523` where the original printed the tensor
SCALAR_TENSOR = re.compile(r"tensor\(\s*([-+]?(?:\d+\.?\d*(?:e[-+]?\d+)?|nan|inf))\s*(?:,[^()]*(?:\([^()]*\)[^()]*)*)?\)")


def _normalise(text: str, run: "Probed") -> str:
    text = SCALAR_TENSOR.sub(r"\1", text)
    for path in (str(run.tmp), str(run.work), str(run.script.parent)):
        text = text.replace(path, "<run>")
    text = re.sub(r"/tmp\S*?/tmp\w+", "<tmp>", text)
    return re.sub(r"0x[0-9a-fA-F]{6,}", "<addr>", text)


def _numbers(line: str) -> List[Tuple[str, bool]]:
    """The numbers of a line, each with whether it is volatile (a time, a speed, a date)."""
    out = []
    for m in NUMBER.finditer(line):
        around = line[max(0, m.start() - 14):m.end() + 8]
        out.append((m.group(0), bool(VOLATILE.search(around) or TIME_UNIT.match(line, m.end()))))
    return out


def _same_number(a: str, b: str, rtol: float = 1e-5) -> bool:
    if a == b:
        return True
    try:
        x, y = float(a), float(b)
    except ValueError:
        return False
    # to the coarser of the two prints (`tensor(0.0156)` where the migration prints 0.015625)
    digits = min(len(s.split(".")[1]) if "." in s and "e" not in s.lower() else 0 for s in (a, b))
    return _close(x, y, rtol=max(rtol, 1e-5), atol=1.01 * 10 ** -digits if digits else 0.0)


def _printed(base: "Probed", other: "Probed", rtol: float = 1e-5) -> Check:
    la = [(_normalise(ln[2], base), ln[3]) for ln in base.rank(0).get("lines") or []]
    lb = [(_normalise(ln[2], other), ln[3]) for ln in other.rank(0).get("lines") or []]
    diff = compare_lines([t for t, _ in la], [t for t, _ in lb], rtol)
    if diff is None:
        return Check("printed output", "pass", f"{len(lb)} lines, the same text and numbers")
    index, why = diff
    at = lb[index][1] if index < len(lb) else None
    return Check("printed output", "fail", why, at, {"line": index + 1})


def compare_lines(a: Sequence[str], b: Sequence[str], rtol: float = 1e-5) -> Optional[Tuple[int, str]]:
    """(index, why) of the first line of `b` that does not match `a`, or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        why = _line_differs(x, y, rtol)
        if why:
            return i, f"printed line {i + 1}: {why}"
    if len(a) != len(b):
        i = min(len(a), len(b))
        extra = (b if len(b) > len(a) else a)[i]
        who = "the migrated script prints" if len(b) > len(a) else "the original prints"
        return min(i, max(len(b) - 1, 0)), f"{who} {abs(len(a) - len(b))} more lines ({extra.strip()[:80]!r})"
    return None


def _line_differs(x: str, y: str, rtol: float = 1e-5) -> Optional[str]:
    if NUMBER.sub("#", x) != NUMBER.sub("#", y):
        return f"{y.strip()[:100]!r}, the original printed {x.strip()[:100]!r}"
    for (u, vol), (v, _) in zip(_numbers(x), _numbers(y)):
        if not vol and not _same_number(u, v, rtol):
            return f"{v} where the original printed {u} ({y.strip()[:100]!r})"
    return None


# ---------------------------------------------------------------- graphs kept across steps

def retained_graphs(run: "Probed", base: "Probed") -> Check:
    """A name that still holds the autograd graphs of two earlier steps (`total += loss`
    without `.item()`) keeps every step's graph: memory grows until it runs out."""
    scans = run.rank(0).get("retained") or []
    if len(scans) < 3:
        return Check("retained graphs", "skip", f"{len(scans)} steps measured (3 needed)")
    found = [(key, line) for scan in scans for key, line in scan.items()]
    if not found:
        return Check("retained graphs", "pass", f"no name holds the graphs of earlier steps ({len(scans)} steps)")
    key, line = found[0]
    file, function, name = key.split(":", 2)
    original = {k for scan in base.rank(0).get("retained") or [] for k in scan}
    also = " (as the original does)" if key in original else ""
    where = "at module level" if function == "<module>" else f"in {function}()"
    return Check("retained graphs", "fail", f"`{name}` {where} keeps the autograd graph of earlier steps{also}: "
                 f"accumulate `.item()` or a detached tensor", f"{file}:{_adds_to(run, file, name) or line}",
                 {"name": name})


def _adds_to(run: "Probed", file: str, name: str) -> Optional[int]:
    """The first line of `file` (beside the run's script) that adds to `name`."""
    try:
        lines = (run.script.parent / file).read_text(errors="replace").splitlines()
    except OSError:
        return None
    adds = re.compile(rf"\b{re.escape(name)}(\s*\+=|\s*=\s*{re.escape(name)}\s*\+|(\[[^]]*\])?\.(append|extend)\()")
    return next((i for i, text in enumerate(lines, 1) if adds.search(text)), None)


# ---------------------------------------------------------------- ddp

def ddp_checks(session: "Session", base: "Probed", dist: "Probed", fail_fast: bool = False) -> List[Check]:
    n = dist.nproc
    mismatch = _collective_mismatch(dist)
    if mismatch is not None:
        return [mismatch]
    if dist.returncode is None:
        return [Check("run under torchrun", "skip", dist.error() or "timed out")]
    if not dist.ok:
        return [Check("run under torchrun", "fail", dist.error() or "failed", _error_where(dist))]
    checks = [Check("run under torchrun", "pass", f"{n} ranks exit 0 ({dist.seconds:.1f} s)")]
    if not (base.rank(0).get("steps") or base.rank(0).get("pending_losses")):
        checks.append(Check("process group", "skip", "the original trains nothing: a migration to one device per "
                            "process is all there is"))
        return checks
    world = [rep.get("process_group_world_size") for _, rep in sorted(dist.ranks.items())]
    if any(w != n for w in world):
        checks.append(Check("process group", "fail", f"the ranks joined process groups of {world} processes, not {n}"))
    told = session.migration_report + "\n" + dist.stderr  # the review items, and the runtime's warnings
    checks.append(_as_reported(_rank_parameters(dist), told, "the ranks train apart"))
    checks.append(_as_reported(_samples(dist), told, "every rank trains on all the data"))
    checks.append(_epoch_order(dist))
    checks.append(_rank0_output(dist))
    checks.append(_rank0_files(dist))
    if fail_fast and any(c.status == "fail" for c in checks):
        return checks
    ref = _reference(session, dist)
    checks.append(_metrics(dist, ref, base))
    checks.append(_checkpoints(dist, ref))
    return checks


def sharded_like_replicated(dist: "Probed", twin: "Probed") -> Check:
    """fsdp: the sharded run against the script's ddp migration under torchrun, step by step:
    each rank's losses, and the whole parameters (the sums over the ranks of their shards,
    with the parameters every rank holds whole) those of a ddp rank."""
    name = "sharded as ddp trains"
    if not twin.ok:
        return Check(name, "skip", f"the ddp migration of the script does not run under torchrun: {twin.error()}")
    ours = [rep.get("steps") or [] for _, rep in sorted(dist.ranks.items())]
    theirs = [rep.get("steps") or [] for _, rep in sorted(twin.ranks.items())]
    if [len(s) for s in ours] != [len(s) for s in theirs]:
        return Check(name, "fail", f"the ranks take {[len(s) for s in ours]} optimizer steps, under ddp "
                     f"{[len(s) for s in theirs]}")
    if not ours or not ours[0]:
        return Check(name, "skip", "no optimizer step to compare")
    for step in range(len(ours[0])):
        for rank, (a, b) in enumerate(zip(ours, theirs)):
            la, lb = a[step]["losses"], b[step]["losses"]
            if len(la) != len(lb) or not all(_close(x, y, rtol=1e-5, atol=1e-6) for x, y in zip(la, lb)):
                return Check(name, "fail", f"step {step + 1}, rank {rank}: losses {la[:3]} where ddp has {lb[:3]}",
                             a[step].get("backward_at"), {"step": step + 1, "rank": rank})
        whole = [sum(r[step].get("sharded", [0.0, 0.0])[k] for r in ours) + ours[0][step]["params"][k] for k in (0, 1)]
        want = [theirs[0][step]["params"][k] + theirs[0][step].get("sharded", [0.0, 0.0])[k] for k in (0, 1)]
        if not all(_close(x, y, rtol=1e-5, atol=1e-5) for x, y in zip(whole, want)):
            return Check(name, "fail", f"after step {step + 1} the parameters differ from ddp's (sum {whole[0]:.9g} "
                         f"vs {want[0]:.9g})", ours[0][step].get("step_at"), {"step": step + 1})
    return Check(name, "pass", f"{len(ours[0])} steps on {len(ours)} ranks: the losses and the whole parameters "
                 "are the ddp migration's")


def _collective_mismatch(dist: "Probed") -> Optional[Check]:
    """Ranks stuck in a collective (the stall watchdog's report), or that lost their peers
    inside one (gloo raises, or aborts, when a peer ends or calls another; torchrun then stops
    the rest), with no rank failing on its own: the ranks did not call the same collectives.
    Where each rank was comes from its error or from the stack it dumped when stopped."""
    parts, line, waiting = [], None, 0
    for rank in range(dist.nproc):
        rep = dist.ranks.get(rank)
        err = (rep or {}).get("error")
        if rep is not None and err is None:
            parts.append(f"rank {rank} finished")
            continue
        stalled = err is not None and err.get("type") == "Stall"
        if err is not None and not stalled and not PEER_GONE.search(str(err.get("message"))):
            return None  # a rank failed on its own: that is the error to show
        if stalled:
            where = dist.where(err.get("traceback", ""), innermost_first=True)
        elif err is not None:
            where = dist.where(err.get("traceback", ""))
        else:
            dump = dist.out / f"rank{rank}_terminated.txt"
            where = dist.where(dump.read_text(), innermost_first=True) if dump.exists() else None
        waiting += 1
        line = line or where
        parts.append(f"rank {rank} waits at {where or 'a line outside the script'}")
    if not waiting or waiting == dist.nproc and not line:
        return None
    return Check("collectives", "fail", "the ranks do not call the same collectives: " + "; ".join(parts), line)


def _rank_parameters(dist: "Probed") -> Check:
    ranks = [rep.get("steps") or [] for _, rep in sorted(dist.ranks.items())]
    counts = [len(s) for s in ranks]
    if not counts[0]:
        return _wrapped_models_across_ranks(dist)
    if len(set(counts)) > 1:
        return Check("parameters across ranks", "fail", f"the ranks take {counts} optimizer steps: uneven data "
                     f"leaves a rank waiting in a collective the others never call")
    for step, records in enumerate(zip(*ranks), 1):
        first = records[0]["params"]
        for rank, rec in enumerate(records[1:], 1):
            if not all(_close(x, y, rtol=RANK_RTOL, atol=RANK_RTOL) for x, y in zip(first, rec["params"])):
                return Check("parameters across ranks", "fail", f"after step {step}, rank {rank}'s parameters differ "
                             f"from rank 0's (sum {rec['params'][0]:.9g} vs {first[0]:.9g}): the gradients are not "
                             f"averaged across ranks", records[0].get("step_at"), {"step": step})
    finals = [_vectors(dist, r) for r in range(dist.nproc)]
    for i, vec in enumerate(finals[0]):
        for rank in range(1, dist.nproc):
            if not _same_vector(vec, finals[rank][i] if i < len(finals[rank]) else None):
                return Check("parameters across ranks", "fail", f"at the end, optimizer {i}'s parameters on rank {rank} "
                             f"differ from rank 0's")
    return Check("parameters across ranks", "pass", f"identical on {dist.nproc} ranks after each of {counts[0]} steps")


def _same_vector(a: Any, b: Any) -> bool:
    """Two ranks' flattened parameters: the same shape, within RANK_RTOL of each other."""
    return b is not None and a.shape == b.shape and (not a.numel() or float((a - b).abs().max()) <= RANK_RTOL)


def _wrapped_models_across_ranks(dist: "Probed") -> Check:
    """No optimizer (SGD by hand): the models wrap_model returned, compared at the end."""
    import torch
    name = "parameters across ranks"
    models = [rep.get("models") or [] for _, rep in sorted(dist.ranks.items())]
    if not models[0]:
        return Check(name, "fail", "no optimizer step and no wrapped model under torchrun: nothing keeps the ranks "
                     "in step")
    for i, entry in enumerate(models[0]):
        first = torch.load(dist.out / entry["vector"])
        for rank in range(1, dist.nproc):
            if not _same_vector(first, torch.load(dist.out / models[rank][i]["vector"]) if i < len(models[rank]) else None):
                return Check(name, "fail", f"at the end, model {i} ({entry['module']}) on rank {rank} differs from "
                             f"rank 0's")
    return Check(name, "pass", f"no optimizer; the {len(models[0])} wrapped model(s) end identical on every rank")


def _training_sampler(rep: dict) -> Optional[dict]:
    first = [s for s in rep.get("samplers") or [] if s.get("call") == 0]
    if not first:
        return None
    return max(first, key=lambda s: (s.get("steps", 0), len(s.get("indices") or [])))


DECLINED = re.compile(r"training data (NOT sharded|does not come from a DataLoader)|no model is wrapped|"
                      r"each rank trains (on all|by itself)", re.I)
REPORTED = "as the migration's report says"


RUNTIME_SAYS = re.compile(r"gpumigrate\.runtime: \w+: [^\n]*every rank (trains on all rows|reads all of it)")


def _as_reported(check: Check, report: str, what: str) -> Check:
    """A failed data-parallel check the migration itself declined (its review items say the
    ranks train alone or on all the data), or that the runtime declined at run time (its
    warning: one sample, tensors of different lengths), is what the user was told: a note,
    not a difference."""
    said = [line for line in report.splitlines() if DECLINED.search(line)]
    said += [m.group(0) for m in RUNTIME_SAYS.finditer(report)]
    if check.status != "fail" or not said:
        return check
    reason = re.sub(r"^.*?review by hand: ", "", said[0]).strip()
    return Check(check.name, "skip", f"{what}, {REPORTED}: {reason[:200]}")


def _samples(dist: "Probed") -> Check:
    """Each rank takes its own part of the data: a shard of the training sampler, or batches of
    its own where there is no sampler."""
    n = dist.nproc
    reps = [rep for _, rep in sorted(dist.ranks.items())]
    main = _training_sampler(reps[0])
    if main is None or not main.get("steps"):
        inputs = [rep.get("inputs") or [] for rep in reps]
        pairs = list(zip(*inputs))
        differ = sum(len(set(p)) == len(p) for p in pairs)
        if pairs and differ >= 0.9 * len(pairs):
            return Check("samples per rank", "pass", f"no sampler; each rank trains on batches of its own ({differ} of "
                         f"{len(pairs)} steps)")
        if not pairs:
            return Check("samples per rank", "skip", "no training batch seen")
        return Check("samples per rank", "fail", f"every rank trains on the same batches ({len(pairs) - differ} of "
                     f"{len(pairs)} steps): nothing splits the data, each rank trains on all of it")
    kind, total, length = main["kind"], main.get("dataset_len"), main.get("length")
    replicas = main.get("num_replicas") or main.get("step") or 1
    if kind not in ("DistributedSampler", "_Shard") or replicas != n:
        return Check("samples per rank", "fail", f"the training loader's {kind} gives rank 0 {length} of {total} samples "
                     f"per epoch: every rank trains on the whole dataset", values={"kind": kind, "length": length})
    others = [next((s for s in rep.get("samplers") or [] if s["sampler"] == main["sampler"] and s["call"] == 0), None)
              for rep in reps[1:]]
    if any(o is None for o in others):
        return Check("samples per rank", "fail", "the ranks do not build the same training sampler")
    drawn = [set(main["indices"])] + [set(o["indices"]) for o in others]
    overlap = sum(len(drawn[0] & d) for d in drawn[1:])
    if overlap > max(1, n):
        return Check("samples per rank", "fail", f"ranks 0 and 1 draw {overlap} of the same samples in the first epoch "
                     f"(a shard per rank draws disjoint ones)")
    expected = math.ceil(total / n) if total else None
    if expected and length and length > expected:
        return Check("samples per rank", "fail", f"rank 0 draws {length} of {total} samples per epoch, more than "
                     f"1/{n}")
    return Check("samples per rank", "pass", f"{kind}: each rank draws {length} of {total} samples per epoch, "
                 f"disjoint", values={"length": length, "dataset": total})


def _epoch_order(dist: "Probed") -> Check:
    rep = dist.rank(0)
    main = _training_sampler(rep)
    if main is None or main["kind"] != "DistributedSampler":
        return Check("epoch order", "skip", "no DistributedSampler trains")
    if not main.get("shuffle"):
        return Check("epoch order", "skip", "the training sampler does not shuffle")
    # the passes that trained (a batch peeked before training shares epoch 0's order, as it may)
    passes = [s for s in rep.get("samplers") or [] if s["sampler"] == main["sampler"] and s.get("steps")]
    if len(passes) < 2:
        return Check("epoch order", "skip", "one epoch within --steps (raise --steps to see a second)")
    for prev, cur in zip(passes, passes[1:]):
        common = min(len(prev["indices"]), len(cur["indices"]))
        if common >= 2 and prev["indices"][:common] == cur["indices"][:common]:
            return Check("epoch order", "fail", f"epoch {cur['call'] + 1} draws the samples of epoch {prev['call'] + 1} "
                         f"in the same order (sampler epoch {cur.get('epoch')}): `set_epoch` is not called")
    return Check("epoch order", "pass", f"a new order in each of {len(passes)} epochs")


def _rank0_output(dist: "Probed") -> Check:
    for rank, rep in sorted(dist.ranks.items()):
        lines = [ln for ln in rep.get("lines") or [] if ln[2].strip()]
        if rank and lines:
            return Check("output on rank 0 only", "fail", f"rank {rank} printed {len(lines)} lines too "
                         f"(first: {lines[0][2].strip()[:80]!r})", lines[0][3])
    return Check("output on rank 0 only", "pass", "only rank 0 prints")


def _rank0_files(dist: "Probed") -> Check:
    for rank, rep in sorted(dist.ranks.items()):
        if not rank:
            continue
        tmp = str(dist.tmp)
        paths = [s["path"] for s in rep.get("saves") or []] + list(rep.get("writes") or [])
        shared = [p for p in paths if not p.startswith((tmp, "/dev/"))]
        if shared:
            rel = os.path.relpath(shared[0], dist.script.parent)
            return Check("files on rank 0 only", "fail", f"rank {rank} writes {rel} too ({len(set(shared))} files)")
    return Check("files on rank 0 only", "pass", "only rank 0 writes files (temporary ones aside)")


def _reference(session: "Session", dist: "Probed") -> Optional["Probed"]:
    """The original in one process, evaluating the weights rank 0 evaluated first, and
    loading the checkpoints rank 0 wrote."""
    args: List[str] = []
    for save in dist.rank(0).get("saves") or []:
        if save["state_dicts"] and os.path.exists(save["path"]) and "--probe-load" not in args[-2:] + [save["path"]]:
            args += ["--probe-load", save["path"]]
    snapshot = dist.out / "rank0_eval.pt"
    if snapshot.exists():
        args += ["--probe-eval-with", str(snapshot)]
    if not args:
        return None
    return session.run("reference", original=True, probe_args=args)


def _window(run: "Probed", index: int = 0) -> List[list]:
    return [ln for ln in run.rank(0).get("lines") or [] if ln[1] == index]


def _metrics(dist: "Probed", ref: Optional["Probed"], base: "Probed") -> Check:
    name = "evaluation metrics"
    ours = [ln for ln in _window(dist) if ln[2].strip()]
    if not dist.rank(0).get("windows"):
        return Check(name, "skip", "no evaluation (a trained model in eval mode) within --steps")
    if not ours:
        return Check(name, "skip", "nothing printed during the first evaluation")
    if ref is None or not ref.ok:
        return Check(name, "skip", "the original could not evaluate the same weights: " +
                     (ref.error() or "" if ref else "no weights"))
    if not ref.rank(0).get("eval_swaps"):
        return Check(name, "skip", "the original's model has other keys than the evaluated one")
    if _subsets_differ(dist, ref):
        return Check(name, "skip", "the original shuffles its evaluation set and the migration reads its shard in "
                     "order: under --batches they evaluate different samples (raise --batches past the evaluation "
                     "set to compare)")
    theirs = [ln for ln in _window(ref) if ln[2].strip()]
    plain = [ln for ln in _window(base) if ln[2].strip()]
    a = [_normalise(ln[2], ref) for ln in theirs]
    b = [_normalise(ln[2], dist) for ln in ours]
    c = [_normalise(ln[2], base) for ln in plain]
    if len(a) != len(b) or any(NUMBER.sub("#", x) != NUMBER.sub("#", y) for x, y in zip(a, b)):
        i = next((i for i, (x, y) in enumerate(zip(a, b)) if NUMBER.sub("#", x) != NUMBER.sub("#", y)), min(len(a), len(b)))
        shown = b[i] if i < len(b) else "(nothing)"
        return Check(name, "fail", f"the first evaluation prints {shown.strip()[:100]!r} where one process prints "
                     f"{(a[i] if i < len(a) else '(nothing)').strip()[:100]!r}", ours[min(i, len(ours) - 1)][3])
    compared = 0
    for i, (x, y) in enumerate(zip(a, b)):
        plain_numbers = _numbers(c[i]) if i < len(c) and NUMBER.sub("#", c[i]) == NUMBER.sub("#", x) else None
        for j, ((u, vol), (v, _)) in enumerate(zip(_numbers(x), _numbers(y))):
            # a number that the evaluated weights do not change (an epoch, a training loss) is not a metric
            if vol or (plain_numbers is not None and plain_numbers[j][0] == u):
                continue
            compared += 1
            if not _same_number(u, v):
                return Check(name, "fail", f"the first evaluation prints {v} where one process evaluating the same "
                             f"weights prints {u} ({y.strip()[:100]!r}): a metric not reduced across ranks?",
                             ours[i][3], {"ddp": v, "one_process": u})
    if not compared:
        return Check(name, "skip", "no printed number depends on the evaluated weights")
    return Check(name, "pass", f"{compared} numbers of the first evaluation equal one process's on the same weights")


def _subsets_differ(dist: "Probed", ref: "Probed") -> bool:
    """Did a capped evaluation pass read other samples in the two runs: the original's shuffled
    (a capped RandomSampler: a random subset), rank 0's an in-order shard (the first samples)?"""
    def evaluated(rep: dict) -> List[dict]:
        return [s for s in rep.get("samplers") or [] if not s.get("steps")
                and (s.get("length") or 0) > len(s.get("indices") or [])]  # stopped by the cap

    shuffled = any(s["kind"] == "RandomSampler" for s in evaluated(ref.rank(0)))
    in_order = any(s["kind"] == "_Shard" or (s["kind"] == "DistributedSampler" and not s.get("shuffle"))
                   for s in dist.rank(0).get("samplers") or [] if not s.get("steps"))
    return shuffled and in_order


def _checkpoints(dist: "Probed", ref: Optional["Probed"]) -> Check:
    name = "checkpoints"
    saves = [s for s in dist.rank(0).get("saves") or [] if s["state_dicts"]]
    if not saves:
        return Check(name, "skip", "rank 0 saves no weights")
    prefixed = [(s, k) for s in saves for k, keys in s["state_dicts"].items() if any(x.startswith("module.") for x in keys)]
    if prefixed:
        save, entry = prefixed[0]
        return Check(name, "fail", f"{os.path.basename(save['path'])}[{entry!r}] keeps DDP's 'module.' prefix: it does "
                     f"not load into the original model")
    if ref is None or not ref.ok:
        return Check(name, "skip", "the original could not load them: " + ((ref.error() or "") if ref else ""))
    loads = ref.rank(0).get("loads") or []
    bad = [ld for ld in loads if not ld["loaded_into"]]
    if bad:
        ld = bad[0]
        return Check(name, "fail", f"{os.path.basename(ld['file'])}[{ld['entry']!r}] does not load into the original's "
                     f"model: {ld['error']}")
    return Check(name, "pass", f"{len(loads)} state_dict(s) rank 0 saved load into the original's model (strict)")


# ---------------------------------------------------------------- amp

def bf16_band(base: "Probed", bf16: "Probed") -> Check:
    name = "bfloat16 losses"
    if not bf16.ok:
        return Check(name, "fail", f"GPUMIGRATE_AMP=bf16: {bf16.error()}", _error_where(bf16))
    losses = [(s["losses"], s.get("backward_at")) for s in bf16.rank(0).get("steps") or []]
    for step, (values, at) in enumerate(losses, 1):
        if not all(math.isfinite(v) for v in values):
            return Check(name, "fail", f"step {step}: loss {values} in bfloat16", at)
    reference = [s["losses"] for s in base.rank(0).get("steps") or []]
    for step, ((values, at), ref) in enumerate(zip(losses[:BF16_STEPS], reference), 1):
        for u, v in zip(ref, values):
            if not _close(v, u, rtol=BF16_RTOL, atol=ATOL):
                return Check(name, "fail", f"step {step}: loss {v:.6g} in bfloat16, {u:.6g} in float32 (beyond "
                             f"{BF16_RTOL:g} relative)", at)
    if not losses:
        return Check(name, "skip", "no step in bfloat16")
    return Check(name, "pass", f"finite for {len(losses)} steps; the first {min(BF16_STEPS, len(losses))} within "
                 f"{BF16_RTOL:g} of float32")


def scaler_state(runs: Iterable["Probed"]) -> Check:
    name = "scaler state"
    for run in runs:
        rep = run.rank(0)
        if not rep.get("scalers"):
            continue
        for save in rep.get("saves") or []:
            entries = save.get("entries") or {}
            kinds = Counter(entries.values())
            if kinds["optimizer"] and not kinds["scaler"] and not any("scaler" in k.lower() or k.lower() == "amp"
                                                                      for k in entries):
                return Check(name, "fail", f"{os.path.basename(save['path'])} saves the optimizer's state without the "
                             f"GradScaler's: a resumed run restarts loss scaling")
        return Check(name, "pass", "every checkpoint with the optimizer's state has the scaler's")
    return Check(name, "skip", "no GradScaler")
