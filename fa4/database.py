"""The best-config database: the fastest validated configuration per problem bucket, as reviewed JSON.

The harness (`fa4tune search`) writes it; the runtime (`fa4.attention`) reads it. It lives here, in the
runtime package, because reading it must not need the harness.

Where: the package ships one as package data (`packaged_path()`, read-only, a copy of the repository's
`results/best_configs.json`); a search writes the user's own in the results directory (`user_path()`,
`$FA4TUNE_HOME` or `~/.cache/fa4tune`); `$FA4_CONFIG_DB` names another. `default_path()` is what the
runtime reads.

File format (schema 1), JSON with sorted keys and two-space indentation:

    {"schema": 1,
     "entries": [ {entry}, ... ]}          # sorted by entry key

One entry (every field is written; `key` is derived and checked on load):

    key                 "sm90|NVIDIA H200|fp16|d128|gqa4|causal|sq1024|sk1024|w8"
    arch                "sm90" | "sm100"
    device              device name as torch reports it ("NVIDIA H200")
    dtype, head_dim, gqa_ratio, causal
    seqlen_q_bucket, seqlen_k_bucket   next power of two of the tuned sequence lengths
    work_bucket         next power of two of batch * heads_kv (how many tile columns fill the SMs)
    problem             the exact AttentionProblem fields the tuning ran on
    config              knob values {name: value} (a complete `fa4.kernels.Config` of `arch`)
    us, tflops          GPU time of the tuned config (CUDA-graph replay, see fa4tune.timing) and rate
    default_us          the heuristic default configuration on the same run, or null
    speedup             {peer_name: peer_us / us} for every peer timed in the run, plus "default"
    max_err             max |out - fp32 reference| of the tuned config
    kernel_fingerprint  `fa4.kernels.source_fingerprint(arch)` when tuned; a different current
                        fingerprint makes the entry stale: reported, never trusted by lookup
    versions            {"torch", "cutlass_dsl", "optuna", "cuda", "flash_attn_4"}
    date                ISO 8601 UTC time of the record
    study, trial        optuna study name and trial number it came from (storage: fa4tune.search)

Writes take an exclusive `fcntl` lock on `<path>.lock`, re-read the file, merge, write a temporary
file in the same directory, fsync it and rename it over the old one: two searches finishing at once
both land, and a reader never sees half a file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

from fa4.files import atomic_write, exclusive_lock

SCHEMA_VERSION = 1
ENV_VAR = "FA4_CONFIG_DB"
HOME_ENV_VAR = "FA4TUNE_HOME"
DEFAULT_FILENAME = "best_configs.json"

__all__ = [
    "SCHEMA_VERSION", "ENV_VAR", "DatabaseError", "Entry", "Lookup", "BestConfigDB",
    "bucket", "entry_key", "default_path", "packaged_path", "user_path", "user_results_dir", "record",
    "stale_entries", "utc_now",
]


class DatabaseError(RuntimeError):
    """The database file exists but cannot be used (not JSON, wrong schema, malformed entry)."""


def bucket(n: int) -> int:
    """The next power of two >= n (1 for n <= 1)."""
    n = int(n)
    if n <= 1:
        return 1
    return 1 << (n - 1).bit_length()


def _work(problem: Any) -> int:
    return int(problem.batch) * int(problem.heads_kv)


def entry_key(arch: str, device_name: str, problem: Any) -> str:
    """The key of the bucket a problem falls into on one device."""
    return _key_from_fields(
        arch, device_name, problem.dtype, int(problem.head_dim), int(problem.gqa_ratio),
        bool(problem.causal), bucket(problem.seqlen_q), bucket(problem.seqlen_k), bucket(_work(problem)))


def _key_from_fields(arch, device, dtype, head_dim, gqa_ratio, causal, sq_b, sk_b, work_b) -> str:
    mask = "causal" if causal else "full"
    return f"{arch}|{device}|{dtype}|d{head_dim}|gqa{gqa_ratio}|{mask}|sq{sq_b}|sk{sk_b}|w{work_b}"


def utc_now() -> str:
    return datetime.now(timezone.utc).replace(microsecond=0).isoformat()


@dataclass(frozen=True)
class Entry:
    """One tuned configuration. Attribute access, or `entry["field"]` like the JSON."""

    arch: str
    device: str
    dtype: str
    head_dim: int
    gqa_ratio: int
    causal: bool
    seqlen_q_bucket: int
    seqlen_k_bucket: int
    work_bucket: int
    problem: dict
    config: dict
    us: float
    tflops: float
    default_us: Optional[float]
    speedup: dict
    max_err: Optional[float]
    kernel_fingerprint: str
    versions: dict = field(default_factory=dict)
    date: str = ""
    study: str = ""
    trial: Optional[int] = None

    @classmethod
    def from_result(cls, *, arch: str, device: str, problem: Any, config: Mapping[str, Any],
                    us: float, tflops: float, default_us: Optional[float],
                    peers_us: Mapping[str, Optional[float]], max_err: Optional[float],
                    kernel_fingerprint: str, versions: Mapping[str, Any], study: str,
                    trial: Optional[int], date: Optional[str] = None) -> "Entry":
        """Build an entry from a measured result; speedups are computed here, one per timed peer."""
        speedup = {name: round(p_us / us, 4) for name, p_us in peers_us.items()
                   if p_us is not None and us > 0}
        if default_us is not None and us > 0:
            speedup["default"] = round(default_us / us, 4)
        return cls(
            arch=arch, device=device, dtype=problem.dtype, head_dim=int(problem.head_dim),
            gqa_ratio=int(problem.gqa_ratio), causal=bool(problem.causal),
            seqlen_q_bucket=bucket(problem.seqlen_q), seqlen_k_bucket=bucket(problem.seqlen_k),
            work_bucket=bucket(_work(problem)), problem=dict(problem.to_dict()), config=dict(config),
            us=float(us), tflops=float(tflops), default_us=default_us, speedup=speedup,
            max_err=max_err, kernel_fingerprint=kernel_fingerprint, versions=dict(versions),
            date=date or utc_now(), study=study, trial=trial)

    @property
    def key(self) -> str:
        return _key_from_fields(self.arch, self.device, self.dtype, self.head_dim, self.gqa_ratio,
                                self.causal, self.seqlen_q_bucket, self.seqlen_k_bucket,
                                self.work_bucket)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["key"] = self.key
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Entry":
        names = {f.name for f in dataclasses.fields(cls)}
        required = {f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
        missing = sorted(required - set(data))
        if missing:
            raise DatabaseError(f"entry {data.get('key', '?')!r} lacks field(s): {', '.join(missing)}")
        unknown = sorted(set(data) - names - {"key"})
        if unknown:
            raise DatabaseError(f"entry {data.get('key', '?')!r} has unknown field(s): {', '.join(unknown)}")
        entry = cls(**{k: v for k, v in data.items() if k in names})
        if "key" in data and data["key"] != entry.key:
            raise DatabaseError(f"entry key {data['key']!r} does not match its fields ({entry.key!r})")
        if not isinstance(entry.config, dict) or not isinstance(entry.us, (int, float)):
            raise DatabaseError(f"entry {entry.key!r}: config must be an object and us a number")
        return entry

    def __getitem__(self, name: str) -> Any:
        if name == "key":
            return self.key
        try:
            return getattr(self, name)
        except AttributeError:
            raise KeyError(name) from None

    def is_stale(self, fingerprint: Optional[str]) -> bool:
        return fingerprint is not None and self.kernel_fingerprint != fingerprint


@dataclass(frozen=True)
class Lookup:
    """The answer of `BestConfigDB.lookup`.

    kind: "exact" (same bucket, same device), "nearest" (closest compatible bucket) or "default"
    (nothing usable: run `fa4.kernels.default_config`). entry: the chosen entry or None. stale: the
    entries that would have been candidates but carry another kernel fingerprint. distance: log2
    distance of the chosen entry over (seqlen_q, seqlen_k, work) buckets (0 for exact).
    """

    kind: str
    entry: Optional[Entry]
    stale: tuple = ()
    distance: float = 0.0


def packaged_path() -> Path:
    """The database shipped with the package (package data, read-only at run time). It is a copy of the
    repository's reviewed `results/best_configs.json` (README, "Refresh the packaged database")."""
    return Path(__file__).resolve().parent / "data" / DEFAULT_FILENAME


