"""The amp migration's decisions: what it edits, and where it keeps full precision and says why."""

import textwrap

import pytest
from click.testing import CliRunner

from gpumigrate.cli import main
from gpumigrate.targets import TargetError, parse_target, target_bases
from tests.conftest import migrate

HEAD = """\
import torch
from torch.utils.data import DataLoader, TensorDataset
loader = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), batch_size=4)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
"""


def amp(code: str, target: str = "amp", options=None):
    source = HEAD + textwrap.dedent(code)
    result = migrate(source.encode(), target, options=options)
    assert result.error is None, result.error
    out = (result.new_source or result.source).decode()
    compile(out, "x.py", "exec")
    again = migrate(out.encode(), target, options=options)
    assert again.error is None and again.new_source is None, "not idempotent"
    return out, [f.message for f in result.findings if f.review]


def test_gradient_accumulation_updates_only_where_it_steps():
    out, reviews = amp("""\
        for i, (x, y) in enumerate(loader):
            loss = ((model(x) - y) ** 2).mean() / 4
            loss.backward()
            if (i + 1) % 4 == 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
        """)
    assert not reviews
    assert "    if (i + 1) % 4 == 0:\n        scaler.unscale_(opt)\n        torch.nn.utils.clip_grad_norm_" in out
    assert "        scaler.step(opt)\n        scaler.update()\n        opt.zero_grad()" in out
    exec(compile(out, "x.py", "exec"), {})  # it runs (bfloat16, scaler off)


def test_steps_in_different_branches_keep_full_precision_and_say_why():
    out, reviews = amp("""\
        critic = torch.optim.SGD(model.parameters(), lr=0.1)
        for i, (x, y) in enumerate(loader):
            model(x).sum().backward()
            critic.step()
            if i % 5 == 0:
                opt.step()
        """)
    assert "autocast" not in out and "scaler" not in out
    assert any("different blocks" in r for r in reviews)


@pytest.mark.parametrize("code, why", [
    ("for x, y in loader:\n    loss = model(x).sum()\n    loss.backward()\n    opt.step(lambda: loss)\n", "closure"),
    ("for x, y in loader:\n    torch.autograd.backward(model(x).sum())\n    opt.step()\n", "autograd.backward"),
    ("for x, y in loader:\n    loss = model(x).sum()\n    loss.backward()\n", "no `optimizer.step()`"),
])
def test_steps_the_scaler_cannot_take_are_reported(code, why):
    out, reviews = amp(code)
    assert "scaler" not in out
    assert any(why in r for r in reviews), reviews


def test_keep_half_keeps_pure_float16_with_the_batchnorm_guard():
    code = """\
        net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
        net.half()
        o = torch.optim.SGD(net.parameters(), lr=0.1)
        for x, y in loader:
            net(x.half()).sum().backward()
            o.step()
        """
    out, reviews = amp(code, options={"keep_half": True})
    assert "net.half()\nkeep_batchnorm_fp32(net)" in out and "x.half()" in out and "scaler" not in out
    assert any("--keep-half" in r for r in reviews)
    out, reviews = amp(code)
    assert ".half()" not in out and "keep_batchnorm_fp32" not in out and "with autocast(net):" in out


def test_evaluation_that_makes_numpy_arrays_stays_in_full_precision():
    out, reviews = amp("""\
        for x, y in loader:
            model(x).sum().backward()
            opt.step()
        with torch.no_grad():
            for x, y in loader:
                pred = model(x)
                print(pred.numpy())
        """)
    assert out.count("with autocast(model):") == 1
    assert any("NumPy" in r for r in reviews)


def test_evaluation_runs_under_autocast():
    out, _ = amp("""\
        for x, y in loader:
            model(x).sum().backward()
            opt.step()
        with torch.no_grad():
            for x, y in loader:
                pred = model(x)
                print(pred.sum().item())
        """)
    assert "        with autocast(model):\n            pred = model(x)\n            print(pred.sum().item())" in out


def test_a_script_already_on_torch_amp_is_left_alone():
    out, reviews = amp("""\
        scaler = torch.amp.GradScaler("cuda")
        for x, y in loader:
            with torch.autocast("cuda"):
                loss = model(x).sum()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        """)
    assert out == HEAD + textwrap.dedent("""\
        scaler = torch.amp.GradScaler("cuda")
        for x, y in loader:
            with torch.autocast("cuda"):
                loss = model(x).sum()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        """)
    assert not reviews


