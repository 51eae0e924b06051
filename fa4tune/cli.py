"""The `fa4tune` command line: a thin layer over fa4tune.api (search and bench, the same functions the
Python API runs), fa4tune.searches.compile_space, fa4tune.report.command and fa4.database.

Data goes to stdout (`--format table|json`), progress and the defaults in use to stderr (`-q` silences
progress, `-v` adds a line per item). Options mean the same in every command: the shape options come
from one decorator, `shape_options`, and `--arch`, `--db`, `--jobs`, `--format` from their own.
Run outputs go to the results directory (`fa4tune.paths`: $FA4TUNE_HOME, else the user cache folder)
unless an option names a file.

Every command refuses options that contradict each other (`refuse_contradictions`, run by the group
for each command it resolves, whoever defined it): two spellings of one setting (`--causal
--no-causal`, `--peers --no-peers`), one option given twice with different values, two options that
exclude each other (`EXCLUSIVE_OPTIONS`), an option that does nothing in a command's mode
(`IGNORED_WITH`: `search --compile-only --peers`) or without another option (`NEEDS`: `compile-space
--seed` without `--limit`). Click alone would keep the last one, or ignore one, silently. Every file a
command writes is checked before the work starts (`check_output`: a long run must not end unable to
write), and a failed write, like any failure on a file, is a one-line error, not a traceback.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass

import click

from fa4 import backends
from fa4tune.api import DEFAULT_PROBLEM, describe_problems, detect_gpus
from fa4tune.paths import check_output, write_failed
from fa4tune.benchmark.runner import ROUNDS as BENCH_ROUNDS
from fa4tune.searches.retime import ROUNDS as RETIME_ROUNDS, TOP as RETIME_TOP
from fa4tune.searches.runner import EFFORTS
from fa4tune.workers.timing import L2_STATES

# the shape options' defaults: the API's default problem (one definition)
DEFAULT_SHAPE = {"batch": DEFAULT_PROBLEM["batch"], "heads": DEFAULT_PROBLEM["heads_q"],
                 "gqa": DEFAULT_PROBLEM["heads_q"] // DEFAULT_PROBLEM["heads_kv"],
                 "head_dim": DEFAULT_PROBLEM["head_dim"], "seqlen": DEFAULT_PROBLEM["seqlen_q"],
                 "dtype": DEFAULT_PROBLEM["dtype"]}


@dataclass
class Verbosity:
    quiet: bool = False
    verbose: bool = False

    def progress(self):
        from fa4tune.progress import Progress

        return Progress(quiet=self.quiet, verbose=self.verbose)


# ------------------------------------------------------------------------------------------------
# contradicting options, outputs that cannot be written

# options that exclude each other, in whichever command has both
EXCLUSIVE_OPTIONS = (("--gqa", "--heads-kv"), ("--shapes-file", "--model"), ("--shapes", "--shapes-file"),
                     ("--shapes", "--model"), ("--db", "--no-db"), ("--effort", "--trials"),
                     ("--varlen", "--shapes-file"), ("--varlen", "--model"), ("--varlen-tokens", "--varlen-sequences"),
                     # a varlen batch with a window or softcap comes from a shapes file's [[varlen]] table
                     ("--varlen", "--window"), ("--varlen", "--softcap"))
# per command, a mode option and the options it makes do nothing (refused with it, not ignored)
IGNORED_WITH = {
    "search": ("--compile-only", ("--sampler", "--timeout", "--trial-timeout", "--storage", "--study", "--workers",
                                  "--db", "--no-db", "--l2", "--peers", "--no-peers", "--warm-start",
                                  "--cold-start", "--retime")),
    "rescale-stats": ("--show", ("--seqlen", "--threshold", "--kind", "--causal", "--no-causal", "--both",
                                 "--heads", "--heads-kv", "--head-dim", "--dtype", "--format", "--out")),
}
# per command, an option that does something only with another one (refused without it)
NEEDS = {
    "compile-space": (("--seed", "--limit"),),          # --seed picks the sample --limit takes
    "search": (("--varlen-tokens", "--varlen"), ("--varlen-sequences", "--varlen"), ("--varlen-seed", "--varlen")),
    "report": (("--screenshot-size", "--screenshot"),),
}


def refuse_contradictions(ctx: click.Context, args: list[str]) -> None:
    """Raise a UsageError naming both options when `args` (the command line of `ctx`'s command, before
    click parses it) set one setting two ways: two flags of one parameter (`--causal --no-causal`,
    `--both --causal`, `--peers --no-peers`), one option twice with different values (`--seqlen 1024
    --seqlen 2048`), or both options of an `EXCLUSIVE_OPTIONS` pair. Options that may repeat
    (multiple, count) are left alone; the parsing itself stays click's."""
    # option string -> (its parameter, whether it takes a value, the value a flag sets)
    spellings: dict[str, tuple[click.Option, bool, object]] = {}
    for param in ctx.command.get_params(ctx):
        if isinstance(param, click.Option):
            for opt in param.opts:
                spellings[opt] = (param, not param.is_flag and not param.count, param.flag_value)
            for opt in param.secondary_opts:   # the --no-x of a --x/--no-x pair
                spellings[opt] = (param, False, not param.flag_value)

    def said(opt: str, value: object) -> str:
        return f"{opt} {value}" if spellings[opt][1] else opt

    options = args[:args.index("--")] if "--" in args else args   # after "--" only arguments follow
    if any(token in ctx.help_option_names for token in options):
        return   # the help is shown, whatever else was given
    given: dict[str, tuple[str, object]] = {}  # parameter name -> (option string, value), as first given
    seen: set[str] = set()                      # every option string given
    tokens = iter(options)
    for token in tokens:
        name, eq, attached = token.partition("=") if token.startswith("--") else (token, "", "")
        if name not in spellings and not token.startswith("--") and token[:2] in spellings:
            name, eq, attached = token[:2], "=", token[2:]   # a short option's value written on (-oFILE)
        if name not in spellings:
            continue   # an argument, or a value click will refuse
        param, takes_value, value = spellings[name]
        seen.add(name)
        if takes_value:
            value = attached if eq else " ".join(next(tokens, "") for _ in range(param.nargs))
        if param.multiple or param.count:
            continue
        first = given.setdefault(param.name, (name, value))
        if first[1] != value:
            raise click.UsageError(f"{said(*first)} and {said(name, value)} contradict each other: give one",
                                   ctx=ctx)
    def gave(opt: str) -> bool:   # the option itself, not another spelling of its parameter
        return opt in seen

    for pair in EXCLUSIVE_OPTIONS:
        if all(opt in spellings and spellings[opt][0].name in given for opt in pair):
            raise click.UsageError(f"give {pair[0]} or {pair[1]}, not both", ctx=ctx)
    mode, ignored = IGNORED_WITH.get(ctx.info_name, ("", ()))
    if gave(mode):
        useless = [opt for opt in ignored if gave(opt)]
        if useless:
            raise click.UsageError(f"{', '.join(useless)} {'does' if len(useless) == 1 else 'do'} nothing with "
                                   f"{mode}: leave {'it' if len(useless) == 1 else 'them'} out", ctx=ctx)
    for option, needed in NEEDS.get(ctx.info_name, ()):
        if gave(option) and not gave(needed):
            raise click.UsageError(f"{option} does something only with {needed}: give both or neither", ctx=ctx)


