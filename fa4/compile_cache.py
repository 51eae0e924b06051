"""On-disk cache of compiled kernels, so that a new process does not compile what an earlier one did.

A compiled sm90 kernel is exported as an object file (host launch code with the cubin inside, the
DSL's ahead-of-time export), linked into a shared library against the DSL's runtime libraries (the
system C compiler, `$CC` or `cc`, with their folders as rpath) and loaded back by TVM-FFI alone as the
same TVM-FFI function the runtime calls. Loading therefore does not import the DSL, which is most of a
fresh process's first call when the kernel is cached (importing `cutlass` takes ~0.4 s; compiling
takes 2-9 s per configuration, linking ~20 ms, loading a few milliseconds). Without a C compiler
nothing is stored (a warning says why) and every process compiles.

The entry name is a hash of everything the object depends on: the compile key (configuration and
what of the problem the code depends on), the SM count compiled into persistent grids, the kernel
source fingerprint, the DSL version and the host machine type. Writes go to a temporary file in the
cache folder and are renamed into place, so concurrent processes never see half a file and the last
writer of an entry wins with an identical one. The folder is bounded (oldest entries removed first).

On by default (`FA4TUNE_DISK_CACHE=0` turns it off): a kernel loaded from disk has been launched on
the H200 and matched the compiled one (tests/gpu/test_compile_cache_gpu.py). `FA4TUNE_CACHE_DIR` names the
folder (default `$XDG_CACHE_HOME/fa4tune/kernels`, else `~/.cache/fa4tune/kernels`), and
`FA4TUNE_CACHE_MAX_MB` its bound (default 2048). `fa4tune cache info|clear` shows or empties it.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import tempfile
import warnings
from importlib import metadata
from pathlib import Path
from typing import Optional

SUFFIX = ".so"
OLD_SUFFIXES = (".o",)  # entries of earlier versions (objects loaded through the DSL): cleared, trimmed
LINK_TIMEOUT_S = 60
DEFAULT_MAX_MB = 2048
CACHED_ARCHS = ("sm90",)  # the families whose compiled objects have a known launch signature


def enabled() -> bool:
    return os.environ.get("FA4TUNE_DISK_CACHE", "1") != "0"


def cache_dir() -> Path:
    if os.environ.get("FA4TUNE_CACHE_DIR"):
        return Path(os.environ["FA4TUNE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fa4tune" / "kernels"


def max_bytes() -> int:
    raw = os.environ.get("FA4TUNE_CACHE_MAX_MB", "")
    try:
        return max(0, int(raw)) * 2**20 if raw else DEFAULT_MAX_MB * 2**20
    except ValueError:
        warnings.warn(f"fa4: FA4TUNE_CACHE_MAX_MB={raw!r} is not a number; using {DEFAULT_MAX_MB}")
        return DEFAULT_MAX_MB * 2**20


def dsl_version() -> str:
    try:
        return metadata.version("nvidia-cutlass-dsl")
    except metadata.PackageNotFoundError:
        return "unknown"


def entry_name(compile_key: tuple, num_sms: int, fingerprint: str, dsl: str) -> str:
    """The file name of one compiled kernel: a hash of everything its object code depends on."""
    text = repr((compile_key, num_sms, fingerprint, dsl, platform.machine()))
    return hashlib.sha256(text.encode()).hexdigest()[:32] + SUFFIX


def function_name(name: str) -> str:
    """The exported TVM-FFI symbol of an entry: unique per entry, so that objects loaded into one
    process never share a symbol."""
    return "fa4_attention_" + name.removesuffix(SUFFIX)


def load(name: str, folder: Optional[Path] = None):
    """The cached TVM-FFI function of `name`, or None. A file that cannot be loaded is removed, with a
    warning, so the next process compiles afresh. Imports TVM-FFI, not the DSL."""
    path = (folder or cache_dir()) / name
    if not path.is_file():
        return None
    try:
        import tvm_ffi

        function = tvm_ffi.load_module(str(path))[function_name(name)]
    except Exception as exc:  # a truncated or foreign file: drop it rather than fail every call
        warnings.warn(f"fa4: cached kernel {path} cannot be loaded ({type(exc).__name__}: {exc}); "
                      f"removed, it will be compiled again")
        path.unlink(missing_ok=True)
        return None
    os.utime(path)  # recently used: the bound removes the least recently used first
    return function


def store(name: str, jit_function, folder: Optional[Path] = None) -> Optional[Path]:
    """Export a DSL-compiled function and link it as the shared library `name`; None (with a warning)
    if the export or the link fails."""
    folder = folder or cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".tmp-") as tmp:
        obj, lib = Path(tmp) / "kernel.o", Path(tmp) / ("kernel" + SUFFIX)
        try:
            jit_function.export_to_c(str(obj), function_name(name))
            _link_shared(obj, lib)
            os.chmod(lib, 0o644)
            os.replace(lib, folder / name)
        except Exception as exc:
            warnings.warn(f"fa4: could not store a compiled kernel in {folder}: {type(exc).__name__}: {exc}")
            return None
    trim(folder)
    return folder / name


def _link_shared(obj: Path, lib: Path) -> None:
    """Link the DSL's exported object into a shared library that needs only the DSL's runtime
    libraries (found by the DSL, which the caller has imported to compile; their folders become the
    rpath, so loading needs no library path)."""
    from cutlass.runtime import find_runtime_libraries

    runtime = [Path(p) for p in find_runtime_libraries(enable_tvm_ffi=True)]
    rpaths = sorted({str(p.parent) for p in runtime})
    command = [os.environ.get("CC") or "cc", "-shared", "-o", str(lib), str(obj),
               *map(str, runtime), *(f"-Wl,-rpath,{d}" for d in rpaths)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=LINK_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"no C linker ({command[0]}: {exc}); set CC to one") from exc
    if done.returncode != 0:
        raise RuntimeError(f"{command[0]} -shared failed: {done.stderr.strip()[-400:]}")


def entries(folder: Optional[Path] = None) -> list[Path]:
    folder = folder or cache_dir()
    if not folder.is_dir():
        return []
    return sorted((p for suffix in (SUFFIX, *OLD_SUFFIXES) for p in folder.glob("*" + suffix)
                   if not p.name.startswith(".")), key=lambda p: p.stat().st_mtime)


def trim(folder: Optional[Path] = None, limit: Optional[int] = None) -> int:
    """Remove the least recently used entries until the folder is within `limit` bytes; how many."""
    limit = max_bytes() if limit is None else limit
    files = entries(folder)
    total = sum(p.stat().st_size for p in files)
    removed = 0
    for path in files:
        if total <= limit:
            break
        total -= path.stat().st_size
        path.unlink(missing_ok=True)
        removed += 1
    return removed


def clear(folder: Optional[Path] = None) -> int:
    files = entries(folder)
    for path in files:
        path.unlink(missing_ok=True)
    return len(files)


def info(folder: Optional[Path] = None) -> dict:
    files = entries(folder)
    return {"folder": str(folder or cache_dir()), "enabled": enabled(), "entries": len(files),
            "bytes": sum(p.stat().st_size for p in files), "max_bytes": max_bytes(),
            "dsl": dsl_version()}


def compile_attention(config, problem):
    """`fa4.kernels.compile_attention`, through the disk cache when it is enabled (sm90 only)."""
    from fa4 import kernels

    if not enabled() or config.arch not in CACHED_ARCHS:
        return kernels.compile_attention(config, problem)
    from fa4.kernels import compiling, sm90

    num_sms = compiling.device_sm_count()
    name = entry_name(kernels.compile_key(config, problem), num_sms,
                      kernels.source_fingerprint(config.arch), dsl_version())
    function = load(name)
    if function is not None:
        return compiling.CompiledAttention(function, config, problem, sm90.smem_bytes(config, problem),
                                           compile_seconds=0.0)
    launcher = kernels.compile_attention(config, problem)
    # CompiledAttention keeps the DSL's compiled function as `_fn` (kernels/compiling.py); the
    # export needs that object, not the wrapper
    store(name, launcher._fn)
    return launcher