def test_a_scaler_name_the_script_uses_is_not_taken():
    out, _ = amp("scaler = 'minmax'\nfor x, y in loader:\n    model(x).sum().backward()\n    opt.step()\n")
    assert "scaler2 = grad_scaler()" in out and "scaler2.step(opt)" in out and "scaler = 'minmax'" in out


@pytest.mark.parametrize("text, canonical", [("amp", "amp"), ("amp,ddp", "ddp,amp"), (" ddp , amp ", "ddp,amp"),
                                             ("device,amp,amp", "device,amp")])
def test_target_lists_have_one_canonical_order(text, canonical):
    assert parse_target(text) == canonical
    assert target_bases("ddp,amp") == ("device", "ddp", "amp") and target_bases("amp") == ("device", "amp")


@pytest.mark.parametrize("text", ["", "amp,", "fp16", "ddp,cuda"])
def test_bad_target_lists_are_refused(text):
    with pytest.raises(TargetError):
        parse_target(text)


def test_cli_takes_a_target_list_and_the_config_too(tmp_path):
    script = tmp_path / "train.py"
    source = HEAD + "for x, y in loader:\n    model(x).sum().backward()\n    opt.step()\n"
    script.write_text(source)
    runner = CliRunner()
    done = runner.invoke(main, [str(script), "--to", "amp,ddp", "--diff"], catch_exceptions=False)
    assert done.exit_code == 0, done.output
    assert "+    scaler.step(opt)" in done.output and "wrap_model" in done.output
    bad = runner.invoke(main, [str(script), "--to", "ddp,fp16", "--diff"])
    assert bad.exit_code == 2 and "unknown target 'fp16'" in bad.output
    (tmp_path / "pyproject.toml").write_text('[tool.gpumigrate]\ntarget = "amp, ddp"\n')
    done = runner.invoke(main, [str(script), "--diff"], catch_exceptions=False)
    assert "+    scaler.step(opt)" in done.output and "wrap_model" in done.output
    (tmp_path / "pyproject.toml").write_text('[tool.gpumigrate]\ntarget = "amp,tpu"\n')
    done = runner.invoke(main, [str(script), "--diff"])
    assert done.exit_code == 2 and "unknown target 'tpu'" in done.output
    assert script.read_text() == source


def test_lint_fix_leaves_apex_and_half_to_the_amp_migration(tmp_path):
    """`lint --fix` has no scaler to move them to: a half-made migration would not run."""
    script = tmp_path / "train.py"
    source = ("import torch\nfrom apex import amp\nmodel = torch.nn.Linear(4, 1)\n"
              "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
              "model, opt = amp.initialize(model, opt, opt_level='O1')\nfor x, y in loader:\n"
              "    loss = model(x.half()).sum()\n    with amp.scale_loss(loss, opt) as scaled:\n"
              "        scaled.backward()\n    opt.step()\n    torch.save({'model': model.state_dict()}, 'm.pt')\n")
    script.write_text(source)
    done = CliRunner().invoke(main, ["lint", str(script), "--fix"])
    assert script.read_text() == source, "lint --fix made part of a migration"
    assert "GM501 `amp.scale_loss` becomes the GradScaler's `scale` (`gpumigrate --to amp` migrates it)" in done.output
    assert "GM502" in done.output
    done = CliRunner().invoke(main, [str(script), "--to", "ddp,amp", "--diff"])
    added = [line for line in done.output.splitlines() if line.startswith("+") and not line.startswith("+++")]
    assert "+        torch.save({'model': unwrap_model(model).state_dict()}, 'm.pt')" in added
    assert "+    scaler.scale(loss).backward()" in added and not [line for line in added if "amp." in line]


def test_a_trainer_class_computing_its_loss_in_a_method_is_autocast():
    out, reviews = amp("""\
        class Trainer:
            def __init__(self):
                self.model = torch.nn.Linear(4, 1)
                self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)

            def compute_loss(self, x, y):
                return ((self.model(x) - y) ** 2).mean()

            def fit(self):
                for x, y in loader:
                    self.opt.zero_grad()
                    loss = self.compute_loss(x, y)
                    loss.backward()
                    self.opt.step()

        Trainer().fit()
        """)
    assert not reviews
    assert ("            with autocast(self.model):\n                loss = self.compute_loss(x, y)\n"
            "            scaler.scale(loss).backward()\n            scaler.step(self.opt)\n            scaler.update()") in out
    exec(compile(out, "x.py", "exec"), {})


