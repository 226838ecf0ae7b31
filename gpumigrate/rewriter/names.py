"""The module's import table: local name -> qualified name, built once per file.

Resolving names from the imports alone costs a walk over statements, not the full scope
analysis of LibCST's QualifiedNameProvider (about 7x a parse). Rebinding an imported name
locally is rare in training scripts and is not tracked.
"""

from __future__ import annotations

from typing import Dict, Iterator, Optional, Sequence, Tuple

import libcst as cst


def dotted(node: cst.CSTNode) -> Optional[str]:
    """`a.b.c` for a chain of names, else None."""
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        base = dotted(node.value)
        return f"{base}.{node.attr.value}" if base else None
    return None


def _statements(body) -> Iterator[cst.CSTNode]:
    """Every statement, nested in compound statements too, without entering expressions."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, cst.SimpleStatementLine):
            yield from stmt.body
        elif isinstance(stmt, cst.BaseCompoundStatement):
            for part in (stmt, getattr(stmt, "orelse", None), getattr(stmt, "finalbody", None)):
                inner = getattr(part, "body", None)
                if isinstance(inner, cst.BaseSuite):
                    yield from _statements(inner.body)
            for handler in getattr(stmt, "handlers", ()):
                yield from _statements(handler.body.body)
            orelse = getattr(stmt, "orelse", None)
            if isinstance(orelse, cst.If):  # elif chains
                yield from _statements([orelse])


class ImportTable:
    """Maps local names to the qualified names their imports bind."""

    def __init__(self, module: cst.Module, inherited: Sequence[Tuple[str, str]] = ()) -> None:
        # `inherited`: what `from project_module import *` brings (its imports); the file's own win
        self.local: Dict[str, str] = dict(inherited)
        for stmt in _statements(module.body):
            if isinstance(stmt, cst.Import):
                for alias in stmt.names:
                    full = dotted(alias.name)
                    if alias.asname is not None:
                        self.local[alias.asname.name.value] = full
                    else:  # `import a.b` binds `a`
                        top = full.split(".")[0]
                        self.local[top] = top
            elif isinstance(stmt, cst.ImportFrom) and not stmt.relative:
                base = dotted(stmt.module) if stmt.module else None
                if base is None or isinstance(stmt.names, cst.ImportStar):
                    continue
                for alias in stmt.names:
                    name = alias.name.value
                    local = alias.asname.name.value if alias.asname else name
                    self.local[local] = f"{base}.{name}"

    def qualify(self, node: cst.BaseExpression) -> Optional[str]:
        """`nn.DataParallel` -> `torch.nn.DataParallel`; None for names not from an import."""
        name = dotted(node)
        if name is None:
            return None
        head, _, rest = name.partition(".")
        full = self.local.get(head)
        if full is None:
            return None
        return f"{full}.{rest}" if rest else full

    def local_name_for(self, qualified: str) -> Optional[str]:
        """How the module spells `qualified` with its own imports, if it can."""
        best = None
        for local, full in self.local.items():
            if qualified == full or qualified.startswith(full + "."):
                candidate = local + qualified[len(full):]
                if best is None or len(candidate) < len(best):
                    best = candidate
        return best
