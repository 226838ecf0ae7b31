"""The report-only rules (no safe mechanical fix; they live with their concern in codemods/):
their own examples, and one realistic script each with exact findings."""

import textwrap

import pytest

from gpumigrate.codemods.base import Clean, Flagged
from gpumigrate.codemods import (
    DataAttribute,
    DiscardedMove,
    EmptyCacheInLoop,
    HostDeviceRoundtrip,
    LoaderNoPinMemory,
    LoaderNoWorkers,
    OomRetryLeak,
)
from gpumigrate.rewriter.engine import process
from gpumigrate.rewriter.names import ImportTable
from tests.conftest import lint

REPORT_ONLY = (DiscardedMove, DataAttribute, EmptyCacheInLoop, OomRetryLeak, LoaderNoWorkers, LoaderNoPinMemory,
               HostDeviceRoundtrip)


@pytest.mark.parametrize("rule", REPORT_ONLY, ids=lambda r: r.code)
def test_rule_contract(rule):
    docs = rule.docs()
    for section in ("## What it does", "## Why is this bad?", "## Example", "## Use instead"):
        assert section in docs
    assert rule.fixed_in == frozenset()
    assert sum(isinstance(e, Flagged) for e in rule.examples) >= 2
    assert all(e.fixed is None for e in rule.examples if isinstance(e, Flagged))
    assert sum(isinstance(e, Clean) for e in rule.examples) >= 3
    marked = {"GM104", "GM304", "GM306", "GM603"}
    assert rule.reported_in == (frozenset({"device"}) if rule.code in marked else frozenset())


@pytest.mark.parametrize("rule", REPORT_ONLY, ids=lambda r: r.code)
def test_never_rewrites(rule):
    source = b"".join(e.code.encode() for e in rule.examples if isinstance(e, Flagged))
    result = process(source, "script.py", [rule], fix=[rule.code], names_factory=ImportTable)
    assert result.error is None and result.new_source is None
    assert result.findings and not any(f.fixed for f in result.findings)


def found(source: str, rule) -> list:
    result = lint(textwrap.dedent(source).encode(), [rule])
    assert result.error is None
    return [(f.code, f.line) for f in result.findings]


def test_discarded_move():
    source = """\
    import torch
    import torch.nn as nn

    model = nn.Sequential(nn.Linear(784, 10))
    model.to(device)                                  # modules move in place
    criterion = nn.CrossEntropyLoss()
    criterion.cuda()
    mean = torch.zeros(784)
    mean.to(device)                                   # 9: a tensor

    def train(loader):
        for batch_idx, (data, target) in enumerate(loader):
            data.to(device)                           # 13
            target = target.to(device)
            target.to(device)                         # 15: still a tensor after the rebinding
            output = model(data)
            output.cpu()                              # 17: a module's output
            print(output.to("cpu"))                   # used, not discarded
        for batch in loader:
            batch.to(device)                          # PyG / BatchEncoding move in place
        for p in model.parameters():
            p.to(device)                              # 22: parameters do not move this way
        inputs = tokenizer("a b", return_tensors="pt")
        inputs.to(device)
    """
    assert found(source, DiscardedMove) == [("GM104", 9), ("GM104", 13), ("GM104", 15), ("GM104", 17),
                                            ("GM104", 22)]


def test_discarded_move_messages():
    result = lint(b"import torch\nx = torch.ones(2)\nx.cuda()\nfor p in m.parameters():\n    p.to(d)\n", [DiscardedMove])
    first, second = result.findings
    assert (first.line, first.col) == (3, 0) and "write `x = x.cuda(...)`" in first.message
    assert (second.line, second.col) == (5, 4) and "move the module" in second.message


