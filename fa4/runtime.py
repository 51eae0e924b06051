"""`fa4.attention`: choose an implementation and configuration for the inputs, compile once, launch cheaply.

Three paths, one decision procedure (`_plan`):
- Slow path, once per input signature (shapes, strides, dtypes, devices, flags): check the inputs,
  resolve the GPU's architecture, look the configuration up (forced -> exact database hit -> nearest
  bucket -> heuristic default), check it is feasible, compile it or take it from the in-process cache
  of compiled kernels (keyed by `fa4.kernels.compile_key`, which holds no sequence length or batch), and
  store a `_Launch` for the signature.
- Kernel path, every later call of a kernel signature: a short key (Q's and K's shapes, the three
  tensors' strides, Q's dtype and device, the flags) finds the `_Launch`, O (and LSE) are allocated and
  the compiled kernel's TVM-FFI function is called directly (`fa4.dsl_internals.direct_launcher`, the
  one place that reads the DSL's private objects). What the short key
  leaves out is checked by that function itself, in C, on every call: each tensor's dtype, rank, device
  (one for all) and 16-byte data alignment, V's extents against K's, batch against Q's, the head dim and
  the strides (the kernels are compiled with shared symbolic extents and aligned symbolic strides). When
  it refuses a call, the checked path below runs and names the problem.
- Checked path, any other call: the full signature (shapes, strides, dtypes and devices of Q, K and V,
  and the flags) finds the `_Launch`, the data pointers are checked, and the launch runs: the kernel,
  SDPA, or no launch for empty inputs. No torch.library dispatch on either path: the custom op in
  `fa4.ops` serves torch.compile, which enters it through `torch.compiler.is_compiling()` below.

`_plan` also picks, per mode (eager; CUDA-graph capture or torch.compile), the implementation to run
(`fa4.dispatch`, `fa4.backends`): a `_Launch` of a peer, or of ours, with the other mode's launch
attached where it differs (`_Launch.graph`; only such launches check for a capture on the fast path).
The custom op enters `_checked_call` in graph mode and shares the cached launches.

`explain(...)` runs the same `_plan` without compiling and says what would run and why.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from fa4 import backends as _backends, checks, dispatch, fallback as _fallback
from fa4 import compile_cache, config_text, dsl_internals, kernels, record_shapes
from fa4.arch import arch_of_capability, describe_capabilities
from fa4.checks import Fa4Error, InvalidInputError, UnsupportedInputError
from fa4.kernels import AttentionProblem, Config

ALLOW_SM100_ENV = "FA4_ALLOW_UNTESTED_SM100"
FALLBACKS = ("error", "sdpa")
# backend=: "auto" runs the fastest measured implementation (fa4.dispatch), a name forces that one
BACKENDS = ("auto",) + dispatch.IMPLEMENTATIONS

UNTESTED_ARCHS = {"sm100": "the sm100 (Blackwell) kernel has not yet run on hardware: it is compile-checked "
                           "on CPU and its tile algorithm is emulated against PyTorch, but no Blackwell GPU "
                           "was available to run it"}

# Signatures kept in the fast-path table; past this the table starts over (dynamic shapes can create
# one signature per sequence length).
MAX_SIGNATURES = 4096


class KernelCompileError(Fa4Error, RuntimeError):
    """Compiling the chosen configuration failed (a bug in a kernel, or a missing DSL)."""


class NotWarmedUpError(Fa4Error, RuntimeError):
    """The first call of a shape came while a CUDA graph was being captured, and it needs a compile
    (ours or flash-attn-4's), which cannot happen inside a capture. The message says what to warm up."""


class Fa4Warning(UserWarning):
    """Something degraded silently otherwise: a database that cannot be read, stale tunings, SDPA."""


# ---------------------------------------------------------------------------------------------------
# process-wide state
# ---------------------------------------------------------------------------------------------------

class _State:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.launches: dict[tuple, _Launch] = {}
        self.last: tuple = (None, None)  # (key, launch) of the latest signature cached
        self.kernel_launches: dict[tuple, _Launch] = {}  # short key -> kernel launch (see attention)
        self.last_kernel: tuple = (None, None)
        self.compiled: dict[tuple, Any] = {}
        self.db_path: str | None = None  # None: fa4.database's default (env var, else packaged file)
        self.db: Any = None
        self.db_loaded = False
        self.db_error: str | None = None
        self.db_broken: frozenset = frozenset()  # (layer, key) of entries that cannot be used
        self.fingerprints: dict[str, str] = {}
        self.devices: dict[int, tuple[str | None, str, tuple[int, int]]] = {}
        self.warned: set[str] = set()
        # (backend, problem label, return_lse) -> why that peer refused a call of this process: auto
        # dispatch passes it over from then on (explain says so)
        self.refused: dict[tuple, str] = {}
        # (backend, problem label, return_lse) of the peers that ran in this process: flash-attn-4
        # has compiled for that problem, so a capture of another signature of it may call it
        self.peers_run: set[tuple] = set()
        self.compiles = 0
        self.slow_calls = 0


_STATE = _State()


def _warn_once(tag: str, message: str) -> None:
    if tag in _STATE.warned:
        return
    _STATE.warned.add(tag)
    warnings.warn(message, Fa4Warning, stacklevel=_user_stacklevel())


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _user_stacklevel() -> int:
    """The stacklevel that points a warning at the first caller outside the fa4 package."""
    level, frame = 1, sys._getframe(2)  # frame 2: the caller of _warn_once
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        level += 1
        frame = frame.f_back
    return level + 1


def _forget_signatures() -> None:
    _STATE.launches.clear()
    _STATE.last = (None, None)
    _STATE.kernel_launches.clear()
    _STATE.last_kernel = (None, None)


def use_config_db(path: str | os.PathLike | None) -> None:
    """Use exactly this best-config database file for the rest of the process, no other layer (None:
    the default layers, `fa4.database.default_layers()`: the packaged database, then the user's,
    `$FA4_CONFIG_DB` or the results directory's). Forgets cached choices."""
    with _STATE.lock:
        _STATE.db_path = None if path is None else os.fspath(path)
        _STATE.db = None
        _STATE.db_loaded = False
        _STATE.db_error = None
        _STATE.db_broken = frozenset()
        _forget_signatures()


def reset_caches(compiled: bool = False) -> None:
    """Forget cached decisions, the database and one-time warnings (and compiled kernels if asked)."""
    with _STATE.lock:
        _forget_signatures()
        _STATE.db = None
        _STATE.db_loaded = False
        _STATE.db_error = None
        _STATE.db_broken = frozenset()
        _STATE.fingerprints.clear()
        _STATE.warned.clear()
        _STATE.refused.clear()
        if compiled:
            _STATE.compiled.clear()
            _STATE.peers_run.clear()
            _STATE.compiles = 0
        _STATE.slow_calls = 0


def cache_info() -> dict[str, int]:
    """Counters: kernels compiled by this process, compiled kernels cached, signatures cached, and
    calls that took the slow path (first call of a signature, or a misaligned pointer)."""
    return {"compiles": _STATE.compiles, "compiled_kernels": len(_STATE.compiled),
            "signatures": len(_STATE.launches), "slow_calls": _STATE.slow_calls}


def _database():
    """The loaded database (the default layers, or the one file `use_config_db` named), or None when
    nothing of it can be read. Each layer that cannot be read and each entry that cannot be used is
    warned about once, naming the file or the entry (a warning's tag holds the file's identity, so a
    second broken database in the same process warns too); the rest is used."""
    if _STATE.db_loaded:
        return _STATE.db
    with _STATE.lock:
        if _STATE.db_loaded:
            return _STATE.db
        from fa4 import database

        try:
            if _STATE.db_path is None:
                db = database.BestConfigDB.load_layers()
            else:
                db = database.BestConfigDB.load(_STATE.db_path)
                if not os.path.exists(db.path):
                    _warn_once(f"db-missing:{db.path}", f"fa4: best-config database {db.path} does not exist; "
                                                        "running heuristic default configurations")
        except Exception as exc:  # a broken database must never break a forward pass
            _STATE.db, _STATE.db_broken = None, frozenset()
            _STATE.db_error = f"{type(exc).__name__}: {exc}"
            _warn_once(f"db-error:{_file_identity(_STATE.db_path)}",
                       f"fa4: cannot use the best-config database ({_STATE.db_error}); running heuristic "
                       "default configurations instead")
            _STATE.db_loaded = True
            return None
        for layer, path, error in db.errors:
            _warn_once(f"db-error:{_file_identity(path)}",
                       f"fa4: cannot use the {layer} best-config database ({error}); its entries are ignored")
        _STATE.db_error = "; ".join(f"{layer}: {error}" for layer, _, error in db.errors) or None
        _STATE.db_broken = _broken_entries(db)
        _STATE.db = db
        _STATE.db_loaded = True
        return db


def _file_identity(path) -> str:
    """A path with its modification time and size, so a rewritten file counts as another database."""
    try:
        st = os.stat(path)
        return f"{os.fspath(path)}@{st.st_mtime_ns}:{st.st_size}"
    except (OSError, TypeError):
        return str(path)


def _broken_entries(db) -> frozenset:
    """(layer, key) of the entries of every layer that cannot be used at all (unknown knob or value,
    unknown arch, infeasible where tuned), each warned about once by name; lookup skips them."""
    unusable = db.unusable_entries()
    for (layer, key), problems in unusable.items():
        where = f"the {layer} database" if layer else f"{db.path}"
        _warn_once(f"db-entry:{_file_identity(db.path)}:{layer}:{key}",
                   f"fa4: best-config entry {key} in {where} cannot be used ({'; '.join(problems)}); "
                   "it is skipped")
    return frozenset(unusable)


def _fingerprint(arch: str) -> str | None:
    fp = _STATE.fingerprints.get(arch)
    if fp is None:
        try:
            fp = kernels.source_fingerprint(arch)
        except Exception:  # a family without sources yet: nothing can be trusted
            return None
        _STATE.fingerprints[arch] = fp
    return fp


def _device_facts(device: torch.device) -> tuple[str | None, str, tuple[int, int]]:
    """(arch or None, device name, compute capability) of a CUDA device."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    facts = _STATE.devices.get(index)
    if facts is None:
        capability = tuple(torch.cuda.get_device_capability(index))
        facts = (arch_of_capability(capability), torch.cuda.get_device_name(index), capability)
        _STATE.devices[index] = facts
    return facts


def _sm100_allowed(flag: bool) -> bool:
    return bool(flag) or os.environ.get(ALLOW_SM100_ENV, "").strip().lower() in ("1", "true", "yes", "on")


# ---------------------------------------------------------------------------------------------------
# the decision
# ---------------------------------------------------------------------------------------------------

@dataclass
class Explanation:
    """What `fa4.attention` does with some inputs, and why. `str()` reads as a short report."""

    path: str                      # "kernel" (a launch: ours or a peer, see `runs`), "sdpa" (fallback),
    #                                "empty" (no launch), "no_keys" (O = 0, LSE = -inf)
    problem: str                   # the problem's label
    device: str
    arch: str | None = None
    device_name: str | None = None
    config: Config | None = None
    source: str | None = None      # "forced", "exact", "nearest", "default"
    entry: Any = None              # the database entry used, if any
    distance: float | None = None  # log2 bucket distance of a nearest entry
    layer: str | None = None       # the database layer of the entry ("packaged", "user"; None: one file)
    database: str | None = None    # which database file(s), and their state
    compile_key: tuple | None = None
    compiled: bool = False         # already compiled in this process
    reasons: list[str] = field(default_factory=list)  # why our kernel does not run (sdpa path)
    notes: list[str] = field(default_factory=list)
    # fastest-backend dispatch per mode ("eager", "graph"), from the entry's measured times among the
    # implementations installed and applicable here (`fa4.dispatch.Choice`); empty when nothing was
    # measured at this bucket, or a backend is forced
    backends: list = field(default_factory=list)
    # which implementation runs per mode: {"eager": name, "graph": name} (`fa4.dispatch.IMPLEMENTATIONS`;
    # "graph": under CUDA-graph capture or torch.compile); set when path == "kernel"
    runs: dict = field(default_factory=dict)
    forced_backend: str | None = None  # backend= when it names an implementation

    def runs_ours(self, mode: str | None = None) -> bool:
        """Whether our kernel runs (in `mode`, or in any mode)."""
        modes = [mode] if mode else list(self.runs)
        return self.path == "kernel" and any(self.runs.get(m, dispatch.OURS) == dispatch.OURS for m in modes)

    def __str__(self) -> str:
        lines = [f"fa4.attention on {self.problem} ({self.device}"
                 + (f", {self.device_name}" if self.device_name else "")
                 + (f", {self.arch}" if self.arch else "") + ")"]
        if self.path == "kernel":
            lines += self._runs_lines()
            if self.config is not None:
                lines.append(f"  configuration{'' if self.runs_ours() else ' (if our kernel ran)'}: "
                             f"{self.config.label()}")
                lines.append(f"  chosen by: {self._source_text()}")
                lines.append(f"  compiled: {'yes, cached in this process' if self.compiled else 'not yet (compiles on first call)'}")
            if self.backends:
                lines.append(f"  fastest backend, measured at this bucket ({self.entry.backend_source}):")
                lines += [f"    {choice}" for choice in self.backends]
        elif self.path == "sdpa":
            lines.append("  runs: torch SDPA (fallback='sdpa'), because:")
            lines += [f"    - {r}" for r in self.reasons]
        elif self.path == "empty":
            lines.append("  runs: nothing (empty output, no launch)")
        elif self.path == "no_keys":
            lines.append("  runs: nothing (seqlen_k = 0: O = 0 and LSE = -inf, no launch)")
        if self.database:
            lines.append(f"  database: {self.database}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def _runs_lines(self) -> list[str]:
        def title(name):
            return f"our {self.arch} kernel" if name == dispatch.OURS else dispatch.TITLES[name]

        why = {c.mode: c for c in self.backends}
        forced = f" (forced: backend={self.forced_backend!r})" if self.forced_backend else ""
        names = set(self.runs.values())
        if len(names) == 1:
            [name] = names
            reason = forced or ("" if name == dispatch.OURS else
                                f" ({'; '.join(f'{m}: {why[m].reason}' for m in dispatch.MODES if m in why)})")
            return [f"  runs: {title(name)}{reason}"]
        lines = ["  runs:"]
        for mode in dispatch.MODES:
            lines.append(f"    {MODE_TITLES[mode]}: {title(self.runs[mode])}"
                         + (f" ({why[mode].reason})" if mode in why else ""))
        return lines

    def _source_text(self) -> str:
        if self.source == "forced":
            return "config= argument (forced)"
        if self.source == "default":
            return "heuristic default (fa4.kernels.default_config): no usable database entry"
        e = self.entry
        what = "exact database hit" if self.source == "exact" else (
            f"nearest database bucket (log2 distance {self.distance:.2f})")
        if self.layer:
            what += f" in the {self.layer} database"
        facts = [f"tuned on {e.device}", f"{e.us:.1f} us", f"{e.tflops:.0f} TFLOP/s"]
        facts += [f"{v:.2f}x vs {k}" for k, v in sorted(e.speedup.items())]
        return f"{what} {e.key} ({', '.join(facts)}; {e.date})"


MODE_TITLES = {"eager": "eager calls", "graph": "under CUDA-graph capture or torch.compile"}


@dataclass
class _Plan:
    explanation: Explanation
    spec: checks.InputSpec
    problem: AttentionProblem | None
    causal: bool
    return_lse: bool


def _coerce_config(config: Any, arch: str, problem: AttentionProblem) -> Config:
    """A `Config` from the config= argument: a Config; a mapping of knob values (the knobs it does not
    name keep the heuristic default's values; a value may be written as a label prints it, "off"); or
    a label string as `Config.label()` prints it (`fa4.config_text`)."""
    if isinstance(config, Config):
        if config.arch != arch:
            raise InvalidInputError(
                f"config= is an {config.arch} configuration, but the device runs the {arch} kernel")
        return config
    if isinstance(config, str):
        if config.startswith(_PARTIAL + ";"):  # a mapping that crossed the custom op as a string
            return _coerce_config(_knobs_from_str(config), arch, problem)
        if config_text.looks_like_label(config):
            try:
                values = config_text.parse_label(config)
            except ValueError as exc:
                raise InvalidInputError(f"config= {exc}") from exc
            return _coerce_config(values, arch, problem)
        if config.split(";")[0] in kernels.ARCHS and ";" in config:  # a Config that crossed the op
            return _config_from_str(config, arch)
        raise InvalidInputError(
            f"config={config!r} is not a configuration label: want name=value pairs as fa4tune and "
            f"fa4.explain print them, e.g. config='tile_n=80 softmax_overlap=off'")
    if isinstance(config, Mapping):
        try:
            return config_text.with_values(kernels.default_config(arch, problem), config)
        except (ValueError, KeyError) as exc:
            raise InvalidInputError(f"config= {dict(config)}: {exc}") from exc
    raise InvalidInputError(f"config= must be a fa4.kernels.Config, a dict of knob values or a label "
                            f"string, got {type(config).__name__}")


_PARTIAL = "*"  # arch field of a config string holding knob overrides of the heuristic default


def config_to_str(config: Config | Mapping) -> str:
    """config= as a string (the custom op's schema has no Config type): 'arch;name=repr;...', with
    arch '*' for a mapping of knob overrides."""
    if isinstance(config, Config):
        return ";".join([config.arch] + [f"{n}={v!r}" for n, v in config.items])
    return ";".join([_PARTIAL] + [f"{n}={v!r}" for n, v in sorted(config.items())])


def _knobs_from_str(text: str) -> dict:
    import ast

    values = {}
    for part in text.split(";")[1:]:
        name, _, value = part.partition("=")
        try:
            values[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            raise InvalidInputError(f"config={text!r}: cannot read the value of {name!r} ({value!r}); "
                                    "write the configuration as a label, e.g. 'tile_n=80'") from None
    return values


def _config_from_str(text: str, arch: str) -> Config:
    try:
        config = Config.from_dict(text.split(";")[0], _knobs_from_str(text))
    except (ValueError, KeyError, TypeError) as exc:
        if isinstance(exc, InvalidInputError):
            raise
        raise InvalidInputError(f"config={text!r}: {exc}") from exc
    if config.arch != arch:
        raise InvalidInputError(f"config= is an {config.arch} configuration, but the device runs the {arch} kernel")
    return config


def _plan(q, k, v, causal, return_lse, config, fallback, allow_untested_sm100, backend="auto",
          arch: str | None = None, device_name: str | None = None) -> _Plan:
    """Decide what to run; raise for invalid calls and, without a fallback, unsupported ones.

    `arch` and `device_name` override the device's (explain for another GPU, e.g. on CPU tensors).
    """
    if fallback not in FALLBACKS:
        raise InvalidInputError(f"fallback must be one of {FALLBACKS}, got {fallback!r}")
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise InvalidInputError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")
    another_gpu = arch is not None  # explain for a GPU the tensors are not on
    if not isinstance(causal, bool) or not isinstance(return_lse, bool):
        raise InvalidInputError(f"causal and return_lse must be bools, got {causal!r}, {return_lse!r}")
    spec = checks.inspect_inputs(q, k, v)
    reasons = list(spec.unsupported)
    if arch is not None:
        if arch not in kernels.ARCHS:
            raise InvalidInputError(f"unknown architecture {arch!r}; known: {', '.join(kernels.ARCHS)}")
        device_name = device_name or "unknown device"
    else:
        device_problems = checks.device_reasons(spec)
        reasons += device_problems
        arch, device_name, capability = (None, None, None) if device_problems else _device_facts(spec.device)
        if arch is None and not device_problems:
            reasons.append(
                f"{device_name} (compute capability {capability[0]}.{capability[1]}) has no fa4 kernel: "
                f"they exist for {describe_capabilities()}")
    notes: list[str] = []
    if arch in UNTESTED_ARCHS:
        notes.append(UNTESTED_ARCHS[arch])
        if not _sm100_allowed(allow_untested_sm100):
            reasons.append(
                f"{UNTESTED_ARCHS[arch]}; opt in with fa4.attention(..., allow_untested_sm100=True) or "
                f"{ALLOW_SM100_ENV}=1")  # the error itself adds how to fall back to SDPA
    if arch is not None and spec.dtype is not None and not reasons:
        reasons += checks.kernel_reasons(arch, spec, causal, return_lse)

    label = (f"B{spec.batch} Sq{spec.seqlen_q} Sk{spec.seqlen_k} H{spec.heads_q}/{spec.heads_kv} "
             f"D{spec.head_dim} {spec.dtype or spec.torch_dtype} {'causal' if causal else 'full'}")
    expl = Explanation(path="kernel", problem=label, device=str(spec.device), arch=arch,
                       device_name=device_name, notes=notes)
    if backend in dispatch.PEERS:
        return _plan_forced_peer(expl, spec, causal, return_lse, config, backend, another_gpu)
    if reasons:
        if fallback != "sdpa":
            raise UnsupportedInputError(
                "fa4.attention cannot run these inputs with its kernels: " + "; ".join(reasons)
                + ". Pass fallback='sdpa' to run PyTorch SDPA instead.")
        expl.path, expl.reasons = "sdpa", reasons
    if spec.is_empty:
        expl.path = "empty"
    elif spec.has_no_keys:
        expl.path = "no_keys"
    if expl.path != "kernel":
        if config is not None and arch is not None and spec.dtype is not None:
            # a malformed config= is an error even where nothing launches
            _coerce_config(config, arch, spec.problem(causal, return_lse))
        if config is not None and expl.path == "sdpa":
            message = ("fa4: config= is ignored: PyTorch SDPA runs (fallback='sdpa') because "
                       + "; ".join(reasons))
            notes.append(message[len("fa4: "):])
            _warn_once("sdpa-config:" + "|".join(reasons), message)
        return _Plan(expl, spec, None, causal, return_lse)

    problem = spec.problem(causal, return_lse)
    try:
        _choose_config(expl, arch, device_name, problem, config)
    except UnsupportedInputError as exc:  # the heuristic default does not fit this problem
        if fallback != "sdpa":
            raise
        expl.path, expl.reasons, expl.config, expl.source = "sdpa", [str(exc)], None, None
        return _Plan(expl, spec, None, causal, return_lse)
    key = kernels.compile_key(expl.config, problem)
    expl.compile_key = key
    expl.compiled = key in _STATE.compiled
    _choose_backends(expl, backend, problem)
    return _Plan(expl, spec, problem, causal, return_lse)


def _plan_forced_peer(expl: Explanation, spec, causal, return_lse, config, backend, another_gpu=False) -> _Plan:
    """backend= names a peer: it runs in every mode, or the call raises saying why it cannot
    (`another_gpu`: explained for a GPU the tensors are not on, so their device is no reason)."""
    title = dispatch.TITLES[backend]
    if config is not None:
        raise InvalidInputError(f"config= configures our kernel, but backend={backend!r} runs {title}: "
                                "pass one or the other")
    why = [] if another_gpu else checks.device_reasons(spec)
    if spec.dtype is None:
        why.append(f"dtype {spec.torch_dtype}: fp16 or bf16 only")
    missing = _backends.unavailable(backend)
    why += ([missing] if missing else []) + _backends.inapplicable(
        backend, return_lse=return_lse, causal=causal, seqlen_q=spec.seqlen_q, seqlen_k=spec.seqlen_k)
    if why:
        raise UnsupportedInputError(f"backend={backend!r} cannot run these inputs: {'; '.join(why)}")
    expl.runs = {mode: backend for mode in dispatch.MODES}
    expl.forced_backend = backend
    if spec.is_empty:
        expl.path = "empty"
    elif spec.has_no_keys:
        expl.path = "no_keys"
    return _Plan(expl, spec, None, causal, return_lse)


def _choose_backends(expl: Explanation, backend: str, problem: AttentionProblem) -> None:
    """Fill expl.runs (and expl.backends, expl.notes): per mode, the implementation to run.

    backend="ours" runs ours. "auto": an exact database entry's measured times (a neighbour's were
    measured at another shape, so they decide nothing here), among the implementations installed here
    and able to give this call our semantics, judged by `fa4.dispatch.choose`; ours without an entry,
    without times, or where it wins or ties."""
    return_lse = problem.return_lse
    expl.runs = {mode: dispatch.OURS for mode in dispatch.MODES}
    if backend == dispatch.OURS:
        expl.forced_backend = backend
    if expl.source != "exact" or not expl.entry.backend_us:
        return
    measured = dict(expl.entry.backend_us)
    excluded: dict[str, str] = {}
    for name in measured:
        if name == dispatch.OURS or name not in dispatch.PEERS:
            continue
        why = [_backends.unavailable(name)] + _backends.inapplicable(
            name, return_lse=return_lse, causal=problem.causal, seqlen_q=problem.seqlen_q,
            seqlen_k=problem.seqlen_k)
        refused = _STATE.refused.get((name, expl.problem, return_lse))
        why += [f"{dispatch.TITLES[name]} refused this call earlier in this process ({refused})"] if refused else []
        why = [w for w in why if w]
        if why:
            excluded[name] = "; ".join(why)
    host = dispatch.host_us(expl.device_name or "")
    candidates = {name: us for name, us in measured.items() if name not in excluded}
    for mode in dispatch.MODES:
        choice = dispatch.choose(candidates, host, mode)
        if choice is None:
            continue
        expl.backends.append(choice)
        if backend == "auto":
            expl.runs[mode] = choice.backend
        unfiltered = dispatch.choose(measured, host, mode)
        if unfiltered is not None and unfiltered.backend != choice.backend:
            expl.notes.append(f"{mode}: {dispatch.TITLES[unfiltered.backend]} measured fastest "
                              f"({unfiltered.reason}) but cannot run here: {excluded[unfiltered.backend]}")
    if not host:
        expl.notes.append(f"no host time per call was measured on {expl.device_name}: eager calls are "
                          "judged by GPU time alone")


def _choose_config(expl: Explanation, arch: str, device_name: str, problem: AttentionProblem,
                   config: Any) -> None:
    """Fill expl.config and expl.source: forced, else exact -> nearest -> heuristic default."""
    if config is not None:
        cfg = _coerce_config(config, arch, problem)
        why = kernels.feasible(cfg, problem) + checks.launch_reasons(cfg, problem)
        if why:
            raise InvalidInputError(f"config= {cfg.label()} cannot run {problem.label()}: {'; '.join(why)}")
        expl.config, expl.source = cfg, "forced"
        return

    db = _database()
    if db is None:
        expl.database = f"unusable ({_STATE.db_error}); defaults are used"
    else:
        expl.database = _describe_database(db)
        fingerprint = _fingerprint(arch)
        try:
            found = db.lookup(arch, device_name, problem, fingerprint, max_distance=_max_distance(),
                              broken=_STATE.db_broken)
        except Exception as exc:  # a malformed entry must not break a forward pass either
            _warn_once("db-lookup", f"fa4: best-config database lookup failed ({type(exc).__name__}: "
                                    f"{exc}); running heuristic default configurations")
            expl.notes.append(f"database lookup failed: {exc}")
            found = None
        if found is not None and found.stale:
            keys = ", ".join(e.key for e in found.stale[:3]) + (" ..." if len(found.stale) > 3 else "")
            message = (f"fa4: {len(found.stale)} tuned entr{'y' if len(found.stale) == 1 else 'ies'} for "
                       f"{arch} {problem.dtype} d{problem.head_dim} gqa{problem.gqa_ratio} "
                       f"{'causal' if problem.causal else 'full'} {'was' if len(found.stale) == 1 else 'were'} "
                       f"tuned on other kernel sources (fingerprint differs from {fingerprint}) and "
                       f"{'is' if len(found.stale) == 1 else 'are'} not used ({keys}); re-run fa4tune search")
            expl.notes.append(message)
            _warn_once("stale:" + "|".join(e.key for e in found.stale), message)
        if found is not None:
            expl.notes += list(found.passed_over)
        if found is not None and found.kind in ("exact", "nearest") and found.entry is not None:
            try:
                cfg = Config.from_dict(arch, found.entry.config)
                why = kernels.feasible(cfg, problem) + checks.launch_reasons(cfg, problem)
            except (ValueError, KeyError, TypeError) as exc:  # knobs renamed since the tuning
                cfg, why = None, [str(exc)]
            if not why:
                expl.config, expl.source, expl.entry = cfg, found.kind, found.entry
                expl.distance, expl.layer = found.distance, found.layer
                return
            expl.notes.append(f"database entry {found.entry.key} does not fit this problem "
                              f"({'; '.join(why)}); using the heuristic default")
    expl.config, expl.source = kernels.default_config(arch, problem), "default"
    too_big = checks.launch_reasons(expl.config, problem)
    if too_big and expl.config.scheduler == "single":
        # the same tiles, one CTA each, on a 1-D grid: our choice of default, not the user's, so it is
        # adjusted (and said), where a forced or tuned configuration is refused
        adjusted = expl.config.replace(scheduler="single_lpt")
        if not kernels.feasible(adjusted, problem) and not checks.launch_reasons(adjusted, problem):
            expl.notes.append(f"the heuristic default's scheduler=single cannot launch this shape "
                              f"({'; '.join(too_big)}): scheduler=single_lpt runs the same tiles instead")
            expl.config, too_big = adjusted, []
    why = kernels.feasible(expl.config, problem) + too_big
    if why:
        raise UnsupportedInputError(
            f"the heuristic default {expl.config.label()} cannot run {problem.label()}: {'; '.join(why)}")


def _describe_database(db) -> str:
    """The database's files for explain: each layer with its entry count or its error."""
    parts = []
    for layer, path, count, error in db.layers:
        state = f"unusable: {error}" if error else (f"{count} entries" if os.path.exists(path) else "absent")
        parts.append(f"{layer + ' ' if layer else ''}{path} ({state})")
    if _STATE.db_broken:
        parts.append(f"{len(_STATE.db_broken)} unusable entr{'y' if len(_STATE.db_broken) == 1 else 'ies'} skipped")
    return "; ".join(parts) or "none"


def _max_distance() -> float:
    """The nearest-bucket limit (`fa4.database.max_distance`); a malformed setting warns once and the
    documented default is used."""
    from fa4 import database

    try:
        return database.max_distance()
    except ValueError as exc:
        _warn_once(f"max-distance:{exc}", f"fa4: {exc}; using the default limit {database.DEFAULT_MAX_DISTANCE:g}")
        return database.DEFAULT_MAX_DISTANCE


# ---------------------------------------------------------------------------------------------------
# launching
# ---------------------------------------------------------------------------------------------------

_KERNEL, _EMPTY, _NO_KEYS, _SDPA, _PEER = range(5)


class _Launch:
    """What a signature needs at call time. Plain slots: read on every call.

    `graph`: where graph mode (CUDA-graph capture, torch.compile) runs another implementation than an
    eager call (fastest-backend dispatch), that implementation's launch; else None."""

    __slots__ = ("kind", "run", "fast_run", "compiled", "default_scale", "out_like_q", "out_shape",
                 "lse_shape", "device_index", "restride", "causal", "backend", "graph", "rows_without_keys")

    def __init__(self, kind, run, default_scale, out_like_q, out_shape, lse_shape, device_index,
                 restride, causal, compiled=None, backend=dispatch.OURS, rows_without_keys=0):
        self.kind = kind
        self.run = run            # the compiled kernel's checked `run`, or a peer's runner
        self.fast_run = run       # what the fast path calls; see fa4.dsl_internals.direct_launcher
        self.compiled = compiled
        self.default_scale = default_scale
        self.out_like_q = out_like_q
        self.out_shape = out_shape
        self.lse_shape = lse_shape
        self.device_index = device_index
        self.restride = restride
        self.causal = causal
        self.backend = backend    # the implementation this launch runs (`fa4.dispatch.IMPLEMENTATIONS`)
        self.graph = None
        self.rows_without_keys = rows_without_keys  # a peer's rows to set to our no-key rule


def _compiled_kernel(config: Config, problem: AttentionProblem, key: tuple):
    launcher = _STATE.compiled.get(key)
    if launcher is None:
        with _STATE.lock:
            launcher = _STATE.compiled.get(key)
            if launcher is None:
                if _capturing():
                    raise NotWarmedUpError(_warmup_message(problem, f"compiling our {config.arch} kernel "
                                                                    f"{config.label()}"))
                try:
                    launcher = compile_cache.compile_attention(config, problem)
                except Exception as exc:
                    raise KernelCompileError(
                        f"compiling {config.arch} {config.label()} for {problem.label()} failed: "
                        f"{type(exc).__name__}: {exc}") from exc
                _STATE.compiled[key] = launcher
                _STATE.compiles += 1
    return launcher


def _warmup_message(problem: AttentionProblem, what: str) -> str:
    return (f"fa4.attention: {problem.label()} was first called while a CUDA graph was being captured, "
            f"and {what} cannot happen inside a capture. Warm this shape up before capturing: "
            f"fa4.warmup(fa4.kernels.{problem!r}) (or call fa4.attention once with the same inputs)")


def _make_launch(plan: _Plan, fallback: str) -> _Launch:
    """The launch of the implementation eager calls run, with the graph mode's attached where that
    one differs (`_Launch.graph`)."""
    expl = plan.explanation
    if expl.path != "kernel" or not expl.runs:
        return _launch_of(plan, dispatch.OURS, fallback)
    launch = _launch_of(plan, expl.runs["eager"], fallback)
    if expl.runs["graph"] != expl.runs["eager"]:
        launch.graph = _launch_of(plan, expl.runs["graph"], fallback)
    return launch


def _launch_of(plan: _Plan, backend: str, fallback: str) -> _Launch:
    spec, expl = plan.spec, plan.explanation
    kind = {"kernel": _KERNEL, "empty": _EMPTY, "no_keys": _NO_KEYS, "sdpa": _SDPA}[expl.path]
    run = compiled = None
    if kind == _KERNEL and backend != dispatch.OURS:
        kind, run = _PEER, _peer_runner(plan, backend)
        if run is None:  # auto dispatch to a peer that cannot be imported: ours instead
            kind, backend = _KERNEL, dispatch.OURS
    if kind == _KERNEL:
        try:
            compiled = _compiled_kernel(expl.config, plan.problem, expl.compile_key)
            run = compiled.run
        except KernelCompileError as exc:
            if fallback != "sdpa":
                raise
            _warn_once(f"compile:{expl.compile_key}", f"fa4: {exc}; running SDPA instead (fallback='sdpa')")
            kind = _SDPA
    if kind == _SDPA:
        _warn_once("sdpa:" + "|".join(expl.reasons),
                   "fa4: running PyTorch SDPA (fallback='sdpa') because " + "; ".join(expl.reasons or ["the kernel failed to compile"]))
    out_shape = (spec.batch, spec.seqlen_q, spec.heads_q, spec.head_dim)
    from fa4.reference import rows_without_keys

    return _Launch(
        kind=kind, run=run, default_scale=1.0 / math.sqrt(spec.head_dim) if spec.head_dim else 1.0,
        out_like_q=None, out_shape=out_shape, lse_shape=(spec.batch, spec.heads_q, spec.seqlen_q),
        # -1 off CUDA: what the current-device probe answers on a CPU build (the tests' fake kernels)
        device_index=spec.device.index if spec.device.type == "cuda" else -1,
        restride=spec.needs_restride, causal=plan.causal, compiled=compiled,
        backend=backend if kind in (_KERNEL, _PEER) else dispatch.OURS,
        rows_without_keys=rows_without_keys(spec.seqlen_q, spec.seqlen_k, plan.causal) if kind == _PEER else 0)


def _peer_runner(plan: _Plan, backend: str):
    """`fa4.backends.runner` for the peer; None (with a warning) when auto dispatch chose a peer that
    cannot be imported; a forced one raises."""
    try:
        return _backends.runner(backend, plan.causal)
    except Exception as exc:  # ImportError, or a package that fails to initialise
        why = f"{dispatch.TITLES[backend]} cannot be imported: {_backends.short_error(exc)}"
        if plan.explanation.forced_backend == backend:
            raise UnsupportedInputError(f"backend={backend!r} cannot run these inputs: {why}") from exc
        _warn_once(f"peer-import:{backend}", f"fa4: {why}; our kernel runs where it was measured fastest")
        return None


if hasattr(torch._C, "_cuda_getDevice"):
    _current_cuda_device = torch._C._cuda_getDevice
else:  # a CPU build: no kernel launch ever reaches the device check
    def _current_cuda_device() -> int:
        return -1


def _capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False on a machine without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _run_launch(launch: _Launch, q, k, v, softmax_scale, return_lse, in_graph: bool = False):
    """A launch on the checked path: empty outputs, no keys, SDPA, a peer, or the kernel. In graph mode
    (`in_graph`: the custom op under torch.compile, or a CUDA-graph capture) the graph launch runs
    where it differs."""
    if launch.graph is not None and (in_graph or _capturing()):
        launch = launch.graph
    softmax_scale = checks.softmax_scale_value(softmax_scale)
    if launch.kind == _EMPTY:
        out = q.new_empty(launch.out_shape)
        lse = q.new_empty(launch.lse_shape, dtype=torch.float32)
        return (out, lse) if return_lse else out
    if launch.kind == _NO_KEYS:
        out = q.new_zeros(launch.out_shape)
        lse = q.new_full(launch.lse_shape, -math.inf, dtype=torch.float32)
        return (out, lse) if return_lse else out
    if launch.kind == _SDPA:
        out, lse = _fallback.sdpa_attention(q, k, v, launch.causal, softmax_scale, return_lse)
        return (out, lse) if return_lse else out
    scale = launch.default_scale if softmax_scale is None else softmax_scale
    if launch.kind == _PEER:
        if launch.device_index in (-1, _current_cuda_device()):
            out, lse = launch.run(q, k, v, scale, return_lse)
        else:
            with torch.cuda.device(launch.device_index):
                out, lse = launch.run(q, k, v, scale, return_lse)
        _backends.fix_rows_without_keys(out, lse, launch.rows_without_keys)
        return (out, lse) if return_lse else out
    # the kernel (size-1 dimensions re-strided where their strides are not aligned)
    if launch.restride:
        q, k, v = (t.as_strided(t.shape, checks.aligned_strides(t)) for t in (q, k, v))
    out = torch.empty_like(q) if launch.out_like_q else q.new_empty(launch.out_shape)
    lse = q.new_empty(launch.lse_shape, dtype=torch.float32) if return_lse else None
    if launch.device_index == _current_cuda_device():
        launch.fast_run(q, k, v, out, lse, scale)
    else:
        with torch.cuda.device(launch.device_index):
            launch.run(q, k, v, out, lse, scale)
    return (out, lse) if return_lse else out


def _slow_call(q, k, v, causal, softmax_scale, return_lse, config, fallback, allow_untested_sm100, backend,
               key, kernel_key=None, in_graph=False):
    """First call of a signature (or one the fast path cannot take): decide, cache, run."""
    _STATE.slow_calls += 1
    if isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor):
        checks.check_grad(q, k, v)
    softmax_scale = checks.softmax_scale_value(softmax_scale)
    plan = _plan(q, k, v, causal, return_lse, config, fallback, allow_untested_sm100, backend)
    record_shapes.note(plan.spec, causal, return_lse)   # FA4_RECORD_SHAPES; a no-op when unset
    launch = _make_launch(plan, fallback)
    if launch.kind == _KERNEL or (launch.graph is not None and launch.graph.kind == _KERNEL):
        launch.out_like_q = q.is_contiguous()
        if launch.graph is not None:
            launch.graph.out_like_q = launch.out_like_q
        misaligned = checks.pointers_misaligned(q, k, v)
        if misaligned is not None:
            if fallback != "sdpa":
                raise UnsupportedInputError(
                    f"fa4.attention cannot run these inputs with its kernels: {misaligned}. "
                    "Pass fallback='sdpa' to run PyTorch SDPA instead.")
            _warn_once("sdpa:misaligned", f"fa4: running PyTorch SDPA (fallback='sdpa') because {misaligned}")
            out, lse = _fallback.sdpa_attention(q, k, v, causal, softmax_scale, return_lse)
            return (out, lse) if return_lse else out
    launch, result = _first_run(plan, launch, q, k, v, softmax_scale, return_lse, in_graph, fallback)
    if key is not None:
        with _STATE.lock:
            if len(_STATE.launches) >= MAX_SIGNATURES:
                _forget_signatures()
            _STATE.launches[key] = launch
            _STATE.last = (key, launch)
    if launch.kind == _KERNEL and launch.fast_run is launch.run and not (launch.graph is not None and in_graph):
        # `run` accepted this signature: later calls may skip its signature-only checks (a run in
        # graph mode ran the graph launch, so it says nothing of this one)
        launch.fast_run = dsl_internals.direct_launcher(launch.compiled) or launch.run
    if (kernel_key is not None and key is not None and launch.kind == _KERNEL and not launch.restride
            and launch.fast_run is not launch.run and launch.device_index == _current_cuda_device()):
        # a compiled TVM-FFI function, which checks what kernel_key leaves out (see attention)
        with _STATE.lock:
            if len(_STATE.kernel_launches) >= MAX_SIGNATURES:
                _forget_signatures()
            _STATE.kernel_launches[kernel_key] = launch
            _STATE.last_kernel = (kernel_key, launch)
    return result


def _first_run(plan, launch, q, k, v, softmax_scale, return_lse, in_graph, fallback):
    """Run a new signature's launch: (the launch to keep, the result).

    A peer that refuses the call (an error from the peer itself: a shape, layout or GPU it does not
    take) raises under backend=<its name>; under auto dispatch it is remembered as refused, our kernel
    replaces it, and a warning says so. On an eager first call, a peer that only graph mode runs is
    run once too (output dropped), so a later capture finds it compiled (flash-attn-4 compiles on
    first use) and its refusal is known before any capture."""
    capturing = _capturing()
    graph_mode = in_graph or capturing
    active = launch.graph if graph_mode and launch.graph is not None else launch
    if (capturing and active.kind == _PEER and active.backend == "flash_attn_4"
            and (active.backend, plan.explanation.problem, return_lse) not in _STATE.peers_run):
        raise NotWarmedUpError(_warmup_message(plan.spec.problem(plan.causal, return_lse),
                                               "flash-attn-4's first call (it compiles)"))
    if launch.graph is not None and not graph_mode and launch.graph.kind == _PEER:
        launch.graph = _run_or_replace(plan, launch.graph, q, k, v, softmax_scale, return_lse, fallback)[0]
    replaced, result = _run_or_replace(plan, active, q, k, v, softmax_scale, return_lse, fallback)
    if active is launch:
        replaced.graph, launch = launch.graph, replaced
    else:
        launch.graph = replaced
    if launch.graph is not None and launch.graph.backend == launch.backend:
        launch.graph = None  # both modes run the same implementation (a refused peer was replaced)
    return launch, result


def _run_or_replace(plan, launch, q, k, v, softmax_scale, return_lse, fallback):
    """(launch, result) of one run; a peer refusing under auto dispatch gives our kernel's launch."""
    if launch.kind != _PEER:
        return launch, _run_launch(launch, q, k, v, softmax_scale, return_lse)
    try:
        result = _run_launch(launch, q, k, v, softmax_scale, return_lse)
        _STATE.peers_run.add((launch.backend, plan.explanation.problem, return_lse))
        return launch, result
    except Exception as exc:  # the peer refused these inputs
        expl = plan.explanation
        title = dispatch.TITLES[launch.backend]
        if expl.forced_backend == launch.backend:
            raise UnsupportedInputError(f"backend={launch.backend!r} cannot run these inputs: {title} raised "
                                        f"{_backends.short_error(exc)}") from exc
        why = _backends.short_error(exc)
        _STATE.refused[(launch.backend, expl.problem, plan.return_lse)] = why
        _warn_once(f"refused:{launch.backend}:{expl.problem}:{plan.return_lse}",
                   f"fa4: {title}, measured fastest for {expl.problem}, refused the call ({why}); our "
                   "kernel runs instead")
        ours = _launch_of(plan, dispatch.OURS, fallback)
        ours.out_like_q = q.is_contiguous()
        return ours, _run_launch(ours, q, k, v, softmax_scale, return_lse)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              softmax_scale: float | None = None, return_lse: bool = False, config: Any = None,
              fallback: str = "error", *, backend: str = "auto", allow_untested_sm100: bool = False):
    """Attention forward: O = softmax(Q K^T * scale) V, the fastest implementation measured for the shape.

    q: (B, Sq, Hq, D); k, v: (B, Sk, Hkv, D), on one CUDA device, fp16 or bf16, Hq a multiple of Hkv
    (grouped-query attention). Causal masks are bottom-right aligned (key j hidden from query i when
    j > i + Sk - Sq). softmax_scale defaults to 1/sqrt(D).

    Returns O (B, Sq, Hq, D) in q's dtype, or (O, LSE) with LSE (B, Hq, Sq) fp32 (natural log) when
    return_lse. backend="auto" runs our kernel with its tuned configuration unless the database entry
    of this shape measured another implementation faster for this kind of call (eager, or CUDA-graph
    capture / torch.compile; `fa4.dispatch`) and it is installed and gives the same semantics;
    "ours" forces our kernel, "flash_attn_4", "sdpa_cudnn", "sdpa_flash" force that implementation
    (`UnsupportedInputError` when it cannot run the call). config= forces our kernel's configuration
    (a `fa4.kernels.Config`, a dict of knob values over the heuristic default, or a label).
    fallback="sdpa" runs PyTorch SDPA where our kernels cannot run the inputs (with a one-time
    warning); the default raises `UnsupportedInputError`. The Blackwell kernel has never run on
    hardware and is used only with allow_untested_sm100=True (or FA4_ALLOW_UNTESTED_SM100=1).
    Forward only: inputs that require grad (with grad mode on) raise `InvalidInputError`.
    """
    if torch.compiler.is_compiling():
        checks.check_grad(q, k, v)
        return _through_op(q, k, v, causal, softmax_scale, return_lse, config, fallback,
                           allow_untested_sm100, backend)
    try:
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            checks.check_grad(q, k, v)
        # The short key of the kernel path: what decides the launch and what the compiled function
        # cannot check (strides of size-1 extents, which it skips and the kernel re-strides on the
        # checked path). V's shape, K's and V's dtypes and devices and the data pointers' alignment
        # are checked by the compiled function on every call, in C.
        kernel_key = (q.shape, k.shape, q.stride(), k.stride(), v.stride(), q.dtype, q.get_device(),
                      causal, return_lse, config, fallback, allow_untested_sm100, backend)
        last = _STATE.last_kernel  # consecutive calls usually share a signature: skip hashing the key
        launch = last[1] if kernel_key == last[0] else _STATE.kernel_launches.get(kernel_key)
    except (AttributeError, TypeError, RuntimeError):  # not tensors (nested and sparse ones have no
        # sizes or strides), or an unhashable config: the checked path says
        kernel_key = launch = None
    # a launch with a graph launch attached runs that one under a capture: the checked path picks it
    if (launch is not None and launch.device_index == _current_cuda_device()
            and (launch.graph is None or not _capturing())):
        out = torch.empty_like(q) if launch.out_like_q else q.new_empty(launch.out_shape)
        try:
            if softmax_scale is None:
                scale = launch.default_scale
            else:
                # float(): the direct launcher passes the scale to the kernel's Float32 parameter
                # unconverted; x - x is NaN (true) for NaN and infinities, which the checked path names
                scale = float(softmax_scale)
                if scale - scale:
                    raise ValueError
            if return_lse:
                lse = q.new_empty(launch.lse_shape, dtype=torch.float32)
                launch.fast_run(q, k, v, out, lse, scale)
                return out, lse
            launch.fast_run(q, k, v, out, None, scale)
            return out
        except Exception:  # the compiled function refused these inputs (or the scale is no finite
            pass           # number): the checked path says why
    return _checked_call(q, k, v, causal, softmax_scale, return_lse, config, fallback,
                         allow_untested_sm100, backend, kernel_key)


