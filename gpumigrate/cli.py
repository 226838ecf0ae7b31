"""Command line: `gpumigrate PATHS --to device`, `gpumigrate lint`, `rules`, `explain`.

LibCST and the rules are imported inside the commands, so that `--help` and `--version`
answer without loading them."""

from __future__ import annotations

import difflib
import errno
import json
import os
import stat
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import click

from gpumigrate import __version__
from gpumigrate.config import Config, ConfigError, load_config
from gpumigrate.rewriter.diff import colourize, file_diff
from gpumigrate.rewriter.files import BadPattern, discover
from gpumigrate.targets import TargetError, parse_target

if TYPE_CHECKING:
    from gpumigrate.rewriter.engine import FileResult

EXIT_OK, EXIT_CHANGES, EXIT_ERROR = 0, 1, 2
Passes = List[Tuple[List[type], List[str]]]  # a file's passes: the rules each runs, the codes it fixes
STDIN = "-"


_IMPLICIT = "gpumigrate.implicit_migrate"  # ctx.meta key: `migrate` was not typed


class _Context(click.Context):
    """A command's context whose usage and error lines name the command as the user typed
    it: `gpumigrate train.py --bogus` says `Usage: gpumigrate [OPTIONS] PATHS...`, not
    `gpumigrate migrate`, a word the user never wrote."""

    @property
    def command_path(self) -> str:
        path = super().command_path
        if self.meta.get(_IMPLICIT) and self.info_name == "migrate" and path.endswith(" migrate"):
            return path[: -len(" migrate")]
        return path


class _Command(click.Command):
    context_class = _Context


class _DefaultToMigrate(click.Group):
    """`gpumigrate train.py --to ddp` means `gpumigrate migrate train.py --to ddp`.

    A first word that is neither a command nor an existing path stops the run (a mistyped
    `lnit` must never become a migration of the paths after it)."""

    command_class = _Command

    def parse_args(self, ctx: click.Context, args: List[str]) -> List[str]:
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h", "--version"):
            first = args[0]
            if not first.startswith("-") and not os.path.exists(first):
                if os.sep in first or "." in first:
                    raise click.UsageError(f"{first}: no such file or directory; nothing was changed", ctx)
                close = difflib.get_close_matches(first, list(self.commands), n=1)
                hint = f" (did you mean `gpumigrate {close[0]}`?)" if close else ""
                raise click.UsageError(f"{first}: no such command, file or directory{hint}", ctx)
            args = ["migrate", *args]
            ctx.meta[_IMPLICIT] = True
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except _OutputFailed as exc:
            _err(f"error: cannot write to standard output: {exc}")
            sys.exit(EXIT_ERROR)


class _OutputFailed(Exception):
    """Standard output refused a write (a full device, a broken disk): the reason."""


def _echo(data: Union[str, bytes], *, nl: bool = True, color: Optional[bool] = None) -> None:
    """`click.echo` to standard output. A write that fails is one line and exit 2 (a closed
    pipe, `| head`, stays click's: a quiet exit); what is left in the buffer goes nowhere,
    so that the exit does not fail a second time with a traceback."""
    try:
        click.echo(data, nl=nl, color=color)
    except OSError as exc:
        if exc.errno == errno.EPIPE:
            raise
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        raise _OutputFailed(exc.strerror or str(exc)) from None


@click.group("gpumigrate", cls=_DefaultToMigrate, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="gpumigrate")
def main() -> None:
    """Move PyTorch training scripts to any device and to DistributedDataParallel;
    lint them for GPU memory and speed anti-patterns.

    \b
    Targets (--to, default device; a list such as ddp,amp combines them):
      device   any device: CUDA, MPS, XPU... or the CPU; today's torch
      ddp      DistributedDataParallel under torchrun (includes device)
      fsdp     the model sharded across the ranks, FSDP2 (as ddp; not with it)
      amp      mixed precision: autocast and GradScaler (includes device)

    \b
      gpumigrate train.py --to device      rewrite in place (any accelerator or the CPU)
      gpumigrate train.py --to ddp         ... and for torchrun (DDP)
      gpumigrate train.py --to ddp,amp     ... and in mixed precision
      gpumigrate train.py --to fsdp        ... sharded, for models that do not fit one GPU
      gpumigrate src/ --diff               show what would change
      gpumigrate - --stdin-filename t.py   read stdin, write the result to stdout
      gpumigrate lint src/                 report GPU memory and speed anti-patterns
      gpumigrate rules                     list the rules
      gpumigrate explain GM101             one rule's documentation
      gpumigrate verify train.py --to ddp  run both versions and compare them

    Without a command, PATHS are migrated: `gpumigrate PATHS` is `gpumigrate migrate PATHS`
    (its options: `gpumigrate migrate --help`).
    """


def _err(message: str) -> None:
    click.echo(message, err=True)


def _colour(choice: str) -> Optional[bool]:
    """--color wins; else NO_COLOR (https://no-color.org) turns colour off; else click
    colours only a terminal."""
    if choice != "auto":
        return choice == "always"
    return False if os.environ.get("NO_COLOR") else None


def _show_diff(path: str, old: bytes, new: bytes, colour: Optional[bool]) -> None:
    _echo(colourize(file_diff(path, old, new)), nl=False, color=colour)


_COLOR = click.option("--color", "color", type=click.Choice(["auto", "always", "never"]), default="auto",
                      show_default=True, help="Colour the diff and the findings (NO_COLOR in the environment means never).")
_SELECT = click.option("--select", multiple=True, metavar="CODES",
                       help="Only these codes, prefixes (GM3) or rule names, comma-separated.")
_IGNORE = click.option("--ignore", multiple=True, metavar="CODES", help="Skip these codes, prefixes or rule names.")
_EXCLUDE = click.option("--exclude", multiple=True, metavar="GLOB",
                        help="Skip matching paths, gitignore-style (repeatable).")
