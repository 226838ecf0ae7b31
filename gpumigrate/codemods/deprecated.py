"""Removed and deprecated torch symbols, driven by the table of `deprecations.py`: GM211, GM212.

GM211 is a use of a symbol today's torch no longer has (or keeps as a stub that raises):
the script fails where it runs it, so `--to device` fixes it wherever the new call is
provably the same, and lists the rest for review. GM212 is a symbol that still works but is
deprecated: its drop-in replacements are fixed, the rest reported with what changes.

Symbols other rules own are left to them: `torch.cuda.amp.autocast`/`GradScaler` (GM503),
the renames of GM208 (`clip_grad_norm`, `nn.init.xavier_uniform`, `F.upsample`, ...).
"""

from __future__ import annotations

from typing import Dict, FrozenSet, List, Optional, Set, Tuple

import libcst as cst

from gpumigrate.codemods.base import Clean, Flagged, Rule
from gpumigrate.codemods.deprecations import CURRENT_TO, DEPRECATIONS, Deprecation, removed_by
from gpumigrate.codemods.helpers import enclosing, get_arg, keyword_arg, literal_bool, with_args
from gpumigrate.codemods.legacy import _RENAMES
from gpumigrate.rewriter.facts import SourceFacts

# Owned by other rules, which report and fix them (a symbol is reported by one rule only).
_OWNED_ELSEWHERE: FrozenSet[str] = frozenset({"torch.cuda.amp.autocast", "torch.cuda.amp.GradScaler",
                                              # modules and methods: names cannot be qualified
                                              "torch.distributed.launch", "torch.Tensor.storage",
                                              *_RENAMES})

REMOVED: Dict[str, Deprecation] = {e.name: e for e in DEPRECATIONS
                                   if removed_by(e, CURRENT_TO) and e.name not in _OWNED_ELSEWHERE}
DEPRECATED: Dict[str, Deprecation] = {e.name: e for e in DEPRECATIONS
                                      if not removed_by(e, CURRENT_TO) and e.name not in _OWNED_ELSEWHERE}


def _parts(entries: Dict[str, Deprecation]) -> Tuple[FrozenSet[str], ...]:
    """Each symbol's dotted parts: every way a script names it (`import torch as tt;
    tt.qr`, `from torch import qr as q`) puts them all among the file's identifiers."""
    return tuple({frozenset(name.split(".")) for name in entries})


def _spell(rule: Rule, qualified: str, like: Optional[cst.BaseExpression] = None) -> cst.BaseExpression:
    """How the script names `qualified`: as the replaced `like` spells the same package
    (`foo.chain_matmul` with `import torch as foo`: `foo.linalg.multi_dot`), else with its own
    package's name, importing it if need be."""
    if isinstance(like, cst.Attribute):
        head = like
        while isinstance(head, cst.Attribute):
            head = head.value
            known = rule.qualify(head)
            if known and qualified.startswith(known + "."):
                return cst.parse_expression(cst.Module([]).code_for_node(head) + qualified[len(known):])
    # the package's own name (`torch`, `tt`), not a from-import of a part of it, which may
    # be bound only further down (`from torch.utils import _pytree as xx` after the use)
    top, _, rest = qualified.partition(".")
    local = rule.ctx.names.local_name_for(top)
    if local is None or "." in local:
        rule.ctx.add_import(top)
        local = top
    return cst.parse_expression(f"{local}.{rest}" if rest else local)


def _plain(call: cst.Call) -> bool:
    """No `*args`/`**kwargs`: every argument's meaning is known."""
    return not any(a.star for a in call.args)


class _TableRule(Rule):
    """Shared: find every use (call or not) and import line of a table symbol."""

    entries: Dict[str, Deprecation] = {}
    last_names: FrozenSet[str] = frozenset()
    kind = ""
    imported: Optional[Set[str]] = None  # local names bound to a symbol by an import
    _parts: Tuple[FrozenSet[str], ...] = ()  # per symbol, the names its qualified name is made of

    @classmethod
    def gate(cls, facts: SourceFacts) -> bool:  # every part of one symbol's name is in the file
        return any(parts <= facts.ids for parts in cls._parts)

    def _may_name(self, node: cst.CSTNode) -> bool:
        """A cheap necessary condition of `_uses_of` (it runs on every name of the file):
        an attribute with a symbol's last name, or a name imported as a symbol."""
        if isinstance(node, cst.Attribute):
            return node.attr.value in self.last_names
        if isinstance(node, cst.Name):
            if self.imported is None:
                self.imported = {local for local, full in self.ctx.names.local.items() if full in self.entries}
            return node.value in self.imported
        return False

    def _uses_of(self, node: cst.BaseExpression) -> Optional[Deprecation]:
        if not self._may_name(node):
            return None
        qualified = self.qualify(node)
        entry = self.entries.get(qualified) if qualified else None
        if entry is None or enclosing(self.ctx.ancestors, cst.ImportFrom) or enclosing(self.ctx.ancestors, cst.Import):
            return None
        return entry

    def _describe(self, entry: Deprecation) -> str:
        return f"`{entry.name}` is {self.kind}; use `{entry.replacement}` ({entry.note})"

    def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
        if isinstance(node.names, cst.ImportStar) or node.relative:
            return
        module = cst.Module([]).code_for_node(node.module) if node.module is not None else ""
        for alias in node.names:
            name = f"{module}.{cst.Module([]).code_for_node(alias.name)}"
            entry = self.entries.get(name)
            if entry is not None:
                self._import_line(node, alias, entry)

    def _import_line(self, node: cst.ImportFrom, alias: cst.ImportAlias, entry: Deprecation) -> None:
        self.report(alias, f"import of {self._describe(entry)}", review=True, torchfix=self.torchfix[1])


