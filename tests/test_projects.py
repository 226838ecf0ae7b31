"""Projects (fixtures/projects/*): a script and the modules it imports, migrated as one program
with `gpumigrate DIR --to ddp`, then run under python and under torchrun with the probe."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Tuple

import pytest

from tests.conftest import FIXTURES
from tests.test_field_report_2 import (
    _assert_identical_weights,
    _assert_sharded,
    _cli,
    _ok,
    _printed,
    _project_review,
    _run,
    _saves,
    _snapshot,
    _torchrun,
)

PROJECTS = FIXTURES / "projects"
GAN = "gan_trainer_module"  # a driver that builds the optimizers, a trainer module with a gradient penalty


def _migrated(folder: str, tmp_path: Path) -> Tuple[Path, dict]:
    project = tmp_path / folder
    shutil.copytree(PROJECTS / folder, project)
    report = tmp_path / "report.json"
    done = _cli(project, "--to", "ddp", "--report", report)
    assert done.exit_code == 0, done.output
    return project, json.loads(report.read_text())


def test_a_driver_and_its_trainer_module_are_one_program(tmp_path):
    project, report = _migrated(GAN, tmp_path)
    files = _snapshot(project)
    assert "setup_distributed()" in files["main.py"]
    # the models train in training.py (`self.G.sample_latent()`, a gradient penalty): no DDP wrapper
    # in the script, whose checkpoint keys stay as they were; the step hooks average them
    assert "wrap_model" not in files["main.py"] + files["training.py"]
    assert "    def _train_epoch(self, data_loader):\n        data_loader = shard_loader(data_loader)\n" in \
        files["training.py"], "the loader handed in from main.py is not sharded"
    assert report["summary"]["not_applied"] == {}
    assert not any("no training found" in item or "no torch.optim optimizer" in item for item in _project_review(report))
    done = _cli(project, "--to", "ddp", "--check")
    assert done.exit_code == 0 and _snapshot(project) == files, f"a second run changes the project:\n{done.output}"


@pytest.mark.e2e
def test_the_migrated_project_runs_in_one_process(tmp_path):
    project, _ = _migrated(GAN, tmp_path)
    assert _ok(_run(project / "main.py")).count("epoch ") == 2


@pytest.mark.e2e
@pytest.mark.ddp
def test_the_migrated_project_trains_data_parallel(tmp_path):
    project, _ = _migrated(GAN, tmp_path)
    run = _torchrun(project / "main.py", tmp_path / "run", project=True)
    _assert_identical_weights(run)
    draws = _assert_sharded(run, dataset_len=64, epochs=2)
    assert draws[0][0] != draws[0][1], "the same order every epoch: the rebuilt loader is not kept across calls"
    assert _printed(run, 0).count("epoch ") == 2 and "epoch " not in _printed(run, 1)
    assert _saves(run, "gen.pt") == [0]


SOLVER = "solver_shared_loader"  # a script without torch driving a Solver that trains and tests on one loader


def test_a_loader_shared_by_training_and_testing_is_sharded_where_training_iterates_it(tmp_path):
    project, report = _migrated(SOLVER, tmp_path)
    files = _snapshot(project)
    assert "setup_distributed()" in files["main.py"], "a driver without torch of its own never joins the group"
    solver = files["solver.py"]
    assert solver.count("data_iter = iter(shard_loader(data_loader))") == 2
    assert "self.train_loader = train_loader\n" in solver and "for x, y in self.train_loader:" in solver, (
        "the test pass reads the whole set, as before")
    assert report["summary"]["not_applied"] == {}
    done = _cli(project, "--to", "ddp", "--check")
    assert done.exit_code == 0 and _snapshot(project) == files, f"a second run changes the project:\n{done.output}"


@pytest.mark.e2e
@pytest.mark.ddp
def test_the_solver_project_trains_data_parallel(tmp_path):
    project, _ = _migrated(SOLVER, tmp_path)
    assert "train accuracy" in _ok(_run(project / "main.py"))
    run = _torchrun(project / "main.py", tmp_path / "run", project=True)
    _assert_identical_weights(run)
    passes = [[len(it["indices"]) for it in run.ranks[r]["samplers"] if it.get("dataset_len") == 48]
              for r in range(2)]
    # the 12 iterations sharded by their counter: every second one, ending on the last, 6 per rank,
    # of 8 samples from this rank's 24 (2 whole passes), then the test pass
    assert passes[0] == passes[1] == [24, 24, 48], passes
    first = [set(run.ranks[r]["samplers"][0]["indices"]) for r in range(2)]
    assert not first[0] & first[1] and len(first[0] | first[1]) == 48, "the ranks' shards overlap"
    assert _printed(run, 0).count("train accuracy") == 1 and _printed(run, 1) == ""


CHAR_RNN = {
    "model.py": """\
