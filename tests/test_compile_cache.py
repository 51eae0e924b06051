"""The on-disk cache of compiled kernels (fa4.compile_cache), on CPU: a real sm90 kernel compiled
without a GPU is exported, linked and loaded back as a TVM-FFI function without the DSL; names,
bounds, damaged files, a missing C compiler, concurrent writers and the runtime's switch. Launching a loaded kernel needs a GPU (not tested here)."""

from __future__ import annotations

import multiprocessing as mp
import os
import stat

import pytest

from fa4 import compile_cache
from fa4.kernels import AttentionProblem, compile_key, default_config, source_fingerprint

PROBLEM = AttentionProblem(1, 256, 256, 8, 2, 64, "fp16", causal=True)


@pytest.fixture(scope="module")
def jit_function():
    """The DSL's compiled function of the default configuration, compiled for sm_90a on CPU."""
    from fa4.kernels import compiling, family

    compiled, _, _, _ = compiling.compile_kernel(family("sm90"), default_config("sm90", PROBLEM), PROBLEM,
                                                 132, tvm_ffi=True)
    return compiled


def _name(**change):
    config = default_config("sm90", PROBLEM)
    parts = dict(key=compile_key(config, PROBLEM), sms=132, fingerprint=source_fingerprint("sm90"),
                 dsl=compile_cache.dsl_version())
    parts.update(change)
    return compile_cache.entry_name(parts["key"], parts["sms"], parts["fingerprint"], parts["dsl"])


def test_the_name_changes_with_everything_the_object_depends_on():
    base = _name()
    other_config = compile_key(default_config("sm90", PROBLEM).replace(tile_n=96), PROBLEM)
    assert len({base, _name(sms=114), _name(fingerprint="0" * 16), _name(dsl="9.9.9"),
                _name(key=other_config)}) == 5
    assert base == _name() and base.endswith(compile_cache.SUFFIX)


def test_store_then_load_gives_the_kernels_function(tmp_path, jit_function):
    name = _name()
    path = compile_cache.store(name, jit_function, tmp_path)
    assert path == tmp_path / name and path.stat().st_size > 10_000
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]  # no leftovers
    function = compile_cache.load(name, tmp_path)
    assert type(function).__name__ == "Function" and callable(function)
    assert compile_cache.load(_name(dsl="other"), tmp_path) is None  # another entry: a miss


def test_a_loaded_kernel_gets_the_direct_launch(tmp_path, jit_function):
    """A kernel from the disk cache is called straight into TVM-FFI by the eager fast path, as a freshly
    compiled one is (on the H200 a cached kernel once fell back to the checked run: +5 us a call)."""
    from fa4 import dsl_internals
    from fa4.kernels import compiling, sm90

    name = _name()
    compile_cache.store(name, jit_function, tmp_path)
    function = compile_cache.load(name, tmp_path)
    config = default_config("sm90", PROBLEM)
    loaded = compiling.CompiledAttention(function, config, PROBLEM, sm90.smem_bytes(config, PROBLEM),
                                         compile_seconds=0.0)
    assert dsl_internals.direct_launcher(loaded) is function


def test_loading_an_entry_does_not_import_the_dsl(tmp_path, jit_function):
    """The entry is a shared library TVM-FFI loads alone: a fresh process's first call of a cached
    kernel must not pay for importing the DSL (~0.4 s, most of that call)."""
    import subprocess
    import sys

    name = _name()
    compile_cache.store(name, jit_function, tmp_path)
    probe = ("import sys; from pathlib import Path; from fa4 import compile_cache; "
             f"f = compile_cache.load({name!r}, Path({str(tmp_path)!r})); "
             "print(type(f).__name__, 'cutlass' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["Function", "False"], done.stderr[-2000:]


def test_without_a_c_compiler_nothing_is_stored(tmp_path, jit_function, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.warns(UserWarning, match="no C linker"):
        assert compile_cache.store(_name(), jit_function, tmp_path) is None
    assert list(tmp_path.iterdir()) == []


def test_a_damaged_entry_is_removed_with_a_warning(tmp_path):
    name = _name()
    (tmp_path / name).write_bytes(b"\x7fELF but not really")
    with pytest.warns(UserWarning, match="cannot be loaded"):
        assert compile_cache.load(name, tmp_path) is None
    assert not (tmp_path / name).exists()


def test_the_bound_removes_the_least_recently_used(tmp_path):
    for i, name in enumerate(("a.o", "b.o", "c.o")):
        path = tmp_path / name
        path.write_bytes(b"x" * 1000)
        os.utime(path, (1000 + i, 1000 + i))
    assert compile_cache.trim(tmp_path, limit=2000) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.o", "c.o"]
    assert compile_cache.clear(tmp_path) == 2 and compile_cache.entries(tmp_path) == []


def _store_in_child(folder: str, name: str) -> None:
    from fa4.kernels import compiling, family

    compiled, _, _, _ = compiling.compile_kernel(family("sm90"), default_config("sm90", PROBLEM), PROBLEM,
                                                 132, tvm_ffi=True)
    assert compile_cache.store(name, compiled, folder=__import__("pathlib").Path(folder)) is not None


def test_two_processes_storing_one_entry_leave_a_loadable_file(tmp_path):
    name = _name()
    ctx = mp.get_context("spawn")
    children = [ctx.Process(target=_store_in_child, args=(str(tmp_path), name)) for _ in range(2)]
    for child in children:
        child.start()
    for child in children:
        child.join(300)
        assert child.exitcode == 0
    assert [p.name for p in tmp_path.iterdir()] == [name]
    assert compile_cache.load(name, tmp_path) is not None


def test_on_by_default_off_by_the_environment_and_only_for_sm90(monkeypatch):
    calls = []
    monkeypatch.setattr("fa4.kernels.compile_attention", lambda config, problem: calls.append(config) or "plain")
    monkeypatch.delenv("FA4TUNE_DISK_CACHE", raising=False)
    assert compile_cache.enabled()
    monkeypatch.setenv("FA4TUNE_DISK_CACHE", "0")
    assert not compile_cache.enabled()
    config = default_config("sm90", PROBLEM)
    assert compile_cache.compile_attention(config, PROBLEM) == "plain"
    monkeypatch.setenv("FA4TUNE_DISK_CACHE", "1")
    sm100 = default_config("sm100", PROBLEM)
    assert compile_cache.compile_attention(sm100, PROBLEM) == "plain"  # sm100 is never cached
    assert calls == [config, sm100]


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