_STDIN_NAME = click.option("--stdin-filename", metavar="PATH", default=None,
                           help="The name of the file read from `-` (for messages and configuration).")
_JOBS = click.option("-j", "--jobs", type=click.IntRange(min=1), default=None, metavar="N",
                     help="Files processed at a time, each in a worker process (default: one per CPU).")
_PY2 = click.option("--py2", is_flag=True,
                    help="Convert Python 2 scripts to Python 3 first (2to3's fixers, by fissix: "
                         "pip install 'gpumigrate[py2]'); the report lists the fixers used.")
_REFORMAT_NOTEBOOKS = click.option(
    "--reformat-notebooks", is_flag=True,
    help="A notebook whose JSON cannot be written back byte for byte is written as nbformat (Jupyter) writes "
         "it; the diff shows the JSON's changes.")
_NO_CACHE = click.option("--no-cache", is_flag=True,
                         help="Do not read or write the results cache (in the user's cache folder, or "
                              "GPUMIGRATE_CACHE_DIR).")


class _TargetList(click.ParamType):
    """`--to ddp,amp`: one target or a comma-separated list of them."""

    name = "target"

    def get_metavar(self, param: click.Parameter, ctx: Optional[click.Context] = None) -> str:
        return "TARGET[,TARGET]"

    def convert(self, value: str, param: Optional[click.Parameter], ctx: Optional[click.Context]) -> str:
        try:
            return parse_target(value)
        except TargetError as error:
            self.fail(str(error), param, ctx)


@main.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path())
@click.option("--to", "target", type=_TargetList(), default=None,
              help="What to migrate the scripts to: device, ddp, amp, or a list such as ddp,amp (amp and ddp "
                   "include device; default: `target` in [tool.gpumigrate], else device).")
@click.option("--diff", "show_diff", is_flag=True, help="Print a unified diff; write nothing.")
@click.option("--check", is_flag=True, help="Write nothing; exit 1 if any file would change.")
@click.option("-o", "--output", type=click.Path(dir_okay=False, allow_dash=True), default=None,
              help="Write the result of a single input file here instead of in place (`-`: stdout).")
@_SELECT
@_IGNORE
@_EXCLUDE
@click.option("--sync-bn", is_flag=True, help="ddp: convert BatchNorm to SyncBatchNorm when wrapping models.")
@click.option("--keep-half", is_flag=True,
              help="amp: keep `.half()` training in pure float16 (BatchNorm kept in float32) instead of autocast.")
@click.option("--report", "report_file", type=click.Path(dir_okay=False), default=None,
              help="Write the migration report here: Markdown, or JSON for a .json name.")
@_STDIN_NAME
@_COLOR
@click.option("--vendor-runtime", "vendor_dir", metavar="DIR", default=None,
              help="Write the runtime into DIR as gpumigrate_runtime.py (DIR is created if missing) and make the "
                   "scripts import it from there: they then need only torch, not gpumigrate.")
@click.option("-q", "--quiet", is_flag=True, help="Only errors and the summary.")
@_JOBS
@_NO_CACHE
@_PY2
@_REFORMAT_NOTEBOOKS
def migrate(paths: Tuple[str, ...], target: Optional[str], show_diff: bool, check: bool, output: Optional[str],
            select: Tuple[str, ...], ignore: Tuple[str, ...], exclude: Tuple[str, ...], sync_bn: bool, keep_half: bool,
            report_file: Optional[str], stdin_filename: Optional[str], color: str, vendor_dir: Optional[str],
            quiet: bool, jobs: Optional[int], no_cache: bool, py2: bool, reformat_notebooks: bool) -> None:
    """Rewrite PATHS (files, directories, or `-` for stdin) for the --to target.

    Exit 0 when done, 1 when --check finds files that would change, 2 on errors."""
    from gpumigrate.codemods import fixed_codes, passes_for, rules_for
    from gpumigrate.codemods.advice import next_steps
    from gpumigrate.rewriter.vendor import VENDORED_MODULE

    reading_stdin, config = _inputs(paths, stdin_filename)
    target = target or config.target or "device"  # both already parsed and checked
    if show_diff and check:
        raise click.UsageError("--diff and --check: choose one")
    if output and (show_diff or check):
        raise click.UsageError("-o/--output writes a file; --diff and --check write nothing")
    if reading_stdin:
        files = [STDIN]
    else:
        files = _discover(paths, config, exclude)
        if output and (len(paths) != 1 or len(files) != 1):
            raise click.UsageError("-o/--output takes exactly one input file")
    selection = _Selection(config, select, ignore, lint=False)
    target_rules = rules_for(target)
    fix_codes = set(fixed_codes(target))
    dropped = sorted(r.code for r in target_rules if r not in selection.rules and r.code in fix_codes)
    if dropped and (select or ignore or config.select or config.ignore):
        where = "" if select or ignore else (
            "; [tool.gpumigrate] select/ignore scope migrations too (lint alone: [tool.gpumigrate.lint])")
        _err(f"note: --to {target} without {', '.join(dropped)} (not selected): the migration is partial{where}")
    if report_file:
        _check_output_path("--report", report_file, files)
    # Before any script: a script must never import a runtime module that could not be written.
    vendor_changed = _vendor_runtime(vendor_dir, show_diff or check, quiet) if vendor_dir is not None else False
    runtime_module = VENDORED_MODULE if vendor_dir is not None else None  # None: the package, or what the script uses

    def plan(name: str) -> Passes:
        return passes_for(target, selection.for_file(name, target_rules))

    options = {"sync_bn": sync_bn, "keep_half": keep_half, "runtime_module": runtime_module,
               **_conversions(py2, reformat_notebooks)}
    results: List[FileResult] = []
    project = None
    if not reading_stdin:
        from gpumigrate.rewriter.project import projects  # a script and the modules it imports are one program

        project = projects(files)
    processed = _process(files, stdin_filename, plan, options, max_size=config.max_file_size, jobs=jobs,
                         cache=not no_cache, stdin=reading_stdin, file_timeout=config.file_timeout,
                         project=project)
    for result in _progress(processed, len(files), "migrating"):
        results.append(result)
        _deliver(result, show_diff, check, output, reading_stdin, quiet, _colour(color))
    if vendor_dir is not None and not (quiet or reading_stdin or output == STDIN):
        _vendor_note(results, vendor_dir, output)
    steps = next_steps(results, target)
    if report_file:
        _write_report(report_file, results, target, written=not (show_diff or check), steps=steps)
    failed = sum(1 for r in results if r.error)
    changed = [r for r in results if r.changed and not r.error]
    _summary(results, changed, failed, dry=show_diff or check)
    if not (quiet or show_diff or check or reading_stdin or output == STDIN):
        for step in steps:
            _err(f"next: {step}")
    if failed:
        sys.exit(EXIT_ERROR)
    if check and (changed or vendor_changed):
        sys.exit(EXIT_CHANGES)


