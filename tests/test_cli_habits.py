"""What users of ruff and black expect of a command line: no accidental rewrites, stdin and
stdout, .gitignore and exclusions, selection and noqa in migrations too, honest messages and
exit codes, colours, file modes, a report a human can act on, and docs that cannot drift."""

import json
import os
import re
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpumigrate.cli import main, rules_markdown
from tests.conftest import ROOT

CUDA = "import torch\nmodel = torch.nn.Linear(2, 2).cuda()\n"
MIGRATED = "model = torch.nn.Linear(2, 2).to(device)"
LOSS = "import torch.nn.functional as F\nloss = F.nll_loss(out, y)\nprint(loss.data[0])\n"  # GM201
ANSI = re.compile(r"\x1b\[")


def cli(*args, input=None, env=None, color=False):
    return CliRunner().invoke(main, [str(a) for a in args], input=input, env=env, color=color,
                              catch_exceptions=False)


def tree(root: Path, files: dict) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def snapshot(root: Path) -> dict:
    return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------- never rewrite by accident

def test_a_mistyped_command_stops_before_anything_is_written(tmp_path, monkeypatch):
    tree(tmp_path, {"typo/a.py": CUDA, "typo/b.py": CUDA})
    monkeypatch.chdir(tmp_path)
    before = snapshot(tmp_path)
    result = cli("lnit", "typo/")
    assert result.exit_code == 2
    assert "lnit: no such command, file or directory (did you mean `gpumigrate lint`?)" in result.output
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("command", [[], ["--to", "ddp"], ["lint", "--fix"]])
def test_a_missing_path_stops_before_anything_is_written(tmp_path, command):
    tree(tmp_path, {"src/a.py": CUDA})
    before = snapshot(tmp_path)
    args = ([command[0]] if command[:1] == ["lint"] else []) + [tmp_path / "src", tmp_path / "missing.py"] + \
        [a for a in command if a != "lint"]
    result = cli(*args)
    assert result.exit_code == 2
    assert "missing.py: no such file or directory" in result.output
    assert snapshot(tmp_path) == before


# ---------------------------------------------------------------- stdin and stdout

