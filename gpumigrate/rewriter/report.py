"""Findings as text, JSON, SARIF 2.1.0 or GitHub Actions annotations; the migration report."""

from __future__ import annotations

import bisect
import difflib
import json
import os
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import click

from gpumigrate import __version__
from gpumigrate.rewriter.engine import Finding
from gpumigrate.rewriter.notebook import changed_cells, file_position, is_notebook

SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
# There is no hosted documentation site: the project page (PyPI renders the README, whose
# "Rules" table lists every code) is the one stable address; `gpumigrate explain CODE` has a
# rule's full text. A per-rule page, when one exists, changes only `rule_url`.
PROJECT_URL = "https://pypi.org/project/gpumigrate/"


def rule_url(code: str) -> str:
    """The documentation address of a rule (see PROJECT_URL)."""
    return f"{PROJECT_URL}#rules"


@dataclass(frozen=True)
class RuleInfo:
    code: str
    name: str
    message: str
    docs: str
    fixable: bool


@dataclass(frozen=True)
class Edit:
    """Lines start_line..end_line - 1 (1-based; equal: an insertion before start_line) of
    the original file become `content`."""

    start_line: int
    end_line: int
    content: str


@dataclass(frozen=True)
class Located:
    path: str
    finding: Finding
    edits: Tuple[Edit, ...] = ()  # the fix's edits, when the fix was computed (lint JSON)
    fix_message: str = ""


def fix_edits(old: bytes, new: bytes) -> List[Edit]:
    """The edited runs of lines between a file and its fixed form (the report's linear
    line alignment, not difflib over the whole file)."""
    a, b = old.splitlines(keepends=True), new.splitlines(keepends=True)
    return [Edit(i1 + 1, i2 + 1, b"".join(b[j1:j2]).decode("utf-8", "replace"))
            for equal, i1, i2, j1, j2 in _runs(a, b) if not equal]


def with_edits(items: Sequence[Located], edits: Sequence[Edit], fixed: Callable[[Finding], bool],
               messages: Dict[str, str]) -> List[Located]:
    """`items` of one file, each finding whose fix was applied (`fixed`) given the edits
    that touch its lines and those that touch no finding's lines (an import added at the
    top, a `device` defined once): a fix applied alone is then complete. As in ruff, two
    fixes may share an edit (applying both applies it once)."""
    def touches(e: Edit, f: Finding) -> bool:
        last = max(f.end_line, f.line)
        return e.start_line <= last and max(e.end_line, e.start_line + 1) > f.line

    mine = [i for i in items if fixed(i.finding)]
    shared = tuple(e for e in edits if not any(touches(e, i.finding) for i in mine))
    out = []
    for i in items:
        if fixed(i.finding):
            own = tuple(e for e in edits if touches(e, i.finding))
            i = Located(i.path, i.finding, tuple(sorted(own + shared, key=lambda e: e.start_line)),
                        messages.get(i.finding.code, ""))
        out.append(i)
    return out


def sort_findings(items: Sequence[Located]) -> List[Located]:
    return sorted(items, key=lambda i: (i.path, i.finding.cell, i.finding.line, i.finding.col, i.finding.code))


def location(path: str, finding: Finding) -> str:
    """`path:line:col`, or `path:cell N:line:col` in a notebook (as ruff writes it)."""
    cell = f"cell {finding.cell}:" if finding.cell else ""
    return f"{path}:{cell}{finding.line}:{finding.col + 1}"


def _alias(finding: Finding) -> str:
    """` [TOR101]`: the other tool's code for the finding, after ours (so `path:line:col: CODE`
    still starts every line), or ''."""
    return f" [{finding.alias}]" if finding.alias else ""


def as_text(items: Sequence[Located], styled: bool = False) -> str:
    """`path:line:col: CODE [ALIAS] message` lines; `styled`: path bold, code bold red, as ruff
    (click.echo drops the styles where colour is off)."""
    style = click.style if styled else (lambda text, **_: text)
    return "".join(f"{style(i.path, bold=True)}{style(location(i.path, i.finding)[len(i.path):] + ':', fg='cyan')} "
                   f"{style(i.finding.code, fg='red', bold=True)}{_alias(i.finding)} {i.finding.message}\n"
                   for i in items)


