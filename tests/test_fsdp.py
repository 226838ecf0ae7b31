"""The fsdp migration's decisions (GM415 and the ddp rules it runs with): what it edits and
what it reports. Runs of migrated scripts under torchrun are in tests/test_fsdp_e2e.py."""

import textwrap

import pytest
from click.testing import CliRunner

from gpumigrate.cli import main
from gpumigrate.targets import TargetError, parse_target, target_bases
from tests.conftest import migrate

HEAD = """\
import torch
from torch.utils.data import DataLoader, TensorDataset
train_set = TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
"""

TRAIN = """\
loader = DataLoader(train_set, batch_size=4, shuffle=True)
for epoch in range(2):
    for x, y in loader:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
"""


def fsdp(code: str, target: str = "fsdp"):
    """The migrated source, its review items and its notes; checks idempotence."""
    source = HEAD + textwrap.dedent(code)
    result = migrate(source.encode(), target)
    assert result.error is None, result.error
    out = (result.new_source or result.source).decode()
    compile(out, "x.py", "exec")
    again = migrate(out.encode(), target)
    assert again.error is None and again.new_source is None, "not idempotent"
    return out, [f.message for f in result.findings if f.review], [f.message for f in result.findings if not f.review]


def test_fsdp_is_a_target_that_excludes_ddp(tmp_path):
    assert parse_target("amp, fsdp") == "fsdp,amp"
    assert target_bases("fsdp") == ("device", "ddp", "fsdp")
    with pytest.raises(TargetError, match="ddp and fsdp cannot be combined"):
        parse_target("ddp,fsdp")
    script = tmp_path / "x.py"
    script.write_text("import torch\n")
    result = CliRunner().invoke(main, [str(script), "--to", "ddp,fsdp"])
    assert result.exit_code == 2 and "cannot be combined" in result.output and "Traceback" not in result.output


def test_the_model_is_sharded_before_its_optimizer_and_the_checkpoint_gathered():
    out, reviews, notes = fsdp("model = torch.nn.Linear(4, 1)\nopt = torch.optim.AdamW(model.parameters())\n" + TRAIN
                               + "torch.save(model.state_dict(), 'model.pt')\n")
    assert "model = shard_model(model)\nopt = torch.optim.AdamW(model.parameters())" in out
    assert "wrap_model" not in out and "unwrap_model" not in out
    assert "model_state = full_state_dict(model)\nif is_main_process():\n    torch.save(model_state, 'model.pt')" in out
    assert "sampler=distributed_sampler(train_set)" in out  # ddp's data sharding comes with it
    assert any("sharded across the ranks (FSDP2)" in n for n in notes)
    assert not any("state_dict" in r for r in reviews)


def test_a_checkpoint_dict_gathers_the_model_and_its_optimizer():
    out, _, _ = fsdp("model = torch.nn.Linear(4, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n" + TRAIN
                     + "torch.save({'model': model.state_dict(), 'opt': opt.state_dict(), 'epoch': 2}, 'c.pt')\n")
    assert "model_state = full_state_dict(model)\nopt_state = full_optimizer_state_dict(model, opt)\n" in out
    assert "torch.save({'model': model_state, 'opt': opt_state, 'epoch': 2}, 'c.pt')" in out


def test_custom_attributes_are_read_as_they_are():
    """FSDP2 wraps nothing: `model.fc` and `model.state_dict()` keys stay the user's."""
    out, _, _ = fsdp("class Net(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
                     "        self.fc = torch.nn.Linear(4, 1)\n    def forward(self, x):\n        return self.fc(x)\n"
                     "model = Net()\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n" + TRAIN
                     + "print(model.fc.weight.shape)\n")
    assert "unwrap_model" not in out and "model.fc.weight.shape" in out


def test_what_sharding_changes_is_listed_for_review():
    out, reviews, _ = fsdp("model = torch.nn.Linear(4, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                           + TRAIN + "best = {k: v.clone() for k, v in model.state_dict().items()}\n"
                           "y = model.forward(torch.randn(1, 4))\n")
    assert "best = {k: v.clone() for k, v in full_state_dict(model, rank0_only=False).items()}" in out
    assert any("skips the hooks" in r for r in reviews)


