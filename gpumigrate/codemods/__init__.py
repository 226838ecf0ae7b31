"""The knowledge: every rule, and the targets that select them. No file I/O here."""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple, Type

from gpumigrate.targets import TARGET_BASES, TARGETS, target_bases  # noqa: F401  (re-exported)

from gpumigrate.codemods.amp import AmpSetup, ApexAmp, DeprecatedCudaAmp, HalfTraining
from gpumigrate.codemods.base import Rule
from gpumigrate.codemods.deprecated import DeprecatedFunction, RemovedFunction
from gpumigrate.codemods.device import (
    CudaCall,
    CudaSynchronize,
    CudaTensorType,
    DiscardedMove,
    HardcodedDevice,
    LoadMapLocation,
    LoadWholeModel,
    RuntimeImport,
)
from gpumigrate.codemods.distributed import (  # noqa: F401  (OPT_IN re-exported)
    OPT_IN,
    ApexParallel,
    BatchNormWithoutSync,
    CheckpointEveryRank,
    CollectiveInRankBranch,
    DataParallelWrapper,
    DdpDeviceIds,
    DdpSetup,
    DistributedSamplerRule,
    LegacyLauncher,
    MakedirsRace,
    NcclBackend,
    PerRankValue,
    MpiRank,
    RankZeroOutput,
    ShuffleWithSampler,
    SpawnLauncher,
    UnreducedMetric,
    WrappedAttribute,
)
from gpumigrate.codemods.legacy import (
    AsyncKwarg,
    DataAccumulatorIndex,
    DataAttribute,
    DataIndexScalar,
    DeprecatedOverload,
    IteratorNextMethod,
    ScalarMetricAccumulation,
    VariableTypeCheck,
    VariableWrapper,
    VolatileFlag,
)
from gpumigrate.codemods.memory import (
    EmptyCacheInLoop,
    EvalWithoutNoGrad,
    HalfBatchNorm,
    OomRetryLeak,
    TensorAccumulation,
    TensorInContainer,
)
from gpumigrate.codemods.sharding import FsdpShard
from gpumigrate.codemods.speed import HostDeviceRoundtrip, LoaderNoPinMemory, LoaderNoWorkers, ZeroGradToZero
from gpumigrate.codemods.api import CheckpointReentrant, NonPublicCollate, RequireGradTypo
from gpumigrate.codemods.numerics import Expm1, Log1p, LogSumExp
from gpumigrate.codemods.vision import V2ToTensor, VisionModuleImport, VisionPretrained
from gpumigrate.rewriter.engine import set_noqa_aliases

# In application order. GM205 repairs the source before parsing; the guard unwrapping of
# GM103 needs GM101's rewrites of the guarded `.cuda()` calls.
ALL_RULES: Tuple[Type[Rule], ...] = (
    AsyncKwarg,
    CudaCall,
    CudaTensorType,
    HardcodedDevice,
    LoadMapLocation,
    LoadWholeModel,
    CudaSynchronize,
    NcclBackend,
    RuntimeImport,
    DataIndexScalar,
    VariableWrapper,
    VolatileFlag,
    VariableTypeCheck,
    DataAccumulatorIndex,
    ScalarMetricAccumulation,
    IteratorNextMethod,
    DeprecatedOverload,
    RemovedFunction,
    DeprecatedFunction,
    TensorAccumulation,
    TensorInContainer,
    EvalWithoutNoGrad,
    HalfBatchNorm,
    DdpSetup,
    DataParallelWrapper,
    DistributedSamplerRule,
    ShuffleWithSampler,
    CheckpointEveryRank,
    LegacyLauncher,
    SpawnLauncher,
    UnreducedMetric,
    BatchNormWithoutSync,
    CollectiveInRankBranch,
    WrappedAttribute,
    RankZeroOutput,
    PerRankValue,
    MpiRank,
    MakedirsRace,
    ApexParallel,
    DdpDeviceIds,
    FsdpShard,
    AmpSetup,
    ApexAmp,
    HalfTraining,
    DeprecatedCudaAmp,
    RequireGradTypo,
    CheckpointReentrant,
    NonPublicCollate,
    VisionPretrained,
    VisionModuleImport,
    # report only: no safe mechanical fix
    DiscardedMove,
    DataAttribute,
    EmptyCacheInLoop,
    OomRetryLeak,
    LoaderNoWorkers,
    LoaderNoPinMemory,
    HostDeviceRoundtrip,
    ZeroGradToZero,
    Log1p,
    Expm1,
    LogSumExp,
    V2ToTensor,
)


