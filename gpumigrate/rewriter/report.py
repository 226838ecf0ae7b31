"""Findings as text, JSON, SARIF 2.1.0 or GitHub Actions annotations; the migration report."""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Sequence, Tuple

from gpumigrate import __version__
from gpumigrate.rewriter.engine import Finding
from gpumigrate.rewriter.notebook import changed_cells, file_position, is_notebook

SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"


@dataclass(frozen=True)
class RuleInfo:
    code: str
    name: str
    message: str
    docs: str
    fixable: bool


@dataclass(frozen=True)
class Located:
    path: str
    finding: Finding


def sort_findings(items: Sequence[Located]) -> List[Located]:
    return sorted(items, key=lambda i: (i.path, i.finding.cell, i.finding.line, i.finding.col, i.finding.code))


def location(path: str, finding: Finding) -> str:
    """`path:line:col`, or `path:cell N:line:col` in a notebook (as ruff writes it)."""
    cell = f"cell {finding.cell}:" if finding.cell else ""
    return f"{path}:{cell}{finding.line}:{finding.col + 1}"


def as_text(items: Sequence[Located]) -> str:
    return "".join(f"{location(i.path, i.finding)}: {i.finding.code} {i.finding.message}\n" for i in items)


def _in_file(item: Located) -> Tuple[int, int, int]:
    """(line, 1-based column, end line) in the file itself. A notebook's cell position
    becomes the line of the notebook's JSON that holds that code: what code scanning and
    Actions annotations show is the raw file."""
    f = item.finding
    end = max(f.end_line, f.line)
    if f.cell:
        start = file_position(item.path, f.cell, f.line, f.col)
        if start is not None:
            stop = file_position(item.path, f.cell, end, 0)
            return start[0], start[1] + 1, max(stop[0] if stop else 0, start[0])
    return f.line, f.col + 1, end


def as_json(items: Sequence[Located], rules: Dict[str, RuleInfo]) -> str:
    rows = [
        {
            "path": i.path,
            "line": i.finding.line,
            "column": i.finding.col + 1,
            "end_line": i.finding.end_line or i.finding.line,
            "code": i.finding.code,
            "name": rules[i.finding.code].name if i.finding.code in rules else "",
            "message": i.finding.message,
            "fixable": bool(rules.get(i.finding.code) and rules[i.finding.code].fixable and not i.finding.review),
            # notebooks: the cell (1-based, every cell counted); line and column are in it
            **({"cell": i.finding.cell} if i.finding.cell else {}),
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
                "defaultConfiguration": {"level": "warning"},
            }
            for r in ordered
        ],
    }
    results = []
    for i in items:
        f = i.finding
        line, col, end = _in_file(i)
        result = {
            "ruleId": f.code,
            "level": "warning",
            "message": {"text": f.message},
            "locations": [{
                "physicalLocation": {
                    "artifactLocation": {"uri": _uri(i.path), "uriBaseId": "%SRCROOT%"},
                    "region": {"startLine": max(line, 1), "startColumn": col, "endLine": max(end, line, 1)},
                }
            }],
        }
        if f.cell:
            result["properties"] = {"cell": f.cell, "cellLine": f.line, "cellColumn": f.col + 1}
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
        line, col, end = _in_file(i)
        title = i.finding.code + (f" (cell {i.finding.cell}:{i.finding.line}:{i.finding.col + 1})" if i.finding.cell else "")
        out.append(f"::warning file={_escape(i.path, True)},line={line},col={col},endLine={end},"
                   f"title={_escape(title, True)}::{_escape(i.finding.code + ' ' + i.finding.message)}\n")
    return "".join(out)


# -- the migration report (`--report`) ------------------------------------------------------

def line_map(old: bytes, new: bytes) -> Callable[[int], int]:
    """Original line number -> the line of the rewritten file where that code now is (an
    edited line maps to the start of its replacement, a removed one to where it was)."""
    if old == new:
        return lambda line: line
    a, b = old.splitlines(), new.splitlines()
    where: Dict[int, int] = {}
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag == "equal":
            where.update({i: j1 + (i - i1) for i in range(i1, i2)})
            continue
        # an edited run: each old line goes to the most similar new line at or after the
        # previous one's (a removed guard line goes where the code after it went)
        j = j1
        for i in range(i1, i2):
            best, score = None, 0.6
            for k in range(j, j2):
                ratio = difflib.SequenceMatcher(None, a[i].strip(), b[k].strip()).ratio()
                if ratio > score:
                    best, score = k, ratio
            if best is not None:
                j = best
            where[i] = min(j, max(j2 - 1, j1))
            if best is not None:
                j = min(best + 1, max(j2 - 1, j1))
    return lambda line: where.get(line - 1, line - 1) + 1


