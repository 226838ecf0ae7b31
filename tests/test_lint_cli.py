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


# ---------------------------------------------------------------- ruff's command-line habits (issue 20, item 7)

def run(*args, input=None, color=False, env=None):
    return CliRunner().invoke(main, [str(a) for a in args], input=input, color=color, env=env, catch_exceptions=False)


def test_quiet_prints_the_findings_and_nothing_else(script):
    result = lint(script, "-q")
    assert result.exit_code == 1
    assert result.stdout.count("\n") == 2 and result.stderr == ""
    assert "no rules selected" in run("lint", script, "--select", "GM400").stderr  # a migration step only
    assert run("lint", script, "--quiet", "--select", "GM400").stderr == ""  # not even that warning


def test_exit_zero_keeps_the_findings_but_not_the_failure(script, tmp_path):
    result = lint(script, "--exit-zero")
    assert result.exit_code == 0 and "GM301" in result.stdout
    (tmp_path / "broken.py").write_text("def (:\n")
    assert lint(script, tmp_path / "broken.py", "--exit-zero").exit_code == 2  # errors still fail


def test_statistics_count_per_rule_most_first(tmp_path):
    path = tmp_path / "t.py"
    path.write_text("import torch\na = torch.ones(1).cuda()\nb = torch.ones(1).cuda()\n"
                    "for i in range(3):\n    torch.cuda.empty_cache()\n")
    result = lint(path, "--statistics")
    assert result.exit_code == 1
    assert result.stdout.splitlines() == ["2\tGM101\t[*] cuda-call", "1\tGM304\t[ ] empty-cache-in-loop"]
    rows = json.loads(lint(path, "--statistics", "--format", "json").stdout)
    assert rows == [{"code": "GM101", "name": "cuda-call", "count": 2, "fixable": True},
                    {"code": "GM304", "name": "empty-cache-in-loop", "count": 1, "fixable": False}]
    assert run("lint", path, "--statistics", "--format", "sarif").exit_code == 2


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_output_file_gets_what_stdout_would(script, tmp_path, fmt):
    out = tmp_path / "findings.out"
    result = lint(script, "--format", fmt, "--output-file", out, "--color", "always")
    assert result.exit_code == 1 and result.stdout == ""
    assert "2 findings" in result.stderr
    text = out.read_text()
    assert "\x1b[" not in text
    assert text == lint(script, "--format", fmt).stdout
    refused = run("lint", script, "--output-file", script)
    assert refused.exit_code == 2 and "one of the inputs" in refused.output and script.read_text() == SOURCE


def test_config_names_the_settings_file_and_isolated_reads_none(tmp_path, script):
    (tmp_path / "pyproject.toml").write_text('[tool.gpumigrate]\nignore = ["GM301"]\n')
    other = tmp_path / "conf"
    other.mkdir()
    (other / "gpumigrate.toml").write_text('ignore = ["GM101"]\n')  # the settings at the top level
    (other / "pyproject.toml").write_text('[tool.gpumigrate]\nselect = ["GM301"]\n')
    assert "GM301" not in lint(script).stdout  # the nearest pyproject.toml
    out = lint(script, "--config", other / "gpumigrate.toml").stdout
    assert "GM301" in out and "GM101" not in out
    out = lint(script, "--config", other / "pyproject.toml").stdout
    assert "GM301" in out and "GM101" not in out
    out = lint(script, "--isolated").stdout
    assert "GM301" in out and "GM101" in out
    (other / "empty.toml").write_text("colour = 1\n")
    bad = run("lint", script, "--config", other / "empty.toml")
    assert bad.exit_code == 2 and "unknown [tool.gpumigrate] setting 'colour'" in bad.output
    missing = run("lint", script, "--config", other / "missing.toml")
    assert missing.exit_code == 2 and "missing.toml: cannot read" in missing.output
    assert run("lint", script, "--config", other / "gpumigrate.toml", "--isolated").exit_code == 2


