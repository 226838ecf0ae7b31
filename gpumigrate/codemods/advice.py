"""What a user does after a migration, said once per run: how to launch the scripts, what they
now import, and the switches the runtime reads. The migration report and the CLI's last lines
both print it, so that the report alone is enough to act on."""

from __future__ import annotations

from typing import Any, List, Sequence

from gpumigrate.rewriter.vendor import RUNTIME_PACKAGE
from gpumigrate.targets import target_bases


def _imports(result: Any, module: str) -> bool:
    source = result.new_source if result.new_source is not None else result.source
    return module.encode() in (source or b"")


def next_steps(results: Sequence[Any], target: str) -> List[str]:
    """One line per thing to do, for the files this run migrated (errors and untouched files
    need nothing)."""
    done = [r for r in results if not r.error and r.changed]
    if not done:
        return []
    steps: List[str] = []
    chosen = target_bases(target)
    if "ddp" in chosen:
        # a module its script imports (an agent class, a trainer) joins the group through the
        # script: only files that set it up or run as `__main__` are launched
        launched = [r.path for r in done if any(f.code == "GM400" and f.fixed for f in r.findings)
                    and not any(f.not_applied == "ddp" for f in r.findings)
                    and (_imports(r, "setup_distributed(") or _imports(r, "__main__"))]
        for path in launched[:5]:
            steps.append(f"launch: `torchrun --nproc_per_node=NUM_GPUS {path} ARGS` "
                         f"(`python {path} ARGS` still runs it in one process)")
        if len(launched) > 5:
            steps.append(f"launch: likewise the {len(launched) - 5} other scripts wrapped in DistributedDataParallel")
    packaged = [r.path for r in done if _imports(r, RUNTIME_PACKAGE)]
    if packaged:
        which = packaged[0] if len(packaged) == 1 else f"{len(packaged)} scripts (e.g. {packaged[0]})"
        steps.append(f"runtime: {which} now import{'s' if len(packaged) == 1 else ''} `{RUNTIME_PACKAGE}`: "
                     f"where {'it runs' if len(packaged) == 1 else 'they run'}, `pip install \"gpumigrate[torch]\"`, "
                     f"or migrate with `--vendor-runtime DIR` to write the runtime beside the scripts (torch only)")
    if "amp" in chosen and any(f.code == "GM500" and f.fixed for r in done for f in r.findings):
        steps.append("precision: float16 with loss scaling on CUDA and MPS, bfloat16 on a CPU; "
                     "`GPUMIGRATE_AMP=off` trains in float32 (to compare or debug), `fp16`/`bf16` force one")
    return steps
