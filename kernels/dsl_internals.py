"""The one place that relies on the CuTe DSL's private objects (`fa4.kernels.dsl_internals`).

It lives with the kernels, the lowest layer, so that the kernels' own compile step (`compiling.py`),
the runtime (`fa4`) and the harness (`fa4tune`) all reach the DSL's internals through it; nothing
else names them (`tests/test_runtime_direct_launch.py::test_the_dsl_internals_are_read_in_one_module`).
It is not part of the kernel fingerprint: it changes how the DSL is asked, not the code it generates
(the target each family compiles for is `archs.py`'s).

0. The DSL's compile target, switched per compile (`dsl_target`).
   Why: the DSL checks arch-specific atoms (wgmma, tcgen05, TMA) against its target at trace time.
   It reads CUTE_DSL_ARCH once and caches it in the DSL singleton's environment manager
   (`BaseDSL._get_dsl().envar`, private attribute `_arch`), so setting the variable alone works only
   for the first compile of a process: one that first compiled for sm_100a would keep tracing for
   sm_100a. Both are set and both restored. `tests/test_families.py::
   test_the_dsl_target_cache_is_where_target_arch_expects_it` fails loudly when an upgrade moves it.

1. The eager fast path's direct launcher (`direct_launcher`).
   Why: an eager call of our kernel would otherwise pass three Python frames of the DSL (its compiled
   function's `__call__`, which checks that it is initialised and converts pointer-address arguments,
   and a generated keyword wrapper that forwards six positionals) before TVM-FFI's C call, about 1-2 us
   of a ~9 us call. What it reads, all private to nvidia-cutlass-dsl 4.8 / apache-tvm-ffi 0.1:
   `CompiledAttention.compiled` (ours), the DSL function's `execution_args.has_pointer_address_arg_specs`,
   `_tvm_ffi_function` and `_kwargs_wrapper`, and the wrapper's bytecode (`dis`). A kernel with a window
   or softcap takes three more positionals (`CompiledAttention.positionals`: 9), the runtime binding them.
   Anything that does not look exactly as expected gives None and the checked `run` stays in use: an
   upgrade can make calls slower, never wrong. `tests/test_runtime_direct_launch.py::
   test_real_sm90_compile_is_accepted` compiles the real sm90 kernel on CPU and fails loudly when this
   module stops recognising the DSL's object (the slowdown would otherwise go unnoticed).

2. Compile reports without source locations (`without_source_locations`).
   Why: a compile report asks for ptxas's remarks (registers, spills, warnings), and the DSL then
   records the Python call site of every MLIR op it builds (a frame walk per op): about half of a
   report's time (sm100 default configuration on CPU: 4.7-5.2 s with, 2.5-2.8 s without; the same
   registers, spills, shared memory and PTX markers). What it replaces: `cutlass.base_dsl.dsl.
   _set_enable_frame_filtering`, which the DSL calls at the start of each compile. If it is gone the
   compile runs as before (slower, never wrong); `tests/test_compile_report_locations.py` fails loudly.

3. The DSL's hardware query answered from a device description (`answer_hardware_info_from`).
   Why: flash-attn-4's static persistent scheduler asks `cutlass.utils.HardwareInfo` (the CUDA driver)
   for the SM count while tracing; `fa4tune sass` compiles that peer's sm100 kernel on a machine with
   no driver, for the device of `fa4.kernels.device` it is compiled for. What it replaces:
   `cutlass.utils.HardwareInfo`, which the peer builds (its arguments unused here) and asks
   `get_device_multiprocessor_count()` and `get_max_active_clusters(cluster_size)`; for the rest of
   the process (the peer's compile runs in a child process of its own). `tests/test_sass.py` fails
   loudly when the DSL's class loses either method.
"""

from __future__ import annotations

import os
from contextlib import contextmanager


