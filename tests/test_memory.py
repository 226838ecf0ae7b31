"""Why GM301/GM302 matter: a loss kept as a tensor keeps its step's autograd graph alive.

`total_loss += loss` chains every step's graph onto `total_loss`, and `losses.append(loss)`
keeps each step's graph in the list, so the number of live graph nodes grows with the number
of steps. After the migration (`loss.item()`) nothing of the graphs outlives its step.

Liveness probe: autograd nodes do not support weak references, but a hook registered on a
node is owned by that node, so a weak reference to the hook dies exactly when the node is
freed. A forward hook on the model registers such a sentinel on each step's output node.
(After `backward()` the saved activations are already released even in the leaky version;
what leaks is the graph itself, which also keeps the loss and the next step's use from being
freed: on a GPU that is the classic slow growth to an OOM.)
"""

import gc
import weakref

import pytest
import torch
import torch.nn as nn

from tests.conftest import migrate

SNIPPET = '''\
import torch
import torch.nn.functional as F


def run(model, steps, lr=0.05):
    total_loss = 0
    losses = []
    for step in range(steps):
        x = torch.randn(32, 16)
        y = torch.randint(0, 4, (32,))
        model.zero_grad()
        output = model(x)
        loss = F.cross_entropy(output, y)
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
        total_loss += loss
        losses.append(loss)
    return total_loss / steps, losses
'''


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny ops gain nothing from threads, and a busy machine makes them crawl."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class _Sentinel:
    """A no-op node hook; its lifetime is its node's lifetime."""

    def __call__(self, grad_inputs, grad_outputs):
        return None


def _hook(node):
    sentinel = _Sentinel()
    node.register_hook(sentinel)
    return sentinel


def live_graphs(source, steps):
    """Run `run(model, steps)` from `source`; return (live step graphs after it returned, result)."""
    namespace = {}
    exec(compile(source, "snippet.py", "exec"), namespace)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    probes = []
    model.register_forward_hook(
        lambda module, inputs, output: probes.append(weakref.ref(_hook(output.grad_fn))))
    result = namespace["run"](model, steps)  # keep what the function returns alive
    gc.collect()
    assert len(probes) == steps
    return sum(ref() is not None for ref in probes), result


def test_original_keeps_every_step_graph_alive():
    few, _ = live_graphs(SNIPPET, 10)
    many, (average, losses) = live_graphs(SNIPPET, 50)
    assert few == 10
    assert many == 50  # one graph per step: growth proportional to the step count
    assert isinstance(average, torch.Tensor) and average.grad_fn is not None
    assert all(loss.grad_fn is not None for loss in losses)


def test_probe_sees_graphs_being_freed():
    """The probe is not vacuous: dropping the returned tensors frees every graph."""
    namespace = {}
    exec(compile(SNIPPET, "snippet.py", "exec"), namespace)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    probes = []
    model.register_forward_hook(
        lambda module, inputs, output: probes.append(weakref.ref(_hook(output.grad_fn))))
    result = namespace["run"](model, 20)
    gc.collect()
    assert sum(ref() is not None for ref in probes) == 20
    del result
    gc.collect()
    assert sum(ref() is not None for ref in probes) == 0


def test_migration_frees_the_graphs():
    result = migrate(SNIPPET.encode(), "device")
    assert result.error is None
    assert result.new_source is not None, "GM301/GM302 did not rewrite the snippet"
    migrated = result.new_source.decode()
    assert "total_loss += loss.item()" in migrated
    assert "losses.append(loss.item())" in migrated
    assert {"GM301", "GM302"} <= {f.code for f in result.findings if f.fixed}

    few, _ = live_graphs(migrated, 10)
    many, (average, losses) = live_graphs(migrated, 50)
    assert few <= 1 and many <= 1  # bounded, independent of the step count
    assert isinstance(average, float) and all(isinstance(loss, float) for loss in losses)

    # Same training, same numbers: only what is kept changed.
    _, (original_average, original_losses) = live_graphs(SNIPPET, 50)
    assert [loss.item() for loss in original_losses] == losses
    assert abs(original_average.item() - average) < 1e-5  # float32 vs float64 running sum


# GM305: a model converted to float16 twice. The BatchNorm guard must follow the last
# conversion: after an earlier one, the second `.half()` puts BatchNorm back in float16 under
# the float32 hooks, and the forward pass fails with "mixed dtype (CPU)".
HALF_TWICE = '''\
import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        return self.bn(self.conv(x))


device = torch.device("cpu")
torch.manual_seed(0)
loader = [(torch.randn(8, 1, 6, 6), torch.zeros(8)) for _ in range(2)]
model = Net()
model.half()
outputs = []
net = model.half().to(device)
for x, y in loader:
    out = net(x.half())
    outputs.append(out)
'''


def conversion_lines(source):
    lines = source.splitlines()
    return [lines.index("model.half()") + 1, lines.index("net = model.half().to(device)") + 1]


def run_half_script(source):
    namespace = {"__name__": "half_script"}
    exec(compile(source, "half_script.py", "exec"), namespace)
    return namespace


def test_half_twice_guards_after_the_last_conversion_and_runs():
    result = migrate(HALF_TWICE.encode(), "device")
    assert result.error is None
    assert result.new_source is not None, "GM305 did not rewrite the snippet"
    migrated = result.new_source.decode()
    assert "from gpumigrate.runtime import keep_batchnorm_fp32\n" in migrated
    assert "net = model.half().to(device)\nkeep_batchnorm_fp32(net)\nfor x, y in loader:\n" in migrated
    assert migrated.count("keep_batchnorm_fp32(") == 1  # one guard, after the last conversion
    gm305 = [f for f in result.findings if f.code == "GM305"]
    assert [f.line for f in gm305] == conversion_lines(HALF_TWICE)  # both conversions are reported
    assert all(f.fixed for f in gm305)

    namespace = run_half_script(migrated)  # no "mixed dtype" error
    net = namespace["net"]
    assert net.bn.weight.dtype == net.bn.running_var.dtype == torch.float32
    assert net.conv.weight.dtype == torch.float16
    assert len(namespace["outputs"]) == 2
    assert all(out.dtype == torch.float16 and torch.isfinite(out).all() for out in namespace["outputs"])

    again = migrate(result.new_source, "device")  # idempotent
    assert again.error is None and again.new_source is None
    assert not [f for f in again.findings if f.code == "GM305"]


def test_half_twice_guard_after_the_first_conversion_fails():
    """What the fix avoids: the guard after `model.half()` alone is undone by the second
    conversion. Migrating that placement adds the guard after the last conversion."""
    migrated = migrate(HALF_TWICE.encode(), "device").new_source.decode()
    early = migrated.replace("keep_batchnorm_fp32(net)\n", "").replace(
        "model.half()\n", "model.half()\nkeep_batchnorm_fp32(model)\n", 1)
    assert early.count("keep_batchnorm_fp32(") == 1
    with pytest.raises(RuntimeError, match="mixed dtype"):
        run_half_script(early)

    result = migrate(early.encode(), "device")
    assert result.error is None and result.new_source is not None
    fixed = result.new_source.decode()
    assert "net = model.half().to(device)\nkeep_batchnorm_fp32(net)\n" in fixed
    assert [f.line for f in result.findings if f.code == "GM305"] == conversion_lines(early)