def statistics(items: Sequence[Located], rules: Dict[str, RuleInfo]) -> List[Dict[str, Any]]:
    """Findings per code, most first (then by code), as `ruff --statistics` counts them;
    `fixable`: every one of them is."""
    counts: Dict[str, int] = {}
    fixable: Dict[str, int] = {}
    for i in items:
        code = i.finding.code
        counts[code] = counts.get(code, 0) + 1
        info = rules.get(code)
        if info is not None and info.fixable and not i.finding.review:
            fixable[code] = fixable.get(code, 0) + 1
    return [{"code": code, "name": rules[code].name if code in rules else "", "count": n,
             "fixable": fixable.get(code, 0) == n}
            for code, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]


def statistics_text(rows: Sequence[Dict[str, Any]]) -> str:
    """`count<TAB>code<TAB>[*] name` lines (`[*]`: fixable with --fix), as ruff prints them."""
    if not rows:
        return ""
    width = max(len(str(r["count"])) for r in rows)
    marks = any(r["fixable"] for r in rows)
    return "".join(f"{r['count']:>{width}}\t{r['code']}\t{('[*] ' if r['fixable'] else '[ ] ') if marks else ''}"
                   f"{r['name']}\n" for r in rows)


def _in_file(item: Located) -> Tuple[int, int, int, Optional[int]]:
    """(line, 1-based column, end line, 1-based column past the end or None) in the file
    itself. A notebook's cell position becomes the line of the notebook's JSON that holds
    that code: what code scanning and Actions annotations show is the raw file."""
    f = item.finding
    end = max(f.end_line, f.line)
    end_col = f.end_col + 1 if f.end_col else None
    if f.cell:
        start = file_position(item.path, f.cell, f.line, f.col)
        if start is not None:
            stop = file_position(item.path, f.cell, end, f.end_col)
            stop_line = max(stop[0] if stop else 0, start[0])
            stop_col = stop[1] + 1 if stop and f.end_col and stop[0] == stop_line else None
            return start[0], start[1] + 1, stop_line, stop_col
    return f.line, f.col + 1, end, end_col


def _fix_json(i: Located) -> Optional[Dict[str, Any]]:
    """ruff's `fix` object: the edits (1-based rows and columns, end exclusive) that apply it."""
    if not i.edits:
        return None
    return {"applicability": "safe", "message": i.fix_message or None,
            "edits": [{"content": e.content, "location": {"row": e.start_line, "column": 1},
                       "end_location": {"row": e.end_line, "column": 1}} for e in i.edits]}


def as_json(items: Sequence[Located], rules: Dict[str, RuleInfo]) -> str:
    rows = [
        {
            "path": i.path,
            "line": i.finding.line,
            "column": i.finding.col + 1,
            "end_line": i.finding.end_line or i.finding.line,
            # 1-based, just past the flagged code (ruff's end_location); null where unknown
            "end_column": i.finding.end_col + 1 if i.finding.end_col else None,
            "code": i.finding.code,
            "name": rules[i.finding.code].name if i.finding.code in rules else "",
            "message": i.finding.message,
            "url": rule_url(i.finding.code),
            "fixable": bool(rules.get(i.finding.code) and rules[i.finding.code].fixable and not i.finding.review),
            "fix": _fix_json(i),
            # notebooks: the cell (1-based, every cell counted); line and column are in it
            **({"cell": i.finding.cell} if i.finding.cell else {}),
            # TorchFix's code for the same finding (`TOR101`), where there is one
            **({"torchfix": i.finding.alias} if i.finding.alias else {}),
        }
        for i in items
    ]
    return json.dumps(rows, indent=2) + "\n"


def _uri(path: str) -> str:
    rel = os.path.relpath(path) if os.path.isabs(path) else path
    return rel.replace(os.sep, "/")