def _vendor_runtime(directory: str, dry: bool, quiet: bool) -> bool:
    """Write (or, `dry`, check) DIR/gpumigrate_runtime.py; True if it changed (would change)."""
    from gpumigrate.rewriter.vendor import VendorError, write_runtime

    try:
        path, changed = write_runtime(directory, dry=dry)
    except VendorError as exc:
        _err(f"error: {exc}")
        _err("nothing was changed")
        sys.exit(EXIT_ERROR)
    if changed and not quiet:
        _err(f"would write {path}" if dry else f"wrote {path} (the runtime: the scripts need only torch)")
    return changed


def _vendor_note(results: List["FileResult"], directory: str, output: Optional[str]) -> None:
    """Python finds the vendored module by itself only from scripts in its directory (a
    script's directory is on sys.path under python and torchrun); say which files are not."""
    from gpumigrate.rewriter.vendor import VENDORED_MODULE

    home = os.path.realpath(directory)
    away = [r.path for r in results if not r.error
            and VENDORED_MODULE.encode() in (r.new_source if r.new_source is not None else r.source)
            and os.path.realpath(os.path.dirname(os.path.abspath(output or r.path))) != home]
    if away:
        verb = "imports" if len(away) == 1 else "import"
        _err(f"note: {_plural(len(away), 'file')} outside {directory} {verb} {VENDORED_MODULE} (e.g. {away[0]}): "
             f"run {'it' if len(away) == 1 else 'them'} with {directory} on PYTHONPATH, or import "
             f"{'it' if len(away) == 1 else 'them'} from a script in {directory}")


def _process(files: Sequence[str], stdin_filename: Optional[str],
             plan: Callable[[str], "Passes"], options: Optional[dict] = None,
             max_size: Optional[int] = None, jobs: Optional[int] = None, cache: bool = False,
             stdin: bool = False, file_timeout: Optional[float] = None,
             project: Optional[dict] = None) -> Iterator["FileResult"]:
    """The files (or, `stdin`, standard input under the name given for it) through the
    engine, in worker processes `jobs` at a time: a file that crashes its worker, or takes
    longer than `file_timeout` seconds, is that file's error, and the run goes on.
    `plan(name)`: a file's passes, each the rules and the codes to fix. Results come in input order; a
    file over `max_size` bytes is skipped, as an error. `cache`: use the results cache.
    `project`: each file's links to the modules of its project (rewriter/project.py), given
    to the migration as the option `project`."""
    from gpumigrate.rewriter.cache import Cache, cache_dir
    from gpumigrate.rewriter.workers import Task, process_cached

    repairs = tuple(_repairs())
    if stdin:
        name = stdin_filename or "<stdin>"
        tasks = [Task(name, _frozen(plan(stdin_filename or STDIN)), options, repairs, source=_read_stdin(max_size))]
    else:
        tasks = [Task(path, _frozen(plan(path)), _with_project(options, (project or {}).get(path)), repairs, max_size)
                 for path in files]
    return process_cached(tasks, jobs, Cache(cache_dir()) if cache else None, file_timeout)


def _with_project(options: Optional[dict], project: Any) -> Optional[dict]:
    return options if project is None else {**(options or {}), "project": project}



def _conversions(py2: bool, reformat_notebooks: bool) -> dict:
    """The opt-in conversions of inputs (rewriter/prepare.py), as options; only those asked for,
    so that other runs' cache keys stay as they were."""
    from gpumigrate.rewriter.prepare import PY2, REFORMAT_NOTEBOOKS

    if py2:
        from gpumigrate.rewriter.py2 import FLAG, INSTALL, available

        if not available():
            raise click.UsageError(f"{FLAG} needs the fissix package: {INSTALL}")
    return {**({PY2: True} if py2 else {}), **({REFORMAT_NOTEBOOKS: True} if reformat_notebooks else {})}


def _frozen(passes: "Passes") -> tuple:
    return tuple((tuple(rules), tuple(fix)) for rules, fix in passes)


def _read_stdin(max_size: Optional[int]) -> bytes:
    """Standard input, at most `max_size` bytes of it (`/dev/zero` never ends): more is one
    line and exit 2, as a file over the limit is."""
    try:
        data = sys.stdin.buffer.read(max_size + 1) if max_size is not None else sys.stdin.buffer.read()
    except MemoryError:
        data = None
    except OSError as exc:
        _err(f"error: cannot read standard input: {exc.strerror or exc}")
        sys.exit(EXIT_ERROR)
    if data is None or (max_size is not None and len(data) > max_size):
        limit = f"the {max_size:,} bytes limit (max-file-size)" if max_size is not None else "what memory holds"
        _err(f"error: standard input is over {limit}; nothing was changed")
        sys.exit(EXIT_ERROR)
    return data


