"""The command line, driven through click's CliRunner."""

import os
import stat

import pytest
from click.testing import CliRunner

from gpumigrate.cli import main

CUDA_SCRIPT = "import torch\nmodel = torch.nn.Linear(2, 2).cuda()\n"
CLEAN_SCRIPT = "import torch\nmodel = torch.nn.Linear(2, 2)\n"


@pytest.fixture
def run():
    def invoke(*args):
        return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    return invoke


def test_rewrites_in_place(run, tmp_script):
    path = tmp_script(CUDA_SCRIPT)
    result = run(path, "--to", "device")
    assert result.exit_code == 0
    assert ".to(device)" in path.read_text()
    assert "1 file changed" in result.output


def test_diff_writes_nothing(run, tmp_script):
    path = tmp_script(CUDA_SCRIPT)
    result = run(path, "--to", "device", "--diff")
    assert result.exit_code == 0
    assert "-model = torch.nn.Linear(2, 2).cuda()" in result.stdout
    assert "+model = torch.nn.Linear(2, 2).to(device)" in result.stdout
    assert path.read_text() == CUDA_SCRIPT


def test_check_exit_codes(run, tmp_script):
    dirty = tmp_script(CUDA_SCRIPT, "dirty.py")
    clean = tmp_script(CLEAN_SCRIPT, "clean.py")
    assert run(dirty, "--check").exit_code == 1
    assert dirty.read_text() == CUDA_SCRIPT
    assert run(clean, "--check").exit_code == 0


def test_output_file(run, tmp_script, tmp_path):
    path = tmp_script(CUDA_SCRIPT)
    out = tmp_path / "out" / "migrated.py"
    out.parent.mkdir()
    result = run(path, "-o", out)
    assert result.exit_code == 0
    assert path.read_text() == CUDA_SCRIPT
    assert ".to(device)" in out.read_text()


def test_output_needs_one_file(run, tmp_path):
    (tmp_path / "a.py").write_text(CUDA_SCRIPT)
    (tmp_path / "b.py").write_text(CUDA_SCRIPT)
    result = CliRunner().invoke(main, [str(tmp_path), "-o", str(tmp_path / "x.py")])
    assert result.exit_code == 2
    assert "exactly one input file" in result.output


def test_directories_recurse_and_skip(run, tmp_path):
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "sub" / "train.py").write_text(CUDA_SCRIPT)
    (tmp_path / "pkg" / "notes.txt").write_text(CUDA_SCRIPT)
    for skipped in (".hidden", "__pycache__", "venv"):
        (tmp_path / skipped).mkdir()
        (tmp_path / skipped / "x.py").write_text(CUDA_SCRIPT)
    (tmp_path / "venv" / "pyvenv.cfg").write_text("home = /usr\n")
    (tmp_path / "myenv").mkdir()
    (tmp_path / "myenv" / "pyvenv.cfg").write_text("home = /usr\n")
    (tmp_path / "myenv" / "x.py").write_text(CUDA_SCRIPT)
    result = run(tmp_path)
    assert result.exit_code == 0
    assert ".to(device)" in (tmp_path / "pkg" / "sub" / "train.py").read_text()
    assert (tmp_path / "pkg" / "notes.txt").read_text() == CUDA_SCRIPT
    for skipped in (".hidden", "__pycache__", "venv", "myenv"):
        assert (tmp_path / skipped / "x.py").read_text() == CUDA_SCRIPT
    assert "1 file changed" in result.output


def test_exclude(run, tmp_path):
    (tmp_path / "keep.py").write_text(CUDA_SCRIPT)
    (tmp_path / "legacy").mkdir()
    (tmp_path / "legacy" / "old.py").write_text(CUDA_SCRIPT)
    (tmp_path / "skip_me.py").write_text(CUDA_SCRIPT)
    result = run(tmp_path, "--exclude", "legacy", "--exclude", "skip_*.py")
    assert result.exit_code == 0
    assert ".to(device)" in (tmp_path / "keep.py").read_text()
    assert (tmp_path / "legacy" / "old.py").read_text() == CUDA_SCRIPT
    assert (tmp_path / "skip_me.py").read_text() == CUDA_SCRIPT