RULES_BY_CODE: Dict[str, Type[Rule]] = {rule.code: rule for rule in ALL_RULES}


def torchfix_aliases() -> Dict[str, Tuple[str, ...]]:
    """TorchFix code -> our codes that mean the same (the rules' `torchfix`), for noqa."""
    out: Dict[str, Tuple[str, ...]] = {}
    for rule in ALL_RULES:
        for alias in getattr(rule, "torchfix", ()):
            out[alias] = out.get(alias, ()) + (rule.code,)
    return out


set_noqa_aliases(torchfix_aliases())


def fixed_codes(target: str) -> List[str]:
    """Codes whose fixes the `target` migration applies."""
    bases = target_bases(target)
    return [rule.code for rule in ALL_RULES if rule.fixed_in & set(bases)]


def rules_for(target: str) -> List[Type[Rule]]:
    """The rules a migration to `target` runs: its fixes, plus lint-only rules it reports."""
    bases = set(target_bases(target))
    return [rule for rule in ALL_RULES if rule.fixed_in & bases or getattr(rule, "reported_in", frozenset()) & bases]


# amp before ddp: apex's `amp.initialize` rebinds the model and must be gone before ddp
# decides where the model is wrapped (apex wants DDP after it), and ddp's rank-0 gates and
# reductions then see the mixed-precision step they must not split.
PASS_ORDER = ("device", "amp", "ddp")
# fsdp's rules run in the ddp pass: its plan decides where models are sharded, as it decides
# where they are wrapped, and the ddp rules ask whether fsdp's code is fixed there
_PASS_OF = {"fsdp": "ddp"}


def passes_for(target: str, rules: Sequence[Type[Rule]]) -> List[Tuple[List[Type[Rule]], List[str]]]:
    """The `target` migration as passes, in order (device, then amp, then ddp), each run on
    the output of the one before: (the rules among `rules` it runs, the codes it fixes). A
    rule runs in the first pass that fixes it, else in the first that reports it: each pass
    decides from the code it rewrites, so ddp sees the device-agnostic script."""
    bases = set(target_bases(target))
    out, placed = [], set()
    for base in sorted({_PASS_OF.get(b, b) for b in bases}, key=PASS_ORDER.index):
        members = {b for b in bases if _PASS_OF.get(b, b) == base}
        here = [r for r in rules if r not in placed and (r.fixed_in & members or not r.fixed_in & bases
                                                         and getattr(r, "reported_in", frozenset()) & members)]
        placed.update(here)
        if here:
            out.append((here, [r.code for r in here if r.fixed_in & bases]))
    return out


def opted_in(chosen: Sequence[str]) -> Tuple[str, ...]:
    """The codes among `chosen` named in full (`GM409`; a prefix such as `GM4` is not enough)
    of rules that have `migration_notes`: for those, lint reports what holds only after a
    migration too, as ruff reports its opt-in rules only when named. Lint passes them to the
    rules under the option `OPT_IN`."""
    named = {code.upper() for code in chosen}
    return tuple(rule.code for rule in ALL_RULES if rule.code in named and getattr(rule, "migration_notes", ""))


def opt_in_note(rule: Type[Rule]) -> str:
    """For `rules` and `explain`: what of the rule's findings `lint` reports only when the rule
    is named (` (... : lint reports them with --select GM409)`), else ''."""
    notes = getattr(rule, "migration_notes", "")
    return f" ({notes}: true after a migration; lint reports them only with `--select {rule.code}`)" if notes else ""


def select(chosen: List[str], ignored: List[str], *, lint: bool = True) -> List[Type[Rule]]:
    """Rules whose code starts with one of `chosen` (all if empty) and not with `ignored`.
    The more specific prefix wins, as in ruff: `--select GM3 --ignore GM301` keeps GM302,
    `--select GM301 --ignore GM3` keeps GM301."""

    def specificity(code: str, prefixes: List[str]) -> int:
        return max((len(p) for p in prefixes if code.startswith(p)), default=-1)

    picked = []
    for rule in ALL_RULES:
        if lint and not getattr(rule, "lint", True):
            continue  # migration steps (e.g. GM400 ddp-setup) are not defects to report
        selected = specificity(rule.code, chosen) if chosen else 0
        if selected >= 0 and selected > specificity(rule.code, ignored):
            picked.append(rule)
    return picked
