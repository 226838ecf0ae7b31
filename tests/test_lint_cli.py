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


# Lint reports the code as it is (issue 20, item 5): what holds only once a DataParallel script
# is migrated to DDP is in the migration's report, and in lint only for a rule named in full.
DATA_PARALLEL = textwrap.dedent("""\
    import torch
    import torch.nn as nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x):
            return self.fc(x)

    model = nn.DataParallel(Net())
    model.load_state_dict(torch.load("ckpt.pt", map_location="cpu"))
    print(model.module.fc.weight.sum().item())
    torch.save(model.state_dict(), "ckpt.pt")
    """)


def codes_at(output):
    return sorted((int(line.split(":")[1]), line.split()[1]) for line in output.splitlines())


def test_lint_reports_a_data_parallel_script_as_it_is(tmp_path):
    path = tmp_path / "dp.py"
    path.write_text(DATA_PARALLEL)
    result = lint(path)
    # DataParallel itself is a fact of the script; its `module.` keys and `model.module` are right
    # as long as it keeps DataParallel.
    assert codes_at(result.stdout) == [(12, "GM401")], result.stdout
    assert "module.`-prefixed" not in result.stdout and "AttributeError under DDP" not in result.stdout
    assert lint(path, "--select", "GM4").stdout == result.stdout  # a prefix does not opt in


def test_a_rule_named_in_full_reports_its_migration_notes(tmp_path):
    path = tmp_path / "dp.py"
    path.write_text(DATA_PARALLEL)
    notes = lint(path, "--select", "GM401,GM409").stdout
    assert codes_at(notes) == [(12, "GM401"), (13, "GM401"), (13, "GM409"), (14, "GM401"), (15, "GM409")], notes
    only_401 = lint(path, "--select", "GM401").stdout
    assert codes_at(only_401) == [(12, "GM401"), (13, "GM401"), (14, "GM401")], only_401


def test_the_ddp_migration_still_makes_the_edits_lint_leaves_out(tmp_path):
    path = tmp_path / "dp.py"
    path.write_text(DATA_PARALLEL)
    result = CliRunner().invoke(main, ["migrate", "--to", "ddp", "--diff", str(path)], catch_exceptions=False)
    assert "without_module_prefix(torch.load(" in result.stdout and "unwrap_model(model).fc" in result.stdout


def test_custom_attribute_through_data_parallel_is_reported_as_it_is(tmp_path):
    path = tmp_path / "rnn.py"
    path.write_text("import torch.nn as nn\nmodel = nn.DataParallel(Net())\nh = model.init_hidden(4)\n")
    out = lint(path).stdout
    # DataParallel forwards no custom attribute: this raises today, without any DDP.
    assert "GM409 `model.init_hidden` through `nn.DataParallel` raises AttributeError" in out, out
    assert "`model.module.init_hidden`" in out and "under DDP" not in out


def test_a_script_under_ddp_gets_its_state_dict_finding(tmp_path):
    # Under DDP the `module.` keys are the script's own fact: its checkpoints do not load into
    # the plain model.
    path = tmp_path / "ddp.py"
    path.write_text("import torch\nimport torch.nn as nn\nmodel = nn.parallel.DistributedDataParallel(Net())\n"
                    "torch.save(model.state_dict(), 'ckpt.pt')\n")
    assert codes_at(lint(path).stdout) == [(4, "GM409")]


def test_rules_and_explain_say_which_findings_need_the_full_code():
    rules = CliRunner().invoke(main, ["rules"]).stdout
    line = next(row for row in rules.splitlines() if row.startswith("GM409"))
    assert "lint reports them only with `--select GM409`" in line
    assert "only with `--select`" not in next(row for row in rules.splitlines() if row.startswith("GM101"))
    explained = CliRunner().invoke(main, ["explain", "GM401"]).stdout
    assert "lint reports them only with `--select GM401`" in explained