def as_sarif(items: Sequence[Located], rules: Dict[str, RuleInfo]) -> str:
    """SARIF 2.1.0, as GitHub code scanning reads it."""
    ordered = sorted(rules.values(), key=lambda r: r.code)
    index = {r.code: n for n, r in enumerate(ordered)}
    driver = {
        "name": "gpumigrate",
        "version": __version__,
        "informationUri": "https://pypi.org/project/gpumigrate/",
        "rules": [
            {
                "id": r.code,
                "name": r.name,
                "shortDescription": {"text": r.message},
                "fullDescription": {"text": r.message},
                "help": {"text": r.docs, "markdown": r.docs},
                "helpUri": rule_url(r.code),
                "defaultConfiguration": {"level": "warning"},
            }
            for r in ordered
        ],
    }
    results = []
    for i in items:
        f = i.finding
        line, col, end, end_col = _in_file(i)
        region = {"startLine": max(line, 1), "startColumn": col, "endLine": max(end, line, 1)}
        if end_col is not None:
            region["endColumn"] = end_col
        result = {
            "ruleId": f.code,
            "level": "warning",
            "message": {"text": f.message},
            "locations": [{
                "physicalLocation": {
                    "artifactLocation": {"uri": _uri(i.path), "uriBaseId": "%SRCROOT%"},
                    "region": region,
                }
            }],
        }
        properties = {"cell": f.cell, "cellLine": f.line, "cellColumn": f.col + 1} if f.cell else {}
        if f.alias:  # TorchFix's code for the same finding, where there is one
            properties["torchfix"] = f.alias
        if properties:
            result["properties"] = properties
        if f.code in index:
            result["ruleIndex"] = index[f.code]
        results.append(result)
    log = {
        "$schema": SARIF_SCHEMA,
        "version": "2.1.0",
        "runs": [{"tool": {"driver": driver}, "results": results, "columnKind": "unicodeCodePoints"}],
    }
    return json.dumps(log, indent=2) + "\n"


def _escape(value: str, property_value: bool = False) -> str:
    # GitHub's workflow-command escaping
    value = value.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
    if property_value:
        value = value.replace(":", "%3A").replace(",", "%2C")
    return value


def as_github(items: Sequence[Located]) -> str:
    out = []
    for i in items:
        line, col, end, end_col = _in_file(i)
        code = i.finding.code + (f" [{i.finding.alias}]" if i.finding.alias else "")  # as the text output
        title = code + (f" (cell {i.finding.cell}:{i.finding.line}:{i.finding.col + 1})" if i.finding.cell else "")
        # GitHub takes columns only on a one-line annotation
        columns = f"col={col},endColumn={end_col}," if end == line and end_col else f"col={col}," if end == line else ""
        out.append(f"::warning file={_escape(i.path, True)},line={line},{columns}endLine={end},"
                   f"title={_escape(title, True)}::{_escape(code + ' ' + i.finding.message)}\n")
    return "".join(out)


# -- the migration report (`--report`) ------------------------------------------------------

# The report's line numbers: the diff's runs of equal lines map one for one; in an edited run,
# each old line goes to the most similar new line at or after the previous one's. Both steps
# are linear in the lines (issue 17): an edited run is searched near where each old line
# should be, not whole, and the runs come from anchoring on lines that occur once, not from
# difflib over the whole file.
#
# The search: the _WINDOW new lines after the previous old line's match. When they hold no
# similar line (a longer block was inserted there), it goes on past them to the first similar
# line and _WINDOW lines beyond, at most _FARTHEST lines, out of a budget of 2 * _WINDOW
# comparisons per old line of the run; once that is spent, the lines around the old line's
# proportional position in the run are searched instead. When at most _WHOLE new lines are
# left, they are all searched: a short run is as exact as comparing every pair.
_WINDOW = 8
_WHOLE = 3 * _WINDOW
_FARTHEST = 8 * _WINDOW
_LONGEST = 200  # characters of a line compared: a longer line costs no more than this
_SIMILAR = 0.6  # the least ratio that makes two lines the same code
_SMALL = 32  # a stretch between anchors with at most this many lines a side: difflib aligns it
_DEPTH = 4  # levels of anchoring within a stretch between anchors


def _unique_pairs(a: Sequence[bytes], b: Sequence[bytes], i1: int, i2: int, j1: int,
                  j2: int) -> List[Tuple[int, int]]:
    """The longest chain, increasing on both sides, of the lines that occur once in
    a[i1:i2] and once in b[j1:j2] (patience diff's anchors): n log n."""
    def once(lines: Sequence[bytes], lo: int, hi: int) -> Dict[bytes, int]:
        seen: Dict[bytes, int] = {}
        for k in range(lo, hi):
            seen[lines[k]] = -1 if lines[k] in seen else k
        return seen

    in_a, in_b = once(a, i1, i2), once(b, j1, j2)
    pairs = sorted((i, in_b[line]) for line, i in in_a.items() if i >= 0 and in_b.get(line, -1) >= 0)
    tops: List[int] = []  # tops[n]: the least j that ends an increasing chain of n + 1 pairs
    ends: List[int] = []  # the pair that ends it
    back = [-1] * len(pairs)
    for n, (_, j) in enumerate(pairs):
        at = bisect.bisect_left(tops, j)
        back[n] = ends[at - 1] if at else -1
        if at == len(tops):
            tops.append(j)
            ends.append(n)
        else:
            tops[at], ends[at] = j, n
    chain, n = [], ends[-1] if ends else -1
    while n >= 0:
        chain.append(pairs[n])
        n = back[n]
    return chain[::-1]