def test_python2_file(run, tmp_script):
    source = b"import torch\nprint 'loss', loss.data[0]\n"
    path = tmp_script(source)
    result = run(path)
    assert result.exit_code == 2
    assert f"{path}:2: cannot parse: Python 2 syntax" in result.output
    assert "2to3" in result.output
    assert "Traceback" not in result.output
    assert path.read_bytes() == source


def test_syntax_error_does_not_stop_other_files(run, tmp_path):
    (tmp_path / "bad.py").write_text("def broken(:\n    pass\n")
    (tmp_path / "good.py").write_text(CUDA_SCRIPT)
    result = run(tmp_path)
    assert result.exit_code == 2
    assert f"{tmp_path / 'bad.py'}:1: cannot parse:" in result.output
    assert (tmp_path / "bad.py").read_text() == "def broken(:\n    pass\n"
    assert ".to(device)" in (tmp_path / "good.py").read_text()
    assert "1 error" in result.output


def test_non_utf8_file(run, tmp_script):
    source = "import torch\n# caf\u00e9\nx = torch.ones(1).cuda()\n".encode("latin-1")
    path = tmp_script(source)
    result = run(path)
    assert result.exit_code == 2
    assert f"{path}:2: cannot decode as utf-8" in result.output
    assert "coding cookie" in result.output
    assert path.read_bytes() == source


def test_missing_path(run, tmp_path):
    result = run(tmp_path / "nope.py")
    assert result.exit_code == 2
    assert "nope.py: no such file or directory" in result.output


def test_read_only_file(run, tmp_script):
    path = tmp_script(CUDA_SCRIPT)
    os.chmod(path, 0o444)
    result = run(path)
    assert result.exit_code == 2
    assert "read-only" in result.output
    assert path.read_text() == CUDA_SCRIPT
    assert stat.S_IMODE(path.stat().st_mode) == 0o444


def test_keeps_mode_bits(run, tmp_script):
    path = tmp_script("#!/usr/bin/env python\n" + CUDA_SCRIPT)
    os.chmod(path, 0o755)
    assert run(path).exit_code == 0
    assert stat.S_IMODE(path.stat().st_mode) == 0o755
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]


def test_review_items_are_listed(run, tmp_script):
    path = tmp_script("x = output.data[0]\n")
    result = run(path)
    assert result.exit_code == 0
    assert f"{path}:1:5: GM201 review by hand" in result.output
    assert "1 to review by hand" in result.output


def test_rules_and_explain(run):
    listing = run("rules").output
    assert "GM101  cuda-call" in listing and "GM205" in listing
    codes = [line.split()[0] for line in listing.splitlines()[1:]]
    assert codes == sorted(codes) and len(codes) == len(set(codes))
    assert "GM603  host-device-roundtrip" in listing and "lint only" in listing
    explained = run("explain", "GM201")
    assert explained.exit_code == 0
    assert "## Why is this bad?" in explained.output and "loss.data[0]" in explained.output
    unknown = CliRunner().invoke(main, ["explain", "GM999"])
    assert unknown.exit_code == 2 and "no rule" in unknown.output


def test_python_dash_m(tmp_script):
    import subprocess
    import sys
    path = tmp_script(CUDA_SCRIPT)
    done = subprocess.run([sys.executable, "-m", "gpumigrate", str(path), "--check"], capture_output=True, text=True)
    assert done.returncode == 1
    assert "would change" in done.stderr


DDP_SCRIPT = """\
import torch
from torch.utils.data import DataLoader

model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2)).cuda()
loader = DataLoader(train_set, batch_size=8, shuffle=True)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(2):
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x.cuda()), y.cuda())
        loss.backward()
        optimizer.step()
    print(epoch, loss.item())
"""


