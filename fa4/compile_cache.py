"""The one cache of compiled kernels, every family's: this process's (`STATE.compiled`), over the disk's,
so that neither a later call nor a new process compiles what was compiled before.

`compile_attention(config, problem, device)` looks a kernel up by one key (`key_of`: the family's
compile key, which holds the configuration's codegen knobs and what of the problem and of the device
is compiled in, and the kernel fingerprint, our sources and the DSL toolchain), first in this process,
then on disk, and compiles it only when neither has it. The disk layer serves the families of
`DISK_ARCHS`; for the others it is a no-op on the same path (the sm100 kernel has never run, so no
object of it is stored or loaded).

On disk, a compiled kernel is exported as an object file (host launch code with the cubin inside, the
DSL's ahead-of-time export), linked into a shared library against the DSL's runtime libraries (the
system C compiler, `$CC` or `cc`, with their folders as rpath) and loaded back by TVM-FFI alone as the
same TVM-FFI function the runtime calls. Loading therefore does not import the DSL, which is most of a
fresh process's first call when the kernel is cached (importing `cutlass` takes ~0.4 s; compiling
takes 2-9 s per configuration, linking ~20 ms, loading a few milliseconds). Without a C compiler
nothing is stored (a warning says why) and every process compiles.

An entry's key is the text of everything the object depends on: the compile key (configuration, what
of the problem and of the device the code depends on), the kernel fingerprint (our sources and the DSL
toolchain) and the host machine type; its file name is a hash of the key.
Writes go to a temporary folder in the cache folder and are renamed into place, so concurrent
processes never see half a file, and the last writer of an entry wins with an identical one (the link
is deterministic). The folder is bounded (oldest entries removed first).

Loading a shared library runs its code in this process, so a library is loaded only when nothing
but this user can have written it, and only when it is the one written for this key:
- the cache folder is owned by this user and no one else can write it (created 0700, as is every
  parent folder created for it); a folder that fails this is not used at all (one warning; every
  kernel is compiled);
- beside each library `<hash>.so` lies its record `<hash>.json`, written after it: the key it was
  built for and the SHA-256 of its bytes. Both files must be regular files (not links) of this user
  that group and others cannot write, the record's key must be the key looked up, and the library's
  bytes must hash to the recorded digest. A file that fails any of this is never loaded: one warning
  names it, the kernel is compiled, and storing it replaces the file.
Between the hash and the load, only someone who can write the folder (this user) could swap the file.

On by default (`FA4TUNE_DISK_CACHE=0` turns it off): a kernel loaded from disk has been launched on
the H200 and matched the compiled one (tests/gpu/test_compile_cache_gpu.py). `FA4TUNE_CACHE_DIR` names the
folder (default `kernels` in the user cache folder, `fa4.places`: `~/.cache/fa4tune/kernels` on Linux), and
`FA4TUNE_CACHE_MAX_MB` its bound (default 2048). `fa4tune cache info|clear` shows or empties it.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import stat
import subprocess
import tempfile
import warnings
from importlib import metadata
from pathlib import Path
from typing import Optional

from fa4.state import STATE, warn_once

SUFFIX = ".so"
RECORD_SUFFIX = ".json"  # the record beside each library: its key and the hash of its bytes
OLD_SUFFIXES = (".o",)  # entries of earlier versions (objects loaded through the DSL): cleared, trimmed
# Part of every key: entries of versions before records existed (libraries without one) have other
# names, so they are never looked up (the bound and `fa4tune cache clear` remove them)
ENTRY_FORMAT = "so+record"
LINK_TIMEOUT_S = 60
DEFAULT_MAX_MB = 2048
MAX_RECORD_BYTES = 64 * 1024
# The families whose kernels, loaded from disk, have been launched on a GPU and matched the compiled
# ones (tests/gpu/test_compile_cache_gpu.py): the disk layer serves these only.
DISK_ARCHS = ("sm90",)
WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH


def enabled() -> bool:
    return os.environ.get("FA4TUNE_DISK_CACHE", "1") != "0"


def cache_dir() -> Path:
    from fa4.places import kernel_cache_dir

    return kernel_cache_dir()


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


def entry_key(compile_key: tuple, fingerprint: str) -> str:
    """The key of one compiled kernel, in this process and on disk: the text of everything its object
    code depends on (the family's compile key, the kernel fingerprint, the host machine type)."""
    return repr((ENTRY_FORMAT, compile_key, fingerprint, platform.machine()))


def key_of(config, problem, device) -> str:
    """`entry_key` of `config` on `problem` compiled for `device` (a `fa4.kernels.DeviceDescription`)."""
    from fa4 import kernels, state

    return entry_key(kernels.compile_key(config, problem, device), state.fingerprint(config.arch))


def entry_name(key: str) -> str:
    """The file name of the library of `key`."""
    return hashlib.sha256(key.encode()).hexdigest()[:32] + SUFFIX


def record_path(library: Path) -> Path:
    return library.with_suffix(RECORD_SUFFIX)


def function_name(name: str) -> str:
    """The exported TVM-FFI symbol of an entry: unique per entry, so that objects loaded into one
    process never share a symbol."""
    return "fa4_attention_" + name.removesuffix(SUFFIX)


class _Untrusted(Exception):
    """Why a file or folder of the cache must not be used (the message completes "<path> ...")."""


def _check_owned(st: os.stat_result) -> None:
    """Owned by this user and not writable by group or others."""
    if st.st_uid != os.geteuid():
        raise _Untrusted(f"is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})")
    if st.st_mode & WRITABLE_BY_OTHERS:
        raise _Untrusted(f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})")


