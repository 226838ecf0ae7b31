"""`--vendor-runtime DIR`: migrated scripts that run where gpumigrate is not installed.

The vendored module is generated from the package (gpumigrate/runtime/), so it is held to the
package's behaviour: same exports and signatures here, the runtime's own tests through the
`rt` fixture of test_runtime.py, and a vendored `--to ddp` fixture trained under torchrun in
processes that cannot import gpumigrate, libcst or click.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from gpumigrate import __version__, runtime
from gpumigrate.cli import main
from gpumigrate.codemods import ALL_RULES
from gpumigrate.rewriter.vendor import (
    GENERATED_MARK,
    VENDORED_FILE,
    VendorError,
    bundle,
    bundled_runtime,
    runtime_sources,
)
from tests.conftest import FIXTURES, ROOT, lint, migrate

VENDORED_IMPORT = b"from gpumigrate_runtime import"
PACKAGE_IMPORT = b"from gpumigrate.runtime import"
VENDOR = {"runtime_module": "gpumigrate_runtime"}
SCRIPTS = sorted((FIXTURES / "scripts").glob("*.py"))
CUDA_SCRIPT = "import torch\nmodel = torch.nn.Linear(2, 2).cuda()\n"


def cli(*args) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def vendored(golden: bytes) -> bytes:
    """A golden as `--vendor-runtime` must write it: the runtime import names the vendored module.
    (The goldens name `gpumigrate.runtime` in their import line only.)"""
    return golden.replace(PACKAGE_IMPORT, VENDORED_IMPORT)


# ---------------------------------------------------------------- the generated module

def test_vendored_module_exports_what_the_package_exports(vendored_runtime):
    assert vendored_runtime.__all__ == runtime.__all__
    star: dict = {}
    exec(f"from {vendored_runtime.__name__} import *", star)  # what `import *` in a script gets
    assert set(star) - {"__builtins__"} == set(runtime.__all__)
    for name in runtime.__all__:
        ours, theirs = getattr(vendored_runtime, name), getattr(runtime, name)
        assert type(ours) is type(theirs), name
        assert inspect.signature(ours) == inspect.signature(theirs), name
        assert inspect.getdoc(ours) == inspect.getdoc(theirs), name


def test_vendored_module_is_marked_and_needs_no_gpumigrate():
    text = bundled_runtime()
    lines = text.splitlines()
    assert lines[0].startswith(f"{GENERATED_MARK} {__version__} ") and "Do not edit" in lines[0]
    assert "# gpumigrate: noqa" in lines  # the tool's own runs leave it alone
    imported = [alias.name if isinstance(node, ast.Import) else node.module
                for node in ast.walk(ast.parse(text)) if isinstance(node, (ast.Import, ast.ImportFrom))
                for alias in node.names]
    assert not [m for m in imported if m and m.split(".")[0] not in {"torch", "__future__"} | sys.stdlib_module_names]
    assert ast.get_docstring(ast.parse(text)) == runtime.__doc__.strip()
    assert bundled_runtime() == text  # deterministic: rewriting it is a no-op


def test_bundling_reads_sources_without_importing_torch_or_the_runtime():
    code = ("import sys; from gpumigrate.rewriter.vendor import bundled_runtime; text = bundled_runtime(); "
            "print(len(text) > 1000, 'torch' in sys.modules, 'gpumigrate.runtime' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(ROOT))
    assert done.stdout.split() == ["True", "False", "False"], done.stderr


def test_bundling_a_small_package_with_relative_imports():
    sources = {
        "__init__": '"""Pkg."""\nfrom .b import twice\nfrom .a import base\n\n__all__ = ["base", "twice"]\n',
        "a": '"""A."""\nfrom __future__ import annotations\nimport os\n\ndef base() -> int:\n    return 21\n',
        "b": '"""B."""\nfrom __future__ import annotations\nimport os\n\nfrom .a import base\n\n\n'
             'def twice() -> int:\n    return 2 * base()\n',
    }
    text = bundle(sources, "9.9", package="pkg.runtime")
    namespace: dict = {}
    exec(compile(text, "x.py", "exec"), namespace)
    assert namespace["twice"]() == 42 and namespace["__all__"] == ["base", "twice"]
    assert text.index("def base") < text.index("def twice")  # a module after the ones it imports


GOOD = {"__init__": 'from .a import f\n__all__ = ["f"]\n', "a": "def f():\n    return 1\n"}


@pytest.mark.parametrize("change, message", [
    ({"b": "def _helper():\n    pass\n", "a": "def f():\n    return 1\n\ndef _helper():\n    pass\n"},
     "`_helper` is bound in both"),
    ({"a": "from gpumigrate.config import load_config\ndef f():\n    return 1\n"}, "imports gpumigrate.config"),
    ({"a": "def f():\n    from gpumigrate import cli\n    return 1\n"}, "imports gpumigrate"),
    ({"__init__": 'from .a import f\nprint("side effect")\n__all__ = ["f"]\n'}, "may only import"),
    ({"__init__": 'from .a import f\n__all__ = ["f", "g"]\n'}, "differ: g"),
    ({"__init__": 'from .a import g\n__all__ = ["g"]\n'}, "does not define it"),
    ({"b": "from .a import f as g\n"}, "cannot be joined"),
    ({"a": "import os\ndef f():\n    return 1\n", "b": "import sys as os\n"}, "`os` is bound in both"),
    ({"a": "from __future__ import annotations\ndef f():\n    return 1\n", "b": "def g():\n    pass\n"},
     "different `from __future__`"),
])
def test_bundling_refuses_what_would_change_meaning(change, message):
    sources = {**GOOD, **change}
    with pytest.raises(VendorError, match=re.escape(message)):
        bundle(sources, package="pkg.runtime")
    bundle(GOOD, package="pkg.runtime")  # the unchanged package joins


def test_the_real_runtime_has_no_name_clash():
    # The same check as above, on the package as it is: a new private helper named like one
    # in another runtime module must fail here, not in a user's script.
    assert set(runtime_sources()) >= {"__init__", "device", "distributed", "precision", "sharding"}
    compile(bundled_runtime(), VENDORED_FILE, "exec")


# ---------------------------------------------------------------- the migration

@pytest.mark.parametrize("target", ["device", "ddp"])
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
@pytest.mark.slow
def test_vendored_migration_is_the_golden_with_the_vendored_import(script, target):
    """Every rule that recognises the runtime (idempotence, rank queries, collectives, the
    device definition) accepts the vendored name: the output is the golden, import aside;
    a second run changes nothing; and a golden migrated earlier without vendoring is switched
    to the vendored import, nothing else."""
    golden = (FIXTURES / "expected" / target / script.name).read_bytes()
    result = migrate(script.read_bytes(), target, str(script), options=VENDOR)
    assert result.error is None
    out = result.new_source if result.new_source is not None else result.source
    assert out == vendored(golden)
    again = migrate(out, target, str(script), options=VENDOR)
    assert again.error is None and again.new_source is None
    switched = migrate(golden, target, str(script), options=VENDOR)
    assert (switched.new_source if switched.new_source is not None else golden) == vendored(golden)
    assert all(f.code == "GM100" for f in switched.findings if f.fixed)


# A ddp script as a first migration leaves it, with a `.cuda()` added since: the device it
# defines is reused, a collective in the batch loop is the runtime's (not a project helper to
# report), a print of the rank (by an alias) stays per rank, a collective in a rank-0 branch is GM408.
MIGRATED = b"""import torch
from torch.utils.data import DataLoader
from gpumigrate.runtime import barrier, distributed_sampler, get_rank as process_index, is_main_process, reduce_sum, set_epoch, setup_distributed, wrap_model

