"""What a script says about devices: where it builds one, the flags that choose CUDA, and
every place that hard-codes CUDA (`.cuda()`, `"cuda:0"`, CUDA tensor types, `torch.load`
without `map_location`); the names, attributes and `--device` flags bound to a CUDA device's
name (`dev = "cuda"`, `self.device = f"cuda:{i}"`, `default='cuda'`), and how the script uses
each (as a device, as a device type, as a string). Read by the device plan, which decides
what to put there.

One linear scan of the node index: no traversal of its own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Set, Tuple

import libcst as cst

from gpumigrate.analysis.structure import Structure
from gpumigrate.analysis.syntax import findall, get_arg, is_method_call, literal_int, literal_str, runtime_helper
from gpumigrate.rewriter.lazy import matchers as m

CUDA_TYPES = {
    "FloatTensor": "float32", "DoubleTensor": "float64", "HalfTensor": "float16",
    "BFloat16Tensor": "bfloat16", "LongTensor": "int64", "IntTensor": "int32",
    "ShortTensor": "int16", "CharTensor": "int8", "ByteTensor": "uint8", "BoolTensor": "bool",
}
_CUDA_STRING = re.compile(r"^cuda(?::(\d+))?$")


def cuda_string_index(value: Optional[str]) -> Tuple[bool, Optional[int]]:
    """("cuda:1") -> (True, 1); ("cuda") -> (True, None); anything else -> (False, None)."""
    match = _CUDA_STRING.match(value or "")
    if not match:
        return False, None
    return True, int(match.group(1)) if match.group(1) else None


@dataclass(frozen=True)
class CudaName:
    """A CUDA device named by a string: `"cuda"`, `"cuda:1"` (`index` 1), or with a computed
    index (`computed`): `f"cuda:{i}"`, `"cuda:%d" % i`, `"cuda:{}".format(i)`, `"cuda:" + str(i)`."""

    index: Optional[int] = None
    computed: Optional[cst.BaseExpression] = None


def _text(node: Optional[cst.BaseExpression], *starts: str) -> Optional[str]:
    """`literal_str(node)` for a string whose source starts with one of `starts` after its
    quotes: others are not evaluated (which would warn of an invalid escape such as `\\d`)."""
    if not isinstance(node, cst.SimpleString) or not node.value.lstrip("rRuU").strip("\"'").startswith(starts):
        return None
    return literal_str(node)


def cuda_name(node: Optional[cst.BaseExpression]) -> Optional[CudaName]:
    if isinstance(node, cst.SimpleString):
        is_cuda, index = cuda_string_index(_text(node, "cuda"))
        return CudaName(index) if is_cuda else None
    if isinstance(node, cst.FormattedString):
        parts = node.parts
        if len(parts) == 2 and isinstance(parts[0], cst.FormattedStringText) and parts[0].value == "cuda:" and \
                isinstance(parts[1], cst.FormattedStringExpression) and parts[1].conversion is None and \
                parts[1].format_spec is None:
            return CudaName(computed=parts[1].expression)
        return None
    if isinstance(node, cst.BinaryOperation):
        left, right = _text(node.left, "cuda:"), node.right
        if isinstance(node.operator, cst.Modulo) and left in ("cuda:%d", "cuda:%i", "cuda:%s"):
            if isinstance(right, cst.Tuple):
                if len(right.elements) != 1 or isinstance(right.elements[0], cst.StarredElement):
                    return None
                right = right.elements[0].value
            return CudaName(computed=right)
        if isinstance(node.operator, cst.Add) and left == "cuda:" and isinstance(right, cst.Call) and \
                m.matches(right.func, m.Name("str")) and len(right.args) == 1 and not right.args[0].keyword \
                and not right.args[0].star:
            return CudaName(computed=right.args[0].value)
        return None
    if is_method_call(node, "format") and _text(node.func.value, "cuda:") in ("cuda:{}", "cuda:{0}") and \
            len(node.args) == 1 and node.args[0].keyword is None and not node.args[0].star:
        return CudaName(computed=node.args[0].value)
    return None


def local_rank_index(index: cst.BaseExpression) -> bool:
    """`args.local_rank`: under torchrun that is what `get_device()` picks anyway."""
    name = cst.Module(body=[]).code_for_node(index)
    return name.endswith("local_rank") or "LOCAL_RANK" in name


def torch_device_index(call: cst.Call) -> Tuple[bool, Optional[int]]:
    """torch.device("cuda:1") / torch.device("cuda", 1) -> (True, 1)."""
    first = get_arg(call, "type", 0)
    is_cuda, index = cuda_string_index(literal_str(first.value) if first else None)
    second = get_arg(call, "index", 1)
    if second is not None:
        index = literal_int(second.value)
    return is_cuda, index


def cuda_type_dtype(qualified: Optional[str]) -> Optional[str]:
    if qualified and qualified.startswith("torch.cuda."):
        return CUDA_TYPES.get(qualified[len("torch.cuda."):])
    return None


def cuda_or_cpu(node: cst.BaseExpression) -> bool:
    """`"cuda" if COND else "cpu"` (either way round, "cuda:n" too): a device name chosen by
    whether CUDA is there (or a flag says to use it)."""
    if not isinstance(node, cst.IfExp):
        return False
    branches = (node.body, node.orelse)
    return any(literal_str(b) == "cpu" for b in branches) and any(cuda_name(b) for b in branches)


@dataclass
class DeviceDef:
    name: str  # `device`; `self.device`, `args.device` for an attribute
    stmt: cst.SimpleStatementLine
    # torch.device(...), get_device(...), an IfExp choosing between devices, or (`string`) a
    # CUDA device's name
    call: cst.BaseExpression
    hardcoded: bool
    # `"cuda" if COND else "cpu"`, alone (`string`: the script's device is a str) or in
    # `torch.device(...)`: COND chooses between an accelerator and the CPU
    choice: Optional[cst.IfExp] = None
    string: bool = False


@dataclass
class Flag:
    code: str  # how the script spells it: `args.cuda`, `use_cuda`
    expr: cst.BaseExpression
    stmt: cst.SimpleStatementLine
    only_availability: bool  # `cuda = torch.cuda.is_available()`: not a user choice


@dataclass
class Site:
    node: cst.CSTNode
    index: Optional[int]
    literal_index: bool  # no index, a literal one, or LOCAL_RANK's: the script's device serves it


@dataclass
class DeviceFlag:
    """`parser.add_argument('--device', default='cuda')`: read as `args.<dest>`."""

    dest: str
    default: cst.BaseExpression  # a CUDA device's name, or `"cuda" if COND else "cpu"`


class DeviceFacts:
    """Found in one pass over the node index, in source order."""

    def __init__(self, module: cst.Module, index, names) -> None:
        self.names = names
        self.module = module
        self.sites: List[Site] = []
        self.defs: List[DeviceDef] = []
        self.attribute_defs: List[DeviceDef] = []  # self.device = "cuda", args.device = "cuda"
        self.device_flags: List[DeviceFlag] = []
        self.flags: List[Flag] = []
        self.args_name: Optional[Tuple[str, cst.SimpleStatementLine]] = None
        self.parsed_args: Set[str] = set()  # names bound to `parser.parse_args()`
        self.cuda_argument = False
        # exec(...), globals()[key] = value: module-level names may be rebound from outside (a
        # configurator's command-line overrides)
        self.runs_code_text = False
        self.indices: Set[int] = set()
        self._def_calls: Set[int] = set()  # a definition's own torch.device(...) is not a use
        for node in index.order:
            kind = type(node)
            if kind is cst.SimpleStatementLine:
                if len(node.body) == 1 and isinstance(node.body[0], cst.Assign) and len(node.body[0].targets) == 1:
                    self._assignment(node, node.body[0].targets[0].target, node.body[0].value)
                elif len(node.body) == 1 and isinstance(node.body[0], cst.AnnAssign) and node.body[0].value:
                    self._assignment(node, node.body[0].target, node.body[0].value)
            elif kind is cst.Call:
                self._call(node)
            elif kind is cst.Attribute and cuda_type_dtype(names.qualify(node)):
                self.sites.append(Site(node, None, True))

    def _assignment(self, stmt, target: cst.BaseExpression, value: cst.BaseExpression) -> None:
        names = self.names
        if isinstance(target, cst.Name) and isinstance(value, cst.Call):
            qualified = names.qualify(value.func)
            if qualified == "torch.device":
                first = get_arg(value, "type", 0)
                named = cuda_name(first.value) if first else None  # "cuda:0", f"cuda:{i}"
                # torch.device("cuda" if torch.cuda.is_available() else "cpu")
                choice = first.value if first is not None and cuda_or_cpu(first.value) else None
                self.defs.append(DeviceDef(target.value, stmt, value, hardcoded=bool(named or choice),
                                           choice=choice))
                self._def_calls.add(id(value))
                return
            if runtime_helper(qualified) in ("get_device", "setup_distributed"):
                self.defs.append(DeviceDef(target.value, stmt, value, hardcoded=False))
                return
        if isinstance(target, (cst.Name, cst.Tuple)) and is_method_call(value, "parse_args", "parse_known_args"):
            name = target if isinstance(target, cst.Name) else target.elements[0].value if target.elements else None
            if isinstance(name, cst.Name):
                self.parsed_args.add(name.value)
                if is_method_call(value, "parse_args"):
                    self.args_name = (name.value, stmt)
        if (cuda_or_cpu(value) or cuda_name(value)) and (
                isinstance(target, cst.Name) or m.matches(target, m.Attribute(value=m.Name()))):
            # device = "cuda" if torch.cuda.is_available() else "cpu"; dev = "cuda:0"; self.device = f"cuda:{i}";
            # args.device = "cuda"
            name = target.value if isinstance(target, cst.Name) else f"{target.value.value}.{target.attr.value}"
            found = DeviceDef(name, stmt, value, hardcoded=True, choice=value if cuda_or_cpu(value) else None,
                              string=True)
            (self.defs if isinstance(target, cst.Name) else self.attribute_defs).append(found)
            return
        if isinstance(target, cst.Name) and isinstance(value, cst.IfExp):
            # device = torch.device('cuda', args.local_rank) if torch.cuda.is_available() else torch.device('cpu')
            branches = [b for b in (value.body, value.orelse)
                        if isinstance(b, cst.Call) and names.qualify(b.func) == "torch.device"]
            if len(branches) == 2:
                hardcoded = any(torch_device_index(b)[0] for b in branches)
                self.defs.append(DeviceDef(target.value, stmt, value, hardcoded=hardcoded,
                                           choice=value if hardcoded else None))
                self._def_calls.update(id(b) for b in branches)
                self._def_calls.add(id(value))
                return
        if isinstance(target, (cst.Name, cst.Attribute)) and not _mentions_device(value, names):
            availability = [c for c in findall(value, m.Call()) if names.qualify(c.func) == "torch.cuda.is_available"]
            if availability:
                inside = {id(n) for call in availability for n in findall(call, m.Name())}
                only = all(n.value in ("True", "False") for n in findall(value, m.Name()) if id(n) not in inside)
                code = self.module.code_for_node(target)
                self.flags.append(Flag(code, target, stmt, only))

    def _call(self, node: cst.Call) -> None:
        names = self.names
        if is_method_call(node, "cuda"):
            arg = get_arg(node, "device", 0)
            index = literal_int(arg.value) if arg else None
            self.sites.append(Site(node, index, arg is None or index is not None or local_rank_index(arg.value)))
            return
        if is_method_call(node, "add_argument"):
            first = get_arg(node, "", 0)
            if first and literal_str(first.value) == "--cuda":
                self.cuda_argument = True
            default = get_arg(node, "default")
            dest = _dest(node)
            if default is not None and dest and (cuda_name(default.value) or cuda_or_cpu(default.value)):
                self.device_flags.append(DeviceFlag(dest, default.value))
            return
        if type(node.func) is cst.Name and node.func.value in ("exec", "globals"):
            self.runs_code_text = True
        qualified = names.qualify(node.func)
        if qualified == "torch.device":
            is_cuda, index = torch_device_index(node)
            first = get_arg(node, "type", 0)
            computed = cuda_name(first.value) if first is not None and not is_cuda else None
            if is_cuda and id(node) not in self._def_calls:
                self.sites.append(Site(node, index, True))
            elif is_cuda and index is not None:
                self.indices.add(index)  # a definition's index counts toward model parallelism
            elif computed is not None and id(node) not in self._def_calls:  # torch.device(f"cuda:{i}")
                self.sites.append(Site(node, None, local_rank_index(computed.computed)))
            return
        if qualified == "torch.load" and get_arg(node, "map_location", 1) is None:
            self.sites.append(Site(node, None, True))
        if cuda_type_dtype(qualified):
            self.sites.append(Site(node, None, True))
        for arg in node.args:
            if arg.keyword is None or arg.keyword.value in DEVICE_KEYWORDS:
                named = cuda_name(arg.value)
                if named is not None and (arg.keyword is not None or is_method_call(node, "to")):
                    literal = named.computed is None or local_rank_index(named.computed)
                    self.sites.append(Site(arg.value, named.index, literal))


# keywords that take a device: `torch.zeros(2, device=...)`, `torch.load(f, map_location=...)`
DEVICE_KEYWORDS = ("device", "map_location")


@dataclass(eq=False)
class NamedDevice:
    """A name (`dev`), an attribute (`self.device`, `args.device`) or a command-line flag
    (`--device`, read as `args.device`) bound to CUDA device names, and how the script uses it."""

    name: str
    values: List[cst.BaseExpression]  # the CUDA device names bound to it (a flag: its default)
    reads: List[cst.BaseExpression]
    uses: List[str]  # how each read is used (the kinds below)
    mixed: List[bool]  # may each read see a value bound elsewhere (not a CUDA device's name)?
    flag: bool = False


def named_devices(s: Structure, facts: "DeviceFacts", qualify) -> List[NamedDevice]:
    """Every name, attribute and flag the script binds to a CUDA device's name, with its
    reads. A name is one per scope, with every CUDA name bound to it there; `self.device`
    is read in the methods of its class, `args.device` anywhere."""
    found: List[NamedDevice] = []
    module_scope = s.scopes[id(s.module)]
    groups: Dict[Tuple[int, str], List[DeviceDef]] = {}
    ours: Set[int] = set()
    for d in facts.defs:
        if d.string:
            small = d.stmt.body[0]
            scope = module_scope if d.name in s.scope(small).globals else s.scope(small)
            groups.setdefault((id(scope.node), d.name), []).append(d)
            ours.add(id(small))
    reads_by_name: Dict[str, List[cst.Name]] = {}
    if groups:
        wanted = {name for _, name in groups}
        for node in s.index.of(cst.Name):
            if node.value in wanted and is_read(s, node):
                reads_by_name.setdefault(node.value, []).append(node)
    for (scope_id, name), defs in groups.items():
        reads, mixed = [], []
        for node in reads_by_name.get(name, ()):
            scope, bindings = s.lookup(name, s.scope(node), s.order(node))
            if scope is None or id(scope.node) != scope_id or not any(id(b.stmt) in ours for b in bindings):
                continue
            reads.append(node)
            # a module-level name that `exec(...)` may rebind (a configurator's overrides)
            mixed.append(not all(id(b.stmt) in ours for b in bindings) or
                         scope is module_scope and facts.runs_code_text)
        found.append(NamedDevice(name, [d.call for d in defs], reads, [], mixed))
    by_attribute: Dict[Tuple[int, str], List[DeviceDef]] = {}
    classes = {}
    for d in facts.attribute_defs:
        fn = s.function(d.stmt)
        cls = fn.cls if fn is not None and d.name.startswith("self.") else None
        if d.name.startswith("self.") and cls is None:
            continue
        by_attribute.setdefault((id(cls), d.name), []).append(d)
        classes[id(cls)] = cls
    attributes = [n for n in s.index.of(cst.Attribute) if isinstance(n.value, cst.Name)] \
        if by_attribute or facts.device_flags else []
    for (cls_id, name), defs in by_attribute.items():
        (root, attr), cls = name.split(".", 1), classes[cls_id]
        targets = {id(small.targets[0].target if isinstance(small, cst.Assign) else small.target)
                   for small in (d.stmt.body[0] for d in defs)}
        same = [n for n in attributes if n.value.value == root and n.attr.value == attr
                and (cls is None or getattr(s.function(n), "cls", None) is cls)]
        reads = [n for n in same if is_read(s, n)]
        elsewhere = any(id(n) not in targets for n in same if not is_read(s, n))  # bound elsewhere too
        found.append(NamedDevice(name, [d.call for d in defs], reads, [], [elsewhere] * len(reads)))
    if facts.device_flags:
        parsed = _parsed_args_names(s, facts)
        for flag in facts.device_flags:
            reads = [n for n in attributes if n.value.value in parsed and n.attr.value == flag.dest and is_read(s, n)]
            found.append(NamedDevice(f"--{flag.dest}", [flag.default], reads, [], [True] * len(reads), flag=True))
    found.extend(_parameter_defaults(s))
    for named in found:
        named.uses = [device_use(s, qualify, read) for read in named.reads]
    return found


def _parameter_defaults(s: Structure) -> List[NamedDevice]:
    """Parameters defaulting to a CUDA device's name (`def train(model, device="cuda")`):
    read in their function; a caller may pass another value, as a flag's user may."""
    found: List[NamedDevice] = []
    for fn in s.functions.values():
        node = fn.node
        if not isinstance(node, cst.FunctionDef):
            continue
        for param in (*node.params.params, *node.params.kwonly_params):
            if param.default is None or cuda_name(param.default) is None or \
                    not isinstance(param.default, (cst.SimpleString, cst.ConcatenatedString)):
                continue
            name = param.name.value
            reads = []
            for read in s.index.subtree(node.body):
                if isinstance(read, cst.Name) and read.value == name and is_read(s, read):
                    scope, bindings = s.lookup(name, s.scope(read), s.order(read))
                    if scope is not None and scope.node is node and all(b.how == "param" for b in bindings):
                        reads.append(read)
            found.append(NamedDevice(name, [param.default], reads, [], [True] * len(reads), flag=True))
    return found