def test_clipping_in_both_branches_unscales_in_both(monkeypatch):
    """Each path to the step unscales once: a clip left with scaled gradients clips at
    thousands of times the intended norm (found in real ViT and BERT scripts)."""
    out, reviews = amp("""\
        fp16 = True
        for x, y in loader:
            model(x).sum().backward()
            if fp16:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            torch.nn.utils.clip_grad_value_(model.parameters(), 5.0)
            opt.step()
        """)
    assert not reviews
    assert out.count("scaler.unscale_(opt)") == 2
    assert ("    if fp16:\n        scaler.unscale_(opt)\n        torch.nn.utils.clip_grad_norm_" in out and
            "    else:\n        scaler.unscale_(opt)\n        torch.nn.utils.clip_grad_norm_" in out)
    monkeypatch.setenv("GPUMIGRATE_AMP", "fp16")  # the scaler on: a second unscale_ would raise
    exec(compile(out, "x.py", "exec"), {})
    exec(compile(out.replace("fp16 = True", "fp16 = False"), "x.py", "exec"), {})


@pytest.mark.parametrize("call, expected", [
    ("torch.cuda.amp.autocast(use_amp)", "autocast(model, enabled=use_amp)"),
    ("torch.cuda.amp.autocast(enabled=use_amp)", "autocast(model, enabled=use_amp)"),
    # dtype and positional flags: torch.autocast takes the device first, so they become keywords
    ("torch.cuda.amp.autocast(True, torch.bfloat16)", 'torch.autocast("cuda", enabled=True, dtype=torch.bfloat16)'),
])
def test_torch_cuda_amp_keeps_the_meaning_of_its_arguments(call, expected):
    out, reviews = amp(f"""\
        use_amp = True
        scaler = torch.cuda.amp.GradScaler(enabled=use_amp)
        for x, y in loader:
            with {call}:
                loss = model(x).sum()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        """)
    assert f"    with {expected}:\n" in out
    agnostic = expected.startswith("autocast(")
    # one form per file: autocast and scaler agree on the device (and so on the precision)
    assert ("scaler = grad_scaler(enabled=use_amp)" if agnostic else
            'scaler = torch.amp.GradScaler("cuda", enabled=use_amp)') in out
    assert bool(reviews) != agnostic
    exec(compile(out, "x.py", "exec"), {})


def test_the_apex_guard_goes_with_all_it_imports_unless_something_still_needs_apex():
    loop = ("model, opt = amp.initialize(model, opt, opt_level='O1')\nfor x, y in loader:\n"
            "    loss = model(x).sum()\n    with amp.scale_loss(loss, opt) as scaled:\n        scaled.backward()\n"
            "    opt.step()\n")
    guard = ("try:\n    from apex.parallel import DistributedDataParallel as DDP\n    from apex import amp{}\n"
             "except ImportError:\n    raise ImportError('Please install apex')\n")
    out, reviews = amp(guard.format("") + loop)
    assert "apex" not in out and not reviews
    out, reviews = amp(guard.format(", optimizers") + loop + "fused = optimizers.FusedAdam(model.parameters())\n")
    assert "    from apex import optimizers\nexcept ImportError:" in out and "scaler.step(opt)" in out
    assert reviews == ["`apex.optimizers.FusedAdam` (apex) has no torch equivalent the migration knows: apex stays "
                       "imported for it; replace it by hand"]


def test_apex_initialize_by_keyword_and_its_settings_torch_amp_does_not_keep():
    out, reviews = amp("from apex import amp\nmodel, opt = amp.initialize(models=model, optimizers=opt, "
                       "opt_level=args.opt_level, loss_scale=128.0)\nfor x, y in loader:\n    loss = model(x).sum()\n"
                       "    with amp.scale_loss(loss, opt) as scaled:\n        scaled.backward()\n    opt.step()\n",
                       )
    assert "amp." not in out and "scaler.step(opt)" in out
    assert len(reviews) == 2 and "O0 (float32) and O3 (pure float16) are not kept" in reviews[0]
    assert "static loss_scale" in reviews[1]