def _repairs() -> List[type]:
    """Rules that make old syntax parse (`.cuda(async=True)`): they run whatever is selected,
    since without them the file cannot be read at all."""
    from gpumigrate.codemods import ALL_RULES

    return [rule for rule in ALL_RULES if getattr(rule, "repair", None)]


def _deliver(result: "FileResult", show_diff: bool, check: bool, output: Optional[str], stdin: bool,
             quiet: bool, colour: Optional[bool]) -> None:
    """Show or write one migration result, and say what happened to it."""
    from dataclasses import replace

    from gpumigrate.rewriter.report import location, position_map
    from gpumigrate.rewriter.run import write_result

    if result.error:
        _err(f"error: {result.error}")
        return
    to_stdout = output == STDIN or (stdin and not output)
    if show_diff:
        if result.changed:
            _show_diff(result.path, result.source, result.new_source, colour)
    elif check:
        pass
    elif to_stdout:
        _echo(result.new_source if result.changed else result.source, nl=False)
    elif result.changed or output:
        write_result(result, output or "")
        if result.error:
            _err(f"error: {result.error}")
            return
    if quiet:
        return
    for note in result.prepared:  # --py2, --reformat-notebooks
        _err(f"note: {result.path}: {note}")
    # Written: the positions of the file the user now opens. Not written: the file as it is.
    moved = position_map(result.path, result.source, result.new_source) if result.changed and not (
        show_diff or check or to_stdout) else None
    for f in result.findings:
        if not f.fixed:
            if moved is not None:
                cell, line = moved(f)
                f = replace(f, cell=cell, line=line, col=f.col if line == f.line else 0)
            what = "note" if f.note else "review by hand"
            _err(f"{location(output or result.path, f)}: {f.code} {what}: {f.message}")
    if result.changed and not show_diff:
        edits = _plural(sum(1 for f in result.findings if f.fixed), "edit")
        if check:
            _err(f"would rewrite {result.path} ({edits})")
        elif not to_stdout:
            _err(f"wrote {output} ({edits})" if output else f"rewrote {result.path} ({edits})")


def _check_output_path(option: str, path: str, inputs: Sequence[str]) -> None:
    """Before anything is written: a file `option` (--report, --output-file) names must not
    overwrite an input (by any name: a hard or symbolic link too), must be a regular file (a
    FIFO would hang the run), and its folder must be writable (exit 2, as for every usage
    error)."""
    from gpumigrate.rewriter.files import kind_of

    try:
        info: Optional[os.stat_result] = os.stat(path)
    except OSError:
        info = None
    if info is not None:
        if not stat.S_ISREG(info.st_mode):
            raise click.UsageError(f"{option} {path}: not a regular file ({kind_of(info.st_mode)})")
        for name in inputs:
            try:
                if name != STDIN and os.path.samestat(info, os.stat(name)):
                    raise click.UsageError(f"{option} {path}: that is one of the inputs ({name})")
            except OSError:
                continue
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK) or (info is not None and not os.access(path, os.W_OK)):
        raise click.UsageError(f"{option} {path}: cannot write there")


def _write_report(path: str, results: List["FileResult"], target: str, written: bool,
                  steps: Sequence[str] = ()) -> None:
    """What changed and what needs a human, per file: Markdown, or JSON for a .json name.
    Written as the scripts are: whole or not at all, never through a FIFO or device."""
    from gpumigrate.codemods import ALL_RULES
    from gpumigrate.rewriter.report import migration_report

    done = {rule.code: (rule.message, rule.done) for rule in ALL_RULES if rule.done}
    text = migration_report(results, target, json_format=path.endswith(".json"), written=written, done=done,
                            next_steps=steps)
    _write_whole("--report", path, text)


def _write_whole(option: str, path: str, text: str) -> None:
    """The file an option (--report, --output-file) names, written as the scripts are: whole
    or not at all (temp file + rename), never through a FIFO or device; a failure is one line
    and exit 2."""
    from gpumigrate.rewriter.files import Refused, write_atomic

    umask = os.umask(0)
    os.umask(umask)
    try:
        write_atomic(path, text.encode("utf-8"), new_mode=0o666 & ~umask)
        return
    except Refused as exc:
        _err(f"error: {option} {path}: {exc}")
    except OSError as exc:
        _err(f"error: {option} {path}: cannot write: {exc.strerror or exc}")
    sys.exit(EXIT_ERROR)


def _inputs(paths: Sequence[str], stdin_filename: Optional[str], config_file: Optional[str] = None,
            isolated: bool = False) -> Tuple[bool, Config]:
    """(reading stdin, the configuration): `-` alone is stdin, whose configuration is found
    from --stdin-filename. `config_file` replaces the search, `isolated` reads none."""
    reading_stdin = tuple(paths) == (STDIN,)
    if STDIN in paths and not reading_stdin:
        raise click.UsageError("`-` (stdin) cannot be combined with other paths")
    if config_file is not None and isolated:
        raise click.UsageError("--config and --isolated: choose one")
    return reading_stdin, _config([stdin_filename] if reading_stdin and stdin_filename else paths, config_file,
                                  isolated)


def _config(paths: Sequence[str], config_file: Optional[str] = None, isolated: bool = False) -> Config:
    """The configuration, checked whole before any file is read. A broken one is one line
    naming the file (not click's usage block: the command line was fine) and exit 2."""
    try:
        config = load_config(paths, config_file, isolated)
        _check_config_codes(config)
    except ConfigError as exc:
        _err(f"error: {exc}")
        sys.exit(EXIT_ERROR)
    return config