def _parsed_args_names(s: Structure, facts: "DeviceFacts") -> Set[str]:
    """Names that hold a parser's result: bound to `parser.parse_args()`, or to a call of a
    function of this file that returns it (`args = get_args()`)."""
    names = set(facts.parsed_args)
    for fn in s.functions.values():
        if any(is_method_call(r, "parse_args", "parse_known_args") or isinstance(r, cst.Name) and r.value in names
               for r in fn.returns):
            for call in fn.callers:
                stmt = s.statement(call)
                if isinstance(stmt, cst.Assign) and stmt.value is call:
                    target = stmt.targets[0].target
                    if isinstance(target, cst.Tuple) and target.elements:
                        target = target.elements[0].value
                    if isinstance(target, cst.Name):
                        names.add(target.value)
    return names


def _dest(call: cst.Call) -> Optional[str]:
    """The attribute `add_argument` stores into: `dest=`, else the first long option
    (`--device-name` -> `device_name`), else the first name."""
    dest = get_arg(call, "dest")
    if dest is not None:
        return literal_str(dest.value)
    options = [literal_str(a.value) for a in call.args if a.keyword is None and not a.star]
    options = [o for o in options if o]
    longs = [o for o in options if o.startswith("--")]
    chosen = longs[0] if longs else options[0] if options else None
    return chosen.lstrip("-").replace("-", "_") if chosen else None


