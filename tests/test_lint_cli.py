"""`gpumigrate lint`: output, selection, suppression, fixes, formats and configuration."""

import json
import textwrap

import jsonschema
import pytest
from click.testing import CliRunner

from gpumigrate.cli import main

SOURCE = textwrap.dedent("""\
    import torch
    import torch.nn.functional as F

    def train(model, loader, optimizer):
        total_loss = 0
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            total_loss += loss
        return total_loss

    model = torch.nn.Linear(2, 2).cuda()
    """)


def lint(*args, cwd=None):
    return CliRunner().invoke(main, ["lint", *map(str, args)], catch_exceptions=False)


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(SOURCE)
    return path


def test_text_output_and_exit_code(script):
    result = lint(script)
    assert result.exit_code == 1
    assert result.stdout.splitlines() == [
        f"{script}:10:9: GM301 accumulating a graph tensor keeps every step's graph alive; use `.item()`",
        f"{script}:13:31: GM101 `.cuda()` hard-codes the device; use `.to(device)`",
    ]
    assert "2 findings (2 fixable with --fix) in 1 file" in result.stderr


def test_summary_counts_files_with_findings_among_those_checked(script, tmp_path):
    (tmp_path / "ok.py").write_text("import torch\n")
    result = lint(script, tmp_path / "ok.py")
    assert result.stderr.splitlines()[-1] == "2 findings (2 fixable with --fix) in 1 of 2 files"


def test_positions_are_exact(script):
    lines = lint(script).stdout.splitlines()
    assert lines[0].startswith(f"{script}:10:9: GM301")
    assert lines[1].startswith(f"{script}:13:31: GM101")


def test_clean_exit_zero(tmp_path):
    path = tmp_path / "ok.py"
    path.write_text("import torch\nx = torch.ones(1)\n")
    result = lint(path)
    assert result.exit_code == 0 and result.stdout == ""
    assert "no findings in 1 file" in result.stderr


def test_select_and_ignore(script):
    assert "GM101" not in lint(script, "--select", "GM3").stdout
    assert "GM301" in lint(script, "--select", "GM3").stdout
    assert "GM301" not in lint(script, "--ignore", "GM301").stdout
    both = lint(script, "--select", "GM1,GM3", "--ignore", "GM301")
    assert "GM101" in both.stdout and "GM301" not in both.stdout
    assert lint(script, "--select", "GM301", "--ignore", "GM3").stdout.count("GM301") == 1
    bad = CliRunner().invoke(main, ["lint", str(script), "--select", "XX9"])
    assert bad.exit_code == 2 and "no rule matches" in bad.output


def test_noqa(tmp_path):
    path = tmp_path / "t.py"
    path.write_text("import torch\na = torch.ones(1).cuda()  # noqa\nb = torch.ones(1).cuda()  # noqa: GM301\n"
                    "c = torch.ones(1).cuda()  # noqa: GM101\n")
    out = lint(path).stdout
    assert [line.split(":")[1] for line in out.splitlines()] == ["3"]


def test_nothing_in_strings_or_comments(tmp_path):
    path = tmp_path / "t.py"
    path.write_text('import torch\n# model.cuda() was here\ndoc = "call model.cuda() and loss.data[0]"\n')
    assert lint(path).exit_code == 0


def test_fix_applies_and_reports_remaining(script):
    result = lint(script, "--fix")
    assert result.exit_code == 0
    assert "total_loss += loss.item()" in script.read_text()
    assert ".to(device)" in script.read_text()
    assert "Fixed 2 findings" in result.stderr
    assert lint(script).exit_code == 0


def test_fix_respects_selection(script):
    lint(script, "--fix", "--select", "GM3")
    text = script.read_text()
    assert "loss.item()" in text and ".cuda()" in text


def test_fix_diff_previews(script):
    result = lint(script, "--fix", "--diff")
    assert "+        total_loss += loss.item()" in result.stdout
    assert script.read_text() == SOURCE
    assert "Would fix 2 findings" in result.stderr


def test_json_format(script):
    rows = json.loads(lint(script, "--format", "json").stdout)
    schema = {
        "type": "array",
        "items": {
            "type": "object",
            "required": ["path", "line", "column", "end_line", "code", "name", "message", "fixable"],
            "properties": {
                "path": {"type": "string"}, "line": {"type": "integer", "minimum": 1},
                "column": {"type": "integer", "minimum": 1}, "code": {"type": "string", "pattern": "^GM[0-9]{3}$"},
                "fixable": {"type": "boolean"},
            },
        },
    }
    jsonschema.validate(rows, schema)
    assert [(r["code"], r["line"]) for r in rows] == [("GM301", 10), ("GM101", 13)]
    assert rows[0]["name"] == "tensor-accumulation" and rows[0]["fixable"] is True