def test_data_attribute():
    source = """\
    import torch
    import torch.nn as nn
    from torchvision import datasets

    train_set = datasets.MNIST(args.data, train=True)
    pixels = train_set.data.float() / 255             # a dataset's tensor, not a graph
    n = len(train_loader.dataset)

    def weights_init(m):
        m.weight.data.normal_(0.0, 0.02)              # 10
        nn.init.zeros_(m.bias.data)                   # 11

    def sgd_step(model, lr):
        for p in model.parameters():
            p.data.add_(p.grad.data, alpha=-lr)       # 15: one update, one finding

    def evaluate(model, loader):
        for data, target in loader:
            output = model(data)
            pred = output.data.max(1)[1]              # 20
            correct = pred.eq(target.data).sum()      # 21
            size = output.data.size(0)                # metadata only
            print(loss.data[0])                       # GM201's

    w = torch.randn(3, requires_grad=True)
    w.data = torch.zeros(3)                           # 26
    w.data[0] = 1.0                                   # 27
    """
    assert found(source, DataAttribute) == [("GM204", 10), ("GM204", 11), ("GM204", 15), ("GM204", 20),
                                            ("GM204", 21), ("GM204", 26), ("GM204", 27)]


def test_data_attribute_positions_and_messages():
    result = lint(b"net = Net()\nfor p in net.parameters():\n    p.data.mul_(0.9)\nout = net(x)\ny = out.data\n", [DataAttribute])
    update, read = result.findings
    assert (update.line, update.col) == (3, 4) and "torch.no_grad()" in update.message
    assert (read.line, read.col) == (5, 4) and "`out.detach()`" in read.message


def test_empty_cache_in_loop():
    source = """\
    import torch
    from torch.cuda import empty_cache

    def train(model, loader, epochs):
        for epoch in range(epochs):
            for step, (x, y) in enumerate(loader):
                try:
                    loss = model(x, y)
                    loss.backward()
                except RuntimeError:
                    torch.cuda.empty_cache()           # only on failure
                    continue
                if step % 50 == 0:
                    torch.cuda.empty_cache()           # 14
                del loss
            torch.cuda.empty_cache()                   # once per epoch

    def generate(model, prompts):
        outputs = []
        while prompts:
            outputs.append(model(prompts.pop()))
            empty_cache()                              # 22
        torch.cuda.empty_cache()
        return outputs
    """
    assert found(source, EmptyCacheInLoop) == [("GM304", 14), ("GM304", 22)]


def test_oom_retry_leak():
    source = """\
    import torch

    def train(model, loader, optimizer):
        for x, y in loader:
            try:
                out = model(x)
                loss = criterion(out, y)
                loss.backward()
            except RuntimeError as e:                  # 9
                if "CUDA out of memory" in str(e):
                    optimizer.zero_grad()
                    continue
                raise

    def train_safe(model, loader, optimizer):
        for x, y in loader:
            try:
                out = model(x)
                loss = criterion(out, y)
                loss.backward()
            except RuntimeError as e:
                if "out of memory" not in str(e):
                    raise
                del out, loss
                optimizer.zero_grad()

    def find_batch_size(model, bs):
        while bs > 1:
            try:
                preds = model(torch.zeros(bs, 3, 224, 224))
                return bs
            except torch.cuda.OutOfMemoryError:        # 32
                bs //= 2
    """
    assert found(source, OomRetryLeak) == [("GM306", 9), ("GM306", 32)]


def test_oom_retry_leak_position():
    source = b"for x in xs:\n    try:\n        y = f(x)\n    except RuntimeError as e:\n        if 'out of memory' in str(e):\n            continue\n        raise\n"
    (finding,) = lint(source, [OomRetryLeak]).findings
    assert (finding.line, finding.col) == (4, 4) and "`y`" in finding.message


def test_loader_no_workers():
    source = """\
    import torch
    from torch.utils.data import DataLoader
    import torch.utils.data as tud

    train_loader = DataLoader(train_set, batch_size=64, shuffle=True)       # 5
    val_loader = DataLoader(val_set, batch_size=256)
    extra = tud.DataLoader(extra_set, 64, True, None, None, 0)              # 7: positional 0
    fast_train_loader = DataLoader(train_set, batch_size=64, num_workers=8)
    cfg_train_loader = DataLoader(train_set, batch_size=64, **loader_kwargs)
    train_loader2 = DataLoader(train_set, num_workers=args.workers)

    def fit(model, optimizer, epochs):
        for epoch in range(epochs):
            for x, y in extra:
                loss = model(x, y)
                loss.backward()
                optimizer.step()
            with torch.no_grad():
                for x, y in val_loader:
                    model(x)
            for x, y in DataLoader(aux_set, num_workers=0):                 # 21
                model(x, y).backward()
    """
    assert found(source, LoaderNoWorkers) == [("GM601", 5), ("GM601", 7), ("GM601", 21)]