def _check_config_codes(config: Config) -> None:
    """Unknown codes in the configuration, per-file-ignores included: those would otherwise
    stop the run only at the first file they apply to, after earlier files were written."""
    entries = [("[tool.gpumigrate] select", config.select), ("[tool.gpumigrate] ignore", config.ignore),
               ("[tool.gpumigrate.lint] select", config.lint_select or []),
               ("[tool.gpumigrate.lint] ignore", config.lint_ignore),
               ("[tool.gpumigrate.lint] extend-select", config.lint_extend_select),
               *((f"[tool.gpumigrate.per-file-ignores] {k!r}", v) for k, v in config.per_file_ignores.items()),
               *((f"[tool.gpumigrate.lint.per-file-ignores] {k!r}", v)
                 for k, v in config.lint_per_file_ignores.items())]
    for name, values in entries:
        try:
            _codes(values)
        except click.UsageError as exc:
            raise ConfigError(f"{config.path}: {name}: {exc.message}") from None


def _discover(paths: Sequence[str], config: Config, exclude: Sequence[str]) -> List[str]:
    """The files under PATHS. A path that does not exist stops the run before anything is
    read or written; a selection with no files says so."""
    try:
        spec = config.exclude_spec(extra=exclude)
    except BadPattern as exc:
        raise click.UsageError(f"--exclude {exc}") from None
    files, errors = discover(paths, spec)
    if errors:
        for error in errors:
            _err(f"error: {error}")
        _err("nothing was changed")
        sys.exit(EXIT_ERROR)
    if not files:
        _err(f"warning: no Python files or notebooks in {', '.join(paths)}")
    return files


def _codes(values: Sequence[str]) -> List[str]:
    """`--select GM1,GM301 --select tensor-accumulation` -> ["GM1", "GM301", "GM301"]: codes,
    prefixes and rule names (as ruff takes them), checked against the rules."""
    codes = []
    for word in (c.strip() for v in values for c in v.split(",")):
        if word:
            codes.append(_rule_code(word, prefix=True))
    return codes


def _rule_code(word: str, prefix: bool = False) -> str:
    """The code of a rule given by code or name (`prefix`: or a code prefix, `GM3`); an
    unknown one is a usage error with the closest code or name."""
    from gpumigrate.codemods import ALL_RULES

    by_name = {rule.name: rule.code for rule in ALL_RULES}
    if word.lower() in by_name:
        return by_name[word.lower()]
    code = word.upper()
    if any(rule.code == code or prefix and rule.code.startswith(code) for rule in ALL_RULES):
        return code
    known = {**{name: name for name in by_name}, **{r.code.lower(): r.code for r in ALL_RULES}}
    close = difflib.get_close_matches(word.lower(), list(known), n=1)
    hint = f" (did you mean {known[close[0]]}?)" if close else ""
    raise click.UsageError(f"no rule matches {word!r}{hint}; `gpumigrate rules` lists them")


class _Selection:
    """--select/--ignore/--extend-select over the configuration's select/ignore/per-file-ignores.
    An explicit --select replaces the configuration's choice, its ignores included (as in
    ruff). Lint reads [tool.gpumigrate.lint] over the top-level settings (ruff's
    `lint.select`); migrations read only the top level."""

    def __init__(self, config: Config, select: Sequence[str], ignore: Sequence[str], lint: bool,
                 extend_select: Sequence[str] = ()) -> None:
        from gpumigrate.codemods import select as select_rules

        self.config = config
        self.lint = lint
        if select:
            self.chosen, self.ignored, extend = _codes(select), _codes(ignore), []
        else:
            chosen = config.lint_select if lint and config.lint_select is not None else config.select
            ignored = [*config.ignore, *(config.lint_ignore if lint else [])]
            self.chosen, self.ignored = _codes(chosen), [*_codes(ignored), *_codes(ignore)]
            extend = _codes(config.lint_extend_select) if lint else []
        extend += _codes(extend_select)
        if extend:  # added to the choice; with none, to every rule ("GM")
            self.chosen = [*(self.chosen or ["GM"]), *extend]
        self._select = select_rules
        self.rules = select_rules(self.chosen, self.ignored, lint=lint)

    def for_file(self, path: str, among: Optional[Sequence[type]] = None) -> List[type]:
        """The selected rules for `path` (per-file-ignores applied), within `among`."""
        rules = self.rules
        extra = _codes(self.config.ignored_for(path, lint=self.lint))
        if extra:
            rules = self._select(self.chosen, [*self.ignored, *extra], lint=self.lint)
        return rules if among is None else [r for r in among if r in rules]


FORMATS = ("text", "json", "sarif", "github")


@main.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path())
@_SELECT
@click.option("--extend-select", multiple=True, metavar="CODES",
              help="Add these codes, prefixes or names to the selection (the configuration's or --select's).")
@_IGNORE
@click.option("--fix", is_flag=True, help="Apply the fixes of the selected rules.")
@click.option("--diff", "show_diff", is_flag=True,
              help="With --fix: print the fixes as a diff; write nothing (exit 1 when there are fixes).")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="text", show_default=True)
@click.option("--statistics", is_flag=True, help="Count the findings per rule, most first, instead of listing them.")
@click.option("-o", "--output-file", type=click.Path(dir_okay=False), default=None, metavar="PATH",
              help="Write the findings (in --format) to PATH instead of standard output.")
@click.option("--exit-zero", is_flag=True, help="Exit 0 even when there are findings (2 on errors still).")
@click.option("-q", "--quiet", is_flag=True, help="Print the findings and errors only: no summary, no notes.")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="Read the settings from FILE (a pyproject.toml, or a gpumigrate.toml holding them at its top "
                   "level) instead of the nearest pyproject.toml.")