VIT_STEP = """\
from apex import amp
fp16, accumulate = True, 2
model, opt = amp.initialize(model, opt, opt_level="O2")
for step, (x, y) in enumerate(loader):
    loss = ((model(x) - y) ** 2).mean()
    opt.zero_grad() if False else None
    if accumulate > 1:
        loss = loss / accumulate
    if fp16:
        with amp.scale_loss(loss, opt) as scaled_loss:
            scaled_loss.backward()
    else:
        loss.backward()
    if (step + 1) % accumulate == 0:
        if fp16:
            torch.nn.utils.clip_grad_norm_(amp.master_params(opt), 1.0)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
"""


def test_the_apex_fp16_flag_pattern_of_real_scripts(monkeypatch):
    """`if args.fp16: with amp.scale_loss(...)` / `else: loss.backward()`, accumulation, and
    clipping in both branches (as in ViT-pytorch and the BERT examples)."""
    out, reviews = amp(VIT_STEP)
    assert not reviews, reviews
    assert ("    with autocast(model):\n        loss = ((model(x) - y) ** 2).mean()\n        opt.zero_grad() if False "
            "else None\n        if accumulate > 1:\n            loss = loss / accumulate\n"
            "    scaler.scale(loss).backward()\n    if (step + 1) % accumulate == 0:\n") in out  # one branch left
    assert out.count("scaler.unscale_(opt)") == 2 and out.count("scaler.update()") == 1
    assert "optimizer_params(opt)" in out and "amp" not in out.replace("autocast", "").replace("gpumigrate", "")
    for precision in ("fp16", "bf16"):
        monkeypatch.setenv("GPUMIGRATE_AMP", precision)
        exec(compile(out, "x.py", "exec"), {})


def test_data_made_float16_outside_the_loops_is_listed_when_the_model_goes_float32():
    out, reviews = amp("""\
        images = torch.randn(16, 4).half()
        model.half()
        for x, y in loader:
            model(x.half()).sum().backward()
            opt.step()
        """)
    assert "model.half()" not in out and "x.half()" not in out and "images = torch.randn(16, 4).half()" in out
    assert len(reviews) == 1 and reviews[0].startswith("`.half()` kept: if this feeds the model")


def test_a_checkpoint_dict_keeps_the_scaler_wherever_it_is_saved():
    out, _ = amp("""\
        def save_checkpoint(state, path):
            torch.save(state, path)
        for x, y in loader:
            model(x).sum().backward()
            opt.step()
        save_checkpoint({
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
        }, "ckpt.pt")
        ckpt = torch.load("ckpt.pt")
        opt.load_state_dict(ckpt["optimizer"])
        """)
    assert '    "optimizer": opt.state_dict(),\n    "scaler": scaler.state_dict(),\n}, "ckpt.pt")' in out
    assert 'opt.load_state_dict(ckpt["optimizer"])\nload_scaler_state(scaler, ckpt.get("scaler"))' in out


def test_apex_behind_a_flag_goes_and_the_flag_keeps_its_meaning():
    out, reviews = amp("from apex import amp\nfp16 = True\nif fp16:\n    model, opt = amp.initialize(model, opt)\n"
                       "for x, y in loader:\n    loss = model(x).sum()\n    with amp.scale_loss(loss, opt) as s:\n"
                       "        s.backward()\n    opt.step()\n")
    assert "if fp16" not in out and "amp." not in out
    assert "fp16 = True\nscaler = grad_scaler(enabled=fp16)\n" in out
    assert "    with autocast(model, enabled=fp16):\n        loss = model(x).sum()\n" in out
    assert not reviews


def test_apex_behind_a_flag_of_a_function_that_does_not_train_is_listed():
    """The flag is local to a set-up function; the training loop cannot read it."""
    out, reviews = amp("from apex import amp\ndef setup(model, opt):\n    fp16 = True\n    if fp16:\n"
                       "        model, opt = amp.initialize(model, opt)\n    return model, opt\n"
                       "model, opt = setup(model, opt)\n"
                       "for x, y in loader:\n    loss = model(x).sum()\n    with amp.scale_loss(loss, opt) as s:\n"
                       "        s.backward()\n    opt.step()\n")
    assert "enabled=" not in out and "scaler = grad_scaler()" in out
    assert reviews == ["`if fp16:` switched reduced precision, but `fp16` is local to a function, and the training "
                       "or its checkpoints reach beyond it: mixed precision now always runs; pass `enabled=fp16` to "
                       "autocast() and grad_scaler() if the flag must keep its meaning"]