class StrictGroup(click.Group):
    """A click group that checks every command it runs with `refuse_contradictions`, and ends one that
    fails on a file (an OSError its own code did not turn into a message) with one line naming the
    file, not a traceback; those other modules define too. Its sub-groups are of this class."""

    group_class = type

    def resolve_command(self, ctx, args):
        name, command, rest = super().resolve_command(ctx, args)
        if command is not None and not isinstance(command, click.Group) and not ctx.resilient_parsing:
            refuse_contradictions(click.Context(command, info_name=name, parent=ctx), rest)
        return name, command, rest

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except OSError as exc:
            raise click.ClickException(f"{exc.filename}: {exc.strerror}" if exc.filename and exc.strerror
                                       else str(exc)) from exc


@click.group(cls=StrictGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 80})
@click.version_option(package_name="fa4tune", prog_name="fa4tune")
@click.option("-q", "--quiet", is_flag=True, help="no progress on stderr (results and errors only)")
@click.option("-v", "--verbose", is_flag=True, help="a progress line per item (compiled configuration, bench row)")
@click.pass_context
def main(ctx, quiet: bool, verbose: bool) -> None:
    """Tune, record and compare our FA4-style attention kernels."""
    if quiet and verbose:
        raise click.UsageError("give -q or -v, not both")
    ctx.obj = Verbosity(quiet, verbose)


def _verbosity() -> Verbosity:
    ctx = click.get_current_context(silent=True)
    obj = ctx.find_object(Verbosity) if ctx is not None else None
    return obj or Verbosity()


def _echo_err(text: str) -> None:
    if not _verbosity().quiet:
        click.echo(text, err=True)


# ------------------------------------------------------------------------------------------------
# shared options

class WindowType(click.ParamType):
    """--window LEFT,RIGHT: two integers, each checked as `fa4.attention` checks window_size
    (`fa4.kernels.problem.window_pair`, the check `resolve_mask` makes)."""

    name = "LEFT,RIGHT"

    def convert(self, value, param, ctx):
        from fa4.kernels.problem import window_pair

        if isinstance(value, tuple):
            return value
        sides = str(value).split(",")
        try:
            pair = tuple(int(side.strip()) for side in sides)
        except ValueError:
            pair = ()
        if len(pair) != 2:
            self.fail(f"{value!r} is not LEFT,RIGHT: two integers, -1 for an unbounded side (e.g. 4095,0)",
                      param, ctx)
        try:
            return window_pair(pair)
        except ValueError as exc:
            self.fail(f"{value}: {exc}", param, ctx)


def _check_softcap(ctx, param, value):
    from fa4.kernels.problem import softcap_value

    if value is None:
        return None
    try:
        return softcap_value(value)
    except ValueError:
        raise click.BadParameter(f"{value:g} is not a finite number > 0 (leave --softcap out for none)") from None