def _mentions_device(value: cst.BaseExpression, names) -> bool:
    return any(names.qualify(c.func) == "torch.device" for c in findall(value, m.Call()))


# -- how a script uses a value that names a device ------------------------------------------

DEVICE = "device"  # where a device goes: `.to(d)`, `device=d`, `torch.device(d)`, `map_location=d`
TYPE = "type"  # a device type's reads: `d == "cuda"`, `d in ("cuda", "mps")`, `"cuda" in d`, `device_type=d`
NEUTRAL = "neutral"  # printed or formatted: a torch.device prints as well as its name
STRING = "string"  # a string's own operations: `d.startswith("cuda")`, `d + ":0"`, `names[d]`
UNKNOWN = "unknown"  # passed on (to a function of another module, kept in a container, returned)

DEVICE_TYPES = ("cuda", "cpu", "mps", "xpu")
_PRINTS = frozenset({"print", "str", "repr", "format"})
_MAX_DEPTH = 3  # parameters and aliases followed: `device = args.device` -> `Trainer(device)` -> `self.device`
_LOGS = frozenset({"format", "info", "debug", "warning", "warn", "error", "critical", "exception", "log"})


def device_types(node: cst.BaseExpression) -> bool:
    """"cuda", or ("cuda", "mps"): device types, which `device.type` is compared with."""
    if isinstance(node, (cst.Tuple, cst.List, cst.Set)):
        return bool(node.elements) and all(device_types(e.value) for e in node.elements)
    return _text(node, *DEVICE_TYPES) in DEVICE_TYPES