def user_results_dir() -> Path:
    """The per-user folder where the harness writes what a run produces: `$FA4TUNE_HOME`, else
    `$XDG_CACHE_HOME/fa4tune`, else `~/.cache/fa4tune` (never inside the installed package)."""
    home = os.environ.get(HOME_ENV_VAR)
    if home:
        return Path(home).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "fa4tune"


def user_path() -> Path:
    """The database `fa4tune search` records into by default."""
    return user_results_dir() / DEFAULT_FILENAME


def default_path() -> Path:
    """The database the runtime reads: `$FA4_CONFIG_DB` when set, else the user's own (`user_path`, which
    a search starts as a copy of the packaged one) when it exists, else the packaged one."""
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env)
    mine = user_path()
    return mine if mine.is_file() else packaged_path()


def _log2_distance(a: Entry, sq_b: int, sk_b: int, work_b: int) -> float:
    return (abs(math.log2(a.seqlen_q_bucket) - math.log2(sq_b))
            + abs(math.log2(a.seqlen_k_bucket) - math.log2(sk_b))
            + abs(math.log2(a.work_bucket) - math.log2(work_b)))


class BestConfigDB:
    """An in-memory view of the database file. Load with `BestConfigDB.load(path)`."""

    def __init__(self, entries: Mapping[str, Entry] | None = None, path: Optional[Path] = None):
        self._entries: dict[str, Entry] = dict(entries or {})
        self.path = path

    # ---- reading ------------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | os.PathLike | None = None) -> "BestConfigDB":
        """Read the file (a missing file is an empty database; a corrupt one raises DatabaseError)."""
        p = Path(path) if path is not None else default_path()
        if not p.exists():
            return cls({}, p)
        try:
            text = p.read_text()
            data = json.loads(text) if text.strip() else {"schema": SCHEMA_VERSION, "entries": []}
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise DatabaseError(f"cannot read best-config database {p}: {exc}") from exc
        return cls(_parse(data, p), p)

    @property
    def entries(self) -> list[Entry]:
        """All entries, sorted by key."""
        return [self._entries[k] for k in sorted(self._entries)]

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Entry]:
        return iter(self.entries)

    def get(self, key: str) -> Optional[Entry]:
        return self._entries.get(key)

    def lookup(self, arch: str, device_name: str, problem: Any,
               fingerprint: Optional[str] = None) -> Lookup:
        """The best known configuration for a problem on a device.

        Exact: same bucket key. Nearest: same arch, dtype, head_dim, gqa_ratio and causal flag,
        entries of the same device preferred, then the minimal log2 distance over (seqlen_q,
        seqlen_k, work) buckets. Entries whose kernel fingerprint differs from `fingerprint` are
        never returned; they are listed in `Lookup.stale`. `fingerprint=None` trusts every entry.
        """
        key = entry_key(arch, device_name, problem)
        sq_b, sk_b, work_b = bucket(problem.seqlen_q), bucket(problem.seqlen_k), bucket(_work(problem))
        compatible = [e for e in self._entries.values()
                      if e.arch == arch and e.dtype == problem.dtype
                      and e.head_dim == int(problem.head_dim) and e.gqa_ratio == int(problem.gqa_ratio)
                      and e.causal == bool(problem.causal)]
        stale = tuple(sorted((e for e in compatible if e.is_stale(fingerprint)), key=lambda e: e.key))
        fresh = [e for e in compatible if not e.is_stale(fingerprint)]
        exact = self._entries.get(key)
        if exact is not None and not exact.is_stale(fingerprint):
            return Lookup("exact", exact, stale, 0.0)
        if not fresh:
            return Lookup("default", None, stale)
        best = min(fresh, key=lambda e: (e.device != device_name,
                                         _log2_distance(e, sq_b, sk_b, work_b), e.key))
        return Lookup("nearest", best, stale, _log2_distance(best, sq_b, sk_b, work_b))

    def stale_entries(self, fingerprints: Mapping[str, str]) -> list[Entry]:
        """Entries whose arch has a current fingerprint in `fingerprints` that differs from theirs."""
        return [e for e in self.entries
                if e.arch in fingerprints and e.kernel_fingerprint != fingerprints[e.arch]]

    # ---- writing ------------------------------------------------------------------------------
    def merge(self, entry: Entry) -> bool:
        """Merge one entry in memory: True when it was stored (new key, faster, or the old one stale)."""
        old = self._entries.get(entry.key)
        if (old is None or old.kernel_fingerprint != entry.kernel_fingerprint
                or entry.us < old.us):
            self._entries[entry.key] = entry
            return True
        return False

    def to_json(self) -> str:
        doc = {"schema": SCHEMA_VERSION, "entries": [e.to_dict() for e in self.entries]}
        return json.dumps(doc, sort_keys=True, indent=2) + "\n"

    def save(self, path: str | os.PathLike | None = None) -> Path:
        """Write the whole database atomically (temp file + rename) under the lock."""
        p = Path(path) if path is not None else (self.path or default_path())
        with _locked(p):
            atomic_write(p, self.to_json())
        return p


