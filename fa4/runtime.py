"""`fa4.attention`: choose an implementation and configuration for the inputs, compile once, launch cheaply.

Three paths, one decision procedure (`fa4.planning.plan`), over the process-wide state of `fa4.state`:
- Slow path, once per input signature (shapes, strides, dtypes, devices, flags): check the inputs,
  describe the GPU once (`fa4.state.device_description`: its family, SM count, shared memory, L2), look
  the configuration up (forced -> exact database hit -> nearest bucket -> heuristic default), ask the
  family whether it is feasible on that GPU, compile it or take it from the one cache of compiled
  kernels (`fa4.compile_cache`, keyed by `fa4.kernels.compile_key`, which holds no sequence length or
  batch, and the kernel fingerprint), and store a `_Launch` for the signature.
- Kernel path, every later call of a kernel signature: a short key (Q's and K's shapes, the three
  tensors' strides, Q's dtype and device, the flags) finds the `_Launch`, O (and LSE) are allocated and
  the compiled kernel's TVM-FFI function is called directly (`fa4.kernels.dsl_internals.direct_launcher`, the
  one place that reads the DSL's private objects). What the short key
  leaves out is checked by that function itself, in C, on every call: each tensor's dtype, rank, device
  (one for all) and 16-byte data alignment, V's extents against K's, batch against Q's, the head dim and
  the strides (the kernels are compiled with shared symbolic extents and aligned symbolic strides). When
  it refuses a call, the checked path below runs and names the problem.
- Checked path, any other call: the full signature (shapes, strides, dtypes and devices of Q, K and V,
  and the flags) finds the `_Launch`, the data pointers are checked, and the launch runs: the kernel,
  SDPA, or no launch for empty inputs. No torch.library dispatch on either path: the custom op in
  `fa4.ops` serves torch.compile, which enters it through `torch.compiler.is_compiling()` below.

The plan also picks, per mode (eager; CUDA-graph capture or torch.compile), the implementation to run
(`fa4.dispatch`, `fa4.backends`): a `_Launch` of a peer, or of ours, with the other mode's launch
attached where it differs (`_Launch.graph`; only such launches check for a capture on the fast path).
The custom op enters `_checked_call` in graph mode and shares the cached launches.

`explain(...)` runs the same plan without compiling and says what would run and why. The config=
argument is read by `fa4.config_arg`, which also writes it as text for the custom op.
"""

from __future__ import annotations

import functools
from collections import Counter
import math
from typing import Any, Mapping

import torch

from fa4 import backends as _backends, backward as _backward, checks, dispatch, fallback as _fallback, planning
from fa4 import autotuning, compile_cache, config_arg, kernels, record_shapes
from fa4.arch import arch_of_capability
from fa4.checks import Fa4Error, InvalidInputError, UnsupportedInputError
from fa4.explanation import Explanation
from fa4.kernels import AttentionProblem, Config, DeviceDescription, compiling, dsl_internals
from fa4.state import STATE, database, forget_signatures, warn_once

# Signatures kept in the fast-path table; past this the table starts over (dynamic shapes can create
# one signature per sequence length).
MAX_SIGNATURES = 4096
# the softmax scales the kernel path takes without a call (`checks.softmax_scale_value`)
_SCALE_MIN, _SCALE_MAX = checks.SOFTMAX_SCALE_MIN, checks.SOFTMAX_SCALE_MAX


class KernelCompileError(Fa4Error, RuntimeError):
    """Compiling the chosen configuration failed (a bug in a kernel, or a missing DSL)."""


class NotWarmedUpError(Fa4Error, RuntimeError):
    """The first call of a shape came while a CUDA graph was being captured, and it needs a compile
    (ours or flash-attn-4's), which cannot happen inside a capture. The message says what to warm up."""


# ---------------------------------------------------------------------------------------------------
# launching
# ---------------------------------------------------------------------------------------------------

_KERNEL, _EMPTY, _NO_KEYS, _SDPA, _PEER = range(5)


