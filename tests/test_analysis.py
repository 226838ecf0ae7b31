"""The script model: what it believes about a script, fact by fact."""

import textwrap

import libcst as cst
import pytest

from gpumigrate.analysis import script_model
from gpumigrate.analysis import values as v
from gpumigrate.rewriter.engine import FileContext
from gpumigrate.rewriter.names import ImportTable


def model_of(code: str):
    code = textwrap.dedent(code)
    module = cst.parse_module(code)
    return script_model(FileContext(module, "script.py", code, ImportTable(module)))


def expr(model, text: str) -> cst.BaseExpression:
    """The last expression in the file spelled exactly `text`."""
    render = model.ctx.module.code_for_node
    found = [n for n in model.s.index.order if isinstance(n, cst.BaseExpression) and render(n) == text]
    assert found, text
    return found[-1]


@pytest.mark.parametrize("code, text, kind", [
    ("import torch.nn.functional as F\nloss = F.mse_loss(a, b)\nloss\n", "loss", v.LOSS),
    ("import torch.nn as nn\ncrit = nn.CrossEntropyLoss()\nl = crit(o, y)\nl\n", "l", v.LOSS),
    ("import torch\nx = torch.randn(3)\ns = (x.argmax() == 1).sum()\ns\n", "s", v.SCALAR),
    ("import torch\nx = torch.randn(3)\nm = x.max(0)\nm\n", "m", v.TENSOR),  # with a dim: not 0-dim
    ("import torch.nn.functional as F\ndef crit(o, y):\n    return F.l1_loss(o, y), F.mse_loss(o, y)\n"
     "a, b = crit(p, q)\nb\n", "b", v.LOSS),  # unpacked from a function of this file
    ("import torch.nn.functional as F\nl = F.mse_loss(a, b)\nt = l * 2 + 1\nt\n", "t", v.LOSS),
    ("import torch\nimport torch.nn as nn\nclass Net(nn.Module):\n    pass\nnet = Net()\nnet\n", "net", v.MODULE),
    ("import torch.nn as nn\nclass FocalLoss(nn.Module):\n    pass\nf = FocalLoss()\nf\n", "f", v.LOSS_MODULE),
    ("import torch\nopt_cls = getattr(torch.optim, 'SGD')\nopt = opt_cls(ps)\nopt\n", "opt", v.OPTIMIZER),
    ("from torch.utils.data import DataLoader\nl = DataLoader(ds)\nit = iter(l)\nb = next(it)\nb\n", "b", v.BATCH),
    ("class AverageMeter:\n    def update(self, v):\n        self.sum += v\nm = AverageMeter()\nm\n", "m", v.METRIC),
    ("import csv\nw = csv.writer(open('a.csv', 'w'))\nw\n", "w", v.WRITER),
])
def test_what_a_name_holds(code, text, kind):
    model = model_of(code)
    assert model.kind(expr(model, text)) == kind


def test_a_parameter_holds_what_every_call_passes():
    model = model_of("""\
        import torch.nn as nn
        def train(model, criterion):
            return criterion
        train(nn.Linear(2, 2), nn.MSELoss())
        def other(x):
            return x
        """)
    fn = next(f for f in model.s.functions.values() if f.name == "train")
    assert model.kind(fn.returns[0]) == v.LOSS_MODULE
    other = next(f for f in model.s.functions.values() if f.name == "other")
    assert model.kind(other.returns[0]) == v.UNKNOWN  # never called: nothing says


def test_names_are_seen_in_statement_order():
    model = model_of("""\
        import model
        net = model.RNNModel(4)
        model = net
        model.x
        """)
    first = next(n for n in model.s.index.order if isinstance(n, cst.Name) and n.value == "model"
                 and isinstance(model.s.parent(n), cst.Attribute) and model.s.parent(n).attr.value == "RNNModel")
    assert model.kind(first) == v.PYMODULE  # the imported module, not the later rebinding