Position = Tuple[int, int]  # (cell, line); cell 0 in a plain file


def _position_map(r: Any) -> Callable[[Finding], Position]:
    """Finding -> where its code now is in the migrated file. A notebook maps each changed
    cell's lines on their own: a cell's line numbers are what a notebook user sees."""
    if not r.changed:
        return lambda f: (f.cell, f.line)
    if is_notebook(r.path):
        maps = {n: line_map(old.encode(), new.encode()) for n, old, new in changed_cells(r.source, r.new_source) or ()}
        return lambda f: (f.cell, maps[f.cell](f.line) if f.cell in maps else f.line)
    moved = line_map(r.source, r.new_source)
    return lambda f: (f.cell, moved(f.line))


def _grouped(findings: Sequence[Finding], where: Callable[[Finding], Position]) -> List[Dict[str, Any]]:
    """One entry per (code, message), with every line it was found on, in order of first line."""
    groups: Dict[Tuple[str, str], Dict[str, Any]] = {}
    for f in sorted(findings, key=lambda f: (f.cell, f.line, f.col, f.code)):
        entry = groups.setdefault((f.code, f.message), {"code": f.code, "message": f.message, "positions": [],
                                                        "original_positions": []})
        if f.line and (f.cell, f.line) not in entry["original_positions"]:
            entry["original_positions"].append((f.cell, f.line))
            if where(f) not in entry["positions"]:  # two original lines may have become one
                entry["positions"].append(where(f))
    for entry in groups.values():
        for key, positions in (("", entry.pop("positions")), ("original_", entry.pop("original_positions"))):
            entry[key + "lines"] = [line for _, line in positions]
            if any(cell for cell, _ in positions):
                entry[key + "cells"] = [cell for cell, _ in positions]
    return list(groups.values())


def migration_report(results: Sequence[Any], target: str, *, json_format: bool = False, written: bool = True) -> str:
    """What changed and what needs a human, per file, with counts first. Line numbers point
    into the migrated file (the one the user now edits); identical items are grouped."""
    files = []
    for r in results:
        where = _position_map(r)
        files.append({
            "path": r.path, "changed": bool(r.changed and not r.error), "error": r.error,
            "edits": sum(1 for f in r.findings if f.fixed),
            "review": _grouped([f for f in r.findings if not f.fixed], where),
            "fixed": _grouped([f for f in r.findings if f.fixed], where),
        })
    totals = {
        "files": len(files), "changed": sum(f["changed"] for f in files),
        "edits": sum(f["edits"] for f in files if f["changed"]),
        "review": sum(len(g["original_lines"]) or 1 for f in files for g in f["review"]),
        "errors": sum(1 for f in files if f["error"]),
    }
    if json_format:
        return json.dumps({"target": target, "written": written, "line_numbers": "migrated file",
                           "summary": totals, "files": files}, indent=2) + "\n"
    out = [f"# gpumigrate --to {target}: migration report", "",
           f"{_count(totals['files'], 'file')}: {totals['changed']} changed ({_count(totals['edits'], 'edit')}), "
           f"{_count(totals['review'], 'item')} to review by hand, {_count(totals['errors'], 'error')}.", "",
           "Line numbers are those of the migrated file" + ("" if written else " (not written: --diff/--check)")
           + "; the original's follow in parentheses where they differ.", ""]
    for f in files:
        out += [f"## {f['path']}", ""]
        if f["error"]:
            out += [f"- error: {f['error']}", ""]
            continue
        for title, key in (("Review by hand", "review"), ("Changed", "fixed")):
            if f[key]:
                out += [f"### {title}", ""] + [_item(g) for g in f[key]] + [""]
        if not (f["review"] or f["fixed"]):
            out += ["- nothing to change", ""]
    return "\n".join(out)


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
    return f"- {where}: {group['code']} {group['message']}"


def _count(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"
