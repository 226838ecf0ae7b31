"""`gpumigrate verify` on every fixture, for every target it has a golden for: the verdict and the
seconds each takes (the target: at most 60 s each on 2 CPU cores).

    python bench/verify_fixtures.py [--only NAME[,NAME...]] [--targets device,ddp,amp,ddp+amp]
                                    [--json OUT] [--md OUT]

A target applies to a fixture where fixtures/expected/<target>/<name> exists. Runs one at a
time (the torchrun runs take both cores), each through the command line, as a user runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"
TARGETS = ("device", "ddp", "amp", "ddp,amp")
ARGS = {"mnist_2018.py": ["--no-cuda"], "mnist_2019.py": ["--no-cuda"], "hf_local_rank.py": ["--do_train", "--do_eval"]}


def run(name: str, target: str, timeout: float) -> dict:
    cmd = [sys.executable, "-m", "gpumigrate", "verify", str(FIXTURES / "scripts" / name), "--to", target,
           "--format", "json", "--timeout", str(timeout)]
    if name in ARGS:
        cmd += ["--", *ARGS[name]]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    try:
        data = json.loads(proc.stdout)
    except ValueError:
        data = {"verdict": "error", "reason": (proc.stderr.strip().splitlines() or ["?"])[-1], "checks": []}
    return {"name": name, "target": target, "exit": proc.returncode, "seconds": round(seconds, 1),
            "verdict": data.get("verdict"), "reason": data.get("reason", ""),
            "failed": [c["name"] for c in data.get("checks", []) if c["status"] == "fail"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="")
    parser.add_argument("--targets", default=",".join(t.replace(",", "+") for t in TARGETS))
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--md", type=Path)
    args = parser.parse_args()
    wanted = set(filter(None, args.only.split(",")))
    targets = [t.replace("+", ",") for t in args.targets.split(",")]
    records = []
    for target in targets:
        for golden in sorted((FIXTURES / "expected" / target).glob("*.py")):
            if wanted and golden.name not in wanted:
                continue
            rec = run(golden.name, target, args.timeout)
            records.append(rec)
            print(f"{target:8} {rec['name']:28} {rec['verdict']:11} {rec['seconds']:6.1f}s  {rec['reason'][:140]}",
                  flush=True)
            if args.json:
                args.json.write_text(json.dumps(records, indent=1))
    lines = ["| target | fixture | verdict | s | reason |", "|---|---|---|---|---|"]
    for rec in records:
        lines.append(f"| {rec['target']} | {rec['name']} | {rec['verdict']} | {rec['seconds']:.0f} | "
                     f"{rec['reason'][:200].replace('|', '/')} |")
    counts = {v: sum(r["verdict"] == v for r in records) for v in ("equivalent", "different", "unknown", "error")}
    slowest = max(records, key=lambda r: r["seconds"]) if records else None
    lines.append("")
    lines.append(", ".join(f"{v} {n}" for v, n in counts.items()) + f" ({len(records)} runs)" +
                 (f"; slowest {slowest['target']} {slowest['name']} {slowest['seconds']:.0f} s" if slowest else ""))
    text = "\n".join(lines) + "\n"
    print(text)
    if args.md:
        args.md.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
