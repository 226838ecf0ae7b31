"""Parity with TorchFix on TorchFix's own fixtures (issue 21: the external check).

    python bench/torchfix_parity.py [--torchfix PATH] [--write bench/torchfix_parity_results.md]

PATH is a TorchFix checkout (default: the fetched mirror, exported with `git archive` into a
temporary folder). Nothing of TorchFix is copied into this repository: its fixtures are read
where they lie, and the codemod inputs are fixed in a temporary copy.

Checker fixtures (`tests/fixtures/*/checker/X.py` with `X.txt`, lines `LINE:COL TORxxx message`):
`gpumigrate lint --format json --isolated` runs on every `X.py`; a TorchFix finding counts as
found when one of our findings (any code) sits on the same line of the same file. Findings on
one line are matched one to one, so two TorchFix findings on a line need two of ours.

Codemod fixtures (`tests/fixtures/*/codemod/X.in.py` with the expected `X.out.py`): `gpumigrate
lint --fix --isolated` on a temporary copy of `X.in.py`; equal when `ast.dump` of our result
equals that of TorchFix's expected output (formatting and comments do not count).
"""

from __future__ import annotations

import argparse
import ast
import collections
import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

MIRROR = Path("/work/.mirror/pytorch-labs+torchfix/repo")
GPUMIGRATE = [sys.executable, "-m", "gpumigrate"]


NOTES = """## Notes

- TorchFix's checker fixtures hold 81 expected findings, not 78: three `.txt` files
  (`deprecated_register_pytree_node`, `zerograd`, `to_tensor`) end without a newline, so
  `cat */checker/*.txt | wc -l` undercounts by three. The harness parses every line.
- "Found" means any gpumigrate finding on that line, whatever its code: of the first 3, two are
  GM105 (`torch.load` without `map_location`) on TorchFix's TOR102 lines (`torch.load` without
  `weights_only`), the same call for another reason; one is GM503 on `torch.cuda.amp.autocast()`.
- Codemod "untouched": gpumigrate changed nothing; "differ": it changed the file, but not into
  TorchFix's expected output. For `amp` GM503 writes `torch.autocast("cuda", ...)` where TorchFix
  writes `torch.amp.autocast("cuda", ...)` (the same function; the AST comparison is strict), and
  leaves the three `torch.cpu.amp.autocast` calls alone.
- The fetched mirror's newest commit is the one above; TorchFix's move to meta-pytorch and its
  archiving (January 2026) are not in this snapshot, so later fixtures, if any, are not counted.
"""


@dataclass
class CheckerResult:
    fixture: str                                  # e.g. "deprecated_symbols/amp.py"
    expected: List[Tuple[int, str]]               # (line, TorchFix code)
    found: List[Tuple[int, str]] = field(default_factory=list)    # expected ones we match
    missing: List[Tuple[int, str]] = field(default_factory=list)
    ours: List[Tuple[int, str]] = field(default_factory=list)     # every finding of ours


@dataclass
class CodemodResult:
    fixture: str
    status: str          # "equal", "differ", "untouched" (we changed nothing), "error"
    detail: str = ""


