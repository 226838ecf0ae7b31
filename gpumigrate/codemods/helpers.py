"""Small shared pieces for rules: arguments by keyword or position, node builders."""

from __future__ import annotations

from typing import Iterator, Optional, Sequence

import libcst as cst
import libcst.matchers as m

from gpumigrate.rewriter.engine import CURRENT


def get_arg(call: cst.Call, keyword: str, position: Optional[int] = None) -> Optional[cst.Arg]:
    """The argument `keyword`, passed by name or (if `position` is given) positionally."""
    positional: Optional[int] = 0
    for arg in call.args:
        if arg.keyword is not None:
            if arg.keyword.value == keyword:
                return arg
        elif arg.star == "*":
            positional = None  # *args hides the positions after it
        elif arg.star == "**":
            continue
        elif positional is not None:
            if positional == position:
                return arg
            positional += 1
    return None


def positional_args(call: cst.Call) -> Sequence[cst.Arg]:
    return [a for a in call.args if a.keyword is None and not a.star]


def is_method_call(node: cst.CSTNode, *names: str) -> bool:
    """`<expr>.name(...)` for one of `names`."""
    return (
        isinstance(node, cst.Call)
        and isinstance(node.func, cst.Attribute)
        and node.func.attr.value in names
    )


def literal_int(node: Optional[cst.BaseExpression]) -> Optional[int]:
    if isinstance(node, cst.Integer):
        return int(node.evaluated_value)
    return None


def literal_str(node: Optional[cst.BaseExpression]) -> Optional[str]:
    if isinstance(node, cst.SimpleString):
        value = node.evaluated_value
        return value if isinstance(value, str) else None
    return None


def literal_bool(node: Optional[cst.BaseExpression]) -> Optional[bool]:
    if isinstance(node, cst.Name) and node.value in ("True", "False"):
        return node.value == "True"
    return None


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


def enclosing(ancestors: Sequence[cst.CSTNode], kind: type) -> Optional[cst.CSTNode]:
    for node in reversed(ancestors):
        if isinstance(node, kind):
            return node
    return None


def walk(node: cst.CSTNode) -> Iterator[cst.CSTNode]:
    """Every node under `node` (pre-order), without the cost of a visitor class."""
    stack = [node]
    while stack:
        current = stack.pop()
        yield current
        stack.extend(reversed(current.children))



def remove_statement(ctx, line: cst.SimpleStatementLine):
    """Drop a statement line, keeping the blank lines and comments above it; a line that
    carries a trailing comment keeps it on a `pass`."""
    if line.trailing_whitespace.comment is not None:
        return line.with_changes(body=[cst.Pass()])
    return ctx.remove_statement(line)


def same_code(a: cst.CSTNode, b: cst.CSTNode) -> bool:
    """Equal up to whitespace and parentheses."""
    render = cst.Module(body=[]).code_for_node
    return "".join(render(a).split()).strip("()") == "".join(render(b).split()).strip("()")


def findall(root: cst.CSTNode, matcher) -> list:
    """`libcst.matchers.findall`, answered from the file's node index when it can be."""
    ctx = CURRENT.get()
    return ctx.find(root, matcher) if ctx is not None else m.findall(root, matcher)
