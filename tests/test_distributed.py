"""The ddp migration's decisions, one at a time: what it edits, and what it reports instead."""

import textwrap

import pytest

from tests.conftest import migrate

HEAD = """\
import torch
from torch.utils.data import DataLoader, TensorDataset
train_set = TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
"""


def ddp(code: str, head: str = HEAD, notes: bool = False):
    """The migrated source and its review items (and, `notes`, what it says it did)."""
    source = head + textwrap.dedent(code)
    result = migrate(source.encode(), "ddp")
    assert result.error is None, result.error
    out = (result.new_source or result.source).decode()
    compile(out, "x.py", "exec")
    again = migrate(out.encode(), "ddp")
    assert again.error is None and again.new_source is None, "not idempotent"
    reviews = [f.message for f in result.findings if not f.fixed]
    if notes:
        return out, reviews, [f.message for f in result.findings if f.fixed]
    return out, reviews


AVERAGED = "averaged across ranks at each optimizer step"


TRAIN = """\
loader = DataLoader(train_set, batch_size=4, shuffle=True)
for epoch in range(2):
    for x, y in loader:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
"""


def test_a_model_trained_by_a_factory_optimizer_is_wrapped_and_its_data_sharded():
    out, _ = ddp("model = torch.nn.Linear(4, 1)\nopt = getattr(torch.optim, 'SGD')(model.parameters(), lr=0.1)\n"
                 + TRAIN)
    assert "model = wrap_model(model)\nopt = getattr" in out
    assert "sampler=distributed_sampler(train_set)" in out and "set_epoch(loader, epoch)" in out


def test_a_functional_model_is_sharded_and_averaged_at_the_step():
    out, reviews, notes = ddp("params = [torch.zeros(4, 1, requires_grad=True)]\n"
                              "opt = torch.optim.SGD(params, lr=0.1)\nmodel = lambda x: x @ params[0]\n" + TRAIN,
                              notes=True)
    assert "sampler=distributed_sampler(train_set)" in out and "wrap_model" not in out
    assert any("not a module" in n and AVERAGED in n for n in notes)
    assert not any("NOT sharded" in r for r in reviews)


def test_a_loss_module_is_never_wrapped():
    out, reviews, notes = ddp("model, crit = torch.nn.Linear(4, 1), torch.nn.MSELoss()\n"
                              "opt = torch.optim.SGD(list(model.parameters()) + list(crit.parameters()), lr=0.1)\n"
                              "for x, y in DataLoader(train_set):\n    crit(model(x), y).backward()\n    opt.step()\n",
                              notes=True)
    assert "wrap_model(model)" in out and "wrap_model(crit" not in out
    assert any("loss module" in n and AVERAGED in n for n in notes)


def test_the_wrap_follows_the_move_to_the_device_and_a_rebinding():
    out, _ = ddp("model = torch.nn.Linear(4, 1)\nprint(sum(p.numel() for p in model.parameters()))\n"
                 "model = torch.load('pretrained.pt')\nmodel.cuda()\n"
                 "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n" + TRAIN)
    assert "model.to(device)\nmodel = wrap_model(model)\nopt =" in out


def test_a_users_own_wrap_model_keeps_its_name_and_ours_is_aliased():
    out, _ = ddp("def wrap_model(m):\n    return m\nmodel = wrap_model(torch.nn.Linear(4, 1))\n"
                 "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n" + TRAIN)
    assert "wrap_model as gm_wrap_model" in out and "model = gm_wrap_model(model)" in out


