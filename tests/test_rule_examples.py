"""Every rule's own examples are its specification: flagged, not flagged, and fixed."""

import pytest

from gpumigrate.codemods import ALL_RULES
from gpumigrate.codemods.base import LINT_FIX, Clean, Flagged
from gpumigrate.rewriter.engine import process
from gpumigrate.rewriter.names import ImportTable
from tests.conftest import lint, migrate


def fixed_by_lint(code: bytes, rule, options):
    """As `gpumigrate lint --fix --select CODE` fixes it."""
    return process(code, "script.py", [rule], fix=[rule.code], names_factory=ImportTable, options=options)

CASES = [
    pytest.param(rule, example, id=f"{rule.code}-{type(example).__name__.lower()}-{i}")
    for rule in ALL_RULES
    for i, example in enumerate(rule.examples)
]


@pytest.mark.parametrize("rule, example", CASES)
def test_rule_example(rule, example):
    options = dict(example.options or {})
    codes = [f.code for f in lint(example.code.encode(), [rule], options=options).findings]
    if isinstance(example, Clean):
        assert rule.code not in codes
        return
    assert rule.code in codes
    if example.fixed is not None:
        target = sorted(rule.fixed_in)[0]
        fix = (lambda code: fixed_by_lint(code, rule, options)) if target == LINT_FIX else \
            (lambda code: migrate(code, target, options=options))
        result = fix(example.code.encode())
        assert result.error is None
        assert (result.new_source or result.source).decode() == example.fixed
        # the fixed form is stable and clean
        again = fix(example.fixed.encode())
        assert again.new_source is None or again.new_source == example.fixed.encode()
        assert rule.code not in [f.code for f in again.findings if f.fixed]


@pytest.mark.parametrize("rule", ALL_RULES, ids=lambda r: r.code)
def test_rule_is_documented(rule):
    docs = rule.docs()
    for section in ("## What it does", "## Why is this bad?", "## Example", "## Use instead"):
        assert section in docs
    assert any(isinstance(e, Flagged) for e in rule.examples)
    assert any(isinstance(e, Clean) for e in rule.examples)