class _Launch:
    """What a signature needs at call time. Plain slots: read on every call.

    `graph`: where graph mode (CUDA-graph capture, torch.compile) runs another implementation than an
    eager call (fastest-backend dispatch), that implementation's launch; else None."""

    __slots__ = ("kind", "run", "fast_run", "compiled", "default_scale", "out_like_q", "out_shape",
                 "lse_shape", "device_index", "restride", "causal", "backend", "graph", "rows_without_keys",
                 "window", "softcap", "kernel_masks")

    def __init__(self, kind, run, default_scale, out_like_q, out_shape, lse_shape, device_index,
                 restride, causal, compiled=None, backend=dispatch.OURS, rows_without_keys=0, window=None,
                 softcap=None, kernel_masks=None):
        self.kind = kind
        self.run = run            # the compiled kernel's checked `run`, or a peer's runner
        self.fast_run = run       # what the fast path calls; see fa4.kernels.dsl_internals.direct_launcher
        self.compiled = compiled
        self.default_scale = default_scale
        self.out_like_q = out_like_q
        self.out_shape = out_shape
        self.lse_shape = lse_shape
        self.device_index = device_index
        self.restride = restride
        self.causal = causal
        self.backend = backend    # the implementation this launch runs (`fa4.backends.implementations()`)
        self.graph = None
        self.rows_without_keys = rows_without_keys  # a peer's rows to set to our no-key rule
        self.window = window      # the call's sliding window and softcap (SDPA's launch applies them)
        self.softcap = softcap
        # our kernel's mask values (`fa4.kernels.compiling.kernel_mask_values`), bound to its run;
        # None for a kernel without window or softcap
        self.kernel_masks = kernel_masks


def compiled_kernel(config: Config, problem: AttentionProblem, device: DeviceDescription):
    """Our kernel for `device`, from the one cache of compiled kernels (`fa4.compile_cache`), compiled
    (or loaded from disk) on a miss, which cannot happen inside a CUDA-graph capture. The seam every
    runtime path that launches our forward kernel goes through (`fa4.attention`, `fa4.attention_varlen`)."""
    launcher = compile_cache.cached(config, problem, device)
    if launcher is None:
        with STATE.lock:
            launcher = compile_cache.cached(config, problem, device)
            if launcher is None:
                if _capturing():
                    raise NotWarmedUpError(_warmup_message(problem, f"compiling our {config.arch} kernel "
                                                                    f"{config.label()}"))
                try:
                    launcher = compile_cache.compile_attention(config, problem, device)
                except Exception as exc:
                    raise KernelCompileError(
                        f"compiling {config.arch} {config.label()} for {problem.label()} failed: "
                        f"{type(exc).__name__}: {exc}") from exc
                STATE.compiles += 1
    return launcher


def _warmup_message(problem: AttentionProblem, what: str) -> str:
    return (f"fa4.attention: {problem.label()} was first called while a CUDA graph was being captured, "
            f"and {what} cannot happen inside a capture. Warm this shape up before capturing: "
            f"fa4.warmup(fa4.kernels.{problem!r}) (or call fa4.attention once with the same inputs)")


def _make_launch(plan: planning.Plan, fallback: str) -> _Launch:
    """The launch of the implementation eager calls run, with the graph mode's attached where that
    one differs (`_Launch.graph`)."""
    expl = plan.explanation
    if expl.path != "kernel" or not expl.runs:
        return _launch_of(plan, dispatch.OURS, fallback)
    launch = _launch_of(plan, expl.runs["eager"], fallback)
    if expl.runs["graph"] != expl.runs["eager"]:
        launch.graph = _launch_of(plan, expl.runs["graph"], fallback)
    return launch