@pytest.mark.parametrize("code, owners, resolved", [
    ("import torch\nm = Net()\nopt = torch.optim.SGD(m.parameters(), lr=1)\n", ["m"], True),
    ("import torch\nm = Net()\nopt = getattr(torch.optim, 'Adam')(m.parameters())\n", ["m"], True),
    ("import torch\na, b = Enc(), Dec()\nps = list(a.parameters()) + list(b.parameters())\n"
     "opt = torch.optim.SGD(ps, lr=1)\n", ["a", "b"], True),
    ("import torch\nm, h = Net(), Head()\nopt = torch.optim.SGD([{'params': m.backbone.parameters()}, "
     "{'params': h.parameters(), 'lr': 1}], lr=0.1)\n", ["h", "m"], True),
    ("import torch\ndef make(net):\n    return torch.optim.Adam(net.parameters())\nmodel = Net()\n"
     "opt = make(model)\n", ["model"], True),
    ("import torch\nopt = torch.optim.SGD(undefined.parameters(), lr=1)\n", [], False),
    ("import torch\nparams = {'w': torch.zeros(2, requires_grad=True)}\nopt = torch.optim.SGD(params.values())\n",
     [], False),
    ("import torch\nopt = build_optimizer(cfg, model)\nopt.zero_grad()\nopt.step()\n", [], False),
])
def test_which_modules_each_optimizer_trains(code, owners, resolved):
    model = model_of(code)
    assert len(model.optimizers) == 1
    opt = model.optimizers[0]
    assert sorted(name for _, name in opt.owners) == owners
    assert opt.resolved is resolved


def test_loss_modules_are_told_apart_from_models():
    model = model_of("""\
        import torch
        net, crit = Net(), Criterion()
        opt = torch.optim.SGD(list(net.parameters()) + list(crit.parameters()), lr=0.1)
        crit(net(x), y).backward()
        opt.step()
        """)
    roles = {t.name: t.loss_module for t in model.trained_models}
    assert roles == {"net": False, "crit": True}


def test_training_reaches_backward_through_calls():
    model = model_of("""\
        def step(model, x):
            model(x).sum().backward()
        def epoch(model, data):
            for x in data:
                step(model, x)
        def evaluate(model, data):
            for x in data:
                model(x)
        """)
    trains = {f.name for f in model.s.functions.values() if model.function_trains(f)}
    assert trains == {"step", "epoch"}


def test_loader_roles_come_from_how_they_are_consumed():
    model = model_of("""\
        import torch
        from torch.utils.data import DataLoader
        def make(train):
            return DataLoader(ds, shuffle=train)
        a, b = make(True), make(False)
        it_loader = DataLoader(ds2)
        opt = torch.optim.SGD(m.parameters(), lr=1)
        for step in range(10):
            if step % 5 == 0:
                it = iter(it_loader)
            x = next(it)
            m(x).sum().backward()
            opt.step()
        for epoch in range(2):
            for i, (x, y) in enumerate(a):
                m(x).sum().backward()
                opt.step()
            for x, y in b:
                m(x)
        """)
    roles = {model.ctx.module.code_for_node(l.call): (l.role, l.flag) for l in model.loaders}
    assert roles == {"DataLoader(ds, shuffle=train)": ("flag", "train"), "DataLoader(ds2)": ("train", None)}


def test_rank_local_values_and_conditions():
    model = model_of("""\
        import time, torch
        from torch.utils.data import DataLoader
        loader = DataLoader(ds, shuffle=True)
        opt = torch.optim.SGD(m.parameters(), lr=1)
        def train():
            total = 0.0
            for x, y in loader:
                loss = m(x).sum()
                loss.backward()
                opt.step()
                total += loss.item()
            return total
        start = time.time()
        avg = train()
        if avg < 1.0:
            pass
        n = len(loader)
        if n > 3:
            pass
        """)
    tests = [n for n in model.s.index.order if isinstance(n, cst.If)]
    assert [model.rank_local_test(t) for t in tests] == [True, False]
    assert model.per_process(expr(model, "time.time()"))


