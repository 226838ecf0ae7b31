"""Device-agnostic placement: GM101-GM106; and where the runtime is imported from: GM100."""

from __future__ import annotations

import functools
from typing import Any, Dict, List, Optional

import libcst as cst

from gpumigrate.analysis import script_model
from gpumigrate.analysis import values as v
from gpumigrate.analysis.devices import (
    CUDA_TYPES,
    DEVICE_KEYWORDS,
    CudaName,
    cuda_name,
    cuda_or_cpu,
    device_use,
    local_rank_index,
)
from gpumigrate.analysis.syntax import runtime_helper, walk
from gpumigrate.codemods.base import Clean, Flagged, Rule
from gpumigrate.codemods.device_plan import (
    replace_calls,
    cuda_type_dtype,
    device_plan,
    torch_device_index,
)
from gpumigrate.codemods.helpers import (
    findall,
    get_arg,
    is_method_call,
    keyword_arg,
    literal_str,
    defined_in,
    name_assigns,
    remove_statement,
    runtime_module,
    runtime_name,
    with_args,
)
from gpumigrate.rewriter.facts import SourceFacts
from gpumigrate.rewriter.lazy import matchers as m
from gpumigrate.rewriter.names import dotted
from gpumigrate.rewriter.vendor import RUNTIME_PACKAGE, VENDORED_MODULE

@functools.lru_cache(maxsize=1)
def _cuda_method() -> Any:
    """One matcher object (made at first use: see rewriter/lazy.py), so `find` can remember it."""
    return m.Call(func=m.Attribute(attr=m.Name("cuda")))
_SET_DEVICE = "`torch.cuda.set_device` hard-codes the GPU; `get_device()` picks it (LOCAL_RANK's GPU under torchrun)"
_ACCELERATOR_GUARD = ("`torch.cuda.is_available()` guards a move to the device: `accelerator_available()` asks "
                      "what `get_device()` answers, so data and model meet on a Mac's GPU (MPS) too")
_ACCELERATOR_CHOICE = ("`torch.cuda.is_available()` chooses between the device and the CPU: "
                       "`accelerator_available()` asks what `get_device()` answers (MPS on a Mac too)")
_ACCELERATOR_FLAG = ("`torch.cuda.is_available()` chooses the device: `accelerator_available()` counts a Mac's GPU "
                     "(MPS) and the other accelerators too; the flag still selects the CPU")


class CudaCall(Rule):
    """
    ## What it does
    Finds `.cuda()`, `.cuda(n)`, `.cuda(non_blocking=True)` and `.cuda(device=n)` calls on
    modules and tensors.

    ## Why is this bad?
    `.cuda()` hard-codes NVIDIA GPUs: the script fails on a CPU-only machine or a Mac (MPS).

    ## Example
    ```python
    model = Net().cuda()
    data = data.cuda(non_blocking=True)
    ```

    ## Use instead
    ```python
    device = get_device()  # from gpumigrate.runtime: the accelerator (CUDA, MPS, XPU...), else the CPU
    model = Net().to(device)
    data = data.to(device, non_blocking=True)
    ```
    A script that places modules on several GPUs (`encoder.cuda(0)`, `decoder.cuda(1)`)
    keeps its placement: `.to(get_device(1))` is the second accelerator, or the CPU.
    """

    code = "GM101"
    done = "`.cuda()` → `.to(device)`"
    name = "cuda-call"
    message = "`.cuda()` hard-codes the device; use `.to(device)`"
    fixed_in = frozenset({"device"})
    triggers = ("cuda",)

    # every report is a `<expr>.cuda(...)` call
    @classmethod
    def gate(cls, facts: SourceFacts) -> bool:
        return facts.any_call("cuda")

    examples = (
        Flagged(
            "import torch\nx = torch.ones(2).cuda()\n",
            fixed="import torch\nfrom gpumigrate.runtime import get_device\n\ndevice = get_device()\n"
            "x = torch.ones(2).to(device)\n",
        ),
        Flagged(
            "import torch\n\nx = torch.ones(2).cuda(non_blocking=True)\n",
            fixed="import torch\nfrom gpumigrate.runtime import get_device\n\ndevice = get_device()\n\n"
            "x = torch.ones(2).to(device, non_blocking=True)\n",
        ),
        Flagged(
            "import torch.nn as nn\nenc = nn.Linear(2, 2).cuda(0)\ndec = nn.Linear(2, 2).cuda(device=1)\n",
            fixed="import torch.nn as nn\nfrom gpumigrate.runtime import get_device\n\n"
            "enc = nn.Linear(2, 2).to(get_device(0))\ndec = nn.Linear(2, 2).to(get_device(1))\n",
        ),
        Clean("import torch\nx = torch.ones(2).to(device)\n"),
        Clean("import torch\nif torch.cuda.is_available():\n    pass\n"),
        Clean("use_cuda = args.cuda  # an attribute named cuda, not a call\n"),
        # an agent of plain objects with a `cuda()` of its own, which moves its networks
        Clean("class Agent(object):\n    def __init__(self, cuda):\n        if cuda:\n            self.cuda()\n"
              "    def cuda(self):\n        self.on_gpu = True\n"),
    )

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> Optional[cst.Call]:
        if not is_method_call(original, "cuda") or self._own_method(original.func.value, "cuda"):
            return None
        self.report(original.func.attr)
        if not self.fixing:
            return None
        index = get_arg(updated, "device", 0)
        rest = [a for a in updated.args if a is not index]
        plan = device_plan(self.ctx)
        named = get_arg(original, "device", 0)
        if named is not None and plan.holds_device(named.value):  # `dev = "cuda"` ... `x.cuda(dev)`
            device = index.value
        else:
            device = plan.device_expr(index.value if index else None, self.fixing)
        func = updated.func.with_changes(attr=cst.Name("to"))
        return with_args(updated.with_changes(func=func), [cst.Arg(device)] + rest)


    def _own_method(self, receiver: cst.BaseExpression, method: str) -> bool:
        """An object of a class of the project that defines `method` itself (`AliasMethod.cuda()`
        moving its own tensors): its method, which the migration of its module makes
        device-agnostic, not a tensor's."""
        s = script_model(self.ctx).s
        if isinstance(receiver, cst.Name) and receiver.value == "self":  # `self.cuda()` in a class that has one
            cls = s.instance_class(receiver, s.scope(receiver))
            return cls is not None and method in cls.methods
        if isinstance(receiver, cst.Attribute) and isinstance(receiver.value, cst.Name) and \
                receiver.value.value == "self":
            cls = s.instance_class(receiver.value, s.scope(receiver))
            bindings = cls.attrs.get(receiver.attr.value, []) if cls is not None else []
        elif isinstance(receiver, cst.Name):
            bindings = s.all_bindings(receiver.value, s.scope(receiver))
        else:
            return False
        return bool(bindings) and all(b.how == "assign" and isinstance(b.value, cst.Call) and
                                      self._class_defines(b.value.func, method) for b in bindings)

    def _class_defines(self, func: cst.BaseExpression, method: str) -> bool:
        s = script_model(self.ctx).s
        if isinstance(func, cst.Name) and func.value in s.classes_by_name:
            return method in s.classes_by_name[func.value].methods
        link, name = defined_in(self.ctx, func)
        return link is not None and f"{name}.{method}" in link.methods


