"""Jupyter notebooks: positions as `cell N:line:col`, golden rewrites, only the changed
sources touched in the JSON, IPython syntax kept byte for byte, refusals that leave the file
as it was, and the migrated notebook's code really running on this CPU.

Regenerate the goldens after an intended change with `GPUMIGRATE_UPDATE_GOLDENS=1 pytest`,
then read the diff before committing it.
"""

import difflib
import json
import os
import re
import shutil
import textwrap

import pytest
from click.testing import CliRunner

from gpumigrate.cli import main
from gpumigrate.rewriter.engine import Finding
from gpumigrate.rewriter.report import location
from tests.conftest import FIXTURES, run_script

NOTEBOOK = FIXTURES / "notebooks" / "mnist_notebook.ipynb"
TARGETS = ("device", "ddp")
# how nbformat (and Jupyter) writes a notebook: the fixture's layout
NBFORMAT = {"indent": 1, "sort_keys": True, "ensure_ascii": False}


def golden(target):
    return FIXTURES / "expected-notebooks" / target / NOTEBOOK.name


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def lint(*args):
    return cli("lint", *args)


def text(cell):
    src = cell["source"]
    return src if isinstance(src, str) else "".join(src)


def make(cells, metadata=None):
    """A notebook: a str is a code cell, ("markdown", text) a markdown cell."""
    out = []
    for n, cell in enumerate(cells):
        kind, source = cell if isinstance(cell, tuple) else ("code", cell)
        entry = {"cell_type": kind, "id": f"cell-{n}", "metadata": {}, "source": source}
        if kind == "code":
            entry.update(execution_count=n + 1, outputs=[])
        out.append(entry)
    return {"cells": out, "metadata": metadata or {"kernelspec": {"language": "python", "name": "python3"}},
            "nbformat": 4, "nbformat_minor": 5}


def write(path, nb, **layout):
    layout = {**NBFORMAT, **layout}
    newline = layout.pop("newline", "\n")
    trailer = layout.pop("trailer", "\n")
    data = (json.dumps(nb, **layout) + trailer).replace("\n", newline)
    path.write_bytes(data.encode("utf-8"))
    return path