def test_extend_select_adds_to_the_selection(tmp_path, script):
    (tmp_path / "pyproject.toml").write_text('[tool.gpumigrate]\nselect = ["GM1"]\n')
    assert "GM301" not in lint(script).stdout
    out = lint(script, "--extend-select", "GM301").stdout
    assert "GM301" in out and "GM101" in out
    out = lint(script, "--select", "GM3", "--extend-select", "cuda-call").stdout
    assert "GM301" in out and "GM101" in out
    # with no select at all, it adds to every rule (and beats a broader ignore, as in ruff)
    (tmp_path / "pyproject.toml").write_text('[tool.gpumigrate]\nignore = ["GM3"]\n')
    out = lint(script, "--extend-select", "GM301").stdout
    assert "GM301" in out and "GM101" in out


def test_rule_names_wherever_codes_are(tmp_path, script):
    assert "GM101" not in lint(script, "--select", "tensor-accumulation").stdout
    assert "GM301" not in lint(script, "--ignore", "Tensor-Accumulation").stdout
    (tmp_path / "pyproject.toml").write_text('[tool.gpumigrate.lint]\nselect = ["cuda-call"]\n')
    assert "GM301" not in lint(script).stdout and "GM101" in lint(script).stdout
    explained = run("explain", "tensor-accumulation")
    assert explained.exit_code == 0 and explained.stdout.startswith("GM301 (tensor-accumulation)")
    typo = run("lint", script, "--select", "tensor-acumulation")
    assert typo.exit_code == 2 and "did you mean tensor-accumulation?" in typo.output
    assert "did you mean GM301?" in run("explain", "GM3O1").output


def _apply(source: str, edits: list) -> str:
    """Apply ruff-style line edits (each once, bottom up)."""
    lines = source.splitlines(keepends=True)
    unique = {(e["location"]["row"], e["end_location"]["row"], e["content"]) for e in edits}
    for start, end, content in sorted(unique, reverse=True):
        assert e_columns_are_line_starts(edits)
        lines[start - 1:end - 1] = [content]
    return "".join(lines)


def e_columns_are_line_starts(edits: list) -> bool:
    return all(e["location"]["column"] == 1 and e["end_location"]["column"] == 1 for e in edits)


def test_json_has_end_column_url_and_the_fix_edits(script, tmp_path):
    rows = json.loads(lint(script, "--format", "json").stdout)
    edit = {"type": "object", "required": ["content", "location", "end_location"], "properties": {
        "content": {"type": "string"},
        "location": {"type": "object", "required": ["row", "column"]},
        "end_location": {"type": "object", "required": ["row", "column"]}}}
    schema = {"type": "array", "items": {
        "type": "object", "required": ["end_column", "url", "fix"],
        "properties": {
            "end_column": {"type": ["integer", "null"], "minimum": 1},
            "url": {"type": "string", "pattern": "^https://"},
            "fix": {"oneOf": [{"type": "null"}, {
                "type": "object", "required": ["applicability", "edits"],
                "properties": {"applicability": {"const": "safe"},
                               "edits": {"type": "array", "minItems": 1, "items": edit}}}]}}}}
    jsonschema.validate(rows, schema)
    # `total_loss += loss` at 10:9 ends at column 27; `.cuda()` of 13:31 at 35
    assert [(r["line"], r["column"], r["end_line"], r["end_column"]) for r in rows] == [(10, 9, 10, 27),
                                                                                      (13, 31, 13, 35)]
    # each fix alone changes its own line; all of them together make what `lint --fix` writes
    gm301 = _apply(SOURCE, rows[0]["fix"]["edits"])
    assert "total_loss += loss.item()" in gm301 and ".cuda()" in gm301
    together = _apply(SOURCE, [e for r in rows for e in r["fix"]["edits"]])
    assert script.read_text() == SOURCE  # JSON computed the fixes without writing them
    lint(script, "--fix")
    assert together == script.read_text()