def test_loader_no_workers_points_at_the_zero():
    (finding,) = lint(b"from torch.utils.data import DataLoader\ntrain_dl = DataLoader(ds, num_workers=0)\n",
                      [LoaderNoWorkers]).findings
    assert (finding.line, finding.col) == (2, 26) and "num_workers=0" in finding.message


def test_loader_no_pin_memory():
    source = """\
    import torch
    from torch.utils.data import DataLoader

    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda" if use_cuda else "cpu")
    kwargs = {"num_workers": 1, "pin_memory": True} if use_cuda else {}
    train_loader = DataLoader(train_set, batch_size=64, shuffle=True, **kwargs)
    test_loader = DataLoader(test_set, batch_size=1000)                     # 8
    eval_loader = DataLoader(eval_set, 32, False, None, None, 2, None, False)
    aux_loader = torch.utils.data.DataLoader(aux_set, num_workers=2)        # 10

    model = Net().to(device)
    for data, target in train_loader:
        data, target = data.to(device), target.to(device)
        loss = model(data, target)
    """
    assert found(source, LoaderNoPinMemory) == [("GM602", 8), ("GM602", 10)]


def test_loader_no_pin_memory_cpu_script():
    source = """\
    from torch.utils.data import DataLoader
    loader = DataLoader(ds, batch_size=64)  # no .cuda() here, only in this comment
    for x, y in loader:
        x = x.to("cpu")
        print("x.to(device)")
    """
    assert found(source, LoaderNoPinMemory) == []


def test_host_device_roundtrip():
    source = """\
    import numpy as np
    import torch

    def train(model, loader, device):
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            out = model(x)
            probs = out.softmax(1).cpu()
            history.append(probs.numpy())
            loss = criterion(probs.to(device), y)                    # 10
            mask = torch.from_numpy(y.cpu().numpy()).cuda()          # 11
            feats = out.detach().cpu()
            feats = smooth(feats)
            feats = feats.to(device)                                 # rebound in between
            if loss.item() > 10:
                model = model.cpu()
                save(model)
                model = model.to(device)                             # a module
        host = out.cpu()
        return host.cuda()                                           # not in a loop
    """
    assert found(source, HostDeviceRoundtrip) == [("GM603", 10), ("GM603", 11)]


def test_host_device_roundtrip_message_names_the_line():
    (finding,) = lint(b"while True:\n    h = f(x).cpu()\n    g(h)\n    h = h.cuda()\n", [HostDeviceRoundtrip]).findings
    assert (finding.line, finding.col) == (4, 8) and "on line 2" in finding.message


# ---------------------------------------------------------------- the migration report's cost (issue 17, 3c)

import difflib  # noqa: E402
import json  # noqa: E402

from gpumigrate.rewriter.engine import FileResult, Finding  # noqa: E402
from gpumigrate.rewriter.report import line_map, migration_report  # noqa: E402

HEADER = "import torch\n"
ADDED = "from gpumigrate.runtime import get_device\n\ndevice = get_device()\n"  # what --to device inserts


def cuda_run(n: int) -> tuple:
    """A script of `n` consecutive `.cuda()` lines and its `--to device` migration: one
    edited run of n old lines and n + 3 new ones."""
    old = HEADER + "".join(f"x{i} = torch.zeros(3).cuda()\n" for i in range(n))
    new = HEADER + ADDED + "".join(f"x{i} = torch.zeros(3).to(device)\n" for i in range(n))
    return old.encode(), new.encode()


class TooMuchWork(Exception):
    pass


