"""The shape of one file: scopes, what each name is bound to and where, functions, classes,
and which same-file function a call reaches. No torch knowledge here (that is `values.py`).

Built from the engine's node index in one linear scan: no extra LibCST traversal and no
LibCST scope metadata (full scope analysis costs several times a parse).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence, Set, Tuple, Union

import libcst as cst

from gpumigrate.rewriter.engine import NodeIndex, node_types
from gpumigrate.rewriter.names import dotted  # noqa: F401  (the analysis reads names with it too)

ScopeNode = Union[cst.Module, cst.FunctionDef, cst.ClassDef, cst.Lambda]
NEVER = math.inf  # "after every binding": how code that runs later (a called function) sees a name


@dataclass(eq=False)
class Binding:
    """One place that binds a name. `how`: assign (value = the right-hand side), unpack
    (value, path into it), loop (value = the iterable; path into each item), aug (`+=`:
    value = the right-hand side, op = the operator), param, import (value = the qualified
    name), def, class, with, except, global."""

    name: str
    how: str
    value: object
    stmt: cst.CSTNode  # the small statement or compound statement that binds
    order: int  # pre-order position of `stmt`: "before" and "after" in the file
    scope: "Scope"
    path: Tuple[int, ...] = ()
    op: Optional[cst.CSTNode] = None


@dataclass(eq=False)
class Scope:
    node: ScopeNode
    parent: Optional["Scope"]  # where names not bound here are looked up (class bodies skipped)
    bindings: Dict[str, List[Binding]] = field(default_factory=dict)
    params: List[str] = field(default_factory=list)
    globals: Set[str] = field(default_factory=set)

    @property
    def is_module(self) -> bool:
        return isinstance(self.node, cst.Module)


@dataclass(eq=False)
class Function:
    """A function, method or lambda defined in this file."""

    node: Union[cst.FunctionDef, cst.Lambda]
    scope: Scope
    name: str
    cls: Optional["Class"] = None  # the class of a method
    calls: List[cst.Call] = field(default_factory=list)  # in its own body, not nested defs
    returns: List[cst.BaseExpression] = field(default_factory=list)
    callers: List[cst.Call] = field(default_factory=list)  # same-file calls that reach it

    def param_names(self) -> List[str]:
        params = self.node.params
        return [p.name.value for p in (*params.posonly_params, *params.params, *params.kwonly_params)]

    def position(self, name: str) -> int:
        """Where a call passes `name` positionally (`obj.m(a)` passes `a` as the second
        parameter of `m(self, a)`); -1 for `*args`/`**kwargs` and keyword-only parameters."""
        params = self.node.params
        positional = [p.name.value for p in (*params.posonly_params, *params.params)]
        if name not in positional:
            return -1
        return positional.index(name) - (1 if self.cls is not None and positional[:1] == ["self"] else 0)


@dataclass(eq=False)
class Class:
    node: cst.ClassDef
    name: str
    bases: List[cst.BaseExpression]
    methods: Dict[str, Function] = field(default_factory=dict)
    attrs: Dict[str, List[Binding]] = field(default_factory=dict)  # self.x = ... in any method


def target_names(target: cst.CSTNode) -> List[str]:
    if isinstance(target, cst.Name):
        return [target.value]
    if isinstance(target, (cst.Tuple, cst.List)):
        return [n for e in target.elements for n in target_names(e.value)]
    if isinstance(target, cst.StarredElement):
        return target_names(target.value)
    return []


_STATEMENTS = (cst.BaseSmallStatement, cst.BaseCompoundStatement)
# what holds a body that may not run: a branch, a loop, a handler
_BRANCHES = (cst.If, cst.Else, cst.For, cst.While, cst.Try, cst.ExceptHandler, cst.MatchCase)


def _types(kinds) -> frozenset:
    """The concrete classes of a type or tuple of types (fast membership, see node_types)."""
    if isinstance(kinds, tuple):
        return frozenset().union(*(node_types(k) for k in kinds))
    return node_types(kinds)


class Structure:
    def __init__(self, module: cst.Module, index: NodeIndex) -> None:
        self.module = module
        self.index = index
        self.scopes: Dict[int, Scope] = {}
        self.functions: Dict[int, Function] = {}  # id(FunctionDef or Lambda) -> Function
        self.classes: Dict[int, Class] = {}
        self.classes_by_name: Dict[str, Class] = {}
        self._scope_of: Dict[int, Scope] = {}  # id(node) -> innermost scope holding it
        self._scan()

    # -- building ------------------------------------------------------------------------
    def _scan(self) -> None:
        order = self.index.order
        end = self.index.end
        root = Scope(self.module, None)
        self.scopes[id(self.module)] = root
        stack: List[Tuple[Scope, int]] = [(root, len(order))]
        functions: List[Tuple[Function, int]] = []
        # only what opens a scope, calls, returns and binds: the scope of any other node is
        # found on demand (`_scope_at`)
        scanned = {cst.FunctionDef, cst.ClassDef, cst.Lambda, cst.Call, cst.Return, *self._binders}
        for i in [i for i, node in enumerate(order) if type(node) in scanned]:
            node = order[i]
            while i >= stack[-1][1]:
                stack.pop()
            while functions and i >= functions[-1][1]:
                functions.pop()
            scope = stack[-1][0]
            self._scope_of[id(node)] = scope
            kind = type(node)  # exact types: LibCST's ABC isinstance checks cost a tenth of a lint
            if kind is cst.FunctionDef or kind is cst.ClassDef or kind is cst.Lambda:
                inner = self._open(node, scope, i)
                stack.append((inner, end[id(node)]))
                if id(node) in self.functions:
                    functions.append((self.functions[id(node)], end[id(node)]))
                continue
            if kind is cst.Call and functions and functions[-1][0].scope is scope:
                functions[-1][0].calls.append(node)
            elif kind is cst.Return and node.value is not None and functions \
                    and functions[-1][0].scope is scope:
                functions[-1][0].returns.append(node.value)
            bind = self._binders.get(kind)
            if bind is not None:
                bind(self, node, scope, i)
        for fn in self.functions.values():
            if isinstance(fn.node, cst.Lambda):
                fn.returns.append(fn.node.body)
        for fn in self.functions.values():
            for call in fn.calls:
                for target in self.callees(call):
                    target.callers.append(call)
        for call in self._module_calls():
            for target in self.callees(call):
                target.callers.append(call)

    def _module_calls(self) -> Iterator[cst.Call]:
        root = self.scopes[id(self.module)]
        for node in self.index.of(cst.Call):
            if self._scope_of.get(id(node)) is root:
                yield node

    def _open(self, node, scope: Scope, i: int) -> Scope:
        if not isinstance(node, cst.Lambda):
            self._add(scope, node.name.value, "def" if isinstance(node, cst.FunctionDef) else "class", node, node, i)
        lookup = scope
        while isinstance(lookup.node, cst.ClassDef):
            lookup = lookup.parent  # methods do not see the class body's names
        inner = Scope(node, lookup if not isinstance(node, cst.ClassDef) else scope)
        self.scopes[id(node)] = inner
        if isinstance(node, cst.ClassDef):
            cls = Class(node, node.name.value, [a.value for a in node.bases])
            self.classes[id(node)] = cls
            self.classes_by_name.setdefault(cls.name, cls)
            return inner
        params = node.params
        for param in (*params.posonly_params, *params.params, *params.kwonly_params):
            inner.params.append(param.name.value)
            self._add(inner, param.name.value, "param", param, param, i)
        for star in (params.star_arg, params.star_kwarg):
            if isinstance(star, cst.Param):
                inner.params.append(star.name.value)
                self._add(inner, star.name.value, "param", star, star, i)
        name = node.name.value if isinstance(node, cst.FunctionDef) else "<lambda>"
        cls = self.classes.get(id(scope.node)) if isinstance(scope.node, cst.ClassDef) else None
        fn = Function(node, inner, name, cls)
        self.functions[id(node)] = fn
        if cls is not None and isinstance(node, cst.FunctionDef):
            cls.methods[name] = fn
        return inner

    def _add(self, scope: Scope, name: str, how: str, value, stmt, order: int, path=(), op=None) -> Binding:
        if name in scope.globals:
            scope = self.scopes[id(self.module)]
        binding = Binding(name, how, value, stmt, order, scope, tuple(path), op)
        scope.bindings.setdefault(name, []).append(binding)
        return binding

    def _bind_target(self, target, scope: Scope, how: str, value, stmt, order: int, path=()) -> None:
        if isinstance(target, cst.Name):
            self._add(scope, target.value, "unpack" if how == "assign" and path else how, value, stmt, order, path)
        elif isinstance(target, (cst.Tuple, cst.List)):
            for k, element in enumerate(target.elements):
                if isinstance(element, cst.StarredElement):
                    for name in target_names(element.value):
                        self._add(scope, name, "with", None, stmt, order)  # unknown shape
                else:
                    self._bind_target(element.value, scope, how, value, stmt, order, (*path, k))
        elif isinstance(target, cst.Attribute) and isinstance(target.value, cst.Name) \
                and target.value.value == "self":
            cls = self._method_class(scope)
            if cls is not None:
                binding = Binding(f"self.{target.attr.value}", "unpack" if path else how, value, stmt, order,
                                  scope, tuple(path))
                cls.attrs.setdefault(target.attr.value, []).append(binding)

    def _method_class(self, scope: Scope) -> Optional[Class]:
        fn = self.functions.get(id(scope.node))
        return fn.cls if fn is not None else None

    def _assign(self, node: cst.Assign, scope: Scope, i: int) -> None:
        for target in node.targets:
            self._bind_target(target.target, scope, "assign", node.value, node, i)

    def _ann_assign(self, node: cst.AnnAssign, scope: Scope, i: int) -> None:
        if node.value is not None:
            self._bind_target(node.target, scope, "assign", node.value, node, i)

    def _aug_assign(self, node: cst.AugAssign, scope: Scope, i: int) -> None:
        if isinstance(node.target, cst.Name):
            self._add(scope, node.target.value, "aug", node.value, node, i, op=node.operator)
        elif isinstance(node.target, cst.Attribute) and (dotted(node.target) or "").startswith("self."):
            cls = self._method_class(scope)
            if cls is not None:
                cls.attrs.setdefault(node.target.attr.value, []).append(
                    Binding(dotted(node.target), "aug", node.value, node, i, scope, (), node.operator))

    def _for(self, node: cst.For, scope: Scope, i: int) -> None:
        self._bind_target(node.target, scope, "loop", node.iter, node, i)

    def _comp_for(self, node: cst.CompFor, scope: Scope, i: int) -> None:
        self._bind_target(node.target, scope, "loop", node.iter, self.statement(node) or node, i)

    def _named_expr(self, node: cst.NamedExpr, scope: Scope, i: int) -> None:
        self._bind_target(node.target, scope, "assign", node.value, self.statement(node) or node, i)

    def _with(self, node: cst.With, scope: Scope, i: int) -> None:
        for item in node.items:
            if item.asname is not None:
                self._bind_target(item.asname.name, scope, "with", item.item, node, i)

    def _except(self, node: cst.ExceptHandler, scope: Scope, i: int) -> None:
        if node.name is not None:
            self._bind_target(node.name.name, scope, "except", None, node, i)

    def _import(self, node: cst.Import, scope: Scope, i: int) -> None:
        for alias in node.names:
            full = dotted(alias.name) or ""
            if alias.asname is not None:
                self._bind_target(alias.asname.name, scope, "import", full, node, i)
            else:
                top = full.split(".")[0]
                self._add(scope, top, "import", top, node, i)

    def _import_from(self, node: cst.ImportFrom, scope: Scope, i: int) -> None:
        if isinstance(node.names, cst.ImportStar):
            return
        base = dotted(node.module) if node.module is not None else ""
        for alias in node.names:
            local = alias.asname.name.value if alias.asname is not None else alias.name.value
            self._add(scope, local, "import", f"{base}.{alias.name.value}" if base else "", node, i)

    def _global(self, node, scope: Scope, i: int) -> None:
        scope.globals.update(n.name.value for n in node.names)

    # what binds names, by node type: one dict lookup per node instead of a chain of tests
    _binders = {
        cst.Assign: _assign, cst.AnnAssign: _ann_assign, cst.AugAssign: _aug_assign, cst.For: _for,
        cst.CompFor: _comp_for, cst.NamedExpr: _named_expr, cst.With: _with, cst.ExceptHandler: _except,
        cst.Import: _import, cst.ImportFrom: _import_from, cst.Global: _global, cst.Nonlocal: _global,
    }

    # -- where things are ----------------------------------------------------------------
    def parent(self, node: cst.CSTNode) -> Optional[cst.CSTNode]:
        return self.index.parent.get(id(node))

    def ancestors(self, node: cst.CSTNode) -> Iterator[cst.CSTNode]:
        """Outward from the parent of `node`."""
        current = self.index.parent.get(id(node))
        while current is not None:
            yield current
            current = self.index.parent.get(id(current))

    def statement(self, node: cst.CSTNode) -> Optional[cst.CSTNode]:
        """The innermost statement (small or compound) holding `node`, or `node` itself."""
        current: Optional[cst.CSTNode] = node
        while current is not None and not isinstance(current, _STATEMENTS):
            current = self.index.parent.get(id(current))
        return current

    def line(self, node: cst.CSTNode) -> Optional[cst.CSTNode]:
        """The member of a statement block holding `node`: a SimpleStatementLine or a
        compound statement."""
        current: Optional[cst.CSTNode] = node
        while current is not None:
            parent = self.index.parent.get(id(current))
            if isinstance(current, (cst.SimpleStatementLine, cst.BaseCompoundStatement)) and \
                    isinstance(parent, (cst.Module, cst.IndentedBlock)):
                return current
            current = parent
        return None

    def block(self, line: cst.CSTNode) -> Optional[Union[cst.Module, cst.IndentedBlock]]:
        parent = self.index.parent.get(id(line))
        return parent if isinstance(parent, (cst.Module, cst.IndentedBlock)) else None

    def order(self, node: cst.CSTNode) -> int:
        return self.index.start.get(id(node), -1)

    def scope(self, node: cst.CSTNode) -> Scope:
        """The scope the code at `node` runs in (for a def: the def's own scope)."""
        if id(node) in self.scopes:
            return self.scopes[id(node)]
        return self._scope_at(node) or self.scopes[id(self.module)]

    def _scope_at(self, node: cst.CSTNode) -> Optional[Scope]:
        """The innermost scope holding `node` (a def, class or lambda holds its whole subtree:
        name, decorators and defaults too); None for a node the fixes built."""
        found = self._scope_of.get(id(node))
        if found is None and id(node) in self.index.start:
            above = self.index.parent.get(id(node))
            while above is not None and id(above) not in self.scopes:
                above = self.index.parent.get(id(above))
            found = self._scope_of[id(node)] = self.scopes[id(above if above is not None else self.module)]
        return found

    def function(self, node: cst.CSTNode) -> Optional[Function]:
        """The same-file function (def or lambda) whose body holds `node`."""
        scope: Optional[Scope] = self.scope(node)
        while scope is not None and isinstance(scope.node, cst.ClassDef):
            scope = self._scope_at(scope.node)
        return self.functions.get(id(scope.node)) if scope is not None else None

    def inside(self, node: cst.CSTNode, kinds) -> List[cst.CSTNode]:
        """Every node of these types under `node` (pre-order)."""
        types = _types(kinds)
        return [n for n in self.index.subtree(node) if type(n) in types]

    def own(self, root: cst.CSTNode, kinds) -> List[cst.CSTNode]:
        """Nodes of these types under `root` that run in root's own scope (not in nested
        functions, lambdas or classes)."""
        scope = self.scope(root) if not isinstance(root, (cst.FunctionDef, cst.Lambda, cst.ClassDef)) \
            else self.scopes[id(root)]
        types = _types(kinds)
        return [n for n in self.index.subtree(root) if type(n) in types and self._scope_at(n) is scope]

    # -- names ---------------------------------------------------------------------------
    def lookup(self, name: str, scope: Scope, at: float = NEVER) -> Tuple[Optional[Scope], List[Binding]]:
        """The scope that binds `name` as seen from `scope`, and its bindings that may reach
        position `at`: the last one before `at` (straight-line code), or every one when `at`
        comes before all of them (a loop body seeing its own later rebinding, a parameter)."""
        current: Optional[Scope] = scope
        while current is not None:
            if name in current.globals:
                current = self.scopes[id(self.module)]
                at = NEVER
            bindings = current.bindings.get(name)
            if bindings:
                before = [b for b in bindings if b.order < at or b.how == "param"]
                if not before:
                    return current, list(bindings)
                last = before[-1]
                if last.how == "aug":
                    # `total += x` extends the binding before it: keep the whole chain
                    start = max((k for k, b in enumerate(before) if b.how != "aug"), default=0)
                    return current, before[start:]
                # A binding in a branch or loop body that `at` is not in may not have run
                # (`if cifar10: loader = A` / `else: loader = B`): the ones before it reach too.
                reaching = len(before) - 1
                while reaching > 0 and self._may_skip(before[reaching], at):
                    reaching -= 1
                return current, before[reaching:]
            current = current.parent
            at = NEVER  # an enclosing scope's names: as they are when the inner code runs
        return None, []

    def _may_skip(self, binding: Binding, at: float) -> bool:
        """Can code at position `at` be reached without `binding` having run? True where the
        binding sits in a branch or loop body (within its scope) that does not hold `at`."""
        stop = binding.scope.node
        for node in self.ancestors(binding.stmt):
            if node is stop:
                return False
            if isinstance(node, cst.BaseSuite) and isinstance(self.index.parent.get(id(node)), _BRANCHES):
                start = self.index.start.get(id(node), -1)
                if not start <= at < self.index.end[id(node)]:
                    return True
        return False

    def all_bindings(self, name: str, scope: Scope) -> List[Binding]:
        found, _ = self.lookup(name, scope)
        return list(found.bindings.get(name, [])) if found is not None else []

    def identifiers(self) -> Set[str]:
        """Every name the code binds or refers to (not attribute names or keywords): a
        name we insert must avoid all of them."""
        skip: Set[int] = set()
        for node in self.index.order:
            if type(node) is cst.Attribute:
                skip.add(id(node.attr))
            elif type(node) is cst.Arg and node.keyword is not None:
                skip.add(id(node.keyword))
        return {n.value for n in self.index.order if type(n) is cst.Name and id(n) not in skip}

    # -- calls ---------------------------------------------------------------------------
    def callee(self, call: cst.Call) -> Optional[Function]:
        """The same-file function a call runs: `f(...)`, `self.m(...)`, `obj.m(...)` on an
        instance of a class of this file (found by the caller's own bindings), or a class's
        `__init__`."""
        func = call.func
        scope = self.scope(call)
        if isinstance(func, cst.Name):
            _, bindings = self.lookup(func.value, scope, self.order(self.statement(call) or call))
            for b in reversed(bindings):
                if b.how == "def":
                    return self.functions.get(id(b.value))
                if b.how == "class":
                    return self.classes[id(b.value)].methods.get("__init__")
                if b.how == "assign" and isinstance(b.value, cst.Lambda):
                    return self.functions.get(id(b.value))
            return None
        if isinstance(func, cst.Attribute):
            cls = self.instance_class(func.value, scope)
            if cls is not None:
                return self.method(cls, func.attr.value)
        return None

    def callees(self, call: cst.Call) -> List[Function]:
        """`callee`; where it finds nothing for `obj.m(...)` (an object taken from a list, made
        by a factory, handed in), the methods named `m` of this file's classes that the call's
        arguments fit, unless `obj` is bound by an import or is `self`."""
        found = self.callee(call)
        if found is not None:
            return [found]
        func = call.func
        if not isinstance(func, cst.Attribute) or func.attr.value.startswith("__") or \
                any(a.star for a in call.args):
            return []
        root = func.value
        while isinstance(root, cst.Attribute):
            root = root.value
        if not isinstance(root, cst.Name) or root.value == "self":
            return []
        _, bindings = self.lookup(root.value, self.scope(call))
        if not bindings or any(b.how == "import" for b in bindings):
            return []
        out = []
        for cls in self.classes.values():
            fn = cls.methods.get(func.attr.value)
            if fn is not None and isinstance(fn.node, cst.FunctionDef) and self._fits(fn, call):
                out.append(fn)
        return out

    @staticmethod
    def _fits(fn: Function, call: cst.Call) -> bool:
        """Can `obj.m(...)` with these arguments call the method `fn` (bound: `self` given)?"""
        params = fn.node.params
        positional = [*params.posonly_params, *params.params][1:]
        names = {p.name.value for p in (*positional, *params.kwonly_params)}
        given = [a for a in call.args if a.keyword is None]
        keywords = {a.keyword.value for a in call.args if a.keyword is not None}
        if len(given) > len(positional) and not isinstance(params.star_arg, cst.Param):
            return False
        if not keywords <= names and params.star_kwarg is None:
            return False
        required = [p.name.value for p in positional if p.default is None][len(given):]
        required += [p.name.value for p in params.kwonly_params if p.default is None]
        return all(name in keywords for name in required)

    def method(self, cls: Class, name: str) -> Optional[Function]:
        seen: Set[int] = set()
        queue = [cls]
        while queue:
            current = queue.pop(0)
            if id(current) in seen:
                continue
            seen.add(id(current))
            if name in current.methods:
                return current.methods[name]
            for base in current.bases:
                if isinstance(base, cst.Name) and base.value in self.classes_by_name:
                    queue.append(self.classes_by_name[base.value])
        return None

    def instance_class(self, expr: cst.BaseExpression, scope: Scope) -> Optional[Class]:
        """The class of this file an expression is an instance of, when its binding says so:
        `self` in a method, or a name bound to `C(...)`."""
        if isinstance(expr, cst.Name):
            if expr.value == "self":
                fn = self.functions.get(id(scope.node))
                while fn is None and scope.parent is not None and not isinstance(scope.node, cst.FunctionDef):
                    scope = scope.parent
                    fn = self.functions.get(id(scope.node))
                if fn is not None and fn.cls is not None:
                    return fn.cls
            _, bindings = self.lookup(expr.value, scope, self.order(self.statement(expr) or expr))
            classes = {id(c): c for c in (self._class_of_value(b) for b in bindings) if c is not None}
            return next(iter(classes.values())) if len(classes) == 1 and len(bindings) == 1 else None
        if isinstance(expr, cst.Attribute) and isinstance(expr.value, cst.Name) and expr.value.value == "self":
            cls = self.instance_class(expr.value, scope)
            if cls is not None and expr.attr.value in cls.attrs:
                found = {id(c): c for c in (self._class_of_value(b) for b in cls.attrs[expr.attr.value])
                         if c is not None}
                return next(iter(found.values())) if len(found) == 1 else None
        return None

    def _class_of_value(self, binding: Binding) -> Optional[Class]:
        value = binding.value
        if binding.how == "assign" and isinstance(value, cst.Call) and isinstance(value.func, cst.Name):
            return self.classes_by_name.get(value.func.value)
        return None

    def calls_reaching(self, roots: Sequence[Function]) -> Set[int]:
        """ids of the functions reachable from `roots` through same-file calls (roots included)."""
        seen: Set[int] = set()
        stack = list(roots)
        while stack:
            fn = stack.pop()
            if id(fn.node) in seen:
                continue
            seen.add(id(fn.node))
            for call in fn.calls:
                target = self.callee(call)
                if target is not None:
                    stack.append(target)
        return seen