def test_json_fix_is_null_for_a_lint_only_rule(tmp_path):
    path = tmp_path / "t.py"
    path.write_text("import torch\nfor i in range(3):\n    torch.cuda.empty_cache()\n")
    (row,) = json.loads(lint(path, "--format", "json").stdout)
    assert row["code"] == "GM304" and row["fix"] is None and row["fixable"] is False


def test_sarif_and_github_carry_the_end_column_and_docs(script):
    run_ = json.loads(lint(script, "--format", "sarif").stdout)["runs"][0]
    assert all(r["helpUri"].startswith("https://") for r in run_["tool"]["driver"]["rules"])
    regions = [r["locations"][0]["physicalLocation"]["region"] for r in run_["results"]]
    assert [(g["startColumn"], g["endColumn"]) for g in regions] == [(9, 27), (31, 35)]
    lines = lint(script, "--format", "github").stdout.splitlines()
    assert lines[0].startswith(f"::warning file={script},line=10,col=9,endColumn=27,endLine=10,")


def test_github_gives_no_columns_to_a_multiline_finding(tmp_path):
    path = tmp_path / "t.py"
    path.write_text("import torch\ndef f(loader, model):\n    total = 0\n    for x in loader:\n"
                    "        loss = model(x)\n        loss.backward()\n"
                    "        total += (\n            loss\n        )\n")
    (line,) = lint(path, "--format", "github").stdout.splitlines()
    assert ",line=7,endLine=9," in line
    assert "col=" not in line.split("title=")[0] and "endColumn" not in line


def test_findings_are_coloured_on_a_terminal(script):
    ansi = "\x1b["
    coloured = run("lint", script, color=True).stdout
    assert ansi in coloured and "\x1b[31m" in coloured.replace("\x1b[1m", "")  # the code in red
    assert ansi not in run("lint", script, color=True, env={"NO_COLOR": "1"}).stdout
    assert ansi not in run("lint", script, "--color", "never", color=True).stdout
    assert ansi in run("lint", script, "--color", "always").stdout
    assert ansi not in run("lint", script).stdout  # not a terminal


def test_fix_diff_exits_1_when_fixes_are_pending(script, tmp_path):
    assert lint(script, "--fix", "--diff").exit_code == 1
    lint(script, "--fix")
    assert lint(script, "--fix", "--diff").exit_code == 0
    path = tmp_path / "lint_only.py"  # findings, but nothing to fix: the diff is empty
    path.write_text("import torch\nfor i in range(3):\n    torch.cuda.empty_cache()\n")
    result = lint(path, "--fix", "--diff")
    assert result.exit_code == 0 and result.stdout == ""


CUDA_AND_TOTAL = "import torch\nmodel = torch.nn.Linear(2, 2).cuda()\n"


def test_the_lint_table_scopes_lint_not_migrations(tmp_path, script):
    (tmp_path / "pyproject.toml").write_text('[tool.gpumigrate.lint]\nselect = ["GM3"]\n')
    out = lint(script).stdout
    assert "GM301" in out and "GM101" not in out
    migrated = run(script, "--diff")
    assert ".to(device)" in migrated.stdout and "partial" not in migrated.stderr


def test_a_top_level_select_still_scopes_both_and_says_so_when_a_migration_is_partial(tmp_path, script):
    (tmp_path / "pyproject.toml").write_text('[tool.gpumigrate]\nselect = ["GM3"]\n')
    assert "GM101" not in lint(script).stdout
    migrated = run(script, "--diff")
    assert ".to(device)" not in migrated.stdout
    assert "[tool.gpumigrate.lint]" in migrated.stderr and "partial" in migrated.stderr


def test_the_lint_table_is_checked(tmp_path, script):
    (tmp_path / "pyproject.toml").write_text('[tool.gpumigrate.lint]\nselect = ["GM99"]\n')
    result = run("lint", script)
    assert result.exit_code == 2 and "[tool.gpumigrate.lint] select: no rule matches 'GM99'" in result.output
    (tmp_path / "pyproject.toml").write_text('[tool.gpumigrate.lint]\nexclude = ["x"]\n')
    result = run("lint", script)
    assert result.exit_code == 2 and "unknown [tool.gpumigrate.lint] setting 'exclude'" in result.output