def _checked_call(q, k, v, causal, softmax_scale, return_lse, config, fallback, allow_untested_sm100,
                  backend, kernel_key, in_graph=False):
    """Every call the kernel path does not take: the full signature, pointer checks, any launch kind."""
    try:
        key = (q.size(), q.stride(), k.size(), k.stride(), v.size(), v.stride(), q.dtype, k.dtype,
               v.dtype, q.device, k.device, v.device, causal, return_lse, config, fallback,
               allow_untested_sm100, backend)
        last = _STATE.last
        launch = last[1] if key == last[0] else _STATE.launches.get(key)
    except (AttributeError, TypeError, RuntimeError):  # see attention; the slow path says
        key = _hashable_key(q, k, v, causal, return_lse, config, fallback, allow_untested_sm100, backend)
        launch = _STATE.launches.get(key) if key is not None else None
    if launch is None:
        return _slow_call(q, k, v, causal, softmax_scale, return_lse, config, fallback,
                          allow_untested_sm100, backend, key, kernel_key, in_graph)
    if launch.kind == _KERNEL and (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15:
        return _slow_call(q, k, v, causal, softmax_scale, return_lse, config, fallback,
                          allow_untested_sm100, backend, None, None, in_graph)
    return _run_launch(launch, q, k, v, softmax_scale, return_lse, in_graph)


def _hashable_key(q, k, v, causal, return_lse, config, fallback, allow_untested_sm100, backend):
    """The signature key when the fast one failed: config mappings frozen; None for non-tensors and
    tensors without sizes or strides (nested, sparse: the slow path refuses them)."""
    if not all(isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_nested
               for t in (q, k, v)):
        return None
    if isinstance(config, Mapping):
        config = ("mapping",) + tuple(sorted(config.items()))
    try:
        key = (q.size(), q.stride(), k.size(), k.stride(), v.size(), v.stride(), q.dtype, k.dtype,
               v.dtype, q.device, k.device, v.device, causal, return_lse, config, fallback,
               allow_untested_sm100, backend)
        hash(key)
    except TypeError:
        return None
    return key


def _through_op(q, k, v, causal, softmax_scale, return_lse, config, fallback, allow_untested_sm100,
                backend="auto"):
    """The torch.compile path: the custom op `fa4::attention` (registered by fa4.ops)."""
    if isinstance(config, str) and config_text.looks_like_label(config):
        try:
            config = config_text.parse_label(config)   # crosses the op as a mapping of texts
        except ValueError as exc:
            raise InvalidInputError(f"config= {exc}") from exc
    if isinstance(config, (Config, Mapping)):
        config = config_to_str(config)
    elif config is not None:
        raise InvalidInputError(f"config= must be a fa4.kernels.Config, a dict of knob values or a label "
                                f"string, got {type(config).__name__}")
    out, lse = torch.ops.fa4.attention(q, k, v, causal, softmax_scale, return_lse, config, fallback,
                                       allow_untested_sm100, backend)
    return (out, lse) if return_lse else out


def forward_for_op(q, k, v, causal, softmax_scale, return_lse, config, fallback, allow_untested_sm100,
                   backend="auto"):
    """The real implementation of the custom op: the checked path in graph mode (torch.compile and
    CUDA graphs judge implementations by GPU time), outputs always a pair, O contiguous."""
    checks.check_grad(q, k, v)
    result = _checked_call(q, k, v, causal, softmax_scale, return_lse, config, fallback,
                           allow_untested_sm100, backend, None, in_graph=True)
    out, lse = result if return_lse else (result, None)
    if not out.is_contiguous():
        out = out.contiguous()
    if lse is None:
        lse = q.new_empty((0,), dtype=torch.float32)
    return out, lse


def explain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
            softmax_scale: float | None = None, return_lse: bool = False, config: Any = None,
            fallback: str = "error", *, backend: str = "auto", allow_untested_sm100: bool = False,
            arch: str | None = None, device_name: str | None = None) -> Explanation:
    """Which implementation (per mode: eager, CUDA-graph capture / torch.compile) and which configuration
    `attention` would run on these inputs, and why, with the measured ratio; compiles and launches
    nothing.

    The arguments are those of `attention`; `arch` ("sm90", "sm100") and `device_name` (as torch names
    the GPU, e.g. "NVIDIA H200") ask about another GPU. Inputs that are not on a CUDA device (CPU or meta
    tensors) are explained for the GPU of this machine if it has one our kernels run on, else for the
    architecture and device the tuned database was measured on; the explanation says which it assumed
    and how to name another. Raises what `attention` would raise for the same inputs (pointer alignment
    aside: it is checked per call).
    """
    if isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor):
        checks.check_grad(q, k, v)
    assumed = None
    if arch is None and checks.device_reasons(checks.inspect_inputs(q, k, v)):
        arch, device_name, assumed = _assumed_target(device_name)
    plan = _plan(q, k, v, causal, return_lse, config, fallback, allow_untested_sm100, backend,
                 arch=arch, device_name=device_name)
    if assumed:
        plan.explanation.notes.insert(0, assumed)
    return plan.explanation


