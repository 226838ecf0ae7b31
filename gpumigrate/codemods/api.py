"""Torch API use: a misspelt attribute, a default about to change, non-public names.
GM801-GM803 (TorchFix TOR002, TOR003, TOR104/TOR105).
"""

from __future__ import annotations

from typing import Set

import libcst as cst
import libcst.matchers as m

from gpumigrate.codemods.base import LINT_FIX, Clean, Flagged, Rule
from gpumigrate.codemods.helpers import get_arg, keyword_arg, torch_name, with_args
from gpumigrate.rewriter.names import dotted
from gpumigrate.rewriter.facts import SourceFacts


class RequireGradTypo(Rule):
    """
    ## What it does
    Finds assignments to `.require_grad` (TorchFix TOR002), a misspelling of
    `.requires_grad`.

    ## Why is this bad?
    A tensor accepts any attribute: `w.require_grad = False` sets an attribute nothing
    reads, and `w` goes on being trained (or, with `True`, never gets a gradient).

    ## Example
    ```python
    for p in backbone.parameters():
        p.require_grad = False
    ```

    ## Use instead
    ```python
    for p in backbone.parameters():
        p.requires_grad = False
    ```
    `lint --fix` renames the attribute where the file never reads `.require_grad` (then it
    is the script's own attribute, not a typo, and is listed for review instead). Migrations
    list it for review: the fix changes which parameters train, and `verify` would rightly
    see another training.
    """

    code = "GM801"
    name = "require-grad-typo"
    torchfix = ("TOR002",)
    message = "`.require_grad` is a typo of `.requires_grad`: the assignment does nothing"
    done = "`.require_grad =` → `.requires_grad =`"
    # the fix changes what trains (the typo's layer was trained, or never got a gradient): a
    # migration keeps the script's behaviour and lists it; `lint --fix` is the user asking
    fixed_in = frozenset({LINT_FIX})
    reported_in = frozenset({"device"})
    triggers = ("require_grad",)

    examples = (
        Flagged("import torch\nx = torch.zeros(1)\nx.require_grad = True\n",
                fixed="import torch\nx = torch.zeros(1)\nx.requires_grad = True\n"),
        Flagged("for p in net.parameters():\n    p.require_grad = False\n",
                fixed="for p in net.parameters():\n    p.requires_grad = False\n"),
        Flagged(  # the script reads its own attribute: listed, not renamed
            "class Cfg:\n    pass\nc = Cfg()\nc.require_grad = True\nif c.require_grad:\n    pass\n",
        ),
        Clean("x.requires_grad = False\nrequire_grad = False\n"),
    )

    def visit_Module(self, node: cst.Module) -> None:
        self.read = False
        self.targets: Set[int] = set()

    def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
        if isinstance(node.target, cst.Attribute) and node.target.attr.value == "require_grad":
            self.targets.add(id(node.target))

    def visit_Attribute(self, node: cst.Attribute) -> None:
        if node.attr.value == "require_grad" and id(node) not in self.targets:
            self.read = True

    def leave_Module(self, original: cst.Module, updated: cst.Module) -> cst.Module:
        for target in self.ctx.find(original, _REQUIRE_GRAD_TARGET):
            if self.read:
                self.report(target, "`.require_grad` looks like a typo of `.requires_grad`, but the script reads "
                                    "it too: check which is meant", review=True)
            else:
                self.report(target)
        if self.read or not self.fixing or not self.targets:
            return updated
        return updated.visit(_Rename())


_REQUIRE_GRAD_TARGET = m.AssignTarget(target=m.Attribute(attr=m.Name("require_grad")))


class _Rename(cst.CSTTransformer):
    def leave_AssignTarget(self, original: cst.AssignTarget, updated: cst.AssignTarget) -> cst.AssignTarget:
        if isinstance(updated.target, cst.Attribute) and updated.target.attr.value == "require_grad":
            return updated.with_changes(target=updated.target.with_changes(attr=cst.Name("requires_grad")))
        return updated


_CHECKPOINT = "torch.utils.checkpoint.checkpoint"


class CheckpointReentrant(Rule):
    """
    ## What it does
    Finds `torch.utils.checkpoint.checkpoint(...)` without `use_reentrant=` (TorchFix
    TOR003).

    ## Why is this bad?
    Since torch 2.4 the call warns on every step, and the default is announced to change:
    the script's behaviour would then change under it. The two variants differ (the
    reentrant one needs an input that requires grad, supports no keyword arguments to the
    function, and does not work with `torch.autograd.grad`).

    ## Example
    ```python
    h = checkpoint(block, h)
    ```

    ## Use instead
    ```python
    h = checkpoint(block, h, use_reentrant=True)
    ```
    The fix writes `use_reentrant=True`, what the call does today (torch 2.13 still takes
    True when it is omitted): the warning goes and the behaviour stays. TorchFix writes
    `use_reentrant=False`, the recommended variant, which changes behaviour (gradients of
    inputs that do not require grad, RNG state, hooks); move to it by hand and test.
    """

    code = "GM802"
    name = "checkpoint-use-reentrant"
    torchfix = ("TOR003",)
    message = "`checkpoint` without `use_reentrant=` warns and its default will change; pass it explicitly"
    done = "`checkpoint(...)` → `checkpoint(..., use_reentrant=True)` (today's default, now explicit)"
    fixed_in = frozenset({"device"})
    triggers = ("checkpoint",)

    @classmethod
    def gate(cls, facts: SourceFacts) -> bool:  # `save_checkpoint(...)` is common; a call to `checkpoint` is not
        return facts.any_call("checkpoint")

    examples = (
        Flagged("from torch.utils.checkpoint import checkpoint\nh = checkpoint(block, h)\n",
                fixed="from torch.utils.checkpoint import checkpoint\nh = checkpoint(block, h, use_reentrant=True)\n"),
        Flagged("import torch.utils.checkpoint as cp\nh = cp.checkpoint(block, h, preserve_rng_state=False)\n",
                fixed="import torch.utils.checkpoint as cp\n"
                      "h = cp.checkpoint(block, h, preserve_rng_state=False, use_reentrant=True)\n"),
        Flagged(  # **kwargs may hold it: listed
            "from torch.utils.checkpoint import checkpoint\nh = checkpoint(block, h, **kw)\n"),
        Clean("from torch.utils.checkpoint import checkpoint\nh = checkpoint(block, h, use_reentrant=False)\n"),
        Clean("from deepspeed import checkpoint\nh = checkpoint(block, h)\n"),
    )

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        if self.qualify(original.func) != _CHECKPOINT or get_arg(original, "use_reentrant") is not None:
            return updated
        if any(a.star == "**" for a in original.args):
            self.report(original, "`checkpoint` with `**kwargs`: check that they pass `use_reentrant=`", review=True)
            return updated
        self.report(original)
        return with_args(updated, [*updated.args, keyword_arg("use_reentrant", cst.Name("True"))])