class CudaTensorType(Rule):
    """
    ## What it does
    Finds the CUDA tensor types: `torch.cuda.FloatTensor(...)`, `x.type(torch.cuda.LongTensor)`
    and the `Tensor = torch.cuda.FloatTensor if cuda else torch.FloatTensor` idiom.

    ## Why is this bad?
    These types exist only on CUDA builds; elsewhere they raise "type torch.cuda.FloatTensor
    not available". The legacy constructors are also ambiguous (sizes or data).

    ## Example
    ```python
    Tensor = torch.cuda.FloatTensor if cuda else torch.FloatTensor
    valid = Tensor(imgs.size(0), 1).fill_(1.0)
    real = imgs.type(Tensor)
    ```

    ## Use instead
    ```python
    Tensor = tensor_type(torch.float32, device)  # from gpumigrate.runtime
    valid = Tensor(imgs.size(0), 1).fill_(1.0)
    real = imgs.to(device, torch.float32)
    ```
    """

    code = "GM102"
    done = "CUDA tensor type → a tensor built with a dtype and the device"
    name = "cuda-tensor-type"
    message = "CUDA tensor types exist only on CUDA builds; build tensors with a dtype and a device"
    fixed_in = frozenset({"device"})
    triggers = ("Tensor",)

    # a name qualified as `torch.cuda.<T>Tensor` (each part an identifier), or `.type("torch.cuda.<T>Tensor")`
    @classmethod
    def gate(cls, facts: SourceFacts) -> bool:
        return (facts.any_id("cuda") and facts.any_id(*CUDA_TYPES)) or (
            facts.any_call("type") and any(cuda_type_dtype(s) for s in facts.strings))

    examples = (
        Flagged(
            "import torch\nTensor = torch.cuda.FloatTensor if cuda else torch.FloatTensor\n"
            "x = torch.ones(2).type(Tensor)\n",
            fixed="import torch\nfrom gpumigrate.runtime import get_device, tensor_type\n\n"
            "device = get_device()\nTensor = tensor_type(torch.float32, device)\n"
            "x = torch.ones(2).to(device, torch.float32)\n",
        ),
        Flagged(
            "import torch\n\nidx = torch.cuda.LongTensor([1, 2])\n",
            fixed="import torch\nfrom gpumigrate.runtime import get_device, tensor_type\n\n"
            "device = get_device()\n\nidx = tensor_type(torch.int64, device)([1, 2])\n",
        ),
        Clean("import torch\nx = torch.FloatTensor(2, 3)\n"),
    )

    def visit_Module(self, node: cst.Module) -> None:
        self.aliases: Dict[str, str] = {}
        for assign in name_assigns(node):
            value = assign.value
            branches = [value.body, value.orelse] if isinstance(value, cst.IfExp) else [value]
            for branch in branches:
                dtype = cuda_type_dtype(self.qualify(branch))
                if dtype:
                    self.aliases[assign.targets[0].target.value] = dtype

    def _factory(self, dtype: str) -> cst.Call:
        plan = device_plan(self.ctx)
        if self.fixing:
            self.ctx.add_import(runtime_module(self.ctx), "tensor_type")
        return cst.Call(
            func=cst.Name("tensor_type"),
            args=[cst.Arg(plan.torch_name(dtype)), cst.Arg(plan.device_expr(None, self.fixing))],
        )

    def leave_IfExp(self, original: cst.IfExp, updated: cst.IfExp) -> Optional[cst.BaseExpression]:
        for branch in (original.body, original.orelse):
            dtype = cuda_type_dtype(self.qualify(branch))
            if dtype:
                self.report(original)
                return self._factory(dtype)
        return None

    def _type_target(self, node: cst.BaseExpression) -> Optional[str]:
        if isinstance(node, cst.Name) and node.value in self.aliases:
            return self.aliases[node.value]
        text = literal_str(node)
        return cuda_type_dtype(text if text is not None else self.qualify(node))

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> Optional[cst.Call]:
        if is_method_call(original, "type") and len(original.args) == 1 and original.args[0].keyword is None:
            dtype = self._type_target(original.args[0].value)
            if dtype:
                self.report(original)
                plan = device_plan(self.ctx)
                args = [cst.Arg(plan.device_expr(None, self.fixing)), cst.Arg(plan.torch_name(dtype))]
                return with_args(updated.with_changes(func=updated.func.with_changes(attr=cst.Name("to"))), args)
        return None

    def leave_Attribute(self, original: cst.Attribute, updated: cst.Attribute) -> Optional[cst.BaseExpression]:
        dtype = cuda_type_dtype(self.qualify(original))
        if not dtype:
            return None
        parent = self.ctx.ancestors[-1] if self.ctx.ancestors else None
        grand = self.ctx.ancestors[-2] if len(self.ctx.ancestors) > 1 else None
        if isinstance(parent, cst.IfExp) or (isinstance(parent, cst.Arg) and is_method_call(grand, "type")):
            return None  # the enclosing expression's fix covers it
        if isinstance(parent, cst.Arg) and isinstance(grand, cst.Call) and m.matches(grand.func, m.Name("isinstance")):
            self.report(original, "isinstance against a CUDA tensor type; check `x.is_cuda` or `x.dtype`", review=True)
            return None
        self.report(original)
        return self._factory(dtype)


