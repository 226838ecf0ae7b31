"""The rule base: one class per rule serves lint (findings) and migrate (fixes).

A rule reads like a Fixit rule: a code, a name, a message, a docstring in ruff's four parts
(What it does / Why is this bad? / Example / Use instead), and its own examples, which one
parametrized test runs. Its `visit_*`/`leave_*` methods see the file's one tree; `leave_*`
returns the fixed node, which the engine keeps only when the rule fixes in this run.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, ClassVar, FrozenSet, Mapping, Optional, Tuple, Union

import libcst as cst

from gpumigrate.rewriter.engine import FileContext
from gpumigrate.rewriter.facts import SourceFacts


@dataclass(frozen=True)
class Flagged:
    """Code the rule must flag; `fixed` is the whole file after the rule's target migration
    (None for lint-only rules or instances left for review)."""

    code: str
    fixed: Optional[str] = None
    options: Optional[Mapping[str, Any]] = None  # the file options (as the CLI passes them)


@dataclass(frozen=True)
class Clean:
    """Code the rule must not flag."""

    code: str
    options: Optional[Mapping[str, Any]] = None


Example = Union[Flagged, Clean]


# `fixed_in` of a style fix that `gpumigrate lint --fix` applies but no migration does: a
# migration's diff holds what changes for the script to run and run right, nothing else.
LINT_FIX = "lint --fix"


class Rule:
    code: ClassVar[str] = ""
    name: ClassVar[str] = ""
    message: ClassVar[str] = ""
    # What the fix does, for the migration report's "Changed" items (`.cuda()` → `.to(device)`):
    # the message says what is wrong, which a user reading what was done does not need.
    done: ClassVar[str] = ""
    fixed_in: ClassVar[FrozenSet[str]] = frozenset()  # targets whose migration applies the fix
    examples: ClassVar[Tuple[Example, ...]] = ()
    # The rule runs only on files containing one of these strings: a cheap pre-filter that
    # spares most rules on most files.
    triggers: ClassVar[Tuple[str, ...]] = ()
    # False for migration steps that are not defects (GM400 ddp-setup): `lint` skips them.
    lint: ClassVar[bool] = True
    # Lint-only rules whose findings a migration to these targets lists for review by hand.
    reported_in: ClassVar[FrozenSet[str]] = frozenset()
    # The TorchFix codes whose findings this rule's mean the same (`# noqa: TOR101` is an
    # alias of ours; output shows the code beside ours). A finding shows the first unless
    # `report(torchfix=...)` names another (TOR103: an import line).
    torchfix: ClassVar[Tuple[str, ...]] = ()

    def __init__(self, ctx: FileContext) -> None:
        self.ctx = ctx

    @classmethod
    def gate(cls, facts: SourceFacts) -> bool:
        """False only where this rule cannot report on the file, whatever its tree: lint
        (fixing nothing) skips it there, and a file no rule passes is not parsed by LibCST.
        A rule's gate must be a necessary condition of every report it makes; the default
        is its text triggers."""
        return not cls.triggers or any(t in facts.text for t in cls.triggers)

    @property
    def fixing(self) -> bool:
        return self.code in self.ctx.fixing

    def report(self, node: cst.CSTNode, message: Optional[str] = None, *, review: bool = False,
               through: Optional[cst.CSTNode] = None, not_applied: str = "", torchfix: Optional[str] = None) -> None:
        """Report `node` (of the original tree). `review`: no safe fix here, a human must look.
        `through`: the fix spans statements up to this one. `not_applied`: the target (`ddp`)
        this review item says the file does not get (the summary line counts those files)."""
        fixable = bool(self.fixed_in) and not review
        alias = torchfix if torchfix is not None else (self.torchfix[0] if self.torchfix else "")
        self.ctx.report(self.code, node, message or self.message, fixed=fixable, review=review, through=through,
                        not_applied=not_applied, alias=alias)

    def qualify(self, node: cst.BaseExpression) -> Optional[str]:
        return self.ctx.names.qualify(node)

    @classmethod
    def docs(cls) -> str:
        return inspect.cleandoc(cls.__doc__ or "")
