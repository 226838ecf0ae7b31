"""GM211 removed-function, GM212 deprecated-function, and TorchFix codes as aliases of ours
(`# noqa: TOR101`, `[TOR101]` in text output, `"torchfix"` in JSON, `explain`)."""

import json
import shutil
import textwrap

import pytest
from click.testing import CliRunner

from gpumigrate.cli import main
from gpumigrate.codemods import RULES_BY_CODE, select
from gpumigrate.codemods.deprecated import DEPRECATED, REMOVED
from gpumigrate.codemods.deprecations import DEPRECATIONS
from tests.conftest import FIXTURES, lint, migrate, run_script

GM211, GM212 = RULES_BY_CODE["GM211"], RULES_BY_CODE["GM212"]


def codes(source: str, rules=None):
    """(line, code) of what `gpumigrate lint` reports (every lint rule unless `rules`)."""
    rules = select([], []) if rules is None else rules
    return [(f.line, f.code) for f in lint(textwrap.dedent(source).encode(), list(rules)).findings]


def migrated(source: str) -> str:
    result = migrate(textwrap.dedent(source).encode())
    assert result.error is None
    return (result.new_source or result.source).decode()


# --- the table drives the rules ---------------------------------------------------------

@pytest.mark.parametrize("name", sorted(REMOVED))
def test_every_removed_symbol_is_gm211(name):
    top = name.split(".")[0]
    assert (2, "GM211") in codes(f"import {top}\ny = {name}(a)\n", [GM211])


@pytest.mark.parametrize("name", sorted(DEPRECATED))
def test_every_deprecated_symbol_is_gm212(name):
    top = name.split(".")[0]
    assert (2, "GM212") in codes(f"import {top}\ny = {name}(a)\n", [GM212])


@pytest.mark.parametrize("entry", DEPRECATIONS, ids=lambda e: e.name)
def test_no_symbol_is_reported_twice_on_a_line(entry):
    """GM503 owns torch.cuda.amp, GM208 its renames: one of our rules per symbol and line."""
    top = entry.name.split(".")[0]
    found = [c for line, c in codes(f"import {top}\ny = {entry.name}(a)\n") if line == 2]
    ours = [c for c in found if c in ("GM208", "GM211", "GM212", "GM503")]
    if entry.name in ("torch.distributed.launch", "torch.Tensor.storage"):
        return  # a module to run and a method: not names a call resolves to
    assert len(ours) == 1, (entry.name, found)


def test_import_lines_are_reported_once_per_name():
    """TorchFix's TOR103/TOR004: each imported deprecated name, on the import line."""
    found = codes("from functorch import vmap, jacrev\nfrom torch import symeig as xxx\n")
    assert found.count((1, "GM212")) == 2 and (2, "GM211") in found


# --- fixes: only where the result is the same -------------------------------------------

def test_solve_is_fixed_only_where_the_solution_alone_is_read():
    assert migrated("import torch\nx = torch.solve(B, A)[0]\n") == "import torch\nx = torch.linalg.solve(A, B)\n"
    assert migrated("import torch\nx, _ = torch.solve(B, A)\n") == "import torch\nx = torch.linalg.solve(A, B)\n"
    kept = "import torch\nx, lu = torch.solve(B, A)\ny = torch.solve(B, A)\n"
    assert migrated(kept) == kept  # LU read, or the pair kept: review
    result = migrate(kept.encode())
    assert [f.review for f in result.findings if f.code == "GM211"] == [True, True]


def test_symeig_keeps_the_upper_triangle():
    assert migrated("import torch\ne, v = torch.symeig(A, eigenvectors=True)\n") == \
        'import torch\ne, v = torch.linalg.eigh(A, UPLO="U")\n'
    kept = "import torch\ne, v = torch.symeig(A)\n"  # the empty second result is read
    assert migrated(kept) == kept