import torch
import torch.nn as nn


class RNN(nn.Module):
    def __init__(self, n, hidden):
        super(RNN, self).__init__()
        self.hidden_size = hidden
        self.encoder = nn.Embedding(n, hidden)
        self.gru = nn.GRU(hidden, hidden)
        self.decoder = nn.Linear(hidden, n)

    def forward(self, inp, hidden):
        out, hidden = self.gru(self.encoder(inp).view(1, inp.size(0), -1), hidden)
        return self.decoder(out.view(inp.size(0), -1)), hidden

    def init_hidden(self, batch_size):
        return torch.zeros(1, batch_size, self.hidden_size)
""",
    "generate.py": """\
import torch
from model import *


def generate(decoder, length=5):
    hidden = decoder.init_hidden(1)
    inp = torch.zeros(1, dtype=torch.long)
    out = []
    for _ in range(length):
        logits, hidden = decoder(inp, hidden)
        inp = logits.argmax(1)
        out.append(int(inp))
    return out
""",
    "train.py": """\
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
from model import *
from generate import *

torch.manual_seed(0)
data = TensorDataset(torch.randint(0, 10, (32, 6)))
loader = DataLoader(data, batch_size=4, shuffle=True)
decoder = RNN(10, 8)
optimizer = torch.optim.Adam(decoder.parameters(), lr=0.01)
criterion = nn.CrossEntropyLoss()
for epoch in range(2):
    for (chunk,) in loader:
        hidden = decoder.init_hidden(chunk.size(0))
        loss = 0
        for c in range(5):
            output, hidden = decoder(chunk[:, c], hidden)
            loss = loss + criterion(output, chunk[:, c + 1])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(epoch, generate(decoder))
""",
}


@pytest.mark.e2e
@pytest.mark.ddp
def test_a_wrapped_model_handed_to_a_module_that_does_not_train_is_the_plain_model(tmp_path):
    """Practice corpus (char-rnn): `generate(decoder)` from `from generate import *` calls
    `decoder.init_hidden(1)`, which a DDP wrapper does not have."""
    project = tmp_path / "char_rnn"
    project.mkdir()
    for name, text in CHAR_RNN.items():
        (project / name).write_text(text)
    assert _cli(project, "--to", "ddp").exit_code == 0
    train = (project / "train.py").read_text()
    assert "decoder = wrap_model(decoder)" in train
    assert "generate(unwrap_model(decoder))" in train
    assert "unwrap_model(decoder).init_hidden(chunk.size(0))" in train
    run = _torchrun(project / "train.py", tmp_path / "run", project=True)
    _assert_identical_weights(run)
    assert _printed(run, 0).count("\n") == 2 and _printed(run, 1) == ""


@pytest.mark.e2e
def test_an_import_a_star_importer_may_use_stays(tmp_path):
    """Practice corpus (char-rnn): model.py's `Variable` import went once model.py no longer
    used it, and generate.py, which takes it through `from model import *`, failed with a
    NameError."""
    project = tmp_path / "star"
    project.mkdir()
    (project / "model.py").write_text("import torch\nfrom torch.autograd import Variable\n\n\n"
                                      "def ones():\n    return Variable(torch.ones(2)).cuda()\n")
    (project / "main.py").write_text("import torch\nfrom model import *\n\n"
                                     "print(Variable(torch.zeros(2)).sum().item() + ones().sum().item())\n")
    alone = tmp_path / "alone.py"
    alone.write_text((project / "model.py").read_text())
    assert _cli(project, "--to", "device").exit_code == 0 and _cli(alone, "--to", "device").exit_code == 0
    assert "from torch.autograd import Variable" in (project / "model.py").read_text()
    assert "return torch.ones(2).to(device)" in (project / "model.py").read_text()
    assert "Variable" not in alone.read_text(), "a module no other takes `*` from loses the unused import"
    assert _ok(_run(project / "main.py")).strip() == "2.0"


@pytest.mark.e2e
def test_an_object_whose_class_has_its_own_cuda_method_keeps_the_call(tmp_path):
    """Practice corpus (CMC): `self.multinomial.cuda()` of an AliasMethod, a plain object of
    the project whose own `cuda()` moves its tensors, became `.to(device)`, which it lacks."""
    package = tmp_path / "proj" / "nce"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "alias.py").write_text(
        "import torch\n\n\nclass AliasMethod(object):\n    def __init__(self, probs):\n        self.prob = probs\n\n"
        "    def cuda(self):\n        self.prob = self.prob.cuda()\n        return self\n\n"
        "    def draw(self, n):\n        return torch.multinomial(self.prob, n, replacement=True)\n")
    (package / "average.py").write_text(
        "import torch\nfrom .alias import AliasMethod\n\n\nclass Local(object):\n    def cuda(self):\n        return self\n\n\n"
        "class NCEAverage(torch.nn.Module):\n    def __init__(self, n):\n        super(NCEAverage, self).__init__()\n"
        "        self.multinomial = AliasMethod(torch.ones(n) / n)\n        self.multinomial.cuda()\n"
        "        local = Local()\n        local.cuda()\n\n"
        "    def forward(self, k):\n        return self.multinomial.draw(k)\n")
    (tmp_path / "proj" / "main.py").write_text(
        "import torch\nfrom nce.average import NCEAverage\n\nprint(NCEAverage(4).cuda()(3).shape)\n")
    assert _cli(tmp_path / "proj", "--to", "device").exit_code == 0
    average = (package / "average.py").read_text()
    assert "        self.multinomial.cuda()\n" in average and "        local.cuda()\n" in average
    assert "self.prob = self.prob.to(device)" in (package / "alias.py").read_text()
    assert "NCEAverage(4).to(device)(3)" in (tmp_path / "proj" / "main.py").read_text()
    assert _ok(_run(tmp_path / "proj" / "main.py")).strip() == "torch.Size([3])"


MEMORY_BANK = {
    "memory.py": """\
