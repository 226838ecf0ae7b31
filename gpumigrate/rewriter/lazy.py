"""`libcst.matchers`, imported at its first use. It is a third of gpumigrate's start-up
(thousands of generated classes), and a run answered from the results cache, or a lint whose
files no rule can report on, never needs it."""

from __future__ import annotations

import importlib
from typing import Any


class _Lazy:
    def __init__(self, module: str) -> None:
        self._module = module

    def __getattr__(self, name: str) -> Any:
        value = getattr(importlib.import_module(self._module), name)
        setattr(self, name, value)  # the next use is a plain attribute
        return value


matchers: Any = _Lazy("libcst.matchers")