def _runs(a: Sequence[bytes], b: Sequence[bytes]) -> List[Tuple[bool, int, int, int, int]]:
    """(equal, i1, i2, j1, j2): a[i1:i2] is b[j1:j2], or was edited into it; in order,
    covering both. difflib's opcodes on a short stretch; a long one is first cut at the
    lines that occur once on each side (difflib over a whole file is cubic in its lines when
    a line such as a blank one recurs between edits), and one still long and without such
    lines is one edited run, which the similarity search aligns."""
    out: List[Tuple[bool, int, int, int, int]] = []

    def stretch(i1: int, i2: int, j1: int, j2: int, depth: int) -> None:
        n = 0
        while i1 + n < i2 and j1 + n < j2 and a[i1 + n] == b[j1 + n]:
            n += 1
        if n:
            out.append((True, i1, i1 + n, j1, j1 + n))
        i1, j1 = i1 + n, j1 + n
        m = 0
        while i2 - m > i1 and j2 - m > j1 and a[i2 - m - 1] == b[j2 - m - 1]:
            m += 1
        i2, j2 = i2 - m, j2 - m
        if i2 - i1 <= _SMALL and j2 - j1 <= _SMALL:
            if i1 < i2 or j1 < j2:
                for tag, x1, x2, y1, y2 in difflib.SequenceMatcher(None, a[i1:i2], b[j1:j2],
                                                                   autojunk=False).get_opcodes():
                    out.append((tag == "equal", i1 + x1, i1 + x2, j1 + y1, j1 + y2))
        else:
            pairs = _unique_pairs(a, b, i1, i2, j1, j2) if depth < _DEPTH else []
            if not pairs:
                out.append((False, i1, i2, j1, j2))
            for i, j in pairs:
                stretch(i1, i, j1, j, depth + 1)
                out.append((True, i, i + 1, j, j + 1))
                i1, j1 = i + 1, j + 1
            if pairs:
                stretch(i1, i2, j1, j2, depth + 1)
        if m:
            out.append((True, i2, i2 + m, j2, j2 + m))

    stretch(0, len(a), 0, len(b), 0)
    return out


def _edited_run(a: Sequence[bytes], b: Sequence[bytes], i1: int, i2: int, j1: int, j2: int,
                where: Dict[int, int]) -> None:
    """where[i] for the old lines a[i1:i2], edited into b[j1:j2]: each goes to the most
    similar new line at or after the previous one's (a removed guard line goes where the
    code after it went), searched as the comment above says."""
    held: Dict[int, difflib.SequenceMatcher] = {}  # new line -> a matcher holding it as seq2

    def similarity(k: int, line: bytes, score: float) -> float:
        """`line` against new line k if that could beat `score`, else 0."""
        matcher = held.get(k)
        if matcher is None:
            matcher = held[k] = difflib.SequenceMatcher(None, b"", b[k].strip()[:_LONGEST])
        matcher.set_seq1(line)
        # ratio() <= quick_ratio() <= real_quick_ratio(): the cheap bounds first
        if matcher.real_quick_ratio() > score and matcher.quick_ratio() > score:
            return matcher.ratio()
        return 0.0

    dropped = j1  # the new lines below this are behind every later search: their matchers went
    spare = 2 * _WINDOW * (i2 - i1)  # comparisons left for searches past the window
    j = j1
    for i in range(i1, i2):
        expected = j1 + (i - i1) * (j2 - j1) // (i2 - i1)
        for k in range(dropped, min(j, expected - _WINDOW)):
            held.pop(k, None)
        dropped = max(dropped, min(j, expected - _WINDOW))
        line = a[i].strip()[:_LONGEST]
        best, score = None, _SIMILAR
        end = j2 if j2 - j <= _WHOLE else j + _WINDOW
        for k in range(j, end):  # the window after the previous match
            ratio = similarity(k, line, score)
            if ratio > score:
                best, score = k, ratio
                if ratio == 1.0:
                    break
        k = end
        if best is None:  # past it: to the first similar line and the few after that
            stop = min(j2, j + _FARTHEST)
            while k < stop and spare > 0:
                spare -= 1
                ratio = similarity(k, line, score)
                if ratio > score:
                    if best is None:
                        stop = min(stop, k + _WINDOW)
                    best, score = k, ratio
                    if ratio == 1.0:
                        break
                k += 1
        if best is None:  # nothing similar there: around the proportional position
            for k in range(max(k, expected - _WINDOW), min(j2, expected + _WINDOW + 1)):
                ratio = similarity(k, line, score)
                if ratio > score:
                    best, score = k, ratio
                    if ratio == 1.0:
                        break
        if best is not None:
            j = best
        where[i] = min(j, max(j2 - 1, j1))
        if best is not None:
            j = min(best + 1, max(j2 - 1, j1))