# ---------------------------------------------------------------- binary_cross_entropy (issue 18 item 8)

# CUDA autocast raises for binary_cross_entropy whatever its input; CPU autocast does not. The
# runs below stand in for CUDA: binary_cross_entropy refuses anything but float32 input and target.
STRICT_BCE = """\
import torch.nn.functional as _F
_real_bce = _F.binary_cross_entropy
def _float32_only(input, target, *args, **kwargs):
    assert input.dtype == torch.float32 and target.dtype == torch.float32, (input.dtype, target.dtype)
    return _real_bce(input, target, *args, **kwargs)
_F.binary_cross_entropy = _float32_only
"""


def _runs_with_float32_bce(out: str, monkeypatch) -> None:
    for precision in ("fp16", "bf16"):
        monkeypatch.setenv("GPUMIGRATE_AMP", precision)
        exec(compile(out.replace("import torch\n", "import torch\n" + STRICT_BCE, 1), "x.py", "exec"), {})


@pytest.mark.parametrize("loss", ["crit(probs, torch.sigmoid(y))",
                                  "torch.nn.functional.binary_cross_entropy(probs, torch.sigmoid(y))",
                                  "torch.nn.BCELoss()(input=probs, target=torch.sigmoid(y))"])
def test_binary_cross_entropy_runs_after_autocast_on_float32(loss, monkeypatch):
    out, reviews = amp(f"""\
        crit = torch.nn.BCELoss().cuda()
        for x, y in loader:
            probs = torch.sigmoid(model(x)).view(-1, 1)
            loss = {loss}
            loss.backward()
            opt.step()
        """)
    assert not reviews
    assert "    with autocast(model):\n        probs = torch.sigmoid(model(x)).view(-1, 1)\n    loss = " in out
    assert "probs.float()" in out
    _runs_with_float32_bce(out, monkeypatch)


def test_a_binary_cross_entropy_input_that_runs_the_model_is_computed_before_its_line(monkeypatch):
    """The DCGAN shape: `criterion(netD(fake), label)` for G, two BCE losses for D."""
    out, reviews = amp("""\
        netD = torch.nn.Sequential(torch.nn.Linear(1, 1), torch.nn.Sigmoid())
        optD = torch.optim.SGD(netD.parameters(), lr=0.1)
        criterion = torch.nn.BCELoss()
        for x, y in loader:
            real = torch.ones(x.size(0), 1)
            fake = model(x)
            # D
            errD = criterion(netD(torch.sigmoid(y)), real) + criterion(netD(fake.detach()), 1 - real)
            errD.backward()
            optD.step()
            # G
            errG = criterion(netD(fake), real)
            errG.backward()
            opt.step()
        """)
    assert not reviews
    assert ("    # D\n    with autocast(netD):\n        probs = netD(torch.sigmoid(y))\n"
            "        probs_2 = netD(fake.detach())\n"
            "    errD = criterion(probs.float(), real) + criterion(probs_2.float(), 1 - real)\n") in out
    assert "    with autocast(netD):\n        probs = netD(fake)\n    errG = criterion(probs.float(), real)\n" in out
    _runs_with_float32_bce(out, monkeypatch)


def test_binary_cross_entropy_in_methods_helpers_and_evaluation(monkeypatch):
    out, reviews = amp("""\
        def bce(p, t):
            return torch.nn.functional.binary_cross_entropy(p, t)

        class Trainer:
            def __init__(self, net):
                self.net = net
                self.criterion = torch.nn.BCELoss()
                self.opt = torch.optim.SGD(self.net.parameters(), lr=0.1)

            def fit(self):
                for x, y in loader:
                    loss = self.criterion(torch.sigmoid(self.net(x)), torch.sigmoid(y))
                    self.opt.zero_grad()
                    loss.backward()
                    self.opt.step()

        Trainer(model).fit()
        for x, y in loader:
            p = torch.sigmoid(model(x))
            bce(p, torch.sigmoid(y)).backward()
            opt.step()
        with torch.no_grad():
            total = 0.0
            for x, y in loader:
                out = torch.sigmoid(model(x))
                total += bce(out, torch.sigmoid(y)).item()
        """)
    assert not reviews
    assert ("            with autocast(self.net):\n                probs = torch.sigmoid(self.net(x))\n"
            "            loss = self.criterion(probs.float(), torch.sigmoid(y))\n") in out
    assert "    scaler.scale(bce(p.float(), torch.sigmoid(y))).backward()\n" in out
    assert ("        with autocast(model):\n            out = torch.sigmoid(model(x))\n"
            "        total += bce(out.float(), torch.sigmoid(y)).item()\n") in out
    _runs_with_float32_bce(out, monkeypatch)


