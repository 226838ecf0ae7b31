"""The migration targets, apart from the rules so that the command line can name them
without importing LibCST (`gpumigrate --help` stays fast)."""

from typing import Dict, Tuple

# A target includes the ones it builds on: ddp applies every device fix too, and so does amp.
# fsdp is the ddp migration with each trained model sharded (FSDP2) instead of replicated:
# it applies ddp's fixes (set-up, sampler, rank-0 outputs, reductions) and its own.
TARGET_BASES: Dict[str, Tuple[str, ...]] = {"device": ("device",), "ddp": ("device", "ddp"),
                                            "fsdp": ("device", "ddp", "fsdp"), "amp": ("device", "amp")}
TARGETS = tuple(TARGET_BASES)
# targets a list may not name together: each is a way of spreading the same model
_EXCLUSIVE = (("ddp", "fsdp"),)


class TargetError(ValueError):
    """An unknown name in a target list; its message is one line for the user."""


def parse_target(text: str) -> str:
    """`"amp, ddp"` -> `"ddp,amp"`: a comma-separated list of targets, checked, without
    duplicates, in the canonical order (so equal lists name one target everywhere)."""
    names = [part.strip() for part in text.split(",")]
    if not any(names):
        raise TargetError("no target named")
    for name in names:
        if name not in TARGET_BASES:
            raise TargetError(f"unknown target {name!r} (choose from {', '.join(TARGETS)}, or a comma-separated list)")
    for pair in _EXCLUSIVE:
        if all(name in names for name in pair):
            raise TargetError(f"{' and '.join(pair)} cannot be combined: fsdp shards the model that ddp "
                              "replicates (choose one; amp goes with either)")
    return ",".join(t for t in TARGETS if t in names)


def target_bases(target: str) -> Tuple[str, ...]:
    """Every base a (possibly combined) target applies, in order."""
    parts = set(parse_target(target).split(","))
    return tuple(base for base in TARGETS if any(base in TARGET_BASES[p] for p in parts))
