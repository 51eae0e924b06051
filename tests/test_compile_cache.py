"""The one cache of compiled kernels (fa4.compile_cache), on CPU: every family goes through it (in-process
over disk); a real sm90 kernel compiled without a GPU is exported, linked and loaded back as a TVM-FFI
function without the DSL; names, bounds, damaged files, a missing C compiler, concurrent writers and
the runtime's switch; and what is never loaded (a library and its record must be this user's, unwritable by others, in a folder only
this user can write, and the library must hash to what its record says). Launching a loaded kernel
needs a GPU (not tested here)."""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import shutil
import dataclasses
import stat
import subprocess
import types
import warnings
from pathlib import Path

import pytest

import fa4
from fa4 import compile_cache
from fa4.kernels import AttentionProblem, compile_key, default_config, kernel_fingerprint
from fa4.kernels.device import B200, H200
from fa4.state import STATE

PROBLEM = AttentionProblem(1, 256, 256, 8, 2, 64, "fp16", causal=True)


@pytest.fixture(scope="module")
def jit_function():
    """The DSL's compiled function of the default configuration, compiled for sm_90a on CPU."""
    from fa4.kernels import compiling, family

    compiled, _, _, _ = compiling.compile_kernel(family("sm90"), default_config("sm90", PROBLEM), PROBLEM,
                                                 H200, tvm_ffi=True)
    return compiled


@pytest.fixture(autouse=True)
def fresh_warnings():
    fa4.reset_caches(compiled=True)  # one-time warnings and the in-process cache start over in every test
    yield
    fa4.reset_caches(compiled=True)


def _key(**change):
    config = default_config("sm90", PROBLEM)
    parts = dict(key=compile_key(config, PROBLEM, H200), fingerprint=kernel_fingerprint("sm90"))
    parts.update(change)
    return compile_cache.entry_key(parts["key"], parts["fingerprint"])


def _name(**change):
    return compile_cache.entry_name(_key(**change))


def test_the_name_changes_with_everything_the_object_depends_on():
    base = _name()
    config = default_config("sm90", PROBLEM)
    other_config = compile_key(config.replace(tile_n=96), PROBLEM, H200)
    h100_pcie = compile_key(config, PROBLEM, dataclasses.replace(H200, sm_count=114))  # the SM count is compiled in
    assert len({base, _name(key=h100_pcie), _name(fingerprint="0" * 16), _name(key=other_config)}) == 4
    assert base == _name() and base.endswith(compile_cache.SUFFIX)


