"""What a script's own conditions hold under torchrun.

A script with its own distributed path (`if args.distributed:`, `if args.local_rank != -1:`,
`sampler = DistributedSampler(ds) if args.distributed else None`) takes it under torchrun
only if its conditions say so. Under torchrun several processes run, WORLD_SIZE (>= 2), RANK
and LOCAL_RANK (>= 0) are set, setup_distributed() has joined the process group, and the
command line is what the user typed: every argparse option has its default unless passed.
`Torchrun.truth(test)` evaluates a condition under those facts: True, False, or None
(unknown), following names and `args.x` attributes to what this file assigns them, argparse
options to their defaults, and parameters to what every call of this file passes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Dict, List, Optional, Set, Tuple

import libcst as cst

from gpumigrate.analysis.structure import Binding
from gpumigrate.analysis.syntax import get_arg, is_method_call, literal_int, literal_str, runtime_helper
from gpumigrate.analysis.values import call_argument

# argparse options a launcher answers, and the variable torchrun sets for each
LAUNCHER_OPTIONS = {"--local_rank": "LOCAL_RANK", "--local-rank": "LOCAL_RANK", "--world-size": "WORLD_SIZE",
                    "--world_size": "WORLD_SIZE", "--rank": "RANK"}
# the least value of each under torchrun with several processes
_LEAST = {"WORLD_SIZE": 2, "RANK": 0, "LOCAL_RANK": 0}
# the largest default that means "not launched" (-1, 0; one process): a `--rank` defaulting to 8
# is some other rank (a LoRA rank), not the process's
_NOT_LAUNCHED = {"WORLD_SIZE": 1, "RANK": 0}
_DISTRIBUTED_WORDS = ("init_process_group", "DistributedDataParallel", "DistributedSampler")
DISTRIBUTED_SAMPLERS = ("torch.utils.data.distributed.DistributedSampler", "torch.utils.data.DistributedSampler")


def signed_int(node: Optional[cst.BaseExpression]) -> Optional[int]:
    """`3`, `-1`."""
    if isinstance(node, cst.UnaryOperation) and isinstance(node.operator, cst.Minus):
        value = literal_int(node.expression)
        return -value if value is not None else None
    return literal_int(node)


def launcher_variable(call: cst.Call, code: str) -> Optional[str]:
    """The variable torchrun sets for this `add_argument(...)` option, where the option should
    default to it: `--local_rank`/`--local-rank` (torch.distributed.launch passed it, torchrun
    does not); `--world-size`/`--world_size`/`--rank` when their default is a literal that
    means "not launched" and the script (`code`) uses torch.distributed. None otherwise, and
    where the default reads the variable already."""
    if not is_method_call(call, "add_argument") or not call.args:
        return None
    variable = LAUNCHER_OPTIONS.get(literal_str(call.args[0].value) or "")
    if variable is None:
        return None
    default = get_arg(call, "default")
    if default is not None and any(isinstance(n, cst.SimpleString) and variable in n.value
                                   for n in _nodes(default.value)):
        return None
    if variable in _NOT_LAUNCHED:
        value = signed_int(default.value) if default is not None else None
        if value is None or value > _NOT_LAUNCHED[variable] or not any(w in code for w in _DISTRIBUTED_WORDS):
            return None
    return variable


def _nodes(node: cst.CSTNode) -> List[cst.CSTNode]:
    out, stack = [], [node]
    while stack:
        current = stack.pop()
        out.append(current)
        stack.extend(current.children)
    return out


@dataclass(frozen=True)
class _AtLeast:
    """An integer torchrun sets: at least `least`, not known exactly."""

    least: int


_UNKNOWN = object()
_ENVIRON = object()  # os.environ itself
_COMPARE = {cst.Equal: lambda a, b: a == b, cst.NotEqual: lambda a, b: a != b, cst.LessThan: lambda a, b: a < b,
            cst.LessThanEqual: lambda a, b: a <= b, cst.GreaterThan: lambda a, b: a > b,
            cst.GreaterThanEqual: lambda a, b: a >= b, cst.Is: lambda a, b: a is b, cst.IsNot: lambda a, b: a is not b}


class Torchrun:
    """The script's conditions under torchrun (see the module docstring). `env_defaults`: the
    launcher options `launcher_variable` names get torchrun's values (the migration gives
    them those defaults)."""

    def __init__(self, model: Any, env_defaults: bool) -> None:
        self.s = model.s
        self.qualify = model.qualify
        self.code = model.ctx.text
        self.env_defaults = env_defaults
        self._busy: Set[Any] = set()
        self._unmet: Dict[int, Optional[Tuple[cst.BaseExpression, bool]]] = {}

    # -- what the script reads ----------------------------------------------------------
    @cached_property
    def options(self) -> Dict[str, Optional[cst.Call]]:
        """argparse dest -> its `add_argument` call (None where two options share a dest)."""
        out: Dict[str, Optional[cst.Call]] = {}
        for call in self.s.index.of(cst.Call):
            if not is_method_call(call, "add_argument"):
                continue
            names = [literal_str(a.value) for a in call.args if a.keyword is None]
            if not names or any(n is None or not n.startswith("-") for n in names):
                continue
            dest = literal_str(get_arg(call, "dest").value) if get_arg(call, "dest") else None
            if dest is None:
                long = [n for n in names if n.startswith("--")]
                dest = (long or names)[0].lstrip("-").replace("-", "_")
            out[dest] = None if dest in out else call
        return out

    @cached_property
    def _attribute_assigns(self) -> Dict[str, List[cst.CSTNode]]:
        """attr -> the assignments that set `<name>.attr` (`args.distributed = ...`); None for
        one that is not followed (`+=`, tuple targets)."""
        out: Dict[str, List[cst.CSTNode]] = {}
        for node in self.s.index.of(cst.AssignTarget):
            target = node.target
            if isinstance(target, cst.Attribute) and isinstance(target.value, cst.Name):
                out.setdefault(target.attr.value, []).append(self.s.parent(node))
            for element in getattr(target, "elements", ()):  # `args.a, args.b = ...`: not followed
                if isinstance(element.value, cst.Attribute):
                    out.setdefault(element.value.attr.value, []).append(None)
        for node in self.s.index.of(cst.AugAssign):
            if isinstance(node.target, cst.Attribute):
                out.setdefault(node.target.attr.value, []).append(None)
        return out

    @cached_property
    def _namespace_rewritten(self) -> bool:
        """Options set from elsewhere (a config file): their defaults prove nothing."""
        return any(w in self.code for w in ("setattr(", "__dict__", "set_defaults(", "vars(args).update"))

    # -- conditions ---------------------------------------------------------------------
    def truth(self, test: cst.BaseExpression) -> Optional[bool]:
        return _truth(self._value(test, 0))

    def is_world_size(self, expr: cst.BaseExpression) -> bool:
        """Is `expr` the number of processes under torchrun (WORLD_SIZE, `get_world_size()`)?"""
        return self._value(expr, 0) == _AtLeast(_LEAST["WORLD_SIZE"])

    def is_none(self, expr: cst.BaseExpression) -> bool:
        """Is `expr` None under torchrun (`args.gpu` of a `--gpu` option not passed)?"""
        return self._value(expr, 0) is None

    def unmet(self, node: cst.CSTNode) -> Optional[Tuple[cst.BaseExpression, bool]]:
        """The first condition, from `node` out to its function, not known to let `node` run
        under torchrun: (the test, the truth `node` needs of it); None when all do."""
        if id(node) not in self._unmet:
            self._unmet[id(node)] = next(((test, needed) for test, needed in self._conditions(node)
                                          if self.truth(test) is not needed), None)
        return self._unmet[id(node)]

    def runs(self, node: cst.CSTNode) -> Optional[bool]:
        """Does `node` run under torchrun (as far as the conditions of its function go): True,
        False (one is known to be the other way), or None."""
        result: Optional[bool] = True
        for test, needed in self._conditions(node):
            truth = self.truth(test)
            if truth is None:
                result = None
            elif truth is not needed:
                return False
        return result

    def _conditions(self, node: cst.CSTNode):
        """(test, the truth `node` needs of it) of each `if` and conditional expression around
        `node`, innermost first, up to its function."""
        child = node
        for ancestor in self.s.ancestors(node):
            if isinstance(ancestor, (cst.FunctionDef, cst.Lambda, cst.ClassDef)):
                return
            if isinstance(ancestor, (cst.If, cst.IfExp)) and child is not ancestor.test:
                yield ancestor.test, child is ancestor.body
            child = ancestor

    def store_flag(self, test: cst.BaseExpression) -> Optional[str]:
        """The store_true option a condition reads (`args.distributed`: `--distributed`)."""
        for node in _nodes(test):
            if isinstance(node, cst.Attribute):
                call = self.options.get(node.attr.value)
                if call is not None and literal_str(getattr(get_arg(call, "action"), "value", None)) == "store_true":
                    return literal_str(call.args[0].value)
        return None

    # -- values -------------------------------------------------------------------------
    def _value(self, expr: cst.BaseExpression, depth: int) -> Any:
        if depth > 12:
            return _UNKNOWN
        depth += 1
        if isinstance(expr, (cst.Integer, cst.SimpleString)):
            return expr.evaluated_value
        if isinstance(expr, cst.Name):
            if expr.value in ("True", "False", "None"):
                return {"True": True, "False": False, "None": None}[expr.value]
            return self._name(expr, depth)
        if isinstance(expr, cst.UnaryOperation):
            value = self._value(expr.expression, depth)
            if isinstance(expr.operator, cst.Not):
                truth = _truth(value)
                return _UNKNOWN if truth is None else not truth
            if isinstance(expr.operator, cst.Minus) and type(value) is int:
                return -value
            return _UNKNOWN
        if isinstance(expr, cst.BooleanOperation):
            left = _truth(self._value(expr.left, depth))
            stop = isinstance(expr.operator, cst.Or)  # the left truth that decides alone
            if left is stop:
                return stop
            right = _truth(self._value(expr.right, depth))
            if left is None:
                return stop if right is stop else _UNKNOWN
            return _UNKNOWN if right is None else right
        if isinstance(expr, cst.Comparison):
            left = self._value(expr.left, depth)
            result: Any = True
            for target in expr.comparisons:
                right = self._value(target.comparator, depth)
                one = _compare(left, target.operator, right)
                if one is False:
                    return False
                if one is None:
                    result = _UNKNOWN
                left = right
            return result
        if isinstance(expr, (cst.List, cst.Tuple)):
            return tuple(self._value(e.value, depth) for e in expr.elements)
        if isinstance(expr, cst.IfExp):
            truth = self.truth(expr.test)
            return _UNKNOWN if truth is None else self._value(expr.body if truth else expr.orelse, depth)
        if isinstance(expr, cst.Call):
            return self._call(expr, depth)
        if isinstance(expr, cst.Subscript) and self.qualify(expr.value) == "os.environ" and len(expr.slice) == 1 \
                and isinstance(expr.slice[0].slice, cst.Index):
            return _variable(literal_str(expr.slice[0].slice.value))
        if isinstance(expr, cst.Attribute):
            return self._attribute(expr, depth)
        return _UNKNOWN

    def _call(self, call: cst.Call, depth: int) -> Any:
        qualified = self.qualify(call.func) or ""
        helper = runtime_helper(qualified)
        if isinstance(call.func, cst.Name) and call.func.value == "int" and len(call.args) == 1:
            value = self._value(call.args[0].value, depth)
            if isinstance(value, str):
                return int(value) if value.strip().lstrip("-").isdigit() else _UNKNOWN
            return value if type(value) is int or isinstance(value, _AtLeast) else _UNKNOWN
        if qualified in ("os.environ.get", "os.getenv") and call.args:
            return _variable(literal_str(call.args[0].value))
        if qualified == "torch.distributed.get_world_size" or helper == "get_world_size":
            return _AtLeast(_LEAST["WORLD_SIZE"])
        if qualified == "torch.distributed.get_rank" or helper == "get_rank":
            return _AtLeast(_LEAST["RANK"])
        if qualified in ("torch.distributed.is_initialized", "torch.distributed.is_available") or \
                helper == "is_distributed":
            return True  # setup_distributed() joined the group
        return _UNKNOWN

    def _attribute(self, expr: cst.Attribute, depth: int) -> Any:
        if self.qualify(expr) == "os.environ":
            return _ENVIRON
        if not isinstance(expr.value, cst.Name) or expr.value.value in ("self", "cls") or self._namespace_rewritten:
            return _UNKNOWN
        attr = expr.attr.value
        key = ("attr", attr)
        if key in self._busy:
            return self._default(attr, depth)  # `args.x = f(args.x)`: what it was before
        self._busy.add(key)
        try:
            live = []
            for stmt in self._attribute_assigns.get(attr, []):
                if stmt is None:
                    return _UNKNOWN
                if self.runs(stmt) is not False:
                    live.append(stmt)
            if not live:
                return self._default(attr, depth)
            # straight-line code in one function: the last assignment that runs is the value
            last = max(live, key=self.s.order)
            if self.runs(last) is True and len({id(self.s.scope(a)) for a in live}) == 1:
                return self._value(last.value, depth)
            return _UNKNOWN
        finally:
            self._busy.discard(key)

    def _default(self, dest: str, depth: int) -> Any:
        """An option's value when it is not passed."""
        call = self.options.get(dest)
        if call is None:
            return _UNKNOWN
        action = literal_str(getattr(get_arg(call, "action"), "value", None))
        default = get_arg(call, "default")
        if action in ("store_true", "store_false") and default is None:
            return action == "store_false"
        variable = launcher_variable(call, self.code) if self.env_defaults else None
        if variable is not None:
            return _AtLeast(_LEAST[variable])
        return None if default is None else self._value(default.value, depth)

    def _name(self, expr: cst.Name, depth: int) -> Any:
        bindings = self.s.all_bindings(expr.value, self.s.scope(expr))
        if expr.value == "__name__" and not bindings:
            return "__main__"  # torchrun runs the script
        if any(b.how not in ("param", "assign") for b in bindings):
            return _UNKNOWN
        live = [b for b in bindings if b.how == "param" or self.runs(b.stmt) is not False]
        if len(live) != 1 or (live[0].how == "assign" and self.runs(live[0].stmt) is not True):
            return _UNKNOWN
        binding = live[0]
        key = ("name", id(binding.stmt), binding.name)
        if key in self._busy:
            return _UNKNOWN
        self._busy.add(key)
        try:
            if binding.how == "assign":
                return self._value(binding.value, depth)
            return self._parameter(binding, depth)
        finally:
            self._busy.discard(key)

    def _parameter(self, binding: Binding, depth: int) -> Any:
        """What every call of this file passes for a parameter (its default where one does not)."""
        fn = self.s.functions.get(id(binding.scope.node))
        if fn is None or not fn.callers:
            return _UNKNOWN
        position = fn.position(binding.name)
        param = next((p for p in (*fn.node.params.posonly_params, *fn.node.params.params,
                                  *fn.node.params.kwonly_params) if p.name.value == binding.name), None)
        values = []
        for call in fn.callers:
            arg = call_argument(call, binding.name, position)
            if arg is None:
                arg = param.default if param is not None else None
            values.append(_UNKNOWN if arg is None else self._value(arg, depth))
        first = values[0]
        return first if first is not _UNKNOWN and all(v == first for v in values) else _UNKNOWN