def counted_similarity(monkeypatch, budget: int) -> dict:
    """Count the calls into SequenceMatcher's ratio and quick_ratio (every line comparison
    the report makes); past `budget` calls, stop: quadratic work would take minutes."""
    calls = {"n": 0}
    for name in ("ratio", "quick_ratio"):
        original = getattr(difflib.SequenceMatcher, name)

        def wrapped(self, _original=original):
            calls["n"] += 1
            if calls["n"] > budget:
                raise TooMuchWork(f"more than {budget} line comparisons")
            return _original(self)

        monkeypatch.setattr(difflib.SequenceMatcher, name, wrapped)
    return calls


def test_line_map_work_grows_linearly_with_an_edited_run(monkeypatch):
    counts = {}
    for n in (1000, 2000):
        old, new = cuda_run(n)
        calls = counted_similarity(monkeypatch, budget=60 * n)
        moved = line_map(old, new)
        counts[n] = calls["n"]
        monkeypatch.undo()
        assert moved(1) == 1  # `import torch` stays
        assert [moved(line) for line in range(2, n + 2)] == list(range(5, n + 5))  # one for one, 3 lines down
    assert counts[2000] <= 2.2 * counts[1000], counts


def test_line_map_in_a_long_run_keeps_guards_and_inserted_blocks():
    n = 1000
    old = [HEADER] + [f"x{i} = torch.zeros(3).cuda()\n" for i in range(n)]
    new = [HEADER] + ADDED.splitlines(keepends=True) + [f"x{i} = torch.zeros(3).to(device)\n" for i in range(n)]
    # a guard line removed (its body dedented) at old line 402, a block of 8 lines inserted
    # before old line 702: both inside the one edited run
    old.insert(401, "if torch.cuda.is_available():\n")
    old[402] = "    " + old[402]
    new.insert(704, "".join(f"setup_{k}(rank)\n" for k in range(8)))
    new = "".join(new).splitlines(keepends=True)
    moved = line_map("".join(old).encode(), "".join(new).encode())
    assert moved(1) == 1
    assert [moved(line) for line in range(2, 402)] == list(range(5, 405))
    assert moved(402) == 405  # the removed guard: where the code after it went
    assert [moved(line) for line in range(403, 703)] == list(range(405, 705))
    assert [moved(line) for line in range(703, n + 3)] == list(range(713, n + 13))


def counted_alignment(monkeypatch, budget: int) -> dict:
    """The lines difflib's find_longest_match looks through, summed over its calls on lists
    of lines (the line alignment's work, not a comparison of two lines); past `budget`, stop."""
    seen = {"n": 0}
    original = difflib.SequenceMatcher.find_longest_match

    def wrapped(self, alo=0, ahi=None, blo=0, bhi=None):
        ahi = len(self.a) if ahi is None else ahi
        bhi = len(self.b) if bhi is None else bhi
        if isinstance(self.a, list):
            seen["n"] += (ahi - alo) + (bhi - blo)
        if seen["n"] > budget:
            raise TooMuchWork(f"more than {budget} lines looked through")
        return original(self, alo, ahi, blo, bhi)

    monkeypatch.setattr(difflib.SequenceMatcher, "find_longest_match", wrapped)
    return seen


def test_line_map_work_grows_linearly_with_blank_lines_between_edits(monkeypatch):
    """A blank line after every edited line: difflib over the whole file looks through
    every blank line for each one (cubic), and aligned the blank after `import torch` with
    the one the migration added, putting every `.cuda()` line on the line before its own."""
    counts = {}
    for n in (1000, 2000):
        old = (HEADER + "".join(f"x{i} = torch.zeros(3).cuda()\n\n" for i in range(n))).encode()
        new = (HEADER + ADDED + "".join(f"x{i} = torch.zeros(3).to(device)\n\n" for i in range(n))).encode()
        aligned = counted_alignment(monkeypatch, budget=50 * n)
        compared = counted_similarity(monkeypatch, budget=60 * n)
        moved = line_map(old, new)
        counts[n] = aligned["n"] + compared["n"]
        monkeypatch.undo()
        assert [moved(line) for line in range(1, 2 * n + 2)] == [1] + list(range(5, 2 * n + 5))
    assert counts[2000] <= 2.2 * counts[1000], counts