def _assumed_target(device_name: str | None) -> tuple[str, str, str]:
    """(arch, device name, a note saying so) to explain inputs that are on no GPU."""
    how = "name another with fa4.explain(..., arch='sm90' or 'sm100', device_name='NVIDIA H200')"
    if torch.cuda.is_available():
        capability = tuple(torch.cuda.get_device_capability())
        arch = arch_of_capability(capability)
        if arch is not None:
            name = device_name or torch.cuda.get_device_name()
            return arch, name, (f"the inputs are on no GPU: explained for this machine's {name} ({arch}); "
                                f"{how}")
    db = _database()
    tuned = sorted({(e.arch, e.device) for e in db.entries}) if db is not None else []
    if device_name is not None:
        arch = next((a for a, d in tuned if d == device_name), tuned[0][0] if tuned else kernels.ARCHS[0])
        where = f"{arch} on {device_name}"
    else:
        arch, device_name = tuned[0] if tuned else (kernels.ARCHS[0], "unknown device")
        where = f"{arch} on {device_name}, where the tuned database was measured"
    return arch, device_name, (f"the inputs are on no GPU and this machine has none our kernels run on: "
                               f"explained for {where}; {how}. fa4.attention itself runs only on CUDA "
                               "tensors (or with fallback='sdpa')")