class HardcodedDevice(Rule):
    """
    ## What it does
    Finds hard-coded CUDA devices: `torch.device("cuda:0")`, `"cuda"` strings passed as
    devices (`f"cuda:{i}"` and `"cuda:%d" % i` too), names, attributes and `--device` flags
    bound to such a string and used as a device (`dev = "cuda"`, `self.device = "cuda:0"`,
    `parser.add_argument('--device', default='cuda')`), `torch.cuda.set_device(n)`, and
    `if args.cuda:` / `if use_cuda:` guards around `.cuda()` calls; and devices chosen
    between CUDA and the CPU (`"cuda" if torch.cuda.is_available() else "cpu"`,
    `args.cuda = not args.no_cuda and torch.cuda.is_available()`).

    ## Why is this bad?
    The script fails wherever there is no CUDA GPU, and `set_device` fights torchrun's
    `LOCAL_RANK` placement. A choice between CUDA and the CPU runs on the CPU on a Mac (MPS)
    or with another accelerator (XPU).

    ## Example
    ```python
    device = torch.device("cuda:0")
    torch.cuda.set_device(0)
    if args.cuda:
        model.cuda()
    ```

    ## Use instead
    ```python
    device = get_device()  # the accelerator (LOCAL_RANK's under torchrun: CUDA, MPS, XPU...), else the CPU
    model.to(device)
    ```
    A `--no-cuda` flag keeps its meaning: the device becomes
    `get_device() if args.cuda else torch.device("cpu")`, and the flag's
    `torch.cuda.is_available()` becomes `accelerator_available()` (unless a CUDA-only call
    such as `torch.cuda.get_device_name()` runs under the flag: then it is kept and reported).
    `device = "cuda" if torch.cuda.is_available() else "cpu"` (or `device = "cuda"`) becomes
    `device = get_device()`, a torch.device: `device == "cuda"` becomes `device.type ==
    "cuda"`, `"cuda" in device` becomes `"cuda" in device.type`, `device_type=device` becomes
    `device_type=device.type`. Where the script also reads it as a string in another way
    (`device.startswith("cuda")`, a function of another module), it stays a string naming
    the runtime's device (`get_device().type`, `str(get_device(1))`), and this is reported.
    A `--device` flag's CUDA default becomes `get_device().type` (`--device cpu` still
    chooses). `f"cuda:{i}"` becomes `get_device(i)`. A name only used as a device type
    (`device_type = "cuda" if "cuda" in device else "cpu"`, read by autocast and compared
    with "cuda") stays as it is. A GPU index that only an `if
    use_cuda:` guard defines (`gpu = args.gpu`) is defined on every device once the
    `.cuda(gpu)` calls leave their guards; where its value could fail or do something
    (`torch.cuda.current_device()`), those guards stay.
    """

    code = "GM103"
    done = "hard-coded CUDA device → the device from `get_device()`"
    name = "hardcoded-device"
    message = "hard-coded CUDA device; use the device from `get_device()`"
    fixed_in = frozenset({"device"})
    triggers = ("cuda",)

    # `torch.cuda.set_device` or `current_device`, or a "cuda[:n]" literal in `torch.device(...)`,
    # `device=` or `.to(...)`
    # ... or `torch.cuda.is_available()` in a flag that chooses the device
    @classmethod
    def gate(cls, facts: SourceFacts) -> bool:
        return facts.any_id("set_device", "is_available", "current_device") or (
            facts.any_id("device", *DEVICE_KEYWORDS) or facts.any_call("to", "cuda", "load", "add_argument")) and any(
            s == "cuda" or s.startswith("cuda:") for s in facts.strings)

    examples = (
        Flagged(
            'import torch\ndev = torch.device("cuda:0")\nx = torch.zeros(2, device="cuda")\n',
            fixed="import torch\nfrom gpumigrate.runtime import get_device\n\n"
            "dev = get_device()\nx = torch.zeros(2, device=dev)\n",
        ),
        Flagged(
            "import torch\ntorch.cuda.set_device(0)\nx = torch.ones(1)\n",
            fixed="import torch\nx = torch.ones(1)\n",
        ),
        Flagged(  # the flag asks for any accelerator; --no-cuda still means the CPU
            "import torch\nargs.cuda = not args.no_cuda and torch.cuda.is_available()\n"
            'if args.cuda:\n    model.cuda()\nx = torch.zeros(1, device="cuda")\n',
            fixed="import torch\nfrom gpumigrate.runtime import accelerator_available, get_device\n\n"
            "args.cuda = not args.no_cuda and accelerator_available()\n"
            'device = get_device() if args.cuda else torch.device("cpu")\nmodel.to(device)\n'
            "x = torch.zeros(1, device=device)\n",
        ),
        Flagged(  # the GPU index defined under the guard too; the dead `else: pass` goes with it
            "import torch\nuse_cuda = torch.cuda.is_available()\nif use_cuda:\n    gpu = 0\n"
            "model = torch.nn.Linear(2, 2)\nif use_cuda:\n    model.cuda(gpu)\nelse:\n    pass\n"
            'x = torch.zeros(1, device="cuda")\n',
            fixed="import torch\nfrom gpumigrate.runtime import get_device\n\ndevice = get_device()\n"
            "use_cuda = torch.cuda.is_available()\ngpu = 0\nmodel = torch.nn.Linear(2, 2)\n"
            "model.to(get_device(gpu))\nx = torch.zeros(1, device=device)\n",
        ),
        Flagged(  # CUDA or the CPU: the CPU on a Mac
            'import torch\ndevice = torch.device("cuda" if torch.cuda.is_available() else "cpu")\n',
            fixed="import torch\nfrom gpumigrate.runtime import get_device\n\ndevice = get_device()\n",
        ),
        Flagged(  # a device named by a string is a torch.device now: compared by its type
            "import torch\ndevice = 'cuda' if torch.cuda.is_available() else 'cpu'\n"
            "x = torch.zeros(1).to(device)\nif device == 'cuda':\n    torch.backends.cudnn.benchmark = True\n",
            fixed="import torch\nfrom gpumigrate.runtime import get_device\n\ndevice = get_device()\n"
            "x = torch.zeros(1).to(device)\nif device.type == 'cuda':\n    torch.backends.cudnn.benchmark = True\n",
        ),
        Flagged(  # the current CUDA device's index, bound to a name only used as a device
            'import torch\n\ndef main(args):\n    device = torch.cuda.current_device()\n    if args.cpu:\n'
            '        device = "cpu"\n    return torch.zeros(2).to(device)\n',
            fixed="import torch\nfrom gpumigrate.runtime import get_device\n\ndef main(args):\n"
            '    device = get_device()\n    if args.cpu:\n        device = "cpu"\n'
            '    return torch.zeros(2).to(device)\n',
        ),
        Flagged(  # a name bound to a CUDA device's name, in any scope, used as a device
            'import torch\n\ndef to_gpu(t):\n    dev = "cuda:0"\n    return t.to(dev)\n',
            fixed="import torch\nfrom gpumigrate.runtime import get_device\n\n"
            "def to_gpu(t):\n    dev = get_device()\n    return t.to(dev)\n",
        ),
        Flagged(  # a computed index keeps its meaning: the i-th accelerator
            "import torch\nx = torch.zeros(2, device=f'cuda:{rank}')\ny = x.to('cuda:%d' % rank)\n",
            fixed="import torch\nfrom gpumigrate.runtime import get_device\n\n"
            "x = torch.zeros(2, device=get_device(rank))\ny = x.to(get_device(rank))\n",
        ),
        Flagged(  # a flag's default names a device this machine has; `--device cpu` still chooses
            "import argparse\nimport torch\nparser = argparse.ArgumentParser()\n"
            "parser.add_argument('--device', default='cuda')\nargs = parser.parse_args()\n"
            "model = torch.nn.Linear(2, 2).to(args.device)\n",
            fixed="import argparse\nimport torch\nfrom gpumigrate.runtime import get_device\n\n"
            "parser = argparse.ArgumentParser()\n"
            "parser.add_argument('--device', default=get_device().type)\nargs = parser.parse_args()\n"
            "model = torch.nn.Linear(2, 2).to(args.device)\n",
        ),
        Clean('import torch\ndevice = get_device() if args.cuda else torch.device("cpu")\n'),
        Clean('import torch\nx = torch.zeros(2, device="cpu")\nname = "cuda"\n'),
        Clean(  # a device type: read by autocast and compared with "cuda", never used as a device
            "import torch\ndevice_type = 'cuda' if 'cuda' in args.device else 'cpu'\n"
            "ctx = torch.autocast(device_type=device_type, dtype=torch.bfloat16)\nfused = device_type == 'cuda'\n"
        ),
    )

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> Optional[cst.BaseExpression]:
        qualified = self.qualify(original.func)
        if qualified == "torch.cuda.is_available":
            return self._accelerator_flag(original)
        if qualified == "torch.cuda.current_device" and not original.args and self._named_for_devices(original):
            self.report(original)  # `device = torch.cuda.current_device()`, then `x.to(device)`
            return cst.Call(func=runtime_name(self.ctx, "get_device", self.fixing))
        if qualified == "torch.device":
            is_cuda, index = torch_device_index(original)
            first = get_arg(original, "type", 0)
            choice = first.value if first is not None and cuda_or_cpu(first.value) else None
            named = cuda_name(first.value) if first is not None else None
            if not is_cuda and choice is None and (named is None or named.computed is None):
                return None
            plan = device_plan(self.ctx)
            if plan.in_definition(original):
                return None
            self.report(original)
            definition = plan.existing_definition(original)
            if definition is not None:
                return plan.redefine(definition)
            if choice is not None:  # torch.device("cuda" if torch.cuda.is_available() else "cpu") in place
                return plan.redefine_choice(choice)
            if not is_cuda:  # torch.device(f"cuda:{i}")
                return self._named_device(named)
            index_node = cst.Integer(str(index)) if index is not None else None
            return plan.device_expr(index_node, self.fixing)
        if is_method_call(original, "format") and cuda_name(original) is not None:
            return self._named_value(original)  # dev = "cuda:{}".format(i)
        args, changed = list(updated.args), False
        for i, arg in enumerate(original.args):
            if arg.keyword is None and not is_method_call(original, "to"):
                continue
            if arg.keyword is not None and arg.keyword.value not in DEVICE_KEYWORDS:
                continue
            named = cuda_name(arg.value)
            if named is not None:
                self.report(arg.value)
                args[i] = args[i].with_changes(value=self._named_device(named))
                changed = True
        return updated.with_changes(args=args) if changed else None

    def _named_for_devices(self, call: cst.Call) -> bool:
        """`name = torch.cuda.current_device()` where every other use of `name` in its scope
        is a device: `.to(name)`, `device=name`, `map_location=name`, or a binding of its own
        (`if args.cpu: name = "cpu"`). Not `.cuda(name)`: an index there (`get_device(name)`)."""
        s = script_model(self.ctx).s
        assign = s.parent(call)
        if not (isinstance(assign, cst.Assign) and len(assign.targets) == 1
                and isinstance(assign.targets[0].target, cst.Name)):
            return False
        name = assign.targets[0].target.value
        scope = s.scope(call)
        uses = [n for n in s.inside(scope.node, cst.Name) if n.value == name and s.scope(n) is scope]
        for use in uses:
            parent = s.parent(use)
            if isinstance(parent, cst.AssignTarget):
                continue
            if isinstance(parent, cst.Arg) and (
                    parent.keyword is not None and parent.keyword.value in DEVICE_KEYWORDS or parent.keyword is None
                    and is_method_call(s.parent(parent), "to") and s.parent(parent).args[0] is parent):
                continue
            return False
        return True

    def _named_device(self, named: CudaName) -> cst.BaseExpression:
        """Where a CUDA device's name is used as a device: `"cuda"` -> `device`, `"cuda:1"` ->
        `get_device(1)`, `f"cuda:{i}"` -> `get_device(i)`."""
        plan = device_plan(self.ctx)
        if named.computed is not None and not local_rank_index(named.computed):
            return plan.runtime_device(named, self.fixing)
        index = cst.Integer(str(named.index)) if named.index is not None else None
        return plan.device_expr(index, self.fixing)

    def _named_value(self, original: cst.BaseExpression) -> Optional[cst.BaseExpression]:
        """A CUDA device's name bound to a name, an attribute or a `--device` default: what the
        plan decided it becomes (the runtime's device, or a string naming it), said once per name."""
        plan = device_plan(self.ctx)
        mode = plan.mode(original)
        if mode is None:
            return None
        holder = plan.named[id(original)]
        if holder.flag:
            self.report(original, f"`{holder.name}` defaults to a CUDA device: the default becomes the name of the "
                                  "device `get_device()` picks on this machine; a device given on the command line "
                                  "is kept")
        elif mode == "string":
            self.report(original, f"`{holder.name}` names a CUDA device: it becomes the name of the device "
                                  "`get_device()` picks, still a string")
        else:
            self.report(original)
        if original is holder.values[0]:  # said once per name
            for where, why in plan.reviews.get(id(holder), ()):
                self.report(where, why, review=True)
        return plan.rewrite_named(original)

    def leave_SimpleString(self, original: cst.SimpleString, updated: cst.SimpleString):
        if cuda_name(original) is None:
            return None
        return self._named_value(original)  # dev = "cuda"; parser.add_argument('--device', default='cuda')

    def leave_FormattedString(self, original: cst.FormattedString, updated: cst.FormattedString):
        return self._named_value(original) if cuda_name(original) is not None else None  # dev = f"cuda:{i}"

    def leave_BinaryOperation(self, original: cst.BinaryOperation, updated: cst.BinaryOperation):
        return self._named_value(original) if cuda_name(original) is not None else None  # dev = "cuda:%d" % i

    def leave_IfExp(self, original: cst.IfExp, updated: cst.IfExp):
        choice = cuda_or_cpu(original)
        if not choice and not any(isinstance(b, cst.Call) and self.qualify(b.func) == "torch.device"
                                  for b in (original.body, original.orelse)):
            return None
        plan = device_plan(self.ctx)
        if id(original) in plan.named:  # device = "cuda" if torch.cuda.is_available() else "cpu"
            return self._named_value(original)
        definition = plan.existing_definition(original)
        if definition is None and choice and self._used_as_device(original):
            self.report(original)  # x.to("cuda" if torch.cuda.is_available() else "cpu")
            return plan.redefine_choice(original)
        if definition is None or not definition.hardcoded:
            return None
        self.report(original)
        return plan.redefine(definition)

    def _used_as_device(self, choice: cst.IfExp) -> bool:
        """A choice of device used where a device goes (not in `torch.device(...)`, whose
        own fix covers it)."""
        s = script_model(self.ctx).s
        parent, grand = s.parent(choice), s.parent(s.parent(choice))
        if isinstance(parent, cst.Arg) and isinstance(grand, cst.Call) and self.qualify(grand.func) == "torch.device":
            return False
        return device_use(s, self.qualify, choice) == "device"

    def _accelerator_flag(self, original: cst.Call) -> Optional[cst.BaseExpression]:
        """`torch.cuda.is_available()` in the flag that chooses the device
        (`args.cuda = not args.no_cuda and ...`): any accelerator counts."""
        plan = device_plan(self.ctx)
        if id(original) in plan.accelerator_calls:
            self.report(original, _ACCELERATOR_FLAG)
            return cst.Call(func=runtime_name(self.ctx, "accelerator_available", self.fixing))
        if id(original) in plan.choice_calls:
            self.report(original, _ACCELERATOR_CHOICE)
            return cst.Call(func=runtime_name(self.ctx, "accelerator_available", self.fixing))
        guard = plan.accelerator_guard(original)
        if "GM101" in self.ctx.fixing and isinstance(guard, cst.IfExp) and not (
                "GM102" in self.ctx.fixing and any(cuda_type_dtype(self.qualify(b)) for b in (guard.body, guard.orelse))):
            # (a choice of CUDA tensor type goes whole: GM102's `tensor_type(dtype, device)`)
            self.report(original, _ACCELERATOR_GUARD)  # `if` statements: leave_If, once it knows the guard stays
            return cst.Call(func=runtime_name(self.ctx, "accelerator_available", self.fixing))
        for call, why in plan.kept_flags:
            if call is original:
                self.report(original, why, review=True)
        return None

    def leave_Name(self, original: cst.Name, updated: cst.Name):
        if original.value in self._string_names:
            return self._device_type(original, updated)
        return None

    def leave_Attribute(self, original: cst.Attribute, updated: cst.Attribute):
        if original.attr.value in self._string_names and isinstance(original.value, cst.Name):
            return self._device_type(original, updated)  # self.device == "cuda"
        return None

    def _device_type(self, original: cst.BaseExpression, updated: cst.BaseExpression):
        """`device == "cuda"`, `"cuda" in device`, `device_type=device`, where `device` is a
        torch.device now (`get_device()`): its type is the string the script compared."""
        if id(original) not in device_plan(self.ctx).typed:
            return None
        code = self.ctx.module.code_for_node(original)
        self.report(original, f"`{code}` is a torch.device now (`get_device()`): its type is the string "
                              "`\"cuda\"`/`\"cpu\"` the script compares")
        return cst.Attribute(value=updated, attr=cst.Name("type"))

    @functools.cached_property
    def _string_names(self) -> frozenset:
        """Names (and attributes: `self.device`) of devices the script names by strings
        ("cuda"/"cpu"): few files have one."""
        scanner = script_model(self.ctx).devices
        return frozenset([d.name for d in scanner.defs if d.string] +
                         [d.name.split(".", 1)[1] for d in scanner.attribute_defs])

    def leave_SimpleStatementLine(self, original, updated):
        keep = []
        guard = self.ctx.ancestors[-2] if len(self.ctx.ancestors) > 1 else None
        whole_if = isinstance(guard, cst.If) and self._only_set_device(guard) and isinstance(guard.body, cst.IndentedBlock)
        for small, new in zip(original.body, updated.body):
            if m.matches(small, m.Expr(m.Call())) and self.qualify(small.value.func) == "torch.cuda.set_device":
                if not whole_if:  # else the `if` reports, as it goes too
                    self.report(small.value, _SET_DEVICE)
            else:
                keep.append(new)
        if len(keep) == len(updated.body):
            return None
        if not keep:
            return remove_statement(self.ctx, updated)
        keep[-1] = keep[-1].with_changes(semicolon=cst.MaybeSentinel.DEFAULT)
        return updated.with_changes(body=keep)

    def _only_set_device(self, node: cst.If) -> bool:
        body = node.body.body
        return node.orelse is None and all(
            isinstance(s, cst.SimpleStatementLine) and all(
                m.matches(small, m.Expr(m.Call())) and self.qualify(small.value.func) == "torch.cuda.set_device"
                for small in s.body) for s in body)

    def leave_If(self, original: cst.If, updated: cst.If):
        dropped = self._drop_guard(original, updated)
        if dropped is not None or not updated.test.deep_equals(original.test):  # another fix's test: leave it
            return dropped
        calls = [c for c in findall(original.test, m.Call()) if self.qualify(c.func) == "torch.cuda.is_available"]
        if "GM101" not in self.ctx.fixing or not calls:
            return None
        plan = device_plan(self.ctx)
        guards = {id(c) for c in calls if plan.accelerator_guard(c) is original}
        if not guards:
            return None
        self.report(original.test, _ACCELERATOR_GUARD)
        new = cst.Call(func=runtime_name(self.ctx, "accelerator_available", self.fixing))
        return updated.with_changes(test=replace_calls(original.test, guards, new))

    def _drop_guard(self, original: cst.If, updated: cst.If):
        if self._only_set_device(original) and not isinstance(original.body, cst.SimpleStatementSuite):
            # `if torch.cuda.is_available(): torch.cuda.set_device(n)` goes as a whole
            self.report(original, _SET_DEVICE)
            return self.ctx.remove_statement(original)
        if "GM101" not in self.ctx.fixing or not self.fixing:
            return None
        if original.orelse is not None and not self._cpu_twin(original):
            return None
        plan = device_plan(self.ctx)
        test = self.ctx.module.code_for_node(original.test).strip()
        if test not in plan.guard_flags:
            return None
        body = original.body
        if isinstance(body, cst.IndentedBlock):
            if body.header.comment is not None or body.footer:
                return None
            stmts = list(updated.body.body)
            originals = list(body.body)
        else:
            stmts = [cst.SimpleStatementLine(body=[s.with_changes(semicolon=cst.MaybeSentinel.DEFAULT)])
                     for s in updated.body.body]
            originals = list(body.body)
        indices = [s for s in originals if self._index_definition(s)]
        if not all(self._hardcodes_cuda(s) or self._sets_device(s) or any(s is i for i in indices)
                   for s in originals) or any(self._hardcodes_cuda(s) for s in stmts) or not stmts:
            return None
        if len(indices) < len(originals) and self._index_left_behind(original):
            return None  # `.cuda(gpu)` with `gpu` defined only under a guard that stays: keep this one too
        if len(indices) == len(originals):
            names = ", ".join(f"`{n}`" for s in indices for n in self._index_definition(s))
            self.report(original, f"`if {test}:` guard around the GPU index {names} of `.cuda(...)` calls that "
                                  "run on every device now: it is defined on every device too")
        else:
            self.report(original, f"`if {test}:` guard around `.cuda()`: the device already says where to run"
                        + _else_note(original.orelse))
        stmts[0] = stmts[0].with_changes(leading_lines=[*original.leading_lines, *stmts[0].leading_lines])
        return cst.FlattenSentinel(stmts)

    def _sets_device(self, stmt: cst.CSTNode) -> bool:
        """A line of `torch.cuda.set_device(...)` calls (they go: see leave_SimpleStatementLine)."""
        smalls = stmt.body if isinstance(stmt, cst.SimpleStatementLine) else [stmt]
        return all(m.matches(small, m.Expr(m.Call())) and self.qualify(small.value.func) == "torch.cuda.set_device"
                   for small in smalls)

    @functools.cached_property
    def _index_names(self) -> frozenset:
        """Names passed as the GPU index of `.cuda(i)`, `torch.device("cuda", i)` or
        `get_device(i)` anywhere in the file."""
        names = set()
        for call in script_model(self.ctx).s.index.of(cst.Call):
            if is_method_call(call, "cuda"):
                arg = get_arg(call, "device", 0)
            elif self.qualify(call.func) == "torch.device":
                arg = get_arg(call, "index", 1)
            elif runtime_helper(self.qualify(call.func)) == "get_device":
                arg = get_arg(call, "index", 0)
            else:
                continue
            if arg is not None and isinstance(arg.value, cst.Name):
                names.add(arg.value.value)
        return frozenset(names)

    def _index_definition(self, stmt: cst.CSTNode) -> List[str]:
        """`gpu = args.gpu`: names bound (to values that cannot fail or do anything: names,
        attributes, literals, `int(...)`) and used as a GPU index. Under an `if use_cuda:`
        guard, the `.cuda(gpu)` calls leave their guards and need them on every device."""
        smalls = stmt.body if isinstance(stmt, cst.SimpleStatementLine) else [stmt]
        names: List[str] = []
        for small in smalls:
            if not (isinstance(small, cst.Assign) and all(isinstance(t.target, cst.Name) for t in small.targets)
                    and _inert_value(small.value)):
                return []
            names += [t.target.value for t in small.targets]
        return names if names and all(n in self._index_names for n in names) else []

    def _index_left_behind(self, guard: cst.If) -> bool:
        """Does a `.cuda(i)` in this guard use an `i` bound only inside guards that stay
        (whose body is not only index definitions)? Then without the guard it is unbound
        wherever there is no CUDA."""
        s = script_model(self.ctx).s
        flags = device_plan(self.ctx).guard_flags
        for call in s.inside(guard.body, cst.Call):
            arg = get_arg(call, "device", 0) if is_method_call(call, "cuda") else None
            if arg is None or not isinstance(arg.value, cst.Name):
                continue
            bindings = s.all_bindings(arg.value.value, s.scope(call))
            if not bindings:
                continue
            guards = [next((a for a in s.ancestors(b.stmt) if isinstance(a, cst.If) and
                            self.ctx.module.code_for_node(a.test).strip() in flags and
                            s.index.contains(a.body, b.stmt)), None) for b in bindings]
            if all(g is not None and not self._defines_only_indices(g) for g in guards):
                return True
        return False

    def _defines_only_indices(self, guard: cst.If) -> bool:
        """A guard that goes as a whole with its index definitions (`gpu = 0`, and the
        `torch.cuda.set_device(gpu)` that goes anyway)."""
        lines = guard.body.body
        return guard.orelse is None and any(self._index_definition(line) for line in lines) and all(
            self._index_definition(line) or self._sets_device(line) for line in lines)

    def _hardcodes_cuda(self, stmt: cst.CSTNode) -> bool:
        """`.cuda()` or a CUDA tensor type (`x.type(torch.cuda.FloatTensor)`) in a statement."""
        return bool(findall(stmt, _cuda_method())) or any(
            cuda_type_dtype(self.qualify(a)) for a in findall(stmt, m.Attribute()))

    def _cpu_twin(self, node: cst.If) -> bool:
        """`if cuda: x = x.cuda() else: x = x`: the `else` is the body without `.cuda()`, so
        with the device deciding, the body alone does both. So is an `else:` that does
        nothing (`else: pass`, no comment): it goes with the guard."""
        orelse = node.orelse
        if isinstance(orelse, cst.Else) and _does_nothing(orelse):
            return True
        if not isinstance(orelse, cst.Else) or not isinstance(orelse.body, type(node.body)):
            return False
        render = cst.Module(body=[]).code_for_node
        without = node.body.visit(_DropCuda())
        squash = lambda n: " ".join(render(n).split())  # noqa: E731
        return squash(without) == squash(orelse.body)


