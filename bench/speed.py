"""Speed at repository scale, measured in one run: prints a table of times and ratios and
writes them as JSON. Asserts nothing (no timed tests; the targets are issue 11's).

    python bench/speed.py [--every 12] [--json OUT] [--no-torchfix]

The corpus: every k-th `.py` file of the installed torch package that mentions `torch`
(sorted by path), plus the fixtures, copied into a scratch folder. Measured:
- a bare LibCST parse and a stdlib `ast.parse` of each file, in this process;
- `gpumigrate lint` at `-j 1` and at its default, `--no-cache`, as a user runs it;
- `gpumigrate --to ddp --diff` at its default;
- a cached re-run of `gpumigrate lint` (the pre-commit and CI case), after a first run;
- TorchFix at its default, when it is installed;
- that lint's findings are the same with and without its gates (in this process);
- lint against a parse on finding-dense training scripts (the fixtures, in this process);
- `gpumigrate --help` and `--version`; the peak RSS of each child.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import libcst as cst

ROOT = Path(__file__).resolve().parent.parent


def corpus(every: int, into: Path) -> List[Path]:
    import torch

    package = Path(torch.__file__).parent
    found = sorted(p for p in package.rglob("*.py") if b"torch" in p.read_bytes())
    chosen = found[::every] + sorted((ROOT / "fixtures" / "scripts").glob("*.py"))
    out = []
    for i, path in enumerate(chosen):
        target = into / f"{i:04d}_{path.name}"
        shutil.copyfile(path, target)
        out.append(target)
    return out


def timed(label: str, fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def child(args: Sequence[str], cwd: Path, env: Optional[Dict[str, str]] = None) -> Dict[str, float]:
    """Wall seconds and peak RSS (MB) of one command: a fresh interpreter runs it and reports
    its children's maximum RSS (so no earlier run counts)."""
    probe = ("import resource, subprocess, sys, time\n"
             "start = time.perf_counter()\n"
             "code = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode\n"
             "wall = time.perf_counter() - start\n"
             "rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024\n"
             "print(wall, rss, code)\n")
    # As installed, Python reads its bytecode cache: a PYTHONDONTWRITEBYTECODE environment
    # (this machine's) would time gpumigrate's own modules being compiled at every start.
    base = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    out = subprocess.run([sys.executable, "-c", probe, *args], cwd=cwd, capture_output=True, text=True,
                         env={**base, **(env or {})})
    wall, rss, code = out.stdout.split()
    return {"seconds": float(wall), "peak_rss_mb": float(rss), "exit": int(code)}


def with_cli_collector(fn):
    """`fn()` with the garbage collector tuned as the CLI tunes it (rewriter/run.py)."""
    import gc

    from gpumigrate.rewriter.run import tune_gc

    default = gc.get_threshold()
    tune_gc()
    try:
        return fn()
    finally:
        gc.set_threshold(*default)


def dense(repeats: int = 5) -> Dict[str, float]:
    """Lint against a bare parse on finding-dense training scripts (the fixtures), in this
    process: the files are small, so a CLI run would time its start-up. Each file's best of
    `repeats`, parse and lint interleaved; Python's default collector for both, and for
    lint also the collector the CLI runs with."""
    import gc

    from gpumigrate.codemods import select
    from gpumigrate.rewriter.engine import process
    from gpumigrate.rewriter.names import ImportTable
    from gpumigrate.rewriter.run import tune_gc

    sources = []
    for path in sorted((ROOT / "fixtures" / "scripts").glob("*.py")):
        try:
            cst.parse_module(path.read_bytes())
            sources.append((str(path), path.read_bytes()))
        except Exception:
            continue
    rules, default = select([], []), gc.get_threshold()
    best = {"parse": [1e9] * len(sources), "lint": [1e9] * len(sources), "lint, CLI collector": [1e9] * len(sources)}
    for _ in range(repeats):
        for k, (path, data) in enumerate(sources):
            for label, run in (("parse", lambda: cst.parse_module(data)),
                               ("lint", lambda: process(data, path, rules, names_factory=ImportTable)),
                               ("lint, CLI collector", lambda: process(data, path, rules, names_factory=ImportTable))):
                if label.endswith("collector"):
                    tune_gc()
                start = time.perf_counter()
                run()
                best[label][k] = min(best[label][k], time.perf_counter() - start)
                gc.set_threshold(*default)
    return {"files": len(sources), **{label: sum(times) for label, times in best.items()}}