def test_ddp_report_markdown_and_json(run, tmp_script, tmp_path):
    import json
    path = tmp_script(DDP_SCRIPT)
    result = run(path, "--to", "ddp", "--report", tmp_path / "report.md")
    assert result.exit_code == 0
    report = (tmp_path / "report.md").read_text()
    assert report.startswith("# gpumigrate --to ddp: migration report")
    assert "### Changed" in report and "GM400" in report
    assert "### Review by hand" in report and "GM407" in report
    assert "effective batch size is now WORLD_SIZE x 8" in report
    run(tmp_script(DDP_SCRIPT, "again.py"), "--to", "ddp", "--report", tmp_path / "report.json")
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["target"] == "ddp"
    (entry,) = data["files"]
    assert entry["changed"] and any(f["code"] == "GM402" for f in entry["fixed"])
    assert any(f["code"] == "GM407" for f in entry["review"])
    assert data["summary"]["changed"] == 1 and data["summary"]["review"] == sum(
        len(g["original_lines"]) for g in entry["review"])


INFERENCE = "import torch\nmodel = torch.nn.Linear(2, 2).cuda()\nprint(model(torch.randn(1, 2).cuda()))\n"
LONE_TRAINER = ("import torch\n\n\ndef train(model, opt, x):\n    model(x).sum().backward()\n"
                "    opt.step()\n")
FP16_CLOSURE = ("import torch\nmodel = torch.nn.Linear(2, 1)\nopt = torch.optim.LBFGS(model.parameters())\n"
                "x = torch.randn(4, 2)\n\n\ndef closure():\n    opt.zero_grad()\n    loss = model(x).sum()\n"
                "    loss.backward()\n    return loss\n\n\nopt.step(closure)\n")


def test_a_target_not_applied_is_said_in_the_summary_and_the_report(run, tmp_script, tmp_path):
    """Issue 18: a file that does not get the target asked for is never only one review line
    among many: the summary line and the report count it."""
    import json
    inference, lone = tmp_script(INFERENCE, "infer.py"), tmp_script(LONE_TRAINER, "engine.py")
    trains = tmp_script(DDP_SCRIPT, "train.py")
    result = run(inference, lone, trains, "--to", "ddp", "--diff", "--report", tmp_path / "r.json")
    assert result.exit_code == 0
    summary = result.stderr.strip().splitlines()[-1]
    assert summary.endswith("--to ddp not applied to 2 files (see the review items)"), summary
    assert "engine.py:1:1: GM400 review by hand: this module trains" in result.stderr
    assert "infer.py:1:1: GM400 review by hand: no training found" in result.stderr
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["summary"]["not_applied"] == {"ddp": 2}
    assert {f["path"].rsplit("/", 1)[-1]: f["not_applied"] for f in data["files"]} == {
        "infer.py": ["ddp"], "engine.py": ["ddp"], "train.py": []}
    run(inference, lone, trains, "--to", "ddp", "--diff", "--report", tmp_path / "r.md")
    report = (tmp_path / "r.md").read_text()
    assert "; --to ddp not applied to 2 files." in report
    assert report.count("**Not applied: --to ddp**") == 2
    # amp: a training step it cannot place
    closure = tmp_script(FP16_CLOSURE, "lbfgs.py")
    result = run(closure, "--to", "amp", "--diff")
    assert "--to amp not applied to 1 file" in result.stderr.strip().splitlines()[-1]


def test_every_target_applied_says_nothing_more(run, tmp_script):
    result = run(tmp_script(DDP_SCRIPT), "--to", "ddp", "--diff")
    assert "not applied" not in result.stderr


def test_ddp_sync_bn(run, tmp_script):
    path = tmp_script(DDP_SCRIPT)
    assert run(path, "--to", "ddp", "--sync-bn").exit_code == 0
    text = path.read_text()
    assert "model = wrap_model(model, sync_batchnorm=True)" in text
    assert "sampler=distributed_sampler(train_set)" in text
    assert "set_epoch(loader, epoch)" in text
    assert "    if is_main_process():\n        print(epoch, loss.item())" in text