@click.option("--isolated", is_flag=True, help="Ignore every configuration file.")
@_EXCLUDE
@_STDIN_NAME
@_COLOR
@_JOBS
@_NO_CACHE
@_PY2
@_REFORMAT_NOTEBOOKS
def lint(paths: Tuple[str, ...], select: Tuple[str, ...], extend_select: Tuple[str, ...], ignore: Tuple[str, ...],
         fix: bool, show_diff: bool, fmt: str, statistics: bool, output_file: Optional[str], exit_zero: bool,
         quiet: bool, config_file: Optional[str], isolated: bool, exclude: Tuple[str, ...],
         stdin_filename: Optional[str], color: str, jobs: Optional[int], no_cache: bool, py2: bool,
         reformat_notebooks: bool) -> None:
    """Report GPU memory and speed anti-patterns in PATHS (`-` for stdin).

    Rules are given by code, prefix or name (GM301, GM3, tensor-accumulation).
    Exit 0 when clean, 1 when there are findings (with --fix --diff: when there are fixes), 2 on errors."""
    from gpumigrate.codemods import RULES_BY_CODE
    from gpumigrate.rewriter import report
    from gpumigrate.rewriter.notebook import is_notebook
    from gpumigrate.rewriter.run import write_result

    if show_diff and not fix:
        raise click.UsageError("--diff shows the fixes: use it with --fix")
    if show_diff and fmt != "text":
        raise click.UsageError(f"--diff prints a diff on stdout; it cannot be combined with --format {fmt}")
    if statistics and (show_diff or fmt not in ("text", "json")):
        raise click.UsageError(f"--statistics prints text or JSON counts; not with "
                               f"{'--diff' if show_diff else '--format ' + fmt}")
    reading_stdin, config = _inputs(paths, stdin_filename, config_file, isolated)
    selection = _Selection(config, select, ignore, lint=True, extend_select=extend_select)
    if not selection.rules and not quiet:
        _err("warning: no rules selected")
    files = [STDIN] if reading_stdin else _discover(paths, config, exclude)
    if output_file is not None:
        _check_output_path("--output-file", output_file, files)
    located, fixed, failed, files_with, colour = [], 0, 0, set(), _colour(color)
    sink: Optional[List[str]] = [] if output_file is not None else None  # --output-file: written whole at the end

    def out(text: str) -> None:
        if sink is not None:
            sink.append(click.unstyle(text))
        else:
            _echo(text, nl=False, color=colour)

    # JSON gives each finding its fix's edits, as ruff does: the fixes are computed, not applied,
    # in a second run over the files with fixable findings only (a fixing run parses every file
    # it is given, where lint skips most), on the bytes the first run read.
    preview = fmt == "json" and not fix and not statistics
    done = {r.code: r.done for r in selection.rules if r.fixed_in}
    to_fix: Dict[str, Tuple[List[str], bytes]] = {}  # file -> the codes of its fixable findings, its bytes

    def plan(name: str) -> Passes:
        rules = selection.for_file(name)
        return [(rules, [r.code for r in rules if r.fixed_in] if fix else [])]

    from gpumigrate.codemods import OPT_IN, opted_in  # a rule named in full also reports its migration notes

    options = {OPT_IN: opted_in(selection.chosen), **_conversions(py2, reformat_notebooks)}
    processed = _process(files, stdin_filename, plan, options,
                         max_size=config.max_file_size, jobs=jobs,
                         cache=not no_cache, stdin=reading_stdin, file_timeout=config.file_timeout)
    streaming = fmt == "text" and not show_diff and not (fix and reading_stdin) and not statistics and sink is None
    for result in _progress(processed, len(files), "linting"):
        if result.error:
            failed += 1
            _err(f"error: {result.error}")
            continue
        if fix and show_diff and result.changed:
            if sink is not None:
                sink.append(file_diff(result.path, result.source, result.new_source))
            else:
                _show_diff(result.path, result.source, result.new_source, colour)
        elif fix and reading_stdin and fmt == "text":
            # like ruff: the fixed source is the output, findings go to stderr
            _echo(result.new_source if result.changed else result.source, nl=False)
        elif fix and result.changed and not reading_stdin:
            write_result(result)
            if result.error:
                failed += 1
                _err(f"error: {result.error}")
                continue
        for note in result.prepared if not quiet else ():  # --py2, --reformat-notebooks
            _err(f"note: {result.path}: {note}")
        codes = sorted({f.code for f in result.findings if f.code in done and not f.review}) if preview else []
        if codes and not is_notebook(result.path):  # a notebook's edits would be in its JSON
            to_fix[result.path] = (codes, result.source)
        fixed += sum(1 for f in result.findings if f.fixed)
        mine = report.sort_findings([report.Located(result.path, f) for f in result.findings if not f.fixed])
        if mine:
            files_with.add(result.path)
            located += mine
            if streaming:  # each file's findings as it is done, not all at the end of a long run
                out(report.as_text(mine, styled=True))
    if to_fix:
        from gpumigrate.rewriter.cache import Cache, cache_dir
        from gpumigrate.rewriter.workers import Task, process_cached

        named = (stdin_filename or STDIN) if reading_stdin else None  # the name stdin's rules were chosen by
        tasks = [Task(path, _frozen([(selection.for_file(named or path), codes)]), options, tuple(_repairs()), None,
                      source) for path, (codes, source) in to_fix.items()]
        fixes = process_cached(tasks, jobs, None if no_cache else Cache(cache_dir()), config.file_timeout)
        found: Dict[str, List[Any]] = {}
        for item in located:
            found.setdefault(item.path, []).append(item)
        for result in _progress(fixes, len(tasks), "computing fixes"):
            if not result.error and result.changed:  # a file whose fixes fail keeps its findings, without edits
                found[result.path] = _with_fixes(found.get(result.path, []), result, done)
        located = [i for items in found.values() for i in items]
    located = report.sort_findings(located)
    infos = {r.code: report.RuleInfo(r.code, r.name, r.message, r.docs(), bool(r.fixed_in))
             for r in selection.rules}
    if statistics:
        counts = report.statistics(located, infos)
        out(json.dumps(counts, indent=2) + "\n" if fmt == "json" else report.statistics_text(counts))
    elif fmt == "json":
        out(report.as_json(located, infos))
    elif fmt == "sarif":
        out(report.as_sarif(located, infos))
    elif fmt == "github":
        out(report.as_github(located))
    elif sink is not None and not show_diff:
        out(report.as_text(located))
    elif not show_diff and not streaming:  # stdin's fixed source is the output: findings go to stderr
        click.echo(report.as_text(located, styled=True), nl=False, err=True, color=colour)
    if sink is not None:
        _write_whole("--output-file", output_file, "".join(sink))
    fixable = sum(1 for i in located if RULES_BY_CODE[i.finding.code].fixed_in and not i.finding.review)
    if not quiet:
        _lint_summary(len(located), fixable, fixed, len(files_with), len(files) - failed, failed, fix, show_diff)
    if failed:
        sys.exit(EXIT_ERROR)
    pending = fixed if show_diff else located  # --fix --diff: fixes not written are what fails the check (ruff)
    sys.exit(EXIT_CHANGES if pending and not exit_zero else EXIT_OK)