def is_read(s: Structure, node: cst.BaseExpression) -> bool:
    """Does the code read `node` (a name or attribute) here, rather than bind it?"""
    parent = s.parent(node)
    if isinstance(parent, cst.Attribute) and parent.attr is node or \
            isinstance(parent, cst.Arg) and parent.keyword is node or \
            isinstance(parent, (cst.Param, cst.FunctionDef, cst.ClassDef, cst.ImportAlias, cst.NameItem, cst.AsName)):
        return False
    child = node
    while isinstance(parent, (cst.Element, cst.Tuple, cst.List)):
        child, parent = parent, s.parent(parent)
    return not (isinstance(parent, (cst.AssignTarget, cst.AnnAssign, cst.AugAssign, cst.NamedExpr, cst.For,
                                    cst.CompFor)) and parent.target is child)


def device_use(s: Structure, qualify, node: cst.BaseExpression, depth: int = 0) -> str:
    """How the script uses the value read at `node` (one of the kinds above). A value chosen
    (`d if COND else "cpu"`, `d or "cpu"`) is used as the choice is; one passed to a function
    of this file, as that function uses its parameter."""
    child, parent = node, s.parent(node)
    while isinstance(parent, cst.IfExp) and child is not parent.test or isinstance(parent, cst.BooleanOperation):
        child, parent = parent, s.parent(parent)
    if isinstance(parent, cst.Arg) and parent.value is child:
        return _argument_use(s, qualify, parent, depth)
    if isinstance(parent, cst.FormattedStringExpression) or \
            isinstance(parent, (cst.If, cst.While)) and parent.test is child or isinstance(parent, cst.Expr):
        return NEUTRAL
    if isinstance(parent, cst.ComparisonTarget):
        return _comparison_use(s.parent(parent), child)
    if isinstance(parent, cst.Comparison):
        return _comparison_use(parent, child)
    if isinstance(parent, cst.BinaryOperation):
        return NEUTRAL if isinstance(parent.operator, cst.Modulo) and parent.right is child else STRING
    if isinstance(parent, cst.Element) and isinstance(s.parent(parent), cst.Tuple):
        tup = s.parent(parent)
        above = s.parent(tup)  # "%s on %s" % (name, d)
        if isinstance(above, cst.BinaryOperation) and isinstance(above.operator, cst.Modulo) and above.right is tup:
            return NEUTRAL
        return UNKNOWN
    if isinstance(parent, cst.Attribute) and parent.value is child:
        return STRING if hasattr(str, parent.attr.value) and parent.attr.value not in ("index", "type") else UNKNOWN
    if isinstance(parent, cst.Assign) and parent.value is child and len(parent.targets) == 1 and depth < _MAX_DEPTH:
        return _alias_use(s, qualify, parent, parent.targets[0].target, depth)
    if isinstance(parent, (cst.Subscript, cst.Index)):
        return STRING
    return UNKNOWN