device = setup_distributed()
model = wrap_model(torch.nn.Linear(2, 2).to(device))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.utils.data.TensorDataset(torch.randn(8, 2), torch.randn(8, 2))
loader = DataLoader(data, batch_size=2, sampler=distributed_sampler(data))
total = 0.0
for epoch in range(2):
    set_epoch(loader, epoch)
    for x, y in loader:
        x, y = x.cuda(), y.cuda()
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        barrier()
        total += loss.item()
    if is_main_process():
        total = reduce_sum(total)
        print(total)
print("process", process_index(), "finished")
"""
RUNTIME_EXAMPLES = [pytest.param(rule, example.code.encode(), id=f"{rule.code}-{i}")
                    for rule in ALL_RULES for i, example in enumerate(rule.examples)
                    if PACKAGE_IMPORT in example.code.encode() and rule.code != "GM100"]


@pytest.mark.parametrize("rule, source", [pytest.param(None, MIGRATED, id="migrated"), *RUNTIME_EXAMPLES])
def test_the_vendored_runtime_is_the_runtime_to_every_rule(rule, source):
    """Collectives, rank tests and library calls through `gpumigrate_runtime` are what they are
    through `gpumigrate.runtime`: the same findings, the same edits."""
    results = []
    for code, options in ((source, None), (vendored(source), VENDOR)):
        result = lint(code, [rule], options=options) if rule else migrate(code, "ddp", options=options)
        assert result.error is None
        results.append(([(f.code, f.line, f.message, f.fixed) for f in result.findings],
                        vendored(result.new_source) if result.new_source else None))
    assert results[0] == results[1]
    if rule is None:
        assert [f[0] for f in results[0][0]] == ["GM101", "GM101", "GM408"]
        assert b"x, y = x.to(device), y.to(device)" in results[0][1]
        assert b'\nprint("process", process_index(), "finished")\n' in results[0][1]  # names the rank: not gated


@pytest.mark.parametrize("script", [s for s in SCRIPTS
                                    if PACKAGE_IMPORT in (FIXTURES / "expected" / "device" / s.name).read_bytes()],
                         ids=lambda p: p.name)
@pytest.mark.slow
def test_a_vendored_script_stays_vendored_when_migrated_further(script):
    """`--to device --vendor-runtime`, later `--to ddp` without it: the helpers ddp adds come
    from the module the script already imports, never from both."""
    device = (FIXTURES / "expected" / "device" / script.name).read_bytes()
    plain = migrate(device, "ddp", str(script))
    later = migrate(vendored(device), "ddp", str(script))
    assert (later.new_source or vendored(device)) == vendored(plain.new_source or device)


# ---------------------------------------------------------------- the command line

def test_vendor_runtime_writes_the_module_and_the_script_imports_it(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(CUDA_SCRIPT)
    result = cli(script, "--to", "device", "--vendor-runtime", tmp_path)
    assert result.exit_code == 0, result.output
    module = tmp_path / VENDORED_FILE
    assert module.read_text() == bundled_runtime()
    assert "from gpumigrate_runtime import get_device\n" in script.read_text()
    assert "gpumigrate.runtime" not in script.read_text()
    assert f"wrote {module}" in result.output and "note:" not in result.output  # same directory: nothing to say

    stamp = module.stat().st_mtime_ns
    again = cli(script, "--to", "device", "--vendor-runtime", tmp_path)
    assert again.exit_code == 0 and "0 files changed" in again.output and "wrote" not in again.output
    assert module.stat().st_mtime_ns == stamp and module.read_text() == bundled_runtime()
    assert cli(script, "--to", "device", "--vendor-runtime", tmp_path, "--check").exit_code == 0


def test_a_script_migrated_without_vendoring_is_switched(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(CUDA_SCRIPT)
    assert cli(script, "--to", "device").exit_code == 0
    assert "from gpumigrate.runtime import get_device" in script.read_text()
    before = script.read_text()
    assert cli(script, "--to", "device", "--vendor-runtime", tmp_path, "--check").exit_code == 1
    assert script.read_text() == before and not (tmp_path / VENDORED_FILE).exists()
    result = cli(script, "--to", "device", "--vendor-runtime", tmp_path)
    assert result.exit_code == 0 and "1 file changed" in result.output
    assert script.read_text() == before.replace("from gpumigrate.runtime import", "from gpumigrate_runtime import")


def test_dry_runs_write_nothing_but_check_sees_a_missing_module(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(CUDA_SCRIPT)
    vendor = tmp_path / "vendor"
    for flag in ("--diff", "--check"):
        result = cli(script, "--to", "device", "--vendor-runtime", vendor, flag)
        assert result.exit_code == (1 if flag == "--check" else 0)
        assert f"would write {vendor / VENDORED_FILE}" in result.output
        assert script.read_text() == CUDA_SCRIPT and not vendor.exists()
    # scripts already migrated, module missing: --check still fails, since a run would write it
    assert cli(script, "--to", "device", "--vendor-runtime", tmp_path).exit_code == 0
    (tmp_path / VENDORED_FILE).unlink()
    assert cli(script, "--to", "device", "--vendor-runtime", tmp_path, "--check").exit_code == 1


def test_a_missing_directory_is_created_and_files_elsewhere_get_a_note(tmp_path):
    (tmp_path / "scripts").mkdir()
    script = tmp_path / "scripts" / "train.py"
    script.write_text(CUDA_SCRIPT)
    vendor = tmp_path / "deps" / "vendor"
    result = cli(script, "--to", "device", "--vendor-runtime", vendor)
    assert result.exit_code == 0
    assert (vendor / VENDORED_FILE).read_text() == bundled_runtime()
    notes = [line for line in result.output.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and str(script) in notes[0] and f"with {vendor} on PYTHONPATH" in notes[0]


def test_output_next_to_the_module_needs_no_note(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(CUDA_SCRIPT)
    out = tmp_path / "ship" / "train.py"
    result = cli(script, "--to", "device", "--vendor-runtime", out.parent, "-o", out)
    assert result.exit_code == 0 and "note:" not in result.output
    assert "from gpumigrate_runtime import" in out.read_text() and script.read_text() == CUDA_SCRIPT


def test_the_module_inside_the_migrated_tree_is_left_alone(tmp_path):
    (tmp_path / "train.py").write_text(CUDA_SCRIPT)
    for _ in range(2):  # the second run discovers gpumigrate_runtime.py among the scripts
        result = cli(tmp_path, "--to", "ddp", "--vendor-runtime", tmp_path)
        assert result.exit_code == 0, result.output
    assert (tmp_path / VENDORED_FILE).read_text() == bundled_runtime()
    assert cli("lint", tmp_path / VENDORED_FILE).exit_code == 0


@pytest.mark.parametrize("make, message", [
    (lambda d: (d / "vendor").write_text("x"), "not a directory"),
    (lambda d: (d / "vendor").mkdir() or (d / "vendor" / VENDORED_FILE).write_text("# mine\n"),
     "was not generated by gpumigrate; not overwritten"),
    (lambda d: (d / "vendor").mkdir() or os.mkfifo(d / "vendor" / VENDORED_FILE), "not a regular file"),
])
def test_a_bad_directory_is_one_line_and_changes_nothing(tmp_path, make, message):
    script = tmp_path / "train.py"
    script.write_text(CUDA_SCRIPT)
    make(tmp_path)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    result = cli(script, "--to", "device", "--vendor-runtime", tmp_path / "vendor")
    assert result.exit_code == 2
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], result.output
    assert "Traceback" not in result.output
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_an_unwritable_directory_is_one_line_and_changes_nothing(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(CUDA_SCRIPT)
    (tmp_path / "a_file").write_text("x")
    result = cli(script, "--vendor-runtime", tmp_path / "a_file" / "vendor")  # cannot be created, even by root
    assert result.exit_code == 2 and "cannot write" in result.output and "Traceback" not in result.output
    assert script.read_text() == CUDA_SCRIPT
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        result = cli(script, "--vendor-runtime", locked)
        assert result.exit_code == 2 and "cannot write" in result.output and script.read_text() == CUDA_SCRIPT


# ---------------------------------------------------------------- without gpumigrate installed

BLOCKER = '''\
"""Loaded by every Python process started with this directory on PYTHONPATH (the torchrun
launcher and each rank): makes the listed top-level packages unimportable, and records at exit
what this process could import and which runtime module it used."""
import atexit, importlib.abc, json, os, sys

BLOCKED = {blocked!r}


class _Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{{name}} is blocked: this process must run without it")
        return None


sys.meta_path.insert(0, _Blocked())  # before the editable install's finder and site-packages


def _record():
    importable = []
    for name in sorted(BLOCKED):
        try:
            __import__(name)
            importable.append(name)
        except ImportError:
            pass
    runtime = sys.modules.get("gpumigrate_runtime")
    report = {{"rank": os.environ.get("RANK"), "argv": sys.argv, "importable": importable,
              "loaded": sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED),
              "runtime": getattr(runtime, "__file__", None)}}
    with open(os.path.join({reports!r}, f"{{os.getpid()}}.json"), "w") as handle:
        json.dump(report, handle)


atexit.register(_record)
'''


def blocked_env(tmp_path: Path, blocked: set) -> tuple:
    """An environment whose processes cannot import `blocked`, and where their reports go."""
    site, reports = tmp_path / "blocker", tmp_path / "reports"
    site.mkdir()
    reports.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER.format(blocked=sorted(blocked), reports=str(reports)))
    launch = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
              "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if k not in launch and not k.startswith(("TORCHELASTIC_", "SLURM_"))}
    (tmp_path / "tmp").mkdir()
    env.update(PYTHONPATH=str(site), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TMPDIR=str(tmp_path / "tmp"))
    return env, reports


def tool_dependencies() -> set:
    """The import names of the tool's own dependencies, from pyproject.toml: what a
    runtime-only install must do without."""
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        import tomli as tomllib
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {re.match(r"[A-Za-z0-9_.-]+", d).group(0).lower().replace("-", "_") for d in deps}


@pytest.mark.slow
def test_the_package_runtime_works_without_the_tools_dependencies(tmp_path):
    """What `pip install --no-deps gpumigrate` (plus torch) gives: `gpumigrate.runtime`
    imports and works with libcst, click and every other dependency of the tool missing."""
    blocked = tool_dependencies()
    assert {"libcst", "click"} <= blocked
    env, _ = blocked_env(tmp_path, blocked)
    code = ("import torch\nfrom gpumigrate.runtime import get_device, reduce_sum, setup_distributed, wrap_model\n"
            "model = torch.nn.Linear(2, 2)\n"
            "assert setup_distributed() == get_device() and wrap_model(model) is model and reduce_sum(3) == 3\n"
            "for name in " + repr(sorted(blocked)) + ":\n"
            "    try:\n        __import__(name)\n    except ImportError:\n        continue\n"
            "    raise SystemExit(name + ' importable')\nprint('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=str(tmp_path),
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@pytest.mark.e2e
@pytest.mark.ddp
def test_vendored_ddp_script_trains_under_torchrun_without_gpumigrate(tmp_path):
    from gpumigrate.verify.runs import kill_tree

    work = tmp_path / "cluster"  # what the user ships: the script and the vendored runtime
    work.mkdir()
    script = work / "train.py"
    shutil.copy(FIXTURES / "scripts" / "mnist_2019.py", script)
    result = cli(script, "--to", "ddp", "--vendor-runtime", work)
    assert result.exit_code == 0, result.output
    text = script.read_text()
    assert "from gpumigrate_runtime import" in text and "gpumigrate.runtime" not in text
    helpers = re.search(r"from gpumigrate_runtime import (.*)", text).group(1).split(", ")
    assert {"setup_distributed", "wrap_model", "distributed_sampler", "set_epoch", "reduce_sum"} <= set(helpers)

    blocked = {"gpumigrate", "libcst", "click"}
    env, reports = blocked_env(tmp_path, blocked)
    # The blocker works: in this environment the editable install is invisible.
    probe = subprocess.run([sys.executable, "-c", "import gpumigrate.runtime"], capture_output=True, text=True,
                           env=env, cwd=str(work), timeout=60)
    assert probe.returncode != 0 and "gpumigrate is blocked" in probe.stderr
    for stale in reports.iterdir():
        stale.unlink()

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
           "--epochs", "1"]
    proc = subprocess.Popen(cmd, cwd=str(work), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        stdout, stderr = proc.communicate()
        pytest.fail(f"timed out (a deadlock?)\n{stderr[-3000:]}")
    assert proc.returncode == 0, f"exit {proc.returncode}\n{stderr[-3000:]}"

    runs = [json.loads(p.read_text()) for p in reports.glob("*.json")]
    ranks = [r for r in runs if r["argv"] and r["argv"][0].endswith("train.py")]
    assert sorted(r["rank"] for r in ranks) == ["0", "1"], runs
    for run in runs:  # the launcher and both ranks
        assert run["importable"] == [] and run["loaded"] == [], run
    for run in ranks:
        assert run["runtime"] == str(work / VENDORED_FILE)
    assert stdout.count("Test set:") == 1  # trained, evaluated, printed once (rank 0)