def _with_fixes(found: List[Any], fixing: "FileResult", done: Dict[str, str]) -> List[Any]:
    """The lint findings of a file, each one the fixing run fixed with that run's edits. The
    findings stay lint's: a fixing run may report a little differently (a guard it unwraps)."""
    from gpumigrate.rewriter import report

    applied = {(f.line, f.col, f.code) for f in fixing.findings if f.fixed}
    edits = report.fix_edits(fixing.source, fixing.new_source)
    return report.with_edits(found, edits, lambda f: (f.line, f.col, f.code) in applied, done)


def _lint_summary(found: int, fixable: int, fixed: int, files_with: int, checked: int, failed: int, fix: bool,
                  show_diff: bool) -> None:
    parts = []
    if fix:
        parts.append(f"{'Would fix' if show_diff else 'Fixed'} {_plural(fixed, 'finding')}")
    if found:
        hint = f" ({fixable} fixable with --fix)" if fixable and not fix else ""
        where = _plural(files_with, "file") if files_with == checked else f"{files_with} of {_plural(checked, 'file')}"
        parts.append(f"{_plural(found, 'finding')}{hint} in {where}")
    else:
        parts.append(f"no findings in {_plural(checked, 'file')}")
    if failed:
        parts.append(f"{_plural(failed, 'error')} (not checked)")
    _err(", ".join(parts))


def _progress(results: Iterable["FileResult"], count: int, label: str) -> Iterator["FileResult"]:
    """A status line (`migrating 12/126`) on a terminal's standard error, below the lines
    each file prints as it is done: it is erased before a result is handed out (whatever the
    caller prints for it lands on a clean line) and drawn again after. click's progress bar
    redraws on its own schedule, over the streamed lines, hence this small one."""
    stream = sys.stderr
    if count < 2 or not stream.isatty() or os.environ.get("TERM") == "dumb":
        yield from results
        return
    done = 0

    def draw(text: str) -> None:
        try:
            stream.write(f"\r\x1b[K{text}")
            stream.flush()
        except OSError:
            pass

    draw(f"{label} {done}/{count}")
    try:
        for result in results:
            draw("")
            yield result
            done += 1
            draw(f"{label} {done}/{count}")
    finally:
        draw("")


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _summary(results: List["FileResult"], changed: List["FileResult"], failed: int, dry: bool) -> None:
    from gpumigrate.rewriter.report import not_applied

    edits = sum(1 for r in changed for f in r.findings if f.fixed)
    review = sum(1 for r in results if not r.error for f in r.findings if not (f.fixed or f.note))
    verb = "would change" if dry else "changed"
    parts = [f"{_plural(len(changed), 'file')} {verb}", _plural(edits, "edit"), f"{review} to review by hand"]
    unchanged = len(results) - len(changed) - failed
    if unchanged:
        parts.append(f"{unchanged} unchanged")
    if failed:
        parts.append(_plural(failed, "error"))
    for target, count in sorted(not_applied(results).items()):  # asked for, not given: never only in a list
        parts.append(f"--to {target} not applied to {_plural(count, 'file')} (see the review items)")
    _err(", ".join(parts))


@main.command("rules")
@click.option("--format", "fmt", type=click.Choice(["text", "markdown"]), default="text", show_default=True)
def list_rules(fmt: str) -> None:
    """List every rule: code, name, and the targets that fix it."""
    from gpumigrate.codemods import ALL_RULES, opt_in_note

    rules = sorted(ALL_RULES, key=lambda r: r.code)
    if fmt == "markdown":
        _echo(rules_markdown(), nl=False)
        return
    width = max(len(r.name) for r in rules)
    _echo(f"{'code':<6} {'name':<{width}}  {'fixed by':<9} message")
    for rule in rules:
        fix = ", ".join(sorted(rule.fixed_in)) or "lint only"
        step = "" if rule.lint else " (a migration step; `lint` does not report it)"
        _echo(f"{rule.code:<6} {rule.name:<{width}}  {fix:<9} {rule.message}{step}{opt_in_note(rule)}")


def rules_markdown() -> str:
    """The rule table of the README, generated from the rule classes."""
    from gpumigrate.codemods import ALL_RULES, opt_in_note

    lines = ["| code | name | fixed by | message |", "|---|---|---|---|"]
    for rule in sorted(ALL_RULES, key=lambda r: r.code):
        fix = ", ".join(f"`{t}`" for t in sorted(rule.fixed_in)) or "lint only"
        step = " (a migration step; `lint` does not report it)" if not rule.lint else ""
        message = (rule.message + opt_in_note(rule)).replace("|", "\\|")
        lines.append(f"| {rule.code} | {rule.name} | {fix} | {message}{step} |")
    return "\n".join(lines) + "\n"


