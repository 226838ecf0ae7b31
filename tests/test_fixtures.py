"""Whole-script fixtures: golden outputs, idempotence, untouched lines, and the migrated
scripts really running on this CPU-only machine.

Regenerate the goldens after an intended change with `GPUMIGRATE_UPDATE_GOLDENS=1 pytest`,
then read the diff before committing it.
"""

import ast
import difflib
import math
import os
import re
import shutil

import pytest

from gpumigrate.codemods import select
from tests.conftest import FIXTURES, lint, migrate, run_script

SCRIPTS = sorted((FIXTURES / "scripts").glob("*.py"))
TARGET = "device"
TARGETS = ("device", "ddp")
# Originals that run on a CPU as they are (no `.data[0]`, no `async=`, CUDA only if present):
# their migrated versions must print exactly the same losses.
# (`mem_fp16_batchnorm.py` runs too, but BatchNorm in float32 rightly changes its numbers.)
RUNS_ON_CPU = {"agnostic.py": [], "dcgan_gan.py": [], "mnist_2019.py": ["--no-cuda"], "mem_total_loss.py": [],
               "mem_loss_logger.py": [], "mem_eval_no_grad.py": [], "mem_oom_skip.py": [], "eval_only.py": [],
               "distributed_flag.py": [], "hf_local_rank.py": ["--do_train", "--do_eval"]}
# Scripts the device target must leave byte for byte as they are (with only report-only
# findings). A `torch.device("cuda" if torch.cuda.is_available() else "cpu")` script is not
# device-agnostic: it takes the CPU on a Mac, and becomes `get_device()`.
UNCHANGED = {"already_agnostic.py": "no findings"}
NUMBER = re.compile(r"-?\d+\.\d+(?:e[-+]?\d+)?")
# ddp goldens that tests/test_ddp_e2e.py and tests/test_patterns_e2e.py run in one process too
RUN_ELSEWHERE = {"mnist_2019.py", "resnet_dataparallel.py", "dcgan_gan.py", "checkpoint_resume.py",
                 "local_rank_launch.py", "ssd_iterations.py", "classifier_meters.py", "config_finetune.py",
                 "functional_maml.py", "wordlm_batches.py", "run_dir_main.py",
                 # issue 31's shapes: tests/test_first_contact.py runs their ddp goldens in one process too
                 "loader_kwargs.py", "train_accuracy_pass.py", "optimizer_helper.py", "random_iterations.py",
                 "gan_generator_fed.py", "rl_actor_critic.py", "mp_spawn_launcher.py", "device_late_binding.py",
                 "partial_batches.py", "makedirs_try.py", "td3_two_heads.py", "inline_eval_loader.py",
                 "val_loss_counter.py", "progress_bar_read.py", "relayed_loader_steps.py",
                 "agents_in_a_list.py", "logging_setup.py", "launch_flag_finetune.py",
                 "own_ddp_class.py", "next_relay_bar.py",
                 "bar_bound_loader.py", "rank_zero_eval.py", "full_batch_density.py",
                 "generator_own_loader.py"}


# The amp migrations' goldens: every mixed-precision fixture, and older fixtures with `.half()`
# training or a GAN (their amp runs are in tests/test_amp_e2e.py).
AMP_SCRIPTS = sorted((FIXTURES / "scripts").glob("amp_*.py")) + [
    FIXTURES / "scripts" / n for n in ("mem_fp16_batchnorm.py", "dcgan_gan.py", "checkpoint_resume.py")]
AMP_TARGETS = ("amp", "ddp,amp")


# The fsdp migrations' goldens: the fixtures whose models have repeated blocks, and the 2018
# word language model and an mnist script (their torchrun runs are in tests/test_fsdp_e2e.py).
FSDP_SCRIPTS = [FIXTURES / "scripts" / n for n in ("transformer_blocks.py", "wordlm_batches.py", "mnist_2019.py",
                                                    "resnet_dataparallel.py", "local_rank_launch.py")]


def golden(script, target=TARGET):
    return FIXTURES / "expected" / target / script.name


@pytest.mark.parametrize("target", AMP_TARGETS)
@pytest.mark.parametrize("amp_script", AMP_SCRIPTS, ids=lambda p: p.name)
@pytest.mark.slow
def test_amp_golden_and_idempotent(amp_script, target):
    result = migrate(amp_script.read_bytes(), target, str(amp_script))
    assert result.error is None
    assert result.changed
    path = golden(amp_script, target)
    if os.environ.get("GPUMIGRATE_UPDATE_GOLDENS"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(result.new_source)
    assert result.new_source == path.read_bytes()
    compile(result.new_source, str(path), "exec")
    tree = ast.parse(result.new_source)
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names] + \
        [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [name for name in imported if name.split(".")[0] == "apex" or name.startswith("torch.cuda.amp")]
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and (
        n.attr == "half" and f"{ast.unparse(n)}(" in result.new_source.decode() or  # `.half(`, not `args.half`
        n.attr == "amp" and ast.unparse(n.value) == "torch.cuda")]
    assert not [f for f in result.findings if f.review and f.code.startswith("GM5")], "amp needs a human decision"
    again = migrate(result.new_source, target, str(amp_script))
    assert again.error is None and again.new_source is None, "a second run changed the file"


@pytest.mark.parametrize("fsdp_script, target", [*((s, "fsdp") for s in FSDP_SCRIPTS),
                                                  (FIXTURES / "scripts" / "transformer_blocks.py", "fsdp,amp")],
                         ids=lambda p: getattr(p, "name", p))