# potrf/potrs/potri: (position of `upper`, successor); upper=True was their default
_UPPER_DEFAULT: Dict[str, Tuple[int, str]] = {"torch.potrf": (1, "torch.linalg.cholesky"),
                                              "torch.potrs": (2, "torch.cholesky_solve"),
                                              "torch.potri": (1, "torch.cholesky_inverse")}


class RemovedFunction(_TableRule):
    """
    ## What it does
    Finds uses of torch functions that today's torch has removed (`torch.solve`,
    `torch.symeig`, `torch.lstsq`, `torch.eig`, `torch.matrix_rank`, ...) and the
    `from torch import solve` lines that import them. TorchFix calls these TOR001 and TOR004.

    ## Why is this bad?
    The script fails where it calls them: torch keeps stubs that raise `RuntimeError`
    ("This function was deprecated since version 1.9 and is now removed").

    ## Example
    ```python
    x = torch.solve(B, A)[0]
    e, v = torch.symeig(A, eigenvectors=True)
    r = torch.matrix_rank(A)
    ```

    ## Use instead
    ```python
    x = torch.linalg.solve(A, B)
    e, v = torch.linalg.eigh(A, UPLO="U")
    r = torch.linalg.matrix_rank(A)
    ```
    `--to device` fixes a call where the new one gives the same result: `torch.solve`
    whose solution alone is read (`[0]`, `.solution`, `x, _ = ...`); `torch.symeig` with
    literal `eigenvectors`/`upper` (eigenvalues only: `torch.linalg.eigvalsh`, where the empty
    second result is not read); `torch.matrix_rank(A)`; `torch.eig` whose eigenvalues alone
    are read (`torch.view_as_real(torch.linalg.eigvals(A))`, the same (n, 2) rows); `torch.lstsq`
    whose solution alone is read (`torch.linalg.lstsq(A, B).solution`, with a review line: it
    has n rows where the old one had max(m, n)); the LAPACK names of 2018 (`torch.gesv`,
    `torch.gels`, `torch.potrf`/`potrs`/`potri` with their `upper=True` default spelled out,
    `torch.trtrs`, `torch.btrifact`, `torch.btriunpack`). The others (eigenvectors in torch.eig's real
    packed form, lstsq's QR factors) are listed for review with their replacement.
    """

    code = "GM211"
    name = "removed-function"
    message = "removed torch function"
    done = "removed torch function → its `torch.linalg` replacement"
    fixed_in = frozenset({"device"})
    torchfix = ("TOR001", "TOR004")
    entries = REMOVED
    last_names = frozenset(name.rsplit(".", 1)[1] for name in REMOVED)
    kind = "removed"
    _parts = _parts(REMOVED)

    examples = (
        Flagged("import torch\nx = torch.solve(B, A)[0]\n", fixed="import torch\nx = torch.linalg.solve(A, B)\n"),
        Flagged("import torch\nx = torch.solve(B, A).solution\n",
                fixed="import torch\nx = torch.linalg.solve(A, B)\n"),
        Flagged("import torch\nx, _ = torch.solve(B, A)\n", fixed="import torch\nx = torch.linalg.solve(A, B)\n"),
        Flagged("import torch\nx, lu = torch.solve(B, A)\n"),  # LU is read: review
        Flagged("import torch\ne, v = torch.symeig(A, eigenvectors=True)\n",
                fixed='import torch\ne, v = torch.linalg.eigh(A, UPLO="U")\n'),
        Flagged("import torch\ne, v = torch.symeig(A, True, False)\n",
                fixed='import torch\ne, v = torch.linalg.eigh(A, UPLO="L")\n'),
        Flagged("import torch\ne = torch.symeig(A)[0]\n", fixed='import torch\ne = torch.linalg.eigvalsh(A, UPLO="U")\n'),
        Flagged("import torch\nE, Z = torch.symeig(A, eigenvectors, True)\n"),  # not a literal: review
        Flagged("import torch as tt\nr = tt.matrix_rank(A)\n", fixed="import torch as tt\nr = tt.linalg.matrix_rank(A)\n"),
        Flagged("import torch\nx = torch.lstsq(B, A)[0]\n", fixed="import torch\nx = torch.linalg.lstsq(A, B).solution\n"),
        Flagged("import torch\nx, qr = torch.lstsq(B, A)\n"),  # the QR factors are read: review
        Flagged("import torch\ne, _ = torch.eig(A)\n",
                fixed="import torch\ne = torch.view_as_real(torch.linalg.eigvals(A))\n"),
        Flagged("import torch\nw, v = torch.eig(A, eigenvectors=True)\n"),  # packed real eigenvectors: review
        Flagged("import torch\nx, _ = torch.gesv(B, A)\n", fixed="import torch\nx = torch.linalg.solve(A, B)\n"),
        Flagged("import torch\nU = torch.potrf(A)\n", fixed="import torch\nU = torch.linalg.cholesky(A).mH\n"),
        Flagged("import torch\nx = torch.potrs(b, U)\n", fixed="import torch\nx = torch.cholesky_solve(b, U, upper=True)\n"),
        Flagged("import torch\nx = torch.trtrs(b, U)[0]\n",
                fixed="import torch\nx = torch.linalg.solve_triangular(U, b, upper=True)\n"),
        Flagged("import torch\nlu, p = torch.btrifact(A)\n", fixed="import torch\nlu, p = torch.linalg.lu_factor(A)\n"),
        Flagged("import torch\nx = torch.btrisolve(b, lu, p)\n"),  # vectors where lu_solve takes matrices: review
        Flagged("from torch import symeig as xxx\nE, Z = xxx(A, eigenvectors=True)\n",
                fixed='from torch import symeig as xxx\nimport torch\n\nE, Z = torch.linalg.eigh(A, UPLO="U")\n'),
        Clean("import torch\nx = torch.linalg.solve(A, B)\ne, v = torch.linalg.eigh(A)\n"),
        Clean("import numpy as np\nx = np.linalg.solve(A, B)\ns = solve(B, A)\n"),
    )

    def visit_Module(self, node: cst.Module) -> None:
        self.replace: Dict[int, str] = {}  # id of a node (original tree) -> how it is fixed

    def _parent(self, node: cst.CSTNode) -> Optional[cst.CSTNode]:
        return self.ctx.index.parent.get(id(node))

    def _first_only(self, call: cst.Call, field: str) -> Optional[Tuple[cst.CSTNode, str]]:
        """Where only the first of a (solution, other) result is read: the node to replace
        and how ("first": `r[0]` or `r.<name>`; "assign": `x, _ = r`)."""
        above = self._parent(call)
        if isinstance(above, cst.Subscript) and above.value is call and len(above.slice) == 1 \
                and isinstance(above.slice[0].slice, cst.Index) \
                and isinstance(above.slice[0].slice.value, cst.Integer) and above.slice[0].slice.value.value == "0":
            return above, "first"
        if isinstance(above, cst.Attribute) and above.value is call and above.attr.value == field:
            return above, "first"
        if isinstance(above, cst.Assign) and above.value is call and len(above.targets) == 1:
            target = above.targets[0].target
            if isinstance(target, (cst.Tuple, cst.List)) and len(target.elements) == 2 \
                    and all(isinstance(e, cst.Element) and isinstance(e.value, cst.Name) for e in target.elements) \
                    and target.elements[1].value.value == "_":
                return above, "assign"
        return None

    def leave_Call(self, original: cst.Call, updated: cst.Call):
        entry = self._uses_of(original.func)
        if entry is None:
            return None
        new = self._fix(entry, original, updated)
        if new is None:
            self.report(original.func, self._describe(entry), review=True)
            return None
        self.report(original.func, f"`{entry.name}` → `{entry.replacement}`" if self.fixing
                    else f"{self._describe(entry)}; `--to device` fixes it")
        if self.fixing and entry.name in ("torch.lstsq", "torch.gels"):
            self.report(original.func, "the least-squares solution now has n rows (A's columns) where "
                        f"`{entry.name}`'s had max(m, n), the rows below n holding residuals: check code that "
                        "reads those rows", review=True)
        return new if self.fixing else None

    def _fix(self, entry: Deprecation, original: cst.Call, updated: cst.Call) -> Optional[cst.BaseExpression]:
        if not _plain(original):
            return None
        name = entry.name
        if name in _UPPER_DEFAULT:  # potrf/potrs/potri: upper=True by default, their successors' False
            return self._upper_fix(name, original, updated)
        if name in ("torch.btrifact", "torch.btrifact_with_info", "torch.btriunpack"):
            pivot = get_arg(original, "pivot", 1) if name != "torch.btriunpack" else None
            if name != "torch.btriunpack" and (len(original.args) != 1 + (pivot is not None)
                                               or pivot is not None and literal_bool(pivot.value) is not True):
                return None
            args = updated.args if pivot is None else [updated.args[0].with_changes(comma=cst.MaybeSentinel.DEFAULT)]
            return with_args(updated.with_changes(func=_spell(self, entry.replacement, original.func) if self.fixing
                                                  else updated.func), args)
        if name == "torch.trtrs":
            return self._trtrs_fix(original, updated)
        if name in ("torch.solve", "torch.gesv"):
            return self._solution_of(original, updated, "torch.linalg.solve")
        if name == "torch.symeig":
            vectors = get_arg(original, "eigenvectors", 1)
            upper = get_arg(original, "upper", 2)
            if len(original.args) != 1 + (vectors is not None) + (upper is not None):
                return None
            want_vectors = False if vectors is None else literal_bool(vectors.value)
            is_upper = True if upper is None else literal_bool(upper.value)
            if want_vectors is None or is_upper is None:
                return None
            if not want_vectors:  # the second result is an empty tensor: only the first may be read
                where = self._first_only(original, "eigenvalues")
                if where is None:
                    return None
                self.replace[id(where[0])] = where[1]
            func = "torch.linalg.eigh" if want_vectors else "torch.linalg.eigvalsh"
            uplo = keyword_arg("UPLO", cst.SimpleString('"U"' if is_upper else '"L"'))
            first = updated.args[0].with_changes(comma=cst.MaybeSentinel.DEFAULT)
            return with_args(updated.with_changes(func=_spell(self, func, original.func) if self.fixing
                                                  else updated.func),
                             [first, uplo])
        if name == "torch.matrix_rank":
            # the default tolerance is the same (σ_max · max(m, n) · eps); `tol=` is not
            if len(original.args) != 1 or original.args[0].keyword is not None:
                return None
            return updated.with_changes(func=_spell(self, "torch.linalg.matrix_rank", original.func) if self.fixing
                                        else updated.func)
        if name in ("torch.lstsq", "torch.gels"):
            # the solution alone: the QR factors have no counterpart (linalg.lstsq does not return them)
            call = self._solution_of(original, updated, "torch.linalg.lstsq")
            return None if call is None else cst.Attribute(value=call, attr=cst.Name("solution"))
        if name == "torch.eig":
            # eigenvalues alone: eig gave them as (n, 2) rows of (real, imaginary), view_as_real's
            # layout, in LAPACK's order as linalg.eigvals; its real packed eigenvectors are not kept
            vectors = get_arg(original, "eigenvectors", 1)
            if len(original.args) != 1 + (vectors is not None) or original.args[0].keyword is not None:
                return None
            where = self._first_only(original, "eigenvalues")
            if where is None:
                return None
            self.replace[id(where[0])] = where[1]
            if not self.fixing:
                return updated
            first = updated.args[0].with_changes(comma=cst.MaybeSentinel.DEFAULT)
            values = with_args(updated.with_changes(func=_spell(self, "torch.linalg.eigvals", original.func)), [first])
            return cst.Call(func=_spell(self, "torch.view_as_real", original.func), args=[cst.Arg(values)])
        return None  # torch.eig's eigenvectors (real packed pairs), an lstsq's QR, ...: review

    def _solution_of(self, original: cst.Call, updated: cst.Call, new_name: str) -> Optional[cst.Call]:
        """`old(B, A)` whose solution alone is read (`[0]`, `.solution`, `x, _ = ...`) →
        `new_name(A, B)`: the LAPACK-era argument order reversed."""
        if len(original.args) != 2 or any(a.keyword for a in original.args):
            return None
        where = self._first_only(original, "solution")
        if where is None:
            return None
        self.replace[id(where[0])] = where[1]
        b, a = updated.args
        return updated.with_changes(func=_spell(self, new_name, original.func) if self.fixing else updated.func,
                                    args=[a.with_changes(comma=b.comma), b.with_changes(comma=a.comma)])

    def _upper_fix(self, name: str, original: cst.Call, updated: cst.Call) -> Optional[cst.BaseExpression]:
        """potrf(A, upper) → linalg.cholesky(A)[.mH]; potrs(b, u, upper), potri(u, upper) → their
        successors with `upper` spelled out (the defaults differ)."""
        position, new_name = _UPPER_DEFAULT[name]
        upper = get_arg(original, "upper", position)
        if len(original.args) != position + (upper is not None) or any(a.keyword for a in original.args[:position]):
            return None
        is_upper = True if upper is None else literal_bool(upper.value)
        if is_upper is None:
            return None
        if not self.fixing:
            return updated
        kept = [a.with_changes(comma=cst.MaybeSentinel.DEFAULT) if i == position - 1 else a
                for i, a in enumerate(updated.args[:position])]
        if name != "torch.potrf":
            kept.append(keyword_arg("upper", cst.Name(str(is_upper))))
        call = with_args(updated.with_changes(func=_spell(self, new_name, original.func)), kept)
        return cst.Attribute(value=call, attr=cst.Name("mH")) if name == "torch.potrf" and is_upper else call

    def _trtrs_fix(self, original: cst.Call, updated: cst.Call) -> Optional[cst.BaseExpression]:
        """trtrs(b, A, upper=True, transpose=False, unitriangular=False)[0] →
        linalg.solve_triangular(A, b, upper=...): the solution alone, no transpose."""
        flags = [get_arg(original, key, i) for i, key in enumerate(("upper", "transpose", "unitriangular"), 2)]
        if len(original.args) != 2 + sum(f is not None for f in flags) or any(a.keyword for a in original.args[:2]):
            return None
        upper, transpose, unit = (default if f is None else literal_bool(f.value)
                                  for f, default in zip(flags, (True, False, False)))
        if upper is None or transpose is not False or unit is None:
            return None
        where = self._first_only(original, "solution")
        if where is None:
            return None
        self.replace[id(where[0])] = where[1]
        if not self.fixing:
            return updated
        b, a = (arg.with_changes(comma=cst.MaybeSentinel.DEFAULT) for arg in updated.args[:2])
        args = [a, b, keyword_arg("upper", cst.Name(str(upper)))]
        if unit:
            args.append(keyword_arg("unitriangular", cst.Name("True")))
        return cst.Call(func=_spell(self, "torch.linalg.solve_triangular", original.func),
                        args=[arg.with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
                              for arg in args[:-1]] + [args[-1]])

    def _collapse(self, original: cst.CSTNode, updated: cst.CSTNode):
        how = self.replace.get(id(original)) if self.fixing else None
        if how == "first":
            return updated.value
        if how == "assign":
            first = updated.targets[0].target.elements[0].value
            return updated.with_changes(targets=[updated.targets[0].with_changes(target=first)])
        return None

    def leave_Subscript(self, original: cst.Subscript, updated: cst.Subscript):
        return self._collapse(original, updated)

    def leave_Attribute(self, original: cst.Attribute, updated: cst.Attribute):
        return self._collapse(original, updated)

    def leave_Assign(self, original: cst.Assign, updated: cst.Assign):
        return self._collapse(original, updated)

    def visit_Attribute(self, node: cst.Attribute) -> None:
        self._not_called(node)

    def visit_Name(self, node: cst.Name) -> None:
        self._not_called(node)

    def _not_called(self, node: cst.BaseExpression) -> None:
        """A use that is not a call (`f = torch.solve`, `torch._six.inf`): reported for review."""
        if not self._may_name(node):
            return
        above = self._parent(node)
        if isinstance(above, cst.Call) and above.func is node or isinstance(above, cst.Attribute) and above.attr is node:
            return
        entry = self._uses_of(node)
        if entry is not None:
            self.report(node, self._describe(entry), review=True)


