"""Time to the first line of output on a 100-file run (issue 20: under 2 s), and the whole run's
time, for `lint` and for a migration shown as a diff. The files are the fixtures, copied in turn
into a scratch folder (names numbered, so input order is the copies' order); the cache is off.

    python bench/first_line.py [--files 100] [--jobs N]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional, Tuple

ROOT = Path(__file__).resolve().parent.parent


def make_corpus(folder: Path, count: int) -> None:
    scripts = sorted((ROOT / "fixtures" / "scripts").glob("*.py"))
    for i in range(count):
        source = scripts[i % len(scripts)]
        shutil.copyfile(source, folder / f"{i:03d}_{source.name}")


def first_line(args: List[str]) -> Tuple[Optional[float], float, int]:
    """(seconds to the first line on stdout, seconds to the end, exit status)."""
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "gpumigrate", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, cwd=ROOT)
    assert proc.stdout is not None
    first = None
    for _ in proc.stdout:
        if first is None:
            first = time.monotonic() - start
    proc.wait()
    return first, time.monotonic() - start, proc.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=100)
    parser.add_argument("--jobs", type=int, default=None)
    opts = parser.parse_args()
    jobs = ["-j", str(opts.jobs)] if opts.jobs else []
    with tempfile.TemporaryDirectory(prefix="gpumigrate-first-line-") as tmp:
        folder = Path(tmp)
        make_corpus(folder, opts.files)
        print(f"| run ({opts.files} files) | first line (s) | whole run (s) | exit |")
        print("|---|---|---|---|")
        for label, args in (("lint", ["lint", str(folder)]),
                            ("--to device --diff", [str(folder), "--to", "device", "--diff"]),
                            ("--to ddp --diff", [str(folder), "--to", "ddp", "--diff"])):
            first, total, code = first_line([*args, "--no-cache", *jobs])
            shown = f"{first:.2f}" if first is not None else "no output"
            print(f"| `{label}` | {shown} | {total:.2f} | {code} |")


if __name__ == "__main__":
    main()
