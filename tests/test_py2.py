"""`--py2`: a Python 2 training script converted by fissix before the migration, reported in
its own section; without the flag, the refusal names it."""

import json
import textwrap

import pytest
from click.testing import CliRunner

from gpumigrate.cli import main
from gpumigrate.rewriter import py2

pytest.importorskip("fissix")

TRAIN = textwrap.dedent("""\
    # Copyright 2017 Somebody. MIT License.
    import torch
    from torch.autograd import Variable


    def train(model, batches, epochs):
        for epoch in xrange(epochs):
            total = 0
            for name, batch in batches.iteritems():
                try:
                    x = Variable(batch).cuda()
                    loss = model(x).sum()
                except RuntimeError, e:
                    print "skipped", name, e
                    continue
                total += loss.item()
            half = epochs / 2
            print "epoch %d loss %f" % (epoch, total / len(batches))
    """)


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_without_the_flag_the_refusal_names_it(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(TRAIN)
    result = cli(path, "--to", "device")
    assert result.exit_code == 2
    assert f"{path}:13: cannot parse: Python 2 syntax" in result.stderr and "--py2" in result.stderr
    assert path.read_text() == TRAIN


def test_converted_then_migrated(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(TRAIN)
    report = tmp_path / "report.md"
    result = cli(path, "--to", "device", "--py2", "--report", report)
    assert result.exit_code == 0, result.output
    out = path.read_text()
    compile(out, str(path), "exec")
    assert "for epoch in range(epochs):" in out
    assert "batches.items()" in out
    assert "except RuntimeError as e:" in out
    assert 'print("skipped", name, e)' in out
    assert "half = epochs / 2" in out  # no fixer for `/`: named in the report instead
    assert "x = batch.to(device)" in out  # the migration ran on the converted script
    assert out.startswith("# Copyright 2017 Somebody. MIT License.\n")
    note = "converted from Python 2 (--py2): 4 fixers: dict, except, print, xrange"
    assert f"note: {path}: {note}; `/` left as it is" in result.stderr
    assert "check original lines 17, 18" in result.stderr
    text = report.read_text()
    section = text.split("### Converted before the migration\n\n", 1)[1].split("\n\n", 1)[0]
    assert section.startswith(f"- {note}")
    # findings are placed on the original's lines: the `.cuda()` on line 11
    assert "original 11" in text
    again = cli(path, "--to", "device", "--py2")  # now Python 3: nothing to convert, nothing to do
    assert again.exit_code == 0 and "converted" not in again.stderr and path.read_text() == out


def test_json_report_lists_the_conversion(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(TRAIN)
    report = tmp_path / "report.json"
    assert cli(path, "--to", "device", "--py2", "--diff", "--report", report).exit_code == 0
    (entry,) = json.loads(report.read_text())["files"]
    assert entry["converted"][0].startswith("converted from Python 2 (--py2): 4 fixers:")
    assert path.read_text() == TRAIN  # --diff writes nothing


def test_a_python_3_file_is_never_converted():
    source = b"d = {}\nfor k in d.keys():\n    print(k)\n"
    assert py2.converted(source, "x.py") is None  # 2to3 would write list(d.keys())


def test_nothing_to_migrate_leaves_the_python_2_file_as_it_is(tmp_path):
    path = tmp_path / "plain.py"
    path.write_text("print 'hello'\n")
    result = cli(path, "--to", "device", "--py2")
    assert result.exit_code == 0 and path.read_text() == "print 'hello'\n"


def test_implicit_relative_imports_stay(tmp_path):
    # 2to3's `import` fixer would write `from . import models`: a script has no package
    (tmp_path / "models.py").write_text("NET = 1\n")
    source = b"import models\nprint models.NET\n"
    out, note = py2.converted(source, str(tmp_path / "train.py"))
    assert out == b"import models\nprint(models.NET)\n"
    assert note == "converted from Python 2 (--py2): 1 fixer: print"


def test_async_repairs_are_not_python_2():
    # `.cuda(async=True)` is the engine's repair (GM103), not a conversion: no error, no note
    assert py2.converted(b"import torch\nx = torch.ones(1).cuda(async=True)\n", "x.py") is None


def test_a_file_the_conversion_cannot_fix_is_one_line_error(tmp_path):
    # Python 2 took a tab for 8 spaces; Python 3 refuses the mix, and no fixer changes indentation
    source = 'print "start"\nif 1:\n\tx = 1\n        y = 2\n'
    path = tmp_path / "old.py"
    path.write_text(source)
    result = cli(path, "--to", "device", "--py2")
    assert result.exit_code == 2
    assert f"error: {path}:4: --py2: the converted file does not compile either (inconsistent use of tabs" \
        in result.stderr
    assert "Traceback" not in result.output and path.read_text() == source


def test_lint_reads_the_converted_script_at_the_original_lines(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(TRAIN)
    result = cli("lint", path, "--select", "GM101", "--py2")
    assert result.exit_code == 1
    assert f"{path}:11:" in result.stdout and "GM101" in result.stdout


def test_missing_fissix_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(py2, "available", lambda: False)
    path = tmp_path / "train.py"
    path.write_text(TRAIN)
    result = cli(path, "--to", "device", "--py2")
    assert result.exit_code == 2
    assert "--py2 needs the fissix package: pip install 'gpumigrate[py2]'" in result.stderr
    assert "Traceback" not in result.output