def test_a_save_not_every_rank_reaches_is_reported():
    _, reviews, _ = fsdp("model = torch.nn.Linear(4, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                         + TRAIN + "if x.sum() > 0:  # this rank's last batch\n    torch.save(model.state_dict(), 'm.pt')\n")
    assert any("every rank must reach this save" in r for r in reviews)


def test_with_amp_the_shards_follow_the_autocast_precision():
    source = ("model = torch.nn.Linear(4, 1).cuda().half()\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
              + TRAIN)
    out, _, _ = fsdp(source, "fsdp,amp")
    assert "model = shard_model(model, mixed_precision=True)" in out
    assert "mixed_precision" not in fsdp(source.replace(".half()", ""))[0]


def test_a_module_saved_under_another_name_is_gathered_too():
    """shard_model shards the object in place: `model` below is the sharded `wrapper` (a
    practice script, gpleiss/efficient_densenet_pytorch, saved its shards this way)."""
    out, _, _ = fsdp("model = torch.nn.Linear(4, 1)\nwrapper = model\n"
                     "opt = torch.optim.SGD(wrapper.parameters(), lr=0.1)\n"
                     + TRAIN.replace("model(x)", "wrapper(x)") + "torch.save(model.state_dict(), 'm.pt')\n"
                     "torch.save(model, 'whole.pt')\n")
    assert "wrapper = shard_model(wrapper)" in out
    assert "model_state = full_state_dict(model)\nif is_main_process():\n    torch.save(model_state, 'm.pt')" in out
    assert "model_whole = full_model(model)" in out


def test_an_output_reading_a_sharded_model_is_computed_on_every_rank():
    """`model.fc.weight.norm()` gathers the shards (a collective): computed on every rank,
    printed by rank 0 (on rank 0 alone it would wait for the others for ever)."""
    out, _, _ = fsdp("model = torch.nn.Linear(4, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n" + TRAIN
                     + "print('norm', model.weight.norm().item())\n")
    assert "value = model.weight.norm().item()\nif is_main_process():\n    print('norm', value)" in out


def test_a_sharded_model_used_on_rank_0_alone_is_reported():
    _, reviews, _ = fsdp("import torch.distributed as dist\nmodel = torch.nn.Linear(4, 1)\n"
                         "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n" + TRAIN
                         + "if dist.get_rank() == 0:\n    y = model(torch.randn(1, 4))\n")
    assert any("runs on some ranks only" in r for r in reviews)


def test_a_save_in_the_scripts_own_rank0_branch_gathers_before_the_branch():
    out, reviews, _ = fsdp("import torch.distributed as dist\nmodel = torch.nn.Linear(4, 1)\n"
                           "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n" + TRAIN
                           + "if dist.get_rank() == 0:\n    torch.save(model.state_dict(), 'm.pt')\n")
    assert "model_state = full_state_dict(model)\nif dist.get_rank() == 0:\n" in out
    assert not any("some ranks only" in r for r in reviews)


def test_a_state_dict_every_rank_takes_is_the_whole_state_on_every_rank():
    """A checkpoint dict handed to a helper that saves it (rank 0 inside), a copy of the best
    weights: each rank gets the whole state, as one process had it."""
    out, reviews, _ = fsdp("def save_checkpoint(state, path):\n    torch.save(state, path)\n"
                           "model = torch.nn.Linear(4, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                           + TRAIN + "save_checkpoint({'model': model.state_dict(), 'opt': opt.state_dict()}, 'c.pt')\n")
    assert ("save_checkpoint({'model': full_state_dict(model, rank0_only=False), "
            "'opt': full_optimizer_state_dict(model, opt, rank0_only=False)}, 'c.pt')") in out
    assert not any("state_dict" in r for r in reviews)


def test_an_alias_saved_on_rank_0_alone_is_reported():
    _, reviews, _ = fsdp("import torch.distributed as dist\nmodel = torch.nn.Linear(4, 1)\n"
                         "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n" + TRAIN
                         + "if dist.get_rank() == 0:\n    to_save = model\n"
                           "    torch.save(to_save.state_dict(), 'm.pt')\n")
    assert any("every rank must reach this save" in r for r in reviews), reviews
