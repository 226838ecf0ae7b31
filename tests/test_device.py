"""Where the device comes from: one definition, in scope for every use, never clobbering."""

import sys
import textwrap

import pytest
import torch

from tests.conftest import migrate


def fix(code: str) -> str:
    result = migrate(textwrap.dedent(code).encode())
    assert result.error is None, result.error
    out = (result.new_source or result.source).decode()
    assert migrate(out.encode()).new_source is None, "not idempotent"
    compile(out, "x.py", "exec")
    return out


def test_definition_goes_after_the_flag_inside_main():
    out = fix("""\
        import argparse
        import torch

        def main():
            parser = argparse.ArgumentParser()
            parser.add_argument('--no-cuda', action='store_true')
            args = parser.parse_args()
            use_cuda = not args.no_cuda and torch.cuda.is_available()
            model = torch.nn.Linear(2, 2)
            if use_cuda:
                model.cuda()
        """)
    assert textwrap.dedent("""\
            use_cuda = not args.no_cuda and accelerator_available()
            device = get_device() if use_cuda else torch.device("cpu")
            model = torch.nn.Linear(2, 2)
            model.to(device)
        """) in textwrap.dedent(out.split("def main():\n", 1)[1])
    assert out.count("get_device()") == 1


def test_flag_out_of_reach_keeps_guards():
    # the flag lives in main(), the .cuda() calls in train(): the device is defined at module
    # level and the guards stay, so --no-cuda still keeps everything on the CPU
    out = fix("""\
        import torch

        def train(model, x, use_cuda):
            if use_cuda:
                x = x.cuda()
            return model(x)

        def main():
            use_cuda = not args.no_cuda and torch.cuda.is_available()
            model = torch.nn.Linear(2, 2)
            if use_cuda:
                model.cuda()
        """)
    assert "from gpumigrate.runtime import accelerator_available, get_device\n\ndevice = get_device()\n" in out
    assert "    if use_cuda:\n        x = x.to(device)\n" in out
    assert "    if use_cuda:\n        model.to(device)\n" in out
    # the guards and the device agree: both mean an accelerator (MPS on a Mac), unless --no-cuda
    assert "    use_cuda = not args.no_cuda and accelerator_available()\n" in out


def test_existing_name_device_is_not_clobbered():
    out = fix("""\
        import torch

        def run(model, device='gpu0'):
            print(device)
            return model.cuda()
        """)
    assert "device2 = get_device()" in out
    assert "return model.to(device2)" in out
    assert "print(device)" in out


def test_existing_device_is_reused_and_finds_any_accelerator():
    """`torch.device("cuda" if torch.cuda.is_available() else "cpu")` is the CPU on a Mac:
    it becomes `get_device()`, and the fixes use it (no second `device2`)."""
    source = """\
        import torch
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        x = torch.ones(1).cuda()
        """
    out = fix(source)
    assert "device = get_device()\n" in out
    assert "x = torch.ones(1).to(device)" in out
    assert "device2" not in out and "is_available" not in out


def test_variable_index_keeps_the_users_choice():
    out = fix("""\
        import torch
        model = torch.nn.Linear(2, 2).cuda(args.gpu)
        """)
    assert "model = torch.nn.Linear(2, 2).to(get_device(args.gpu))" in out
    assert "device = get_device()" not in out


def test_guard_with_else_is_kept():
    out = fix("""\
        import torch
        if torch.cuda.is_available():
            x = torch.ones(1).cuda()
        else:
            x = torch.zeros(1)
        """)
    # the guard asks what get_device() answers: on a Mac both branches' data meet the model on MPS
    assert "if accelerator_available():\n    x = torch.ones(1).to(device)\nelse:" in out