def _inert_value(value: cst.BaseExpression) -> bool:
    """An expression that computes a plain value: names, attributes, literals, operators and
    `int(...)`/`str(...)` of those; no other call, no indexing."""
    for node in walk(value):
        if isinstance(node, cst.Call):
            if not (isinstance(node.func, cst.Name) and node.func.value in ("int", "str")):
                return False
        elif isinstance(node, (cst.Subscript, cst.Lambda, cst.Await, cst.Yield, cst.NamedExpr)):
            return False
    return True


def _else_note(orelse: Optional[cst.CSTNode]) -> str:
    if orelse is None:
        return ""
    return " (its `else` did nothing)" if _does_nothing(orelse) else " (its `else` did the same on the CPU)"


def _does_nothing(orelse: cst.Else) -> bool:
    """`else: pass` (or `...`), with no comment anywhere in it."""
    body = orelse.body
    if isinstance(body, cst.IndentedBlock):
        if body.header.comment is not None or body.footer or not all(
                isinstance(line, cst.SimpleStatementLine) and not line.leading_lines for line in body.body):
            return False
        lines = list(body.body)
    else:
        lines = [body]
    if orelse.leading_lines or any(line.trailing_whitespace.comment is not None for line in lines):
        return False
    smalls = [small for line in lines for small in line.body]
    return bool(smalls) and all(isinstance(small, cst.Pass) or m.matches(small, m.Expr(m.Ellipsis()))
                                for small in smalls)


