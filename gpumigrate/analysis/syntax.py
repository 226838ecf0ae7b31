"""Reading LibCST code: arguments by keyword or position, literals, walks, and the few
facts about device moves that rules share. Nothing here edits a tree.
"""

from __future__ import annotations

from typing import Iterator, Optional, Sequence

import libcst as cst

from gpumigrate.rewriter.engine import CURRENT
from gpumigrate.rewriter.lazy import matchers as m
from gpumigrate.rewriter.vendor import RUNTIME_PACKAGE, VENDORED_MODULE

# Where a rewritten script imports the runtime from: the package, or the one-module copy that
# `--vendor-runtime` writes next to it. Both are the runtime, for every rule.
RUNTIME_MODULES = (RUNTIME_PACKAGE, VENDORED_MODULE)


def runtime_helper(qualified: Optional[str]) -> Optional[str]:
    """`get_rank` for `gpumigrate.runtime.get_rank`, `gpumigrate_runtime.get_rank` (vendored)
    or `gpumigrate.runtime.distributed.get_rank`; None for a name from anywhere else."""
    for module in RUNTIME_MODULES:
        if qualified and qualified.startswith(module + "."):
            return qualified.rsplit(".", 1)[-1]
    return None


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


def same_code(a: cst.CSTNode, b: cst.CSTNode) -> bool:
    """Equal up to whitespace and parentheses."""
    render = cst.Module(body=[]).code_for_node
    return "".join(render(a).split()).strip("()") == "".join(render(b).split()).strip("()")


def findall(root: cst.CSTNode, matcher) -> list:
    """`libcst.matchers.findall`, answered from the file's node index when it can be."""
    ctx = CURRENT.get()
    return ctx.find(root, matcher) if ctx is not None else m.findall(root, matcher)


def name_assigns(module: cst.Module) -> list:
    """`findall(module, m.Assign(targets=[m.AssignTarget(m.Name())]))`: assignments of one
    plain name, read from the node index (three rules ask, and the matcher is a tenth of a lint)."""
    ctx = CURRENT.get()
    if ctx is None or ctx.module is not module:
        return m.findall(module, m.Assign(targets=[m.AssignTarget(m.Name())]))
    return [a for a in ctx.index.of(cst.Assign) if len(a.targets) == 1 and type(a.targets[0].target) is cst.Name]


def last_name(node: cst.BaseExpression) -> Optional[str]:
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        return node.attr.value
    return None


def statements(node: cst.CSTNode) -> Iterator[cst.CSTNode]:
    """`node` and the statements (compound and small) and except handlers inside it, without
    entering nested functions and classes. No expressions: libcst's `.children` is costly."""
    if isinstance(node, (cst.Module, cst.BaseSuite)):
        for stmt in node.body:
            yield from statements(stmt)
        return
    yield node
    if isinstance(node, cst.SimpleStatementLine):
        yield from node.body
    if not isinstance(node, cst.BaseCompoundStatement) or isinstance(node, (cst.FunctionDef, cst.ClassDef)):
        return
    if isinstance(getattr(node, "body", None), cst.BaseSuite):
        yield from statements(node.body)
    for case in getattr(node, "cases", ()):
        yield from statements(case.body)
    orelse = getattr(node, "orelse", None)
    if orelse is not None:
        yield from statements(orelse if isinstance(orelse, cst.If) else orelse.body)
    for handler in getattr(node, "handlers", ()):
        yield handler
        yield from statements(handler.body)
    final = getattr(node, "finalbody", None)
    if final is not None:
        yield from statements(final.body)


def loop_index(ancestors, start: int = -1) -> Optional[int]:
    """Index in `ancestors` of the innermost `for`/`while` whose body holds `ancestors[start]`,
    within the same function; None outside loops."""
    for i in range(len(ancestors) + start - 1, -1, -1):
        node = ancestors[i]
        if isinstance(node, (cst.FunctionDef, cst.Lambda, cst.ClassDef)):
            return None
        if isinstance(node, (cst.For, cst.While)) and ancestors[i + 1] is node.body:
            return i
    return None


def device_kind(expr: cst.BaseExpression, qualify) -> Optional[str]:
    """'gpu', 'cpu' or None (not a device, or cannot tell) for the target of `.to(...)`."""
    text = literal_str(expr)
    if text is not None:
        return "cpu" if text.startswith("cpu") else "gpu" if text.startswith(("cuda", "mps", "xpu")) else None
    if isinstance(expr, cst.Integer):
        return "gpu"
    if isinstance(expr, cst.Call) and qualify(expr.func) == "torch.device" and expr.args:
        return device_kind(expr.args[0].value, qualify) or "gpu"
    name = last_name(expr)
    if name is None:
        return None
    lowered = name.lower()
    if "cpu" in lowered:
        return "cpu"
    return "gpu" if "device" in lowered or lowered in ("dev", "gpu") or lowered.startswith("cuda") else None


def _to_target(call: cst.Call) -> Optional[cst.BaseExpression]:
    arg = get_arg(call, "device", 0)
    return arg.value if arg is not None else None


def moves_to(call: cst.Call, qualify, kind: str) -> bool:
    """`.cuda()` / `.cpu()`, or `.to(<a device of this kind>)`; kind is "gpu" or "cpu"."""
    if is_method_call(call, "cuda" if kind == "gpu" else "cpu"):
        return True
    if is_method_call(call, "to"):
        target = _to_target(call)
        return target is not None and device_kind(target, qualify) == kind
    return False