def test_a_loss_that_is_not_binary_cross_entropy_stays_under_autocast():
    out, _ = amp("""\
        crit = torch.nn.BCEWithLogitsLoss()
        for x, y in loader:
            loss = crit(model(x), torch.sigmoid(y))
            loss.backward()
            opt.step()
        """)
    assert "    with autocast(model):\n        loss = crit(model(x), torch.sigmoid(y))\n" in out
    assert ".float()" not in out


# ---------------------------------------------------------------- `.numpy()` of autocast values

def test_numpy_of_a_floating_autocast_value_gets_float32_and_indices_stay():
    out, reviews = amp("""\
        history = []
        for x, y in loader:
            out = model(x)
            probs = torch.softmax(out, 1)
            loss = ((out - y) ** 2).mean()
            loss.backward()
            opt.step()
            history.append((probs.detach()[0].cpu().numpy(), out.argmax(1).numpy(), y.numpy(),
                            loss.detach().numpy(), (out > 0).numpy()))
        """)
    assert not reviews, reviews
    assert ("history.append((probs.detach()[0].cpu().float().numpy(), out.argmax(1).numpy(), y.numpy(),\n"
            "                    loss.detach().float().numpy(), (out > 0).numpy()))") in out


def test_numpy_of_an_autocast_value_of_unknown_dtype_is_listed():
    out, reviews = amp("""\
        for x, y in loader:
            out = model(x)
            loss = ((out - y) ** 2).mean()
            loss.backward()
            opt.step()
            print(out.round().numpy())
        """)
    assert "out.round().numpy()" in out
    assert any("`.numpy()` of a value computed under autocast" in r for r in reviews)


# ---------------------------------------------------------------- branches left with nothing to choose

def test_if_half_left_empty_goes_and_an_emptied_branch_negates_its_test():
    out, reviews = amp("""\
        half = True
        if half:
            model.half()
        for x, y in loader:
            if half:
                x = x.half()
            else:
                x = x.float()
            model(x).sum().backward()
            opt.step()
        """)
    assert not reviews
    assert "if half:" not in out and "pass" not in out
    assert "    if not half:\n        x = x.float()\n" in out


def test_identical_branches_with_a_call_in_the_test_are_kept():
    """The test may do something: evaluating it once more keeps that."""
    out, _ = amp("""\
        from apex import amp
        model, opt = amp.initialize(model, opt)
        def fp16():
            return True
        for x, y in loader:
            loss = model(x).sum()
            if fp16():
                with amp.scale_loss(loss, opt) as scaled:
                    scaled.backward()
            else:
                loss.backward()
            opt.step()
        """)
    assert "    if fp16():\n        scaler.scale(loss).backward()\n    else:\n        scaler.scale(loss).backward()\n" in out


# ---------------------------------------------------------------- the script's own precision switch (issue 20)

FLAGGED_HALF = """\
    import argparse
    parser = argparse.ArgumentParser()
    parser.add_argument("--half", action="store_true")
    parser.add_argument("--precision", type=int, default=32)
    args = parser.parse_args(ARGV)
    if FLAG:
        model.half()
    for x, y in loader:
        if FLAG:
            x = x.half()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
    """


