"""Data: torch symbols that are deprecated or removed, with the release of each change.

No rules here and no torch import: rules (and `tests/test_deprecations.py`) read `DEPRECATIONS`.
The table covers every symbol of TorchFix's `deprecated_symbols.yaml` (its last commit,
0ee382c, February 2025), written in our own form, plus symbols deprecated or removed since
and a few older ones training scripts still use. Every entry was checked against torch
2.13.0 (the test does so on every run); a version we could not establish from a release
note, pull request or torch's own warning text is `None` and `version_checked` says so.

`removed` is the first release without a working symbol: either the name is gone, or it is
a stub that raises `RuntimeError` (torch kept `torch.solve`, `torch.lstsq`, ... as such
stubs, so `getattr` still works on them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

# The newest torch release the table is kept current to.
CURRENT_TO = "2.14"


@dataclass(frozen=True)
class Deprecation:
    """One deprecated or removed torch symbol."""

    name: str                   # qualified name, as a rule would resolve it
    deprecated: Optional[str]   # first torch release that deprecated it (None: not established)
    removed: Optional[str]      # first torch release without it (None: still there)
    replacement: str            # qualified name of the drop-in replacement, or a short text
    note: str                   # one line: what changes when moving to the replacement
    source: str = ""            # where the versions come from
    version_checked: bool = True  # False: `deprecated` is a lower bound or not established
    drop_in: bool = False       # True: `replacement` is a qualified name taking the same arguments
    in_torchfix: bool = False   # listed in TorchFix's deprecated_symbols.yaml


_LINALG_19 = "deprecated by the torch.linalg work of 1.9 (pytorch#55953)"

DEPRECATIONS: Tuple[Deprecation, ...] = (
    # --- linear algebra: removed (calls raise RuntimeError from stubs in torch/_linalg_utils.py)
    Deprecation("torch.solve", "1.9", "1.13", "torch.linalg.solve",
                "arguments reversed: torch.solve(B, A).solution is torch.linalg.solve(A, B)",
                "pytorch#57741 deprecates, pytorch#70986 removes", in_torchfix=True),
    Deprecation("torch.symeig", "1.9", "2.0", "torch.linalg.eigh",
                "eigh reads the lower triangle by default (symeig the upper): pass UPLO='U'; "
                "eigenvalues only: torch.linalg.eigvalsh",
                "pytorch#57732 deprecates, pytorch#70988 removes (after pytorch/xla#4498, Jan 2023)",
                in_torchfix=True),
    Deprecation("torch.matrix_rank", "1.9", "1.13", "torch.linalg.matrix_rank",
                "`symmetric=` becomes `hermitian=`",
                "pytorch#57734 deprecates, pytorch#70981 removes", in_torchfix=True),
    Deprecation("torch.lstsq", "1.9", "1.13", "torch.linalg.lstsq",
                "arguments reversed and the result is a named tuple (solution, residuals, ...)",
                "pytorch#57743 deprecates, pytorch#70980 removes", in_torchfix=True),
    Deprecation("torch.eig", "1.9", "1.13", "torch.linalg.eig",
                "returns complex eigenvalues and eigenvectors; torch.linalg.eigvals for values only",
                "pytorch#70982 removes (merged summer 2022)"),
    # --- linear algebra: the LAPACK names of torch 0.4/1.0 (2018 scripts), gone since 1.2-1.3
    Deprecation("torch.gesv", "1.1", "1.2", "torch.linalg.solve",
                "arguments reversed: torch.gesv(B, A)[0] is torch.linalg.solve(A, B)",
                "deprecated for torch.solve in 1.1 (its warning: 'will be removed in the next release')"),
    Deprecation("torch.gels", "1.2", "1.3", "torch.linalg.lstsq",
                "arguments reversed and the solution has n rows (max(m, n) before)",
                "pytorch#26480 removes it for 1.3 ('deprecated in v1.2.0')"),
    Deprecation("torch.potrf", "1.0", "1.2", "torch.linalg.cholesky",
                "potrf's default was the upper factor: torch.potrf(A) is torch.linalg.cholesky(A).mH",
                "deprecated for torch.cholesky in 1.0 (pyro-ppl/pyro#1529)", version_checked=False),
    Deprecation("torch.potrs", "1.1", "1.2", "torch.cholesky_solve",
                "same arguments; potrs's default was upper=True, cholesky_solve's is upper=False",
                "deprecated for torch.cholesky_solve in 1.1", version_checked=False),
    Deprecation("torch.potri", "1.1", "1.2", "torch.cholesky_inverse",
                "same arguments; potri's default was upper=True, cholesky_inverse's is upper=False",
                "deprecated for torch.cholesky_inverse in 1.1", version_checked=False),
    Deprecation("torch.trtrs", "1.1", "1.2", "torch.linalg.solve_triangular",
                "arguments reversed, the solution alone: trtrs(b, A)[0] is solve_triangular(A, b, upper=True)",
                "deprecated for torch.triangular_solve in 1.1", version_checked=False),
    Deprecation("torch.btrifact", "1.1", "1.2", "torch.linalg.lu_factor",
                "same (LU, pivots) result", "deprecated for torch.lu in 1.1 (locuslab/mpc.pytorch#16)",
                version_checked=False),
    Deprecation("torch.btrifact_with_info", "1.1", "1.2", "torch.linalg.lu_factor_ex",
                "same (LU, pivots, info) result", "as torch.btrifact", version_checked=False),
    Deprecation("torch.btrisolve", "1.1", "1.2", "torch.linalg.lu_solve",
                "linalg.lu_solve(LU, pivots, B) takes B as a matrix (*, n, k): btrisolve took vectors (*, n)",
                "deprecated for torch.lu_solve in 1.1 (locuslab/mpc.pytorch#16)", version_checked=False),
    Deprecation("torch.btriunpack", "1.1", "1.2", "torch.lu_unpack", "same arguments",
                "deprecated for torch.lu_unpack in 1.1", version_checked=False, drop_in=True),
    Deprecation("torch.pstrf", "1.1", "1.2", "torch.linalg.cholesky",
                "which does not pivot: pivoted Cholesky has no torch equivalent (scipy.linalg.lapack.dpstrf)",
                "removed with the LAPACK names of 1.2", version_checked=False),
    # --- linear algebra: deprecated, still working
    Deprecation("torch.qr", "1.9", None, "torch.linalg.qr",
                "`some=False` becomes `mode='complete'`", "pytorch#57745; warns once",
                in_torchfix=True),
    Deprecation("torch.chain_matmul", "1.9", None, "torch.linalg.multi_dot",
                "takes one list: chain_matmul(a, b, c) is multi_dot([a, b, c])",
                "pytorch#57735; warns once", in_torchfix=True),
    Deprecation("torch.cholesky", "1.9", None, "torch.linalg.cholesky",
                "`upper=True` becomes torch.linalg.cholesky(A).mH",
                "pytorch#57725; warns once", in_torchfix=True),
    Deprecation("torch.norm", "1.9", None, "torch.linalg.vector_norm",
                "torch.linalg.vector_norm / matrix_norm / norm, chosen by what is normed",
                "pytorch#57986 (TorchFix); documented deprecated, no warning",
                version_checked=False, in_torchfix=True),
    Deprecation("torch.ger", None, None, "torch.outer", "same arguments",
                "an alias of torch.outer since pytorch#44364 (1.7 era); documented deprecated, "
                "no warning; release not established",
                version_checked=False, drop_in=True, in_torchfix=True),
    Deprecation("torch.svd", "1.9", None, "torch.linalg.svd",
                "returns Vh rather than V, and full_matrices=True by default (some=True before)",
                "pytorch#57981 (May 2021) deprecates it in the docs; no warning (pytorch#57772 open)",
                in_torchfix=True),
    Deprecation("torch.lu", "1.13", None, "torch.linalg.lu_factor",
                "get_infos=True becomes torch.linalg.lu_factor_ex",
                "pytorch#73804 (relanded in the #77637 stack, BC note for 1.13); warns once",
                in_torchfix=True),
    Deprecation("torch.lu_solve", "1.13", None, "torch.linalg.lu_solve",
                "arguments reordered: lu_solve(B, LU, pivots) is linalg.lu_solve(LU, pivots, B)",
                "pytorch#77637 (BC note: 1.13); warns once", in_torchfix=True),
    Deprecation("torch.triangular_solve", "1.11", None, "torch.linalg.solve_triangular",
                "arguments reordered and `upper` becomes keyword-only",
                "pytorch#63570 (merged Nov 2021); warns once", in_torchfix=True),
    # --- tensor creation
    Deprecation("torch.range", None, None, "torch.arange",
                "range includes `end` and makes the default float dtype: torch.range(a, b) is "
                "torch.arange(a, b + step, dtype=torch.get_default_dtype()) for integer a, b",
                "warns on every call; deprecated before 1.0, release not established",
                version_checked=False, in_torchfix=True),
    Deprecation("torch.set_default_tensor_type", "2.1", None, "torch.set_default_dtype",
                "plus torch.set_default_device for the device part",
                "torch's own warning: 'deprecated as of PyTorch 2.1'"),
    Deprecation("torch.Tensor.storage", "2.0", None, "torch.Tensor.untyped_storage",
                "TypedStorage is deprecated; untyped_storage() returns bytes, not elements",
                "TypedStorage deprecation of 2.0; warns"),
    # --- torch.nn
    Deprecation("torch.nn.UpsamplingNearest2d", None, None, "torch.nn.Upsample",
                "nn.Upsample(mode='nearest') or F.interpolate",
                "documented deprecated, no warning; release not established",
                version_checked=False, in_torchfix=True),
    Deprecation("torch.nn.UpsamplingBilinear2d", None, None, "torch.nn.Upsample",
                "nn.Upsample(mode='bilinear', align_corners=True) keeps the old corner alignment",
                "documented deprecated, no warning; release not established",
                version_checked=False, in_torchfix=True),
    Deprecation("torch.nn.functional.upsample", "0.4.1", None, "torch.nn.functional.interpolate",
                "same arguments", "warns on every call", version_checked=False, drop_in=True),
    Deprecation("torch.nn.functional.upsample_nearest", "0.4.1", None,
                "torch.nn.functional.interpolate", "interpolate(x, size, scale_factor, mode='nearest')",
                "warns on every call", version_checked=False),
    Deprecation("torch.nn.functional.upsample_bilinear", "0.4.1", None,
                "torch.nn.functional.interpolate",
                "interpolate(x, size, scale_factor, mode='bilinear', align_corners=True)",
                "warns on every call", version_checked=False),
    Deprecation("torch.nn.utils.weight_norm", "2.1", None,
                "torch.nn.utils.parametrizations.weight_norm",
                "weight_g/weight_v become parametrizations.weight.original0/original1 "
                "(old state_dicts still load)",
                "pytorch#103001; FutureWarning", in_torchfix=True),
    Deprecation("torch.nn.utils.clip_grad_norm", "0.4", None, "torch.nn.utils.clip_grad_norm_",
                "same arguments", "warns on every call", drop_in=True),
    Deprecation("torch.nn.utils.stateless.functional_call", "2.0", None,
                "torch.func.functional_call", "same arguments",
                "torch's own warning: 'deprecated as of PyTorch 2.0'", drop_in=True),
    *(
        Deprecation(f"torch.nn.init.{name}", "0.4", None, f"torch.nn.init.{name}_",
                    "same arguments (the in-place form)", "warns on every call", drop_in=True)
        for name in ("uniform", "normal", "constant", "eye", "dirac", "xavier_uniform",
                     "xavier_normal", "kaiming_uniform", "kaiming_normal", "orthogonal", "sparse")
    ),
    Deprecation("torch.backends.cuda.sdp_kernel", "2.2", None, "torch.nn.attention.sdpa_kernel",
                "takes a list of SDPBackend values instead of one boolean per backend",
                "pytorch#114689 (Nov 2023); FutureWarning", in_torchfix=True),
    # --- mixed precision (torch.amp takes the device type first)
    Deprecation("torch.cuda.amp.autocast", "2.4", None, "torch.amp.autocast",
                "torch.amp.autocast('cuda', ...); positional arguments shift: the old first is "
                "`enabled`, the new second is `dtype`", "FutureWarning since 2.4", in_torchfix=True),
    Deprecation("torch.cpu.amp.autocast", "2.4", None, "torch.amp.autocast",
                "torch.amp.autocast('cpu', ...)", "FutureWarning since 2.4", in_torchfix=True),
    Deprecation("torch.cuda.amp.GradScaler", "2.4", None, "torch.amp.GradScaler",
                "torch.amp.GradScaler('cuda', ...)", "FutureWarning since 2.4"),
    Deprecation("torch.cpu.amp.GradScaler", "2.4", None, "torch.amp.GradScaler",
                "torch.amp.GradScaler('cpu', ...)", "FutureWarning since 2.4"),
    Deprecation("torch.cuda.amp.custom_fwd", "2.4", None, "torch.amp.custom_fwd",
                "torch.amp.custom_fwd(..., device_type='cuda')", "FutureWarning since 2.4",
                in_torchfix=True),
    Deprecation("torch.cuda.amp.custom_bwd", "2.4", None, "torch.amp.custom_bwd",
                "torch.amp.custom_bwd(..., device_type='cuda')", "FutureWarning since 2.4",
                in_torchfix=True),
    # --- testing and utilities
    Deprecation("torch.testing.assert_allclose", "1.12", None, "torch.testing.assert_close",
                "stricter: dtypes must match unless check_dtype=False; default tolerances differ",
                "torch's own warning: 'deprecated since 1.12' (pytorch#61844)", in_torchfix=True),
    Deprecation("torch.utils._pytree._register_pytree_node", "2.2", None,
                "torch.utils._pytree.register_pytree_node",
                "drop-in for three arguments; to_str_fn/maybe_from_str_fn are gone (TypeError): "
                "pass serialized_type_name/to_dumpable_context/from_dumpable_context instead",
                "pytorch#112111 (Oct 2023); FutureWarning", in_torchfix=True),
    # --- functorch: merged into torch.func in 2.0
    *(
        Deprecation(f"functorch.{name}", "2.0", None, f"torch.func.{name}", "same arguments",
                    "torch's own warning: 'deprecated as of PyTorch 2.0'", drop_in=True,
                    in_torchfix=True)
        for name in ("vmap", "grad", "vjp", "jvp", "jacrev", "jacfwd", "hessian", "functionalize")
    ),
    # --- TorchScript, ONNX, launcher
    Deprecation("torch.jit.script", "2.11", None, "torch.compile",
                "torch.compile to speed up, torch.export to serialise",
                "TorchScript deprecated in the 2.11 release blog (docs notice since 2.9); "
                "DeprecationWarning in 2.13", version_checked=False),
    Deprecation("torch.jit.trace", "2.11", None, "torch.export.export",
                "torch.export to serialise a graph, torch.compile to speed up",
                "as torch.jit.script", version_checked=False),
    Deprecation("torch.onnx.dynamo_export", "2.7", "2.9", "torch.onnx.export",
                "torch.onnx.export(..., dynamo=True)",
                "pytorch#146003 warns, pytorch#158130 deletes (Jul 2025)"),
    Deprecation("torch.distributed.launch", None, None, "torchrun",
                "torchrun sets LOCAL_RANK in the environment instead of passing --local_rank",
                "module docstring: 'going to be deprecated in favor of torchrun'; "
                "FutureWarning when run", version_checked=False),
    Deprecation("torch._six", None, "2.0", "the Python standard library",
                "string_classes is str, inf is math.inf, container_abcs is collections.abc",
                "private module, deleted for 2.0", version_checked=False),
)

BY_NAME: Dict[str, Deprecation] = {entry.name: entry for entry in DEPRECATIONS}


def _key(version: str) -> Tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def removed_by(entry: Deprecation, version: str) -> bool:
    """True when `entry` no longer works in torch `version` (e.g. "2.13")."""
    return entry.removed is not None and _key(entry.removed) <= _key(version)


def lookup(qualified_name: str) -> Optional[Deprecation]:
    """The entry for a resolved name, or None."""
    return BY_NAME.get(qualified_name)
