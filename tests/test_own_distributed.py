"""Scripts with their own distributed path (issue 18 item 4): `--world-size`/`--rank`/`--dist-url`
(the ImageNet recipe), a `--distributed` store_true flag, `--local_rank`/`n_gpu` (the 2019
transformers examples). Under torchrun each must end up data-parallel: one model on every rank
(every optimizer's parameters identical after its last step) trained on disjoint shards (each
rank draws half of each epoch), or say in one line what to pass.

The fixtures are fixtures/scripts/{imagenet_distributed,distributed_flag,hf_local_rank}.py; their
goldens, idempotence and one-process runs are tests/test_fixtures.py's.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import List

import libcst as cst
import pytest
import torch

from gpumigrate.analysis import script_model
from gpumigrate.analysis.launch import Torchrun
from gpumigrate.rewriter.engine import FileContext
from gpumigrate.rewriter.names import ImportTable
from tests.conftest import FIXTURES, migrate
from tests.probe_runs import NPROC, Run, run_probe
from tests.test_ddp_e2e import check_training_shards

GOLDENS = FIXTURES / "expected" / "ddp"
TOL = 1e-6
WRAP = re.compile(r"\bwrap_model\(")


# ---------------------------------------------------------------- conditions under torchrun

def _truth(code: str, env_defaults: bool = True):
    """Torchrun's truth of the test of the file's last `if`."""
    code = textwrap.dedent(code)
    module = cst.parse_module(code)
    model = script_model(FileContext(module, "script.py", code, ImportTable(module)))
    test = [n for n in model.s.index.order if isinstance(n, cst.If)][-1].test
    return Torchrun(model, env_defaults).truth(test)


ARGS = """\
import argparse, os
import torch
import torch.distributed as dist
parser = argparse.ArgumentParser()
parser.add_argument('--world-size', default=-1, type=int)
parser.add_argument('--local_rank', type=int, default=-1)
parser.add_argument('--distributed', action='store_true')
parser.add_argument('--gpu', default=None, type=int)
args = parser.parse_args()
dist.init_process_group('nccl')
"""


@pytest.mark.parametrize("test, truth", [
    ("args.world_size > 1", True),                         # --world-size defaults to WORLD_SIZE (>= 2)
    ("args.local_rank != -1", True),                       # --local_rank defaults to LOCAL_RANK (>= 0)
    ("args.local_rank == -1", False),
    ("args.local_rank in [-1, 0]", None),                  # rank 0 only: not every rank
    ("args.distributed", False),                           # store_true, not passed
    ("not args.distributed or dist.get_rank() == 0", True),
    ("args.gpu is not None", False),
    ("int(os.environ.get('WORLD_SIZE', 1)) > 1", True),
    ("'WORLD_SIZE' in os.environ", True),
    ("dist.is_available() and dist.is_initialized()", True),
    ("torch.cuda.is_available()", None),
    ("__name__ == '__main__'", True),
])
def test_a_condition_under_torchrun(test, truth):
    assert _truth(ARGS + f"if {test}:\n    pass\n") is truth


def test_attributes_follow_what_the_script_assigns():
    imagenet = ARGS + textwrap.dedent("""\
        parser.add_argument('--dist-url', default='tcp://224.66.41.62:23456')
        parser.add_argument('--multiprocessing-distributed', action='store_true')
        if args.dist_url == "env://" and args.world_size == -1:
            args.world_size = int(os.environ["WORLD_SIZE"])
        args.distributed = args.world_size > 1 or args.multiprocessing_distributed
        if args.distributed:
            pass
        """)
    assert _truth(imagenet) is True
    assert _truth(imagenet, env_defaults=False) is False  # without GM405: -1 > 1
    apex = ARGS + textwrap.dedent("""\
        args.distributed = False
        if 'WORLD_SIZE' in os.environ:
            args.distributed = int(os.environ['WORLD_SIZE']) > 1
        if args.distributed:
            pass
        """)
    assert _truth(apex) is True  # the last assignment that runs
    config = ARGS + textwrap.dedent("""\
        args.__dict__.update(load_config())
        if args.distributed:
            pass
        """)
    assert _truth(config) is None  # a config may set anything


# ---------------------------------------------------------------- the migration

def _migrated(name: str):
    return migrate((FIXTURES / "scripts" / name).read_bytes(), "ddp", name)


def _review(result) -> List[str]:
    return [f.message for f in result.findings if f.review]


def test_imagenet_script_takes_its_own_path_under_torchrun():
    result = _migrated("imagenet_distributed.py")
    text = result.new_source.decode()
    assert "parser.add_argument('--world-size', default=int(os.environ.get(\"WORLD_SIZE\", -1)), type=int," in text
    assert "parser.add_argument('--rank', default=int(os.environ.get(\"RANK\", -1)), type=int," in text
    # its own DDP and DistributedSampler apply: nothing of ours on top, nothing to say about it
    assert "shard_loader" not in text and len(WRAP.findall(text)) == 1  # its device_ids DDP, for CPUs
    assert not [r for r in _review(result) if re.search(r"own distributed path|custom sampler|GPU chosen", r)]


def test_store_true_flag_is_wrapped_and_sharded_on_either_path_and_said_once():
    result = _migrated("distributed_flag.py")
    text = result.new_source.decode()
    assert "loader = shard_loader(DataLoader(" in text
    assert "\n    model = wrap_model(model)\n    optimizer" in text
    said = [r for r in _review(result) if "own distributed path" in r]
    assert said == [said[0]] and "pass `--distributed` under torchrun" in said[0], _review(result)
    assert not [r for r in _review(result) if "custom sampler" in r]


def test_transformers_script_keeps_its_own_wrap_and_sampler():
    result = _migrated("hf_local_rank.py")
    text = result.new_source.decode()
    assert 'default=int(os.environ.get("LOCAL_RANK", -1))' in text
    assert "model = wrap_model(model, find_unused_parameters=True)" in text  # its own, runs on CPUs too
    assert len(WRAP.findall(text)) == 1 and "shard_loader" not in text  # no second wrap in main()
    assert "        set_epoch(train_dataloader, epoch)\n" in text  # its DistributedSampler needs one too
    assert not [r for r in _review(result) if re.search(r"own distributed path|custom sampler", r)]


def test_a_rank_that_is_no_process_rank_is_left_alone():
    source = ARGS.replace("--world-size", "--rank").replace("default=-1, type=int)", "default=8, type=int)")
    result = migrate(source.encode(), "ddp")
    assert "'--rank', default=8" in (result.new_source or result.source).decode()


# ---------------------------------------------------------------- under torchrun

_RUNS: dict[tuple, Run] = {}  # (name, args) -> Run: this module's tests stay on one worker (--dist loadfile)


def _torchrun(name: str, tmp_path: Path, args=()) -> Run:
    """Each (golden, arguments) is launched once: the flag test reads the two runs of
    distributed_flag.py that test_data_parallel_under_torchrun checks."""
    key = (name, tuple(args))
    if key not in _RUNS:
        _RUNS[key] = run_probe(GOLDENS / name, tmp_path / "torchrun", NPROC, list(args), kind="torchrun")
    run = _RUNS[key]
    assert run.ok(), run.why()
    return run


def _assert_data_parallel(run: Run) -> None:
    """One model on every rank, trained on each rank's own half of the data."""
    optimizers = run.ranks[0]["optimizers"]
    assert optimizers, "no optimizer was built"
    for i, entry in enumerate(optimizers):
        assert entry["steps_that_changed_parameters"] > 0, f"optimizer {i} never changed a parameter"
        for rank in range(1, NPROC):
            diff = (run.optim_vector(rank, i) - run.optim_vector(0, i)).abs().max().item()
            assert diff <= TOL, f"optimizer {i}: rank {rank} differs from rank 0 by {diff:g}: each rank trained alone"
    check_training_shards([run.ranks[r] for r in range(NPROC)])
    assert all(run.ranks[r]["stdout"] == "" for r in range(1, NPROC)), "rank 1 printed"


@pytest.mark.e2e
@pytest.mark.ddp
@pytest.mark.parametrize("name, args", [
    ("imagenet_distributed.py", []),
    ("hf_local_rank.py", ["--do_train", "--do_eval"]),
    ("distributed_flag.py", []),
    ("distributed_flag.py", ["--distributed"]),
], ids=["imagenet", "transformers", "flag-not-passed", "flag-passed"])
def test_data_parallel_under_torchrun(name, args, tmp_path):
    run = _torchrun(name, tmp_path, args)
    _assert_data_parallel(run)
    assert run.stdout.strip(), "rank 0 printed nothing"


@pytest.mark.e2e
@pytest.mark.ddp
def test_the_flag_changes_the_path_not_the_training(tmp_path):
    """With or without `--distributed` the ranks train the same model on the same shards."""
    without = _torchrun("distributed_flag.py", tmp_path / "without")
    with_flag = _torchrun("distributed_flag.py", tmp_path / "with", ["--distributed"])
    assert torch.equal(without.optim_vector(0, 0), with_flag.optim_vector(0, 0))
    assert without.stdout == with_flag.stdout