# The parts of the SARIF 2.1.0 schema that GitHub code scanning requires.
SARIF_SUBSET = {
    "type": "object",
    "required": ["version", "runs"],
    "properties": {
        "version": {"const": "2.1.0"},
        "$schema": {"type": "string"},
        "runs": {"type": "array", "items": {
            "type": "object",
            "required": ["tool", "results"],
            "properties": {
                "tool": {"type": "object", "required": ["driver"], "properties": {"driver": {
                    "type": "object", "required": ["name", "rules"],
                    "properties": {"rules": {"type": "array", "items": {
                        "type": "object", "required": ["id", "shortDescription"],
                        "properties": {"shortDescription": {"type": "object", "required": ["text"]}}}}}}}},
                "results": {"type": "array", "items": {
                    "type": "object", "required": ["ruleId", "message", "locations"],
                    "properties": {
                        "level": {"enum": ["none", "note", "warning", "error"]},
                        "message": {"type": "object", "required": ["text"]},
                        "ruleIndex": {"type": "integer", "minimum": 0},
                        "locations": {"type": "array", "minItems": 1, "items": {
                            "type": "object", "required": ["physicalLocation"],
                            "properties": {"physicalLocation": {
                                "type": "object", "required": ["artifactLocation", "region"],
                                "properties": {
                                    "artifactLocation": {"type": "object", "required": ["uri"]},
                                    "region": {"type": "object", "required": ["startLine"], "properties": {
                                        "startLine": {"type": "integer", "minimum": 1},
                                        "startColumn": {"type": "integer", "minimum": 1}}}}}}}}}}},
            }}},
    },
}


def test_sarif_format(script):
    log = json.loads(lint(script, "--format", "sarif").stdout)
    jsonschema.validate(log, SARIF_SUBSET)
    run = log["runs"][0]
    rules = run["tool"]["driver"]["rules"]
    for result in run["results"]:
        assert rules[result["ruleIndex"]]["id"] == result["ruleId"]
    assert [r["locations"][0]["physicalLocation"]["region"]["startLine"] for r in run["results"]] == [10, 13]


def test_github_format(script):
    lines = lint(script, "--format", "github").stdout.splitlines()
    assert lines[0].startswith(f"::warning file={script},line=10,col=9,")
    assert "title=GM301::GM301 accumulating" in lines[0]


def test_config_in_pyproject(tmp_path, script):
    (tmp_path / "pyproject.toml").write_text(
        '[tool.gpumigrate]\nignore = ["GM301"]\n[tool.gpumigrate.per-file-ignores]\n"legacy_*.py" = ["GM101"]\n')
    (tmp_path / "legacy_x.py").write_text(SOURCE)
    out = lint(tmp_path).stdout
    assert "GM301" not in out
    assert "train.py:13" in out and "legacy_x.py" not in out
    # CLI flags win over the configuration
    assert "GM301" in lint(script, "--select", "GM301").stdout


def test_config_found_walking_up(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[tool.gpumigrate]\nselect = ["GM1"]\nexclude = ["skip"]\n')
    (tmp_path / "src" / "skip").mkdir(parents=True)
    (tmp_path / "src" / "t.py").write_text(SOURCE)
    (tmp_path / "src" / "skip" / "t.py").write_text(SOURCE)
    out = lint(tmp_path / "src").stdout
    assert out.count("GM101") == 1 and "GM301" not in out


def test_bad_config_is_one_line(tmp_path, script):
    (tmp_path / "pyproject.toml").write_text('[tool.gpumigrate]\nselect = "GM1"\ncolour = 1\n')
    result = CliRunner().invoke(main, ["lint", str(script)])
    assert result.exit_code == 2
    assert "unknown [tool.gpumigrate] setting 'colour'" in result.output
    assert "Traceback" not in result.output


def test_config_default_target(tmp_path, script):
    (tmp_path / "pyproject.toml").write_text('[tool.gpumigrate]\ntarget = "device"\n')
    result = CliRunner().invoke(main, [str(script), "--check"])
    assert result.exit_code == 1