def _check_folder(folder: Path) -> None:
    try:
        st = os.stat(folder)
    except OSError as exc:
        raise _Untrusted(f"cannot be read ({exc.strerror})") from None
    if not stat.S_ISDIR(st.st_mode):
        raise _Untrusted("is not a folder")
    _check_owned(st)


def _usable_folder(folder: Path, create: bool) -> bool:
    """Whether kernels may be loaded from (and stored in) `folder`; warns once per folder when not.

    With `create`, missing folders are made 0700 (the folder and each missing parent), then checked
    like the folder itself: someone else may have made one first."""
    made = []
    if create:
        missing = [p for p in (folder, *folder.parents) if not os.path.lexists(p)]
        for path in reversed(missing):
            try:
                os.mkdir(path, 0o700)
            except FileExistsError:
                pass
            except OSError as exc:
                warnings.warn(f"fa4: cannot create the kernel cache folder {path} ({exc.strerror}); "
                              "kernels are compiled, not cached")
                return False
        made = missing
    for path in dict.fromkeys((*made, folder)):
        try:
            _check_folder(path)
        except _Untrusted as exc:
            warn_once(f"kernel-cache-folder:{folder}",
                      f"fa4: the kernel cache folder {path} {exc}; nothing is loaded from or stored in "
                      f"{folder} (every kernel is compiled): use a folder only you can write "
                      "(FA4TUNE_CACHE_DIR), or FA4TUNE_DISK_CACHE=0")
            return False
    return True


