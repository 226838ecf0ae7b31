"""Small shared pieces for rules that write code: node builders, statement removal, the names
the rewritten script uses for runtime helpers. (Reading helpers: analysis/syntax.py.)"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import libcst as cst

from gpumigrate.analysis.syntax import (  # noqa: F401  (re-exported: rules read and write code)
    device_kind,
    enclosing,
    findall,
    get_arg,
    is_method_call,
    last_name,
    literal_bool,
    literal_int,
    literal_str,
    loop_index,
    moves_to,
    name_assigns,
    positional_args,
    runtime_helper,
    same_code,
    statements,
    walk,
)
from gpumigrate.rewriter.vendor import RUNTIME_PACKAGE, VENDORED_MODULE


def with_args(call: cst.Call, args: Sequence[cst.Arg]) -> cst.Call:
    """Replace a call's arguments, fixing up the commas between them."""
    fixed = []
    for i, arg in enumerate(args):
        last = i == len(args) - 1
        if last:
            # Keep a trailing comma only if the original call had one on its last argument.
            had_trailing = bool(call.args) and call.args[-1].comma is not cst.MaybeSentinel.DEFAULT
            if not had_trailing:
                arg = arg.with_changes(comma=cst.MaybeSentinel.DEFAULT)
            elif arg.comma is cst.MaybeSentinel.DEFAULT:
                arg = arg.with_changes(comma=call.args[-1].comma)
        elif arg.comma is cst.MaybeSentinel.DEFAULT:
            arg = arg.with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
        fixed.append(arg)
    return call.with_changes(args=fixed)


def keyword_arg(name: str, value: cst.BaseExpression) -> cst.Arg:
    return cst.Arg(
        value=value,
        keyword=cst.Name(name),
        equal=cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")),
    )


def call_method(receiver: cst.BaseExpression, method: str, args: Sequence[cst.Arg] = ()) -> cst.Call:
    if isinstance(receiver, (cst.BinaryOperation, cst.UnaryOperation, cst.BooleanOperation,
                             cst.Comparison, cst.IfExp, cst.Lambda, cst.Await)) and not receiver.lpar:
        receiver = receiver.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
    return cst.Call(func=cst.Attribute(value=receiver, attr=cst.Name(method)), args=list(args))


def remove_statement(ctx, line: cst.SimpleStatementLine):
    """Drop a statement line, keeping the blank lines and comments above it; a line that
    carries a trailing comment keeps it on a `pass`."""
    if line.trailing_whitespace.comment is not None:
        return line.with_changes(body=[cst.Pass()])
    return ctx.remove_statement(line)


def runtime_module(ctx) -> str:
    """The module the rewritten script imports the runtime from: the one the options name
    (`--vendor-runtime` passes the vendored copy's), else the one the script imports already
    (a vendored script stays vendored when migrated again), else the package."""
    chosen = ctx.options.get("runtime_module")
    if chosen:
        return chosen
    return ctx.shared("runtime-module", lambda c: next(
        (VENDORED_MODULE for q in c.names.local.values() if q.split(".")[0] == VENDORED_MODULE), RUNTIME_PACKAGE))


def runtime_name(ctx, name: str, fixing: bool = True) -> cst.Name:
    """How the rewritten script calls the runtime's `name`, importing it when `fixing`.
    A script that defines a `wrap_model` of its own gets ours as `gm_wrap_model`, so neither
    shadows the other."""
    for local, qualified in ctx.names.local.items():
        if runtime_helper(qualified) == name:
            return cst.Name(local)  # imported already (a second run), from either runtime module
    taken = ctx.shared("identifiers", _identifiers, tree=True)
    local = name
    if name in taken:
        local = fresh_name(ctx, f"gm_{name}")
    if fixing:
        ctx.add_import(runtime_module(ctx), name, local if local != name else None)
    return cst.Name(local)


def torch_name(ctx, attr: str, fixing: bool = True) -> cst.BaseExpression:
    """How the script names `torch.<attr>`: its own import of it, else `torch.<attr>` (with
    `import torch` added when `fixing`)."""
    local = ctx.names.local_name_for(f"torch.{attr}")
    if local is None:
        if fixing:
            ctx.add_import("torch")
        local = f"torch.{attr}"
    return cst.parse_expression(local)


def fresh_name(ctx, base: str) -> str:
    """`base`, or `base2`, `base3`... whichever the script does not use anywhere."""
    taken = ctx.shared("identifiers", _identifiers, tree=True)
    reserved = ctx.shared("fresh-names", lambda c: {})
    if base in reserved:
        return reserved[base]
    name, n = base, 1
    while name in taken or name in reserved.values():
        n += 1
        name = f"{base}{n}"
    reserved[base] = name
    return name


def _identifiers(ctx) -> set:
    from gpumigrate.analysis import script_model  # analysis builds on the engine, as helpers do

    return script_model(ctx).s.identifiers()


def defined_in(ctx, func: cst.BaseExpression) -> Tuple[Optional[Any], str]:
    """The project module (a Link) that defines what `func` names, and its name there:
    `generate` of `from generate import generate` or `import *`, `AliasMethod` of
    `from .alias_multinomial import AliasMethod`, `utils.get_loader`. (None, "") if none."""
    qualified = ctx.names.qualify(func) or ""
    module, _, name = qualified.rpartition(".")
    if module:
        return project_module(ctx, module), name
    if not isinstance(func, cst.Name):
        return None, ""
    for stmt in ctx.module.body:  # a relative import, which names do not qualify
        for small in stmt.body if isinstance(stmt, cst.SimpleStatementLine) else ():
            if isinstance(small, cst.ImportFrom) and small.relative and not isinstance(small.names, cst.ImportStar):
                for alias in small.names:
                    if (alias.asname.name.value if alias.asname else alias.name.value) == func.value:
                        dotted = cst.Module(body=[]).code_for_node(small.module) if small.module else ""
                        return project_module(ctx, dotted), alias.name.value
    return _star_imported(ctx, func), func.value


def _star_imported(ctx, func: cst.BaseExpression) -> Optional[Any]:
    """`generate(...)` after `from generate import *`: the project module that defines it, if
    this file does not."""
    if not isinstance(func, cst.Name):
        return None
    from gpumigrate.analysis import script_model

    s = script_model(ctx).s
    if s.lookup(func.value, s.scope(func))[1]:
        return None  # defined (or imported by name) here
    return next((link for link in getattr(ctx.options.get("project"), "imports", ()) if func.value in link.defines),
                None)


def project_module(ctx, module: str) -> Optional[Any]:
    """The project module (rewriter/project.py's Link) a dotted module name imports, if any
    (`.alias` of a relative import: by its last parts)."""
    module = module.lstrip(".")
    for link in getattr(ctx.options.get("project"), "imports", ()):
        stem = link.path[:-3] if link.path.endswith(".py") else link.path
        parts = stem.replace("\\", "/").split("/")
        if parts[-1] == "__init__":
            parts = parts[:-1]
        full = ".".join(parts)
        if full == module or full.endswith("." + module):
            return link
    return None