# old name -> (new name, device, the old positional parameters that must become keywords)
_AMP_MOVES: Dict[str, Tuple[str, str, Optional[Tuple[str, ...]]]] = {
    "torch.cpu.amp.autocast": ("torch.amp.autocast", "cpu", ("enabled", "dtype", "cache_enabled")),
    "torch.cpu.amp.GradScaler": ("torch.amp.GradScaler", "cpu", None),
    "torch.cuda.amp.custom_fwd": ("torch.amp.custom_fwd", "cuda", ("fwd",)),
    "torch.cuda.amp.custom_bwd": ("torch.amp.custom_bwd", "cuda", ("bwd",)),
}
_PYTREE_KEYWORDS = frozenset({"serialized_type_name", "to_dumpable_context", "from_dumpable_context"})


def _pytree_call(call: cst.Call) -> bool:
    """The same for three arguments and the keywords both take (to_str_fn/maybe_from_str_fn are gone)."""
    keywords = {a.keyword.value for a in call.args if a.keyword is not None}
    return _plain(call) and sum(a.keyword is None for a in call.args) <= 3 and not keywords - _PYTREE_KEYWORDS


# symbols whose replacement takes the call's arguments as they are when the test holds
_DROP_IN_CALLS = {"torch.utils._pytree._register_pytree_node": _pytree_call}