def line_map(old: bytes, new: bytes) -> Callable[[int], int]:
    """Original line number -> the line of the rewritten file where that code now is (an
    edited line maps to the start of its replacement, a removed one to where it was).
    Linear in the lines (n log n for the anchors): a bounded number of comparisons per old
    line, each of bounded cost."""
    if old == new:
        return lambda line: line
    a, b = old.splitlines(), new.splitlines()
    where: Dict[int, int] = {}
    for equal, i1, i2, j1, j2 in _runs(a, b):
        if equal:
            where.update({i: j1 + (i - i1) for i in range(i1, i2)})
        else:
            _edited_run(a, b, i1, i2, j1, j2, where)
    return lambda line: where.get(line - 1, line - 1) + 1


Position = Tuple[int, int]  # (cell, line); cell 0 in a plain file


def position_map(path: str, old: bytes, new: bytes) -> Callable[[Finding], Position]:
    """Finding in `old` -> where its code is in `new`. A notebook maps each changed cell's
    lines on their own: a cell's line numbers are what a notebook user sees."""
    if old == new:
        return lambda f: (f.cell, f.line)
    if is_notebook(path):
        maps = {n: line_map(a.encode(), b.encode()) for n, a, b in changed_cells(old, new) or ()}
        return lambda f: (f.cell, maps[f.cell](f.line) if f.cell in maps else f.line)
    moved = line_map(old, new)
    return lambda f: (f.cell, moved(f.line))


def _position_map(r: Any) -> Callable[[Finding], Position]:
    """Finding -> where its code now is in the migrated file."""
    return position_map(r.path, r.source, r.new_source) if r.changed else (lambda f: (f.cell, f.line))


def _grouped(findings: Sequence[Finding], where: Callable[[Finding], Position]) -> List[Dict[str, Any]]:
    """One entry per (code, message), with every line it was found on, in order of first line."""
    groups: Dict[Tuple[str, str], Dict[str, Any]] = {}
    seen: Dict[Tuple[str, str], Tuple[Set[Position], Set[Position]]] = {}  # (original, migrated) positions
    for f in sorted(findings, key=lambda f: (f.cell, f.line, f.col, f.code)):
        entry = groups.setdefault((f.code, f.message), {"code": f.code, "message": f.message, "positions": [],
                                                        "original_positions": []})
        original, migrated = seen.setdefault((f.code, f.message), (set(), set()))
        if f.line and (f.cell, f.line) not in original:
            original.add((f.cell, f.line))
            entry["original_positions"].append((f.cell, f.line))
            now = where(f)
            if now not in migrated:  # two original lines may have become one
                migrated.add(now)
                entry["positions"].append(now)
    for entry in groups.values():
        for key, positions in (("", entry.pop("positions")), ("original_", entry.pop("original_positions"))):
            entry[key + "lines"] = [line for _, line in positions]
            if any(cell for cell, _ in positions):
                entry[key + "cells"] = [cell for cell, _ in positions]
    return list(groups.values())


def not_applied(results: Sequence[Any]) -> Dict[str, int]:
    """target -> how many files a review item says did not get it."""
    counts: Dict[str, int] = {}
    for r in results:
        for target in {f.not_applied for f in r.findings if f.not_applied and not r.error}:
            counts[target] = counts.get(target, 0) + 1
    return counts