@contextmanager
def dsl_target(target: str):
    """Trace and compile for the DSL target `target` ("sm_90a", "sm_100a") inside this block, then
    restore the previous one (environment variable and the DSL's cached copy)."""
    from cutlass.cutlass_dsl import BaseDSL
    envar = BaseDSL._get_dsl().envar
    previous_env = os.environ.get("CUTE_DSL_ARCH")
    previous_cached = envar._arch
    os.environ["CUTE_DSL_ARCH"] = target
    envar.arch = target
    try:
        yield
    finally:
        envar.arch = previous_cached
        if previous_env is None:
            os.environ.pop("CUTE_DSL_ARCH", None)
        else:
            os.environ["CUTE_DSL_ARCH"] = previous_env


def direct_launcher(compiled):
    """The compiled kernel's TVM-FFI function as a plain `tvm_ffi.Function`, or None.

    `CompiledAttention.run` checks only what the signature fixes (LSE given iff the problem returns
    it, head dim, packed GQA ratio), then calls the DSL's compiled-function object, whose Python
    `__call__` checks that it is initialised, converts pointer-address arguments (our kernels take
    none) and, for `TVMFFIJitCompiledFunctionWithKwargs` (what DSL 4.8 returns for our signature),
    calls a generated keyword wrapper that forwards the six positionals to a plain `tvm_ffi.Function`
    (nine for a kernel with a window or softcap: `compiled.positionals`).
    Once `run` has succeeded for a signature, later calls of that signature can enter TVM-FFI's C call
    directly and skip those three Python frames. Anything that does not look exactly like that (other
    DSL or tvm_ffi versions, a wrapper that fills defaults or unpacks arguments) gives None: the
    checked `run` stays in use. The launch keeps `compiled` alive, which owns the execution engine.
    A kernel loaded from the disk cache is already a plain `tvm_ffi.Function` (the same exported C
    function, same arguments) and is its own direct launcher.
    """
    fn = getattr(compiled, "compiled", None)  # CompiledAttention's DSL function (kernels/compiling.py)
    positionals = getattr(compiled, "positionals", 6)
    try:
        import tvm_ffi
    except ImportError:
        return None
    if type(fn) is tvm_ffi.Function and fn.__chandle__() != 0:
        return fn  # loaded from the disk cache (fa4.compile_cache): no DSL Python around the C call
    execution_args = getattr(fn, "execution_args", None)
    if execution_args is None or getattr(execution_args, "has_pointer_address_arg_specs", True):
        return None
    if isinstance(fn, tvm_ffi.Function):  # TVMFFIJitCompiledFunction: positional-only already
        target = fn
    else:
        target = getattr(fn, "_tvm_ffi_function", None)
        if not forwards_positionals(getattr(fn, "_kwargs_wrapper", None), target, tvm_ffi, positionals):
            return None
    if not isinstance(target, tvm_ffi.Function) or target.__chandle__() == 0:
        return None
    if type(target) is tvm_ffi.Function:
        return target
    # a subclass with a Python __call__: the same handle in a plain Function calls straight into C
    try:
        plain = tvm_ffi.convert([target])[0]
    except Exception:
        plain = None
    if type(plain) is tvm_ffi.Function and plain.__chandle__() == target.__chandle__():
        return plain
    import types
    return types.MethodType(tvm_ffi.Function.__call__, target)


def tvm_ffi_function_of(dsl_function):
    """The `tvm_ffi.Function` a DSL compiled function calls, as a callable with no Python in between
    (`benchmarks/bench_overhead.py` times it beside the direct launcher); raises TypeError when this
    DSL's object holds none where DSL 4.8 keeps it."""
    import types

    import tvm_ffi

    if isinstance(dsl_function, tvm_ffi.Function):  # TVMFFIJitCompiledFunction (Python __call__ subclass)
        return types.MethodType(tvm_ffi.Function.__call__, dsl_function)
    target = getattr(dsl_function, "_tvm_ffi_function", None)  # TVMFFIJitCompiledFunctionWithKwargs
    if not isinstance(target, tvm_ffi.Function):
        raise TypeError(f"no tvm_ffi.Function inside {type(dsl_function).__name__}")
    return target


