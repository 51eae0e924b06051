"""The `config=` argument of `fa4.attention`: a `fa4.kernels.Config`, a mapping of knob values over the
heuristic default, or a label as `Config.label()` prints it, turned into a `Config`; and its text form
for the custom op, whose schema has no Config type (encoded once per traced call, read back once per
signature: the runtime caches its decision per signature, config text included)."""

from __future__ import annotations

import ast
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
        if config.startswith(_PARTIAL + ";"):  # a mapping that crossed the custom op as a string
            return coerce_config(knobs_from_str(config), arch, problem, device)
        if config_text.looks_like_label(config):
            try:
                values = config_text.parse_label(config)
            except ValueError as exc:
                raise InvalidInputError(f"config= {exc}") from exc
            return coerce_config(values, arch, problem, device)
        if config.split(";")[0] in kernels.ARCHS and ";" in config:  # a Config that crossed the op
            return config_from_str(config, arch)
        raise InvalidInputError(
            f"config={config!r} is not a configuration label: want name=value pairs as fa4tune and "
            f"fa4.explain print them, e.g. config='tile_n=80 softmax_overlap=off'")
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


_PARTIAL = "*"  # arch field of a config string holding knob overrides of the heuristic default


def config_to_str(config: Config | Mapping) -> str:
    """config= as a string (the custom op's schema has no Config type): 'arch;name=repr;...', with
    arch '*' for a mapping of knob overrides."""
    if isinstance(config, Config):
        return ";".join([config.arch] + [f"{n}={v!r}" for n, v in config.items])
    return ";".join([_PARTIAL] + [f"{n}={v!r}" for n, v in sorted(config.items())])


def knobs_from_str(text: str) -> dict:
    values = {}
    for part in text.split(";")[1:]:
        name, _, value = part.partition("=")
        try:
            values[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            raise InvalidInputError(f"config={text!r}: cannot read the value of {name!r} ({value!r}); "
                                    "write the configuration as a label, e.g. 'tile_n=80'") from None
    return values


def config_from_str(text: str, arch: str) -> Config:
    try:
        config = Config.from_dict(text.split(";")[0], knobs_from_str(text))
    except (ValueError, KeyError, TypeError) as exc:
        if isinstance(exc, InvalidInputError):
            raise
        raise InvalidInputError(f"config={text!r}: {exc}") from exc
    if config.arch != arch:
        raise InvalidInputError(f"config= is an {config.arch} configuration, but the device runs the {arch} kernel")
    return config


def for_op(config: Any) -> str | None:
    """config= as the custom op carries it: None, or the text `config_to_str` writes (a label is read
    here, so a malformed one fails before tracing goes on)."""
    if isinstance(config, str) and config_text.looks_like_label(config):
        try:
            config = config_text.parse_label(config)   # crosses the op as a mapping of texts
        except ValueError as exc:
            raise InvalidInputError(f"config= {exc}") from exc
    if isinstance(config, (Config, Mapping)):
        return config_to_str(config)
    if config is not None:
        raise _wrong_type(config)
    return None


def _wrong_type(config: Any) -> InvalidInputError:
    return InvalidInputError(f"config= must be a fa4.kernels.Config, a dict of knob values or a label "
                             f"string, got {type(config).__name__}")
