"""Full-batch training on fixed tensors (no DataLoader): `--to ddp` splits their rows between
the ranks (`shard_rows`) where the training loop provably trains on them whole, and says what
to check; everywhere else the data stays whole and the review says so.

The runtime's split is a DistributedSampler's (no shuffle, padded), checked against one under
torchrun; the migrated fixture `fullbatch_tensors.py` must, under torchrun, draw different
rows on each rank and end with the parameters of the original run in one process (equal
shares of a mean loss average to the whole batch's gradient).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

from tests.conftest import FIXTURES
from tests.probe_runs import NPROC, run_probe
from tests.test_distributed import ddp
from tests.test_runtime import torchrun

HEAD = """\
import torch
from torch import nn
model = nn.Linear(3, 2)
criterion = nn.CrossEntropyLoss()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
inputs = torch.randn(8, 3)
targets = torch.randint(0, 2, (8,))
"""
SPLIT = "are split between the ranks"
WHOLE = "training data does not come from a DataLoader"


# ---------------------------------------------------------------- what the migration decides

def test_a_loop_over_fixed_tensors_trains_on_this_ranks_rows():
    out, reviews = ddp("""\
        # Training
        for epoch in range(100):
            opt.zero_grad()
            output = model(inputs)
            loss = criterion(output, targets)
            acc = (output.argmax(1) == targets).float().mean()
            loss.backward()
            opt.step()
        print(model(inputs).argmax(1).tolist())
        """, head=HEAD)
    assert "# Training\ninputs_shard, targets_shard = shard_rows(inputs, targets)\nfor epoch in range(100):" in out
    assert "output = model(inputs_shard)" in out and "loss = criterion(output, targets_shard)" in out
    assert "acc = (output.argmax(1) == targets_shard)" in out  # every read in the loop: no shape mismatch
    assert "value = model(inputs).argmax(1).tolist()" in out  # after the loop: the whole set, as before
    assert any(SPLIT in r and "check that dim 0 is the batch" in r for r in reviews), reviews
    assert not any(WHOLE in r for r in reviews), reviews


def test_the_split_goes_before_the_outermost_loop_that_keeps_the_tensors():
    out, _ = ddp("""\
        for run in range(2):
            x = inputs * (run + 1)
            for epoch in range(3):
                loss = criterion(model(x), targets)
                loss.backward()
                opt.step()
        """, head=HEAD)
    assert "    x_shard, targets_shard = shard_rows(x, targets)\n    for epoch in range(3):" in out, out


@pytest.mark.parametrize("loop", [
    # hidden state sized by a constant: its batch dim would not follow the rows
    """\
    for epoch in range(3):
        hidden = torch.zeros(1, 8, 2)
        output = model(inputs, hidden)
        loss = criterion(output, targets)
        loss.backward()
        opt.step()
    """,
    # the loss summed sample by sample: a share's sum is not the batch's mean
    """\
    for epoch in range(3):
        output = model(inputs)
        loss = 0
        for i in range(len(targets)):
            loss += criterion(output[i:i + 1], targets[i:i + 1])
        loss.backward()
        opt.step()
    """,
    # the loss reads a value of unknown shape beside the rows
    """\
    weights = make_weights()
    for epoch in range(3):
        output = model(inputs)
        loss = criterion(output, targets) if weights is None else criterion(output * weights, targets)
        loss.backward()
        opt.step()
    """,
])
def test_data_left_whole_where_the_rows_cannot_be_followed(loop):
    out, reviews = ddp(loop, head=HEAD)
    assert "shard_rows" not in out
    assert any(WHOLE in r for r in reviews), reviews


def test_a_loop_that_draws_its_data_is_sharded_by_its_counter_not_by_rows():
    out, _ = ddp("""\
    for epoch in range(3):
        x = torch.randn(8, 3)
        loss = criterion(model(x), targets)
        loss.backward()
        opt.step()
    """, head=HEAD)
    assert "shard_rows" not in out and "for epoch in shard_batches(range(3)):" in out


def test_a_dataloader_script_is_sharded_by_its_sampler_not_by_rows():
    out, _ = ddp("""\
        from torch.utils.data import DataLoader, TensorDataset
        loader = DataLoader(TensorDataset(inputs, targets), batch_size=4, shuffle=True)
        for epoch in range(2):
            for x, y in loader:
                loss = criterion(model(x), y)
                loss.backward()
                opt.step()
            loss = criterion(model(inputs), targets)
        """, head=HEAD)
    assert "shard_rows" not in out and "distributed_sampler(" in out


# ---------------------------------------------------------------- the runtime's split

RUNNER = """\
import json, sys, warnings
import torch
from torch.utils.data.distributed import DistributedSampler
from gpumigrate.runtime import get_rank, setup_distributed, shard_rows