def test_outputs_the_script_writes():
    model = model_of("""\
        import csv, logging, pickle, torch
        log = logging.getLogger(__name__)
        f = open('out.csv', 'w')
        w = csv.writer(f)
        print(1)
        log.info('x')
        w.writerow([1])
        pickle.dump(obj, f)
        torch.save(obj, 'x.pt')
        sorted(items)
        """)
    kinds = [model.output_call(c) for c in model.s.index.order
             if isinstance(c, cst.Call) and isinstance(model.s.parent(c), cst.Expr)]
    assert kinds == ["print", "write", "write", "save", "save", None]


def test_pickled_loads_are_told_from_state_dicts():
    model = model_of("""\
        import torch
        import torch.nn as nn
        model = nn.Linear(2, 2)
        torch.save(model, 'whole.pt')
        a = torch.load('whole.pt')
        net.load_state_dict(torch.load('weights.pt'))
        m = torch.load(path)
        m.eval()
        """)
    loads = [c for c in model.s.index.order if isinstance(c, cst.Call) and model.qualify(c.func) == "torch.load"]
    assert [model.loads_pickled(c) for c in loads] == [True, False, True]


def test_a_recursive_function_unpacked_from_its_own_call_is_no_new_fact():
    """`return build(n - 1)` in a function whose result is unpacked: once an endless
    recursion ("nesting too deep" on torch/_inductor/ir.py)."""
    model = model_of("import torch\ndef build(n):\n    if n == 0:\n        return torch.nn.Linear(2, 2), 0\n"
                     "    return build(n - 1)\nnet, depth = build(3)\nnet\n")
    assert model.kind(expr(model, "net")) == v.MODULE


@pytest.mark.slow
def test_scopes_found_on_demand_are_the_scans():
    """The structure scan steps only on what opens a scope, calls, returns and binds; any
    other node's scope is found on demand, walking up to the nearest def, class or lambda.
    Both give, for every node of the fixtures and of a torch sample, the scope that a walk
    over every node in order (the scan before) gives."""
    from pathlib import Path

    import libcst as cst
    import torch

    from gpumigrate.analysis.structure import Structure
    from gpumigrate.rewriter.engine import NodeIndex
    from tests.conftest import FIXTURES

    package = Path(torch.__file__).parent
    compared = 0
    for path in sorted((FIXTURES / "scripts").glob("*.py")) + sorted(package.rglob("*.py"))[::150]:
        try:
            module = cst.parse_module(path.read_bytes())
        except Exception:
            continue
        index = NodeIndex().build(module)
        s = Structure(module, index)
        stack = [(s.scopes[id(module)], len(index.order))]
        for i, node in enumerate(index.order):
            while i >= stack[-1][1]:
                stack.pop()
            assert s._scope_at(node) is stack[-1][0], (path, i, type(node).__name__)
            if id(node) in s.scopes and node is not module:
                stack.append((s.scopes[id(node)], index.end[id(node)]))
            compared += 1
    assert compared > 40_000


def test_a_name_bound_in_both_branches_reaches_code_that_runs_later():
    """`if c: x = A` / `else: x = B`: a function called afterwards may see either."""
    model = model_of("""\
        import sys
        if sys.argv:
            loader = make_a()
        else:
            loader = make_b()
        loader = loader if True else None
        def f():
            return loader
        if sys.argv:
            other = make_a()
        else:
            other = make_b()
        def g():
            return other
        x = 1
        x = 2
        def h():
            return x
        one = make_a()
        if sys.argv: one = make_b()
        def k():
            return one
    """)
    s = model.s
    scope_of = lambda name: s.scope(next(f.node for f in s.functions.values() if f.node.name.value == name))
    _, seen = s.lookup("other", scope_of("g"))
    assert [b.value.func.value for b in seen] == ["make_a", "make_b"]
    _, seen = s.lookup("loader", scope_of("f"))
    assert len(seen) == 1  # the unconditional rebinding hides both branches
    _, seen = s.lookup("x", scope_of("h"))
    assert [b.value.value for b in seen] == ["2"]
    _, seen = s.lookup("one", scope_of("k"))  # bodies on the `if` line are branches too
    assert [b.value.func.value for b in seen] == ["make_a", "make_b"]
