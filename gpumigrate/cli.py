"""Command line: `gpumigrate PATHS --to device`, `gpumigrate rules`, `gpumigrate explain`."""

from __future__ import annotations

import json
import sys
from typing import Iterator, List, Optional, Sequence, Tuple

import click

from gpumigrate import __version__
from gpumigrate.codemods import ALL_RULES, RULES_BY_CODE, TARGETS, fixed_codes, rules_for
from gpumigrate.codemods import select as select_rules  # `select` is also lint's --select
from gpumigrate.codemods.base import Clean, Flagged
from gpumigrate.config import Config, ConfigError, load_config
from gpumigrate.rewriter import report
from gpumigrate.rewriter.diff import colourize, unified_diff
from gpumigrate.rewriter.engine import FileResult
from gpumigrate.rewriter.files import discover
from gpumigrate.rewriter.run import process_path, process_paths, write_result

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
      gpumigrate lint src/                 report GPU memory and speed anti-patterns
      gpumigrate rules                     list the rules
      gpumigrate explain GM101             one rule's documentation
    """


def _err(message: str) -> None:
    click.echo(message, err=True)


@main.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path())
@click.option("--to", "target", type=click.Choice(TARGETS), default=None,
              help="What to migrate the scripts to (default: `target` in [tool.gpumigrate], else device).")
@click.option("--diff", "show_diff", is_flag=True, help="Print a unified diff; write nothing.")
@click.option("--check", is_flag=True, help="Write nothing; exit 1 if any file would change.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None,
              help="Write the result of a single input file here instead of in place.")
@click.option("--exclude", multiple=True, metavar="GLOB", help="Skip matching paths (repeatable).")
@click.option("--sync-bn", is_flag=True, help="ddp: convert BatchNorm to SyncBatchNorm when wrapping models.")
@click.option("--report", "report_file", type=click.Path(dir_okay=False), default=None,
              help="Write the migration report here: Markdown, or JSON for a .json name.")
@click.option("-q", "--quiet", is_flag=True, help="Only errors and the summary.")
def migrate(paths: Tuple[str, ...], target: str, show_diff: bool, check: bool, output: Optional[str],
            exclude: Tuple[str, ...], sync_bn: bool, report_file: Optional[str], quiet: bool) -> None:
    """Rewrite PATHS (files or directories) for the --to target."""
    config = _config(paths)
    target = target or config.target or "device"
    if target not in TARGETS:
        raise click.UsageError(f"{config.path}: unknown target {target!r} (choose from {', '.join(TARGETS)})")
    files, errors = discover(paths, (*config.exclude, *exclude))
    if output and (len(paths) != 1 or len(files) != 1):
        raise click.UsageError("-o/--output takes exactly one input file")
    for error in errors:
        _err(f"error: {error}")
    results = _migrate(files, target, show_diff, check, output, quiet, {"sync_bn": sync_bn})
    if report_file:
        _write_report(report_file, results, target)
    failed = len(errors) + sum(1 for r in results if r.error)
    changed = [r for r in results if r.changed]
    _summary(results, changed, failed, dry=show_diff or check)
    if failed:
        sys.exit(EXIT_ERROR)
    if check and changed:
        sys.exit(EXIT_CHANGES)


def _migrate(files: Sequence[str], target: str, show_diff: bool, check: bool, output: Optional[str],
             quiet: bool, options: dict) -> List[FileResult]:
    results = []
    rules, fix = rules_for(target), fixed_codes(target)
    for result in process_paths(_progress(files, "migrating") if quiet else files, rules, fix, options):
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


def _write_report(path: str, results: List[FileResult], target: str) -> None:
    """What changed and what needs a human, per file: Markdown, or JSON for a .json name."""
    rows = [{"path": r.path, "changed": r.changed, "error": r.error,
             "fixed": [{"code": f.code, "line": f.line, "message": f.message} for f in r.findings if f.fixed],
             "review": [{"code": f.code, "line": f.line, "message": f.message} for f in r.findings if not f.fixed]}
            for r in results]
    if path.endswith(".json"):
        text = json.dumps({"target": target, "files": rows}, indent=2) + "\n"
    else:
        lines = [f"# gpumigrate --to {target}: migration report", ""]
        for row in rows:
            lines.append(f"## {row['path']}")
            if row["error"]:
                lines.append(f"- error: {row['error']}")
            for title, key in (("Changed", "fixed"), ("Review by hand", "review")):
                if row[key]:
                    lines += ["", f"### {title}", ""]
                    lines += [f"- line {f['line']}: {f['code']} {f['message']}" for f in row[key]]
            if not (row["fixed"] or row["review"] or row["error"]):
                lines.append("- nothing to change")
            lines.append("")
        text = "\n".join(lines)
    try:
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)
    except OSError as exc:
        raise click.FileError(path, exc.strerror) from None


def _config(paths: Sequence[str]) -> Config:
    try:
        return load_config(paths)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None


def _codes(values: Sequence[str]) -> List[str]:
    """`--select GM1,GM301 --select GM4` -> ["GM1", "GM301", "GM4"], checked against the rules."""
    codes = [c.strip().upper() for v in values for c in v.split(",") if c.strip()]
    for code in codes:
        if not any(rule.code.startswith(code) for rule in ALL_RULES):
            raise click.UsageError(f"no rule matches {code!r}; `gpumigrate rules` lists them")
    return codes


FORMATS = ("text", "json", "sarif", "github")


@main.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path())
@click.option("--select", multiple=True, metavar="CODES", help="Only these codes or prefixes (GM3), comma-separated.")
@click.option("--ignore", multiple=True, metavar="CODES", help="Skip these codes or prefixes.")
@click.option("--fix", is_flag=True, help="Apply the fixes of the selected rules.")
@click.option("--diff", "show_diff", is_flag=True, help="With --fix: print the fixes as a diff; write nothing.")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="text", show_default=True)
@click.option("--exclude", multiple=True, metavar="GLOB", help="Skip matching paths (repeatable).")
def lint(paths: Tuple[str, ...], select: Tuple[str, ...], ignore: Tuple[str, ...], fix: bool, show_diff: bool,
         fmt: str, exclude: Tuple[str, ...]) -> None:
    """Report GPU memory and speed anti-patterns in PATHS.

    Exit 0 when clean, 1 when there are findings, 2 on errors."""
    config = _config(paths)
    # An explicit --select replaces the configuration's choice, ignores included.
    chosen = _codes(select) or _codes(config.select)
    ignored = _codes(ignore) if select else [*_codes(config.ignore), *_codes(ignore)]
    rules = select_rules(chosen, ignored)
    files, errors = discover(paths, (*config.exclude, *exclude))
    for error in errors:
        _err(f"error: {error}")
    located, fixed, failed, files_with = [], 0, len(errors), set()
    for path in _progress(files, "linting"):
        file_rules = select_rules(chosen, [*ignored, *_codes(config.ignored_for(path))]) if config.per_file_ignores else rules
        fix_codes = [r.code for r in file_rules if r.fixed_in] if fix else []
        result = process_path(path, file_rules, fix_codes)
        if result.error:
            failed += 1
            _err(f"error: {result.error}")
            continue
        if fix and result.changed:
            if show_diff:
                click.echo(colourize(unified_diff(path, result.source, result.new_source)), nl=False)
            else:
                write_result(result)
                if result.error:
                    failed += 1
                    _err(f"error: {result.error}")
                    continue
        fixed += sum(1 for f in result.findings if f.fixed)
        for finding in result.findings:
            if not finding.fixed:
                located.append(report.Located(path, finding))
                files_with.add(path)
    located = report.sort_findings(located)
    infos = {r.code: report.RuleInfo(r.code, r.name, r.message, r.docs(), bool(r.fixed_in)) for r in rules}
    if fmt == "json":
        click.echo(report.as_json(located, infos), nl=False)
    elif fmt == "sarif":
        click.echo(report.as_sarif(located, infos), nl=False)
    elif fmt == "github":
        click.echo(report.as_github(located), nl=False)
    elif not show_diff:
        click.echo(report.as_text(located), nl=False)
    _lint_summary(located, fixed, len(files_with), len(files), fix, show_diff)
    sys.exit(EXIT_ERROR if failed else EXIT_CHANGES if located else EXIT_OK)


def _lint_summary(located, fixed: int, files_with: int, files: int, fix: bool, show_diff: bool) -> None:
    fixable = sum(1 for i in located if RULES_BY_CODE[i.finding.code].fixed_in and not i.finding.review)
    parts = []
    if fix:
        parts.append(f"{'Would fix' if show_diff else 'Fixed'} {_plural(fixed, 'finding')}")
    if located:
        hint = f" ({fixable} fixable with --fix)" if fixable and not fix else ""
        parts.append(f"{_plural(len(located), 'finding')}{hint} in {_plural(files_with, 'file')}")
    else:
        parts.append(f"no findings in {_plural(files, 'file')}")
    _err(", ".join(parts))


def _progress(files: Sequence[str], label: str) -> Iterator[str]:
    """A progress bar on a terminal, for runs long enough to want one."""
    if len(files) < 50 or not sys.stderr.isatty():
        yield from files
        return
    with click.progressbar(files, label=label, file=sys.stderr, show_pos=True) as bar:
        yield from bar


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
    click.echo(f"{'code':<6} {'name':<{width}}  {'fixed by':<9} message")
    for rule in sorted(ALL_RULES, key=lambda r: r.code):
        fix = ", ".join(sorted(rule.fixed_in)) or "lint only"
        step = "" if rule.lint else " (a migration step; `lint` does not report it)"
        click.echo(f"{rule.code:<6} {rule.name:<{width}}  {fix:<9} {rule.message}{step}")


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
