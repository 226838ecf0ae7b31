"""The results cache: re-runs over unchanged files take their results from it, and nothing
a result depends on is left out of its key."""

import json

import pytest
from click.testing import CliRunner

from gpumigrate.cli import main

SCRIPT = "import torch\nmodel = torch.nn.Linear(2, 2).cuda()\n"
MESSAGE = "`.cuda()` hard-codes the device"


@pytest.fixture
def project(tmp_path, monkeypatch):
    monkeypatch.delenv("GPUMIGRATE_CACHE_DIR", raising=False)
    (tmp_path / "pyproject.toml").write_text("[tool.gpumigrate]\n")
    (tmp_path / "train.py").write_text(SCRIPT)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def entries(folder):
    return [p for p in (folder / ".gpumigrate_cache").rglob("*") if p.is_file() and p.parent.name != ".gpumigrate_cache"]


def tamper(folder, old, new):
    for entry in entries(folder):
        entry.write_text(entry.read_text().replace(old, new))


def test_a_rerun_takes_its_results_from_the_cache(project):
    first = cli("lint", "train.py")
    assert first.exit_code == 1 and MESSAGE in first.output
    cache = project / ".gpumigrate_cache"
    assert (cache / "CACHEDIR.TAG").exists() and (cache / ".gitignore").read_text().endswith("*\n")
    assert len(entries(project)) == 1
    tamper(project, "hard-codes", "HARD-CODES")  # only a cache hit can print this
    assert "HARD-CODES" in cli("lint", "train.py").output
    assert MESSAGE in cli("lint", "train.py", "--no-cache").output
    (project / "train.py").write_text(SCRIPT + "x = 1\n")  # new content: a new entry
    assert MESSAGE in cli("lint", "train.py").output and len(entries(project)) == 2


def test_other_rules_are_another_entry(project):
    cli("lint", "train.py")
    tamper(project, "hard-codes", "HARD-CODES")
    assert MESSAGE in cli("lint", "train.py", "--select", "GM1").output  # GM101 in both runs


def test_what_a_result_depends_on_is_in_its_key():
    from gpumigrate.codemods import rules_for, fixed_codes
    from gpumigrate.rewriter.cache import Cache, run_key

    rules = tuple(rules_for("ddp"))
    base = run_key(rules, fixed_codes("ddp"), {"sync_bn": False}, ())
    assert base == run_key(rules, list(reversed(fixed_codes("ddp"))), {"sync_bn": False}, ())
    others = [run_key(rules[:-1], fixed_codes("ddp"), {"sync_bn": False}, ()),
              run_key(rules, fixed_codes("device"), {"sync_bn": False}, ()),
              run_key(rules, fixed_codes("ddp"), {"sync_bn": True}, ()),
              run_key(rules, fixed_codes("ddp"), {"sync_bn": False}, None)]
    assert len({base, *others}) == 5
    cache = Cache("unused")
    assert cache.key(base, "a.py", b"x") == cache.key(base, "b/c.py", b"x")  # the name is not the content
    assert len({cache.key(base, "a.py", b"x"), cache.key(base, "a.ipynb", b"x"), cache.key(base, "a.py", b"y"),
                cache.key(others[0], "a.py", b"x")}) == 4


def test_a_damaged_or_deleted_cache_is_recomputed(project):
    cli("lint", "train.py")
    for entry in entries(project):
        entry.write_text("{not json")
    assert MESSAGE in cli("lint", "train.py").output
    for entry in entries(project):
        entry.write_text(json.dumps({"findings": [{"bogus": 1}], "new_source": None}))
    assert MESSAGE in cli("lint", "train.py").output
    import shutil

    shutil.rmtree(project / ".gpumigrate_cache")
    assert MESSAGE in cli("lint", "train.py").output


def test_a_cache_folder_we_cannot_write_is_no_error(project):
    (project / ".gpumigrate_cache").write_text("a file where the folder would go")  # even root cannot
    result = cli("lint", "train.py")
    assert result.exit_code == 1 and MESSAGE in result.output
    assert result.output.count("\n") == 2  # the finding and the summary: no warning, no traceback


def test_migration_from_the_cache_writes_the_same_file(project):
    assert cli("train.py", "--to", "device", "--check").exit_code == 1  # fills the cache
    result = cli("train.py", "--to", "device")
    assert result.exit_code == 0 and "1 file changed" in result.output
    assert ".to(device)" in (project / "train.py").read_text()
    again = cli("train.py", "--to", "device")
    assert "1 unchanged" in again.output


def test_the_cache_folder_can_be_chosen(project, tmp_path_factory, monkeypatch):
    elsewhere = tmp_path_factory.mktemp("cache")
    monkeypatch.setenv("GPUMIGRATE_CACHE_DIR", str(elsewhere))
    cli("lint", "train.py")
    assert not (project / ".gpumigrate_cache").exists() and list(elsewhere.rglob("*"))


def test_stdin_is_not_cached(project):
    result = CliRunner().invoke(main, ["lint", "-", "--stdin-filename", "train.py"], input=SCRIPT)
    assert MESSAGE in result.output and not (project / ".gpumigrate_cache").exists()
