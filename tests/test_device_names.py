"""Every way a script names a device becomes the runtime's device, defined before its first
use (issue 31, item 5 and shape 6): names bound to "cuda" in any scope, `f"cuda:{i}"`,
`--device` flags defaulting to CUDA; device types (`device_type`) stay strings."""

import textwrap

import pytest

from tests.conftest import migrate, run_script


def fix(code: str, target: str = "device") -> str:
    result = migrate(textwrap.dedent(code).encode(), target)
    assert result.error is None, result.error
    out = (result.new_source or result.source).decode()
    assert migrate(out.encode(), target).new_source is None, "not idempotent"
    compile(out, "x.py", "exec")
    return out


def reviews(code: str):
    result = migrate(textwrap.dedent(code).encode())
    return [f for f in result.findings if f.review]


def run(out: str, tmp_path, *args: str) -> str:
    """Run a migrated script on this CPU-only machine, as a user would."""
    path = tmp_path / "train.py"
    path.write_text(out)
    done = run_script(path, list(args), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.e2e
def test_a_cuda_string_bound_in_any_scope_becomes_the_device(tmp_path):
    out = fix("""\
        import torch

        dev = "cuda:0"

        class Trainer:
            def __init__(self):
                self.device = "cuda"
                self.model = torch.nn.Linear(2, 2).to(self.device)

            def step(self, x):
                return self.model(x.to(self.device))

        def helper(t):
            d = "cuda"
            return t.cuda(d)

        x = torch.zeros(2, device=dev)
        y = torch.ones(2).to(torch.device(dev))
        print(Trainer().step(helper(torch.ones(3, 2))).shape, x.device, y.device)
        """)
    assert 'dev = get_device()\n' in out
    assert "        self.device = get_device()\n" in out
    assert "    d = get_device()\n    return t.to(d)\n" in out
    assert '"cuda' not in out
    assert run(out, tmp_path) == "torch.Size([3, 2]) cpu cpu\n"


@pytest.mark.e2e
def test_a_computed_cuda_index_becomes_that_accelerator(tmp_path):
    out = fix("""\
        import torch
        i = 0
        a = torch.zeros(2, device=f'cuda:{i}')
        b = torch.ones(2).to("cuda:%d" % i)
        c = torch.ones(2).to(torch.device("cuda:{}".format(i)))
        d = torch.ones(2).to("cuda:" + str(i))
        gpu = f"cuda:{i}"
        e = torch.ones(1).to(gpu)
        print(a.device, b.device, c.device, d.device, e.device)
        """)
    assert "device=get_device(i)" in out
    assert out.count(".to(get_device(i))") == 3
    assert 'gpu = get_device(i)\n' in out
    assert run(out, tmp_path) == "cpu cpu cpu cpu cpu\n"


def test_local_rank_in_a_device_name_is_the_runtime_s_choice():
    out = fix("""\
        import torch
        device = f'cuda:{args.local_rank}'
        model = torch.nn.Linear(2, 2).to(device)
        """)
    assert "device = get_device()\n" in out


@pytest.mark.e2e
def test_a_device_flag_defaulting_to_cuda_defaults_to_this_machine_s_device(tmp_path):
    source = """\
        import argparse
        import torch

        def get_args():
            parser = argparse.ArgumentParser()
            parser.add_argument('--device', type=str, default='cuda')
            parser.add_argument('--dvc', default='cuda:0', help='another spelling')
            parser.add_argument('--name', default='cuda')  # not a device: never used as one
            return parser.parse_args()

        args = get_args()
        model = torch.nn.Linear(2, 2).to(args.device)
        x = torch.zeros(2, device=torch.device(args.dvc))
        print(args.device, args.dvc, args.name, next(model.parameters()).device, x.device)
        """
    out = fix(source)
    assert "parser.add_argument('--device', type=str, default=get_device().type)" in out
    assert "parser.add_argument('--dvc', default=str(get_device()), help='another spelling')" in out
    assert "parser.add_argument('--name', default='cuda')" in out
    assert run(out, tmp_path) == "cpu cpu cuda cpu cpu\n"
    # the user's explicit choice is kept
    assert run(out, tmp_path, "--device", "cpu", "--dvc", "cpu") == "cpu cpu cuda cpu cpu\n"
    assert not reviews(source)


@pytest.mark.e2e
def test_a_flag_used_as_a_device_through_aliases_and_an_attribute(tmp_path):
    """`device = args.device` -> `Trainer(device)` -> `self.device` -> `x.to(self.device)`."""
    out = fix("""\
        import argparse
        import torch
        parser = argparse.ArgumentParser()
        parser.add_argument('--device', default='cuda')
        args = parser.parse_args()
        args.gpu_device = 'cuda' if torch.cuda.is_available() else 'cpu'

        class Trainer:
            def __init__(self, device):
                self.device = device

            def step(self, x):
                return x.to(self.device)

        def main():
            device = args.device
            y = Trainer(device).step(torch.ones(2)).to(args.gpu_device)
            if args.gpu_device == 'cuda':
                print("gpu")
            print(y.device, args.gpu_device)

        main()
        """)
    assert "parser.add_argument('--device', default=get_device().type)" in out
    assert "args.gpu_device = get_device()\n" in out
    assert "if args.gpu_device.type == 'cuda':" in out
    assert run(out, tmp_path) == "cpu cpu\n"


def test_a_choice_between_a_flag_s_device_and_the_cpu_asks_for_any_accelerator():
    out = fix("""\
        import argparse
        import torch
        parser = argparse.ArgumentParser()
        parser.add_argument('--device', default='cuda')
        args = parser.parse_args()
        device = torch.device(args.device if torch.cuda.is_available() else 'cpu')
        """)
    # on a Mac: args.device is "mps" and the choice takes it, as get_device() does
    assert "device = torch.device(args.device if accelerator_available() else 'cpu')\n" in out


def test_a_guard_around_a_move_to_a_named_device_asks_for_any_accelerator():
    out = fix("""\
        import torch

        def to_gpu_if_possible(t):
            dev = "cuda"
            if torch.cuda.is_available():
                t = t.to(dev)
            return t
        """)
    assert "    dev = get_device()\n    if accelerator_available():\n        t = t.to(dev)\n" in out


# -- device types stay strings --------------------------------------------------------------

NANO = """\
    import torch
    from model import GPT

    device = 'cuda'
    dtype = 'bfloat16'
    device_type = 'cuda' if 'cuda' in device else 'cpu'
    ctx = torch.amp.autocast(device_type=device_type, dtype=torch.bfloat16)

    def get_batch():
        x = torch.randn(4, 8)
        if device_type == 'cuda':
            x = x.pin_memory().to(device, non_blocking=True)
        else:
            x = x.to(device)
        return x

    model = GPT()
    model.to(device)
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), device_type)
    checkpoint = torch.load('ckpt.pt', map_location=device)
    """


def test_a_device_type_stays_a_string_and_the_device_becomes_the_runtime_s():
    """`device_type` is read by autocast, compared with 'cuda' and handed to another module's
    `configure_optimizers` (`fused = device_type == 'cuda'`): a string it stays. `device` is
    used as a device and in `'cuda' in device`, which `.type` keeps right."""
    out = fix(NANO)
    assert "device = get_device()\n" in out
    assert "device_type = 'cuda' if 'cuda' in device.type else 'cpu'\n" in out
    assert "torch.amp.autocast(device_type=device_type, dtype=torch.bfloat16)" in out
    assert "if device_type == 'cuda':" in out
    assert "(0.9, 0.95), device_type)" in out
    assert "map_location=device)" in out


def test_a_device_a_configurator_may_rebind_stays_a_string():
    """`exec(open('configurator.py').read())` may set `device = 'cpu'` from the command line:
    `'cuda' in device.type` would fail on that string, so `device` stays a string, naming
    the runtime's device, and the double use is reported."""
    source = NANO.replace("dtype = 'bfloat16'\n", "dtype = 'bfloat16'\n    exec(open('configurator.py').read())\n")
    out = fix(source)
    assert "device = get_device().type\n" in out
    assert "device_type = 'cuda' if 'cuda' in device else 'cpu'\n" in out
    found = reviews(source)
    assert [(f.code, f.line) for f in found] == [("GM103", 7)] and "stays a string" in found[0].message


@pytest.mark.e2e
def test_a_device_type_that_only_asks_for_cuda_is_the_runtime_device_s_type(tmp_path):
    out = fix("""\
        import torch
        device_type = 'cuda' if torch.cuda.is_available() else 'cpu'
        with torch.autocast(device_type=device_type, dtype=torch.bfloat16):
            y = torch.nn.Linear(2, 2)(torch.ones(1, 2))
        print(device_type, device_type == 'cuda', y.dtype)
        """)
    assert "device_type = get_device().type\n" in out
    assert run(out, tmp_path) == "cpu False torch.bfloat16\n"


def test_a_user_chosen_device_type_is_kept():
    source = """\
        import torch
        device_type = 'cuda' if args.amp_on_gpu else 'cpu'
        ctx = torch.autocast(device_type=device_type)
        """
    assert fix(source) == textwrap.dedent(source)


def test_a_string_passed_to_another_module_s_function_stays_a_string():
    out = fix("""\
        import torch
        from utils import train
        device = 'cuda'
        model = torch.nn.Linear(2, 2).to(device)
        train(model, device)
        """)
    assert "device = get_device().type\n" in out  # whatever `train` does with "cuda", it gets a name


def test_a_string_passed_to_a_function_of_this_file_follows_its_use():
    out = fix("""\
        import torch
        device = 'cuda'

        def train(model, dev):
            return model.to(dev)

        train(torch.nn.Linear(2, 2), device)
        """)
    assert "device = get_device()\n" in out


# -- defined before the first use (shape 6) -------------------------------------------------

@pytest.mark.e2e
def test_a_flag_bound_in_a_nested_loop_does_not_place_the_device_there(tmp_path):
    """`model.cuda()` at the top of main(), the only flag in a nested loop: the device is
    defined where every use sees it, not after the flag (UnboundLocalError on every machine)."""
    out = fix("""\
        import torch

        def main(pin):
            model = torch.nn.Linear(2, 2)
            if torch.cuda.is_available():
                model.cuda()
            for epoch in range(2):
                for x in [torch.ones(1, 2)]:
                    pin_memory = torch.cuda.is_available() and pin
                    if pin_memory:
                        x = x.cuda(non_blocking=pin_memory)
                    print(model(x).shape)

        main(True)
        """)
    head, main = out.split("def main(pin):\n")
    assert "device = get_device()" in head
    assert "device = " not in main
    assert run(out, tmp_path) == "torch.Size([1, 2])\ntorch.Size([1, 2])\n"


@pytest.mark.e2e
def test_a_device_defined_after_a_use_in_the_same_function_is_not_reused(tmp_path):
    out = fix("""\
        import torch

        def main():
            model = torch.nn.Linear(2, 2).cuda()
            device = torch.device("cuda:0")
            x = torch.ones(1, 2).to(device)
            print(model(x).shape)

        main()
        """)
    assert "model = torch.nn.Linear(2, 2).to(device2)" in out
    assert "    device = get_device()\n" in out
    assert run(out, tmp_path) == "torch.Size([1, 2])\n"


@pytest.mark.e2e
def test_a_device_defined_in_one_branch_is_not_reused_outside_it(tmp_path):
    out = fix("""\
        import torch

        def main(cuda):
            if cuda:
                device = torch.device("cuda")
                model = torch.nn.Linear(2, 2).cuda()
            x = torch.ones(1, 2).cuda()
            print(x.device)

        main(False)
        """)
    assert "x = torch.ones(1, 2).to(device2)" in out
    assert run(out, tmp_path) == "cpu\n"


@pytest.mark.e2e
def test_a_module_device_is_not_reused_by_a_function_that_runs_before_it(tmp_path):
    out = fix("""\
        import torch

        def build():
            return torch.nn.Linear(2, 2).cuda()

        model = build()
        device = torch.device("cuda")
        print(model(torch.ones(1, 2).to(device)).shape)
        """)
    assert "return torch.nn.Linear(2, 2).to(device2)" in out
    assert run(out, tmp_path) == "torch.Size([1, 2])\n"


@pytest.mark.e2e
def test_a_module_device_is_not_reused_where_a_local_name_shadows_it(tmp_path):
    out = fix("""\
        import torch
        device = torch.device("cuda")

        def step(x):
            x = x.cuda()
            device = 'reported elsewhere'
            return x, device

        print(step(torch.ones(1))[0].device)
        """)
    assert "x = x.to(device2)" in out
    assert run(out, tmp_path) == "cpu\n"


def test_a_device_bound_in_every_branch_of_an_if_is_reused_after_it():
    out = fix("""\
        import torch

        def main(args):
            if args.local_rank == -1:
                device = torch.device('cuda', args.gpu_id)
            elif args.cpu:
                device = torch.device('cpu')
            else:
                device = torch.device('cuda', args.local_rank)
            state = torch.load('ckpt.pt')
        """)
    assert "state = torch.load('ckpt.pt', map_location=device)" in out and "device2" not in out


def test_a_global_device_set_in_main_is_not_reused_by_other_functions():
    """`global device` in main(): another function may run before main() sets it."""
    out = fix("""\
        import torch

        def load(path):
            return torch.load(path)

        def main():
            global device
            device = torch.device(args.device)
            load('m.pt')
        """)
    assert "return torch.load(path, map_location=device2)" in out


def test_a_device_bound_before_every_use_is_reused():
    out = fix("""\
        import torch

        def main():
            device = torch.device("cuda:0")
            for x in range(3):
                model = torch.nn.Linear(2, 2).cuda()
        """)
    assert "model = torch.nn.Linear(2, 2).to(device)" in out
    assert "device2" not in out


def test_a_printed_cuda_name_becomes_the_device_the_fixes_use():
    out = fix("""\
        import torch
        device = "cuda"
        print("running on", device)
        model = torch.nn.Linear(2, 2).cuda()
        """)
    assert "device = get_device()\n" in out and "model = torch.nn.Linear(2, 2).to(device)" in out


@pytest.mark.e2e
def test_the_late_binding_fixture_runs_with_and_without_its_flags(tmp_path):
    from tests.conftest import FIXTURES

    script = FIXTURES / "scripts" / "device_late_binding.py"
    if not script.exists():
        pytest.skip("fixtures/scripts/device_late_binding.py is written by another change")
    out = fix(script.read_text())
    main = out.split("def main():\n", 1)[1]
    assert "cuda" not in main.replace("torch.cuda.is_available()", "")
    assert "default=get_device().type" in out
    for args in ([], ["--device", "cpu"]):
        printed = run(out, tmp_path, "--epochs", "1", *args)
        assert "reloaded val_acc" in printed


@pytest.mark.e2e
def test_a_parameter_defaulting_to_cuda_defaults_to_the_runtime_device(tmp_path):
    """`def train(model, device="cuda")`: a caller may pass another device, so the default
    stays a string, the runtime's device's name (evaluated where the function is defined)."""
    out = fix("""\
        import torch


        def make_batch(n, device="cuda"):
            return torch.randn(n, 4, device=device), torch.randn(n, 1, device=device)


        def train(model, steps=3, *, device: str = 'cuda:0'):
            model.to(device)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(steps):
                x, y = make_batch(8)
                opt.zero_grad()
                ((model(x.to(device)) - y.to(device)) ** 2).mean().backward()
                opt.step()
            return device


        print(train(torch.nn.Linear(4, 1)), train(torch.nn.Linear(4, 1), device="cpu"))
        """)
    assert 'def make_batch(n, device=get_device().type):' in out
    assert "device: str = str(get_device())" in out
    assert run(out, tmp_path).split() == ["cpu", "cpu"]