def test_migrate_reads_stdin_and_writes_stdout(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = cli("-", "--stdin-filename", "train.py", input=CUDA)
    assert result.exit_code == 0
    assert MIGRATED in result.stdout and "import torch" in result.stdout
    assert "1 file changed, 1 edit" in result.stderr
    assert list(tmp_path.iterdir()) == []  # no file named "-" or anything else


def test_migrate_stdin_review_items_name_the_stdin_filename():
    result = cli("-", "--stdin-filename", "src/train.py", input="import torch\nx.to(device)\n")
    assert result.stdout == "import torch\nx.to(device)\n"  # unchanged input passes through
    assert result.stderr.startswith("src/train.py:2:1: GM104 review by hand")


def test_output_dash_writes_stdout_and_leaves_the_source(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tree(tmp_path, {"train.py": CUDA}) / "train.py"
    result = cli(path, "-o", "-")
    assert result.exit_code == 0 and MIGRATED in result.stdout
    assert path.read_text() == CUDA and not (tmp_path / "-").exists()


def test_lint_reads_stdin():
    result = cli("lint", "-", "--stdin-filename", "t.py", input=CUDA)
    assert result.exit_code == 1
    assert result.stdout.startswith("t.py:2:31: GM101")


def test_lint_fix_on_stdin_prints_the_fixed_source():
    result = cli("lint", "--fix", "-", input="import torch\nmodel = torch.nn.Linear(2, 2).cuda()\nx.to(d)\n")
    assert MIGRATED in result.stdout and "GM104" not in result.stdout
    assert "GM104" in result.stderr and result.exit_code == 1


def test_stdin_config_is_found_from_the_stdin_filename(tmp_path):
    tree(tmp_path, {"proj/pyproject.toml": '[tool.gpumigrate]\nignore = ["GM101"]\n'})
    result = cli("lint", "-", "--stdin-filename", tmp_path / "proj" / "t.py", input=CUDA)
    assert result.exit_code == 0 and result.stdout == ""


# ---------------------------------------------------------------- directories

def git_init(path: Path) -> None:
    subprocess.run(["git", "init", "-q", str(path)], check=True)


def linted(result) -> set:
    return {Path(line.split(":")[0]).as_posix() for line in result.stdout.splitlines()}


def test_gitignore_is_respected_inside_a_work_tree(tmp_path, monkeypatch):
    git_init(tmp_path)
    tree(tmp_path, {
        ".gitignore": "generated/\n*_tmp.py\n",
        "src/.gitignore": "scratch.py\n!keep_tmp.py\n",
        "src/train.py": CUDA, "src/scratch.py": CUDA, "src/a_tmp.py": CUDA, "src/keep_tmp.py": CUDA,
        "generated/x.py": CUDA, "other/scratch.py": CUDA,
    })
    monkeypatch.chdir(tmp_path)
    assert linted(cli("lint", ".")) == {"src/train.py", "src/keep_tmp.py", "other/scratch.py"}
    # a .gitignore applies only below its own folder; from a subfolder the ones above count
    monkeypatch.chdir(tmp_path / "src")
    assert linted(cli("lint", ".")) == {"train.py", "keep_tmp.py"}


def test_gitignore_outside_a_work_tree_is_not_read(tmp_path, monkeypatch):
    tree(tmp_path, {".gitignore": "*.py\n", "train.py": CUDA})
    monkeypatch.chdir(tmp_path)
    assert linted(cli("lint", ".")) == {"train.py"}


def test_config_exclude_is_relative_to_the_config_folder(tmp_path, monkeypatch):
    tree(tmp_path, {
        "pyproject.toml": '[tool.gpumigrate]\nexclude = ["src/legacy/"]\nextend-exclude = ["*_old.py"]\n',
        "src/train.py": CUDA, "src/legacy/old.py": CUDA, "src/net_old.py": CUDA, "legacy/kept.py": CUDA,
    })
    monkeypatch.chdir(tmp_path / "src")
    assert linted(cli("lint", ".")) == {"train.py"}
    monkeypatch.chdir(tmp_path)
    assert linted(cli("lint", ".")) == {"src/train.py", "legacy/kept.py"}
    before = (tmp_path / "src" / "legacy" / "old.py").read_text()
    cli(tmp_path)
    assert (tmp_path / "src" / "legacy" / "old.py").read_text() == before
    assert MIGRATED in (tmp_path / "src" / "train.py").read_text()


def test_virtualenvs_are_found_by_their_marker_not_their_name(tmp_path, monkeypatch):
    tree(tmp_path, {
        "env/train.py": CUDA, "build/train.py": CUDA,  # a project's own folders
        "myvenv/pyvenv.cfg": "home = /usr\n", "myvenv/lib/x.py": CUDA,
        "conda/conda-meta/history": "", "conda/lib/x.py": CUDA,
    })
    monkeypatch.chdir(tmp_path)
    assert linted(cli("lint", ".")) == {"env/train.py", "build/train.py"}


def test_an_empty_selection_says_so(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "notes.txt").write_text("x")
    result = cli("lint", tmp_path / "docs")
    assert result.exit_code == 0 and "warning: no Python files or notebooks in" in result.stderr
    result = cli(tmp_path / "docs", "--to", "device")
    assert result.exit_code == 0 and "warning: no Python files or notebooks in" in result.stderr
    path = tree(tmp_path, {"t.py": CUDA}) / "t.py"
    result = cli("lint", path, "--select", "GM1", "--ignore", "GM1")
    assert "warning: no rules selected" in result.stderr and result.exit_code == 0


# ---------------------------------------------------------------- selection in migrations

def test_migrate_honours_the_configured_ignore(tmp_path):
    tree(tmp_path, {"pyproject.toml": '[tool.gpumigrate]\nignore = ["GM101"]\n',
                    "t.py": CUDA + LOSS})
    result = cli(tmp_path / "t.py", "--to", "device")
    text = (tmp_path / "t.py").read_text()
    assert ".cuda()" in text and "loss.item()" in text
    assert "note: --to device without GM101 (not selected): the migration is partial" in result.stderr


def test_migrate_takes_select_and_ignore_flags(tmp_path):
    path = tree(tmp_path, {"t.py": CUDA + LOSS}) / "t.py"
    result = cli(path, "--select", "GM2", "--diff")
    assert "loss.item()" in result.stdout and ".to(device)" not in result.stdout
    result = cli(path, "--ignore", "GM2", "--diff")
    assert "loss.item()" not in result.stdout and ".to(device)" in result.stdout


def test_migrate_honours_per_file_ignores(tmp_path):
    tree(tmp_path, {"pyproject.toml": '[tool.gpumigrate.per-file-ignores]\n"legacy_*.py" = ["GM1"]\n',
                    "legacy_a.py": CUDA, "b.py": CUDA})
    cli(tmp_path)
    assert (tmp_path / "legacy_a.py").read_text() == CUDA
    assert MIGRATED in (tmp_path / "b.py").read_text()


def test_parse_repairs_run_whatever_is_selected(tmp_path):
    source = "import torch\nx = y.cuda(async=True)\nfrom torch.utils.data import DataLoader\ntest_loader = DataLoader(ds)\n"
    path = tree(tmp_path, {"t.py": source}) / "t.py"
    result = cli("lint", path, "--select", "GM601")  # GM205 holds the repair of `async=`
    assert result.exit_code == 0 and "cannot parse" not in result.output and "GM205" not in result.stdout
    result = cli(path, "--select", "GM601", "--check")
    assert result.exit_code == 0 and "error" not in result.output  # nothing selected changes it


# ---------------------------------------------------------------- noqa

MULTILINE = """\
import torch
model = torch.nn.Sequential(  # noqa: GM101
    torch.nn.Linear(2, 2),
).cuda()
other = torch.nn.Sequential(
    torch.nn.Linear(2, 2),  # noqa: GM101
).cuda()
third = torch.nn.Sequential(
    torch.nn.Linear(2, 2),
).cuda()
"""


def test_noqa_on_any_line_of_a_multiline_expression_for_lint_and_fix(tmp_path):
    path = tree(tmp_path, {"t.py": MULTILINE}) / "t.py"
    assert [line.split(":")[1] for line in cli("lint", path).stdout.splitlines()] == ["10"]
    cli(path, "--to", "device")
    assert path.read_text().count(".cuda()") == 2 and path.read_text().endswith(").to(device)\n")


def test_noqa_on_a_block_covers_its_header_only(tmp_path):
    source = "import torch\nwith torch.no_grad():  # noqa\n    x = torch.ones(1).cuda()\n"
    path = tree(tmp_path, {"t.py": source}) / "t.py"
    assert "GM101" in cli("lint", path).stdout


def test_noqa_prefixes(tmp_path):
    source = CUDA.replace(".cuda()", ".cuda()  # noqa: GM1") + "b = torch.ones(1).cuda()  # noqa: GM3\n"
    path = tree(tmp_path, {"t.py": source}) / "t.py"
    assert [line.split(":")[1] for line in cli("lint", path).stdout.splitlines()] == ["3"]


@pytest.mark.parametrize("marker, left", [("# gpumigrate: noqa", []), ("# gpumigrate: noqa: GM101", ["GM201"])])
def test_file_level_noqa(tmp_path, marker, left):
    source = f"{marker}\n{CUDA}{LOSS}"
    path = tree(tmp_path, {"t.py": source}) / "t.py"
    codes = [line.split()[1] for line in cli("lint", path).stdout.splitlines()]
    assert codes == left
    cli(path, "--to", "device")
    assert (".cuda()" in path.read_text()) and (("loss.item()" in path.read_text()) == bool(left))


def test_a_noqa_inside_a_string_is_not_a_file_marker(tmp_path):
    source = CUDA + 'doc = """\n# gpumigrate: noqa\n"""\n'
    path = tree(tmp_path, {"t.py": source}) / "t.py"
    assert cli("lint", path).stdout.split()[1] == "GM101"


# ---------------------------------------------------------------- output hygiene

def test_a_file_that_fails_to_parse_is_an_error_not_no_findings(tmp_path):
    path = tree(tmp_path, {"bad.py": "def f(:\n", "ok.py": "x = 1\n"})
    result = cli("lint", path)
    assert result.exit_code == 2
    assert "no findings in 1 file, 1 error (not checked)" in result.stderr


def test_lint_diff_needs_fix(tmp_path):
    path = tree(tmp_path, {"t.py": CUDA}) / "t.py"
    result = CliRunner().invoke(main, ["lint", str(path), "--diff"])
    assert result.exit_code == 2 and "use it with --fix" in result.output


@pytest.mark.parametrize("fmt", ["json", "sarif", "github"])
def test_machine_formats_are_never_mixed_with_a_diff(tmp_path, fmt):
    path = tree(tmp_path, {"t.py": CUDA}) / "t.py"
    result = CliRunner().invoke(main, ["lint", str(path), "--fix", "--diff", "--format", fmt])
    assert result.exit_code == 2 and "cannot be combined" in result.output
    assert path.read_text() == CUDA
    json.loads(cli("lint", path, "--format", "json").stdout) if fmt == "json" else None


def test_colour_follows_the_flag_and_no_color(tmp_path):
    path = tree(tmp_path, {"t.py": CUDA}) / "t.py"
    assert ANSI.search(cli(path, "--diff", color=True).stdout)  # a terminal that takes colour
    assert not ANSI.search(cli(path, "--diff", color=True, env={"NO_COLOR": "1"}).stdout)
    assert ANSI.search(cli(path, "--diff", "--color", "always", env={"NO_COLOR": "1"}).stdout)
    assert not ANSI.search(cli(path, "--diff", "--color", "never", color=True).stdout)


def test_messages_count_edits_and_name_the_file_written(tmp_path):
    path = tree(tmp_path, {"t.py": CUDA}) / "t.py"
    out = tmp_path / "out.py"
    result = cli(path, "-o", out)
    assert f"wrote {out} (1 edit)" in result.stderr and "rewrote" not in result.stderr
    result = cli(path)
    assert f"rewrote {path} (1 edit)" in result.stderr


def test_check_says_would_rewrite(tmp_path):
    path = tree(tmp_path, {"t.py": CUDA}) / "t.py"
    result = cli(path, "--check")
    assert result.exit_code == 1 and f"would rewrite {path} (1 edit)" in result.stderr


@pytest.mark.parametrize("mode", [0o644, 0o755, 0o600])
def test_output_file_gets_the_source_mode_less_the_umask(tmp_path, mode):
    path = tree(tmp_path, {"t.py": CUDA}) / "t.py"
    path.chmod(mode)
    out = tmp_path / "new.py"
    umask = os.umask(0o022)
    try:
        cli(path, "-o", out)
    finally:
        os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == mode & ~0o022


def test_summary_counts_a_failed_write_once(tmp_path):
    paths = tree(tmp_path, {"a.py": CUDA, "b.py": CUDA})
    (paths / "a.py").chmod(0o444)
    result = cli(tmp_path)
    assert result.exit_code == 2
    summary = [line for line in result.stderr.splitlines() if "file changed" in line]
    assert summary == ["1 file changed, 1 edit, 0 to review by hand, 1 error"] or (
        len(summary) == 1 and summary[0].startswith("1 file changed, 1 edit") and "-1" not in summary[0]), summary


def test_help_is_accurate_and_loads_no_libcst():
    help_text = cli("--help").output
    for command in ("lint", "rules", "explain", "verify"):
        assert command in help_text
    # the targets `--to` takes are listed, each on its own line
    from gpumigrate.targets import TARGETS

    listed = {line.split()[0] for line in help_text.splitlines() if line.strip()}
    assert set(TARGETS) <= listed, help_text
    code = ("import sys; from gpumigrate.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('libcst', 'torch')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip().endswith("[]"), out.stdout[-300:]


# ---------------------------------------------------------------- the report

REPORT_SCRIPT = textwrap.dedent("""\
    import torch
    from torch.autograd import Variable
    model = torch.nn.Linear(2, 2)
    if torch.cuda.is_available():
        model = model.cuda()
    a = torch.ones(2).cuda()
    b = torch.ones(2).cuda()
    c = torch.ones(2).cuda()
    x = Variable(a)
    a.to(b)
    a.to(c)
    """)


def test_report_counts_groups_and_points_into_the_migrated_file(tmp_path):
    path = tree(tmp_path, {"t.py": REPORT_SCRIPT}) / "t.py"
    report = tmp_path / "r.md"
    result = cli(path, "--report", report)
    assert result.exit_code == 0
    text = report.read_text()
    migrated = path.read_text().splitlines()
    assert "1 file: 1 changed (" in text and "2 items to review by hand, 0 errors." in text
    assert text.index("### Review by hand") < text.index("### Changed")
    (gm101,) = [line for line in text.splitlines() if "GM101" in line]
    lines = [int(n) for n in re.match(r"- lines ([\d, ]+) \(original ([\d, ]+)\)", gm101).group(1).split(", ")]
    assert all(".to(device)" in migrated[n - 1] for n in lines) and len(lines) == 4
    (gm104,) = [line for line in text.splitlines() if "GM104" in line]
    review_lines = [int(n) for n in re.match(r"- lines ([\d, ]+) \(original", gm104).group(1).split(", ")]
    assert [migrated[n - 1] for n in review_lines] == ["a.to(b)", "a.to(c)"]


def test_report_json_has_the_counts(tmp_path):
    path = tree(tmp_path, {"t.py": REPORT_SCRIPT}) / "t.py"
    cli(path, "--report", tmp_path / "r.json", "--diff")
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["written"] is False and data["summary"]["review"] == 2
    (entry,) = data["files"]
    (gm104,) = [g for g in entry["review"] if g["code"] == "GM104"]
    assert gm104["original_lines"] == [10, 11]


def test_an_unwritable_report_stops_before_anything_is_written(tmp_path):
    path = tree(tmp_path, {"t.py": CUDA}) / "t.py"
    result = CliRunner().invoke(main, [str(path), "--report", str(tmp_path / "no" / "such" / "r.md")])
    assert result.exit_code == 2 and "cannot write there" in result.output
    assert path.read_text() == CUDA


def test_a_report_onto_an_input_is_refused(tmp_path):
    path = tree(tmp_path, {"t.py": CUDA}) / "t.py"
    result = CliRunner().invoke(main, [str(path), "--check", "--report", str(path)])
    assert result.exit_code == 2 and "one of the inputs" in result.output
    assert path.read_text() == CUDA


# ---------------------------------------------------------------- docs

def test_the_readme_rule_table_is_generated_from_the_rules():
    readme = (ROOT / "README.md").read_text()
    table = readme.split("<!-- rules:begin -->\n")[1].split("<!-- rules:end -->")[0]
    assert table == rules_markdown() == cli("rules", "--format", "markdown").stdout, \
        "README rule table is stale: paste `gpumigrate rules --format markdown` between the markers"
    listed = [line.split()[0] for line in cli("rules").stdout.splitlines()[1:]]
    assert [row.split("|")[1].strip() for row in table.splitlines()[2:]] == listed


def test_there_is_a_changelog_naming_this_version():
    from gpumigrate import __version__
    assert f"## {__version__}" in (ROOT / "CHANGELOG.md").read_text()


def test_stdin_filename_names_only_stdin(tmp_path):
    # per-file-ignores for the name given to stdin must not apply to files read by path
    (tmp_path / "pyproject.toml").write_text('[tool.gpumigrate.per-file-ignores]\n"legacy.py" = ["GM101"]\n')
    script = tmp_path / "train.py"
    script.write_text(CUDA)
    result = cli("lint", script, "--stdin-filename", tmp_path / "legacy.py")
    assert result.exit_code == 1 and "GM101" in result.stdout


def test_usage_errors_name_the_command_the_user_typed(tmp_path):
    path = tree(tmp_path, {"t.py": CUDA}) / "t.py"
    implicit = cli(path, "--bogus")  # `gpumigrate t.py`: the user never typed `migrate`
    assert implicit.exit_code == 2
    assert "Usage: gpumigrate [OPTIONS] PATHS..." in implicit.output and "gpumigrate migrate" not in implicit.output
    explicit = cli("migrate", path, "--bogus")
    assert "Usage: gpumigrate migrate [OPTIONS] PATHS..." in explicit.output
    assert "Usage: gpumigrate lint [OPTIONS] PATHS..." in cli("lint", path, "--bogus").output
    assert "gpumigrate migrate" not in cli(path, "--to", "tpu").output
    assert path.read_text() == CUDA