@pytest.mark.parametrize("flag, on", [("args.half", ["--half"]), ("args.precision == 16", ["--precision", "16"])])
def test_a_precision_flag_becomes_enabled_of_autocast_and_the_scaler(flag, on, monkeypatch):
    out, reviews = amp(FLAGGED_HALF.replace("FLAG", flag))
    assert not reviews, reviews
    assert f"args = parser.parse_args(ARGV)\nscaler = grad_scaler(enabled={flag})\n" in out
    assert f"    with autocast(model, enabled={flag}):\n        loss = ((model(x) - y) ** 2).mean()\n" in out
    assert "if args" not in out and "pass" not in out and ".half()" not in out
    monkeypatch.setenv("GPUMIGRATE_AMP", "fp16")  # the runtime's switch is on: the script's decides
    for argv, enabled in (([], False), (on, True)):
        seen = []
        space = {"ARGV": argv}
        exec(compile(out.replace("        loss = ((model(x) - y) ** 2).mean()\n",
                                 "        loss = ((model(x) - y) ** 2).mean()\n"
                                 "        seen.append(torch.is_autocast_enabled(x.device.type))\n"),
                     "x.py", "exec"), dict(space, seen=seen))
        assert seen and set(seen) == {enabled}, (argv, seen)  # off: float32, as before


def test_a_flag_local_to_the_training_function_gets_its_scaler_there():
    out, reviews = amp("""\
        def main(fp16):
            \"\"\"Train.\"\"\"
            if fp16:
                model.half()
            for x, y in loader:
                if fp16:
                    x = x.half()
                loss = model(x).sum()
                loss.backward()
                opt.step()
        def evaluate(fp16):
            args = fp16
        main(False)
        """)
    assert not reviews, reviews
    assert ('def main(fp16):\n    """Train."""\n    scaler = grad_scaler(enabled=fp16)\n    for x, y in loader:\n'
            "        with autocast(model, enabled=fp16):\n") in out
    assert out.count("scaler = grad_scaler") == 1


def test_flags_that_disagree_keep_mixed_precision_on_and_say_why():
    out, reviews = amp("""\
        half, fp16 = False, True
        if half:
            model.half()
        if fp16:
            model.half()
        for x, y in loader:
            model(x).sum().backward()
            opt.step()
        """)
    assert "enabled=" not in out and "scaler = grad_scaler()\n" in out
    assert reviews == ["`if half:` switched reduced precision, but other tests switched it too (`if fp16:`, "
                       "`if half:`): mixed precision now always runs; pass `enabled=` to autocast() and grad_scaler() "
                       "if a flag must keep its meaning"]


def test_identical_branches_collapse_and_keep_their_comments():
    out, reviews = amp("""\
        from apex import amp
        fp16 = True
        if fp16:
            model, opt = amp.initialize(model, opt)
        for x, y in loader:
            loss = model(x).sum()
            if fp16:
                # apex scales the loss so that fp16 gradients do not underflow
                with amp.scale_loss(loss, opt) as scaled:
                    scaled.backward()
            else:
                loss.backward()  # plain float32
            opt.step()
        """)
    assert not reviews, reviews
    assert "if fp16" not in out and "else" not in out and "pass" not in out
    assert ("    # apex scales the loss so that fp16 gradients do not underflow\n    # plain float32\n"
            "    scaler.scale(loss).backward()\n    scaler.step(opt)\n") in out


def test_an_emptied_if_goes_with_its_comments_kept_and_no_extra_blank_line():
    out, _ = amp("""\
        half = False

        if half:
            # float16 weights: half the memory
            model.half()

        for x, y in loader:
            model(x).sum().backward()
            opt.step()
        """)
    assert "if half" not in out and "pass" not in out
    assert "half = False\nscaler = grad_scaler(enabled=half)\n\n# float16 weights: half the memory\n\nfor x, y in loader:\n" \
        in out


def test_a_removed_block_leaves_one_blank_line_where_there_was_one():
    out, _ = amp("""\
        from apex import amp
        fp16 = True

        if fp16:
            model, opt = amp.initialize(model, opt)

        for x, y in loader:
            loss = model(x).sum()
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
        """)
    assert "fp16 = True\nscaler = grad_scaler(enabled=fp16)\n\nfor x, y in loader:\n" in out


def test_an_else_the_device_pass_emptied_goes():
    out, _ = amp("""\
        cuda = False
        if not cuda:
            print("training on the CPU")
        else:
            torch.cuda.set_device(0)
        if cuda:
            torch.cuda.set_device(0)
        for x, y in loader:
            model(x).sum().backward()
            opt.step()
        """)
    assert "else" not in out and "pass" not in out and "if cuda" not in out
    assert 'if not cuda:\n    print("training on the CPU")\nfor x, y in loader:\n' in out


