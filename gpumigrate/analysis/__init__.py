"""What the tool believes about a script: one per-file model, built once, read by every rule.

Start with model.py: `script_model(ctx)` and the facts it answers. structure.py is the
file's shape (scopes, bindings, calls), values.py what expressions hold.
"""

from gpumigrate.analysis.model import ScriptModel, script_model

__all__ = ["ScriptModel", "script_model"]