def export_mirror(mirror: Path, into: Path) -> str:
    """`git archive HEAD` of the mirror into `into`; returns the commit."""
    commit = subprocess.run(["git", "-C", str(mirror), "rev-parse", "HEAD"], check=True,
                            capture_output=True, text=True).stdout.strip()
    archive = subprocess.run(["git", "-C", str(mirror), "archive", "HEAD"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return commit


def checkout_commit(path: Path) -> str:
    out = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else "unknown (not a git checkout)"


def lint_flags() -> List[str]:
    """`--isolated` where this gpumigrate has it (older ones do not)."""
    help_text = subprocess.run([*GPUMIGRATE, "lint", "--help"], capture_output=True, text=True).stdout
    flags = ["--no-cache", "--exit-zero", "-q"]
    return flags + (["--isolated"] if "--isolated" in help_text else [])


def parse_expected(text: str) -> List[Tuple[int, str]]:
    rows = []
    for line in text.splitlines():
        if line.strip():
            position, code = line.split()[:2]
            rows.append((int(position.split(":")[0]), code))
    return rows


def run_checkers(root: Path, flags: List[str], select: Optional[str]) -> List[CheckerResult]:
    sources = sorted(root.glob("tests/fixtures/*/checker/*.py"))
    if not sources:
        raise SystemExit(f"no checker fixtures under {root}/tests/fixtures")
    command = [*GPUMIGRATE, "lint", "--format", "json", *flags, *(["--select", select] if select else [])]
    out = subprocess.run([*command, *map(str, sources)], capture_output=True, text=True)
    if out.returncode not in (0, 1):
        raise SystemExit(f"gpumigrate lint failed ({out.returncode}): {out.stderr.strip()}")
    ours: Dict[str, List[Tuple[int, str]]] = collections.defaultdict(list)
    for finding in json.loads(out.stdout or "[]"):
        ours[str(Path(finding["path"]).resolve())].append((finding["line"], finding["code"]))
    results = []
    for source in sources:
        result = CheckerResult(f"{source.parent.parent.name}/{source.name}",
                               parse_expected(source.with_suffix(".txt").read_text()),
                               ours=sorted(ours.get(str(source.resolve()), [])))
        free = collections.Counter(line for line, _ in result.ours)
        for line, code in result.expected:
            if free[line] > 0:
                free[line] -= 1
                result.found.append((line, code))
            else:
                result.missing.append((line, code))
        results.append(result)
    return results


def run_codemods(root: Path, flags: List[str], select: Optional[str]) -> List[CodemodResult]:
    results = []
    with tempfile.TemporaryDirectory(prefix="torchfix-codemod-") as tmp:
        for source in sorted(root.glob("tests/fixtures/*/codemod/*.in.py")):
            name = f"{source.parent.parent.name}/{source.name[:-len('.in.py')]}"
            expected = source.with_name(source.name.replace(".in.py", ".out.py"))
            work = Path(tmp) / source.parent.parent.name / source.name.replace(".in.py", ".py")
            work.parent.mkdir(exist_ok=True)
            shutil.copyfile(source, work)
            command = [*GPUMIGRATE, "lint", "--fix", *flags, *(["--select", select] if select else []),
                       str(work)]
            out = subprocess.run(command, capture_output=True, text=True)
            if out.returncode not in (0, 1):
                results.append(CodemodResult(name, "error", out.stderr.strip().splitlines()[-1:][0]
                                             if out.stderr.strip() else f"exit {out.returncode}"))
                continue
            ours = work.read_text()
            try:
                equal = ast.dump(ast.parse(ours)) == ast.dump(ast.parse(expected.read_text()))
            except SyntaxError as error:
                results.append(CodemodResult(name, "error", f"does not parse: {error}"))
                continue
            if equal:
                results.append(CodemodResult(name, "equal"))
            elif ours == source.read_text():
                results.append(CodemodResult(name, "untouched"))
            else:
                results.append(CodemodResult(name, "differ"))
    return results


def checker_table(results: List[CheckerResult]) -> List[str]:
    by_dir: Dict[str, List[CheckerResult]] = collections.defaultdict(list)
    for result in results:
        by_dir[result.fixture.split("/")[0]].append(result)
    rows = ["| fixture directory | files | expected | found at the same line | missing |",
            "|---|---:|---:|---:|---:|"]
    for name, group in sorted(by_dir.items()):
        rows.append(f"| {name} | {len(group)} | {sum(len(r.expected) for r in group)} | "
                    f"{sum(len(r.found) for r in group)} | {sum(len(r.missing) for r in group)} |")
    expected = sum(len(r.expected) for r in results)
    found = sum(len(r.found) for r in results)
    rows.append(f"| **total** | {len(results)} | {expected} | {found} | {expected - found} |")
    rows.append("")
    rows.append(f"Ratio: {found}/{expected} = {found / expected:.1%} (issue 21 asks for at least 95%).")
    return rows


def code_table(results: List[CheckerResult]) -> List[str]:
    expected = collections.Counter(code for r in results for _, code in r.expected)
    found = collections.Counter(code for r in results for _, code in r.found)
    rows = ["| TorchFix code | expected | found |", "|---|---:|---:|"]
    rows += [f"| {code} | {n} | {found[code]} |" for code, n in sorted(expected.items())]
    return rows


def detail_table(results: List[CheckerResult]) -> List[str]:
    rows = ["| fixture | expected | found | our findings (line code) |", "|---|---:|---:|---|"]
    for r in results:
        ours = ", ".join(f"{line} {code}" for line, code in r.ours) or "none"
        rows.append(f"| {r.fixture} | {len(r.expected)} | {len(r.found)} | {ours} |")
    return rows


def codemod_table(results: List[CodemodResult]) -> List[str]:
    counts = collections.Counter(r.status for r in results)
    rows = ["| codemod fixture | result |", "|---|---|"]
    rows += [f"| {r.fixture} | {r.status}{': ' + r.detail if r.detail else ''} |" for r in results]
    rows.append("")
    rows.append(f"Equal AST: {counts['equal']} of {len(results)}; differ: {counts['differ']}; "
                f"untouched (we changed nothing): {counts['untouched']}; errors: {counts['error']}.")
    return rows


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torchfix", type=Path, help="a TorchFix checkout (default: the mirror)")
    parser.add_argument("--select", help="passed to gpumigrate lint --select (default: its default)")
    parser.add_argument("--write", type=Path, help="write the tables as Markdown to this file")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="torchfix-") as tmp:
        if args.torchfix:
            root, commit = args.torchfix, checkout_commit(args.torchfix)
        else:
            if not MIRROR.exists():
                raise SystemExit(f"no TorchFix mirror at {MIRROR}: pass --torchfix PATH")
            root, commit = Path(tmp), export_mirror(MIRROR, Path(tmp))
        flags = lint_flags()
        checkers = run_checkers(root, flags, args.select)
        codemods = run_codemods(root, flags, args.select)
    gm = subprocess.run([*GPUMIGRATE, "--version"], capture_output=True, text=True).stdout.strip()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parent).stdout.strip()
    lines = [f"TorchFix commit measured: {commit}",
             f"gpumigrate: {gm or 'unknown version'} at commit {head or 'unknown'}; "
             f"lint flags: {' '.join(flags)}{' --select ' + args.select if args.select else ''}",
             "", "## Checker fixtures", "", *checker_table(checkers), "", "### By TorchFix code", "",
             *code_table(checkers), "", "### Per fixture", "", *detail_table(checkers), "",
             "## Codemod fixtures", "", *codemod_table(codemods)]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write:
        args.write.write_text("# TorchFix parity: first results\n\n" + text + "\n" + NOTES)
    return 0


if __name__ == "__main__":
    sys.exit(main())
