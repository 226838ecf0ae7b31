"""The migration targets, apart from the rules so that the command line can name them
without importing LibCST (`gpumigrate --help` stays fast)."""

from typing import Dict, Tuple

# A target includes the ones it builds on: ddp applies every device fix too.
TARGET_BASES: Dict[str, Tuple[str, ...]] = {"device": ("device",), "ddp": ("device", "ddp")}
TARGETS = tuple(TARGET_BASES)
