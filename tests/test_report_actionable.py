"""A migration report the user can act on alone (issue 20, item 2): how to launch the result,
what it now imports, what GPUMIGRATE_AMP does; changed items worded as what was done; review
items pointing at, and quoting, the migrated file."""

import json
import shutil

import pytest
from click.testing import CliRunner

from gpumigrate import cli
from gpumigrate.codemods import ALL_RULES
from tests.conftest import FIXTURES

MNIST = FIXTURES / "scripts" / "mnist_2018.py"


def _migrate(tmp_path, *args):
    script = tmp_path / "train.py"
    shutil.copyfile(MNIST, script)
    run = CliRunner().invoke(cli.main, [str(script), "--no-cache", "--report", str(tmp_path / "r.md"), *args])
    assert run.exit_code == 0, run.output
    return script, run.output, (tmp_path / "r.md").read_text()


def test_every_fix_says_what_it_does():
    missing = [r.code for r in ALL_RULES if r.fixed_in and not r.done]
    assert not missing, f"rules with a fix but no `done` wording: {missing}"
    same = [r.code for r in ALL_RULES if r.done and r.done == r.message]
    assert not same


def test_ddp_report_gives_the_launch_command_and_the_runtime_dependency(tmp_path):
    script, output, report = _migrate(tmp_path, "--to", "ddp")
    steps = report.split("## Next steps")[1].split("\n## ")[0]
    assert f"`torchrun --nproc_per_node=NUM_GPUS {script} ARGS`" in steps
    assert "imports `gpumigrate.runtime`" in steps and 'pip install "gpumigrate[torch]"' in steps
    assert "--vendor-runtime DIR" in steps
    assert "GPUMIGRATE_AMP" not in report  # not an amp migration
    # the terminal's last lines say the same
    assert f"next: launch: `torchrun --nproc_per_node=NUM_GPUS {script} ARGS`" in output


def test_only_the_script_is_launched_not_the_module_it_imports(tmp_path):
    project = tmp_path / "p"
    shutil.copytree(FIXTURES / "projects" / "agent_step_budget", project)
    run = CliRunner().invoke(cli.main, [str(project), "--to", "ddp", "--no-cache"])
    assert run.exit_code == 0, run.output
    launches = [line for line in run.output.splitlines() if line.startswith("next: launch:")]
    assert launches == [f"next: launch: `torchrun --nproc_per_node=NUM_GPUS {project / 'train.py'} ARGS` "
                        f"(`python {project / 'train.py'} ARGS` still runs it in one process)"], run.output


def test_amp_report_says_what_gpumigrate_amp_does(tmp_path):
    _, output, report = _migrate(tmp_path, "--to", "amp")
    assert "`GPUMIGRATE_AMP=off` trains in float32" in report
    assert "torchrun" not in report  # one process: nothing to launch differently
    assert "next: precision:" in output


def test_vendored_runtime_needs_no_install_note(tmp_path):
    _, output, report = _migrate(tmp_path, "--to", "device", "--vendor-runtime", str(tmp_path))
    assert "gpumigrate.runtime" not in report and "pip install" not in output


def test_changed_items_are_worded_as_what_was_done(tmp_path):
    _, _, report = _migrate(tmp_path, "--to", "device")
    changed = report.split("### Changed")[1]
    assert "GM101 `.cuda()` → `.to(device)`" in changed
    assert "GM201 `.data[0]` → `.item()`" in changed
    assert "GM303 `test()` runs under `@torch.no_grad()`" in changed
    assert "hard-codes the device" not in changed and "evaluates without" not in changed


def test_review_items_point_at_and_quote_the_migrated_file(tmp_path):
    script, output, report = _migrate(tmp_path, "--to", "ddp")
    lines = script.read_text().splitlines()
    loader = next(i for i, line in enumerate(lines, 1) if "train_loader = DataLoader(" in line)
    # the terminal names the line of the file as written, not the original's
    assert f"{script}:{loader}:1: GM400 review by hand: the effective batch size is now WORLD_SIZE" in output
    item = next(part for part in report.split("\n- ") if "the effective batch size" in part)
    assert item.startswith(f"line {loader} (original ") and "`train_loader = DataLoader(" in item


def test_a_dry_run_points_at_the_file_as_it_is(tmp_path):
    script = tmp_path / "train.py"
    shutil.copyfile(MNIST, script)
    run = CliRunner().invoke(cli.main, [str(script), "--no-cache", "--to", "ddp", "--check"])
    loader = next(i for i, line in enumerate(MNIST.read_text().splitlines(), 1)
                  if "train_loader = DataLoader(" in line)
    assert f"{script}:{loader}:" in run.output and "GM400 review by hand: the effective batch size" in run.output
    assert "next:" not in run.output


@pytest.mark.parametrize("target", ["ddp", "ddp,amp"])
def test_json_report_carries_the_next_steps(tmp_path, target):
    script = tmp_path / "train.py"
    shutil.copyfile(MNIST, script)
    run = CliRunner().invoke(cli.main, [str(script), "--no-cache", "--to", target, "--report", str(tmp_path / "r.json")])
    assert run.exit_code == 0, run.output
    data = json.loads((tmp_path / "r.json").read_text())
    assert any(step.startswith("launch: `torchrun") for step in data["next_steps"])
    assert any("GPUMIGRATE_AMP" in step for step in data["next_steps"]) == ("amp" in target)