def _variable(name: Optional[str]) -> Any:
    return _AtLeast(_LEAST[name]) if name in _LEAST else _UNKNOWN


def _truth(value: Any) -> Optional[bool]:
    if value is _UNKNOWN:
        return None
    if value is _ENVIRON:
        return True
    if isinstance(value, _AtLeast):
        return True if value.least > 0 else None
    try:
        return bool(value)
    except Exception:  # noqa: BLE001  (whatever a literal's bool does)
        return None


def _compare(left: Any, operator: cst.BaseCompOp, right: Any) -> Optional[bool]:
    """A comparison under torchrun; None where it is not known."""
    if isinstance(operator, (cst.In, cst.NotIn)):
        inside: Optional[bool] = None
        if right is _ENVIRON and isinstance(left, str):
            inside = left in _LEAST or None  # another variable may or may not be set
        elif isinstance(right, tuple) and left is not _UNKNOWN:
            if isinstance(left, _AtLeast):
                if all(type(v) is int and v < left.least for v in right):
                    inside = False
            elif all(v is not _UNKNOWN and not isinstance(v, _AtLeast) for v in right):
                inside = left in right
        if inside is None:
            return None
        return inside if isinstance(operator, cst.In) else not inside
    if left is _UNKNOWN or right is _UNKNOWN or type(operator) not in _COMPARE:
        return None
    if isinstance(left, _AtLeast) or isinstance(right, _AtLeast):
        if isinstance(operator, (cst.Is, cst.IsNot)) and (left is None or right is None):
            return isinstance(operator, cst.IsNot)  # a launcher's number is never None
        if isinstance(right, _AtLeast):  # the unknown on the left: `1 < n` is `n > 1`
            left, right = right, left
            operator = {cst.LessThan: cst.GreaterThan(), cst.GreaterThan: cst.LessThan(),
                        cst.LessThanEqual: cst.GreaterThanEqual(), cst.GreaterThanEqual: cst.LessThanEqual()}.get(
                type(operator), operator)
        if type(right) is not int or isinstance(operator, (cst.Is, cst.IsNot)):
            return None
        least = left.least  # the value is some n >= least
        if isinstance(operator, cst.GreaterThan):
            return True if least > right else None
        if isinstance(operator, cst.GreaterThanEqual):
            return True if least >= right else None
        if isinstance(operator, (cst.LessThan, cst.LessThanEqual)):
            return False if least > right or (least == right and isinstance(operator, cst.LessThan)) else None
        if isinstance(operator, cst.Equal):
            return False if right < least else None
        return True if right < least else None  # NotEqual
    try:
        return bool(_COMPARE[type(operator)](left, right))
    except Exception:  # noqa: BLE001  (mixed types)
        return None

