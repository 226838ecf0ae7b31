"""The migration report's cost (issue 17, item 3c), measured in one run: prints a table of
times and the ratio report / no report per size. Asserts nothing (no timed tests).

    python bench/report_cost.py [--sizes 250,500,1000,2000] [--blank] [--repeat 1] [--json OUT]

Each script is `import torch` then n consecutive lines `x{i} = torch.zeros(3).cuda()`,
every one of which `--to device` rewrites to `.to(device)`: one edited run of n lines,
the case that made `line_map` quadratic. With --blank, a blank line follows each of them:
the case that made the line alignment under it cubic. Each size is run twice as a user
runs it, in a scratch folder: `python -m gpumigrate FILE --to device --diff --no-cache`,
and the same with `--report OUT.md`; the best of `--repeat` wall times of each. The
report's own cost is the difference; a linear report keeps the ratio about flat as n
doubles.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Sequence


def script(n: int, blank: bool = False) -> str:
    after = "\n" if blank else ""
    return "import torch\n" + "".join(f"x{i} = torch.zeros(3).cuda()\n{after}" for i in range(n))


def wall(args: Sequence[str], cwd: Path) -> float:
    """Wall seconds of one command (its output thrown away); it must exit 0."""
    # As installed, Python reads its bytecode cache: a PYTHONDONTWRITEBYTECODE environment
    # would time gpumigrate's own modules being compiled at every start.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    start = time.perf_counter()
    code = subprocess.run(args, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env).returncode
    seconds = time.perf_counter() - start
    if code != 0:
        raise SystemExit(f"{' '.join(map(str, args))}: exit {code}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="250,500,1000,2000", help="edited lines per script (default 250,500,1000,2000)")
    parser.add_argument("--blank", action="store_true", help="a blank line after each edited line")
    parser.add_argument("--repeat", type=int, default=1, help="best of this many runs of each command (default 1)")
    parser.add_argument("--json", metavar="OUT", help="write the measurements here")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    gm = [sys.executable, "-m", "gpumigrate"]
    rows: List[Dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="gpumigrate-report-") as scratch:
        folder = Path(scratch)
        wall([*gm, "--version"], folder)  # writes the bytecode cache, as installed
        for n in sizes:
            path = folder / f"train_{n}.py"
            path.write_text(script(n, args.blank))
            report = folder / f"report_{n}.md"
            plain = [*gm, str(path), "--to", "device", "--diff", "--no-cache"]
            without = min(wall(plain, folder) for _ in range(max(args.repeat, 1)))
            with_report = min(wall([*plain, "--report", str(report)], folder) for _ in range(max(args.repeat, 1)))
            rows.append({"lines": n, "no_report": without, "report": with_report, "ratio": with_report / without})
            print(f"  {n} lines: {without:.2f} s, with --report {with_report:.2f} s", file=sys.stderr)
    print("\n| edited lines | --diff (s) | --diff --report (s) | the report's own (s) | report / no report |\n"
          "|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['lines']} | {row['no_report']:.2f} | {row['report']:.2f} | "
              f"{row['report'] - row['no_report']:.2f} | {row['ratio']:.2f}x |")
    if len(rows) > 1:  # the two largest: the smallest are within the noise of a process start
        (small, large) = rows[-2:]
        growth = (large["report"] - large["no_report"]) / max(small["report"] - small["no_report"], 1e-3)
        print(f"\nthe report's own cost (report - no report) grew {growth:.1f}x from {small['lines']} to "
              f"{large['lines']} lines ({large['lines'] / small['lines']:.0f}x the lines)")
    if args.json:
        Path(args.json).write_text(json.dumps({"blank": args.blank, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
