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