def _read_owned(path: Path, limit: Optional[int] = None) -> bytes:
    """The bytes of `path`: a regular file (not a link) of this user that no one else can write, at
    most `limit` bytes; `_Untrusted` otherwise. FileNotFoundError when it does not exist."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # NONBLOCK: a FIFO never hangs
    except FileNotFoundError:
        raise
    except OSError as exc:  # ELOOP: a symbolic link
        raise _Untrusted(f"cannot be opened as a regular file ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as file:
        st = os.fstat(file.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise _Untrusted("is not a regular file")
        _check_owned(st)
        if limit is not None and st.st_size > limit:
            raise _Untrusted(f"is {st.st_size} bytes, more than a record can be ({limit})")
        return file.read()


def _check_entry(library: Path, key: str) -> None:
    """`_Untrusted` unless `library` is the one written for `key` (see the module's docstring)."""
    record_file = record_path(library)
    try:
        record = json.loads(_read_owned(record_file, MAX_RECORD_BYTES))
    except FileNotFoundError:
        raise _Untrusted(f"has no record {record_file.name} of what it was built for") from None
    except _Untrusted as exc:
        raise _Untrusted(f"has a record {record_file.name} that {exc}") from None
    except ValueError:  # not JSON, or not UTF-8
        raise _Untrusted(f"has a record {record_file.name} that is not JSON") from None
    if not isinstance(record, dict) or record.get("key") != key:
        raise _Untrusted(f"has a record {record_file.name} for another key than the one looked up")
    if hashlib.sha256(_read_owned(library)).hexdigest() != record.get("sha256"):
        raise _Untrusted(f"does not hash to the SHA-256 its record {record_file.name} holds")


def load(key: str, folder: Optional[Path] = None):
    """The cached TVM-FFI function of `key`, or None (not cached, or not trusted: see the module's
    docstring). A trusted file that cannot be loaded is removed, with a warning, so the next process
    compiles afresh. Imports TVM-FFI, not the DSL."""
    folder = folder or cache_dir()
    name = entry_name(key)
    path = folder / name
    if not os.path.lexists(path) or not _usable_folder(folder, create=False):
        return None
    try:
        _check_entry(path, key)
    except FileNotFoundError:  # removed meanwhile (the bound, or `fa4tune cache clear`)
        return None
    except _Untrusted as exc:
        warn_once(f"kernel-cache-file:{path}", f"fa4: cached kernel {path} {exc}; not loaded, the kernel "
                                               "is compiled (and stored in its place)")
        return None
    try:
        import tvm_ffi

        function = tvm_ffi.load_module(str(path))[function_name(name)]
    except Exception as exc:  # a library of ours that does not load: drop it rather than fail every call
        warnings.warn(f"fa4: cached kernel {path} cannot be loaded ({type(exc).__name__}: {exc}); "
                      f"removed, it will be compiled again")
        _remove(path)
        return None
    os.utime(path)  # recently used: the bound removes the least recently used first
    return function


def store(key: str, jit_function, folder: Optional[Path] = None) -> Optional[Path]:
    """Export a DSL-compiled function and link it as the shared library of `key`, with its record;
    None (with a warning) if the folder cannot be trusted or the export or the link fails."""
    folder = folder or cache_dir()
    if not _usable_folder(folder, create=True):
        return None
    name = entry_name(key)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".tmp-") as tmp:
        obj, lib = Path(tmp) / "kernel.o", Path(tmp) / ("kernel" + SUFFIX)
        record = Path(tmp) / ("kernel" + RECORD_SUFFIX)
        try:
            jit_function.export_to_c(str(obj), function_name(name))
            _link_shared(obj, lib)
            os.chmod(lib, 0o644)
            record.write_text(json.dumps({"key": key, "sha256": hashlib.sha256(lib.read_bytes()).hexdigest()}))
            os.chmod(record, 0o644)
            # the library first: a reader between the two renames finds an old record that does
            # not match, and compiles
            os.replace(lib, folder / name)
            os.replace(record, record_path(folder / name))
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


def _remove(path: Path) -> None:
    """Remove an entry: the file and its record."""
    path.unlink(missing_ok=True)
    record_path(path).unlink(missing_ok=True)


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
        _remove(path)
        removed += 1
    return removed


def clear(folder: Optional[Path] = None) -> int:
    files = entries(folder)
    for path in files:
        _remove(path)
    return len(files)


def info(folder: Optional[Path] = None) -> dict:
    files = entries(folder)
    return {"folder": str(folder or cache_dir()), "enabled": enabled(), "entries": len(files),
            "bytes": sum(p.stat().st_size for p in files), "max_bytes": max_bytes(),
            "dsl": dsl_version()}


def cached(config, problem, device):
    """The kernel of `config` on `problem` for `device` compiled (or loaded) in this process, or None."""
    return STATE.compiled.get(key_of(config, problem, device))


def compile_attention(config, problem, device):
    """The launchable kernel of `config` on `problem` for `device`, from the one cache: this process's,
    else the disk's (the families of `DISK_ARCHS`, when `enabled()`), else compiled now
    (`fa4.kernels.compile_attention`) and kept in both."""
    from fa4 import kernels

    key = key_of(config, problem, device)
    with STATE.lock:
        launcher = STATE.compiled.get(key)
        if launcher is not None:
            return launcher
        disk = enabled() and config.arch in DISK_ARCHS
        launcher = _load_launchable(key, config, problem, device) if disk else None
        if launcher is None:
            launcher = kernels.compile_attention(config, problem, device)
            if disk:
                # the export needs the DSL's compiled function, not the wrapper
                store(key, launcher.compiled)
        STATE.compiled[key] = launcher
    return launcher


def _load_launchable(key: str, config, problem, device):
    """The kernel of `key` from disk, as the launchable a compile gives, or None."""
    function = load(key)
    if function is None:
        return None
    from fa4.kernels import compiling, family

    smem = family(config.arch).resources(config, problem, device)["smem_bytes"]
    return compiling.CompiledAttention(function, config, problem, smem, compile_seconds=0.0)