def _launch_of(plan: planning.Plan, backend: str, fallback: str) -> _Launch:
    spec, expl = plan.spec, plan.explanation
    kind = {"kernel": _KERNEL, "empty": _EMPTY, "no_keys": _NO_KEYS, "sdpa": _SDPA}[expl.path]
    run = compiled = kernel_masks = None
    if kind == _KERNEL and backend != dispatch.OURS:
        kind, run = _PEER, _peer_runner(plan, backend)
        if run is None:  # auto dispatch to a peer that cannot be imported: ours instead
            kind, backend = _KERNEL, dispatch.OURS
    if kind == _KERNEL:
        try:
            compiled = compiled_kernel(expl.config, plan.problem, plan.device)
            run = compiled.run
            masks = compiling.mask_values(plan.problem)
            if masks is not None:   # the window's widths and the cap: runtime values of its kernel
                run = functools.partial(compiled.run, masks=masks)
                kernel_masks = compiling.kernel_mask_values(masks, spec.seqlen_q, spec.seqlen_k)
        except KernelCompileError as exc:
            if fallback != "sdpa":
                raise
            warn_once(f"compile:{expl.compile_key}", f"fa4: {exc}; running SDPA instead (fallback='sdpa')")
            kind = _SDPA
    if kind == _SDPA:
        warn_once("sdpa:" + "|".join(expl.reasons),
                   "fa4: running PyTorch SDPA (fallback='sdpa') because " + "; ".join(expl.reasons or ["the kernel failed to compile"]))
    out_shape = (spec.batch, spec.seqlen_q, spec.heads_q, spec.value_head_dim)
    from fa4.reference import rows_without_keys

    return _Launch(
        kind=kind, run=run, default_scale=1.0 / math.sqrt(spec.head_dim) if spec.head_dim else 1.0,
        out_like_q=None, out_shape=out_shape, lse_shape=(spec.batch, spec.heads_q, spec.seqlen_q),
        # -1 off CUDA: what the current-device probe answers on a CPU build (the tests' fake kernels)
        device_index=spec.device.index if spec.device.type == "cuda" else -1,
        restride=spec.needs_restride, causal=plan.causal, compiled=compiled,
        backend=backend if kind in (_KERNEL, _PEER) else dispatch.OURS,
        rows_without_keys=rows_without_keys(spec.seqlen_q, spec.seqlen_k, plan.causal, plan.window)
        if kind == _PEER else 0, window=plan.window, softcap=plan.softcap, kernel_masks=kernel_masks)


def spec_out_like_q(spec) -> bool:
    """Whether the output has q's shape (not when v's head dim differs)."""
    return spec.head_dim_v is None


def _peer_runner(plan: planning.Plan, backend: str):
    """`fa4.backends.runner` for the peer; None (with a warning) when auto dispatch chose a peer that
    cannot be imported; a forced one raises."""
    try:
        masks = {} if plan.window is None and plan.softcap is None else {"window": plan.window,
                                                                          "softcap": plan.softcap}
        return _backends.runner(backend, plan.causal, **masks)
    except Exception as exc:  # ImportError, or a package that fails to initialise
        why = f"{_backends.title(backend)} cannot be imported: {_backends.first_error_line(exc)}"
        if plan.explanation.forced_backend == backend:
            raise UnsupportedInputError(f"backend={backend!r} cannot run these inputs: {why}") from exc
        warn_once(f"peer-import:{backend}", f"fa4: {why}; our kernel runs where it was measured fastest")
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
        out, lse = _fallback.sdpa_attention(q, k, v, launch.causal, softmax_scale, return_lse,
                                            window=launch.window, softcap=launch.softcap)
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
               key, kernel_key=None, in_graph=False, window_size=None, softcap=None):
    """First call of a signature (or one the fast path cannot take): decide, cache, run."""
    STATE.slow_calls += 1
    softmax_scale = checks.softmax_scale_value(softmax_scale)
    masks = {"window_size": window_size, "softcap": softcap}
    plan = planning.plan(q, k, v, causal, return_lse, config, fallback, allow_untested_sm100, backend, **masks)
    if autotuning.tune_first(plan, in_graph):   # $FA4_AUTOTUNE / fa4.autotune: a no-op when off
        plan = planning.plan(q, k, v, causal, return_lse, config, fallback, allow_untested_sm100, backend,
                             **masks)
    record_shapes.note(plan.spec, plan.causal, return_lse, plan.window, plan.softcap)   # FA4_RECORD_SHAPES
    launch = _make_launch(plan, fallback)
    if launch.kind == _KERNEL or (launch.graph is not None and launch.graph.kind == _KERNEL):
        launch.out_like_q = q.is_contiguous() and spec_out_like_q(plan.spec)
        if launch.graph is not None:
            launch.graph.out_like_q = launch.out_like_q
        misaligned = checks.pointers_misaligned(q, k, v)
        if misaligned is not None:
            if fallback != "sdpa":
                raise UnsupportedInputError(
                    f"fa4.attention cannot run these inputs with its kernels: {misaligned}. "
                    "Pass fallback='sdpa' to run PyTorch SDPA instead.")
            warn_once("sdpa:misaligned", f"fa4: running PyTorch SDPA (fallback='sdpa') because {misaligned}")
            out, lse = _fallback.sdpa_attention(q, k, v, plan.causal, softmax_scale, return_lse,
                                                window=plan.window, softcap=plan.softcap)
            return (out, lse) if return_lse else out
    launch, result = _first_run(plan, launch, q, k, v, softmax_scale, return_lse, in_graph, fallback)
    if key is not None:
        with STATE.lock:
            if len(STATE.launches) >= MAX_SIGNATURES:
                forget_signatures()
            STATE.launches[key] = launch
            STATE.last = (key, launch)
    if launch.kind == _KERNEL and launch.fast_run is launch.run and not (launch.graph is not None and in_graph):
        # `run` accepted this signature: later calls may skip its signature-only checks (a run in
        # graph mode ran the graph launch, so it says nothing of this one)
        launch.fast_run = _direct_run(launch) or launch.run
    if (kernel_key is not None and key is not None and launch.kind == _KERNEL and not launch.restride
            and launch.fast_run is not launch.run and launch.device_index == _current_cuda_device()):
        # a compiled TVM-FFI function, which checks what kernel_key leaves out (see attention)
        with STATE.lock:
            if len(STATE.kernel_launches) >= MAX_SIGNATURES:
                forget_signatures()
            STATE.kernel_launches[kernel_key] = launch
            STATE.last_kernel = (kernel_key, launch)
    return result