def test_fsdp_golden_and_idempotent(fsdp_script, target):
    result = migrate(fsdp_script.read_bytes(), target, str(fsdp_script))
    assert result.error is None and result.changed
    path = golden(fsdp_script, target)
    if os.environ.get("GPUMIGRATE_UPDATE_GOLDENS"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(result.new_source)
    assert result.new_source == path.read_bytes()
    text = result.new_source.decode()
    assert "shard_model(" in text and not re.search(r"\bwrap_model\(", text)
    assert ("mixed_precision=True" in text) == ("amp" in target)  # the shards follow autocast's precision
    again = migrate(result.new_source, target, str(fsdp_script))
    assert again.error is None and again.new_source is None, "a second run changed the file"


@pytest.fixture(params=SCRIPTS, ids=lambda p: p.name)
def script(request):
    return request.param


@pytest.mark.parametrize("target", TARGETS)
def test_golden(script, target):
    result = migrate(script.read_bytes(), target, str(script))
    assert result.error is None
    out = result.new_source if result.new_source is not None else result.source
    path = golden(script, target)
    if os.environ.get("GPUMIGRATE_UPDATE_GOLDENS"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(out)
    assert out == path.read_bytes()
    compile(out, str(path), "exec")
    if target != TARGET:
        return
    if script.name in UNCHANGED:
        assert result.new_source is None
        assert all(not f.fixed for f in result.findings)
        assert bool(result.findings) == (UNCHANGED[script.name] == "review only")
    else:
        assert result.changed


def test_lint_golden(script):
    """`gpumigrate lint` finds exactly the expected codes at the expected places."""
    result = lint(script.read_bytes(), select([], []), str(script))
    assert result.error is None
    found = "".join(f"{f.line}:{f.col + 1}: {f.code}\n" for f in result.findings)
    path = FIXTURES / "expected" / "lint" / (script.stem + ".txt")
    if os.environ.get("GPUMIGRATE_UPDATE_GOLDENS"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(found)
    assert found == path.read_text()


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.slow
def test_idempotent(script, target):
    once = golden(script, target).read_bytes()
    again = migrate(once, target, str(script))
    assert again.error is None
    assert again.new_source is None, "a second run changed the file"
    assert not [f for f in again.findings if f.fixed]


@pytest.mark.slow
def test_only_flagged_lines_change(script):
    """Untouched code keeps its bytes: every original line that changed lies in code where a
    fix was reported (or is an import the fixes made unused)."""
    source = script.read_bytes()
    result = migrate(source, TARGET, str(script))
    old = source.splitlines(keepends=True)
    new = (result.new_source or source).splitlines(keepends=True)
    fixed = [(f.line, f.end_line) for f in result.findings if f.fixed]
    matcher = difflib.SequenceMatcher(a=old, b=new, autojunk=False)
    for tag, i1, i2, _, _ in matcher.get_opcodes():
        if tag in ("replace", "delete"):
            for line in range(i1 + 1, i2 + 1):
                if old[line - 1].lstrip().startswith((b"import ", b"from ")):
                    continue  # an import the fixes made unused
                assert any(start <= line <= end for start, end in fixed), f"line {line} changed with no fix there"


@pytest.mark.e2e
@pytest.mark.parametrize("target", TARGETS)
def test_migrated_script_runs_on_cpu(script, target, tmp_path):
    """Every golden runs as `python script.py` here (the ddp ones under torchrun too: see
    test_ddp_e2e.py and test_patterns_e2e.py, which also run them in one process); where the
    original runs, the migrated script prints what it prints."""
    if target == "ddp" and script.name in RUN_ELSEWHERE and script.name not in RUNS_ON_CPU:
        pytest.skip("run in one process, with more checks, by the ddp end-to-end tests")
    if _imports_apex(golden(script, target)):
        pytest.skip("imports apex, which only --to amp removes (tests/test_amp_e2e.py runs those)")
    migrated = tmp_path / script.name
    shutil.copy(golden(script, target), migrated)
    args = RUNS_ON_CPU.get(script.name, [])
    done = run_script(migrated, args, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip(), "the script printed nothing"
    if script.name in RUNS_ON_CPU:  # in one process the ddp helpers change nothing either
        before = _original_run(script, tmp_path)
        assert before.returncode == 0, before.stderr[-2000:]
        assert_same_output(done.stdout, before.stdout)


def _imports_apex(path) -> bool:
    tree = ast.parse(path.read_bytes())
    return any((n.module or "").split(".")[0] == "apex" if isinstance(n, ast.ImportFrom) else
               any(a.name.split(".")[0] == "apex" for a in n.names)
               for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)))


_ORIGINAL_RUNS = {}


def _original_run(script, tmp_path):
    """The original's own run, once per session (both targets compare against it)."""
    if script.name not in _ORIGINAL_RUNS:
        original = tmp_path / f"original_{script.name}"
        shutil.copy(script, original)
        _ORIGINAL_RUNS[script.name] = run_script(original, RUNS_ON_CPU[script.name], cwd=tmp_path)
    return _ORIGINAL_RUNS[script.name]


def assert_same_output(after: str, before: str) -> None:
    """Same lines; numbers equal to float32 precision (`.item()` sums in float64 where the
    original summed float32 tensors, so a 6th decimal may move)."""
    assert NUMBER.sub("#", after) == NUMBER.sub("#", before)
    for a, b in zip(NUMBER.findall(after), NUMBER.findall(before)):
        assert math.isclose(float(a), float(b), rel_tol=1e-5, abs_tol=1e-6), (a, b)


def test_original_cannot_run_where_migrated_can():
    """The point of the fixtures: the 2018 originals fail on today's torch/CPU."""
    done = run_script(FIXTURES / "scripts" / "async_copy.py")
    assert done.returncode != 0 and "SyntaxError" in done.stderr