def same_findings(files: Sequence[Path]) -> str:
    """Lint in this process with the gates (stdlib-ast pre-checks, data literals emptied) and
    without: the optimisations must not change a finding (issue 11)."""
    from gpumigrate.codemods import select
    from gpumigrate.rewriter import engine
    from gpumigrate.rewriter.names import ImportTable

    rules, differ = select([], []), []
    for path in files:
        source = path.read_bytes()
        found = []
        for flag in (True, False):
            engine.GATES = flag
            result = engine.process(source, str(path), rules, names_factory=ImportTable)
            found.append((result.error, result.findings))
        engine.GATES = True
        if found[0] != found[1] and "LibCST cannot parse" not in str(found[1][0]):
            differ.append(path.name)
    return f"identical on all {len(files)} files" if not differ else f"DIFFER on {len(differ)}: {differ[:5]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--every", type=int, default=12, help="every k-th torch file (default 12)")
    parser.add_argument("--json", metavar="OUT", help="write the measurements here")
    parser.add_argument("--no-torchfix", action="store_true", help="skip TorchFix even if it is installed")
    args = parser.parse_args()
    gm = [sys.executable, "-m", "gpumigrate"]
    scripts = dense()  # first: a process that has linted 4 MB collects its garbage slower
    with tempfile.TemporaryDirectory(prefix="gpumigrate-speed-") as scratch:
        folder = Path(scratch) / "corpus"
        folder.mkdir()
        files = corpus(args.every, folder)
        sources = [p.read_bytes() for p in files]
        parseable = []
        for data in sources:
            try:
                cst.parse_module(data)
                parseable.append(data)
            except Exception:
                pass
        size = sum(len(d) for d in sources) / 1e6
        print(f"{len(files)} files ({len(parseable)} LibCST parses), {size:.1f} MB; {os.cpu_count()} CPUs")
        rows: Dict[str, Dict[str, float]] = {}
        rows["libcst.parse_module"] = {"seconds": timed("parse", lambda: [cst.parse_module(d) for d in parseable])}
        rows["ast.parse"] = {"seconds": timed("ast", lambda: [ast.parse(d) for d in parseable])}
        rows["libcst.parse_module, the CLI's collector"] = {"seconds": with_cli_collector(
            lambda: timed("parse", lambda: [cst.parse_module(d) for d in parseable]))}
        cache = {"GPUMIGRATE_CACHE_DIR": str(Path(scratch) / "cache")}
        child([*gm, "lint", "--no-cache", str(files[-1])], folder)  # writes the bytecode cache, as installed
        rows["lint -j 1"] = child([*gm, "lint", str(folder), "-j", "1", "--no-cache"], folder)
        rows["lint (default -j)"] = child([*gm, "lint", str(folder), "--no-cache"], folder)
        rows["--to ddp --diff"] = child([*gm, str(folder), "--to", "ddp", "--diff", "--no-cache"], folder)
        child([*gm, "lint", str(folder)], folder, cache)  # fills the cache
        rows["lint, cached re-run"] = child([*gm, "lint", str(folder)], folder, cache)
        rows["--help"] = child([*gm, "--help"], folder)
        rows["--version"] = child([*gm, "--version"], folder)
        if not args.no_torchfix and shutil.which("torchfix"):
            rows["TorchFix (default -j)"] = child(["torchfix", str(folder)], folder)
        exact = same_findings(files)
    parse = rows["libcst.parse_module"]["seconds"]
    first = rows["lint (default -j)"]["seconds"]
    ratios = {
        "lint -j 1 / parse (target <= 1.5)": rows["lint -j 1"]["seconds"] / parse,
        "lint -j 1 / parse with the CLI's collector": rows["lint -j 1"]["seconds"] / rows[
            "libcst.parse_module, the CLI's collector"]["seconds"],
        "-j 1 / default -j (target >= 1.7 on 2 cores)": rows["lint -j 1"]["seconds"] / first,
        "cached re-run / first run (target <= 0.10)": rows["lint, cached re-run"]["seconds"] / first,
        "--to ddp --diff / parse": rows["--to ddp --diff"]["seconds"] / parse,
    }
    if "TorchFix (default -j)" in rows:
        ratios["TorchFix / lint, both default (target >= 10)"] = rows["TorchFix (default -j)"]["seconds"] / first
    ratios["finding-dense scripts: lint / parse (target <= 2)"] = scripts["lint"] / scripts["parse"]
    ratios["finding-dense scripts: lint with the CLI's collector / parse"] = scripts["lint, CLI collector"] / scripts["parse"]
    print(f"\nfinding-dense training scripts ({scripts['files']} fixtures, in process, best of 5): "
          f"parse {scripts['parse']:.3f} s, lint {scripts['lint']:.3f} s, "
          f"lint with the CLI's collector {scripts['lint, CLI collector']:.3f} s")
    print(f"lint -j 1 peak RSS: {rows['lint -j 1']['peak_rss_mb']:.0f} MB (target <= 300)")
    print(f"findings with and without the gates: {exact}")
    print("\n| step | seconds | peak RSS |\n|---|---|---|")
    for name, row in rows.items():
        rss = f"{row['peak_rss_mb']:.0f} MB" if "peak_rss_mb" in row else ""
        print(f"| {name} | {row['seconds']:.2f} | {rss} |")
    print("\n| ratio | value |\n|---|---|")
    for name, value in ratios.items():
        print(f"| {name} | {value:.2f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps({"files": len(files), "megabytes": size, "cpus": os.cpu_count(),
                                               "rows": rows, "ratios": ratios, "gates_exact": exact,
                                               "dense_scripts": scripts}, indent=2))


if __name__ == "__main__":
    main()