def record(entry: Entry, path: str | os.PathLike | None = None) -> bool:
    """Add one entry to the file under the lock, keeping the faster entry per key unless the stored
    one is stale (another kernel fingerprint). Returns True when the file changed."""
    p = Path(path) if path is not None else default_path()
    with _locked(p):
        db = BestConfigDB.load(p)
        changed = db.merge(entry)
        if changed:
            atomic_write(p, db.to_json())
    return changed


def stale_entries(fingerprints: Mapping[str, str], path: str | os.PathLike | None = None) -> list[Entry]:
    return BestConfigDB.load(path).stale_entries(fingerprints)


def _parse(data: Any, path: Path) -> dict[str, Entry]:
    if not isinstance(data, dict) or "entries" not in data:
        raise DatabaseError(f"{path}: not a best-config database (no 'entries')")
    if data.get("schema") != SCHEMA_VERSION:
        raise DatabaseError(f"{path}: schema {data.get('schema')!r}, this fa4 reads schema {SCHEMA_VERSION}")
    if not isinstance(data["entries"], list):
        raise DatabaseError(f"{path}: 'entries' must be a list")
    out: dict[str, Entry] = {}
    for raw in data["entries"]:
        if not isinstance(raw, dict):
            raise DatabaseError(f"{path}: an entry is not an object")
        try:
            entry = Entry.from_dict(raw)
        except TypeError as exc:
            raise DatabaseError(f"{path}: malformed entry: {exc}") from exc
        if entry.key in out:
            raise DatabaseError(f"{path}: key {entry.key!r} appears twice")
        out[entry.key] = entry
    return out


@contextlib.contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(path.with_name(path.name + ".lock")):
        yield