def shape_options(fn):
    """--batch --heads --heads-kv/--gqa --head-dim --seqlen --seqlen-k --dtype --lse
    --causal/--no-causal/--both (both by default, in every command) --window --softcap."""
    options = [
        click.option("--batch", type=click.IntRange(min=1), default=DEFAULT_SHAPE["batch"], show_default=True),
        click.option("--heads", type=click.IntRange(min=1), default=DEFAULT_SHAPE["heads"], show_default=True,
                     help="query heads"),
        click.option("--gqa", type=click.IntRange(min=1), default=None,
                     help=f"query heads per KV head [default: {DEFAULT_SHAPE['gqa']}]"),
        click.option("--heads-kv", type=click.IntRange(min=1), default=None,
                     help="KV heads (instead of --gqa)"),
        click.option("--head-dim", type=click.IntRange(min=1), default=DEFAULT_SHAPE["head_dim"], show_default=True),
        click.option("--seqlen", type=click.IntRange(min=1), default=DEFAULT_SHAPE["seqlen"], show_default=True,
                     help="query length (and key length unless --seqlen-k)"),
        click.option("--seqlen-k", type=click.IntRange(min=1), default=None, help="key length [default: --seqlen]"),
        click.option("--dtype", type=click.Choice(["fp16", "bf16"]), default=DEFAULT_SHAPE["dtype"], show_default=True),
        click.option("--lse", is_flag=True, help="the variant that also returns the log-sum-exp"),
        click.option("--causal", "mask", flag_value="causal", help="causal only"),
        click.option("--no-causal", "mask", flag_value="full", help="non-causal only"),
        click.option("--both", "mask", flag_value="both", default=True, help="both (default)"),
        click.option("--window", type=WindowType(), default=None,
                     help="sliding window: keys seen left,right of the diagonal (flash-attn's window_size: "
                          "-1 unbounded; under causal the right side is 0)"),
        click.option("--softcap", type=float, default=None, callback=_check_softcap, metavar="C",
                     help="softcap C > 0: each scaled score s becomes C*tanh(s/C)"),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def shape_set_options(fn):
    """--shapes-file and --model: a set of problems instead of the shape options."""
    fn = click.option("--model", default=None, metavar="NAME",
                      help="a model preset's shape set (fa4tune.inputs.shape_sets.model_names(): llama-3-8b, ...) "
                           "instead of the shape options")(fn)
    return click.option("--shapes-file", default=None, type=click.Path(dir_okay=False),
                        help="a TOML list of problems ([[problem]] tables; FA4_RECORD_SHAPES writes one) "
                             "instead of the shape options")(fn)


_SHAPE_OPTION_NAMES = ("batch", "heads", "gqa", "heads_kv", "head_dim", "seqlen", "seqlen_k", "dtype", "lse",
                       "window", "softcap")


def problems_from_set(shapes_file, model, mask):
    """The problems of --shapes-file or --model (None when neither is given; `EXCLUSIVE_OPTIONS` refuses
    both); --causal/--no-causal keep one mask of the set, the other shape options may not be given
    with a set."""
    from fa4tune.inputs.shape_sets import ShapeSetError, load_model, load_shapes_file

    if shapes_file is None and model is None:
        return None
    ctx = click.get_current_context()
    given = [f"--{n.replace('_', '-')}" for n in _SHAPE_OPTION_NAMES
             if ctx.get_parameter_source(n) == click.core.ParameterSource.COMMANDLINE]
    if given:
        raise click.UsageError(f"{', '.join(given)} cannot be combined with a shape set (--shapes-file/--model); "
                               "write the shapes into the file instead")
    try:
        problems = load_shapes_file(shapes_file) if shapes_file else load_model(model)
    except ShapeSetError as exc:
        raise click.UsageError(str(exc)) from exc
    if mask in ("causal", "full"):
        problems = [p for p in problems if p.causal == (mask == "causal")]
        if not problems:
            raise click.UsageError(f"the shape set has no {'causal' if mask == 'causal' else 'non-causal'} problem")
    return problems


def varlen_options(fn):
    """--varlen (a length distribution's name, or the lengths) and how a distribution's batch is drawn."""
    options = [
        click.option("--varlen", "varlen_spec", default=None, metavar="DISTRIBUTION|L1,L2,...",
                     help="a variable-length batch instead of --batch/--seqlen: its lengths drawn from a "
                          "distribution (fa4tune.inputs.varlen_lengths: azure-conv-2023, azure-code-2023, "
                          "log-uniform) or written out; tuned as fa4.attention_varlen runs it"),
        click.option("--varlen-tokens", type=click.IntRange(min=1), default=None,
                     help=f"the drawn batch's total tokens [default: {VARLEN_TOKENS}]"),
        click.option("--varlen-sequences", type=click.IntRange(min=1), default=None,
                     help="draw this many sequences instead of filling --varlen-tokens"),
        click.option("--varlen-seed", type=int, default=0, show_default=True, help="which drawn batch"),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


# a drawn varlen batch's tokens when neither --varlen-tokens nor --varlen-sequences is given: a prefill
# step of a serving engine (vLLM's max_num_batched_tokens is of this order)
VARLEN_TOKENS = 16384


def problems_from_varlen(spec, tokens, sequences, seed, heads, gqa, heads_kv, head_dim, dtype, lse, mask):
    """The `VarlenProblem`s of --varlen (one per mask), or None without it; the shape options that a
    batch's lengths set (--batch, --seqlen, --seqlen-k) may not be given with it."""
    from fa4.varlen_batch import VarlenProblem
    from fa4tune.inputs.varlen_lengths import DISTRIBUTIONS, lengths

    if spec is None:
        return None
    ctx = click.get_current_context()
    given = [f"--{n.replace('_', '-')}" for n in ("batch", "seqlen", "seqlen_k")
             if ctx.get_parameter_source(n) == click.core.ParameterSource.COMMANDLINE]
    if given:
        raise click.UsageError(f"{', '.join(given)} cannot be combined with --varlen: the batch's lengths set them")
    try:
        if spec in DISTRIBUTIONS:
            drawn = lengths(spec, sequences=sequences, tokens=None if sequences else tokens or VARLEN_TOKENS, seed=seed)
        else:
            if tokens or sequences:
                raise ValueError("--varlen-tokens and --varlen-sequences draw from a distribution; the lengths "
                                 "given are the batch")
            try:
                drawn = [int(n) for n in spec.split(",")]
            except ValueError:
                raise ValueError(f"--varlen {spec!r} is neither a distribution ({', '.join(DISTRIBUTIONS)}) nor "
                                 "comma-separated lengths") from None
        [template] = problems_from_options(1, heads, gqa, heads_kv, head_dim, 1, None, dtype, lse, "full")
        problems = {VarlenProblem.of(drawn, heads_q=template.heads_q, heads_kv=template.heads_kv, head_dim=head_dim,
                                     dtype=dtype, causal=causal, return_lse=lse): None
                    for causal in {"causal": [True], "full": [False], "both": [False, True]}[mask or "both"]}
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    return list(problems)


def _check_arch(ctx, param, value: str) -> str:
    # validated when used, not declared as a Choice: the list lives in fa4.kernels, and importing it
    # (torch) on every `fa4tune --help` would make the help slow
    from fa4.kernels import ARCHS

    if value != "auto" and value not in ARCHS:
        raise click.BadParameter(f"{value!r} is not one of auto, {', '.join(ARCHS)}")
    return value


def arch_option(fn):
    return click.option("--arch", default="auto", show_default=True, callback=_check_arch,
                        metavar="auto|sm90|sm100",
                        help="kernel family; auto: the GPU's (sm90 on a machine without one, for the commands "
                             "that need no GPU)")(fn)


def db_option(fn):
    return click.option("--db", "db_path", default=None,
                        help="best-config database file [default: the user's, $FA4_CONFIG_DB or the results "
                             "directory's best_configs.json; reading without --db also reads the packaged one "
                             "under it]")(fn)


def peers_option(fn):
    return click.option("--peers/--no-peers", default=True, show_default=True,
                        help="time the peers too: " + ", ".join(b.title for b in backends.peers()))(fn)


def format_option(fn):
    return click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table",
                        show_default=True)(fn)


def _option_masks(mask) -> list[bool]:
    """The causal flags of --causal/--no-causal/--both."""
    return {"causal": [True], "full": [False], "both": [False, True]}[mask or "both"]


def problems_from_options(batch, heads, gqa, heads_kv, head_dim, seqlen, seqlen_k, dtype, lse, mask,
                          window=None, softcap=None):
    """The problems of the shape options: one per mask, the window and softcap resolved as a shapes
    file's table and `fa4.attention` resolve them (`resolve_mask`: a window as wide as the sequences is
    none, a right side 0 is causal, so both masks may be one problem)."""
    from fa4.kernels import AttentionProblem
    from fa4.kernels.problem import resolve_mask

    if gqa is not None and heads_kv is not None:
        raise click.UsageError("give --gqa or --heads-kv, not both")
    if heads_kv is None:
        ratio = gqa or DEFAULT_SHAPE["gqa"]
        if heads % ratio:
            raise click.UsageError(f"--heads {heads} is not divisible by --gqa {ratio}")
        heads_kv = heads // ratio
    seqlen_k = seqlen_k or seqlen
    problems: dict = {}
    try:
        for causal in _option_masks(mask):
            causal, resolved, cap = resolve_mask(causal, window, softcap, seqlen, seqlen_k)
            problems.setdefault(AttentionProblem(batch, seqlen, seqlen_k, heads, heads_kv, head_dim, dtype, causal,
                                                 lse, window=resolved, softcap=cap))
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    return list(problems)


def _resolve_arch(arch: str, gpus: list[dict], need_gpu: bool) -> str:
    from fa4tune.api import NoGpuError, resolve_arch

    try:
        return resolve_arch(arch, gpus, need_gpu)
    except (ValueError, NoGpuError) as exc:
        raise click.ClickException(str(exc)) from exc


def _table(title: str, columns: list[str], rows: list[list]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for c in columns:
        table.add_column(c, overflow="fold")  # wide content wraps within its column
    for r in rows:
        table.add_row(*["-" if v is None else str(v) for v in r])
    # rich's own width: the terminal's (or $COLUMNS); machines read --format json
    Console(file=sys.stdout).print(table)


def _compile_space_tables(results: list[dict], stream=None) -> None:
    """Per problem: the feasibility census by reason, and what compiled (fits the terminal)."""
    from rich.console import Console
    from rich.table import Table

    from fa4.kernels import AttentionProblem

    console = Console(file=stream or sys.stdout)
    for r in results:
        label = AttentionProblem(**r["problem"]).label()
        why = Table(title=f"{label}: {r['feasible']} of {r['space_size']} feasible; rejected before compiling, "
                          "by reason")
        why.add_column("reason (the first of its kind, with its numbers)")
        why.add_column("configurations", justify="right")
        examples = r.get("infeasible_examples") or {}
        for reason, n in r["infeasible_reasons"].items():
            why.add_row(examples.get(reason, reason), str(n))
        console.print(why)
        table = Table(title=f"{label}: compiled for {r['arch']} ({len(r['compiled'])})")
        for column in ("configuration", "registers", "spills (st/ld)", "smem B", "model B", "seconds", "problems"):
            table.add_column(column)
        for entry in sorted(r["compiled"], key=lambda e: bool(e["problems"])):
            report = entry.get("report") if isinstance(entry.get("report"), dict) else {}
            config = ("default " if entry["is_default"] else "") + _label(r["arch"], entry["config"])
            spills = (f"{report.get('spill_stores', '-')}/{report.get('spill_loads', '-')}"
                      if "spill_stores" in report else str(report.get("spills", "-")))
            table.add_row(config, str(report.get("registers", "-")), spills, str(report.get("smem_bytes", "-")),
                          str(entry["model_smem_bytes"]),
                          str(report.get("compile_seconds", entry.get("compile_s", "-"))),
                          "; ".join(entry["problems"]) or "ok")
        console.print(table)


def _fmt(x, digits=2):
    return None if x is None else f"{x:.{digits}f}"


def _label(arch: str, config: dict) -> str:
    from fa4.config_text import display_label

    return display_label(arch, config)


# ------------------------------------------------------------------------------------------------
# compile-space (and search --compile-only, the same code path)

def _run_compile_space(arch, problems, space_path, limit, jobs, seed, shard, fmt, out_path,
                       compile_timeout) -> None:
    from fa4tune.searches import compile_space
    from fa4tune.inputs.space import SpaceError, load_space

    try:
        space = load_space(arch, space_path)
        shard_index, shard_count = (int(x) for x in shard.split("/"))
        if not 0 <= shard_index < shard_count:
            raise ValueError(f"--shard {shard}: want i/n with 0 <= i < n")
    except (ValueError, SpaceError) as exc:
        raise click.UsageError(str(exc)) from exc
    check_output(out_path, "--out")
    jobs = jobs or os.cpu_count() or 2
    _echo_err(f"fa4tune compile-space: {arch}, {describe_problems(problems)}; {space.size} configurations "
              f"({space.source or 'all declared choices'}), compiling "
              f"{'every feasible one' if not limit else f'up to {limit} feasible ones'} per problem "
              f"with {jobs} processes")
    results = compile_space.run(arch, problems, space, limit or 10**9, seed=seed, processes=jobs,
                                shard=(shard_index, shard_count), compile_timeout_s=compile_timeout,
                                progress=_verbosity().progress())
    if out_path:
        try:
            compile_space.write_json(results, out_path)
        except OSError as exc:
            raise write_failed(exc) from exc
    if fmt == "json":
        click.echo(json.dumps(results, indent=1, sort_keys=True))
    else:
        _compile_space_tables(results)
    for line in compile_space.summary_lines(results):
        click.echo(line, err=True)
    sys.exit(compile_space.exit_status(results))


@main.command("compile-space")
@shape_options
@arch_option
@click.option("--space", "space_path", default=None, help="search-space TOML [default: search_spaces/<arch>.toml]")
@click.option("--limit", type=click.IntRange(min=0), default=0, show_default=True,
              help="compile at most this many feasible configurations per problem (0: all; the default first)")
@click.option("--jobs", type=click.IntRange(min=1), default=None, help="compile processes [default: all cores]")
@click.option("--seed", type=int, default=0, show_default=True, help="which sample --limit takes")
@click.option("--shard", default="0/1", show_default=True,
              help="i/n: compile only the feasible configurations in part i of n (by a hash of their knob "
                   "values, so a configuration keeps its part when the model changes): a whole space "
                   "in several time-limited runs")
@click.option("--compile-timeout", type=float, default=300.0, show_default=True, help="seconds per compile")
@format_option
@click.option("--out", "out_path", default=None, help="also write the results as JSON (a list, one per problem)")
def compile_space_command(batch, heads, gqa, heads_kv, head_dim, seqlen, seqlen_k, dtype, lse, mask, window, softcap,
                          arch, space_path, limit, jobs, seed, shard, compile_timeout, fmt, out_path):
    """Compile a search space on CPU: feasibility, registers, spills, shared memory, PTX (no GPU needed).

    Exit status: 0 clean; 1 a configuration the model accepts failed the compile check; 4 the default
    configuration is infeasible (flags add up); 2 a usage error."""
    problems = problems_from_options(batch, heads, gqa, heads_kv, head_dim, seqlen, seqlen_k, dtype, lse, mask,
                                     window, softcap)
    arch = _resolve_arch(arch, detect_gpus() if arch == "auto" else [], need_gpu=False)
    _run_compile_space(arch, problems, space_path, limit, jobs, seed, shard, fmt, out_path, compile_timeout)


# ------------------------------------------------------------------------------------------------
# search

@main.command()
@shape_options
@shape_set_options
@arch_option
@click.option("--effort", type=click.Choice(list(EFFORTS)), default=None,
              help="a preset of --trials: " + "; ".join(f"{name} {n}" for name, n in EFFORTS.items())
                   + " (from the searches' own curves: docs/tuning.md) [default: default]")
@click.option("--trials", type=click.IntRange(min=1), default=None,
              help="configurations per study that pass the feasibility model (infeasible ones are "
                   "recorded but not counted); a re-run resumes up to this many. With --compile-only: "
                   "how many feasible configurations to compile per problem [default: --effort's]")
@click.option("--sampler", type=click.Choice(["tpe", "grid", "random"]), default="tpe", show_default=True)
@click.option("--timeout", type=float, default=None, help="wall-clock budget per study, seconds")
@click.option("--trial-timeout", type=float, default=20.0, show_default=True,
              help="GPU phase of one trial, seconds; a hung worker is killed and replaced")
@click.option("--compile-timeout", type=float, default=300.0, show_default=True, help="seconds per compile")
@click.option("--storage", default=None, help="optuna storage: journal file or sqlite:/// URL "
                                               "[default: the results directory's studies.journal]")
@click.option("--study", default=None, help="study name [default: the shape key]")
@click.option("--workers", type=click.IntRange(min=1), default=1, show_default=True,
              help="GPUs to use, one worker group per GPU: a shape set runs one study per GPU at a time, "
                   "a single problem runs one study over all of them")
@click.option("--jobs", type=click.IntRange(min=1), default=None,
              help="worker processes in all (they compile in parallel) [default: cores - 2, at most 12 per GPU; "
                   "with --compile-only: all cores]")
@click.option("--seed", type=int, default=0, show_default=True)
@format_option
@db_option
@click.option("--no-db", is_flag=True, help="do not record the best configuration")
@click.option("--space", "space_path", default=None, help="search-space TOML [default: search_spaces/<arch>.toml]")
@click.option("--l2", type=click.Choice(L2_STATES), default="warm", show_default=True, help="L2 state when timing")
@peers_option
@click.option("--warm-start/--cold-start", default=True, show_default=True,
              help="seed a new study with the best configurations of its nearest tuned neighbours in the "
                   "database (same arch, dtype, head dim; both masks)")
@click.option("--retime", "retime_rounds", type=click.IntRange(min=0), default=RETIME_ROUNDS, show_default=True,
              help=f"after a study, time its {RETIME_TOP} fastest configurations and the default this many times "
                   "each and record the lowest median (the search's single best is partly luck); 0: off")
@click.option("--compile-only", is_flag=True,
              help="no GPU: `fa4tune compile-space` with --limit TRIALS (the same code path and exit status)")
@click.option("--backward", is_flag=True, default=False,
              help="search our backward kernel's knobs (knob set <arch>_bwd) instead of the forward's: each "
                   "trial validated (dQ, dK, dV) and timed as the backward alone, the peers' backward "
                   "timed beside it; entries recorded under their own keys")
@varlen_options
def search(batch, heads, gqa, heads_kv, head_dim, seqlen, seqlen_k, dtype, lse, mask, window, softcap, shapes_file,
           model, arch,
           effort, trials, sampler,
           timeout, trial_timeout, compile_timeout, storage, study, workers, jobs, seed, fmt, db_path, no_db,
           space_path, l2, peers, warm_start, retime_rounds, compile_only, backward,
           varlen_spec, varlen_tokens, varlen_sequences, varlen_seed):
    """Search kernel knobs per shape with optuna; validate, time, record the best.

    --varlen tunes our varlen kernel on a variable-length batch (fa4.attention_varlen's packed layout),
    timing the peers' varlen kernels and per-sequence calls beside it."""
    from fa4tune.api import NoGpuError, run_search_set
    from fa4tune.inputs.space import SpaceError
    from fa4tune.workers.pool import PoolError

    trials = trials or EFFORTS[effort or "default"]
    problems = (problems_from_set(shapes_file, model, mask)
                or problems_from_varlen(varlen_spec, varlen_tokens, varlen_sequences, varlen_seed, heads, gqa,
                                        heads_kv, head_dim, dtype, lse, mask)
                or problems_from_options(batch, heads, gqa, heads_kv, head_dim, seqlen, seqlen_k, dtype, lse, mask,
                                         window, softcap))
    if backward and any(p.varlen for p in problems):
        raise click.UsageError("--backward: our varlen kernel has no backward (a varlen batch's gradients run "
                               "a peer's varlen kernel or the per-sequence path)")
    if compile_only and backward:
        # the backward's whole space is compile-checked by tests/test_sm90_bwd_compile.py
        raise click.UsageError("--compile-only compiles forward spaces; --backward needs a GPU")
    if compile_only:
        arch = _resolve_arch(arch, detect_gpus() if arch == "auto" else [], need_gpu=False)
        # a varlen batch compiles as its compiled problem (the lengths are run-time values)
        compiled = list(dict.fromkeys(p.base() if hasattr(p, "base") else p for p in problems))
        _run_compile_space(arch, compiled, space_path, trials, jobs, seed, "0/1", fmt, None, compile_timeout)
    _check_search_outputs(storage, db_path, no_db)
    try:
        summaries = run_search_set(
            problems, gpus=detect_gpus(), arch=arch, trials=trials, sampler=sampler, seed=seed, timeout=timeout,
            trial_timeout=trial_timeout, compile_timeout=compile_timeout, storage=storage, study=study,
            workers=workers, jobs=jobs, db=db_path, record_db=not no_db, space=space_path, l2=l2, peers=peers,
            warm_start=warm_start, retime_rounds=retime_rounds, backward=backward, progress=_verbosity().progress())
    except NoGpuError as exc:
        click.echo(f"fa4tune search: {exc}", err=True)
        sys.exit(2)
    except (PoolError, SpaceError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    _print_summaries(summaries, fmt)
    broken_default = [s["study"] for s in summaries if s["default_us"] is None]
    if broken_default:
        # the runtime falls back to the default for untuned shapes: a default that does not
        # validate is a kernel bug, whatever the search found
        click.echo(f"the default configuration did not run correctly in: {', '.join(broken_default)}", err=True)
    if broken_default or not all(s["best"] for s in summaries):
        sys.exit(1)


def _check_search_outputs(storage: str | None, db_path: str | None, no_db: bool) -> None:
    """What a search writes, checked before it starts: the journal (or an SQLite URL's file; a
    server's URL is the server's business) and, unless --no-db, the database it records into."""
    from fa4tune import paths
    from fa4tune.searches.storage import sqlite_file_of

    journal = paths.storage_path() if storage is None else sqlite_file_of(storage) if "://" in storage else storage
    check_output(journal, "--storage")
    if not no_db:
        check_output(db_path or paths.database_path(), "--db")


def _print_summaries(summaries: list[dict], fmt: str) -> None:
    if fmt == "json":
        click.echo(json.dumps(summaries, indent=2, sort_keys=True))
        return
    rows = []
    for s in summaries:
        best = s["best"] or {}
        fails = ", ".join(f"{k} {v}" for k, v in s["outcomes"].items() if k != "ok" and v) or "-"
        peers = "; ".join(f"{n} {_fmt(d.get('us'))}" if "us" in d else f"{n} n/a"
                          for n, d in (s["peers"] or {}).items())
        speed = ", ".join(f"{k} {v}x" for k, v in s["speedup"].items()) or "-"
        rows.append([s["study"], s["evaluated"], s["outcomes"]["ok"], fails, _fmt(best.get("us")),
                     _fmt(best.get("tflops"), 1), _fmt(s["default_us"]), peers, speed, _fmt(s.get("wall_s"), 1)])
    _table("fa4tune search", ["study", "evaluated", "ok", "failures", "best us", "TFLOP/s", "default us",
                              "peers us", "speedup of best over", "wall s"], rows)
    for s in summaries:
        if s["best"]:
            # a label pastes back: fa4.attention(..., config="<label>")
            click.echo(f"{s['study']}: best trial {s['best']['trial']}: {_label(s['arch'], s['best']['config'])}")


# ------------------------------------------------------------------------------------------------
# best

@main.command()
@format_option
@db_option
def best(fmt, db_path):
    """List the best-config database: the packaged layer, then the user's (later wins per key), with the
    layer of each entry, the fastest backend measured at its shape (eager / captured, `fa4.dispatch`)
    and a stale column (kernel fingerprint changed). --db lists that file alone. Exits 1 when a file
    cannot be read or an entry fails the check (each named on stderr; the rest is listed)."""
    from fa4 import dispatch
    from fa4.database import BestConfigDB, DatabaseError
    from fa4.kernels import BACKWARD_KERNELS
    from fa4.varlen_batch import problem_from_dict
    from fa4tune import environment

    if db_path is not None:
        try:
            db = BestConfigDB.load(db_path, "--db")
        except DatabaseError as exc:
            raise click.ClickException(str(exc)) from exc
    else:
        db = BestConfigDB.load_layers()
    for layer, path, count, error in db.layers:
        _echo_err(f"fa4tune best: {layer} {path}: " + (f"UNUSABLE: {error}" if error else f"{count} entries"))
    for s in db.skipped:
        _echo_err(f"fa4tune best: {s.layer} {s.path}: entry {s.key} SKIPPED: {s.reason}")
    current = {arch: environment.kernel_fingerprint(arch) for arch in {e.arch for e in db.entries}}
    out = []
    for e in db.entries:
        fp = current.get(e.arch, "")
        stale = "unknown" if fp.startswith("unavailable") else e.kernel_fingerprint != fp
        choices = [dispatch.choose(e.backend_us, dispatch.host_us(e.device), mode) for mode in dispatch.MODES]
        out.append({**e.to_dict(), "stale": stale, "layer": db.layer_of(e.key),
                    "shadows": [layer for layer, _ in db.shadowed(e.key)],
                    "fastest_backend": {c.mode: c.backend for c in choices if c is not None}})
    if fmt == "json":
        click.echo(json.dumps(out, indent=2, sort_keys=True))
    else:
        # the columns a reader scans; the rest (TFLOP/s, max error, study and trial, every peer's
        # speedup, the bucket key) is in --format json
        rows = []
        for d in out:
            # speedup: a peer's time over ours; the fastest peer has the smallest
            peers = {k: v for k, v in d["speedup"].items() if k != "default" and v}
            rival = min(peers, key=peers.get) if peers else None
            versus = f"{1 / peers[rival]:.3f} ({backends.title(rival)})" if rival else None
            layer = d["layer"] + (f" (over {', '.join(d['shadows'])})" if d["shadows"] else "")
            fastest = " / ".join(backends.title(d["fastest_backend"][m]) for m in dispatch.MODES
                                 if m in d["fastest_backend"]) or None
            # a backward entry (`search --backward`) beside its forward one: the same problem, another pass
            rows.append([problem_from_dict({**d["problem"], **(d.get("varlen") or {})}).label(),
                         "backward" if d["arch"] in BACKWARD_KERNELS
                         else "forward", layer, _label(d["arch"], d["config"]),
                         _fmt(d["us"]), versus, fastest,
                         {True: "STALE", False: "no"}.get(d["stale"], d["stale"]), d["date"][:10]])
        _table(f"best configurations ({len(rows)})",
               ["problem", "pass", "layer", "config", "us", "ours ÷ fastest peer", "fastest eager / captured", "stale",
                "date"], rows)
    if db.errors or db.skipped:
        sys.exit(1)


@main.group()
def db():
    """Best-config database files: combine them, record a bench's per-implementation times."""


@db.command("merge")
@click.argument("inputs", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("-o", "--out", "out_path", default=None,
              help="the database to merge into, created if missing; an existing one keeps its entries, which "
                   "take part in the merge [default: the user's database, $FA4_CONFIG_DB or the results "
                   "directory's best_configs.json]")
def db_merge(inputs, out_path):
    """Merge databases tuned on several machines into one: the user's database, or -o. Per key, a current
    entry (this checkout's kernel fingerprint) beats a stale one, then the fastest wins; the target's own
    entries compete like the inputs' (and win ties). The target is read, merged and written in one
    locked step, so a search recording into it meanwhile loses nothing. Prints what it kept."""
    from fa4.database import BestConfigDB, DatabaseError, default_path, merge_databases, update
    from fa4.kernels import KNOB_SETS
    from fa4tune import environment

    target = out_path or str(default_path())
    missing = [path for path in inputs if not os.path.exists(path)]
    if missing:
        raise click.ClickException(f"no such database: {', '.join(missing)}")
    fingerprints = {}
    for arch in KNOB_SETS:   # the backward knob sets' entries are judged by their own fingerprint too
        fp = environment.kernel_fingerprint(arch)
        fingerprints[arch] = None if fp.startswith("unavailable") else fp

    def merge_into(own: BestConfigDB):
        # the inputs are read under the target's lock too: one of them may be the target itself
        dbs = [BestConfigDB.load(path) for path in inputs]
        before = list(own.entries)
        merged = merge_databases([own, *dbs], fingerprints)
        new = [entry for entry in merged.entries if own.get(entry.key) is not entry]
        for entry in new:
            own.put(entry)
        return dbs, before, own.skipped, merged, len(new)

    try:
        dbs, before, own_skipped, merged, changed = update(target, merge_into)
    except DatabaseError as exc:
        raise click.ClickException(f"{exc}; nothing was written") from exc
    except OSError as exc:
        raise click.ClickException(_cannot_write(target, exc)) from exc
    for path, d in [(target, None), *zip(inputs, dbs)]:
        entries, skipped = (before, own_skipped) if d is None else (d.entries, d.skipped)
        kept = sum(1 for e in entries if merged.get(e.key) is e)
        role = " (the target)" if d is None else ""
        _echo_err(f"fa4tune db merge: {path}{role}: {len(entries)} entries, {kept} kept")
        for s in skipped:
            fate = ("not merged" if d is not None else "replaced by the merged entry of its key"
                    if merged.get(s.key) else "left in it as it is")
            _echo_err(f"fa4tune db merge: {path}: entry {s.key} fails the check ({s.reason}); {fate}")
    stale = sum(1 for e in merged.entries if e.is_stale(fingerprints.get(e.arch)))
    _echo_err(f"{'wrote' if changed else 'unchanged:'} {target}: {len(merged)} entries"
              + (f", {stale} stale (no current entry for their key)" if stale else ""))


@db.command("import-bench")
@click.argument("bench_path", type=click.Path(exists=True, dir_okay=False))
@db_option
def db_import_bench(bench_path, db_path):
    """Record in each database entry the GPU time of every implementation a bench timed at its shape
    (ours and the peers, one run), which `fa4.explain` judges the fastest backend from. Entries tuned
    on other kernel sources than the bench ran are left alone. The database is read, changed and
    written in one locked step."""
    from fa4.database import DatabaseError, default_path, update
    from fa4tune.benchmark.runner import backend_times, import_backend_times, read_bench

    target = db_path or str(default_path())
    try:
        doc = read_bench(bench_path)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    try:
        backend_times(doc)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise click.ClickException(f"{bench_path}: malformed bench rows ({type(exc).__name__}: {exc})") from exc
    try:
        updated, skipped = update(target, lambda db: import_backend_times(doc, db))
    except DatabaseError as exc:
        raise click.ClickException(f"{exc}; nothing was written") from exc
    except OSError as exc:
        raise click.ClickException(_cannot_write(target, exc)) from exc
    for line in skipped:
        _echo_err(f"skipped {line}")
    _echo_err(f"fa4tune db import-bench: {len(updated)} entries of {target} updated from {bench_path}")


def _cannot_write(target: str, exc: OSError) -> str:
    """One line for a database file that cannot be locked or written (the temporary file's name, which
    the OSError may carry, would only confuse)."""
    return f"cannot write {target}: {exc.strerror or exc}; nothing was written"


# ------------------------------------------------------------------------------------------------
# bench

@main.command()
@shape_options
@shape_set_options
@click.option("--shapes", default=None,
              help="space/comma separated shape keys, e.g. 'sq1024-gqa4-causal s4096-bf16-full' "
                   "(tokens: b hq hkv gqa d s sq sk fp16 bf16 causal full wl wr cap lse; the rest from the "
                   "shape options)")
@arch_option
@db_option
@click.option("--out", "out_path", default=None, help="JSON output [default: the results directory's bench.json]")
@click.option("--csv", "csv_path", default=None, help="also write the rows as CSV")
@format_option
@click.option("--jobs", type=click.IntRange(min=1), default=4, show_default=True,
              help="worker processes in all (they compile in parallel)")
@click.option("--l2", type=click.Choice(L2_STATES), default="warm", show_default=True, help="L2 state when timing")
@peers_option
@click.option("--rounds", type=click.IntRange(min=1), default=BENCH_ROUNDS, show_default=True,
              help="time every row this many times, in interleaved rounds, and keep its lowest median "
                   "(a transient slows one round, not all)")
@click.option("--backward", is_flag=True, default=False,
              help="time the training pass too: forward + backward and backward alone, fa4.attention "
                   "and every peer (gradients validated)")
@click.option("--shapes-per-part", type=click.IntRange(min=0), default=0, show_default=True,
              help="run the shapes this many at a time (each part's rounds interleaved within it) and write "
                   "--out after each part, so a run cut short keeps the shapes it finished (0: one part)")
@click.option("--resume", is_flag=True, default=False,
              help="keep the shapes an earlier run of the same settings wrote to --out and time the rest")
def bench(batch, heads, gqa, heads_kv, head_dim, seqlen, seqlen_k, dtype, lse, mask, window, softcap, shapes_file,
          model, shapes, arch, db_path,
          out_path, csv_path, fmt, jobs, l2, peers, rounds, backward, shapes_per_part, resume):
    """Tuned vs default vs peers, same timing, for a list of shapes; writes bench.json."""
    from fa4tune import paths
    from fa4tune.api import NoGpuError, run_bench_set
    from fa4tune.inputs.shapes import parse_shape_masks
    from fa4tune.workers.pool import PoolError

    shape_set = problems_from_set(shapes_file, model, mask)
    problems = shape_set or problems_from_options(batch, heads, gqa, heads_kv, head_dim, seqlen, seqlen_k,
                                                  dtype, lse, mask, window, softcap)
    if shapes:
        # the tokens a key leaves out come from the shape options, the window and softcap as given (each
        # key's own lengths decide what they hide); a key without a mask stands for the options' masks
        base = {**problems[0].to_dict(), "window": window, "softcap": softcap}
        parsed: dict = {}
        for text in shapes.replace(",", " ").split():
            try:
                parsed.update(dict.fromkeys(parse_shape_masks(text, base, _option_masks(mask))))
            except ValueError as exc:
                raise click.UsageError(str(exc)) from exc
        problems = list(parsed)
    check_output(out_path or paths.bench_path(), "--out")
    check_output(csv_path, "--csv")
    try:
        doc = run_bench_set(problems, gpus=detect_gpus(), arch=arch, db=db_path, out=out_path, csv=csv_path,
                            jobs=jobs, l2=l2, peers=peers, rounds=rounds, backward=backward,
                            progress=_verbosity().progress(), shapes_per_part=shapes_per_part, resume=resume)
    except NoGpuError as exc:
        click.echo(f"fa4tune bench: {exc}", err=True)
        sys.exit(2)
    except (PoolError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    arch = doc["arch"]
    if fmt == "json":
        click.echo(json.dumps(doc, indent=2, sort_keys=True))
        return
    rounds = doc["timing"].get("rounds", 1)
    _table(f"fa4tune bench on {doc['device'].get('name')}, lowest of {rounds} round{'s' if rounds != 1 else ''} "
           f"per row (timing: {doc['timing']})",
           ["shape", "variant", "outcome", "us", "TFLOP/s", "tuned faster by", "lookup", "error", "configuration"],
           [[r["shape"], r["variant"], r["outcome"], _fmt(r["us"]), _fmt(r["tflops"], 1),
             f"{r['speedup_of_tuned']}x" if r["speedup_of_tuned"] else None, r["lookup"],
             r["error"] or None, _label(arch, r["config"]) if r.get("config") else None] for r in doc["rows"]])
    from fa4tune.report.data import DISPATCH_TOLERANCE

    ran = {r["shape"]: r for r in doc["rows"] if r["variant"] == "dispatched"}
    picks = doc.get("dispatch", {})
    verdicts = _dispatch_verdicts(doc)

    def what_ran(shape, mode):
        backend = (ran.get(shape, {}).get("backend") or {}).get(mode)
        return backends.title(backend) if backend is not None else None

    def measured(shape, mode):
        """The fastest implementation measured in this run in `mode` with its time, and the dispatched
        row's time over it (fa4tune.report.data.dispatch_rows, the report's rule)."""
        d = verdicts.get(shape)
        if d is None:
            return [None, None]
        name, us, ratio, within = ((d.eager_fastest, d.eager_fastest_us, d.eager_ratio, d.eager_within_tolerance)
                                   if mode == "eager" else
                                   (d.fastest, d.fastest_us, d.ratio, d.graph_within_tolerance))
        return [f"{_impl_title(name)} {_fmt(us)}" if name else None,
                f"{ratio:.3f}x {'ok' if within else 'MISS'}" if ratio is not None else None]

    shapes = [s for s in dict.fromkeys(r["shape"] for r in doc["rows"]) if s in picks or s in verdicts]
    _table("fastest backend per shape: picked from this run's times, what fa4.attention ran (the "
           "\"dispatched\" rows; it follows the database's times), and the fastest measured in this run "
           "with the dispatched row's time over it (the bar: within 2 %)",
           ["shape", "eager: picked", "eager: ran", "eager us/call", "eager: fastest measured", "eager ratio",
            "captured: picked", "captured: ran", "captured us", "captured: fastest measured", "captured ratio"],
           [[shape, _picked(picks.get(shape), "eager"), what_ran(shape, "eager"),
             _fmt(ran.get(shape, {}).get("eager_us")), *measured(shape, "eager"),
             _picked(picks.get(shape), "graph"), what_ran(shape, "graph"), _fmt(ran.get(shape, {}).get("us")),
             *measured(shape, "graph")]
            for shape in shapes])
    bar = f"{DISPATCH_TOLERANCE:.0%}"
    counts = []
    for mode, within in (("captured", lambda d: d.graph_within_tolerance),
                         ("eager", lambda d: d.eager_within_tolerance)):
        judged = [within(d) for d in verdicts.values() if within(d) is not None]
        counts.append(f"{mode} {sum(judged)} of {len(judged)} shapes")
    click.echo(f"fa4.attention within {bar} of the fastest measured in this run: {', '.join(counts)}")
    if doc.get("training_rows"):
        _table("training pass: forward + backward and backward alone (GPU us, CUDA-graph replay), the "
               "backward's peak extra memory, gradients validated against fp32 autograd",
               ["shape", "implementation", "outcome", "fwd+bwd us", "bwd us", "bwd extra MiB", "validated",
                "backward", "error"],
               [[r["shape"], _impl_title(r["implementation"]) if r["implementation"] != "fa4" else "fa4.attention",
                 r["outcome"], _fmt(r["fwdbwd_us"]), _fmt(r["bwd_us"]), _fmt(r["bwd_peak_extra_mib"], 1),
                 r["validated"], r["backward"], r["error"]] for r in doc["training_rows"]])
        click.echo(_training_bar(doc))


def _training_bar(doc: dict) -> str:
    """fa4.attention's training times over the fastest peer's, per pass: on how many shapes it is at most
    1.00 and the geometric mean (fa4tune.report.data.training_rows' ratios)."""
    from statistics import geometric_mean

    from fa4.backends import OURS
    from fa4tune.report.data import TRAINING_FA4, training_rows

    ours = [r for r in training_rows(doc) if r.implementation == TRAINING_FA4]
    parts = []
    for pass_, title in (("bwd", "backward"), ("fwdbwd", "forward + backward")):
        ratios = [getattr(r, f"{pass_}_ratio") for r in ours if getattr(r, f"{pass_}_ratio") is not None]
        if not ratios:
            parts.append(f"{title}: no shape with both times")
            continue
        parts.append(f"{title} at most 1.00 on {sum(x <= 1.0 for x in ratios)} of {len(ratios)} shapes "
                     f"(of {len(ours)}), geometric mean {geometric_mean(ratios):.3f}, worst {max(ratios):.3f}")
    # where fa4.attention's backward was a peer's (its entry timed that one faster), the backward's ratio
    # is that kernel against itself: say on how many shapes ours ran, and how ours stood there
    ran = [r for r in ours if r.backward]
    if ran:
        mine = [r for r in ran if r.backward == OURS]
        own = [r.bwd_ratio for r in mine if r.bwd_ratio is not None]
        parts.append(f"its backward was ours on {len(mine)} of {len(ran)} shapes"
                     + (f" (backward geometric mean {geometric_mean(own):.3f} there)" if own else "")
                     + (", a peer's on the others (there the ratio is that kernel against itself)"
                        if len(mine) < len(ran) else ""))
    return "fa4.attention's training time over the fastest peer's: " + "; ".join(parts)


def _dispatch_verdicts(doc: dict) -> dict:
    """{shape: fa4tune.report.data.DispatchRow}: each shape's dispatched row beside the fastest implementation
    of the run, by GPU time and by eager time, computed as the report computes it."""
    from fa4tune.report.data import dispatch_rows, rows_from_bench

    verdicts = {}
    for shape in dict.fromkeys(r["shape"] for r in doc["rows"]):
        found = dispatch_rows(rows_from_bench([r for r in doc["rows"] if r["shape"] == shape], doc))
        if found:
            verdicts[shape] = found[0]
    return verdicts


def _impl_title(name: str) -> str:
    """A bench variant as the runtime names what it runs: the tuned and default rows are ours."""
    return backends.title(backends.OURS) + f" ({name})" if name in ("tuned", "default") else backends.title(name)


def _picked(choices: dict | None, mode: str) -> str | None:
    if not choices:
        return None
    choice = choices[mode]
    return backends.title(choice["backend"]) + (f" {choice['ratio']}x" if choice["backend"] != backends.OURS else "")


@main.group()
def cache():
    """The on-disk cache of compiled kernels (fa4.compile_cache; on unless FA4TUNE_DISK_CACHE=0)."""


@cache.command("info")
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True)
def cache_info(fmt):
    """Where the cache is, whether it is on, and how much it holds."""
    from fa4 import compile_cache

    facts = compile_cache.info()
    if fmt == "json":
        click.echo(json.dumps(facts, indent=2, sort_keys=True))
        return
    for name, value in facts.items():
        click.echo(f"{name:10} {value}")


@cache.command("clear")
def cache_clear():
    """Remove every cached kernel (they are compiled again on first use)."""
    from fa4 import compile_cache

    click.echo(f"removed {compile_cache.clear()} cached kernel(s) from {compile_cache.cache_dir()}")


from fa4tune.report.command import report_command  # noqa: E402  (the report command lives with the report code)
main.add_command(report_command)
from fa4tune.sm100.sass_build import sass_command_factory  # noqa: E402
main.add_command(sass_command_factory())
from fa4tune.sm100.rescale_stats import rescale_stats_command  # noqa: E402
main.add_command(rescale_stats_command)

if __name__ == "__main__":
    main()