setup_distributed()
rank, out = get_rank(), {}
for n in (8, 7, 3):
    x = torch.arange(n * 2).view(n, 2)
    y = torch.arange(n)
    xs, ys = shard_rows(x, y)
    out[n] = {"x": xs.tolist(), "y": ys.tolist(),
              "sampler": list(DistributedSampler(range(n), num_replicas=2, rank=rank, shuffle=False))}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    a, b = shard_rows(torch.zeros(4, 2), torch.zeros(5))
    out["unequal"] = [list(a.shape), list(b.shape), [str(w.message) for w in caught]]
    out["one_row"] = list(shard_rows(torch.zeros(1, 3)).shape)
json.dump(out, open(sys.argv[1] + f"/rank{rank}.json", "w"))
"""


@pytest.mark.e2e
@pytest.mark.ddp
def test_shard_rows_splits_as_a_distributed_sampler(tmp_path):
    script = tmp_path / "rows.py"
    script.write_text(RUNNER)
    code, _, err = torchrun(script, str(tmp_path))
    assert code == 0, err[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank in ranks:
        for n in ("8", "7", "3"):
            assert rank[n]["y"] == rank[n]["sampler"]  # the same rows a DistributedSampler gives
            assert rank[n]["x"] == [[2 * i, 2 * i + 1] for i in rank[n]["y"]]  # every tensor the same rows
        assert rank["one_row"] == [1, 3]  # fewer rows than ranks: whole
    assert sorted(ranks[0]["8"]["y"] + ranks[1]["8"]["y"]) == list(range(8))
    shapes, warned = ranks[0]["unequal"][:2], ranks[0]["unequal"][2]
    assert shapes == [[4, 2], [5]] and any("different lengths (4, 5)" in w for w in warned), warned
    assert ranks[1]["unequal"][2] == []  # said once, by rank 0


def test_shard_rows_in_one_process_returns_its_arguments():
    from gpumigrate.runtime import shard_rows
    x, y = torch.randn(5, 2), torch.randn(5)
    assert shard_rows(x) is x
    assert shard_rows(x, y) == (x, y)


# ---------------------------------------------------------------- the migrated fixture, run

@pytest.mark.e2e
@pytest.mark.ddp
def test_migrated_fullbatch_script_is_data_parallel_and_equals_one_process(tmp_path):
    """Two ranks on 4 rows each, DDP averaging their mean losses' gradients: the whole
    8-row batch's gradient, so the weights end as the original's in one process."""
    golden = FIXTURES / "expected" / "ddp" / "fullbatch_tensors.py"
    original = FIXTURES / "scripts" / "fullbatch_tensors.py"
    one = run_probe(original, tmp_path / "one", 1)
    assert one.ok(), one.why()
    run = run_probe(golden, tmp_path / "ddp", NPROC)
    assert run.ok(), run.why()
    inputs = [run.ranks[r]["inputs"] for r in range(NPROC)]
    assert len(inputs[0]) == 60 and all(a != b for a, b in zip(*inputs))  # each rank its own rows, every step
    assert one.ranks[0]["inputs"][0] not in inputs[0]
    reference = torch.load(one.out / "rank0_optim0.pt")
    for r in range(NPROC):
        torch.testing.assert_close(torch.load(run.out / f"rank{r}_optim0.pt"), reference, rtol=1e-5, atol=1e-6)
    printed = run.ranks[0]["stdout"]
    assert "predictions [1, 1, 1, 0, 0, 0, 1, 0]" in printed and "correct 4" in printed
    assert run.ranks[1]["stdout"].strip() == ""
    assert [Path(s["path"]).name for r in run.ranks.values() for s in r["saves"]] == ["tiny_classifier.pt"]


@pytest.mark.e2e
@pytest.mark.ddp
def test_migrated_fullbatch_derivative_script_splits_differentiated_inputs(tmp_path):
    """fixtures/scripts/fullbatch_derivative.py: the input requires grad and is differentiated
    at every step (`autograd.grad(H, x, create_graph=True)`), the model is called through a
    method chosen by a flag. Each rank's rows are a leaf of their own (an indexed view's graph
    would be freed by the first backward), and the two ranks' equal shares of a mean loss end
    with the one-process weights."""
    golden = FIXTURES / "expected" / "ddp" / "fullbatch_derivative.py"
    assert "x_shard, dxdt_shard = shard_rows(x, dxdt)" in golden.read_text()
    one = run_probe(FIXTURES / "scripts" / "fullbatch_derivative.py", tmp_path / "one", 1)
    assert one.ok(), one.why()
    run = run_probe(golden, tmp_path / "ddp", NPROC)
    assert run.ok(), run.why()
    reference = torch.load(one.out / "rank0_optim0.pt")
    for r in range(NPROC):
        torch.testing.assert_close(torch.load(run.out / f"rank{r}_optim0.pt"), reference, rtol=1e-4, atol=1e-5)
    assert run.ranks[1]["stdout"].strip() == "" and "step 30" in run.ranks[0]["stdout"]
