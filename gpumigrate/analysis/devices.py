"""What a script says about devices: where it builds one, the flags that choose CUDA, and
every place that hard-codes CUDA (`.cuda()`, `"cuda:0"`, CUDA tensor types, `torch.load`
without `map_location`). Read by the device plan, which decides what to put there.

One linear scan of the node index: no traversal of its own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Optional, Set, Tuple

import libcst as cst

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
    names = [literal_str(node.body), literal_str(node.orelse)]
    return "cpu" in names and any(cuda_string_index(n)[0] for n in names)


@dataclass
class DeviceDef:
    name: str
    stmt: cst.SimpleStatementLine
    call: cst.BaseExpression  # torch.device(...), get_device(...), or an IfExp choosing between devices
    funcs: Tuple[cst.FunctionDef, ...]
    top: int  # statement order in the file
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
    funcs: Tuple[cst.FunctionDef, ...]
    top: int
    only_availability: bool  # `cuda = torch.cuda.is_available()`: not a user choice


@dataclass
class Site:
    top: int
    funcs: Tuple[cst.FunctionDef, ...]
    index: Optional[int]
    literal_index: bool  # no index, or a literal one


class DeviceFacts:
    """Found in one pass over the node index, in source order (`top` counts statement lines,
    as "after" does for module-level names)."""

    def __init__(self, module: cst.Module, index, names) -> None:
        self.names = names
        self.module = module
        self.sites: List[Site] = []
        self.defs: List[DeviceDef] = []
        self.flags: List[Flag] = []
        self.args_name: Optional[Tuple[str, cst.SimpleStatementLine, tuple, int]] = None
        self.cuda_argument = False
        self.indices: Set[int] = set()
        self._def_calls: Set[int] = set()  # a definition's own torch.device(...) is not a use
        funcs: List[Tuple[cst.FunctionDef, int]] = []
        top = -1
        for i, node in enumerate(index.order):
            while funcs and i >= funcs[-1][1]:
                funcs.pop()
            here = (tuple(f for f, _ in funcs), top)
            kind = type(node)
            if kind is cst.FunctionDef:
                funcs.append((node, index.end[id(node)]))
            elif kind is cst.SimpleStatementLine:
                top += 1
                here = (here[0], top)
                if len(node.body) == 1 and isinstance(node.body[0], cst.Assign) and len(node.body[0].targets) == 1:
                    self._assignment(node, node.body[0].targets[0].target, node.body[0].value, here)
            elif kind is cst.Call:
                self._call(node, here)
            elif kind is cst.Attribute and cuda_type_dtype(names.qualify(node)):
                self.sites.append(Site(here[1], here[0], None, True))

    def _assignment(self, stmt, target: cst.BaseExpression, value: cst.BaseExpression, here) -> None:
        names = self.names
        funcs, top = here
        if isinstance(target, cst.Name) and isinstance(value, cst.Call):
            qualified = names.qualify(value.func)
            if qualified == "torch.device":
                first = get_arg(value, "type", 0)
                is_cuda, _ = cuda_string_index(literal_str(first.value) if first else None)
                # torch.device("cuda" if torch.cuda.is_available() else "cpu")
                choice = first.value if first is not None and cuda_or_cpu(first.value) else None
                self.defs.append(DeviceDef(target.value, stmt, value, funcs, top, hardcoded=is_cuda or bool(choice),
                                           choice=choice))
                self._def_calls.add(id(value))
                return
            if runtime_helper(qualified) in ("get_device", "setup_distributed"):
                self.defs.append(DeviceDef(target.value, stmt, value, funcs, top, hardcoded=False))
                return
            if qualified in ("argparse.ArgumentParser.parse_args",) or is_method_call(value, "parse_args"):
                self.args_name = (target.value, stmt, funcs, top)
        if isinstance(target, cst.Name) and cuda_or_cpu(value):
            # device = "cuda" if torch.cuda.is_available() else "cpu"
            self.defs.append(DeviceDef(target.value, stmt, value, funcs, top, hardcoded=True, choice=value,
                                       string=True))
            return
        if isinstance(target, cst.Name) and isinstance(value, cst.IfExp):
            # device = torch.device('cuda', args.local_rank) if torch.cuda.is_available() else torch.device('cpu')
            branches = [b for b in (value.body, value.orelse)
                        if isinstance(b, cst.Call) and names.qualify(b.func) == "torch.device"]
            if len(branches) == 2:
                hardcoded = any(torch_device_index(b)[0] for b in branches)
                self.defs.append(DeviceDef(target.value, stmt, value, funcs, top, hardcoded=hardcoded,
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
                self.flags.append(Flag(code, target, stmt, funcs, top, only))

    def _call(self, node: cst.Call, here) -> None:
        names = self.names
        funcs, top = here
        if is_method_call(node, "cuda"):
            arg = get_arg(node, "device", 0)
            index = literal_int(arg.value) if arg else None
            self.sites.append(Site(top, funcs, index, arg is None or index is not None))
            return
        if is_method_call(node, "add_argument"):
            first = get_arg(node, "", 0)
            if first and literal_str(first.value) == "--cuda":
                self.cuda_argument = True
            return
        qualified = names.qualify(node.func)
        if qualified == "torch.device":
            is_cuda, index = torch_device_index(node)
            if is_cuda and id(node) not in self._def_calls:
                self.sites.append(Site(top, funcs, index, True))
            elif is_cuda and index is not None:
                self.indices.add(index)  # a definition's index counts toward model parallelism
            return
        if qualified == "torch.load" and get_arg(node, "map_location", 1) is None:
            self.sites.append(Site(top, funcs, None, True))
        if cuda_type_dtype(qualified):
            self.sites.append(Site(top, funcs, None, True))
        for arg in node.args:
            if arg.keyword is None or arg.keyword.value == "device":
                is_cuda, index = cuda_string_index(literal_str(arg.value))
                if is_cuda and (arg.keyword is not None or is_method_call(node, "to")):
                    self.sites.append(Site(top, funcs, index, True))


def _mentions_device(value: cst.BaseExpression, names) -> bool:
    return any(names.qualify(c.func) == "torch.device" for c in findall(value, m.Call()))


