"""The deprecations table against the installed torch: removed symbols are gone, deprecated ones
still work and say they are deprecated (a warning when called, else their docstring)."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings
from typing import Any, Callable, Dict

import pytest

from gpumigrate.codemods.deprecations import BY_NAME, CURRENT_TO, DEPRECATIONS, Deprecation, removed_by

# Every name of TorchFix's deprecated_symbols.yaml (commit 0ee382c): the table must keep them all.
TORCHFIX_NAMES = """
torch.solve torch.qr torch.symeig torch.chain_matmul torch.cholesky torch.ger torch.lu_solve
torch.norm torch.range torch.svd torch.triangular_solve torch.lu torch.matrix_rank torch.lstsq
torch.nn.UpsamplingNearest2d torch.nn.UpsamplingBilinear2d torch.testing.assert_allclose
torch.nn.utils.weight_norm torch.utils._pytree._register_pytree_node torch.backends.cuda.sdp_kernel
torch.cuda.amp.autocast torch.cuda.amp.custom_fwd torch.cuda.amp.custom_bwd torch.cpu.amp.autocast
functorch.vmap functorch.grad functorch.vjp functorch.jvp functorch.jacrev functorch.jacfwd
functorch.hessian functorch.functionalize
""".split()


def _version_key(version: str) -> tuple:
    return tuple(int(part) for part in version.split("."))


def test_table_keeps_every_torchfix_symbol() -> None:
    missing = [name for name in TORCHFIX_NAMES if name not in BY_NAME]
    assert missing == []
    assert {e.name for e in DEPRECATIONS if e.in_torchfix} == set(TORCHFIX_NAMES)


def test_table_is_well_formed() -> None:
    assert len(BY_NAME) == len(DEPRECATIONS), "duplicate names"
    for entry in DEPRECATIONS:
        assert entry.replacement and entry.note, entry.name
        for version in (entry.deprecated, entry.removed):
            if version is not None:
                assert _version_key(version) <= _version_key(CURRENT_TO), entry.name
        if entry.deprecated and entry.removed:
            assert _version_key(entry.deprecated) < _version_key(entry.removed), entry.name


def test_table_imports_without_torch() -> None:
    code = ("import sys; sys.modules['torch'] = None; sys.modules['functorch'] = None\n"
            "import gpumigrate.codemods.deprecations as d; print(len(d.DEPRECATIONS))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == len(DEPRECATIONS)


# --- against the installed torch ---------------------------------------------------------------

torch = pytest.importorskip("torch", reason="torch is not installed: the table cannot be checked")
TORCH_VERSION = ".".join(torch.__version__.split("+")[0].split(".")[:2])


def _resolve(name: str) -> Any:
    """The object a qualified name denotes; AttributeError or ImportError when it is gone."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            if cut == 1:
                raise
            continue
        for part in parts[cut:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(name)


def _calls() -> Dict[str, Callable[[], Any]]:
    """A cheap call for each deprecated symbol whose deprecation warns when used."""
    F = torch.nn.functional
    eye, ones = torch.eye(2), torch.ones(2)
    img = torch.ones(1, 1, 2, 2)
    calls: Dict[str, Callable[[], Any]] = {
        "torch.qr": lambda: torch.qr(eye),
        "torch.chain_matmul": lambda: torch.chain_matmul(eye, eye),
        "torch.cholesky": lambda: torch.cholesky(eye),
        "torch.lu": lambda: torch.lu(eye),
        "torch.lu_solve": lambda: torch.lu_solve(torch.ones(2, 1), *torch.linalg.lu_factor(eye)),
        "torch.triangular_solve": lambda: torch.triangular_solve(torch.ones(2, 1), eye),
        "torch.range": lambda: torch.range(0, 3),
        "torch.set_default_tensor_type": lambda: torch.set_default_tensor_type(torch.FloatTensor),
        "torch.Tensor.storage": lambda: ones.storage(),
        "torch.nn.functional.upsample": lambda: F.upsample(img, scale_factor=2),
        "torch.nn.functional.upsample_nearest": lambda: F.upsample_nearest(img, scale_factor=2),
        "torch.nn.functional.upsample_bilinear": lambda: F.upsample_bilinear(img, scale_factor=2),
        "torch.nn.utils.weight_norm": lambda: torch.nn.utils.weight_norm(torch.nn.Linear(2, 2)),
        "torch.nn.utils.clip_grad_norm":
            lambda: torch.nn.utils.clip_grad_norm([torch.nn.Parameter(ones)], 1.0),
        "torch.nn.utils.stateless.functional_call":
            lambda: torch.nn.utils.stateless.functional_call(torch.nn.Linear(2, 2), {}, (ones,)),
        "torch.backends.cuda.sdp_kernel": lambda: torch.backends.cuda.sdp_kernel().__enter__(),
        "torch.cuda.amp.autocast": lambda: torch.cuda.amp.autocast(),
        "torch.cpu.amp.autocast": lambda: torch.cpu.amp.autocast(),
        "torch.cuda.amp.GradScaler": lambda: torch.cuda.amp.GradScaler(),
        "torch.cpu.amp.GradScaler": lambda: torch.cpu.amp.GradScaler(),
        "torch.cuda.amp.custom_fwd": lambda: torch.cuda.amp.custom_fwd(lambda: None),
        "torch.cuda.amp.custom_bwd": lambda: torch.cuda.amp.custom_bwd(lambda: None),
        "torch.testing.assert_allclose": lambda: torch.testing.assert_allclose(ones, ones),
        "torch.utils._pytree._register_pytree_node": lambda: torch.utils._pytree._register_pytree_node(
            type("Box", (), {}), lambda box: ([], None), lambda leaves, ctx: None),
        "torch.jit.script": lambda: torch.jit.script(lambda x: x),  # warns, then fails on source
        "torch.jit.trace": lambda: torch.jit.trace(lambda x: x * 2, ones),
    }
    for name in ("uniform", "normal", "constant", "eye", "dirac", "xavier_uniform", "xavier_normal",
                 "kaiming_uniform", "kaiming_normal", "orthogonal", "sparse"):
        shape = (1, 1, 3) if name == "dirac" else (2, 2)
        args = {"constant": (0.5,), "sparse": (0.5,)}.get(name, ())
        calls[f"torch.nn.init.{name}"] = (
            lambda fn=getattr(torch.nn.init, name), shape=shape, args=args: fn(torch.empty(shape), *args))
    for name in ("vmap", "grad", "vjp", "jvp", "jacrev", "jacfwd", "hessian", "functionalize"):
        def call(name: str = name) -> Any:
            fn = getattr(importlib.import_module("functorch"), name)
            x = torch.tensor(1.0)
            if name == "vjp":
                return fn(torch.sin, x)
            if name == "jvp":
                return fn(torch.sin, (x,), (x,))
            return fn(torch.sin)
        calls[f"functorch.{name}"] = call
    return calls


CALLS = _calls()


def _warnings_of(call: Callable[[], Any]) -> list:
    default_dtype = torch.get_default_dtype()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            call()
        except Exception:  # noqa: BLE001  (the warning, if any, came before the failure)
            pass
        finally:
            torch.set_default_dtype(default_dtype)
    return [str(w.message) for w in caught]


def _says_deprecated(text: str) -> bool:
    return "deprecat" in text.lower()


@pytest.mark.parametrize("entry", [e for e in DEPRECATIONS if removed_by(e, TORCH_VERSION)],
                         ids=lambda e: e.name)
def test_removed_symbol_is_gone(entry: Deprecation) -> None:
    try:
        obj = _resolve(entry.name)
    except (AttributeError, ImportError):
        return
    # torch keeps some removed functions as stubs that only raise
    assert callable(obj), f"{entry.name} is listed removed in {entry.removed} but still exists"
    try:
        obj(torch.eye(2), torch.eye(2))
    except RuntimeError as error:
        if "removed" in str(error):
            return
    except Exception:  # noqa: BLE001  (a working function refusing these arguments)
        pass
    pytest.fail(f"{entry.name} is listed removed in {entry.removed} but still works")


@pytest.mark.parametrize("entry", [e for e in DEPRECATIONS if not removed_by(e, TORCH_VERSION)],
                         ids=lambda e: e.name)
def test_deprecated_symbol_exists_and_says_so(entry: Deprecation) -> None:
    if entry.deprecated and _version_key(entry.deprecated) > _version_key(TORCH_VERSION):
        pytest.skip(f"deprecated in {entry.deprecated}, after the installed torch {TORCH_VERSION}")
    obj = _resolve(entry.name)  # raises if the symbol is gone: then the table is wrong
    call = CALLS.get(entry.name)
    if call is not None:
        messages = _warnings_of(call)
        assert any(_says_deprecated(m) for m in messages), (entry.name, messages)
    else:
        # listed as removed later (CURRENT_TO) symbols must warn: give them a call above
        assert entry.removed is None, f"{entry.name}: a symbol removed in {entry.removed} needs a call"
        assert _says_deprecated(getattr(obj, "__doc__", None) or ""), f"{entry.name}: no warning, no doc"


def test_every_warning_call_belongs_to_an_entry() -> None:
    assert set(CALLS) <= set(BY_NAME)