def test_one_line_guard_is_unwrapped_and_comments_kept():
    out = fix("""\
        import torch
        cuda = True if torch.cuda.is_available() else False
        # move everything
        if cuda: generator.cuda(); discriminator.cuda()
        """)
    assert "# move everything\ngenerator.to(device)\ndiscriminator.to(device)\n" in out
    # a flag that only says "CUDA is there" does not decide the device: MPS counts too
    assert "device = get_device()\n" in out


def test_set_device_guard_goes_as_a_whole():
    out = fix("""\
        import torch
        if args.gpu is not None:
            torch.cuda.set_device(args.gpu)
        x = 1
        if torch.cuda.is_available():
            torch.cuda.set_device(0)
            print('on GPU 0')
        """)
    assert out == "import torch\nx = 1\nif torch.cuda.is_available():\n    print('on GPU 0')\n"


def test_set_device_alone_in_a_function_leaves_pass():
    out = fix("""\
        import torch
        def pin():
            torch.cuda.set_device(0)
        """)
    assert "def pin():\n    pass\n" in out


def test_guard_around_a_cuda_tensor_type_goes_too():
    out = fix("""\
        import torch
        cuda = True if torch.cuda.is_available() else False
        x = torch.randn(8, 4)
        if cuda:
            x = x.type(torch.cuda.FloatTensor)
        """)
    assert "if cuda" not in out and "x = x.to(device, torch.float32)" in out


def test_weights_only_false_for_a_model_whose_class_is_imported():
    out = fix("""\
        import torch
        from mymodels import Net
        model = Net()
        torch.save(model, 'model.pt')
        model = torch.load('model.pt')
        """)
    assert "torch.load('model.pt', map_location=device, weights_only=False)" in out


def test_a_gpu_index_defined_under_the_guard_is_defined_on_every_device():
    """Field report 2, P11: the `.cuda(gpu)` calls leave their guards, so must `gpu`."""
    source = """\
        import torch
        use_cuda = torch.cuda.is_available()
        if use_cuda:
            gpu = 0
            torch.cuda.set_device(gpu)
        model = torch.nn.Linear(2, 2)
        if use_cuda:
            model = model.cuda(gpu)
        x = torch.randn(3, 2)
        if use_cuda: x = x.cuda(gpu)
        print(model(x).shape)
        """
    out = fix(source)
    assert "if use_cuda" not in out and "set_device" not in out
    assert "\ngpu = 0\nmodel = torch.nn.Linear(2, 2)\nmodel = model.to(get_device(gpu))\n" in out
    exec(compile(out, "x.py", "exec"), {})  # no CUDA here: `gpu` is defined all the same


def test_a_gpu_index_that_needs_cuda_to_compute_keeps_its_guards():
    out = fix("""\
        import torch
        use_cuda = torch.cuda.is_available()
        if use_cuda:
            gpu = torch.cuda.current_device()
        model = torch.nn.Linear(2, 2)
        if use_cuda:
            model.cuda(gpu)
        """)
    assert "if use_cuda:\n    gpu = torch.cuda.current_device()\n" in out
    assert "if use_cuda:\n    model.to(get_device(gpu))\n" in out
    exec(compile(out, "x.py", "exec"), {})


def test_a_dead_else_goes_with_the_guard_but_a_commented_one_stays():
    out = fix("""\
        import torch
        use_cuda = torch.cuda.is_available()
        model = torch.nn.Linear(2, 2)
        if use_cuda:
            model.cuda()
        else:
            pass
        x = torch.randn(1, 2)
        if use_cuda:
            x = x.cuda()
        else:
            pass  # TODO: MPS
        """)
    assert "model = torch.nn.Linear(2, 2)\nmodel.to(device)\n" in out
    assert "if use_cuda:\n    x = x.to(device)\nelse:\n    pass  # TODO: MPS\n" in out


# -- any accelerator: MPS, XPU (issue 20, item 4) -------------------------------------------

def findings(code: str, target: str = "device"):
    result = migrate(textwrap.dedent(code).encode(), target)
    assert result.error is None, result.error
    return result.findings


