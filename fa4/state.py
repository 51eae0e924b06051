"""The runtime's process-wide state: cached launches and compiled kernels, the loaded best-config
database, the description of each GPU, one-time warnings, and the functions that read or reset them."""

from __future__ import annotations

import os
import sys
import threading
import warnings
from typing import Any

import torch

from fa4 import kernels
from fa4.kernels import DeviceDescription


class Fa4Warning(UserWarning):
    """Something degraded silently otherwise: a database that cannot be read, stale tunings, SDPA."""


class _State:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.launches: dict[tuple, Any] = {}
        self.last: tuple = (None, None)  # (key, launch) of the latest signature cached
        self.kernel_launches: dict[tuple, Any] = {}  # short key -> kernel launch (see attention)
        self.last_kernel: tuple = (None, None)
        # the in-process layer of the one cache of compiled kernels (`fa4.compile_cache`)
        self.compiled: dict[str, Any] = {}
        self.db_path: str | None = None  # None: fa4.database's default (env var, else packaged file)
        self.db: Any = None
        self.db_loaded = False
        self.db_error: str | None = None
        self.db_broken: frozenset = frozenset()  # (layer, key) of entries that cannot be used
        self.fingerprints: dict[str, str] = {}
        self.devices: dict[int, DeviceDescription] = {}
        self.warned: set[str] = set()
        # (backend, problem label, return_lse) -> why that peer refused a call of this process: auto
        # dispatch passes it over from then on (explain says so)
        self.refused: dict[tuple, str] = {}
        # (backend, problem label, return_lse) of the peers that ran in this process: flash-attn-4
        # has compiled for that problem, so a capture of another signature of it may call it
        self.peers_run: set[tuple] = set()
        self.compiles = 0
        self.slow_calls = 0
        # shape -> how autotune on first use ended for it in this process (`fa4.autotuning`): once each
        self.autotuned: dict[str, str] = {}


STATE = _State()


def warn_once(tag: str, message: str) -> None:
    if tag in STATE.warned:
        return
    STATE.warned.add(tag)
    warnings.warn(message, Fa4Warning, stacklevel=_user_stacklevel())


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _user_stacklevel() -> int:
    """The stacklevel that points a warning at the first caller outside the fa4 package."""
    level, frame = 1, sys._getframe(2)  # frame 2: the caller of warn_once
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        level += 1
        frame = frame.f_back
    return level + 1


def forget_signatures() -> None:
    STATE.launches.clear()
    STATE.last = (None, None)
    STATE.kernel_launches.clear()
    STATE.last_kernel = (None, None)


def use_config_db(path: str | os.PathLike | None) -> None:
    """Use exactly this best-config database file for the rest of the process, no other layer (None:
    the default layers, `fa4.database.default_layers()`: the packaged database, then the user's,
    `$FA4_CONFIG_DB` or the results directory's). Forgets cached choices."""
    with STATE.lock:
        STATE.db_path = None if path is None else os.fspath(path)
        _forget_database()
        forget_signatures()


def _forget_database() -> None:
    """The loaded database and what was read from it; the next lookup loads it again."""
    STATE.db = None
    STATE.db_loaded = False
    STATE.db_error = None
    STATE.db_broken = frozenset()


def reset_caches(compiled: bool = False) -> None:
    """Forget cached decisions, the database and one-time warnings (and compiled kernels if asked)."""
    with STATE.lock:
        forget_signatures()
        _forget_database()
        STATE.fingerprints.clear()
        STATE.warned.clear()
        STATE.refused.clear()
        STATE.autotuned.clear()
        if compiled:
            STATE.compiled.clear()
            STATE.peers_run.clear()
            STATE.compiles = 0
        STATE.slow_calls = 0


def cache_info() -> dict[str, int]:
    """Counters: kernels compiled by this process, compiled kernels cached, signatures cached, and
    calls that took the slow path (first call of a signature, or a misaligned pointer)."""
    return {"compiles": STATE.compiles, "compiled_kernels": len(STATE.compiled),
            "signatures": len(STATE.launches), "slow_calls": STATE.slow_calls}


def database():
    """The loaded database (the default layers, or the one file `use_config_db` named), or None when
    nothing of it can be read. Each layer that cannot be read and each entry that cannot be used is
    warned about once, naming the file or the entry (a warning's tag holds the file's identity, so a
    second broken database in the same process warns too); the rest is used."""
    if STATE.db_loaded:
        return STATE.db
    with STATE.lock:
        if STATE.db_loaded:
            return STATE.db
        from fa4 import database

        try:
            if STATE.db_path is None:
                db = database.BestConfigDB.load_layers()
            else:
                db = database.BestConfigDB.load(STATE.db_path)
                if not os.path.exists(db.path):
                    warn_once(f"db-missing:{db.path}", f"fa4: best-config database {db.path} does not exist; "
                                                        "running heuristic default configurations")
        except Exception as exc:  # a broken database must never break a forward pass
            STATE.db, STATE.db_broken = None, frozenset()
            STATE.db_error = f"{type(exc).__name__}: {exc}"
            warn_once(f"db-error:{_file_identity(STATE.db_path)}",
                       f"fa4: cannot use the best-config database ({STATE.db_error}); running heuristic "
                       "default configurations instead")
            STATE.db_loaded = True
            return None
        for layer, path, error in db.errors:
            warn_once(f"db-error:{_file_identity(path)}",
                       f"fa4: cannot use the {layer} best-config database ({error}); its entries are ignored")
        STATE.db_error = "; ".join(f"{layer}: {error}" for layer, _, error in db.errors) or None
        STATE.db_broken = _broken_entries(db)
        STATE.db = db
        STATE.db_loaded = True
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
        warn_once(f"db-entry:{_file_identity(db.path)}:{layer}:{key}",
                   f"fa4: best-config entry {key} in {where} cannot be used ({'; '.join(problems)}); "
                   "it is skipped")
    return frozenset(unusable)


def fingerprint(arch: str) -> str | None:
    fp = STATE.fingerprints.get(arch)
    if fp is None:
        try:
            fp = kernels.kernel_fingerprint(arch)
        except Exception:  # a family without sources yet: nothing can be trusted
            return None
        STATE.fingerprints[arch] = fp
    return fp


def device_description(device: torch.device) -> DeviceDescription:
    """The description of a CUDA device (its family, name, SM count, shared memory, L2), read once per
    device: what the runtime passes to the kernels' feasibility, defaults and compiles."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    described = STATE.devices.get(index)
    if described is None:
        described = STATE.devices[index] = kernels.device_from_torch(index)
    return described