def _comparison_use(comparison: cst.Comparison, child: cst.BaseExpression) -> str:
    if len(comparison.comparisons) != 1:
        return STRING
    target = comparison.comparisons[0]
    op, left, right = target.operator, comparison.left, target.comparator
    other = right if child is left else left
    if isinstance(op, (cst.Is, cst.IsNot)):
        return NEUTRAL
    if isinstance(op, (cst.Equal, cst.NotEqual)):
        return TYPE if device_types(other) else STRING
    if isinstance(op, (cst.In, cst.NotIn)):
        if child is left:  # d in ("cuda", "mps")
            return TYPE if isinstance(other, (cst.Tuple, cst.List, cst.Set)) and device_types(other) else STRING
        return TYPE if _text(other, *DEVICE_TYPES) in DEVICE_TYPES else STRING  # "cuda" in d
    return STRING


def _argument_use(s: Structure, qualify, arg: cst.Arg, depth: int) -> str:
    call = s.parent(arg)
    keyword = arg.keyword.value if arg.keyword is not None else None
    if keyword in DEVICE_KEYWORDS:
        return DEVICE
    if keyword == "device_type":
        return TYPE
    if arg.star or not isinstance(call, cst.Call):
        return UNKNOWN
    position = None
    if keyword is None:
        position = [a for a in call.args if a.keyword is None and not a.star].index(arg)
    qualified = qualify(call.func)
    if qualified == "torch.device" and (keyword == "type" or position == 0) or \
            is_method_call(call, "to", "cuda") and position == 0 or \
            qualified == "torch.load" and position == 1 or \
            qualified == "torch.cuda.set_device" or runtime_helper(qualified) == "get_device":
        return DEVICE
    if isinstance(call.func, cst.Name) and call.func.value in _PRINTS and qualified is None or \
            is_method_call(call, *_LOGS):
        return NEUTRAL
    callee = s.callee(call)
    param = _parameter(callee, position, keyword) if callee is not None and depth < _MAX_DEPTH else None
    if param is None:
        return UNKNOWN
    return _combined({device_use(s, qualify, read, depth + 1) for read in s.own(callee.node, cst.Name)
                      if read.value == param and is_read(s, read)})