def stand_in_compiled_function(function, arg_names, wrapper=None, pointer_args: bool = False):
    """A DSL compiled-function object (`TVMFFIJitCompiledFunctionWithKwargs`, as DSL 4.8 returns for our
    signature) around the `tvm_ffi.Function` `function`, built without compiling: the layout
    `direct_launcher` reads, for the tests and the CPU benchmark of the fast path
    (`benchmarks/bench_fastpath_cpu.py`). `wrapper`: the keyword wrapper (default: the one tvm_ffi
    generates for `arg_names`); `pointer_args`: whether it claims pointer-address arguments."""
    import types

    from cutlass.cutlass_dsl.tvm_ffi_provider import TVMFFIJitCompiledFunctionWithKwargs
    from tvm_ffi.utils.kwargs_wrapper import make_kwargs_wrapper

    fn = object.__new__(TVMFFIJitCompiledFunctionWithKwargs)
    fn._tvm_ffi_function = function
    fn._kwargs_wrapper = wrapper or make_kwargs_wrapper(function, arg_names=list(arg_names))
    fn.execution_args = types.SimpleNamespace(has_pointer_address_arg_specs=pointer_args)
    return fn


def forwards_positionals(wrapper, target, tvm_ffi, count: int = 6) -> bool:
    """Whether `wrapper` is `def w(a0, ..., a<count-1>): return target(a0, ...)` and nothing more."""
    import dis
    import inspect

    code = getattr(wrapper, "__code__", None)
    if code is None or not isinstance(target, tvm_ffi.Function):
        return False
    if (code.co_argcount != count or code.co_kwonlyargcount or code.co_posonlyargcount
            or code.co_flags & (inspect.CO_VARARGS | inspect.CO_VARKEYWORDS)
            or wrapper.__defaults__ or wrapper.__kwdefaults__ or wrapper.__closure__
            or len(code.co_names) != 1 or wrapper.__globals__.get(code.co_names[0]) is not target):
        return False
    loaded: list[str] = []
    for ins in dis.get_instructions(wrapper):
        if ins.opname.startswith("LOAD_FAST"):  # LOAD_FAST_LOAD_FAST (3.13) loads a pair
            loaded += list(ins.argval) if isinstance(ins.argval, tuple) else [ins.argval]
        elif ins.opname in ("LOAD_CONST", "LOAD_DEREF", "LOAD_ATTR", "BUILD_TUPLE", "BUILD_MAP",
                            "CALL_FUNCTION_EX", "KW_NAMES", "STORE_FAST"):
            return False
    return loaded == list(code.co_varnames[:count])


@contextmanager
def without_source_locations():
    """Compiles inside this block build no source locations, even when ptxas remarks are asked for.
    Yields whether it took effect (False: this DSL has no such hook; compiles run as they would)."""
    try:
        from cutlass.base_dsl import dsl
    except ImportError:
        yield False
        return
    setter = getattr(dsl, "_set_enable_frame_filtering", None)
    if not callable(setter):
        yield False
        return
    dsl._set_enable_frame_filtering = lambda enable: setter(False)
    try:
        yield True
    finally:
        dsl._set_enable_frame_filtering = setter


def answer_hardware_info_from(device) -> None:
    """Make `cutlass.utils.HardwareInfo` answer from `device` (a `fa4.kernels.DeviceDescription`)
    instead of the driver, for the rest of this process."""
    import cutlass.utils

    class DescribedHardware:
        def __init__(self, *args, **kwargs):
            pass

        def get_device_multiprocessor_count(self) -> int:
            return device.sm_count

        def get_max_active_clusters(self, cluster_size: int) -> int:
            return device.sm_count // cluster_size

    cutlass.utils.HardwareInfo = DescribedHardware