class _DropCuda(cst.CSTTransformer):
    def leave_Call(self, original: cst.Call, updated: cst.Call):
        if m.matches(updated, _cuda_method()):
            return updated.func.value
        return updated

    def leave_Comment(self, original: cst.Comment, updated: cst.Comment):
        return cst.RemoveFromParent()


class LoadMapLocation(Rule):
    """
    ## What it does
    Finds `torch.load(f)` without `map_location`.

    ## Why is this bad?
    `torch.load` restores each tensor onto the device it was saved from: a checkpoint written
    on `cuda:0` fails to load on a CPU-only machine, and under DDP every rank loads onto GPU 0.

    ## Example
    ```python
    state = torch.load("ckpt.pt")
    ```

    ## Use instead
    ```python
    state = torch.load("ckpt.pt", map_location=device)
    ```
    """

    code = "GM105"
    done = "`torch.load` → `torch.load(..., map_location=device)`"
    name = "load-without-map-location"
    message = "`torch.load` without `map_location` restores tensors onto the device they were saved from"
    fixed_in = frozenset({"device"})
    triggers = ("load",)

    # a call qualified as `torch.load`: both parts come from the file's identifiers
    @classmethod
    def gate(cls, facts: SourceFacts) -> bool:
        return facts.any_id("load") and facts.any_id("torch")

    examples = (
        Flagged(
            "import torch\nstate = torch.load('ckpt.pt')\n",
            fixed="import torch\nfrom gpumigrate.runtime import get_device\n\ndevice = get_device()\n"
            "state = torch.load('ckpt.pt', map_location=device)\n",
        ),
        Clean("import torch\nstate = torch.load('ckpt.pt', map_location='cpu')\n"),
        Clean("import pickle\nstate = pickle.load(f)\n"),
    )

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> Optional[cst.Call]:
        if self.qualify(original.func) != "torch.load" or get_arg(original, "map_location", 1) is not None:
            return None
        if any(a.star for a in original.args):
            return None
        self.report(original)
        if not self.fixing:
            return None
        device = device_plan(self.ctx).device_expr(None, self.fixing)
        return with_args(updated, [*updated.args, keyword_arg("map_location", device)])