def lines(source):
    parts = source.split("\n")
    return [p + "\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


@pytest.fixture
def notebook(tmp_path):
    path = tmp_path / NOTEBOOK.name
    shutil.copyfile(NOTEBOOK, path)
    return path


def position(path, cell, snippet):
    """(line, 1-based column) of `snippet` in a cell of the notebook, found independently."""
    source = text(json.loads(path.read_text())["cells"][cell - 1])
    for number, line in enumerate(source.split("\n"), 1):
        if snippet in line:
            return number, line.index(snippet) + 1
    raise AssertionError(f"{snippet!r} not in cell {cell}")


# -- positions --------------------------------------------------------------------------------

def test_lint_positions_name_the_cell(notebook):
    result = lint(notebook, "--select", "GM101,GM201,GM203")
    assert result.exit_code == 1
    out = result.stdout.splitlines()
    # Cells count from 1 over every cell (markdown too), as ruff and Jupyter's order do:
    # the model is built in the 6th cell of the notebook, the 5th code cell.
    assert position(notebook, 6, "cuda()") == (19, 15)
    assert f"{notebook}:cell 6:19:15: GM101 `.cuda()` hard-codes the device; use `.to(device)`" in out
    line, col = position(notebook, 8, "loss.data[0]))")
    assert f"{notebook}:cell 8:{line}:{col}: GM201 `.data[0]` on a 0-dim tensor raises since torch 0.4; use `.item()`" in out
    line, col = position(notebook, 8, "Variable(data.cuda(), volatile=True)")
    assert any(o.startswith(f"{notebook}:cell 8:{line}:{col}: GM203") for o in out)
    # every finding names a code cell; the %%writefile cell (13) holds `.cuda()` but is not Python run here
    cells = {int(re.match(rf"{re.escape(str(notebook))}:cell (\d+):", o).group(1)) for o in out}
    assert cells == {6, 8}
    assert "in 1 file" in result.stderr


def test_json_sarif_and_github_formats(notebook, tmp_path):
    rows = json.loads(lint(notebook, "--select", "GM101", "--format", "json").stdout)
    assert {(r["cell"], r["line"], r["column"]) for r in rows} >= {(6, 19, 15)}
    assert all(r["cell"] in (6, 8) for r in rows)
    script = tmp_path / "plain.py"
    script.write_text("import torch\nx = torch.ones(1).cuda()\n")
    plain = json.loads(lint(script, "--format", "json").stdout)
    assert plain and all("cell" not in r for r in plain)

    # SARIF and GitHub annotations point into the raw file: the JSON line holding the code.
    raw = notebook.read_text().split("\n")
    sarif = json.loads(lint(notebook, "--select", "GM101", "--format", "sarif").stdout)
    results = sarif["runs"][0]["results"]
    assert len(results) == len(rows)
    for res in results:
        region = res["locations"][0]["physicalLocation"]["region"]
        assert raw[region["startLine"] - 1][region["startColumn"] - 1:].startswith("cuda()")
        assert res["properties"]["cell"] in (6, 8)
    model = next(r for r in results if r["properties"] == {"cell": 6, "cellLine": 19, "cellColumn": 15})
    assert raw[model["locations"][0]["physicalLocation"]["region"]["startLine"] - 1].strip() == '"model = Net().cuda()\\n",'

    github = lint(notebook, "--select", "GM101", "--format", "github").stdout.splitlines()
    first = next(g for g in github if "cell 6%3A19%3A15" in g)
    line, col = (int(v) for v in re.search(r",line=(\d+),col=(\d+),", first).groups())
    assert raw[line - 1][col - 1:].startswith("cuda()")


def test_location_format():
    assert location("a.py", Finding("GM101", 3, 4, "m")) == "a.py:3:5"
    assert location("n.ipynb", Finding("GM101", 3, 4, "m", cell=7)) == "n.ipynb:cell 7:3:5"


def test_review_items_name_the_cell(notebook):
    result = cli(notebook, "--to", "ddp", "--check")
    assert result.exit_code == 1
    line, col = position(notebook, 5, "torch.utils.data.DataLoader(")
    assert f"{notebook}:cell 5:{line}:{col}: GM400 review by hand: the effective batch size is now WORLD_SIZE" \
        in result.stderr


def test_syntax_error_names_the_cell(tmp_path):
    path = write(tmp_path / "bad.ipynb", make(["import torch", "x = (1,\ny = 2"]))
    before = path.read_bytes()
    for args in ((path, "--to", "device"), ("lint", path)):
        result = cli(*args)
        assert result.exit_code == 2
        assert f"{path}:cell 2:1: cannot parse" in result.stderr
        assert "Traceback" not in result.output
    assert path.read_bytes() == before


# -- golden rewrites and the JSON they touch --------------------------------------------------

@pytest.mark.parametrize("target", TARGETS)
def test_golden(notebook, target):
    result = cli(notebook, "--to", target)
    assert result.exit_code == 0, result.output
    if os.environ.get("GPUMIGRATE_UPDATE_GOLDENS"):
        golden(target).parent.mkdir(parents=True, exist_ok=True)
        golden(target).write_bytes(notebook.read_bytes())
    assert notebook.read_bytes() == golden(target).read_bytes()
    assert f"rewrote {notebook}" in result.stderr


@pytest.mark.parametrize("target", TARGETS)
def test_json_diff_is_only_the_changed_sources(target):
    old_bytes, new_bytes = NOTEBOOK.read_bytes(), golden(target).read_bytes()
    old, new = json.loads(old_bytes), json.loads(new_bytes)
    assert {k: v for k, v in old.items() if k != "cells"} == {k: v for k, v in new.items() if k != "cells"}
    assert len(old["cells"]) == len(new["cells"])
    changed = [n for n, (a, b) in enumerate(zip(old["cells"], new["cells"])) if a != b]
    assert changed, "the fixture needs a rewrite"
    for n in changed:
        a, b = old["cells"][n], new["cells"][n]
        assert a["cell_type"] == "code"
        assert {k: v for k, v in a.items() if k != "source"} == {k: v for k, v in b.items() if k != "source"}
        assert isinstance(b["source"], list) and b["source"] == lines(text(b))
    # Textually: putting the old sources back gives the original bytes, and every line the
    # byte diff touches is a line of a source array (4 spaces deep in nbformat's layout).
    for n in changed:
        new["cells"][n]["source"] = old["cells"][n]["source"]
    assert (json.dumps(new, **NBFORMAT) + "\n").encode() == old_bytes
    old_lines, new_lines = old_bytes.decode().split("\n"), new_bytes.decode().split("\n")
    source_line = re.compile(r'^    "(?:[^"\\]|\\.)*",?$')
    spans = _source_spans(new_bytes.decode(), [n + 1 for n in changed])
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, old_lines, new_lines, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        assert all(source_line.match(line) for line in old_lines[i1:i2] + new_lines[j1:j2]), (old_lines[i1:i2], new_lines[j1:j2])
        assert any(lo <= j1 and j2 <= hi for lo, hi in spans), (j1, j2, spans)


def _source_spans(raw, cells):
    """0-based [first, last + 1) raw line ranges of the `source` arrays of these cells."""
    spans, number = [], 0
    rows = raw.split("\n")
    for i, row in enumerate(rows):
        if row == "  {":
            number += 1
        if number in cells and row == '   "source": [':
            end = rows.index("   ]", i)
            spans.append((i + 1, end + 1))
    return spans


def test_magics_kept_byte_for_byte():
    old = json.loads(NOTEBOOK.read_text())["cells"]
    for target in TARGETS:
        new = json.loads(golden(target).read_text())["cells"]
        for a, b in zip(old, new):
            magics = [line for line in a["source"] if line.lstrip().startswith(("%", "!")) or "= !" in line
                      or line.rstrip().endswith("?")]
            for line in magics:
                assert line in b["source"], (target, line)
            if text(a).startswith("%%"):
                assert b["source"][0] == a["source"][0]
            if text(a).startswith("%%writefile"):
                assert b == a  # not Python run in the notebook: not touched, although it holds `.cuda()`


IPYTHON = [
    "%matplotlib inline\n%load_ext autoreload\nimport torch\nfiles = !ls -1\n?torch.nn\ntorch.nn.Linear??",
    "%%time\nfor i in range(2):\n    !echo {i} \\\n        done\n    %time y = torch.ones(1).cuda()\n    x = torch.ones(1).cuda()",
    "%%bash\npython -c 'import torch; torch.ones(1).cuda()'",
    "doc = '''\n!not a shell escape\n%not a magic\n'''\nz = torch.zeros(2,\n    3).cuda()\nz?",
    "%%writefile helper.py\nimport torch\nt = torch.ones(1).cuda()",
]


def test_ipython_syntax_kept(tmp_path):
    path = write(tmp_path / "magic.ipynb", make([lines(c) for c in IPYTHON]))
    result = cli(path, "--to", "device")
    assert result.exit_code == 0, result.output
    cells = [text(c) for c in json.loads(path.read_text())["cells"]]
    assert cells[0].startswith("%matplotlib inline\n%load_ext autoreload\nimport torch\n")
    assert "files = !ls -1\n?torch.nn\ntorch.nn.Linear??" in cells[0]
    assert cells[1] == IPYTHON[1].replace("    x = torch.ones(1).cuda()", "    x = torch.ones(1).to(device)")
    assert cells[2] == IPYTHON[2] and cells[4] == IPYTHON[4]
    assert cells[3] == IPYTHON[3].replace("3).cuda()", "3).to(device)")
    # and the linter never looked into the skipped cells
    assert {f["cell"] for f in json.loads(lint(path, "--format", "json").stdout)} <= {2, 4}


@pytest.mark.parametrize("target", TARGETS)
def test_idempotent(tmp_path, target):
    path = tmp_path / NOTEBOOK.name
    shutil.copyfile(golden(target), path)
    result = cli(path, "--to", target)
    assert result.exit_code == 0
    assert "0 files changed" in result.stderr
    assert path.read_bytes() == golden(target).read_bytes()
    assert cli(path, "--to", target, "--check").exit_code == 0


def test_inserted_statements_go_to_a_sensible_cell(tmp_path):
    path = write(tmp_path / "train.ipynb", make([
        "%matplotlib inline\nimport torch\nmodel = torch.nn.Linear(2, 2).cuda()",
        ("markdown", "## Training"),
        "# the optimizer\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\nfor i in range(2):\n"
        "    loss = model(torch.randn(4, 2).cuda()).sum()\n    opt.zero_grad()\n    loss.backward()\n    opt.step()",
    ]))
    assert cli(path, "--to", "ddp").exit_code == 0
    first, _, training = (text(c) for c in json.loads(path.read_text())["cells"])
    # imports the rewrite adds: in the first code cell, after the user's (magics stay on top)
    assert first.startswith("%matplotlib inline\nimport torch\nfrom gpumigrate.runtime import ")
    assert "device = setup_distributed()" in first
    # a statement inserted before a cell's first statement stays with it
    assert training.startswith("# the optimizer\nmodel = wrap_model(model)\nopt = torch.optim.SGD(")


def test_noqa_in_a_cell(tmp_path):
    path = write(tmp_path / "noqa.ipynb", make([
        "import torch", "a = torch.ones(1).cuda()  # noqa\nb = torch.ones(1).cuda()  # noqa: GM101\nc = torch.ones(1).cuda()"]))
    rows = json.loads(lint(path, "--select", "GM101", "--format", "json").stdout)
    assert [(r["cell"], r["line"]) for r in rows] == [(2, 3)]
    assert cli(path, "--to", "device").exit_code == 0
    cell = text(json.loads(path.read_text())["cells"][1])
    assert cell == "a = torch.ones(1).cuda()  # noqa\nb = torch.ones(1).cuda()  # noqa: GM101\nc = torch.ones(1).to(device)"


def test_lint_fix_rewrites_a_notebook(notebook):
    result = lint(notebook, "--select", "GM201", "--fix")
    assert result.exit_code == 0, result.output
    cell = text(json.loads(notebook.read_text())["cells"][7])
    assert ".data[0]" not in cell and "loss.item()" in cell
    assert ".cuda()" in cell  # GM101 was not selected


# -- discovery, --diff, --check -------------------------------------------------------------

def test_directory_discovery_finds_notebooks(tmp_path, notebook):
    (tmp_path / "plain.py").write_text("import torch\nx = torch.ones(1).cuda()\n")
    checkpoints = tmp_path / ".ipynb_checkpoints"
    checkpoints.mkdir()
    shutil.copyfile(NOTEBOOK, checkpoints / "mnist_notebook-checkpoint.ipynb")
    result = lint(tmp_path, "--select", "GM101")
    paths = {line.split(":")[0] for line in result.stdout.splitlines()}
    assert paths == {str(tmp_path / "plain.py"), str(notebook)}
    assert "in 2 files" in result.stderr


def test_diff_shows_changed_cells(notebook):
    before = notebook.read_bytes()
    result = cli(notebook, "--to", "device", "--diff")
    assert result.exit_code == 0
    headers = [line for line in result.stdout.splitlines() if line.startswith(("---", "+++"))]
    assert headers == [f"{sign} {notebook}:cell {n}\t({label})" for n in (2, 6, 8)
                       for sign, label in (("---", "original"), ("+++", "migrated"))]
    assert "-model = Net().cuda()" in result.stdout.splitlines()
    assert "+model = Net().to(device)" in result.stdout.splitlines()
    assert '"source"' not in result.stdout and "No newline" not in result.stdout
    assert notebook.read_bytes() == before


def test_check_exit_code(notebook):
    before = notebook.read_bytes()
    result = cli(notebook, "--to", "device", "--check")
    assert result.exit_code == 1
    assert f"would rewrite {notebook}" in result.stderr
    assert notebook.read_bytes() == before


def test_report_names_cells_and_their_migrated_lines(tmp_path):
    nb = write(tmp_path / "t.ipynb", make([
        "import torch\n", ("markdown", "notes"),
        "from torch.autograd import Variable\nx = Variable(torch.ones(1).cuda())\ny = x.sum()\n"]))
    result = cli(nb, "--to", "device", "--report", tmp_path / "r.json")
    assert result.exit_code == 0, result.output
    migrated = text(json.loads(nb.read_text())["cells"][2]).split("\n")
    fixed = {g["code"]: g for g in json.loads((tmp_path / "r.json").read_text())["files"][0]["fixed"]}
    # the import went away, so the finding's line moved up by one, within cell 3
    assert {k: fixed["GM101"][k] for k in ("cells", "lines", "original_cells", "original_lines")} == {
        "cells": [3], "lines": [1], "original_cells": [3], "original_lines": [2]}
    assert migrated[0] == "x = torch.ones(1).to(device)"
    nb.write_bytes(write(tmp_path / "u.ipynb", make([
        "import torch\n", ("markdown", "notes"),
        "from torch.autograd import Variable\nx = Variable(torch.ones(1).cuda())\ny = x.sum()\n"])).read_bytes())
    cli(nb, "--to", "device", "--report", tmp_path / "r.md")
    assert ("- cell 3 line 1 (original cell 3 line 2): GM101 `.cuda()` → `.to(device)`"
            in (tmp_path / "r.md").read_text().splitlines())


# -- layouts: kept, or refused ----------------------------------------------------------------

LAYOUTS = {
    "indent2": {"indent": 2},
    "compact": {"indent": None},
    "compact-tight": {"indent": None, "separators": (",", ":")},
    "crlf": {"newline": "\r\n"},
    "ascii-escapes": {"ensure_ascii": True},
    "no-final-newline": {"trailer": ""},
    "unsorted-keys": {"sort_keys": False},
}
CELLS = ["# température\nimport torch\n", "x = torch.ones(1).cuda()\ny = 2", ("markdown", "keep me"), "z = 3"]


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
@pytest.mark.parametrize("form", ["lists", "strings"])
def test_layout_kept(tmp_path, layout, form):
    nb = make([(c if isinstance(c, tuple) else c if form == "strings" else lines(c)) for c in CELLS])
    nb = {"nbformat_minor": 5, **nb} if layout == "unsorted-keys" else nb
    path = write(tmp_path / "layout.ipynb", nb, **LAYOUTS[layout])
    before = path.read_bytes()
    assert cli(path, "--to", "device").exit_code == 0
    after = json.loads(path.read_bytes())
    expected = json.loads(before)
    expected["cells"][0]["source"] = _form("# température\nimport torch\nfrom gpumigrate.runtime import get_device\n\n"
                                           "device = get_device()\n", form)
    expected["cells"][1]["source"] = _form("x = torch.ones(1).to(device)\ny = 2", form)
    assert after == expected
    # written exactly as the file was laid out: same serialiser, same bytes
    assert path.read_bytes() == write(tmp_path / "again.ipynb", after, **LAYOUTS[layout]).read_bytes()


def _form(source, form):
    return source if form == "strings" else lines(source)


@pytest.mark.parametrize("tweak", [
    pytest.param(lambda raw: raw.replace('"lr": 0.001', '"lr": 1e-3'), id="number-format"),
    pytest.param(lambda raw: raw.replace('"nbformat": 4', '"nbformat" : 4'), id="spacing"),
    pytest.param(lambda raw: raw.replace('"keep me"', '"keep m\\u0065"'), id="escape"),
    pytest.param(lambda raw: raw.replace("\n", "\r\n", 3), id="mixed-line-endings"),
])
def test_unreproducible_layout_refused(tmp_path, tweak):
    nb = make(CELLS, metadata={"kernelspec": {"language": "python", "name": "python3"}, "lr": 0.001})
    path = tmp_path / "odd.ipynb"
    raw = tweak(json.dumps(nb, **NBFORMAT) + "\n")
    assert raw != json.dumps(nb, **NBFORMAT) + "\n"
    path.write_bytes(raw.encode())
    before = path.read_bytes()
    result = cli(path, "--to", "device")
    assert result.exit_code == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1
    assert errors[0].startswith(f"error: {path}: cannot rewrite: writing it back would change its ")
    assert errors[0].endswith("; notebook left unchanged (--reformat-notebooks writes its JSON as nbformat does)")
    assert "Traceback" not in result.output
    assert path.read_bytes() == before
    # lint still reads it
    result = lint(path, "--select", "GM101")
    assert result.exit_code == 1 and f"{path}:cell 2:1:19: GM101" in result.stdout


def _odd(tmp_path, cells=CELLS):
    """A notebook nbformat would write with `"text": []` where the file has `[ ]` (an empty
    stream output, as some tools write it)."""
    nb = make(cells)
    nb["cells"][1]["outputs"] = [{"name": "stdout", "output_type": "stream", "text": []}]
    raw = (json.dumps(nb, **NBFORMAT) + "\n").replace('"text": []', '"text": [ ]')
    path = tmp_path / "odd.ipynb"
    path.write_bytes(raw.encode())
    return path, nb


def test_reformat_notebooks_writes_the_json_as_nbformat_does(tmp_path):
    path, nb = _odd(tmp_path)
    before = path.read_bytes()
    result = cli(path, "--to", "device", "--reformat-notebooks")
    assert result.exit_code == 0, result.output
    after = path.read_bytes()
    data = json.loads(after)
    assert after == (json.dumps(data, **NBFORMAT) + "\n").encode()  # nbformat's layout, exactly
    assert data["cells"][1]["source"] == "x = torch.ones(1).to(device)\ny = 2"
    assert data["cells"][1]["outputs"] == nb["cells"][1]["outputs"]  # outputs untouched
    assert data["cells"][2] == nb["cells"][2]
    assert "note: " + str(path) + ': JSON written as nbformat writes it (--reformat-notebooks): 1 line of layout ' \
        'changed (line 20: "text": [ ] -> "text": [])' in result.stderr
    # only that line and the migrated sources differ
    changed = [line for line in difflib.ndiff(before.decode().splitlines(), after.decode().splitlines())
               if line.startswith("- ")]
    assert '-      "text": [ ]' in changed and all('"text"' in c or "cuda" in c or "import torch" in c
                                                     for c in changed), changed
    again = cli(path, "--to", "device", "--reformat-notebooks")
    assert again.exit_code == 0 and "note:" not in again.stderr and path.read_bytes() == after


def test_reformat_notebooks_diff_shows_the_json_changes_first(tmp_path):
    path, _ = _odd(tmp_path)
    before = path.read_bytes()
    result = cli(path, "--to", "device", "--reformat-notebooks", "--diff")
    assert result.exit_code == 0 and path.read_bytes() == before
    diff = result.stdout
    assert diff.startswith(f"--- {path}\t(original JSON)\n+++ {path}\t(as nbformat writes it)\n")
    assert '-     "text": [ ]\n+     "text": []\n' in diff
    assert f"--- {path}:cell 2\t(original)" in diff and "+x = torch.ones(1).to(device)" in diff
    assert diff.index("(as nbformat writes it)") < diff.index(":cell 2\t(original)")


def test_reformat_notebooks_with_lint_fix(tmp_path):
    path, _ = _odd(tmp_path)
    assert lint(path, "--fix", "--select", "GM101").exit_code == 2  # refused: names the flag
    result = lint(path, "--fix", "--select", "GM101", "--reformat-notebooks")
    assert result.exit_code == 0, result.output
    assert "JSON written as nbformat writes it" in result.stderr
    assert "to(device)" in text(json.loads(path.read_bytes())["cells"][1])


def test_reformat_notebooks_leaves_a_notebook_with_nothing_to_migrate(tmp_path):
    path, _ = _odd(tmp_path, ["import torch\n", "y = 2"])
    before = path.read_bytes()
    result = cli(path, "--to", "device", "--reformat-notebooks")
    assert result.exit_code == 0 and path.read_bytes() == before and "note:" not in result.stderr


BAD = {
    "invalid-json": (b'{"cells": [}', "not a notebook: invalid JSON at line 1 column 12"),
    "nbformat-3": (b'{"nbformat": 3, "nbformat_minor": 0, "worksheets": []}', "unsupported notebook format 3"),
    "no-cells": (b'{"nbformat": 4, "nbformat_minor": 5, "metadata": {}}', "not a notebook: no list of cells"),
    "not-an-object": (b"[1, 2]", "not a notebook: the JSON is not an object"),
    "bad-source": (b'{"nbformat": 4, "cells": [{"cell_type": "code", "source": 3}]}', "cell 1: the cell's source"),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
@pytest.mark.parametrize("command", ["migrate", "lint"])
def test_bad_notebook(tmp_path, case, command):
    raw, message = BAD[case]
    path = tmp_path / "bad.ipynb"
    path.write_bytes(raw)
    result = cli(path, "--to", "device") if command == "migrate" else lint(path)
    assert result.exit_code == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {path}") and message in errors[0]
    assert "Traceback" not in result.output
    assert path.read_bytes() == raw


def test_empty_and_non_python_notebooks_are_left_alone(tmp_path):
    empty = write(tmp_path / "empty.ipynb", make([]))
    r_kernel = write(tmp_path / "r.ipynb", make(["x <- torch$cuda()"], metadata={"kernelspec": {"language": "R"}}))
    before = {p: p.read_bytes() for p in (empty, r_kernel)}
    result = cli(tmp_path, "--to", "device")
    assert result.exit_code == 0, result.output
    assert all(p.read_bytes() == b for p, b in before.items())


# -- the migrated notebook runs ---------------------------------------------------------------

MATPLOTLIB_STUB = {
    "matplotlib/__init__.py": "",
    "matplotlib/pyplot.py": "def plot(*a, **k): pass\ndef xlabel(*a, **k): pass\ndef ylabel(*a, **k): pass\n",
}


def notebook_as_script(path):
    """The code cells as IPython would run them, minus what needs IPython: cell magics other
    than %%time skip their cell, line magics and shell escapes are dropped."""
    out = []
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] != "code":
            continue
        source = text(cell)
        if source.startswith("%%") and not source.startswith("%%time"):
            continue
        for line in source.split("\n"):
            stripped = line.strip()
            if stripped.startswith(("%", "!", "?")) or stripped.endswith("?"):
                continue
            out.append(re.sub(r"^(\s*\w+) = !.*", r"\1 = []", line))  # `x = !cmd`: a list of output lines
        out.append("")
    return "\n".join(out)


@pytest.mark.e2e
@pytest.mark.parametrize("target", TARGETS)
def test_migrated_notebook_runs_on_cpu(tmp_path, target):
    for name, content in MATPLOTLIB_STUB.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(content)
    script = tmp_path / "notebook.py"
    script.write_text(notebook_as_script(golden(target)))
    run = run_script(script, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout.count("Test set: Average loss") == 2
    assert (tmp_path / "mnist_cnn.pt").exists()
    if target == "device":
        # the original needs CUDA: on this machine it stops at the first `.cuda()`
        import torch
        if not torch.cuda.is_available():
            script.write_text(notebook_as_script(NOTEBOOK))
            run = run_script(script, cwd=tmp_path)
            assert run.returncode != 0 and "CUDA" in run.stderr