def migration_report(results: Sequence[Any], target: str, *, json_format: bool = False, written: bool = True,
                     done: Optional[Mapping[str, Tuple[str, str]]] = None, next_steps: Sequence[str] = ()) -> str:
    """What changed and what needs a human, per file, with counts first, and what to do next.
    Line numbers point into the migrated file (the one the user now edits); identical items
    are grouped. `done`: per code, (the rule's general message, what its fix does): a changed
    item with the general message is worded as what was done."""
    files = []
    for r in results:
        where = _position_map(r)
        files.append({
            "path": r.path, "changed": bool(r.changed and not r.error), "error": r.error,
            "edits": sum(1 for f in r.findings if f.fixed),
            "not_applied": sorted({f.not_applied for f in r.findings if f.not_applied and not r.error}),
            "review": _quoted(r, _grouped([f for f in r.findings if not (f.fixed or f.note)], where)),
            "notes": _grouped([f for f in r.findings if f.note], where),
            "fixed": _grouped([_as_done(f, done or {}) for f in r.findings if f.fixed], where),
            # opt-in conversions of the input before the rules ran (--py2, --reformat-notebooks)
            "converted": list(getattr(r, "prepared", ())) if r.changed and not r.error else [],
        })
    totals = {
        "files": len(files), "changed": sum(f["changed"] for f in files),
        "edits": sum(f["edits"] for f in files if f["changed"]),
        "review": sum(len(g["original_lines"]) or 1 for f in files for g in f["review"]),
        "errors": sum(1 for f in files if f["error"]),
        "not_applied": not_applied(results),
    }
    if json_format:
        return json.dumps({"target": target, "written": written, "line_numbers": "migrated file",
                           "summary": totals, "next_steps": list(next_steps), "files": files}, indent=2) + "\n"
    out = [f"# gpumigrate --to {target}: migration report", "",
           f"{_count(totals['files'], 'file')}: {totals['changed']} changed ({_count(totals['edits'], 'edit')}), "
           f"{_count(totals['review'], 'item')} to review by hand, {_count(totals['errors'], 'error')}"
           + "".join(f"; --to {t} not applied to {_count(n, 'file')}" for t, n in sorted(totals["not_applied"].items()))
           + ".", "",
           "Line numbers are those of the migrated file" + ("" if written else " (not written: --diff/--check)")
           + "; the original's follow in parentheses where they differ.", ""]
    if next_steps:
        out += ["## Next steps", ""] + [f"- {step}" for step in next_steps] + [""]
    for f in files:
        out += [f"## {f['path']}", ""]
        if f["error"]:
            out += [f"- error: {f['error']}", ""]
            continue
        if f["not_applied"]:
            out += [f"**Not applied: {', '.join('--to ' + t for t in f['not_applied'])}** (the review items say why)", ""]
        if f["converted"]:
            out += ["### Converted before the migration", ""] + [f"- {note}" for note in f["converted"]] + [""]
        for title, key in (("Review by hand", "review"), ("Changed", "fixed"), ("Notes", "notes")):
            if f[key]:
                out += [f"### {title}", ""] + [_item(g) for g in f[key]] + [""]
        if not (f["review"] or f["fixed"] or f["notes"]):
            out += ["- nothing to change", ""]
    return "\n".join(out).rstrip("\n") + "\n"


def _quoted(result: Any, groups: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Each review item with the text of its (first) line in the migrated file, the one the
    user opens: what to look at, without a pre-migration text the file no longer has."""
    if result.error or is_notebook(result.path):
        return groups
    text = result.new_source if result.changed else result.source
    lines = (text or b"").decode("utf-8", "replace").splitlines()
    for group in groups:
        if group["lines"] and 1 <= group["lines"][0] <= len(lines):
            code = lines[group["lines"][0] - 1].strip()
            if code:
                group["text"] = code if len(code) <= 120 else code[:117] + "..."
    return groups


def _as_done(finding: Finding, done: Mapping[str, Tuple[str, str]]) -> Finding:
    """A changed item worded as what was done, where the finding says only the rule's general
    problem; a finding's own words (naming the model, the metric) stay."""
    general, wording = done.get(finding.code, ("", ""))
    return replace(finding, message=wording) if wording and finding.message == general else finding


def _places(group: Dict[str, Any], prefix: str = "") -> List[str]:
    lines, cells = group[prefix + "lines"], group.get(prefix + "cells")
    return [f"cell {c} line {n}" for c, n in zip(cells, lines)] if cells else [str(n) for n in lines]


def _item(group: Dict[str, Any]) -> str:
    places, original = _places(group), _places(group, "original_")
    if not places:
        where = "whole file"
    elif "cells" in group:
        where = ", ".join(places)
    else:
        where = f"{'line' if len(places) == 1 else 'lines'} {', '.join(places)}"
    if places != original:
        where += f" (original {', '.join(original)})"
    quoted = ""
    if group.get("text"):
        pad = " " if "`" in group["text"] else ""
        tick = "``" if pad else "`"
        quoted = f"\n  {tick}{pad}{group['text']}{pad}{tick}"
    return f"- {where}: {group['code']} {group['message']}{quoted}"


def _count(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"