def test_lstsq_and_eig_are_fixed_where_the_first_result_alone_is_read():
    source = "import torch\nx = torch.lstsq(B, A)[0]\ne, _ = torch.eig(A)\nw, v = torch.eig(A, True)\nX, QR = torch.lstsq(B, A)\n"
    out = migrated(source)
    assert "x = torch.linalg.lstsq(A, B).solution\ne = torch.view_as_real(torch.linalg.eigvals(A))\n" in out
    assert "w, v = torch.eig(A, True)\nX, QR = torch.lstsq(B, A)\n" in out  # the second results are read
    findings = [f for f in migrate(source.encode()).findings if f.code == "GM211"]
    review = [(f.line, f.message) for f in findings if f.review]
    assert [line for line, _ in review] == [2, 4, 5]  # lstsq's rows; eig's vectors; lstsq's QR
    assert "n rows" in review[0][1] and "complex" in review[1][1]


def test_fixed_lstsq_and_eig_give_what_the_old_calls_gave():
    """torch.eig gave the eigenvalues as (n, 2) rows of (real, imaginary) (±i for a quarter
    turn), torch.lstsq the solution in its first n rows (all of them for a square A)."""
    import torch

    out = migrated("import torch\ne = torch.eig(R)[0]\nx, _ = torch.lstsq(B, A)\ny = torch.lstsq(B, M).solution\n")
    torch.manual_seed(0)
    A, M = torch.randn(3, 3, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    scope = {"R": torch.tensor([[0.0, -1.0], [1.0, 0.0]]), "A": A, "M": M, "B": torch.randn(3, 2, dtype=torch.float64)}
    scope["B6"] = torch.randn(6, 2, dtype=torch.float64)
    exec(out.replace("torch.lstsq(B, M)", "torch.lstsq(B6, M)").replace("(M, B)", "(M, B6)"), scope)
    assert torch.equal(scope["e"], torch.tensor([[0.0, 1.0], [0.0, -1.0]]))
    assert torch.allclose(A @ scope["x"], scope["B"])
    normal = torch.linalg.solve(M.t() @ M, M.t() @ scope["B6"])  # the normal equations' solution
    assert scope["y"].shape == (3, 2) and torch.allclose(scope["y"], normal)


def test_the_lapack_names_of_2018_are_fixed_to_what_they_computed():
    """torch 1.0's potrf/potrs/potri took the upper factor by default, trtrs an upper
    triangle, gesv reversed arguments: the fixed calls compute the same."""
    import torch

    source = ("import torch\nU = torch.potrf(A)\nx = torch.potrs(b, U)\ninv = torch.potri(U)\n"
              "t = torch.trtrs(b, U)[0]\ng, _ = torch.gesv(b, A)\nLU, piv = torch.btrifact(A)\n"
              "P, L, R = torch.btriunpack(LU, piv)\n")
    out = migrated(source)
    assert not any(f"torch.{n}(" in out for n in ("potrf", "potrs", "potri", "trtrs", "gesv", "btrifact", "btriunpack"))
    torch.manual_seed(1)
    g = torch.randn(4, 4, dtype=torch.float64)
    A = g @ g.t() + 4 * torch.eye(4, dtype=torch.float64)
    scope = {"A": A, "b": torch.randn(4, 2, dtype=torch.float64)}
    exec(out, scope)
    U = scope["U"]
    assert torch.equal(U, U.triu()) and torch.allclose(U.t() @ U, A)
    assert torch.allclose(A @ scope["x"], scope["b"]) and torch.allclose(A @ scope["g"], scope["b"])
    assert torch.allclose(scope["inv"], torch.linalg.inv(A))
    assert torch.allclose(U @ scope["t"], scope["b"])
    assert torch.allclose(scope["P"] @ scope["L"] @ scope["R"], A)


def test_range_is_reported_not_fixed():
    """torch.arange(a, b + 1) of integers makes int64 where torch.range made floats."""
    source = "import torch\nr = torch.range(0, 4)\n"
    assert migrated(source) == source
    assert (2, "GM212") in codes(source, [GM212])


def test_cpu_autocast_positionals_become_keywords():
    assert migrated("import torch\nwith torch.cpu.amp.autocast(False):\n    pass\n") == \
        'import torch\nwith torch.amp.autocast("cpu", enabled=False):\n    pass\n'


def test_a_part_imported_further_down_is_not_used_above_it():
    out = migrated("import torch\ntorch.utils._pytree._register_pytree_node(C, f, g)\n"
                   "from torch.utils import _pytree as xx\n")
    assert "torch.utils._pytree.register_pytree_node(C, f, g)" in out


def test_fixed_fixture_runs_and_prints_what_modern_code_prints(tmp_path):
    """deprecated_linalg.py fails on today's torch; its migration prints what the same
    script written with torch.linalg prints."""
    golden = FIXTURES / "expected" / "device" / "deprecated_linalg.py"
    script = tmp_path / "migrated.py"
    shutil.copy(golden, script)
    modern = tmp_path / "modern.py"
    text = (FIXTURES / "scripts" / "deprecated_linalg.py").read_text()
    for old, new in [("torch.solve(B, A)[0]", "torch.linalg.solve(A, B)"),
                     ("y, _ = torch.solve(B, A)", "y = torch.linalg.solve(A, B)"),
                     ("torch.solve(B, A).solution", "torch.linalg.solve(A, B)"),
                     ("torch.symeig(A, eigenvectors=True)", "torch.linalg.eigh(A)"),
                     ("torch.symeig(A)[0]", "torch.linalg.eigvalsh(A)"),
                     ("torch.matrix_rank", "torch.linalg.matrix_rank"),
                     ("torch.chain_matmul(A, B, B.t())", "torch.linalg.multi_dot([A, B, B.t()])"),
                     ("torch.qr", "torch.linalg.qr"), ("torch.cholesky", "torch.linalg.cholesky"),
                     ("torch.ger", "torch.outer"),
                     ("torch.eig(A)[0]", "torch.view_as_real(torch.linalg.eigvals(A))"),
                     ("s, _ = torch.lstsq(torch.randn(6, 2, dtype=torch.float64), C)",
                      "s = torch.linalg.lstsq(C, torch.randn(6, 2, dtype=torch.float64)).solution")]:
        assert old in text
        text = text.replace(old, new)
    modern.write_text(text)
    original = tmp_path / "original.py"
    shutil.copy(FIXTURES / "scripts" / "deprecated_linalg.py", original)
    before = run_script(original, cwd=tmp_path)
    assert before.returncode != 0 and "torch.linalg.solve" in before.stderr
    after, want = run_script(script, cwd=tmp_path), run_script(modern, cwd=tmp_path)
    assert after.returncode == 0 and want.returncode == 0, after.stderr[-2000:] + want.stderr[-2000:]
    assert after.stdout == want.stdout and "rank 4" in after.stdout


# --- TorchFix codes ----------------------------------------------------------------------

def test_rules_carry_their_torchfix_codes():
    assert GM211.torchfix == ("TOR001", "TOR004")
    assert GM212.torchfix == ("TOR101", "TOR103")
    assert RULES_BY_CODE["GM503"].torchfix == ("TOR101",)
    assert RULES_BY_CODE["GM105"].torchfix == ()  # map_location is not TOR102's weights_only


def test_noqa_with_a_torchfix_code_suppresses_the_aliased_findings():
    source = """\
        import torch
        q, r = torch.qr(A)  # noqa: TOR101
        x = torch.solve(B, A)[0]  # noqa: TOR001
        with torch.cuda.amp.autocast():  # noqa: TOR101
            pass
        from torch import qr  # noqa: TOR103
        q, r = torch.qr(A)  # noqa: TOR102
        q, r = torch.qr(A)  # noqa: GM212
        """
    assert codes(source) == [(7, "GM212")]
    # and the fix is not applied where the noqa is
    assert "torch.qr(A)  # noqa: TOR101" in migrated(source)


def test_text_and_json_show_the_torchfix_code(tmp_path):
    path = tmp_path / "t.py"
    path.write_text("import torch\nq, r = torch.qr(A)\nfrom torch import qr\nx = y.cuda()\n")
    runner = CliRunner()
    text = runner.invoke(main, ["lint", "--isolated", "--no-cache", str(path)]).output
    assert f"{path}:2:8: GM212 [TOR101] `torch.qr` is deprecated" in text
    assert f"{path}:3:19: GM212 [TOR103] import of" in text
    assert "GM101 [" not in text  # no alias, nothing beside the code
    rows = json.loads(runner.invoke(main, ["lint", "--isolated", "--no-cache", "--format", "json", str(path)]).stdout)
    assert {(r["code"], r.get("torchfix")) for r in rows} >= {("GM212", "TOR101"), ("GM212", "TOR103")}
    assert all("torchfix" not in r for r in rows if not r["code"].startswith("GM21"))
    sarif = json.loads(runner.invoke(main, ["lint", "--isolated", "--no-cache", "--format", "sarif", str(path)]).stdout)
    results = sarif["runs"][0]["results"]
    assert {(r["ruleId"], r.get("properties", {}).get("torchfix")) for r in results} == \
        {("GM212", "TOR101"), ("GM212", "TOR103"), ("GM101", None)}
    github = runner.invoke(main, ["lint", "--isolated", "--no-cache", "--format", "github", str(path)]).stdout
    assert "title=GM212 [TOR101]::GM212 [TOR101] `torch.qr` is deprecated" in github
    assert "title=GM101::GM101 " in github


def test_explain_names_the_torchfix_codes():
    out = CliRunner().invoke(main, ["explain", "GM212"]).output
    assert "TorchFix codes: TOR101, TOR103" in out
    assert "TorchFix" not in CliRunner().invoke(main, ["explain", "GM101"]).output


def test_fixed_calls_compute_what_the_old_ones_did():
    """Run the fixes: `upper=True` is the transpose of the lower factor, `some=False` the
    complete QR, `eigenvectors=False` the eigenvalues of the upper triangle."""
    import torch

    source = ("import torch\nU = torch.cholesky(A, upper=True)\nQ, R = torch.qr(M, some=False)\n"
              "w = torch.symeig(S, False, False)[0]\n")
    out = migrated(source)
    assert "torch.cholesky" not in out and "torch.qr" not in out and "torch.symeig" not in out
    torch.manual_seed(0)
    g = torch.randn(3, 3, dtype=torch.float64)
    S = torch.triu(torch.randn(3, 3, dtype=torch.float64))  # only the lower triangle counts: zeros
    scope = {"A": g @ g.t() + 3 * torch.eye(3, dtype=torch.float64), "M": torch.randn(4, 2, dtype=torch.float64),
             "S": S + S.t()}
    exec(out, scope)
    assert torch.allclose(scope["U"].t() @ scope["U"], scope["A"]) and torch.equal(scope["U"], scope["U"].triu())
    assert scope["Q"].shape == (4, 4) and torch.allclose(scope["Q"] @ scope["R"], scope["M"])
    assert torch.allclose(scope["w"], torch.linalg.eigvalsh(scope["S"]))


def test_a_from_import_changes_only_if_every_call_can():
    fixable = "from torch.utils._pytree import _register_pytree_node as reg\nreg(C, f, g)\n"
    assert migrated(fixable) == "from torch.utils._pytree import register_pytree_node as reg\nreg(C, f, g)\n"
    kept = fixable + "reg(D, f, g, to_str)\n"  # to_str_fn is gone from the new one
    assert "import _register_pytree_node as reg" in migrated(kept)
    assert "reg(D, f, g, to_str)" in migrated(kept)
