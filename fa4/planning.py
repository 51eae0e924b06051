"""The runtime's decision for a call: the implementation per mode (ours or a peer, `fa4.dispatch`) and our
kernel's configuration (forced, exact database hit, nearest bucket, heuristic default), or why our
kernels cannot run it. `plan` raises for invalid calls and, without a fallback, unsupported ones;
`fa4.explain` returns its `Explanation`."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from fa4 import backends as _backends, checks, compile_cache, dispatch, kernels, prediction, state
from fa4.arch import describe_capabilities
from fa4.checks import InvalidInputError, UnsupportedInputError
from fa4.config_arg import check_unused, forced_config
from fa4.explanation import Explanation, mask_lines
from fa4.kernels import AttentionProblem, Config, DeviceDescription
from fa4.state import STATE, warn_once

ALLOW_SM100_ENV = "FA4_ALLOW_UNTESTED_SM100"
FALLBACKS = ("error", "sdpa")
# backend=: AUTO runs the fastest measured implementation (fa4.dispatch), a name
# (`fa4.backends.implementations()`) forces that one
AUTO = _backends.AUTO

UNTESTED_ARCHS = {"sm100": "the sm100 (Blackwell) kernel has not yet run on hardware: it is compile-checked "
                           "on CPU and its tile algorithm is emulated against PyTorch, but no Blackwell GPU "
                           "was available to run it"}


def sm100_allowed(flag: bool) -> bool:
    return bool(flag) or os.environ.get(ALLOW_SM100_ENV, "").strip().lower() in ("1", "true", "yes", "on")


@dataclass
class Plan:
    explanation: Explanation
    spec: checks.InputSpec
    problem: AttentionProblem | None
    causal: bool
    return_lse: bool
    # the GPU our kernel is planned for (the tensors', or the reference device of an `arch` explained
    # for another GPU); None where our kernel runs nothing
    device: DeviceDescription | None = None
    # the call's sliding window (left, right) and softcap as resolved (`checks.mask_arguments`;
    # `causal` is resolved with them), whatever runs it
    window: tuple[int, int] | None = None
    softcap: float | None = None


def plan(q, k, v, causal, return_lse, config, fallback, allow_untested_sm100, backend="auto",
          arch: str | None = None, device_name: str | None = None, window_size=None, softcap=None) -> Plan:
    """Decide what to run; raise for invalid calls and, without a fallback, unsupported ones.

    `arch` and `device_name` override the device's (explain for another GPU, e.g. on CPU tensors); that
    GPU is judged as the family's reference device (`fa4.kernels.reference_device`). `window_size` and
    `softcap` are `fa4.attention`'s (flash-attn's conventions).
    """
    if fallback not in FALLBACKS:
        raise InvalidInputError(f"fallback must be one of {FALLBACKS}, got {fallback!r}")
    choices = (AUTO,) + _backends.implementations()
    if not isinstance(backend, str) or backend not in choices:
        raise InvalidInputError(f"backend must be one of {', '.join(map(repr, choices))}, got {backend!r}")
    another_gpu = arch is not None  # explain for a GPU the tensors are not on
    if not isinstance(causal, bool) or not isinstance(return_lse, bool):
        raise InvalidInputError(f"causal and return_lse must be bools, got {causal!r}, {return_lse!r}")
    spec = checks.inspect_inputs(q, k, v)
    causal, window, softcap = checks.mask_arguments(causal, window_size, softcap, spec)
    masks = {"window": window, "softcap": softcap}
    reasons = list(spec.unsupported)
    device = None
    if arch is not None:
        if arch not in kernels.ARCHS:
            raise InvalidInputError(f"unknown architecture {arch!r}; known: {', '.join(kernels.ARCHS)}")
        device_name = device_name or "unknown device"
        device = kernels.reference_device(arch)
    else:
        device_problems = checks.device_reasons(spec)
        reasons += device_problems
        if not device_problems:
            device = state.device_description(spec.device)
            arch, device_name = device.arch, device.name
            if arch is None:
                major, minor = device.capability
                reasons.append(f"{device_name} (compute capability {major}.{minor}) has no fa4 kernel: "
                               f"they exist for {describe_capabilities()}")
    notes: list[str] = []
    if arch in UNTESTED_ARCHS:
        notes.append(UNTESTED_ARCHS[arch])
        if not sm100_allowed(allow_untested_sm100):
            reasons.append(
                f"{UNTESTED_ARCHS[arch]}; opt in with fa4.attention(..., allow_untested_sm100=True) or "
                f"{ALLOW_SM100_ENV}=1")  # the error itself adds how to fall back to SDPA
    if arch is not None and spec.dtype is not None and not reasons:
        reasons += checks.kernel_reasons(arch, spec, causal, return_lse, **masks)

    mask_text = AttentionProblem(1, 1, 1, 1, 1, 1, causal=causal, **masks).mask_label()
    label = (f"B{spec.batch} Sq{spec.seqlen_q} Sk{spec.seqlen_k} H{spec.heads_q}/{spec.heads_kv} "
             f"D{spec.head_dim}{'' if spec.head_dim_v is None else f' Dv{spec.head_dim_v}'} "
             f"{spec.dtype or spec.torch_dtype} {mask_text}")
    expl = Explanation(path="kernel", problem=label, device=str(spec.device), arch=arch,
                       device_name=device_name, notes=notes, mask=mask_lines(causal, window, softcap))
    given = checks.window_value(window_size)
    if given is not None and window != (given[0], 0 if causal else given[1]):
        notes.append(f"window_size {given} at Sq={spec.seqlen_q}, Sk={spec.seqlen_k} is '{mask_text}': a side "
                     "that reaches past every key bounds nothing, and a right side 0 is the causal mask")
    if backend in _backends.peer_names():
        return _plan_forced_peer(expl, spec, causal, return_lse, config, backend, another_gpu, **masks)
    if config is not None and (reasons or spec.is_empty or spec.has_no_keys):
        # our kernel runs nothing here, but a wrong config= is a wrong call whatever runs instead
        check_unused(config, arch, spec, causal, return_lse, device)
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
        if config is not None and expl.path == "sdpa":
            message = ("fa4: config= is ignored: PyTorch SDPA runs (fallback='sdpa') because "
                       + "; ".join(reasons))
            notes.append(message[len("fa4: "):])
            warn_once("sdpa-config:" + "|".join(reasons), message)
        return Plan(expl, spec, None, causal, return_lse, **masks)

    problem = spec.problem(causal, return_lse, **masks)
    try:
        _choose_config(expl, arch, device_name, device, problem, config)
    except UnsupportedInputError as exc:  # the heuristic default does not fit this problem
        if fallback != "sdpa":
            raise
        expl.path, expl.reasons, expl.config, expl.source = "sdpa", [str(exc)], None, None
        return Plan(expl, spec, None, causal, return_lse, **masks)
    expl.compile_key = kernels.compile_key(expl.config, problem, device)
    expl.compiled = compile_cache.cached(expl.config, problem, device) is not None
    _choose_backends(expl, backend, problem)
    return Plan(expl, spec, problem, causal, return_lse, device, **masks)


def _plan_forced_peer(expl: Explanation, spec, causal, return_lse, config, backend, another_gpu=False,
                      window=None, softcap=None) -> Plan:
    """backend= names a peer: it runs in every mode, or the call raises saying why it cannot
    (`another_gpu`: explained for a GPU the tensors are not on, so their device is no reason)."""
    title = _backends.title(backend)
    if config is not None:
        raise InvalidInputError(f"config= configures our kernel, but backend={backend!r} runs {title}: "
                                "pass one or the other")
    why = [] if another_gpu else checks.device_reasons(spec)
    if spec.dtype is None:  # no problem to ask the peer about
        why.append(f"dtype {spec.torch_dtype}: fp16 or bf16 only")
    why += [_backends.unavailable(backend)]
    if spec.dtype is not None:
        why += [_backends.unsupported(backend, spec.problem(causal, return_lse, window, softcap))]
    why = [w for w in why if w]
    if why:
        raise UnsupportedInputError(f"backend={backend!r} cannot run these inputs: {'; '.join(why)}")
    expl.runs = {mode: backend for mode in dispatch.MODES}
    expl.forced_backend = backend
    if spec.is_empty:
        expl.path = "empty"
    elif spec.has_no_keys:
        expl.path = "no_keys"
    return Plan(expl, spec, None, causal, return_lse, window=window, softcap=softcap)


def _choose_backends(expl: Explanation, backend: str, problem: AttentionProblem) -> None:
    """Fill expl.runs (and expl.backends or expl.predictions, expl.notes): per mode, the implementation.

    backend="ours" runs ours. "auto": among the implementations installed here and able to give this
    call our semantics, an exact database entry's measured times decide (`fa4.dispatch.choose`); without
    them (a shape nobody tuned, or an entry that timed ours alone), the times measured at nearby shapes
    predict the winner (`fa4.prediction`); ours without any measurement, or where it wins or ties. A
    forced configuration runs ours."""
    expl.runs = {mode: dispatch.OURS for mode in dispatch.MODES}
    if backend == dispatch.OURS:
        expl.forced_backend = backend
    measured_here = expl.source == "exact" and expl.entry.backend_us
    if expl.source == "forced":
        return
    # an exact entry without times (autotuned on first use, which times ours only) is judged as a
    # shape nobody measured: the neighbours predict the implementation
    excluded = _excluded_peers(expl, problem)
    if backend == AUTO:
        expl.candidates = [dispatch.OURS] + [name for name in _backends.peer_names() if name not in excluded]
        expl.left_out = excluded
    host = dispatch.host_us(expl.device_name or "")
    if measured_here:
        measured = dict(expl.entry.backend_us)
        candidates = {name: us for name, us in measured.items() if name not in excluded}
        for mode in dispatch.MODES:
            choice = dispatch.choose(candidates, host, mode)
            if choice is None:
                continue
            expl.backends.append(choice)
            if backend == AUTO:
                expl.runs[mode] = choice.backend
            unfiltered = dispatch.choose(measured, host, mode)
            if unfiltered is not None and unfiltered.backend != choice.backend:
                expl.notes.append(f"{mode}: {_backends.title(unfiltered.backend)} measured fastest "
                                  f"({unfiltered.reason}) but cannot run here: {excluded[unfiltered.backend]}")
    else:
        db = state.database()
        entries = [] if db is None else prediction.region(
            db.current_entries(state.fingerprint(expl.arch), STATE.db_broken), expl.arch,
            expl.device_name or "", problem)
        for mode in dispatch.MODES:
            guess = prediction.predict(entries, problem, mode, host, lambda name: name not in excluded)
            if guess is None:
                continue
            expl.predictions.append(guess)
            if backend == AUTO:
                expl.runs[mode] = guess.backend
    if not host and (expl.backends or expl.predictions):
        expl.notes.append(f"no host time per call was measured on {expl.device_name}: eager calls are "
                          "judged by GPU time alone")


def _excluded_peers(expl: Explanation, problem: AttentionProblem) -> dict[str, str]:
    """{peer: why it cannot run this call here} (not installed, cannot give our semantics, or it
    refused this call earlier in this process)."""
    excluded: dict[str, str] = {}
    for name in _backends.peer_names():
        why = [_backends.unavailable(name), _backends.unsupported(name, problem)]
        refused = STATE.refused.get((name, expl.problem, problem.return_lse))
        why += [f"{_backends.title(name)} refused this call earlier in this process ({refused})"] if refused else []
        why = [w for w in why if w]
        if why:
            excluded[name] = "; ".join(why)
    return excluded


def _choose_config(expl: Explanation, arch: str, device_name: str, device: DeviceDescription,
                   problem: AttentionProblem, config: Any) -> None:
    """Fill expl.config and expl.source: forced, else exact -> nearest -> heuristic default; each judged
    feasible on `device` by the family (`fa4.kernels.feasible`: resources and grid limits)."""
    if config is not None:
        expl.config, expl.source = forced_config(config, arch, problem, device), "forced"
        return

    db = state.database()
    if db is None:
        expl.database = f"unusable ({STATE.db_error}); defaults are used"
    else:
        expl.database = _describe_database(db)
        fingerprint = state.fingerprint(arch)
        try:
            found = db.lookup(arch, device_name, problem, fingerprint, max_distance=_max_distance(),
                              broken=STATE.db_broken)
        except Exception as exc:  # a malformed entry must not break a forward pass either
            warn_once("db-lookup", f"fa4: best-config database lookup failed ({type(exc).__name__}: "
                                    f"{exc}); running heuristic default configurations")
            expl.notes.append(f"database lookup failed: {exc}")
            found = None
        if found is not None and found.stale:
            keys = ", ".join(e.key for e in found.stale[:3]) + (" ..." if len(found.stale) > 3 else "")
            message = (f"fa4: {len(found.stale)} tuned entr{'y' if len(found.stale) == 1 else 'ies'} for "
                       f"{arch} {problem.dtype} d{problem.head_dim} gqa{problem.gqa_ratio} "
                       f"{problem.mask_label()} {'was' if len(found.stale) == 1 else 'were'} "
                       f"tuned on other kernel sources (fingerprint differs from {fingerprint}) and "
                       f"{'is' if len(found.stale) == 1 else 'are'} not used ({keys}); re-run fa4tune search")
            expl.notes.append(message)
            warn_once("stale:" + "|".join(e.key for e in found.stale), message)
        if found is not None:
            expl.notes += list(found.passed_over)
        if found is not None and found.kind in ("exact", "nearest") and found.entry is not None:
            try:
                cfg = Config.from_dict(arch, found.entry.config)
                why = kernels.feasible(cfg, problem, device)
            except (ValueError, KeyError, TypeError) as exc:  # knobs renamed since the tuning
                cfg, why = None, [str(exc)]
            if not why:
                expl.config, expl.source, expl.entry = cfg, found.kind, found.entry
                expl.distance, expl.layer = found.distance, found.layer
                return
            expl.notes.append(f"database entry {found.entry.key} does not fit this problem "
                              f"({'; '.join(why)}); using the heuristic default")
    expl.config, expl.source = kernels.default_config(arch, problem, device), "default"
    too_big = kernels.family(arch).launch_reasons(expl.config, problem, device)
    if too_big and expl.config.scheduler == "single":
        # the same tiles, one CTA each, on a 1-D grid: our choice of default, not the user's, so it is
        # adjusted (and said), where a forced or tuned configuration is refused
        adjusted = expl.config.replace(scheduler="single_lpt")
        if not kernels.feasible(adjusted, problem, device):
            expl.notes.append(f"the heuristic default's scheduler=single cannot launch this shape "
                              f"({'; '.join(too_big)}): scheduler=single_lpt runs the same tiles instead")
            expl.config = adjusted
    why = kernels.feasible(expl.config, problem, device)
    if why:
        raise UnsupportedInputError(
            f"the heuristic default {expl.config.label()} cannot run {problem.label()}: {'; '.join(why)}")


def _describe_database(db) -> str:
    """The database's files for explain: each layer with its entry count or its error."""
    parts = []
    for layer, path, count, error in db.layers:
        state = f"unusable: {error}" if error else (f"{count} entries" if os.path.exists(path) else "absent")
        parts.append(f"{layer + ' ' if layer else ''}{path} ({state})")
    if STATE.db_broken:
        parts.append(f"{len(STATE.db_broken)} unusable entr{'y' if len(STATE.db_broken) == 1 else 'ies'} skipped")
    return "; ".join(parts) or "none"


def _max_distance() -> float:
    """The nearest-bucket limit (`fa4.database.max_distance`); a malformed setting warns once and the
    documented default is used."""
    from fa4 import database

    try:
        return database.max_distance()
    except ValueError as exc:
        warn_once(f"max-distance:{exc}", f"fa4: {exc}; using the default limit {database.DEFAULT_MAX_DISTANCE:g}")
        return database.DEFAULT_MAX_DISTANCE