def _reference_line_map(old: bytes, new: bytes):
    """line_map as it was before it was made linear: every old line of an edited run against
    every new line at or after the previous one's."""
    a, b = old.splitlines(), new.splitlines()
    where = {}
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag == "equal":
            where.update({i: j1 + (i - i1) for i in range(i1, i2)})
            continue
        j = j1
        for i in range(i1, i2):
            best, score = None, 0.6
            for k in range(j, j2):
                ratio = difflib.SequenceMatcher(None, a[i].strip(), b[k].strip()).ratio()
                if ratio > score:
                    best, score = k, ratio
            if best is not None:
                j = best
            where[i] = min(j, max(j2 - 1, j1))
            if best is not None:
                j = min(best + 1, max(j2 - 1, j1))
    return lambda line: where.get(line - 1, line - 1) + 1


ORDINARY = {
    "one for one": ("import torch\na = x.cuda()\nb = y.cuda()\nc = 1\n",
                    "import torch\na = x.to(device)\nb = y.to(device)\nc = 1\n"),
    "removed guard": ("import torch\nif torch.cuda.is_available():\n    model = model.cuda()\nprint(1)\n",
                      "import torch\nmodel = model.to(device)\nprint(1)\n"),
    "inserted block": ("import torch\nfrom torch.autograd import Variable\nx = Variable(torch.ones(1).cuda())\ny = 2\n",
                       "import torch\nfrom gpumigrate.runtime import get_device\n\ndevice = get_device()\n"
                       "x = torch.ones(1).to(device)\ny = 2\n"),
    "lines merged": ("a = 1\nx = f(\n    y.cuda())\nz = 3\n", "a = 1\nx = f(y.to(device))\nz = 3\n"),
    "everything replaced": ("p = 1\nq = 2\n", "something else entirely\n"),
    "all removed": ("a = 1\nif torch.cuda.is_available():\n    pass\nb = 2\n", "a = 1\nb = 2\n"),
    "twenty lines and a wrap": (
        "".join(f"v{i} = torch.ones({i}).cuda()\n" for i in range(20)) + "print(loss.item())\n",
        "from gpumigrate.runtime import get_device, is_main_process\n\ndevice = get_device()\n"
        + "".join(f"v{i} = torch.ones({i}).to(device)\n" for i in range(20))
        + "if is_main_process():\n    print(loss.item())\n"),
}


@pytest.mark.parametrize("case", ORDINARY, ids=str)
def test_line_map_answers_as_before_on_ordinary_edits(case):
    old, new = (s.encode() for s in ORDINARY[case])
    lines = range(1, old.count(b"\n") + 2)
    assert [line_map(old, new)(n) for n in lines] == [_reference_line_map(old, new)(n) for n in lines]


class CountedLine(int):
    """A finding's line number that counts its equality tests."""

    eq = 0

    def __eq__(self, other):
        CountedLine.eq += 1
        return int(self) == int(other)

    def __ne__(self, other):
        return not self.__eq__(other)

    __hash__ = int.__hash__


def test_report_grouping_work_grows_linearly_with_the_findings():
    counts = {}
    for n in (1000, 2000):
        findings = [Finding("GM101", CountedLine(line), 0, "`.cuda()` hard-codes the device", fixed=True)
                    for line in range(1, n + 1)]
        findings += [Finding("GM101", CountedLine(line), 4, "`.cuda()` hard-codes the device", fixed=True)
                     for line in range(1, n + 1, 2)]  # a second finding on every other line
        result = FileResult("t.py", b"x\n" * n, findings=findings)
        CountedLine.eq = 0
        report = migration_report([result], "device", json_format=True)
        counts[n] = CountedLine.eq
        (group,) = json.loads(report)["files"][0]["fixed"]
        assert group["lines"] == group["original_lines"] == list(range(1, n + 1))
    assert counts[2000] <= 2.2 * counts[1000], counts