def _direct_run(launch: _Launch):
    """The compiled kernel's TVM-FFI function as the fast path calls it (`dsl_internals.direct_launcher`),
    with a window's or softcap's kernel mask values bound; None where the DSL's object is not recognised."""
    direct = dsl_internals.direct_launcher(launch.compiled)
    masks = launch.kernel_masks
    if direct is None or masks is None:
        return direct

    def run(q, k, v, out, lse, scale):
        direct(q, k, v, out, lse, scale, *masks)

    return run


def _first_run(plan, launch, q, k, v, softmax_scale, return_lse, in_graph, fallback):
    """Run a new signature's launch: (the launch to keep, the result).

    A peer that refuses the call (an error from the peer itself: a shape, layout or GPU it does not
    take) raises under backend=<its name>; under auto dispatch it is remembered as refused, our kernel
    replaces it, and a warning says so. On an eager first call, a peer that only graph mode runs is
    run once too (output dropped), so a later capture finds it compiled (a peer that compiles on
    first use, `Backend.compiles_on_first_call`) and its refusal is known before any capture."""
    capturing = _capturing()
    graph_mode = in_graph or capturing
    active = launch.graph if graph_mode and launch.graph is not None else launch
    if (capturing and active.kind == _PEER and _backends.get(active.backend).compiles_on_first_call
            and (active.backend, plan.explanation.problem, return_lse) not in STATE.peers_run):
        raise NotWarmedUpError(_warmup_message(plan.spec.problem(plan.causal, return_lse, plan.window, plan.softcap),
                                               f"{_backends.title(active.backend)}'s first call (it compiles)"))
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
        STATE.peers_run.add((launch.backend, plan.explanation.problem, return_lse))
        return launch, result
    except Exception as exc:  # the peer refused these inputs
        expl = plan.explanation
        title = _backends.title(launch.backend)
        if expl.forced_backend == launch.backend:
            raise UnsupportedInputError(f"backend={launch.backend!r} cannot run these inputs: {title} raised "
                                        f"{_backends.first_error_line(exc)}") from exc
        why = _backends.first_error_line(exc)
        STATE.refused[(launch.backend, expl.problem, plan.return_lse)] = why
        warn_once(f"refused:{launch.backend}:{expl.problem}:{plan.return_lse}",
                   f"fa4: {title}, measured fastest for {expl.problem}, refused the call ({why}); our "
                   "kernel runs instead")
        ours = _launch_of(plan, dispatch.OURS, fallback)
        ours.out_like_q = q.is_contiguous() and spec_out_like_q(plan.spec)
        return ours, _run_launch(ours, q, k, v, softmax_scale, return_lse)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              softmax_scale: float | None = None, return_lse: bool = False, config: Any = None,
              fallback: str = "error", *, backend: str = "auto", allow_untested_sm100: bool = False,
              window_size: tuple[int, int] | None = None, softcap: float | None = None,
              deterministic: bool | None = None):
    """Attention forward: O = softmax(Q K^T * scale) V, the fastest implementation measured for the shape.

    q: (B, Sq, Hq, D); k, v: (B, Sk, Hkv, D), on one CUDA device, fp16 or bf16, Hq a multiple of Hkv
    (grouped-query attention). Causal masks are bottom-right aligned (key j hidden from query i when
    j > i + Sk - Sq). softmax_scale defaults to 1/sqrt(D); one given must be a positive number from
    2**-126 to 2**127 (`fa4.checks.SOFTMAX_SCALE_MIN` says why), else `InvalidInputError`.
    window_size=(left, right): a sliding window, flash-attn's convention: query i sees key j when
    i + Sk - Sq - left <= j <= i + Sk - Sq + right, -1 leaving a side unbounded (causal makes the right
    side 0). softcap=c (> 0; None or 0: none): each scaled score s becomes c * tanh(s / c) before the
    softmax, as flash-attn-4 applies it. Rows that see no key get O = 0 and LSE = -inf.

    Returns O (B, Sq, Hq, D) in q's dtype, or (O, LSE) with LSE (B, Hq, Sq) fp32 (natural log) when
    return_lse. backend="auto" runs our kernel with its tuned configuration unless the database entry
    of this shape measured another implementation faster for this kind of call (eager, or CUDA-graph
    capture / torch.compile; `fa4.dispatch`) and it is installed and gives the same semantics;
    "ours" forces our kernel, a peer's name (`fa4.backends.peer_names()`: "flash_attn_4",
    "sdpa_cudnn", "sdpa_flash") forces that implementation (`UnsupportedInputError` when it cannot
    run the call). config= forces our kernel's configuration (a `fa4.kernels.Config`, a dict of knob
    values over the heuristic default, or a label).
    fallback="sdpa" runs PyTorch SDPA where our kernels cannot run the inputs (with a one-time
    warning); the default raises `UnsupportedInputError`. The Blackwell kernel has never run on
    hardware and is used only with allow_untested_sm100=True (or FA4_ALLOW_UNTESTED_SM100=1).
    Differentiable: with grad mode on and an input that requires grad, the call goes through the
    custom op `fa4::attention`, whose forward also saves LSE and whose backward is `fa4.backward`'s
    (flash-attn-4's backward kernels on a GPU they run on, else a blockwise PyTorch backward); a
    gradient through a returned LSE is supported. deterministic=True: the gradients are equal bit for
    bit on every run of the same inputs (our backward kernels adding each sum in a fixed order, else
    the blockwise one; `fa4.backward`); None (the default) follows
    `torch.use_deterministic_algorithms`; the forward is deterministic either way.
    """
    # a bad value is refused here, whatever path the call takes; None (torch's setting) is resolved only
    # where a gradient needs it (`_through_op`), not on the eager forward path
    if deterministic is not None:
        checks.deterministic_value(deterministic)
    if torch.compiler.is_compiling():
        softmax_scale = checks.softmax_scale_value(softmax_scale)  # before the op's schema sees it
        return _through_op(q, k, v, causal, softmax_scale, return_lse, config, fallback,
                           allow_untested_sm100, backend, window_size, softcap, deterministic)
    try:
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            softmax_scale = checks.softmax_scale_value(softmax_scale)
            return _through_op(q, k, v, causal, softmax_scale, return_lse, config, fallback,
                               allow_untested_sm100, backend, window_size, softcap, deterministic)
        # The short key of the kernel path: what decides the launch and what the compiled function
        # cannot check (strides of size-1 extents, which it skips and the kernel re-strides on the
        # checked path). V's head dim (the output's), here; the rest of V's shape, K's and V's dtypes and devices and the data pointers' alignment
        # are checked by the compiled function on every call, in C.
        kernel_key = (q.shape, k.shape, v.shape[3], q.stride(), k.stride(), v.stride(), q.dtype, q.get_device(),
                      causal, return_lse, config, fallback, allow_untested_sm100, backend, window_size, softcap)
        last = STATE.last_kernel  # consecutive calls usually share a signature: skip hashing the key
        launch = last[1] if kernel_key == last[0] else STATE.kernel_launches.get(kernel_key)
    except (AttributeError, TypeError, RuntimeError, IndexError):  # not tensors (or v not 4-D) (nested and sparse ones have no
        # sizes or strides), or an unhashable config: the checked path says
        kernel_key = launch = None
    # a launch with a graph launch attached runs that one under a capture: the checked path picks it
    if (launch is not None and launch.device_index == _current_cuda_device()
            and (launch.graph is None or not _capturing())):
        out = torch.empty_like(q) if launch.out_like_q else q.new_empty(launch.out_shape)
        try:
            if softmax_scale is None:
                scale = launch.default_scale
            elif type(softmax_scale) is float and _SCALE_MIN <= softmax_scale <= _SCALE_MAX:
                scale = softmax_scale  # what `checks.softmax_scale_value` accepts, as it returns it
            else:  # the direct launcher passes the scale to the kernel's Float32 parameter unconverted:
                raise ValueError  # any other value goes the checked path, which converts or names it
            if return_lse:
                lse = q.new_empty(launch.lse_shape, dtype=torch.float32)
                launch.fast_run(q, k, v, out, lse, scale)
                return out, lse
            launch.fast_run(q, k, v, out, None, scale)
            return out
        except Exception:  # the compiled function refused these inputs (or the scale is no finite
            pass           # number): the checked path says why
    return _checked_call(q, k, v, causal, softmax_scale, return_lse, config, fallback,
                         allow_untested_sm100, backend, kernel_key, window_size=window_size, softcap=softcap)