class LoadWholeModel(Rule):
    """
    ## What it does
    Finds `torch.load` of a whole pickled module (`torch.save(model, f)` ... `model = torch.load(f)`).

    ## Why is this bad?
    Since torch 2.6 `torch.load` defaults to `weights_only=True`, which refuses pickled modules:
    the old script fails with an `UnpicklingError`.

    ## Example
    ```python
    torch.save(model, f)
    model = torch.load(f)
    ```

    ## Use instead
    ```python
    model = torch.load(f, weights_only=False)  # only for files you trust: it runs pickled code
    ```
    Better still: save and load `model.state_dict()`.
    """

    code = "GM106"
    done = "`torch.load` of a whole model → `weights_only=False` (load only files you trust)"
    name = "load-whole-model"
    message = ("`torch.load` of a whole pickled model fails since torch 2.6 (weights_only=True): "
               "passing weights_only=False, which runs pickled code; load only files you trust")
    fixed_in = frozenset({"device"})
    triggers = ("load",)

    # a call qualified as `torch.load`: both parts come from the file's identifiers
    @classmethod
    def gate(cls, facts: SourceFacts) -> bool:
        return facts.any_id("load") and facts.any_id("torch")

    examples = (
        Flagged(
            "import torch\ntorch.save(model, 'm.pt')\nmodel = torch.load('m.pt', map_location='cpu')\nmodel.eval()\n",
            fixed="import torch\ntorch.save(model, 'm.pt')\n"
            "model = torch.load('m.pt', map_location='cpu', weights_only=False)\nmodel.eval()\n",
        ),
        Flagged(
            "import torch\nimport torch.nn as nn\nnet = nn.Linear(2, 2)\ntorch.save([net, opt], 'ckpt.pt')\n"
            "obj = torch.load('ckpt.pt', map_location='cpu')\n",
            fixed="import torch\nimport torch.nn as nn\nnet = nn.Linear(2, 2)\ntorch.save([net, opt], 'ckpt.pt')\n"
            "obj = torch.load('ckpt.pt', map_location='cpu', weights_only=False)\n",
        ),
        Clean("import torch\ntorch.save(model.state_dict(), 'm.pt')\nstate = torch.load('m.pt', map_location='cpu')\n"),
        Clean("import torch\nnoise = torch.randn(4, 2)\ntorch.save(noise, 'noise.pth')\n"
              "net.load_state_dict(torch.load('w.pth', map_location='cpu'))\n"),
    )

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> Optional[cst.Call]:
        if self.qualify(original.func) != "torch.load" or get_arg(original, "weights_only") is not None \
                or not script_model(self.ctx).loads_pickled(original):
            return None
        self.report(original)
        return with_args(updated, [*updated.args, keyword_arg("weights_only", cst.Name("False"))])