def _alias_use(s: Structure, qualify, assign: cst.Assign, target: cst.BaseExpression, depth: int) -> str:
    """`device = args.device`, `self.device = device`: used as the alias's reads are."""
    if isinstance(target, cst.Name):
        scope = s.scope(assign)
        reads = []
        for node in s.index.of(cst.Name):
            if node.value == target.value and node is not target and is_read(s, node):
                found, bindings = s.lookup(node.value, s.scope(node), s.order(node))
                if found is scope and any(b.stmt is assign for b in bindings):
                    reads.append(node)
    elif m.matches(target, m.Attribute(value=m.Name("self"))):
        fn = s.function(assign)
        cls = fn.cls if fn is not None else None
        if cls is None:
            return UNKNOWN
        reads = [n for n in s.index.of(cst.Attribute) if n is not target and m.matches(n.value, m.Name("self"))
                 and n.attr.value == target.attr.value and is_read(s, n)
                 and getattr(s.function(n), "cls", None) is cls]
    else:
        return UNKNOWN
    return _combined({device_use(s, qualify, read, depth + 1) for read in reads})


def _combined(uses: Set[str]) -> str:
    """How a value is used through a parameter or an alias: as a device (or printed) only,
    else unknown (a device type's read there would need an edit the caller cannot make)."""
    if uses <= {DEVICE, NEUTRAL}:
        return DEVICE if DEVICE in uses else NEUTRAL
    return UNKNOWN


def _parameter(callee, position: Optional[int], keyword: Optional[str]) -> Optional[str]:
    """The parameter of a same-file function that an argument binds."""
    names = callee.param_names()
    if keyword is not None:
        return keyword if keyword in names else None
    return next((n for n in names if callee.position(n) == position), None)
