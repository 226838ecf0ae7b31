"""Command line: `gpumigrate PATHS --to device`, `gpumigrate rules`, `gpumigrate explain`."""

from __future__ import annotations

import sys
from typing import List, Optional, Sequence, Tuple

import click

from gpumigrate import __version__
from gpumigrate.codemods import ALL_RULES, RULES_BY_CODE, TARGETS, fixed_codes, rules_for
from gpumigrate.codemods.base import Clean, Flagged
from gpumigrate.rewriter.diff import colourize, unified_diff
from gpumigrate.rewriter.engine import FileResult
from gpumigrate.rewriter.files import discover
from gpumigrate.rewriter.run import process_paths, write_result

EXIT_OK, EXIT_CHANGES, EXIT_ERROR = 0, 1, 2


class _DefaultToMigrate(click.Group):
    """`gpumigrate train.py --to ddp` means `gpumigrate migrate train.py --to ddp`."""

    def parse_args(self, ctx: click.Context, args: List[str]) -> List[str]:
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h", "--version"):
            args = ["migrate", *args]
        return super().parse_args(ctx, args)


@click.group(cls=_DefaultToMigrate, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="gpumigrate")
def main() -> None:
    """Move PyTorch training scripts to any device, to DDP and to mixed precision.

    \b
      gpumigrate train.py --to device      rewrite in place
      gpumigrate src/ --to device --diff   show what would change
      gpumigrate rules                     list the rules
      gpumigrate explain GM101             one rule's documentation
    """


def _err(message: str) -> None:
    click.echo(message, err=True)


@main.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path())
@click.option("--to", "target", type=click.Choice(TARGETS), default="device", show_default=True,
              help="What to migrate the scripts to.")
@click.option("--diff", "show_diff", is_flag=True, help="Print a unified diff; write nothing.")
@click.option("--check", is_flag=True, help="Write nothing; exit 1 if any file would change.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None,
              help="Write the result of a single input file here instead of in place.")
@click.option("--exclude", multiple=True, metavar="GLOB", help="Skip matching paths (repeatable).")
@click.option("-q", "--quiet", is_flag=True, help="Only errors and the summary.")
def migrate(paths: Tuple[str, ...], target: str, show_diff: bool, check: bool, output: Optional[str],
            exclude: Tuple[str, ...], quiet: bool) -> None:
    """Rewrite PATHS (files or directories) for the --to target."""
    files, errors = discover(paths, exclude)
    if output and (len(paths) != 1 or len(files) != 1):
        raise click.UsageError("-o/--output takes exactly one input file")
    for error in errors:
        _err(f"error: {error}")
    results = _migrate(files, target, show_diff, check, output, quiet)
    failed = len(errors) + sum(1 for r in results if r.error)
    changed = [r for r in results if r.changed]
    _summary(results, changed, failed, dry=show_diff or check)
    if failed:
        sys.exit(EXIT_ERROR)
    if check and changed:
        sys.exit(EXIT_CHANGES)


def _migrate(files: Sequence[str], target: str, show_diff: bool, check: bool, output: Optional[str],
             quiet: bool) -> List[FileResult]:
    results = []
    rules, fix = rules_for(target), fixed_codes(target)
    for result in process_paths(files, rules, fix):
        results.append(result)
        if result.error:
            _err(f"error: {result.error}")
            continue
        if show_diff and result.changed:
            click.echo(colourize(unified_diff(result.path, result.source, result.new_source)), nl=False)
        elif not (show_diff or check) and (result.changed or output):
            write_result(result, output or "")
            if result.error:
                _err(f"error: {result.error}")
                continue
        if not quiet:
            for f in result.findings:
                if not f.fixed:
                    _err(f"{result.path}:{f.line}:{f.col + 1}: {f.code} review by hand: {f.message}")
            if result.changed and not show_diff:
                verb = "would rewrite" if check else "rewrote"
                _err(f"{verb} {result.path} ({sum(1 for f in result.findings if f.fixed)} edits)")
    return results


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _summary(results: List[FileResult], changed: List[FileResult], failed: int, dry: bool) -> None:
    edits = sum(1 for r in changed for f in r.findings if f.fixed)
    review = sum(1 for r in results for f in r.findings if not f.fixed)
    verb = "would change" if dry else "changed"
    parts = [f"{_plural(len(changed), 'file')} {verb}", _plural(edits, "edit"), f"{review} to review by hand"]
    unchanged = len(results) - len(changed) - sum(1 for r in results if r.error)
    if unchanged:
        parts.append(f"{unchanged} unchanged")
    if failed:
        parts.append(_plural(failed, "error"))
    _err(", ".join(parts))


@main.command("rules")
def list_rules() -> None:
    """List every rule: code, name, and the targets that fix it."""
    width = max(len(r.name) for r in ALL_RULES)
    for rule in ALL_RULES:
        fix = ", ".join(sorted(rule.fixed_in)) or "lint"
        click.echo(f"{rule.code}  {rule.name:<{width}}  {fix:<8}  {rule.message}")


@main.command()
@click.argument("code")
def explain(code: str) -> None:
    """Print a rule's documentation and examples."""
    rule = RULES_BY_CODE.get(code.upper())
    if rule is None:
        raise click.BadParameter(f"no rule {code!r}; `gpumigrate rules` lists them", param_hint="CODE")
    fix = ", ".join(sorted(rule.fixed_in)) or "none (lint only)"
    click.echo(f"{rule.code} ({rule.name})\n\n{rule.message}\n\nFixed by the migration to: {fix}\n")
    click.echo(rule.docs())
    flagged = [e for e in rule.examples if isinstance(e, Flagged)]
    clean = [e for e in rule.examples if isinstance(e, Clean)]
    if flagged:
        click.echo("\n## Flagged")
        for e in flagged:
            click.echo("```python\n" + e.code + "```")
    if clean:
        click.echo("\n## Not flagged")
        for e in clean:
            click.echo("```python\n" + e.code + "```")