def _checked_call(q, k, v, causal, softmax_scale, return_lse, config, fallback, allow_untested_sm100,
                  backend, kernel_key, in_graph=False, window_size=None, softcap=None):
    """Every call the kernel path does not take: the full signature, pointer checks, any launch kind."""
    masks = {"window_size": window_size, "softcap": softcap}
    try:
        key = (q.size(), q.stride(), k.size(), k.stride(), v.size(), v.stride(), q.dtype, k.dtype,
               v.dtype, q.device, k.device, v.device, causal, return_lse, config, fallback,
               allow_untested_sm100, backend, window_size, softcap)
        last = STATE.last
        launch = last[1] if key == last[0] else STATE.launches.get(key)
    except (AttributeError, TypeError, RuntimeError):  # see attention; the slow path says
        key = _hashable_key(q, k, v, causal, return_lse, config, fallback, allow_untested_sm100, backend,
                            window_size, softcap)
        launch = STATE.launches.get(key) if key is not None else None
    if launch is None:
        return _slow_call(q, k, v, causal, softmax_scale, return_lse, config, fallback,
                          allow_untested_sm100, backend, key, kernel_key, in_graph, **masks)
    if launch.kind == _KERNEL and (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15:
        return _slow_call(q, k, v, causal, softmax_scale, return_lse, config, fallback,
                          allow_untested_sm100, backend, None, None, in_graph, **masks)
    return _run_launch(launch, q, k, v, softmax_scale, return_lse, in_graph)


def _hashable_key(q, k, v, causal, return_lse, config, fallback, allow_untested_sm100, backend,
                  window_size=None, softcap=None):
    """The signature key when the fast one failed: config mappings frozen, a window_size list made a
    tuple; None for non-tensors and tensors without sizes or strides (nested, sparse: the slow path
    refuses them)."""
    if not all(isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_nested
               for t in (q, k, v)):
        return None
    if isinstance(config, Mapping):
        config = ("mapping",) + tuple(sorted(config.items()))
    if isinstance(window_size, list):
        window_size = ("list",) + tuple(window_size)
    try:
        key = (q.size(), q.stride(), k.size(), k.stride(), v.size(), v.stride(), q.dtype, k.dtype,
               v.dtype, q.device, k.device, v.device, causal, return_lse, config, fallback,
               allow_untested_sm100, backend, window_size, softcap)
        hash(key)
    except TypeError:
        return None
    return key


def _through_op(q, k, v, causal, softmax_scale, return_lse, config, fallback, allow_untested_sm100,
                backend="auto", window_size=None, softcap=None, deterministic=None):
    """The custom op `fa4::attention` (registered by fa4.ops): under torch.compile, and for every call
    that needs a gradient (its backward needs LSE, so the op computes it then). The window travels as
    int[] (-1 for an unbounded side) and the softcap as float?, checked before the op sees them;
    deterministic None as torch's setting."""
    config = config_arg.for_op(config)
    window = checks.window_value(window_size)
    needs_lse = return_lse or (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))
    extra = {}
    if window is not None or softcap is not None:   # a dense call's op call is what it was
        if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))):
            raise InvalidInputError(f"softcap must be a number > 0 (None or 0: no softcap), got {softcap!r}")
        extra = {"window_size": None if window is None else list(window),
                 "softcap": None if softcap is None else float(softcap)}
    if checks.deterministic_value(deterministic):
        extra["deterministic"] = True
    out, lse = torch.ops.fa4.attention(q, k, v, causal, softmax_scale, needs_lse, config, fallback,
                                       allow_untested_sm100, backend, **extra)
    return (out, lse) if return_lse else out