class DeprecatedFunction(_TableRule):
    """
    ## What it does
    Finds uses of deprecated torch functions and classes (`torch.qr`, `torch.chain_matmul`,
    `torch.cholesky`, `torch.ger`, `functorch.vmap`, `torch.nn.UpsamplingNearest2d`,
    `torch.backends.cuda.sdp_kernel`, ...; the table of `gpumigrate/codemods/deprecations.py`)
    and the lines that import them. TorchFix calls these TOR101 and TOR103.

    ## Why is this bad?
    They warn (some on every call) and are removed one release at a time: `torch.solve` and
    `torch.symeig` went this way. The replacements differ in small ways the message names.

    ## Example
    ```python
    q, r = torch.qr(A)
    y = torch.chain_matmul(a, b, c)
    g = functorch.vmap(f)
    ```

    ## Use instead
    ```python
    q, r = torch.linalg.qr(A)
    y = torch.linalg.multi_dot([a, b, c])
    g = torch.func.vmap(f)
    ```
    `--to device` fixes the drop-in replacements (same arguments), `torch.chain_matmul`,
    `torch.qr` with a literal `some`, `torch.cholesky` with a literal `upper`, and `from
    functorch import vmap` lines; the rest is reported with what changes. `torch.cuda.amp`
    is GM503's, and the renames of GM208 (`clip_grad_norm`, `nn.init.xavier_uniform`,
    `F.upsample`) are that rule's.
    """

    code = "GM212"
    name = "deprecated-function"
    message = "deprecated torch function"
    done = "deprecated torch function → its replacement"
    fixed_in = frozenset({"device"})
    torchfix = ("TOR101", "TOR103")
    entries = DEPRECATED
    last_names = frozenset(name.rsplit(".", 1)[1] for name in DEPRECATED)
    kind = "deprecated"
    _parts = _parts(DEPRECATED)

    examples = (
        Flagged("import torch\nq, r = torch.qr(A)\n", fixed="import torch\nq, r = torch.linalg.qr(A)\n"),
        Flagged("import torch\nq, r = torch.qr(A, some=False)\n",
                fixed="import torch\nq, r = torch.linalg.qr(A, mode=\"complete\")\n"),
        Flagged("import torch\ny = torch.chain_matmul(a)\n"),  # multi_dot wants two at least
        Flagged("import torch\ny = torch.chain_matmul(a, b, c)\n",
                fixed="import torch\ny = torch.linalg.multi_dot([a, b, c])\n"),
        Flagged("import torch\nu = torch.cholesky(A, upper=True)\n",
                fixed="import torch\nu = torch.linalg.cholesky(A).mH\n"),
        Flagged("import torch\no = torch.ger(a, b)\n", fixed="import torch\no = torch.outer(a, b)\n"),
        Flagged("import functorch\ng = functorch.vmap(f, (None, 0))\n",
                fixed="import functorch\nimport torch\n\ng = torch.func.vmap(f, (None, 0))\n"),
        Flagged("from functorch import vmap, jacrev\ng = vmap(jacrev(f))\n",
                fixed="from torch.func import vmap, jacrev\ng = vmap(jacrev(f))\n"),
        Flagged("import torch\nn = torch.nn.init.eye(w)\n", fixed="import torch\nn = torch.nn.init.eye_(w)\n"),
        Flagged("from torch import ger\no = ger(a, b)\nf = ger\n", fixed="from torch import outer\no = outer(a, b)\nf = outer\n"),
        Flagged("import torch as foo\ny = foo.chain_matmul(a, b, out=o)\n",
                fixed="import torch as foo\ny = foo.linalg.multi_dot([a, b], out=o)\n"),
        Flagged("import torch\nwith torch.backends.cuda.sdp_kernel(enable_math=False):\n    pass\n"),
        Flagged("from torch import qr as old_qr\nq, r = old_qr(A)\n",
                fixed="from torch import qr as old_qr\nimport torch\n\nq, r = torch.linalg.qr(A)\n"),
        Flagged("import torch\nm = torch.nn.UpsamplingNearest2d(scale_factor=2)\n"),
        Flagged("import torch\nwith torch.cpu.amp.autocast(True, torch.bfloat16):\n    pass\n",
                fixed='import torch\nwith torch.amp.autocast("cpu", enabled=True, dtype=torch.bfloat16):\n    pass\n'),
        Flagged("import torch\ns = torch.cpu.amp.GradScaler(2.0 ** 10)\n",
                fixed='import torch\ns = torch.amp.GradScaler("cpu", 2.0 ** 10)\n'),
        Flagged("import torch\n@torch.cuda.amp.custom_fwd\ndef f(ctx, x):\n    return x\n",
                fixed='import torch\n@torch.amp.custom_fwd(device_type="cuda")\ndef f(ctx, x):\n    return x\n'),
        Flagged("import torch\n@torch.cuda.amp.custom_fwd(cast_inputs=torch.float32)\ndef f(ctx, x):\n    return x\n",
                fixed='import torch\n@torch.amp.custom_fwd(cast_inputs=torch.float32, device_type="cuda")\n'
                      'def f(ctx, x):\n    return x\n'),
        Flagged("import torch.utils._pytree as pytree\npytree._register_pytree_node(C, flat, unflat)\n",
                fixed="import torch.utils._pytree as pytree\npytree.register_pytree_node(C, flat, unflat)\n"),
        Flagged("import torch.utils._pytree as pytree\npytree._register_pytree_node(C, flat, unflat, to_str)\n"),
        Flagged("from torch.utils._pytree import _register_pytree_node\n_register_pytree_node(C, flat, unflat)\n",
                fixed="from torch.utils._pytree import register_pytree_node\nregister_pytree_node(C, flat, unflat)\n"),
        Clean("import torch\nq, r = torch.linalg.qr(A)\ny = torch.linalg.multi_dot([a, b])\n"),
        Clean("import torch\nwith torch.cuda.amp.autocast():\n    pass\n"),  # GM503's
        Clean("import torch\ntorch.nn.utils.clip_grad_norm(ps, 1.0)\n"),  # GM208's
    )

    def visit_Module(self, node: cst.Module) -> None:
        # local names whose from-import line is fixed -> the name they take (`ger` -> `outer`)
        self.rewritten_imports: Dict[str, str] = {}
        self.pending: Dict[int, object] = {}  # id of a name not called -> its fix

    def _import_fix(self, node: cst.ImportFrom) -> Optional[str]:
        """The module every name of `from M import a, b` moves to, when each has a drop-in
        there (`from functorch import vmap` → `from torch.func import vmap`)."""
        module = cst.Module([]).code_for_node(node.module) if node.module is not None else ""
        targets = set()
        for alias in node.names:
            entry = self.entries.get(f"{module}.{cst.Module([]).code_for_node(alias.name)}")
            if entry is None or "." not in entry.replacement or not (
                    entry.drop_in or entry.name in _DROP_IN_CALLS and self._every_call_fixable(alias, entry)):
                return None
            targets.add(entry.replacement.rsplit(".", 1)[0])
        return targets.pop() if len(targets) == 1 else None

    def _every_call_fixable(self, alias: cst.ImportAlias, entry: Deprecation) -> bool:
        """Every use of the name `alias` binds is a call the replacement takes as it is
        (`_register_pytree_node(C, f, g)`): then the import line itself can change."""
        local = alias.asname.name if alias.asname is not None else alias.name
        if not isinstance(local, cst.Name):
            return False
        parent = self.ctx.index.parent
        for name in self.ctx.index.of(cst.Name):
            if name.value != local.value or name is local or name is alias.name:
                continue
            call = parent.get(id(name))
            if isinstance(call, cst.Attribute) and call.attr is name or isinstance(call, cst.ImportAlias):
                continue  # `xx._register_pytree_node`: another name; an import line
            if not (isinstance(call, cst.Call) and call.func is name and _DROP_IN_CALLS[entry.name](call)):
                return False
        return True

    def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
        self.fix_to = None
        if not isinstance(node.names, cst.ImportStar) and not node.relative:
            self.fix_to = self._import_fix(node)
            if self.fix_to is not None:
                for alias in node.names:
                    local = alias.asname.name if alias.asname is not None else alias.name
                    new = self._renamed_alias(node, alias)
                    if isinstance(local, cst.Name):
                        self.rewritten_imports[local.value] = local.value if alias.asname is not None else new
        super().visit_ImportFrom(node)

    def _import_line(self, node: cst.ImportFrom, alias: cst.ImportAlias, entry: Deprecation) -> None:
        if self.fix_to is not None:
            self.report(alias, f"import of `{entry.name}` → `{entry.replacement}`" if self.fixing
                        else f"import of {self._describe(entry)}; `--to device` fixes it", torchfix=self.torchfix[1])
        else:
            super()._import_line(node, alias, entry)

    def leave_ImportFrom(self, original: cst.ImportFrom, updated: cst.ImportFrom):
        if not self.fixing or isinstance(original.names, cst.ImportStar) or original.relative:
            return None
        to = self._import_fix(original)
        if to is None:
            return None
        names = [alias.with_changes(name=cst.Name(self._renamed_alias(original, old)))
                 for old, alias in zip(original.names, updated.names)]
        return updated.with_changes(module=cst.parse_expression(to), names=names)

    def _renamed_alias(self, node: cst.ImportFrom, alias: cst.ImportAlias) -> str:
        module = cst.Module([]).code_for_node(node.module) if node.module is not None else ""
        entry = self.entries[f"{module}.{cst.Module([]).code_for_node(alias.name)}"]
        return entry.replacement.rsplit(".", 1)[1]

    def _fix(self, entry: Deprecation, original: cst.Call, updated: cst.Call, node: cst.BaseExpression):
        """The fixed call (or name, `call` None), or None: report for review."""
        name = entry.name
        if isinstance(node, cst.Name) and node.value in self.rewritten_imports:
            new = self.rewritten_imports[node.value]  # the import line is fixed: the name stays or follows it
            return "import" if new == node.value else cst.Name(new)
        if entry.drop_in:
            return "name"
        if original is None and name in _AMP_MOVES and name.endswith(("custom_fwd", "custom_bwd")) \
                and isinstance(self.ctx.index.parent.get(id(node)), cst.Decorator):
            return self._amp(name, None, None) if self.fixing else "name"  # `@torch.cuda.amp.custom_fwd`
        if original is None or not _plain(original):
            return None
        if name == "torch.chain_matmul":
            keywords = [a for a in updated.args if a.keyword is not None]
            matrices = [a for a in updated.args if a.keyword is None]
            if len(matrices) < 2 or any(a.keyword.value != "out" for a in keywords):
                return None  # `out=` is multi_dot's too; it wants two matrices at least
            items = [cst.Element(a.value) for a in matrices]
            return with_args(updated.with_changes(func=self._new(original, "torch.linalg.multi_dot")),
                             [cst.Arg(cst.List(items)), *keywords])
        if name == "torch.qr":
            some = get_arg(original, "some", 1)
            if len(original.args) != 1 + (some is not None):
                return None
            mode = True if some is None else literal_bool(some.value)
            if mode is None:
                return None
            args = [updated.args[0].with_changes(comma=cst.MaybeSentinel.DEFAULT)]
            if not mode:
                args.append(keyword_arg("mode", cst.SimpleString('"complete"')))
            return with_args(updated.with_changes(func=self._new(original, "torch.linalg.qr")), args)
        if name == "torch.cholesky":
            upper = get_arg(original, "upper", 1)
            if len(original.args) != 1 + (upper is not None):
                return None
            is_upper = False if upper is None else literal_bool(upper.value)
            if is_upper is None:
                return None
            call = with_args(updated.with_changes(func=self._new(original, "torch.linalg.cholesky")),
                             [updated.args[0].with_changes(comma=cst.MaybeSentinel.DEFAULT)])
            return cst.Attribute(call, cst.Name("mH")) if is_upper else call
        if name in _AMP_MOVES:
            return self._amp(name, original, updated)
        if name in _DROP_IN_CALLS:
            return updated.with_changes(func=self._new(original, entry.replacement)) \
                if _DROP_IN_CALLS[name](original) else None
        return None

    def _amp(self, name: str, original: Optional[cst.Call], updated: Optional[cst.Call]) -> Optional[cst.BaseExpression]:
        """`torch.cpu.amp.autocast(True)` → `torch.amp.autocast("cpu", enabled=True)` (the old
        positionals are keyworded: the new second is `dtype`), `torch.cpu.amp.GradScaler(...)`
        → `torch.amp.GradScaler("cpu", ...)` (the same order after the device),
        `torch.cuda.amp.custom_fwd(...)` → `torch.amp.custom_fwd(..., device_type="cuda")`."""
        new, device, positional = _AMP_MOVES[name]
        func = self._new(original, new)
        old = list(updated.args) if updated is not None else []
        given = [a for a in old if a.keyword is None]
        if len(given) > len(positional) if positional is not None else False:
            return None
        device_arg = cst.Arg(cst.SimpleString(f'"{device}"'))
        if name.endswith(("custom_fwd", "custom_bwd")):
            args = [*old, keyword_arg("device_type", device_arg.value)]
        elif positional is None:  # GradScaler: every argument keeps its place after the device
            args = [device_arg, *old]
        else:
            named = [keyword_arg(p, a.value) for p, a in zip(positional, given)]
            args = [device_arg, *named, *(a for a in old if a.keyword is not None)]
        call = cst.Call(func=func) if updated is None else updated.with_changes(func=func)
        return with_args(call, args)

    def _new(self, original: Optional[cst.Call], qualified: str) -> cst.BaseExpression:
        return _spell(self, qualified, original.func if original is not None else None) if self.fixing \
            else cst.Name("_")

    def _handle(self, node: cst.BaseExpression, call: Optional[cst.Call], updated: Optional[cst.Call]):
        entry = self._uses_of(node)
        if entry is None:
            return None
        how = self._fix(entry, call, updated, node)
        if how is None:
            self.report(node, self._describe(entry), review=True)
            return None
        self.report(node, f"`{entry.name}` → `{entry.replacement}`" if self.fixing
                    else f"{self._describe(entry)}; `--to device` fixes it")
        if not self.fixing or how == "import":
            return None
        return how

    def leave_Call(self, original: cst.Call, updated: cst.Call):
        how = self._handle(original.func, original, updated)
        if how is None:
            return None
        if how == "name":
            return updated.with_changes(func=_spell(self, self.entries[self.qualify(original.func)].replacement,
                                                    original.func))
        if isinstance(how, cst.Name):
            return updated.with_changes(func=how)
        return how

    def visit_Attribute(self, node: cst.Attribute) -> None:
        self._not_called(node)

    def visit_Name(self, node: cst.Name) -> None:
        self._not_called(node)

    def _not_called(self, node: cst.BaseExpression) -> None:
        if not self._may_name(node):
            return
        above = self.ctx.index.parent.get(id(node))
        if isinstance(above, cst.Call) and above.func is node or isinstance(above, cst.Attribute) and above.attr is node:
            return
        entry = self._uses_of(node)
        if entry is None:
            return
        how = self._handle(node, None, None)
        if how == "name":
            self.pending[id(node)] = entry.replacement
        elif isinstance(how, cst.BaseExpression):
            self.pending[id(node)] = how

    def leave_Name(self, original: cst.Name, updated: cst.Name):
        return self._renamed(original)

    def leave_Attribute(self, original: cst.Attribute, updated: cst.Attribute):
        return self._renamed(original)

    def _renamed(self, original: cst.BaseExpression):
        new = self.pending.get(id(original)) if self.pending else None
        if isinstance(new, cst.BaseExpression):
            return new
        return _spell(self, new, original) if new and self.fixing else None