_PRIVATE = "torch.utils.data._utils.collate."
_PUBLIC = ("default_collate", "default_convert")


class NonPublicCollate(Rule):
    """
    ## What it does
    Finds `torch.utils.data._utils.collate.default_collate` and `default_convert`, used or
    imported (TorchFix TOR104, TOR105).

    ## Why is this bad?
    `_utils` is private: it can move in any release without notice. Both functions are
    public, the same objects, as `torch.utils.data.default_collate` and
    `torch.utils.data.default_convert` (since torch 1.11).

    ## Example
    ```python
    from torch.utils.data._utils.collate import default_collate
    ```

    ## Use instead
    ```python
    from torch.utils.data import default_collate
    ```
    The fix rewrites the import (the names the script uses stay) or the dotted use. An
    import of other private names from the same module is listed for review.
    """

    code = "GM803"
    name = "non-public-collate"
    torchfix = ("TOR104", "TOR105")
    message = "`torch.utils.data._utils.collate` is private; use `torch.utils.data.default_collate`/`default_convert`"
    done = "private `_utils.collate` → `torch.utils.data`"
    fixed_in = frozenset({"device"})
    triggers = ("_utils",)

    examples = (
        Flagged("from torch.utils.data._utils.collate import default_collate\nb = default_collate(items)\n",
                fixed="from torch.utils.data import default_collate\nb = default_collate(items)\n"),
        Flagged("import torch\nv = torch.utils.data._utils.collate.default_convert(v)\n",
                fixed="import torch\nv = torch.utils.data.default_convert(v)\n"),
        Flagged("from torch.utils.data import _utils\nb = _utils.collate.default_collate(b)\n",
                fixed="import torch.utils.data\n\nb = torch.utils.data.default_collate(b)\n"),
        Flagged(  # a private name beside it: listed
            "from torch.utils.data._utils.collate import default_collate, np_str_obj_array_pattern\n"),
        Clean("from torch.utils.data import default_collate\nb = default_collate(items)\n"),
    )

    def _msg(self, name: str) -> str:
        if self.fixing:
            return f"private `_utils.collate.{name}` → `torch.utils.data.{name}`"
        return f"`torch.utils.data._utils.collate` is private; use `torch.utils.data.{name}`"

    def leave_ImportFrom(self, original: cst.ImportFrom, updated: cst.ImportFrom) -> cst.ImportFrom:
        if original.relative or original.module is None or dotted(original.module) != _PRIVATE[:-1] \
                or isinstance(original.names, cst.ImportStar):
            return updated
        names = [a.name.value for a in original.names]
        public = [n for n in names if n in _PUBLIC]
        if not public:
            return updated
        if len(public) != len(names):
            self.report(original, "import from the private `torch.utils.data._utils.collate`: import "
                                  f"{', '.join(public)} from `torch.utils.data`", review=True, torchfix="TOR105")
            return updated
        self.report(original, self._msg(public[0]), torchfix="TOR105")
        return updated.with_changes(module=cst.parse_expression("torch.utils.data"))

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        qualified = self.qualify(original.func)
        if not qualified or not qualified.startswith(_PRIVATE) or qualified[len(_PRIVATE):] not in _PUBLIC:
            return updated
        name = qualified[len(_PRIVATE):]
        self.report(original.func, self._msg(name))
        if not isinstance(original.func, cst.Attribute):
            return updated  # a name from the import, which leave_ImportFrom rewrites
        head = dotted(original.func).split(".")[0]
        if self.qualify(cst.Name(head)) == "torch":  # spelt through torch, which is bound here
            return updated.with_changes(func=torch_name(self.ctx, f"utils.data.{name}", self.fixing))
        if self.ctx.names.local.get("torch", "torch") != "torch":
            return updated  # `torch` is another module's alias here: leave it (reported above)
        if self.fixing:
            # `import torch.utils.data` at the top: a later `import torch` would not bind it here
            self.ctx.add_import("torch.utils.data")
            if head == "_utils":
                self.ctx.remove_import("torch.utils.data", "_utils")  # removed only if no other use is left
        return updated.with_changes(func=cst.parse_expression(f"torch.utils.data.{name}"))