def test_store_then_load_gives_the_kernels_function(tmp_path, jit_function):
    name = _name()
    path = compile_cache.store(_key(), jit_function, tmp_path)
    assert path == tmp_path / name and path.stat().st_size > 10_000
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    record = json.loads(compile_cache.record_path(path).read_text())
    assert record == {"key": _key(), "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([name, compile_cache.record_path(path).name])
    function = compile_cache.load(_key(), tmp_path)
    assert type(function).__name__ == "Function" and callable(function)
    assert compile_cache.load(_key(fingerprint="other"), tmp_path) is None  # another entry: a miss


def test_a_loaded_kernel_gets_the_direct_launch(tmp_path, jit_function):
    """A kernel from the disk cache is called straight into TVM-FFI by the eager fast path, as a freshly
    compiled one is (on the H200 a cached kernel once fell back to the checked run: +5 us a call)."""
    from fa4.kernels import dsl_internals
    from fa4.kernels import compiling, sm90

    compile_cache.store(_key(), jit_function, tmp_path)
    function = compile_cache.load(_key(), tmp_path)
    config = default_config("sm90", PROBLEM)
    loaded = compiling.CompiledAttention(function, config, PROBLEM, sm90.smem_bytes(config, PROBLEM),
                                         compile_seconds=0.0)
    assert dsl_internals.direct_launcher(loaded) is function


def test_loading_an_entry_does_not_import_the_dsl(tmp_path, jit_function):
    """The entry is a shared library TVM-FFI loads alone: a fresh process's first call of a cached
    kernel must not pay for importing the DSL (~0.4 s, most of that call)."""
    import sys

    compile_cache.store(_key(), jit_function, tmp_path)
    probe = ("import sys; from pathlib import Path; from fa4 import compile_cache; "
             f"f = compile_cache.load({_key()!r}, Path({str(tmp_path)!r})); "
             "print(type(f).__name__, 'cutlass' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["Function", "False"], done.stderr[-2000:]


def test_without_a_c_compiler_nothing_is_stored(tmp_path, jit_function, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.warns(UserWarning, match="no C linker"):
        assert compile_cache.store(_key(), jit_function, tmp_path) is None
    assert list(tmp_path.iterdir()) == []


def test_a_damaged_entry_is_removed_with_a_warning(tmp_path):
    """A library of ours (its record matches) that does not load: removed, with its record."""
    path = tmp_path / _name()
    path.write_bytes(b"\x7fELF but not really")
    _write_record(path, _key())
    with pytest.warns(UserWarning, match="cannot be loaded"):
        assert compile_cache.load(_key(), tmp_path) is None
    assert list(tmp_path.iterdir()) == []


def test_the_bound_removes_the_least_recently_used(tmp_path):
    for i, name in enumerate(("a.o", "b.so", "c.so")):
        path = tmp_path / name
        path.write_bytes(b"x" * 1000)
        compile_cache.record_path(path).write_text("{}")
        os.utime(path, (1000 + i, 1000 + i))
    assert compile_cache.trim(tmp_path, limit=2000) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.json", "b.so", "c.json", "c.so"]
    assert compile_cache.clear(tmp_path) == 2 and list(tmp_path.iterdir()) == []


def _store_in_child(folder: str, key: str) -> None:
    from fa4.kernels import compiling, family

    compiled, _, _, _ = compiling.compile_kernel(family("sm90"), default_config("sm90", PROBLEM), PROBLEM,
                                                 H200, tvm_ffi=True)
    assert compile_cache.store(key, compiled, folder=Path(folder)) is not None


def test_two_processes_storing_one_entry_leave_a_loadable_file(tmp_path):
    ctx = mp.get_context("spawn")
    children = [ctx.Process(target=_store_in_child, args=(str(tmp_path), _key())) for _ in range(2)]
    for child in children:
        child.start()
    for child in children:
        child.join(300)
        assert child.exitcode == 0
    name = _name()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([name, compile_cache.record_path(Path(name)).name])
    assert compile_cache.load(_key(), tmp_path) is not None


def test_the_disk_layer_is_on_by_default_off_by_the_environment(monkeypatch):
    calls = []
    monkeypatch.setattr("fa4.kernels.compile_attention",
                        lambda config, problem, device: calls.append(config) or "plain")
    monkeypatch.setattr(compile_cache, "load", lambda key, folder=None: pytest.fail("the disk was read"))
    monkeypatch.delenv("FA4TUNE_DISK_CACHE", raising=False)
    assert compile_cache.enabled()
    monkeypatch.setenv("FA4TUNE_DISK_CACHE", "0")
    assert not compile_cache.enabled()
    config = default_config("sm90", PROBLEM)
    assert compile_cache.compile_attention(config, PROBLEM, H200) == "plain"
    assert calls == [config]


def test_every_family_goes_through_the_one_cache(monkeypatch, tmp_path):
    """sm90 and sm100 alike: compiled once per key and kept in this process, looked up on disk first
    where the disk layer serves the family (sm90; for sm100, whose kernel never ran, it is a no-op on
    the same path); another device's compiled-in facts make another key."""
    monkeypatch.setenv("FA4TUNE_DISK_CACHE", "1")
    monkeypatch.setenv("FA4TUNE_CACHE_DIR", str(tmp_path))
    compiles, disk = [], []

    def compile_attention(config, problem, device):
        compiles.append((config.arch, device.sm_count))
        return types.SimpleNamespace(compiled=f"compiled {config.arch}")

    monkeypatch.setattr("fa4.kernels.compile_attention", compile_attention)
    monkeypatch.setattr(compile_cache, "load", lambda key, folder=None: disk.append(("load", key)))
    monkeypatch.setattr(compile_cache, "store", lambda key, fn, folder=None: disk.append(("store", key)))
    h20 = dataclasses.replace(H200, name="NVIDIA H20", sm_count=78)
    keys = []
    for arch, device in (("sm90", H200), ("sm100", B200), ("sm90", h20)):
        config = default_config(arch, PROBLEM, device)
        assert compile_cache.cached(config, PROBLEM, device) is None
        first = compile_cache.compile_attention(config, PROBLEM, device)
        assert compile_cache.compile_attention(config, PROBLEM, device) is first   # this process's
        assert compile_cache.cached(config, PROBLEM, device) is first
        keys.append(compile_cache.key_of(config, PROBLEM, device))
    assert compiles == [("sm90", 132), ("sm100", 148), ("sm90", 78)]
    assert disk == [("load", keys[0]), ("store", keys[0]), ("load", keys[2]), ("store", keys[2])]
    assert len(set(keys)) == 3 and len(STATE.compiled) == 3


def test_folder_and_bound_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("FA4TUNE_CACHE_DIR", str(tmp_path / "k"))
    monkeypatch.setenv("FA4TUNE_CACHE_MAX_MB", "3")
    assert compile_cache.cache_dir() == tmp_path / "k" and compile_cache.max_bytes() == 3 * 2**20
    monkeypatch.delenv("FA4TUNE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.cache_dir() == tmp_path / "xdg" / "fa4tune" / "kernels"
    monkeypatch.setenv("FA4TUNE_CACHE_MAX_MB", "lots")
    with pytest.warns(UserWarning, match="not a number"):
        assert compile_cache.max_bytes() == compile_cache.DEFAULT_MAX_MB * 2**20


# --- what is never loaded -----------------------------------------------------------------------------

def _write_record(library: Path, key: str) -> None:
    record = {"key": key, "sha256": hashlib.sha256(library.read_bytes()).hexdigest()}
    compile_cache.record_path(library).write_text(json.dumps(record))


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """(a shared library whose constructor writes a marker file, the marker's path): what someone
    else could put in a cache folder. Loading it runs the constructor."""
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        pytest.skip(f"no C compiler ({cc}) to build the planted library")
    folder = tmp_path_factory.mktemp("planted")
    marker, source, library = folder / "constructor-ran", folder / "planted.c", folder / "planted.so"
    source.write_text('#include <stdio.h>\n__attribute__((constructor)) static void planted(void) {\n'
                      f'  FILE *f = fopen("{marker}", "w"); if (f) {{ fputs("ran", f); fclose(f); }}\n}}\n')
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(library), str(source)], check=True, timeout=60)
    return library, marker


@pytest.fixture
def cached_runtime(tmp_path, monkeypatch, jit_function):
    """compile_cache.compile_attention as the runtime of a new process calls it, on a CPU: the disk
    cache on in tmp_path/kernels, nothing in this process's layer, an H200, and a compile that hands
    back the module's compiled function (and counts its calls)."""
    folder = tmp_path / "kernels"
    monkeypatch.setenv("FA4TUNE_DISK_CACHE", "1")
    monkeypatch.setenv("FA4TUNE_CACHE_DIR", str(folder))
    compiles = []

    def compile_attention(config, problem, device):
        compiles.append(config)
        return types.SimpleNamespace(compiled=jit_function)

    monkeypatch.setattr("fa4.kernels.compile_attention", compile_attention)
    config = default_config("sm90", PROBLEM)

    def call():
        STATE.compiled.clear()  # as in a new process: only the disk has what an earlier one compiled
        return compile_cache.compile_attention(config, PROBLEM, H200)

    return types.SimpleNamespace(folder=folder, compiles=compiles, call=call)


def _stored_library(folder: Path) -> Path:
    [library] = [p for p in compile_cache.entries(folder)]
    return library


def test_the_runtime_loads_what_it_stored(cached_runtime):
    """The baseline of the tests below: a second call loads the stored kernel, no compile."""
    cached_runtime.call()
    loaded = cached_runtime.call()
    assert len(cached_runtime.compiles) == 1 and loaded.compile_seconds == 0.0


def test_a_planted_library_is_never_loaded(cached_runtime, planted):
    """Someone's library under an entry's name (owned by this user, mode 0644, so only its bytes
    differ from the stored one): its constructor never runs; one warning names it, the kernel is
    compiled and stored in its place."""
    library, marker = planted
    cached_runtime.call()
    stored = _stored_library(cached_runtime.folder)
    stored.write_bytes(library.read_bytes())
    with pytest.warns(fa4.Fa4Warning, match=f"cached kernel {stored} does not hash to the SHA-256"):
        cached_runtime.call()
    assert not marker.exists(), "the planted library was loaded: its constructor ran"
    assert len(cached_runtime.compiles) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cached_runtime.call().compile_seconds == 0.0  # the real kernel again, loaded
    assert len(cached_runtime.compiles) == 2 and not marker.exists()


@pytest.mark.parametrize("which", ["library", "record"])
def test_a_file_others_can_write_is_not_loaded(cached_runtime, which):
    cached_runtime.call()
    stored = _stored_library(cached_runtime.folder)
    path = stored if which == "library" else compile_cache.record_path(stored)
    path.chmod(0o664)
    with pytest.warns(fa4.Fa4Warning, match=f"cached kernel {stored} .*writable by group or others"):
        cached_runtime.call()
    assert len(cached_runtime.compiles) == 2
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # stored again, in its place


@pytest.mark.parametrize("unsafe", ["group-writable", "other-writable", "another owner"])
def test_a_folder_others_can_write_is_not_used(cached_runtime, monkeypatch, unsafe):
    """A cache folder someone else owns or can write: nothing is loaded from it or stored in it; one
    warning names it, and every kernel is compiled."""
    cached_runtime.call()
    before = sorted(cached_runtime.folder.iterdir())
    if unsafe == "another owner":
        owner = os.geteuid() + 1
        monkeypatch.setattr(os, "geteuid", lambda: owner)
    else:
        cached_runtime.folder.chmod(0o770 if unsafe == "group-writable" else 0o707)
    with pytest.warns(fa4.Fa4Warning, match=f"kernel cache folder {cached_runtime.folder} "
                                            "(is owned by uid|is writable by group or others)"):
        cached_runtime.call()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning, not one per call
        cached_runtime.call()
    assert len(cached_runtime.compiles) == 3
    assert sorted(cached_runtime.folder.iterdir()) == before  # nothing stored or replaced


def test_the_folder_and_the_parents_it_needs_are_made_private(tmp_path, jit_function):
    folder = tmp_path / "home" / "cache" / "kernels"
    (tmp_path / "home").mkdir(mode=0o755)  # a folder that exists: left as it is
    old_umask = os.umask(0o022)
    try:
        assert compile_cache.store(_key(), jit_function, folder) is not None
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE((tmp_path / "home").stat().st_mode) == 0o755
    assert [stat.S_IMODE(p.stat().st_mode) for p in (folder.parent, folder)] == [0o700, 0o700]


def test_entries_that_fail_a_check_are_not_loaded_and_left_in_place(tmp_path, jit_function, planted):
    """Each check alone: the record missing, for another key, not JSON; the library a symbolic link
    (to a real, matching library), or not a regular file. Each warns once, naming the file."""
    library, marker = planted
    real = compile_cache.store(_key(), jit_function, tmp_path / "real")
    cases = {}
    cases["no record"] = _key(fingerprint="no-record")
    path = tmp_path / compile_cache.entry_name(cases["no record"])
    path.write_bytes(library.read_bytes())
    cases["another key's record"] = _key(fingerprint="other-key")
    path = tmp_path / compile_cache.entry_name(cases["another key's record"])
    path.write_bytes(library.read_bytes())
    _write_record(path, _key())
    cases["a record that is not JSON"] = _key(fingerprint="not-json")
    path = tmp_path / compile_cache.entry_name(cases["a record that is not JSON"])
    path.write_bytes(library.read_bytes())
    compile_cache.record_path(path).write_bytes(b"\xff{")
    cases["a link"] = _key(fingerprint="link")
    path = tmp_path / compile_cache.entry_name(cases["a link"])
    path.symlink_to(real)
    _write_record(real, cases["a link"])  # a record that matches what the link points to
    shutil.copy(compile_cache.record_path(real), compile_cache.record_path(path))
    cases["a fifo"] = _key(fingerprint="fifo")
    path = tmp_path / compile_cache.entry_name(cases["a fifo"])
    os.mkfifo(path)  # reading it would block: never opened for reading
    _write_record(real, cases["a fifo"])
    shutil.copy(compile_cache.record_path(real), compile_cache.record_path(path))
    before = sorted(tmp_path.iterdir())
    for what, key in cases.items():
        path = tmp_path / compile_cache.entry_name(key)
        with pytest.warns(fa4.Fa4Warning, match=f"cached kernel {path} ") as caught:
            assert compile_cache.load(key, tmp_path) is None, what
        assert len(caught) == 1, what
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert compile_cache.load(key, tmp_path) is None, what  # warned once
    assert not marker.exists()
    assert sorted(tmp_path.iterdir()) == before  # not ours to remove: stored over when compiled