class CudaSynchronize(Rule):
    """
    ## What it does
    Finds `torch.cuda.synchronize()`, as timing code calls it around a step or an epoch.

    ## Why is this bad?
    Without a CUDA GPU it raises "Found no NVIDIA driver on your system": a script that runs on
    a CPU or a Mac everywhere else stops at its first timing line.

    ## Example
    ```python
    torch.cuda.synchronize()
    batch_time.update(time.time() - end)
    ```

    ## Use instead
    ```python
    synchronize()  # from gpumigrate.runtime: CUDA's, MPS's, or nothing on a CPU
    batch_time.update(time.time() - end)
    ```
    """

    code = "GM107"
    done = "`torch.cuda.synchronize()` → `synchronize()` (any device)"
    name = "cuda-synchronize"
    message = "`torch.cuda.synchronize()` raises without a CUDA GPU; `synchronize()` waits for whichever device runs"
    fixed_in = frozenset({"device"})
    triggers = ("synchronize",)

    # a call qualified as `torch.cuda.synchronize`
    @classmethod
    def gate(cls, facts: SourceFacts) -> bool:
        return facts.any_id("synchronize")

    examples = (
        Flagged(
            "import time\nimport torch\nstart = time.time()\ntorch.cuda.synchronize()\nprint(time.time() - start)\n",
            fixed="import time\nimport torch\nfrom gpumigrate.runtime import synchronize\n\n"
            "start = time.time()\nsynchronize()\nprint(time.time() - start)\n",
        ),
        Clean("import torch\ntorch.mps.synchronize()\n"),
    )

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> Optional[cst.Call]:
        if self.qualify(original.func) != "torch.cuda.synchronize":
            return None
        self.report(original)
        return updated.with_changes(func=runtime_name(self.ctx, "synchronize", self.fixing))


TENSOR_NAMES = frozenset({"inputs", "input", "target", "targets", "label", "labels", "images", "image",
                          "imgs", "img", "x", "y"})


