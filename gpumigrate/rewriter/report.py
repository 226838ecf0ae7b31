"""Findings as text, JSON, SARIF 2.1.0 or GitHub Actions annotations."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Dict, List, Sequence

from gpumigrate import __version__
from gpumigrate.rewriter.engine import Finding

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
    return sorted(items, key=lambda i: (i.path, i.finding.line, i.finding.col, i.finding.code))


def as_text(items: Sequence[Located]) -> str:
    return "".join(f"{i.path}:{i.finding.line}:{i.finding.col + 1}: {i.finding.code} {i.finding.message}\n"
                   for i in items)


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
        result = {
            "ruleId": f.code,
            "level": "warning",
            "message": {"text": f.message},
            "locations": [{
                "physicalLocation": {
                    "artifactLocation": {"uri": _uri(i.path), "uriBaseId": "%SRCROOT%"},
                    "region": {"startLine": max(f.line, 1), "startColumn": f.col + 1,
                               "endLine": max(f.end_line, f.line, 1)},
                }
            }],
        }
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
    return "".join(
        f"::warning file={_escape(i.path, True)},line={i.finding.line},col={i.finding.col + 1},"
        f"endLine={max(i.finding.end_line, i.finding.line)},title={_escape(i.finding.code, True)}::"
        f"{_escape(i.finding.code + ' ' + i.finding.message)}\n"
        for i in items
    )
