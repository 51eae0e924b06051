"""The `config=` argument of `fa4.attention`: a `fa4.kernels.Config`, a mapping of knob values over the
heuristic default, or a label as `Config.label()` prints it, turned into a `Config`. The custom op,
whose schema has no Config type, carries it as a label too (`for_op`: the one text form, written once
per traced call and read back once per signature: the runtime caches its decision per signature,
config text included)."""

from __future__ import annotations

from typing import Any, Mapping

from fa4 import checks, config_text, kernels
from fa4.checks import InvalidInputError
from fa4.kernels import AttentionProblem, Config, DeviceDescription


def coerce_config(config: Any, arch: str, problem: AttentionProblem, device: DeviceDescription | None = None) -> Config:
    """A `Config` from the config= argument: a Config; a mapping of knob values (the knobs it does not
    name keep the heuristic default's values; a value may be written as a label prints it, "off"); or
    a label string as `Config.label()` prints it (`fa4.config_text`)."""
    if isinstance(config, Config):
        if config.arch != arch:
            raise InvalidInputError(
                f"config= is an {config.arch} configuration, but the device runs the {arch} kernel")
        return config
    if isinstance(config, str):
        try:
            values = config_text.parse_label(config)
        except ValueError as exc:
            raise InvalidInputError(
                f"config={config!r} is not a configuration label: want name=value pairs as fa4tune and "
                f"fa4.explain print them, e.g. config='tile_n=80 softmax_overlap=off' ({exc})") from None
        if not values:
            raise InvalidInputError("config='' names no knob: give a label such as 'tile_n=80', or None")
        config = values
    if isinstance(config, Mapping):
        try:
            return config_text.with_values(kernels.default_config(arch, problem, device), config)
        except (ValueError, KeyError) as exc:
            raise InvalidInputError(f"config= {dict(config)}: {exc}") from exc
    raise _wrong_type(config)


def forced_config(config: Any, arch: str, problem: AttentionProblem, device: DeviceDescription | None = None) -> Config:
    """config= as the configuration our `arch` kernel runs on `problem` on `device` (None: the family's
    reference device); InvalidInputError when it is malformed, another architecture's, or cannot run
    the problem there (resources, the device's grid limits: `fa4.kernels.feasible`)."""
    cfg = coerce_config(config, arch, problem, device)
    why = kernels.feasible(cfg, problem, device)
    if why:
        raise InvalidInputError(f"config= {cfg.label()} cannot run {problem.label()}: {'; '.join(why)}")
    return cfg


def check_unused(config: Any, arch: str | None, spec: checks.InputSpec, causal: bool, return_lse: bool,
                 device: DeviceDescription | None = None) -> None:
    """InvalidInputError when config= is wrong although our kernel does not run this call (SDPA runs
    instead, or nothing launches): a wrong configuration is a wrong call whatever runs, and the same
    call on a GPU our kernel runs would raise.

    Judged as `forced_config` judges it, for `arch` on `device`, or where the tensors give no
    architecture (CPU tensors, a GPU without a kernel) for every one on its reference device: it must
    fit one of them. On the shape with at
    least one batch, row and key (as `checks.kernel_reasons`), in fp16 where the tensors' dtype has no
    kernel (fp16 and bf16 take the same resources). Where the kernel cannot run the shape at all (a
    head dim it lacks) no configuration can, so the configuration is only read."""
    problem = AttentionProblem(
        batch=max(spec.batch, 1), seqlen_q=max(spec.seqlen_q, 1), seqlen_k=max(spec.seqlen_k, 1),
        heads_q=spec.heads_q, heads_kv=spec.heads_kv, head_dim=spec.head_dim, dtype=spec.dtype or "fp16",
        causal=bool(causal), return_lse=bool(return_lse))
    if arch is not None:
        archs = [arch]
    else:
        archs = [config.arch] if isinstance(config, Config) else list(kernels.ARCHS)
    errors: dict[str, str] = {}
    for candidate in archs:
        on = device if device is not None and device.arch == candidate else None
        try:
            if kernels.family(candidate).can_implement(problem):
                coerce_config(config, candidate, problem, on)
            else:
                forced_config(config, candidate, problem, on)
            return
        except InvalidInputError as exc:
            errors[candidate] = str(exc)
    if len(set(errors.values())) == 1:
        raise InvalidInputError(next(iter(errors.values())))
    raise InvalidInputError("config= fits none of fa4's kernels (the tensors name no GPU architecture, so "
                            "each was asked): " + "; ".join(f"{a}: {why}" for a, why in errors.items()))


def for_op(config: Any) -> str | None:
    """config= as the custom op carries it: None, or a label (a Config's full label, a mapping's pairs,
    a label as given once it reads as one, so a malformed one fails before tracing goes on)."""
    if config is None:
        return None
    if isinstance(config, Config):
        return config.label()
    if isinstance(config, str):
        try:
            config_text.parse_label(config)  # read here to refuse early; the op reads it again
        except ValueError as exc:
            raise InvalidInputError(f"config= {exc}") from exc
        return config
    if isinstance(config, Mapping):
        return config_text.label_of(sorted(config.items()))
    raise _wrong_type(config)


def _wrong_type(config: Any) -> InvalidInputError:
    return InvalidInputError(f"config= must be a fa4.kernels.Config, a dict of knob values or a label "
                             f"string, got {type(config).__name__}")