@main.command()
@click.argument("code")
def explain(code: str) -> None:
    """Print a rule's documentation and examples (CODE: a code or a name, GM301 or tensor-accumulation)."""
    from gpumigrate.codemods import RULES_BY_CODE, opt_in_note
    from gpumigrate.codemods.base import LINT_FIX, Clean, Flagged

    try:
        rule = RULES_BY_CODE[_rule_code(code)]
    except click.UsageError as exc:
        raise click.BadParameter(exc.message.replace("no rule matches", "no rule"), param_hint="CODE") from None
    targets = sorted(rule.fixed_in - {LINT_FIX})
    fix = (f"the migration to {', '.join(targets)}" if targets else
           "`gpumigrate lint --fix` only (no migration)" if rule.fixed_in else "none (lint only)")
    _echo(f"{rule.code} ({rule.name})\n\n{rule.message}{opt_in_note(rule)}\n\nFixed by: {fix}\n")
    if getattr(rule, "torchfix", ()):
        codes = ", ".join(rule.torchfix)
        _echo(f"TorchFix codes: {codes} (`# noqa: {rule.torchfix[0]}` suppresses it as `# noqa: {rule.code}` does)\n")
    _echo(rule.docs())
    flagged = [e for e in rule.examples if isinstance(e, Flagged)]
    clean = [e for e in rule.examples if isinstance(e, Clean)]
    if flagged:
        _echo("\n## Flagged")
        for e in flagged:
            _echo("```python\n" + e.code + "```")
    if clean:
        _echo("\n## Not flagged")
        for e in clean:
            _echo("```python\n" + e.code + "```")


@main.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("script", type=click.Path(dir_okay=False))
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED, metavar="[-- SCRIPT_ARGS...]")
@click.option("--to", "target", required=True, metavar="TARGET",
              help="What the migration is for: device, ddp, fsdp, amp, or a comma list (ddp,amp).")
@click.option("--against", type=click.Path(dir_okay=False), default=None,
              help="A migrated script to check; default: migrate SCRIPT into a temporary folder.")
@click.option("--steps", type=click.IntRange(1, 1000), default=5, show_default=True,
              help="Optimizer steps each run takes (the next one ends it).")
@click.option("--batches", type=click.IntRange(1, 1000), default=3, show_default=True,
              help="Batches per pass over a DataLoader, so epochs end and evaluation runs.")
@click.option("--nproc", type=click.IntRange(2, 64), default=2, show_default=True, help="Ranks of the torchrun run.")
@click.option("--timeout", type=click.FloatRange(1, 86400), default=300.0, show_default=True,
              help="Seconds each run may take.")
@click.option("--stall", type=click.FloatRange(1, 86400), default=None,
              help="Seconds a rank may go without progress before it counts as hung (default: a third of --timeout, "
                   "at least 30).")
@click.option("--data", type=click.Choice(["fake", "real"]), default="fake", show_default=True,
              help="fake: torchvision datasets become small random ones; real: the script's own data.")
@click.option("--samples", type=click.IntRange(8, 1_000_000), default=64, show_default=True,
              help="Training samples of a faked dataset (other splits get a quarter).")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
@click.option("--no-cache", "no_cache", is_flag=True, help="Run the original again even if its run is cached.")
@click.option("--fail-fast", is_flag=True, help="Stop at the first difference (the later runs are not made).")
@click.option("--keep", is_flag=True, help="Keep the scratch folder of the runs (printed) for a look.")
def verify(script: str, script_args: Tuple[str, ...], target: str, against: Optional[str], steps: int, batches: int,
           nproc: int, timeout: float, stall: Optional[float], data: str, samples: int, fmt: str, no_cache: bool,
           fail_fast: bool, keep: bool) -> None:
    """Run SCRIPT and its migration side by side for a few steps, on this machine's CPU, and
    say whether they train the same.

    Exit status: 0 equivalent, 1 a difference (the first quantity that differs, and where the
    migrated script computes it), 2 could not judge (the original fails on its own, needs data
    verify cannot fake, or runs past --timeout). Nothing of the user's is written: each run
    works in a scratch copy of the script's folder."""
    import json

    from gpumigrate.verify.runner import Options, VerifyError
    from gpumigrate.verify.runner import verify as run_verify

    for path, what in ((script, "SCRIPT"), (against, "--against")):
        if path is not None and not os.path.isfile(path):
            raise click.BadParameter(f"{path}: no such file", param_hint=what)
        if path is not None and path.endswith(".ipynb"):
            raise click.BadParameter(f"{path}: verify runs Python scripts; export the notebook first "
                                     f"(`jupyter nbconvert --to script {path}`)", param_hint=what)
    try:
        target = parse_target(target)
    except TargetError as exc:
        raise click.BadParameter(str(exc), param_hint="--to") from None
    opts = Options(script=Path(script), target=target, args=list(script_args), against=Path(against) if against else None,
                   steps=steps, batches=batches, nproc=nproc, timeout=timeout, stall=stall, data=data, samples=samples,
                   keep=keep, fail_fast=fail_fast, cache=not no_cache)
    tty = sys.stderr.isatty()
    try:
        verdict = run_verify(opts, progress=(lambda text: _err(f"verify: {text}")) if tty else None)
    except VerifyError as exc:
        _err(f"{script}: could not judge: {exc}")
        sys.exit(EXIT_ERROR)
    if fmt == "json":
        _echo(json.dumps(verdict.as_json(), indent=1))
    else:
        _echo(f"{script} --to {target}: {verdict.status}: {verdict.reason} ({verdict.seconds:.1f} s)")
        width = max((len(c.name) for c in verdict.checks), default=0)
        for check in verdict.checks:
            where = f" [{check.line}]" if check.line else ""
            _echo(f"  {check.status:<4}  {check.name:<{width}}  {check.detail}{where}")
    sys.exit(verdict.exit_code)