def test_a_device_named_by_a_string_becomes_get_device_and_is_reused():
    """`device = 'cuda' if torch.cuda.is_available() else 'cpu'` is the CPU on a Mac: it
    becomes `get_device()`, the fixes reuse it (no `device2`), and the reads that took it for
    a string compare its type."""
    out = fix("""\
        import torch
        device = 'cuda' if torch.cuda.is_available() else 'cpu'
        model = torch.nn.Linear(2, 2).to(device)
        state = torch.load('ckpt.pt')
        x = torch.ones(1).cuda()
        if device == 'cuda':
            torch.backends.cudnn.benchmark = True
        pin = device in ('cuda', 'mps')
        with torch.autocast(device_type=device, enabled=False):
            y = model(x)
        print('running on', device)
        """)
    assert "device = get_device()\n" in out
    assert "device2" not in out and "is_available" not in out
    assert "state = torch.load('ckpt.pt', map_location=device)" in out
    assert "x = torch.ones(1).to(device)" in out
    assert "if device.type == 'cuda':" in out
    assert "pin = device.type in ('cuda', 'mps')" in out
    assert "torch.autocast(device_type=device.type, enabled=False)" in out
    assert "print('running on', device)" in out


def test_string_reads_no_edit_makes_right_keep_a_string_and_are_reported():
    """Used as a device and read as a string: it stays a string (issue 31), the name of the
    device `get_device()` picks, so `device.startswith("cuda")` still works; and it is said."""
    source = """\
        import torch
        device = "cuda:0" if torch.cuda.is_available() else "cpu"
        x = torch.ones(1).to(device)
        on_gpu = device.startswith("cuda")
        """
    out = fix(source)
    assert 'device = str(get_device())\n' in out
    assert 'on_gpu = device.startswith("cuda")' in out  # left, and said
    reviews = [f for f in findings(source) if f.review]
    assert [(f.code, f.line) for f in reviews] == [("GM103", 4)]
    assert "device.startswith" in reviews[0].message


def test_torch_device_choice_in_a_function_is_reused_there():
    out = fix("""\
        import torch

        def main():
            device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
            model = torch.nn.Linear(2, 2).cuda()
            model.load_state_dict(torch.load('m.pt'))
        """)
    assert "    device = get_device()\n" in out
    assert "model = torch.nn.Linear(2, 2).to(device)" in out
    assert "torch.load('m.pt', map_location=device)" in out
    assert "device2" not in out


def test_no_cuda_flag_asks_for_any_accelerator():
    """`args.cuda = not args.no_cuda and torch.cuda.is_available()`: "an accelerator unless
    --no-cuda"; the script's own `torch.device("cuda" if args.cuda else "cpu")` follows it."""
    out = fix("""\
        import torch
        args.cuda = not args.no_cuda and torch.cuda.is_available()
        device = torch.device("cuda" if args.cuda else "cpu")
        if args.cuda:
            torch.cuda.manual_seed(1)
        model = torch.nn.Linear(2, 2).to(device)
        """)
    assert "args.cuda = not args.no_cuda and accelerator_available()\n" in out
    assert 'device = get_device() if args.cuda else torch.device("cpu")\n' in out
    assert "from gpumigrate.runtime import accelerator_available, get_device\n" in out


def test_a_flag_choosing_map_location_stays_cuda_only_and_is_reported():
    """`map_location=None if use_cuda else 'cpu'`: None restores onto the saving GPU, CUDA."""
    source = """\
        import torch
        use_cuda = torch.cuda.is_available() and not args.no_cuda
        model = torch.nn.Linear(2, 2)
        if use_cuda:
            model.cuda()
        state = torch.load('m.pt', map_location=None if use_cuda else 'cpu')
        """
    out = fix(source)
    assert "use_cuda = torch.cuda.is_available() and not args.no_cuda\n" in out
    reviews = [f for f in findings(source) if f.review]
    assert [(f.code, f.line) for f in reviews] == [("GM103", 2)] and "map_location" in reviews[0].message