class DiscardedMove(Rule):
    """
    ## What it does
    Finds statements that only call `x.to(...)`, `x.cuda()` or `x.cpu()` on a tensor,
    throwing the result away.

    ## Why is this bad?
    `Module.to()` moves a module in place, but `Tensor.to()` returns a new tensor and leaves
    `x` where it was: the next line still computes on the CPU copy, or fails with "Expected
    all tensors to be on the same device".

    ## Example
    ```python
    for data, target in train_loader:
        data.to(device)
        target.to(device)
        output = model(data)
    ```

    ## Use instead
    ```python
    for data, target in train_loader:
        data, target = data.to(device), target.to(device)
        output = model(data)
    ```
    A receiver is a tensor when it is bound from a `torch` tensor function, an indexing, a
    module's output or a `(data, target)` pair unpacked from a loader, or is named like one
    (`inputs`, `target`, `labels`, `images`, `x`, `y`...). Names bound from a class call
    (modules, Hugging Face's `BatchEncoding`) and a bare `for batch in loader` item (PyG's
    `Data` and `Batch` move in place) are not flagged.
    """

    code = "GM104"
    name = "discarded-move"
    message = "`Tensor.to()` returns a new tensor; the result is discarded"
    reported_in = frozenset({"device"})
    triggers = (".to", ".cuda", ".cpu")

    # every report is a `.to()`, `.cuda()` or `.cpu()` call
    @classmethod
    def gate(cls, facts: SourceFacts) -> bool:
        return facts.any_call("to", "cuda", "cpu")

    examples = (
        Flagged("for data, target in train_loader:\n    data.to(device)\n    output = model(data)\n"),
        Flagged("import torch\nx = torch.randn(4, 3)\nx.cuda()\ny = x * 2\n"),
        Flagged("def step(model, inputs, labels):\n    inputs.to(device, non_blocking=True)\n    return model(inputs)\n"),
        Clean("import torch.nn as nn\nmodel = nn.Linear(3, 1)\nmodel.to(device)\nnet = Net()\nnet.cuda()\n"),
        Clean("inputs = tokenizer(texts, return_tensors='pt')\ninputs.to(device)\n"),
        Clean("for data in loader:  # torch_geometric Batch moves in place\n    data.to(device)\n"),
        Clean("import torch\nx = torch.randn(4, 3)\nx = x.to(device)\nprint(x.to(device))\n"),
        Clean("model = build_model(cfg)\nmodel.to(device)\nmodels[0].cuda()\n"),
    )

    def visit_Expr(self, node: cst.Expr) -> None:
        call = node.value
        if not is_method_call(call, "to", "cuda", "cpu"):
            return
        receiver = call.func.value
        model = script_model(self.ctx)
        method = call.func.attr.value
        if isinstance(receiver, cst.Name):
            kind = model.kind_anywhere(receiver.value, call)
            if not (kind in (v.TENSOR, v.PARAM) or (kind in (None, v.BATCH) and receiver.value in TENSOR_NAMES)):
                return
            x = receiver.value
            if kind == v.PARAM:
                self.report(call, f"`{x}.{method}(...)` returns a new tensor and leaves the parameter where it "
                                  f"was; move the module instead (`model.to(device)`)")
                return
            self.report(call, f"`{x}.{method}(...)` returns a new tensor; the result is discarded, so `{x}` "
                              f"stays where it was: write `{x} = {x}.{method}(...)`")
        elif isinstance(receiver, (cst.Call, cst.Subscript)) and model.kind(receiver) == v.TENSOR:
            self.report(call, f"`.{method}(...)` returns a new tensor; the result is discarded: assign it")


class RuntimeImport(Rule):
    """
    ## What it does
    With `--vendor-runtime DIR`, points the runtime imports of an earlier migration at the
    one-module copy of the runtime written into DIR: `from gpumigrate.runtime import
    get_device` becomes `from gpumigrate_runtime import get_device`. Without
    `--vendor-runtime` it does nothing (and a script that imports the vendored copy keeps it).

    ## Why is this bad?
    A script that imports `gpumigrate.runtime` runs only where gpumigrate is installed, with
    LibCST and click; the vendored module needs only torch.

    ## Example
    ```python
    from gpumigrate.runtime import get_device, setup_distributed
    import gpumigrate.runtime as gr
    ```

    ## Use instead
    ```python
    from gpumigrate_runtime import get_device, setup_distributed
    import gpumigrate_runtime as gr
    ```
    `import gpumigrate.runtime` without `as` (used as `gpumigrate.runtime.get_device()`) is
    listed for review: its uses name the package, change them with the import.
    """

    code = "GM100"
    done = "the runtime is imported from the vendored `gpumigrate_runtime` (torch only)"
    name = "runtime-import"
    message = ("with `--vendor-runtime`: import the runtime from the vendored `gpumigrate_runtime`, "
               "which needs only torch")
    fixed_in = frozenset({"device"})
    lint = False  # a migration step, chosen on the command line, not a defect
    triggers = ("gpumigrate",)
    examples = (
        Flagged(
            "import torch\nfrom gpumigrate.runtime import get_device\nimport gpumigrate.runtime as gr\n\n"
            "device = get_device()\ngr.barrier()\n",
            fixed="import torch\nfrom gpumigrate_runtime import get_device\nimport gpumigrate_runtime as gr\n\n"
            "device = get_device()\ngr.barrier()\n",
            options={"runtime_module": VENDORED_MODULE},
        ),
        Flagged(
            "from gpumigrate import runtime\nruntime.barrier()\n",
            fixed="import gpumigrate_runtime as runtime\nruntime.barrier()\n",
            options={"runtime_module": VENDORED_MODULE},
        ),
        Flagged("import gpumigrate.runtime\ngpumigrate.runtime.barrier()\n",
                options={"runtime_module": VENDORED_MODULE}),  # review: the uses name the package
        Clean("from gpumigrate_runtime import get_device\ndevice = get_device()\n",
              options={"runtime_module": VENDORED_MODULE}),
        Clean("from gpumigrate.runtime import get_device\ndevice = get_device()\n"),  # not vendoring
    )

    def _chosen(self) -> Optional[str]:
        return self.ctx.options.get("runtime_module")

    def _other_runtime(self, module: Optional[str]) -> bool:
        """A runtime module that is not the chosen one: the package (or one of its modules,
        whose names the vendored module has too), or the vendored copy."""
        chosen = self._chosen()
        if not chosen or module is None or module == chosen:
            return False
        return module in (RUNTIME_PACKAGE, VENDORED_MODULE) or (
            chosen == VENDORED_MODULE and module.startswith(RUNTIME_PACKAGE + "."))

    def _report(self, node: cst.CSTNode, module: str, review: bool = False) -> None:
        how = "; its uses name the module: change them with it" if review else ""
        self.report(node, f"imports the runtime from `{module}`; `{self._chosen()}` is the one to import{how}",
                    review=review)

    def leave_ImportFrom(self, original: cst.ImportFrom, updated: cst.ImportFrom) -> Optional[cst.BaseSmallStatement]:
        if original.relative or self._chosen() is None:
            return None
        module = dotted(original.module) if original.module else None
        if self._other_runtime(module):
            self._report(original, module)
            return updated.with_changes(module=cst.parse_expression(self._chosen()))
        if module == "gpumigrate" and self._other_runtime(RUNTIME_PACKAGE) \
                and not isinstance(original.names, cst.ImportStar) \
                and any(alias.name.value == "runtime" for alias in original.names):
            (alias, *others) = original.names
            if others:  # `from gpumigrate import runtime, something_else`
                self._report(original, RUNTIME_PACKAGE, review=True)
                return None
            self._report(original, RUNTIME_PACKAGE)
            local = alias.asname.name.value if alias.asname else "runtime"
            return cst.Import(names=[cst.ImportAlias(name=cst.parse_expression(self._chosen()),
                                                     asname=cst.AsName(name=cst.Name(local)))])
        return None

    def leave_Import(self, original: cst.Import, updated: cst.Import) -> Optional[cst.Import]:
        if self._chosen() is None:
            return None
        names = list(updated.names)
        switched = False
        for i, alias in enumerate(original.names):
            module = dotted(alias.name)
            if not self._other_runtime(module):
                continue
            if alias.asname is None:  # `import gpumigrate.runtime`: `gpumigrate.runtime.x` in the code
                self._report(original, module, review=True)
                continue
            self._report(original, module)
            names[i] = names[i].with_changes(name=cst.parse_expression(self._chosen()))
            switched = True
        return updated.with_changes(names=names) if switched else None