import torch
import torch.nn as nn


class Bank(nn.Module):
    def __init__(self, n, dim):
        super(Bank, self).__init__()
        self.register_buffer('memory', torch.randn(n, dim))

    def forward(self, feats, index):
        out = feats @ self.memory.t()
        self.memory.index_copy_(0, index, feats.detach())
        return out
""",
    "queue.py": """\
import torch
import torch.nn as nn
import torch.distributed as dist


class Queue(nn.Module):
    def __init__(self, n, dim):
        super(Queue, self).__init__()
        self.register_buffer('queue', torch.randn(n, dim))

    def push(self, keys):
        gathered = [torch.zeros_like(keys) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, keys)
        self.queue[:len(keys)] = torch.cat(gathered)[:len(keys)]
""",
    "train.py": """\
import torch
from torch.utils.data import DataLoader, TensorDataset
from memory import Bank
from queue import Queue

data = TensorDataset(torch.randn(16, 4), torch.arange(16))
loader = DataLoader(data, batch_size=4, shuffle=True)
model = torch.nn.Linear(4, 4)
bank = Bank(16, 4)
keys = Queue(8, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(2):
    for x, index in loader:
        optimizer.zero_grad()
        bank(model(x), index.cuda(async=True)).logsumexp(1).mean().backward()
        optimizer.step()
""",
}


def test_a_memory_bank_from_a_project_module_is_reported_unless_it_gathers_itself(tmp_path):
    """Practice corpus (CMC): an NCE memory bank in a module beside the script (a buffer its
    forward updates with index_copy_): each rank keeps its own. The module is read although the
    script needs a repair to parse (`async=True`); a queue whose module all_gathers is not
    reported."""
    project = tmp_path / "bank"
    project.mkdir()
    for name, text in MEMORY_BANK.items():
        (project / name).write_text(text)
    result = _cli(project / "train.py", "--to", "ddp")
    assert result.exit_code == 0, result.output
    said = [l for l in result.output.splitlines() if "keeps state in buffers" in l]
    assert len(said) == 1 and "`Bank`" in said[0] and "train.py:12:" in said[0]  # the line in the file as written, result.output


def test_a_helper_two_imports_away_prints_on_rank_0_and_a_second_run_changes_nothing(tmp_path):
    """Practice corpus: main.py imports solver.py (a trainer module), which imports network.py,
    whose init_weights() prints. The print ran on every rank; and a module that the migration
    gave `device = get_device()` counted as a script on the next run, whose imports then
    became helpers: the second run gated what the first had not."""
    project = tmp_path / "p"
    project.mkdir()
    (project / "network.py").write_text(
        "import torch.nn as nn\n\n\ndef init_weights(net):\n    print('initialize network')\n"
        "    net.apply(lambda m: None)\n")
    (project / "helpers.py").write_text("def banner(text):\n    print('=' * 10, text)\n")
    (project / "solver.py").write_text(
        "import torch\nimport torch.nn as nn\nfrom network import init_weights\nfrom helpers import banner\n\n\n"
        "class Solver:\n    def __init__(self, loader):\n        self.net = nn.Linear(4, 1).cuda()\n"
        "        init_weights(self.net)\n        self.opt = torch.optim.SGD(self.net.parameters(), lr=0.1)\n"
        "        self.loader = loader\n\n    def train(self):\n        banner('train')\n"
        "        for x, y in self.loader:\n            self.opt.zero_grad()\n"
        "            loss = (self.net(x.cuda()) - y.cuda()).pow(2).mean()\n            loss.backward()\n"
        "            self.opt.step()\n")
    (project / "main.py").write_text(
        "import torch\nfrom torch.utils.data import DataLoader, TensorDataset\nfrom solver import Solver\n\n"
        "data = TensorDataset(torch.randn(16, 4), torch.randn(16, 1))\n"
        "Solver(DataLoader(data, batch_size=4, shuffle=True)).train()\n")
    done = _cli(project, "--to", "ddp")
    assert done.exit_code == 0, done.output
    files = _snapshot(project)
    assert "    if is_main_process():\n        print('initialize network')\n" in files["network.py"]
    assert "    if is_main_process():\n        print('=' * 10, text)\n" in files["helpers.py"]
    done = _cli(project, "--to", "ddp", "--check")
    assert done.exit_code == 0 and _snapshot(project) == files, f"a second run changes the project:\n{done.output}"


def test_a_subfolder_put_on_sys_path_roots_the_imports_and_step_methods_are_named(tmp_path):
    from gpumigrate.rewriter.project import projects

    (tmp_path / "nn").mkdir()
    (tmp_path / "nn" / "gans.py").write_text(
        "class GAN:\n    def optimize_D(self, gen):\n        loss = self.d(next(gen))\n        loss.backward()\n"
        "        self.opt.step()\n\n    def fit(self, loader):\n        for x in loader:\n"
        "            self.d(x).backward()\n")
    (tmp_path / "train.py").write_text(
        "import os, sys\nhere = '/'.join(os.path.realpath(__file__).split('/')[:-1])\n"
        "sys.path.insert(0, here + '/nn/')\nfrom gans import GAN\nGAN().fit([])\n")
    found = projects([str(tmp_path / "train.py"), str(tmp_path / "nn" / "gans.py")])
    (link,) = found[str(tmp_path / "train.py")].imports
    assert link.path.endswith("gans.py") and link.steps == ("optimize_D",)  # fit() loops: not one step
    assert [i.path for i in found[str(tmp_path / "nn" / "gans.py")].importers] == [os.path.relpath(tmp_path / "train.py")]


def test_a_logger_class_in_a_helper_keeps_its_state_on_every_rank(tmp_path):
    """Practice corpus (SAM's example): `Log.train()` called `self._reset()`, which the migration
    gated as an output of a logger class: on rank 1 `epoch_state` never existed, and the
    script's own `log.flush()` (not gated: the class is another file's) raised AttributeError."""
    project = tmp_path / "p"
    (project / "utility").mkdir(parents=True)
    (project / "utility" / "log.py").write_text(
        "import time\n\n\nclass Log:\n    def train(self, n):\n        self.flush()\n        self._reset(n)\n\n"
        "    def flush(self):\n        if hasattr(self, 'state'):\n            print('loss', self.state['loss'] / max(1, self.n))\n\n"
        "    def __call__(self, loss):\n        self.state['loss'] += loss\n\n"
        "    def _reset(self, n):\n        self.n, self.start = n, time.time()\n        self.state = {'loss': 0.0}\n")
    (project / "train.py").write_text(
        "import torch\nfrom utility.log import Log\n\nmodel = torch.nn.Linear(2, 1).cuda()\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\nlog = Log()\nfor epoch in range(2):\n    log.train(4)\n"
        "    for x in torch.randn(4, 3, 2).unbind(0):\n        opt.zero_grad()\n        loss = model(x.cuda()).pow(2).mean()\n"
        "        loss.backward()\n        opt.step()\n        log(loss.item())\nlog.flush()\n")
    done = _cli(project, "--to", "ddp")
    assert done.exit_code == 0, done.output
    text = (project / "utility" / "log.py").read_text()
    assert "        self.flush()\n        self._reset(n)\n" in text, text
    assert "            if is_main_process():\n                print('loss'" in text, text


@pytest.mark.parametrize("target", ["device", "ddp"])
def test_a_function_that_trains_through_a_helper_module_gets_no_no_grad(target, tmp_path):
    """`run()` calls `model.eval()` after each epoch, and trains through `train_one_epoch`
    of engine.py (handed the optimizer): under `@torch.no_grad()` its backward would fail."""
    project = tmp_path / "engine_helper"
    shutil.copytree(PROJECTS / "engine_helper", project)
    done = _cli(project, "--to", target)
    assert done.exit_code == 0, done.output
    assert "no_grad" not in (project / "train.py").read_text()
    assert "1 " in _ok(_run(project / "train.py"))  # both epochs printed


def test_a_helper_migrated_in_the_same_run_is_not_put_up_for_review(tmp_path):
    """A loop's call of a project helper that may print is a review item only where the helper's
    module is not migrated with the script: when it is, its prints are gated there."""
    project = tmp_path / "helped"
    project.mkdir()
    (project / "helpers.py").write_text("def show(step, loss):\n    print(step, loss)\n")
    (project / "train.py").write_text(
        "import torch\nfrom torch.utils.data import DataLoader, TensorDataset\nimport helpers\n\n"
        "data = TensorDataset(torch.randn(16, 4), torch.randn(16, 1))\nmodel = torch.nn.Linear(4, 1)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for step, (x, y) in enumerate(DataLoader(data, batch_size=4, shuffle=True)):\n"
        "    loss = torch.nn.functional.mse_loss(model(x), y)\n    opt.zero_grad()\n    loss.backward()\n"
        "    opt.step()\n    helpers.show(step, loss.item())\n")
    alone = _cli(project / "train.py", "--to", "ddp", "--diff")
    together = _cli(project, "--to", "ddp", "--diff")
    assert alone.exit_code == 0 and together.exit_code == 0, alone.output + together.output
    assert "`helpers.show` comes from another file" in alone.output
    assert "comes from another file" not in together.output
    assert "if is_main_process():\n+        print(step, loss)" in together.output


@pytest.mark.e2e
def test_a_device_the_main_block_defines_is_defined_for_the_modules_that_import_its_functions(tmp_path):
    """A script whose `device` exists only under `if __name__ == "__main__":`, and whose
    evaluation function another module imports: that function needs a device there too."""
    project = tmp_path / "evaluated"
    project.mkdir()
    (project / "evaluate.py").write_text(
        "import torch\nimport torch.nn as nn\n\n\ndef evaluate(model, data):\n"
        "    Tensor = torch.cuda.FloatTensor if torch.cuda.is_available() else torch.FloatTensor\n"
        "    with torch.no_grad():\n        return model(data.type(Tensor)).sum().item()\n\n\n"
        "if __name__ == '__main__':\n    device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')\n"
        "    print(evaluate(nn.Linear(3, 1).to(device), torch.ones(2, 3)))\n")
    (project / "train.py").write_text(
        "import torch\nimport torch.nn as nn\nfrom evaluate import evaluate\n\ntorch.manual_seed(0)\n"
        "print('eval', evaluate(nn.Linear(3, 1), torch.ones(2, 3, dtype=torch.float64)))\n")
    before = _ok(_run(project / "train.py"))
    assert _cli(project, "--to", "device").exit_code == 0
    text = (project / "evaluate.py").read_text()
    assert text.count("device = get_device()") == 2 and "accelerator_available" not in text
    assert _ok(_run(project / "train.py")) == before and _ok(_run(project / "evaluate.py"))