def test_a_flag_guarding_a_move_agrees_with_the_device():
    """The script's device asks only for CUDA (`get_device()` now), its `if args.cuda:`
    guards `.cuda()`: the flag asks for any accelerator too, or on a Mac the model would stay
    on the CPU while the data goes to MPS."""
    out = fix("""\
        import torch
        args.cuda = not args.no_cuda and torch.cuda.is_available()
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        model = torch.nn.Linear(2, 2)
        if args.cuda:
            model.cuda()
        x = torch.ones(1).to(device)
        """)
    assert "args.cuda = not args.no_cuda and accelerator_available()\n" in out
    assert "device = get_device()\n" in out


def test_a_flag_guarding_cuda_only_calls_stays_cuda_only_and_is_reported():
    source = """\
        import torch
        use_cuda = not args.no_cuda and torch.cuda.is_available()
        model = torch.nn.Linear(2, 2)
        if use_cuda:
            model.cuda()
            print(torch.cuda.get_device_name())
        """
    out = fix(source)
    assert "use_cuda = not args.no_cuda and torch.cuda.is_available()\n" in out
    assert "accelerator_available" not in out
    reviews = [f for f in findings(source) if f.review]
    assert [(f.code, f.line) for f in reviews] == [("GM103", 2)]
    assert "torch.cuda.get_device_name()" in reviews[0].message


def test_an_availability_name_bound_twice_is_the_user_s_choice():
    """`use_cuda` is `torch.cuda.is_available()` and then the user's flag: the device keeps
    asking it (on the CPU with --no-cuda), it is not taken for a mere availability test."""
    out = fix("""\
        import torch
        use_cuda = torch.cuda.is_available()
        use_cuda = use_cuda and not args.no_cuda
        device = "cuda" if use_cuda else "cpu"
        x = torch.ones(1).to(device)
        """)
    assert 'device = get_device() if use_cuda else torch.device("cpu")\n' in out


def test_an_inline_cuda_guard_asks_for_the_accelerator():
    out = fix("""\
        import torch
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        def step(x):
            return x.cuda() if torch.cuda.is_available() else x
        """)
    assert "return x.to(device) if accelerator_available() else x" in out


def _run_device_lines(out: str, argv, monkeypatch) -> torch.device:
    """Run a migrated script's set-up lines (no tensors: this machine has no MPS) and return
    the device it chose."""
    monkeypatch.setattr(sys, "argv", ["train.py", *argv])
    namespace = {"__name__": "migrated"}
    exec(compile(out, "train.py", "exec"), namespace)
    return namespace["device"]


@pytest.mark.parametrize("argv, expected", [([], "mps"), (["--no-cuda"], "cpu")])
def test_a_migrated_no_cuda_script_runs_on_a_mac_s_gpu_unless_told(monkeypatch, argv, expected):
    out = fix("""\
        import argparse
        import torch
        parser = argparse.ArgumentParser()
        parser.add_argument('--no-cuda', action='store_true', default=False)
        args = parser.parse_args()
        args.cuda = not args.no_cuda and torch.cuda.is_available()

        def load(path):
            return torch.load(path)
        """)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: torch.device("mps"))
    monkeypatch.setattr(torch.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _run_device_lines(out, argv, monkeypatch) == torch.device(expected)


def test_a_migrated_string_device_script_finds_xpu(monkeypatch):
    """Only compared with "cuda", the name is a device type: it stays a string, the type of
    the device `get_device()` picks."""
    out = fix("""\
        import torch
        device = 'cuda' if torch.cuda.is_available() else 'cpu'
        on_gpu = device == 'cuda'
        """)
    assert "device = get_device().type\non_gpu = device == 'cuda'\n" in out
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: torch.device("xpu"))
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 1)
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert _run_device_lines(out, [], monkeypatch) == "xpu"