def forward_for_op(q, k, v, causal, softmax_scale, return_lse, config, fallback, allow_untested_sm100,
                   backend="auto", window_size=None, softcap=None, deterministic=False):
    """The real implementation of the custom op: the checked path in graph mode (torch.compile and
    CUDA graphs judge implementations by GPU time), outputs always a pair, O contiguous."""
    window_size = None if window_size is None else tuple(window_size)
    result = _checked_call(q, k, v, causal, softmax_scale, return_lse, config, fallback,
                           allow_untested_sm100, backend, None, in_graph=True, window_size=window_size,
                           softcap=softcap)
    out, lse = result if return_lse else (result, None)
    if not out.is_contiguous():
        out = out.contiguous()
    if lse is None:
        lse = q.new_empty((0,), dtype=torch.float32)
    return out, lse


def explain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
            softmax_scale: float | None = None, return_lse: bool = False, config: Any = None,
            fallback: str = "error", *, backend: str = "auto", allow_untested_sm100: bool = False,
            arch: str | None = None, device_name: str | None = None,
            window_size: tuple[int, int] | None = None, softcap: float | None = None,
            deterministic: bool | None = None) -> Explanation:
    """Which implementation (per mode: eager, CUDA-graph capture / torch.compile) and which configuration
    `attention` would run on these inputs, and why, with the measured ratio; compiles and launches
    nothing.

    The arguments are those of `attention`; `arch` ("sm90", "sm100") and `device_name` (as torch names
    the GPU, e.g. "NVIDIA H200") ask about another GPU. Inputs that are not on a CUDA device (CPU or meta
    tensors) are explained for the GPU of this machine if it has one our kernels run on, else for the
    architecture and device the tuned database was measured on; the explanation says which it assumed
    and how to name another. Raises what `attention` would raise for the same inputs (pointer alignment
    aside: it is checked per call), except the opt-in of a kernel that never ran on hardware (sm100):
    it explains what runs once opted in and notes that `attention` refuses without it.
    """
    checks.softmax_scale_value(softmax_scale)  # refused here as `attention` refuses it
    assumed = None
    if arch is None and checks.device_reasons(checks.inspect_inputs(q, k, v)):
        arch, device_name, assumed = _assumed_target(device_name)
    # asked about an architecture whose kernel never ran on hardware: explain what would run once
    # opted in, and say that `attention` refuses without the opt-in (rather than raise it here)
    gated = (arch in planning.UNTESTED_ARCHS and not planning.sm100_allowed(allow_untested_sm100)
             and fallback != "sdpa")
    plan = planning.plan(q, k, v, causal, return_lse, config, fallback, allow_untested_sm100 or gated,
                         backend, arch=arch, device_name=device_name, window_size=window_size, softcap=softcap)
    if gated:
        plan.explanation.notes.insert(0, f"fa4.attention raises on {arch} unless allow_untested_sm100=True or "
                                         f"{planning.ALLOW_SM100_ENV}=1 (next note); this explains what runs "
                                         "once opted in")
    if assumed:
        plan.explanation.notes.insert(0, assumed)
    if isinstance(q, torch.Tensor):
        plan.explanation.backward = _backward.choose(q, window=plan.window, softcap=plan.softcap,
                                                     **({"k": k, "causal": causal} if isinstance(k, torch.Tensor) else {}),
                                                     **({"v": v} if isinstance(v, torch.Tensor) else {}),
                                                     deterministic=checks.deterministic_value(deterministic))
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
    db = database()
    # forward families only: a backward knob set's entries ("sm90_bwd") name no architecture to explain for;
    # the (arch, device) with the most entries first (the database's main card), then by name
    counted = Counter((e.arch, e.device) for e in db.entries if e.arch in kernels.ARCHS) if db is not None else {}
    tuned = sorted(counted, key=lambda pair: (-counted[pair], pair))
    if device_name is not None:
        arch = next((a for a, d in tuned if d == device_name), tuned[0][0] if tuned else kernels.ARCHS[0])
        where = f"{arch} on {device_name}"
    else:
        arch, device_name = tuned[0] if tuned else (kernels.ARCHS[0], "unknown device")
        where = f"{arch} on {device_name}, where the tuned database was measured"
    return arch, device_name, (f"the inputs are on no GPU and this machine has none our kernels run on: "
                               f"explained for {where}; {how}. fa4.attention itself runs only on CUDA "
                               "tensors (or with fallback='sdpa')")