def test_evaluation_kept_in_a_metric_object_is_not_sharded():
    code = TRAIN + textwrap.dedent("""\
    class Meter:
        def __init__(self):
            self.n = 0
        def update(self, k):
            self.n += k
    val = DataLoader(train_set, batch_size=4)
    m = Meter()
    with torch.no_grad():
        for x, y in val:
            m.update(len(x))
    print(m.n)
    """)
    out, reviews = ddp("model = torch.nn.Linear(4, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                       + textwrap.dedent(code))
    assert "val = DataLoader(train_set, batch_size=4)\n" in out and "reduce_sum" not in out
    assert any("evaluation not sharded" in r for r in reviews)


def test_evaluation_sums_are_sharded_and_reduced():
    code = TRAIN + textwrap.dedent("""\
    val = DataLoader(train_set, batch_size=4)
    n = 0
    for x, y in val:
        n += len(x)
    print(n)
    """)
    out, _ = ddp("model = torch.nn.Linear(4, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                 + textwrap.dedent(code))
    assert "distributed_sampler(train_set, shuffle=False, pad=False)" in out
    assert "    n += len(x)\nn = reduce_sum(n)\nif is_main_process():\n    print(n)" in out


def test_no_collective_in_a_helper_called_from_rank_zero_output():
    out, _ = ddp("""\
        import time
        class Timer:
            def tic(self):
                self.t = time.time()
            def toc(self):
                return time.time() - self.t
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        t = Timer()
        for x, y in DataLoader(train_set, shuffle=True):
            t.tic()
            model(x).sum().backward()
            opt.step()
            print('step', t.toc())
        """)
    assert "broadcast_object" not in out
    assert "    if is_main_process():\n        print('step', t.toc())" in out


def test_a_run_directory_is_agreed_on_after_setup():
    out, _ = ddp("""\
        import os, random
        def train(d):
            model = torch.nn.Linear(4, 1)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for x, y in DataLoader(train_set, shuffle=True):
                model(x).sum().backward()
                opt.step()
        if __name__ == '__main__':
            run_dir = os.path.join('runs', str(random.randint(0, 999)))
            os.makedirs(run_dir)
            train(run_dir)
        """, head="import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n"
                  "train_set = TensorDataset(torch.randn(16, 4), torch.randn(16, 1))\n")
    assert ("    run_dir = broadcast_object(os.path.join('runs', str(random.randint(0, 999))))\n"
            "    if is_main_process():\n        os.makedirs(run_dir)") in out
    assert out.index("setup_distributed()\n") < out.index("broadcast_object(os")


def test_a_rank_local_early_stop_is_reported():
    _, reviews = ddp("""\
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in DataLoader(train_set, shuffle=True):
            loss = model(x).sum()
            loss.backward()
            opt.step()
            if loss.item() < 0.1:
                break
        """)
    assert any("loop exit decided on a rank-local value" in r for r in reviews)


def test_iteration_based_training_reshuffles_when_the_iterator_restarts():
    out, reviews = ddp("""\
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = DataLoader(train_set, batch_size=4, shuffle=True)
        epoch_size = len(train_set) // 4
        for it in range(20):
            if it % epoch_size == 0:
                batches = iter(loader)
            x, y = next(batches)
            model(x).sum().backward()
            opt.step()
        """)
    assert "epoch_size = shard_length(train_set) // 4" in out
    assert "        set_epoch(loader)\n        batches = iter(loader)" in out
    assert any("iteration-based" in r for r in reviews)


def test_a_script_without_training_gets_only_the_device_changes():
    out, reviews = ddp("model = torch.nn.Linear(4, 1).cuda()\nfor x, y in DataLoader(train_set):\n"
                       "    print(model(x.cuda()))\n")
    assert "setup_distributed" not in out and "is_main_process" not in out and ".to(device)" in out
    assert any("no training found" in r for r in reviews)


def test_a_library_trainer_given_the_scripts_optimizer_is_averaged_at_its_steps():
    """No backward here: ignite's trainer (or any library's) steps the script's optimizer. The
    group is set up, the model wrapped, the training loader sharded, and the review says so."""
    out, reviews = ddp("""\
        from ignite.engine import create_supervised_trainer
        model = torch.nn.Linear(4, 1).cuda()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        train_loader = DataLoader(train_set, batch_size=4, shuffle=True)
        trainer = create_supervised_trainer(model, optimizer, torch.nn.MSELoss(), device="cuda")
        trainer.run(train_loader, max_epochs=2)
        torch.save(model.state_dict(), "model.pt")
        """)
    assert "setup_distributed()" in out and "model = wrap_model(model)" in out
    assert "sampler=distributed_sampler(train_set)" in out and "if is_main_process():\n    torch.save(" in out
    assert any("the training loop is a library's" in r and "distributed_sampler" in r for r in reviews), reviews
    assert not any("no training found" in r for r in reviews)


def test_a_module_without_torch_is_left_alone():
    source = "import sys\n\ndef main():\n    print(sys.argv)\n\nif __name__ == '__main__':\n    main()\n"
    assert migrate(source.encode(), "ddp").new_source is None


@pytest.mark.parametrize("line, reported", [
    ('device = torch.device("cuda", args.gpu)', True),
    ('device = torch.device("cuda:1")', True),
    ('device = torch.device("cuda:0")', False),
    ('device = torch.device("cuda", args.local_rank)', False),
])
def test_a_gpu_chosen_by_index_is_kept_and_reported(line, reported):
    out, reviews = ddp(line + "\nmodel = torch.nn.Linear(4, 1).to(device)\n"
                       "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n" + TRAIN)
    assert any("chosen by index" in r for r in reviews) is reported


def test_per_rank_files_stay_per_rank():
    out, _ = ddp("import os\nmodel = torch.nn.Linear(4, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                 + TRAIN + "with open('w%s.txt' % os.environ.get('RANK', '0'), 'w') as f:\n    f.write('x')\n")
    assert "with open('w%s.txt' % os.environ.get('RANK', '0'), 'w') as f:\n    f.write('x')\n" in out


def test_outputs_opened_for_writing_go_to_devnull_on_other_ranks():
    out, _ = ddp("import csv\nmodel = torch.nn.Linear(4, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                 "log = open('log.csv', 'w'); writer = csv.writer(log)\n" + TRAIN + "writer.writerow([1])\n")
    assert "log = open('log.csv' if is_main_process() else os.devnull, 'w')" in out
    assert "\nwriter.writerow([1])" in out  # it writes to os.devnull on the other ranks: no gate


def test_a_gradient_penalty_keeps_models_unwrapped_and_is_averaged_at_the_step():
    out, reviews = ddp("""\
        D = torch.nn.Linear(4, 1)
        opt = torch.optim.Adam(D.parameters())
        for x, y in DataLoader(train_set, shuffle=True):
            inter = x.requires_grad_()
            grads = torch.autograd.grad(D(inter).sum(), inter, create_graph=True)[0]
            (D(x).mean() + grads.norm()).backward()
            opt.step()
        """, notes=True)[::2]
    assert "wrap_model" not in out and "distributed_sampler(" in out
    assert any("DDP does not support" in n and AVERAGED in n for n in reviews)


@pytest.mark.parametrize("test, unused", [("self.downsample", False), ("x.sum() > 0", True)])
def test_find_unused_parameters_only_for_branches_on_the_input(test, unused):
    out, _ = ddp(textwrap.dedent(f"""\
        class Block(torch.nn.Module):
            def __init__(self, downsample=None):
                super().__init__()
                self.fc = torch.nn.Linear(4, 1)
                self.extra = torch.nn.Linear(4, 1)
                self.downsample = downsample
            def forward(self, x):
                if {test}:
                    return self.extra(x)
                return self.fc(x)
        model = Block()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        """) + TRAIN)
    assert ("find_unused_parameters=True" in out) is unused


def test_helpers_from_the_projects_other_files_are_reported_in_loops():
    _, reviews = ddp("from utils import progress_bar\nmodel = torch.nn.Linear(4, 1)\n"
                     "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n" + TRAIN + "        progress_bar(epoch)\n")
    assert any("`utils.progress_bar` comes from another file" in r for r in reviews)


def test_a_model_passed_through_mutually_recursive_helpers_is_found_in_one_walk():
    # Each helper calls every other: 8! paths from the save back to the wrap. A walk per path
    # (as once) never finished; one walk over the calls finds the wrapped model.
    n = 8
    helpers = "".join(
        f"def h{i}(m, k):\n    if k:\n" + "".join(f"        h{j}(m, k - 1)\n" for j in range(n) if j != i)
        + ("    torch.save(m.state_dict(), 'm.pt')\n" if i == n - 1 else "") for i in range(n))
    out, _ = ddp("model = torch.nn.Linear(4, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n" + TRAIN
                 + helpers + "h0(model, 1)\n")
    assert "torch.save(unwrap_model(m).state_dict(), 'm.pt')" in out


def test_a_script_joining_the_group_itself_does_so_only_where_setup_did_not():
    out, _ = ddp("import torch.distributed as dist\nimport os\n"
                 "if int(os.environ.get('WORLD_SIZE', 1)) > 1:\n"
                 "    dist.init_process_group(backend='nccl', init_method='env://')\n"
                 "model = torch.nn.Linear(4, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n" + TRAIN)
    # (its hard-coded NCCL follows the device: GM417)
    assert "    if not dist.is_initialized():\n        dist.init_process_group(backend=distributed_backend()" in out


def test_a_script_that_distributes_itself_under_torchrun_keeps_its_path():
    """Its group, its DDP wrap and its sampler where torchrun runs it as written: no second
    group, no second wrap, the device changes only, and one note with the launch command."""
    source = HEAD + textwrap.dedent("""\
        import os
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        from torch.utils.data.distributed import DistributedSampler
        ddp = int(os.environ.get('RANK', -1)) != -1
        if ddp:
            dist.init_process_group(backend='gloo')
        model = torch.nn.Linear(4, 1)
        if ddp:
            model = DDP(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sampler = DistributedSampler(train_set) if ddp else None
        for epoch in range(2):
            for x, y in DataLoader(train_set, batch_size=4, sampler=sampler):
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
            print(epoch)
        """)
    result = migrate(source.encode(), "ddp")
    assert result.error is None and result.new_source is None  # nothing of theirs to change
    notes = [f.message for f in result.findings if f.note]
    assert len(notes) == 1 and "joins the process group itself" in notes[0] and "torchrun --nproc_per_node" in notes[0]


LAUNCHED = """\
import fire


def demo(save='out', epochs=2):
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(train_set, batch_size=4, shuffle=True)
    for epoch in range(epochs):
        for x, y in loader:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        torch.save(model.state_dict(), save + '/model.dat')
    model.load_state_dict(torch.load(save + '/model.dat'))


if __name__ == '__main__':
    {launch}
"""


def test_a_function_handed_once_to_a_launcher_runs_once_per_rank():
    """`fire.Fire(demo)`: every rank runs demo once, so the save in its loop is followed by a
    barrier before the load reads the file back (practice corpus: efficient_densenet's demo.py,
    where rank 1 read the checkpoint before rank 0 wrote it)."""
    out, reviews = ddp(LAUNCHED.format(launch="fire.Fire(demo)"))
    assert "            torch.save(unwrap_model(model).state_dict(), save + '/model.dat')\n        barrier()\n" in out
    assert not any("no barrier was added" in r for r in reviews)


@pytest.mark.parametrize("launch", ["for seed in range(2):\n        fire.Fire(demo)",
                                    "fire.Fire(demo)\n    fire.Fire(demo)",
                                    "if args.rank == 0:\n        fire.Fire(demo)"])
def test_a_function_launched_any_other_way_is_not_taken_as_once_per_rank(launch):
    out, reviews = ddp(LAUNCHED.format(launch=launch))
    assert "barrier()" not in out
    assert any("no barrier was added" in r for r in reviews)


WRITER = """\
import os
from torch.utils.tensorboard import SummaryWriter


class Runner:
    def __init__(self, model, opt):
        self.model, self.opt = model, opt
        self.writer = SummaryWriter()
        {use}

    def train(self, loader):
        for step, (x, y) in enumerate(loader):
            self.opt.zero_grad()
            loss = torch.nn.functional.mse_loss(self.model(x), y)
            loss.backward()
            self.opt.step()
            self.writer.add_scalar('loss', loss.item(), step)


model = torch.nn.Linear(4, 1)
Runner(model, torch.optim.SGD(model.parameters(), lr=0.1)).train(DataLoader(train_set, batch_size=4))
"""


def test_a_writer_read_on_every_rank_stays_on_every_rank():
    """Practice corpus (SimCLR): `self.writer.log_dir` read in __init__ on every rank; a writer
    made on rank 0 only is None there."""
    out, _, notes = ddp(WRITER.format(use="self.log = os.path.join(self.writer.log_dir, 'train.log')"), notes=True)
    assert "        self.writer = SummaryWriter()\n" in out
    assert "            if is_main_process():\n                self.writer.add_scalar(" in out
    assert any("`self.writer.log_dir` is read outside its writes" in n for n in notes)


def test_a_writer_with_a_directory_handed_on_is_muted_on_the_other_ranks(tmp_path):
    """Practice corpus (an RL agent): `writer = SummaryWriter(log_path)` handed to `agent.train`,
    which writes from a sibling module. Kept real on every rank, rank 1 wrote a second copy of
    the events and raced rank 0 to make the directory (tensorboardX: FileExistsError)."""
    src = WRITER.replace("SummaryWriter()", "SummaryWriter(log_dir='runs/a')").format(use="report(self.writer)")
    out, _, notes = ddp(src, notes=True)
    assert "self.writer = SummaryWriter(log_dir='runs/a') if is_main_process() else muted_writer(log_dir='runs/a')" in out
    assert any("the other ranks get one that writes nothing" in n for n in notes)
    # what the other ranks hold: its directory, and every method a no-op
    from gpumigrate.runtime import muted_writer
    for writer in (muted_writer(str(tmp_path / "w")), muted_writer(log_dir=str(tmp_path / "w")),
                   muted_writer(logdir=str(tmp_path / "w"), flush_secs=5)):
        assert writer.log_dir == writer.get_logdir() == str(tmp_path / "w")
        with writer as w:
            assert w.add_scalar("loss", 1.0, 0) is None and w.flush() is None
    assert not (tmp_path / "w").exists()


def test_a_writer_only_written_to_is_made_on_rank_0():
    out, _ = ddp(WRITER.format(use="pass"))
    assert "self.writer = SummaryWriter() if is_main_process() else None" in out


PLOTS = """\
import os
import imageio
import matplotlib.pyplot as plt

if not os.path.isdir('results'):
    os.mkdir('results')
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(train_set, batch_size=4, shuffle=True)
for epoch in range(2):
    for x, y in loader:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    plt.plot([epoch])
    plt.savefig('results/epoch_%d.png' % epoch)
{end}
"""


def test_files_read_back_are_waited_for_and_the_folder_test_is_rank_0s():
    """Practice corpus (a DCGAN that makes a GIF of its epoch images at the end): rank 1 read
    an image rank 0 had not written yet. The folder test would let rank 1 skip a barrier that
    rank 0 waits in: rank 0 decides it for all."""
    out, _ = ddp(PLOTS.format(end="images = [imageio.imread('results/epoch_%d.png' % e) for e in range(2)]"))
    assert "if broadcast_object(not os.path.isdir('results')):\n    if is_main_process():\n" \
           "        os.mkdir('results')\n    barrier()\n" in out
    assert "    if is_main_process():\n        plt.savefig('results/epoch_%d.png' % epoch)\n    barrier()\n" in out


def test_files_never_read_back_need_no_barrier():
    out, _ = ddp(PLOTS.format(end="print('done')"))
    assert "barrier" not in out and "broadcast_object" not in out


GLOB_CLEANUP = """\
import glob, os
import torch
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = torch.utils.data.DataLoader(train_set, batch_size=4, shuffle=True)
best_epoch = 0
for epoch in range(3):
    for x, y in loader:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    torch.save(model.state_dict(), '{}.pkl'.format(epoch))
    files = glob.glob('*.pkl')
    for file in files:
        if int(file.split('.')[0]) < best_epoch:
            os.remove(file)
model.load_state_dict(torch.load('{}.pkl'.format(best_epoch)))
"""


def test_no_barrier_in_a_loop_over_a_listing_of_files_rank_0_changes():
    """Practice corpus (pyGAT): `for file in glob.glob('*.pkl'): os.remove(file)` finds a
    different number of files on each rank while rank 0 deletes them, so a barrier per removal
    made ranks call different numbers of collectives (one rank's barrier met the other's DDP
    all_reduce). The save every rank reaches keeps its barrier."""
    out, _ = ddp(GLOB_CLEANUP)
    assert "        torch.save(unwrap_model(model).state_dict(), '{}.pkl'.format(epoch))\n    barrier()\n" in out
    assert "            if is_main_process():\n                os.remove(file)\n" in out
    assert out.count("barrier()") == 1


def test_a_sampler_that_is_none_on_every_path_makes_way_for_the_distributed_one():
    """The ImageNet recipe's `train_sampler = None` ... `sampler=train_sampler` with no
    distributed branch: the loader has no sampler, so it is sharded, not reported as custom."""
    out, reviews = ddp("""\
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        train_sampler = None
        loader = DataLoader(train_set, batch_size=4, shuffle=(train_sampler is None), sampler=train_sampler)
        for epoch in range(2):
            for x, y in loader:
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
        """)
    assert "loader = DataLoader(train_set, batch_size=4, sampler=distributed_sampler(train_set, " \
           "shuffle=(train_sampler is None)))" in out
    assert not any("custom sampler" in r for r in reviews), reviews


def test_a_loader_held_as_an_item_of_a_pair_handed_in_is_rebuilt_where_bound():
    """recurrent-visual-attention's Trainer(config, data_loader) takes the (train, valid) pair
    a factory of another module made: `data_loader[0]` is rebuilt for the rank, the validation
    loader (`data_loader[1]`) stays whole."""
    out, _ = ddp("""\
        class Trainer:
            def __init__(self, config, data_loader):
                self.train_loader = data_loader[0]
                self.valid_loader = data_loader[1]
                self.model = torch.nn.Linear(4, 1)
                self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)

            def train(self):
                for x, y in self.train_loader:
                    self.optimizer.zero_grad()
                    torch.nn.functional.mse_loss(self.model(x), y).backward()
                    self.optimizer.step()

            def validate(self):
                with torch.no_grad():
                    return [self.model(x) for x, y in self.valid_loader]
        """)
    assert "self.train_loader = shard_loader(data_loader[0])" in out
    assert "self.valid_loader = data_loader[1]" in out


def test_a_batch_peeked_before_training_does_not_make_the_loader_an_evaluation_one():
    """The CIFAR-10 tutorial draws `images, labels = next(iter(trainloader))` to show a few
    samples, then trains on the same loader: one batch drawn outside any loop is no
    evaluation, so the loader is still sharded."""
    out, reviews = ddp("""\
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        trainloader = DataLoader(train_set, batch_size=4, shuffle=True)
        dataiter = iter(trainloader)
        images, labels = next(dataiter)
        print(images.shape)
        for epoch in range(2):
            for x, y in trainloader:
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
        """)
    assert "trainloader = DataLoader(train_set, batch_size=4, sampler=distributed_sampler(train_set))" in out
    assert not any("used for training and for evaluation" in r for r in reviews), reviews


PHASES = """\
import os
from tempfile import TemporaryDirectory
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
sets = {'train': train_set, 'val': train_set}
dataloaders = {x: DataLoader(sets[x], batch_size=4, shuffle=True) for x in ['train', 'val']}
with TemporaryDirectory() as tempdir:
    best = os.path.join(tempdir, 'best.pt')
    torch.save(model.state_dict(), best)
    for epoch in range(2):
        for phase in ['train', 'val']:
            model.train() if phase == 'train' else model.eval()
            for x, y in dataloaders[phase]:
                opt.zero_grad()
                with torch.set_grad_enabled(phase == 'train'):
                    loss = torch.nn.functional.mse_loss(model(x), y)
                    if phase == 'train':
                        loss.backward()
                        opt.step()
            if phase == 'val':
                torch.save(model.state_dict(), best)
    model.load_state_dict(torch.load(best))
"""


def test_the_training_phase_of_a_loop_over_dataloaders_by_phase_is_sharded():
    """The transfer-learning tutorial: `for phase in ['train', 'val']` over a dict of
    loaders, training only under `if phase == 'train':`. Exactly those passes are sharded,
    the validation passes read the whole set; the best weights go to each process's own
    temporary directory, so every rank writes and reads back its own copy."""
    out, reviews = ddp(PHASES)
    assert "for x, y in shard_loader(dataloaders[phase], shard=phase == 'train'):" in out
    assert "dataloaders = {x: DataLoader(sets[x], batch_size=4, shuffle=True) for x in ['train', 'val']}" in out
    assert "    torch.save(unwrap_model(model).state_dict(), best)\n" in out
    assert "is_main_process():\n            torch.save" not in out and "barrier()" not in out
    assert not any("does not come from a DataLoader" in r for r in reviews), reviews


def test_phases_trained_under_another_test_are_left_whole():
    """Training not under `if phase == '...'` (backward in every phase): no phase can be
    told apart, the data stays whole and the review says so."""
    out, reviews = ddp(PHASES.replace("                    if phase == 'train':\n                        loss.backward()\n"
                                      "                        opt.step()\n",
                                      "                    loss.backward()\n                    opt.step()\n"))
    assert "shard_loader" not in out
    assert any("does not come from a DataLoader" in r for r in reviews), reviews


BRANCHED_EVAL = """\
import sys
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
if sys.argv[-1] == "small":
    test_loader = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=4)
else:
    test_set = TensorDataset(torch.randn(12, 4), torch.randn(12, 1))
    test_loader = DataLoader(test_set, batch_size=4)

def test():
    total = 0.0
    with torch.no_grad():
        for x, y in test_loader:
            total += torch.nn.functional.mse_loss(model(x), y, reduction="sum").item()
    print(total / len(test_loader.dataset))
""" + TRAIN + "    test()\n"


def test_an_evaluation_loader_bound_in_two_branches_is_sharded_in_both_or_neither():
    """Field: network-slimming binds `test_loader` in an if/else; only the else branch's loader
    was sharded, while the loop's sums were reduced on both paths: the if path doubled them."""
    out, _ = ddp(BRANCHED_EVAL)
    small, large = out.split("else:")[0].split("if sys.argv")[1], out.split("else:")[1].split("def test")[0]
    assert "reduce_sum(total)" in out
    assert "distributed_sampler(" in small and "distributed_sampler(" in large


COUNTED_EVAL = """\
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
test_loader = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=4)
def test():
    total = 0.0
    with torch.no_grad():
        for i, (x, y) in enumerate(test_loader):
            total += torch.nn.functional.mse_loss(model(x), y).item()
    print(AVERAGE)
""" + TRAIN + "    test()\n"


@pytest.mark.parametrize("average, count", [
    ("total / (i + 1)", "i"),  # field: the PyTorch tutorial's `running_vloss / (i + 1)`
    ("total / len(test_loader)", "len(test_loader)"),
    ("total / len(test_loader.dataset)", None),  # the whole set's size: sharded and reduced
])
def test_a_sum_divided_by_a_per_rank_batch_count_keeps_evaluation_whole(average, count):
    """Reduced over ranks and divided by this rank's number of batches, a mean is N times too
    large: such an evaluation is kept whole (correct, not faster), and says why."""
    out, reviews = ddp(COUNTED_EVAL.replace("AVERAGE", average))
    sharded = count is None
    assert ("distributed_sampler(test" in out) == sharded and ("reduce_sum(total)" in out) == sharded
    if not sharded:
        assert any(f"`{count}` after the loop counts this rank's batches only" in r for r in reviews), reviews


ENV_HEAD = """\
import torch
class Env:
    def seed(self, s): pass
    def reset(self, seed=None): return [0.0]
    def step(self, a): return [0.0], 1.0, True
env = Env()
model = torch.nn.Linear(1, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
"""


def test_an_environment_seeded_once_gets_a_seed_per_rank_and_one_seeded_by_episode_keeps_its_own():
    """`rank_seed(s)` (s * WORLD_SIZE + rank) where every rank would play the same episodes; a
    seed that reads the sharded episode counter (`seed=100 + episode`, or a name made from it)
    already differs per rank: a rank added to it would replay another rank's episode."""
    out, _ = ddp("""\
        env.seed(7)
        for episode in range(6):
            s = env.reset(seed=100 + episode)
            episode_seed = 1000 + 2 * episode
            env.action_space_seed = episode_seed
            env.reset(seed=episode_seed)
            s2, r, done = env.step(0)
            loss = model(torch.tensor(s)).sum() * r
            opt.zero_grad()
            loss.backward()
            opt.step()
        """, head=ENV_HEAD)
    assert "env.seed(rank_seed(7))" in out
    assert "for episode in shard_batches(range(6)):" in out
    assert "env.reset(seed=100 + episode)" in out and "env.reset(seed=episode_seed)" in out


def test_rank_seed_is_the_seed_itself_in_one_process():
    from gpumigrate.runtime import rank_seed
    assert rank_seed(7) == 7 and rank_seed(None) is None


@pytest.mark.e2e
@pytest.mark.ddp
def test_rank_seed_gives_each_rank_seeds_no_other_rank_gets(tmp_path):
    from tests.test_runtime import torchrun
    script = tmp_path / "seeds.py"
    # one write per rank (PYTHONUNBUFFERED writes print()'s pieces apart: two ranks interleave them)
    script.write_text("import sys\nfrom gpumigrate.runtime import get_rank, rank_seed, setup_distributed\n"
                      "setup_distributed()\n"
                      "sys.stdout.write('seeds %s %s %s\\n' % (get_rank(), [rank_seed(s) for s in range(3)], "
                      "rank_seed(None)))\n")
    code, out, err = torchrun(script)
    assert code == 0, err[-2000:]
    lines = sorted(line for line in out.splitlines() if line.startswith("seeds"))
    assert lines == ["seeds 0 [0, 2, 4] None", "seeds 1 [1, 3, 5] None"], out


def test_a_generator_that_yields_from_a_loader_hands_it_the_training_role():
    """`def infiniteloop(loader): while True: yield from loader` drawn with `next()` in a counted
    step loop: the loader trains (a sampler), the step loop is sharded by its counter."""
    out, reviews = ddp("""\
        from torch.utils.data import DataLoader, TensorDataset
        def infiniteloop(dataloader):
            while True:
                yield from dataloader
        dataset = TensorDataset(torch.randn(64, 3), torch.randint(0, 2, (64,)))
        dataloader = DataLoader(dataset, batch_size=8, shuffle=True, drop_last=True)
        datalooper = infiniteloop(dataloader)
        model = torch.nn.Linear(3, 2)
        criterion = torch.nn.CrossEntropyLoss()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(20):
            x, y = next(datalooper)
            loss = criterion(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        """, head=HEAD)
    assert "sampler=distributed_sampler(dataset)" in out and "for step in shard_batches(range(20)):" in out
    assert not any("does not come from a DataLoader" in r for r in reviews), reviews


@pytest.mark.parametrize("search", ["import optuna\nstudy = optuna.create_study(direction='maximize')\n"
                                    "study.optimize(objective, n_trials=3)\n",
                                    "from hyperopt import fmin, hp, tpe\n"
                                    "best = fmin(objective, {'lr': hp.loguniform('lr', -9, -1)}, tpe.suggest, 5)\n"])
def test_a_hyperparameter_search_gets_the_device_changes_only(search):
    # each rank would draw its own trials: different models that DDP cannot join
    out, reviews = ddp(textwrap.dedent("""\
        def objective(trial):
            model = torch.nn.Linear(4, 1).cuda()
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for x, y in DataLoader(train_set, batch_size=4, shuffle=True):
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x.cuda()), y.cuda()).backward()
                opt.step()
            return 0.0
        """) + search)
    assert ".to(device)" in out or "get_device()" in out  # the device changes are made
    assert "wrap_model" not in out and "distributed_sampler" not in out and "setup_distributed" not in out
    assert any("hyperparameter search" in r for r in reviews)


@pytest.mark.parametrize("via_block", [False, True])
def test_a_backward_run_inside_a_custom_functions_backward_is_no_training_and_keeps_the_model_unwrapped(via_block):
    # DDP cannot follow a backward that runs inside the backward (reversible layers): the step averages
    inner = ("        return ctx.block.backward_pass(dy)\n" if via_block else
             "        with torch.enable_grad():\n"
             "            torch.autograd.backward(ctx.block.f(ctx.x), dy)\n"
             "        return ctx.x.grad\n")
    out, reviews, notes = ddp(textwrap.dedent("""\
        class Rev(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, block):
                ctx.block, ctx.x = block, x.detach().requires_grad_()
                return block.f(x)

            @staticmethod
            def backward(ctx, dy):
        """) + inner + textwrap.dedent("""\

        class Block(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.f = torch.nn.Linear(4, 4)

            def forward(self, x):
                return Rev.apply(x, self)

            def backward_pass(self, dy):
                x = self.x.detach().requires_grad_()
                torch.autograd.backward(self.f(x), dy)
                return x.grad

        model = torch.nn.Sequential(Block(), torch.nn.Linear(4, 1)).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        """) + TRAIN, notes=True)
    assert "wrap_model" not in out and "distributed_sampler(" in out  # still data-parallel
    assert any("Rev.backward" in n for n in reviews + notes)
    block = out.split("class Block")[1].split("model =")[0]
    assert "torch.autograd.backward(self.f(x), dy)" in block and "get_rank" not in block and "is_main" not in block


@pytest.mark.parametrize("test", ["is_primary()", "utils.is_main()", "is_rank0()", "args.is_master"])
def test_output_under_the_scripts_own_rank_zero_test_is_not_gated_again(test):
    out, _ = ddp(textwrap.dedent(f"""\
        import utils
        model = torch.nn.Linear(4, 1).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        """) + TRAIN + f"    if {test}:\n        print(\"epoch\", epoch)\n")
    assert f"    if {test}:\n        print(\"epoch\", epoch)\n" in out  # left as it was, not gated a second time


def test_a_few_batches_looked_at_with_islice_do_not_make_the_training_loader_an_evaluation_one():
    # a data-dependent init (Glow's ActNorm) reads a few training batches before training
    out, reviews = ddp(textwrap.dedent("""\
        from itertools import islice
        loader = DataLoader(train_set, batch_size=4, shuffle=True, drop_last=True)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with torch.no_grad():
            for x, y in islice(loader, None, 2):
                model(x)
        """) + TRAIN.split("\n", 1)[1])
    assert "shuffle=True, drop_last=True" not in out and "sampler=distributed_sampler(train_set)" in out
    assert not any("training and for evaluation" in r for r in reviews), reviews


def test_a_script_with_its_own_is_main_process_is_gated_once_through_the_alias():
    # the runtime's helper comes in as `gm_is_main_process`: its branches count as rank-0 ones
    out, _ = ddp(textwrap.dedent("""\
        def is_main_process():
            return True
        model = torch.nn.Linear(4, 1).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        """) + TRAIN + "    print('epoch', epoch)\n")
    assert "    if gm_is_main_process():\n        print('epoch', epoch)\n" in out  # ddp() checks a second run


def test_a_folder_made_with_exist_ok_is_made_on_every_rank():
    # gated to rank 0, another rank could open its log file inside before the folder exists
    out, _ = ddp(textwrap.dedent("""\
        import logging, os, time
        outdir = 'exps/run_' + time.strftime('%H%M')
        os.makedirs(outdir, exist_ok=True)
        logging.basicConfig(filename=outdir + '/std.log')
        model = torch.nn.Linear(4, 1).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        """) + TRAIN)
    assert "\nos.makedirs(outdir, exist_ok=True)\n" in out
    assert "broadcast_object(" in out  # the clock's name is rank 0's on every rank