GUARDED = textwrap.dedent("""\
    import torch
    model = torch.nn.Linear(2, 2)
    if torch.cuda.is_available():
        model = model.cuda()
    x = torch.ones(2).cuda()
    """)


def test_json_reports_the_findings_text_does_and_fixes_stdin_too(tmp_path):
    path = tmp_path / "t.py"
    path.write_text(GUARDED)
    text = [line.split(": ")[0].split(":")[1:] + [line.split(": ")[1].split()[0]]
            for line in lint(path).stdout.splitlines()]
    rows = json.loads(lint(path, "--format", "json").stdout)
    assert [[str(r["line"]), str(r["column"]), r["code"]] for r in rows] == text  # a fixing run reports otherwise
    assert all(r["fix"] for r in rows if r["code"] == "GM101")
    piped = json.loads(run("lint", "-", "--stdin-filename", "t.py", "--format", "json", input=GUARDED).stdout)
    assert [(r["line"], r["code"]) for r in piped] == [(r["line"], r["code"]) for r in rows]
    assert [r["fix"] for r in piped] == [r["fix"] for r in rows]


def test_the_lint_table_has_per_file_ignores_too(tmp_path, script):
    (tmp_path / "pyproject.toml").write_text('[tool.gpumigrate.lint.per-file-ignores]\n"train.py" = ["cuda-call"]\n')
    out = lint(script).stdout
    assert "GM101" not in out and "GM301" in out
    assert ".to(device)" in run(script, "--diff").stdout  # migrations do not read it
    (tmp_path / "pyproject.toml").write_text('[tool.gpumigrate.lint.per-file-ignores]\n"train.py" = ["GM99"]\n')
    bad = run("lint", script)
    assert bad.exit_code == 2 and "[tool.gpumigrate.lint.per-file-ignores] 'train.py'" in bad.output


def test_a_ddp_migrated_script_is_under_ddp(tmp_path):
    # `wrap_model` is DDP under torchrun: a custom attribute read through it raises there, and
    # its state_dict keys differ between `python` and `torchrun` runs.
    path = tmp_path / "migrated.py"
    path.write_text("import torch\nfrom gpumigrate.runtime import unwrap_model, wrap_model\n"
                    "model = wrap_model(Net())\nh = model.init_hidden(4)\n"
                    "torch.save(model.state_dict(), 'ckpt.pt')\ng = unwrap_model(model).init_hidden(4)\n")
    out = lint(path).stdout
    assert codes_at(out) == [(4, "GM409"), (5, "GM409")], out
    assert "raises AttributeError under DDP" in out


def test_uses_above_the_wrap_in_the_same_function_are_the_plain_model(tmp_path):
    path = tmp_path / "migrated.py"
    path.write_text("import torch\nfrom gpumigrate.runtime import wrap_model\n"
                    "def main():\n    model = Net()\n    model.init_weights()\n"
                    "    model.load_state_dict(torch.load('ckpt.pt', map_location='cpu'))\n"
                    "    model = wrap_model(model)\n    model.init_hidden(4)\n")
    assert codes_at(lint(path).stdout) == [(8, "GM409")]
    # a function called only above the wrap gets the plain model too; one called below, the wrapper
    path.write_text("import torch\nfrom gpumigrate.runtime import wrap_model\n"
                    "def resume(model):\n    model.load_state_dict(torch.load('ckpt.pt', map_location='cpu'))\n"
                    "def report(model):\n    print(model.fc)\n"
                    "def main():\n    model = Net()\n    resume(model)\n    model = wrap_model(model)\n"
                    "    report(model)\n")
    assert codes_at(lint(path).stdout) == [(6, "GM409")]