def test_a_script_already_on_torch_amp_gets_one_line_saying_so():
    source = HEAD + textwrap.dedent("""\
        scaler = torch.amp.GradScaler("cpu")
        for x, y in loader:
            with torch.autocast("cpu"):
                loss = model(x).sum()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        for x, y in loader:
            with torch.amp.autocast("cpu"):
                print(model(x).sum())
        """)
    result = migrate(source.encode(), "amp")
    assert result.error is None and result.new_source is None
    assert [(f.line, f.message, f.review, f.fixed, f.note) for f in result.findings] == [
        (6, "already uses torch.amp autocast/GradScaler: nothing to add", False, False, True)]


def test_the_already_on_torch_amp_line_is_a_note_not_work_for_a_human(tmp_path):
    from click.testing import CliRunner

    from gpumigrate import cli

    script = tmp_path / "t.py"
    script.write_text("import torch\nmodel = torch.nn.Linear(2, 2)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                      "scaler = torch.amp.GradScaler('cpu')\nfor x in [torch.ones(2)]:\n"
                      "    with torch.autocast('cpu'):\n        loss = model(x).sum()\n"
                      "    scaler.scale(loss).backward()\n    scaler.step(opt)\n    scaler.update()\n")
    run = CliRunner().invoke(cli.main, [str(script), "--to", "amp", "--no-cache", "--report", str(tmp_path / "r.md")])
    assert run.exit_code == 0, run.output
    assert f"{script}:4:10: GM500 note: already uses torch.amp" in run.output
    assert "review by hand:" not in run.output and "0 to review by hand" in run.output
    report = (tmp_path / "r.md").read_text()
    assert "### Notes" in report and "### Review by hand" not in report


def test_a_flag_bound_in_a_branch_is_not_trusted_with_the_scaler():
    """A scaler made after one of two assignments would not exist on the other path."""
    out, reviews = amp("""\
        import sys
        if len(sys.argv) > 5:
            fp16 = True
        else:
            fp16 = False
        if fp16:
            model.half()
        for x, y in loader:
            model(x).sum().backward()
            opt.step()
        """)
    assert "enabled=" not in out and "scaler = grad_scaler()\n" in out
    assert reviews == ["`if fp16:` switched reduced precision, but `fp16` is not assigned once, where the scaler can "
                       "be made: mixed precision now always runs; pass `enabled=fp16` to autocast() and grad_scaler() "
                       "if the flag must keep its meaning"]


def test_a_flag_parsed_under_the_main_guard_keeps_its_meaning():
    out, reviews = amp("""\
        def train(model):
            if args.fp16:
                model.half()
            for x, y in loader:
                model(x).sum().backward()
                opt.step()
        if __name__ == "__main__":
            import argparse
            parser = argparse.ArgumentParser()
            parser.add_argument("--fp16", action="store_true")
            args = parser.parse_args([])
            train(model)
        """)
    assert not reviews, reviews
    assert "    args = parser.parse_args([])\n    scaler = grad_scaler(enabled=args.fp16)\n    train(model)\n" in out
    exec(compile(out, "x.py", "exec"), {"__name__": "__main__"})


@pytest.mark.parametrize("env, flag, on", [("fp16", True, True), ("fp16", False, False), ("off", True, False),
                                           ("bf16", False, False)])
def test_the_runtime_runs_mixed_precision_only_where_both_switches_allow_it(env, flag, on, monkeypatch):
    """`enabled=args.fp16` and GPUMIGRATE_AMP: mixed precision (and loss scaling in float16)
    only where both say so; off, float32 and a pass-through scaler."""
    import torch

    from gpumigrate.runtime import autocast, grad_scaler

    monkeypatch.setenv("GPUMIGRATE_AMP", env)
    model = torch.nn.Linear(4, 1)
    with autocast(model, enabled=flag):
        assert torch.is_autocast_enabled("cpu") is on
        loss = model(torch.randn(2, 4)).sum()
    scaler = grad_scaler(enabled=flag)
    scaled = scaler.scale(loss)
    assert scaler.is_enabled() is (on and env == "fp16")
    assert scaled is loss or on  # off: the loss itself
