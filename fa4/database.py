"""The best-config database: the fastest validated configuration per problem bucket, as reviewed JSON.

The harness (`fa4tune search`) writes it; the runtime (`fa4.attention`) reads it. It lives here, in the
runtime package, because reading it must not need the harness.

Where, in layers (`default_layers()`), later layers winning per key:
1. "packaged": shipped as package data (`packaged_path()`, read-only at run time; the repository's
   one reviewed copy, which GPU runs of the repository update);
2. "user": the user's own, which `fa4tune search` writes (`default_path()`: `$FA4_CONFIG_DB` when set,
   else `user_path()`, `best_configs.json` in `$FA4TUNE_HOME` or the user cache folder, `fa4.places`). It holds only
   what was tuned here.
Per key the latest layer's entry wins, unless it is stale (another kernel fingerprint) and a lower
layer's is current: a stale tuning never hides a current one. `BestConfigDB.load(path)` reads one file
alone (`fa4tune ... --db`, `fa4.use_config_db(path)`); `BestConfigDB.load_layers()` the stack.
`merge_databases` combines files from several machines (`fa4tune db merge`): per key the current
entry beats a stale one, then the faster wins.

Nearest-bucket lookup follows rules a user can check in `fa4.explain`: only entries of the same
device (another GPU model's tuning is reported, never used), at most `max_distance` (log2 bucket
distance, default `DEFAULT_MAX_DISTANCE`, `$FA4_MAX_BUCKET_DISTANCE`), and only a configuration that
beat the heuristic default at its own shape by more than `NEIGHBOUR_MIN_GAIN` (timing noise): where
it did not, the default, which adapts to the shape, is the better guess.

File format (schema 2; schema 1, the same without `backend_us` and `backend_source`, is read too),
JSON with sorted keys and two-space indentation:

    {"schema": 2,
     "entries": [ {entry}, ... ]}          # sorted by entry key

One entry (every field is written; `key` is derived and checked on load):

    key                 "sm90|NVIDIA H200|fp16|d128|gqa4|causal|sq1024|sk1024|w8"; the mask part
                        (`mask_key`) of a problem with a sliding window or softcap adds them:
                        "causal-wl4096-softcap" (a window side: next power of two of its width).
                        A variable-length batch (`fa4.varlen_batch.VarlenProblem`, `fa4tune search
                        --varlen`) has its own kind: "-varlen" closes the mask part and "|t<bucket>"
                        (its total query tokens, next power of two) ends the key:
                        "sm90|NVIDIA H200|bf16|d128|gqa4|causal-varlen|sq4096|sk4096|w128|t16384", its
                        sq and sk the max lengths, w sequences x KV heads (why: `fa4.varlen_batch`)
    arch                the knob set tuned: a forward family, "sm90" | "sm100", or our backward kernel,
                        "sm90_bwd" (`fa4tune search --backward`). So a backward entry has a key of its own
                        beside the forward's ("sm90_bwd|NVIDIA H200|..."), and a lookup of one knob set
                        never returns another's. In a backward entry `us` and `default_us` are the
                        backward alone (dQ, dK, dV from saved O and LSE), `backend_us` "ours" and
                        the peers' backward alone, `max_err` the largest gradient error
    device              device name as torch reports it ("NVIDIA H200")
    dtype, head_dim, gqa_ratio, causal
    seqlen_q_bucket, seqlen_k_bucket   next power of two of the tuned sequence lengths
    work_bucket         next power of two of batch * heads_kv (how many tile columns fill the SMs)
    problem             the exact AttentionProblem fields the tuning ran on
    varlen              only in a varlen batch's entry: {"lengths_q": [...], "lengths_k": [...]}, the
                        lengths of the batch the tuning ran on (its `problem` is the compiled one:
                        batch = sequences, the max lengths, varlen true); "backend_us" there times
                        ours, the peers' varlen kernels and "per_sequence" (`fa4.varlen`)
    config              knob values {name: value} (a complete `fa4.kernels.Config` of `arch`)
    us, tflops          GPU time of the tuned config (CUDA-graph replay, see fa4tune.workers.timing) and rate
    default_us          the heuristic default configuration on the same run, or null
    speedup             {peer_name: peer_us / us} for every peer timed in the run, plus "default"
    max_err             max |out - fp32 reference| of the tuned config
    backend_us          {implementation: GPU us} of every implementation timed at this shape in one run:
                        "ours" (this entry's configuration) and the peers (`fa4.backends`);
                        from the search (`us` and the peers it timed) or a bench (`fa4tune db
                        import-bench`); what `fa4.dispatch` judges the fastest backend from
    backend_source      where backend_us comes from: "search" or "bench <date>"
    kernel_fingerprint  `fa4.kernels.source_fingerprint(arch)` when tuned; a different current
                        fingerprint makes the entry stale: reported, never trusted by lookup
    versions            {"torch", "cutlass_dsl", "optuna", "cuda"} and each peer with a package of its
                        own (`fa4.backends.recorded_versions`: "flash_attn_4")
    date                ISO 8601 UTC time of the record
    study, trial        optuna study name and trial number it came from (storage: fa4tune.searches.runner)

Every entry read is checked (`field_error`): each field of its type and in its range (times finite
and > 0, integers that are not booleans, buckets powers of two), a known arch and dtype, a problem
that is an AttentionProblem, a key that matches the fields. An entry that fails is skipped
(`BestConfigDB.skipped`, and `unusable_entries` with the file named, which the runtime warns about
once each), never looked up; a file that cannot be read at all (not JSON, too deep or too large a
number for the parser, another schema, not a regular file) raises DatabaseError, and in a stack of
layers only that layer is left out.

Writes change a file in one locked step (`update(path, change)`, which `record`, `BestConfigDB.save`,
`fa4tune db merge` and `fa4tune db import-bench` use): take the file's lock, read it, change what it
holds now, and write a temporary file in the same directory, fsync it and rename it over the old one.
Two writers at once both land, and a reader never sees half a file. The lock is an `flock` on the
database file itself (`fa4.files.exclusive_file_lock`), so nothing is left beside it. No writer
writes an entry that fails the check (DatabaseError, nothing written); an entry of the file that
failed it is written back as it was (the user's to fix or remove; a newer fa4's arch survives an older
fa4's write) unless the write stores a new entry of its key.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import hashlib
import json
import math
import os
import stat
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, TypeVar

from fa4.files import atomic_write, exclusive_file_lock

SCHEMA_VERSION = 2
READABLE_SCHEMAS = (1, 2)  # schema 1 lacks backend_us and backend_source, which default to empty
ENV_VAR = "FA4_CONFIG_DB"
MAX_DISTANCE_ENV_VAR = "FA4_MAX_BUCKET_DISTANCE"
DEFAULT_FILENAME = "best_configs.json"
PACKAGED, USER = "packaged", "user"   # layer names, lowest first

# Nearest-bucket limit, in log2 bucket steps summed over (seqlen_q, seqlen_k, batch x KV heads): 2 is
# one doubling of the sequence length (query and key together) or a factor 4 in batch x KV heads.
# Further away a tuning says little: tile and scheduler choices follow the number of tiles per SM.
DEFAULT_MAX_DISTANCE = 2.0
# A neighbour's configuration is used only when it beat the heuristic default at its own shape by
# more than this fraction; below it the difference is timing noise (repeats move by ~1 %).
NEIGHBOUR_MIN_GAIN = 0.01

__all__ = [
    "SCHEMA_VERSION", "ENV_VAR", "DatabaseError", "Entry", "Lookup", "BestConfigDB",
    "bucket", "entry_key", "mask_key", "default_path", "default_layers", "packaged_path", "user_path",
    "user_results_dir", "record", "update", "stale_entries", "utc_now", "merge_databases", "max_distance",
    "entry_problems", "field_error", "Skipped", "PACKAGED", "USER", "DEFAULT_MAX_DISTANCE",
    "NEIGHBOUR_MIN_GAIN",
]

# Ranges of an entry's integers: far past any problem a GPU runs, near enough that a typo or a
# planted value (10**40, -1) is refused rather than looked up.
MAX_HEAD_DIM = 1 << 16      # head_dim and gqa_ratio
MAX_SIZE = 1 << 48          # sequence lengths, batch, heads, their buckets, trial numbers
MAX_NUMBER = 1e300          # magnitude of any number (a time, a rate, a knob value)
MAX_LENGTHS = 1 << 20       # sequences of a varlen entry's batch


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


def entry_key(arch: str, device_name: str, problem: Any, tokens: Optional[int] = None) -> str:
    """The key of the bucket a problem falls into on one device. A varlen problem's key holds its total
    query tokens: `tokens`, else the problem's own (`fa4.varlen_batch.tokens_of`)."""
    return _key_from_fields(
        arch, device_name, problem.dtype, int(problem.head_dim), int(problem.gqa_ratio),
        mask_key(problem.to_dict()), bucket(problem.seqlen_q), bucket(problem.seqlen_k), bucket(_work(problem)),
        _tokens_bucket(problem, tokens))


def _tokens_bucket(problem: Any, tokens: Optional[int] = None) -> Optional[int]:
    from fa4.varlen_batch import tokens_of

    found = tokens_of(problem, tokens)
    return None if found is None else bucket(found)


def mask_key(problem: Mapping[str, Any]) -> str:
    """The mask part of a key, from a problem's fields (`AttentionProblem.to_dict`, an entry's
    `problem`): "causal" or "full", then "-wl<n>" / "-wr<n>" for a sliding window's bounded sides and
    "-softcap" for a softcap. A side's width is bucketed to the next power of two, as the sequence
    lengths are: it sets the key blocks each tile visits (the work per tile, as Sk does without a
    window), and widths of one bucket take the same tiles and schedule, the width being a runtime
    value of one compiled kernel; the cap's value changes neither, so only its presence counts.
    A value head dim of its own (`head_dim_v`, DeepSeek's 192/128) adds "-dv<Dv>": another kernel.
    Entries of one mask key are one kind: lookup and prediction compare within a kind."""
    causal = bool(problem.get("causal", False))
    key = "causal" if causal else "full"
    window = problem.get("window")
    if window is not None:
        left, right = window
        if left >= 0:
            key += f"-wl{bucket(left)}"
        if right >= 0 and not causal:
            key += f"-wr{bucket(right)}"
    if problem.get("softcap") is not None:
        key += "-softcap"
    if problem.get("head_dim_v") is not None:
        key += f"-dv{problem['head_dim_v']}"
    if problem.get("varlen"):   # a variable-length batch: another kind, never compared with dense ones
        key += "-varlen"
    return key


def _key_from_fields(arch, device, dtype, head_dim, gqa_ratio, mask, sq_b, sk_b, work_b, tokens_b=None) -> str:
    key = f"{arch}|{device}|{dtype}|d{head_dim}|gqa{gqa_ratio}|{mask}|sq{sq_b}|sk{sk_b}|w{work_b}"
    return key if tokens_b is None else f"{key}|t{tokens_b}"


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
    backend_us: dict = field(default_factory=dict)
    backend_source: str = ""
    varlen: Optional[dict] = None   # a varlen batch's lengths (module docstring); None: a dense problem

    @classmethod
    def from_result(cls, *, arch: str, device: str, problem: Any, config: Mapping[str, Any],
                    us: float, tflops: float, default_us: Optional[float],
                    peers_us: Mapping[str, Optional[float]], max_err: Optional[float],
                    kernel_fingerprint: str, versions: Mapping[str, Any], study: str,
                    trial: Optional[int], date: Optional[str] = None) -> "Entry":
        """Build an entry from a measured result; speedups are computed here, one per timed peer. A
        `fa4.varlen_batch.VarlenProblem` gives a varlen entry (its lengths beside the compiled problem)."""
        lengths = {name: list(getattr(problem, name)) for name in ("lengths_q", "lengths_k")
                   if getattr(problem, name, None) is not None}
        if lengths:
            problem = problem.base()
        speedup = {name: round(p_us / us, 4) for name, p_us in peers_us.items()
                   if p_us is not None and us > 0}
        timed = {name: float(p_us) for name, p_us in peers_us.items() if p_us is not None}
        if default_us is not None and us > 0:
            speedup["default"] = round(default_us / us, 4)
        return cls(
            arch=arch, device=device, dtype=problem.dtype, head_dim=int(problem.head_dim),
            gqa_ratio=int(problem.gqa_ratio), causal=bool(problem.causal),
            seqlen_q_bucket=bucket(problem.seqlen_q), seqlen_k_bucket=bucket(problem.seqlen_k),
            work_bucket=bucket(_work(problem)), problem=dict(problem.to_dict()), config=dict(config),
            us=float(us), tflops=float(tflops), default_us=default_us, speedup=speedup,
            max_err=max_err, kernel_fingerprint=kernel_fingerprint, versions=dict(versions),
            date=date or utc_now(), study=study, trial=trial,
            backend_us={"ours": float(us), **timed} if timed else {},
            backend_source="search" if timed else "", varlen=lengths or None)

    @property
    def key(self) -> str:
        return _key_from_fields(self.arch, self.device, self.dtype, self.head_dim, self.gqa_ratio,
                                self.mask, self.seqlen_q_bucket, self.seqlen_k_bucket,
                                self.work_bucket, self.tokens_bucket)

    @property
    def tokens_bucket(self) -> Optional[int]:
        """A varlen entry's total query tokens, bucketed; None for a dense entry."""
        return None if self.varlen is None else bucket(sum(self.varlen["lengths_q"]))

    @property
    def mask(self) -> str:
        """The mask part of the key (`mask_key`): the causal flag, and the problem's window and softcap."""
        return mask_key({**self.problem, "causal": self.causal})

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        if out["varlen"] is None:   # a dense entry reads as it did before varlen entries existed
            del out["varlen"]
        out["key"] = self.key
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Entry":
        """The entry of a mapping of its fields (as in the file); DatabaseError naming the first field
        that fails the check (`field_error`)."""
        error = field_error(data)
        if error:
            raise DatabaseError(f"entry {_show(data.get('key', '?'), 300, quote=False)}: {error}")
        return cls(**{k: v for k, v in data.items() if k != "key"})

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

    kind: "exact" (same bucket, same device), "nearest" (closest usable bucket of the same device) or
    "default" (nothing usable: run `fa4.kernels.default_config`). entry: the chosen entry or None.
    stale: the entries that would have been candidates but carry another kernel fingerprint.
    distance: log2 distance of the chosen entry over (seqlen_q, seqlen_k, work) buckets (0 for
    exact). layer: the layer the entry came from. passed_over: why nearer entries were not used
    (another device, too far, lost to the default), one line each, for `fa4.explain`.
    """

    kind: str
    entry: Optional[Entry]
    stale: tuple = ()
    distance: float = 0.0
    layer: Optional[str] = None
    passed_over: tuple = ()


@dataclass(frozen=True)
class Skipped:
    """An entry of a file that failed the check (`field_error`), skipped at load. key: its key, or
    "entry <n>" (its place in the file) when it has none that is text; raw: the entry as in the file
    (written back as it was, see the module docstring)."""

    key: str
    reason: str
    raw: Any
    path: Optional[Path] = None
    layer: Optional[str] = None


def packaged_path() -> Path:
    """The database shipped with the package (package data, read-only at run time). In the repository it
    is the one reviewed copy (docs/search-at-scale.md, "Refresh the packaged database")."""
    return Path(__file__).resolve().parent / "data" / DEFAULT_FILENAME


def user_results_dir() -> Path:
    """The per-user folder where the harness writes what a run produces (`fa4.places.results_dir`:
    `$FA4TUNE_HOME`, else the platform's user cache folder; never inside the installed package)."""
    from fa4.places import results_dir

    return results_dir()


def user_path() -> Path:
    """The database `fa4tune search` records into by default."""
    return user_results_dir() / DEFAULT_FILENAME


def default_path() -> Path:
    """The user's database, the one `fa4tune search` records into: `$FA4_CONFIG_DB` when set, else
    `user_path()`. The runtime reads it over the packaged one (`default_layers`)."""
    env = os.environ.get(ENV_VAR)
    return Path(env) if env else user_path()


def default_layers() -> list[tuple[str, Path]]:
    """[(layer name, path)], lowest first: the packaged database, then the user's (`default_path`)."""
    return [(PACKAGED, packaged_path()), (USER, default_path())]


def max_distance() -> float:
    """The nearest-bucket limit: `$FA4_MAX_BUCKET_DISTANCE` when set (a number >= 0), else
    `DEFAULT_MAX_DISTANCE`. A malformed value raises ValueError naming the variable."""
    text = os.environ.get(MAX_DISTANCE_ENV_VAR, "").strip()
    if not text:
        return DEFAULT_MAX_DISTANCE
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value >= 0:  # also NaN
        raise ValueError(f"${MAX_DISTANCE_ENV_VAR}={text!r}: want a number >= 0 (log2 bucket steps)")
    return value


def _log2_distance(a: Entry, sq_b: int, sk_b: int, work_b: int, tokens_b: Optional[int] = None) -> float:
    tokens = 0.0 if tokens_b is None or a.tokens_bucket is None else abs(math.log2(a.tokens_bucket) - math.log2(tokens_b))
    return (abs(math.log2(a.seqlen_q_bucket) - math.log2(sq_b))
            + abs(math.log2(a.seqlen_k_bucket) - math.log2(sk_b))
            + abs(math.log2(a.work_bucket) - math.log2(work_b)) + tokens)


class BestConfigDB:
    """An in-memory view of one database file (`BestConfigDB.load(path)`) or of a stack of layers
    (`BestConfigDB.load_layers()`). `entries` are the top entry per key; lookup chooses per key the
    highest layer's entry that is current (see the module docstring)."""

    def __init__(self, entries: Mapping[str, Entry] | None = None, path: Optional[Path] = None,
                 layer: Optional[str] = None):
        self._entries: dict[str, Entry] = dict(entries or {})
        self.path = path
        self.layer = layer
        # lower layers' entries under the top one, per key, lowest first (empty for one file)
        self._below: dict[str, list[tuple[Optional[str], Entry]]] = {}
        self._layer_of: dict[str, Optional[str]] = {k: layer for k in self._entries}
        # [(layer name, path, entry count or None, error or None)], lowest first
        self.layers: list[tuple[Optional[str], Optional[Path], Optional[int], Optional[str]]] = (
            [(layer, path, len(self._entries), None)] if path is not None else [])
        self.skipped: list[Skipped] = []   # the entries of the file(s) that failed the check
        # for a database loaded from a file (`load`): its entries as read, and a digest of the bytes
        # read, so that `save` can tell the file changed since and `to_json` which keys were replaced
        self._as_loaded: dict[str, Entry] = {}
        self._loaded_digest: Optional[str] = None

    # ---- reading ------------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | os.PathLike | None = None, layer: Optional[str] = None) -> "BestConfigDB":
        """Read one file (a missing file is an empty database; a corrupt one, or a path that is not a
        regular file, raises DatabaseError). `path=None`: the user's database (`default_path`)."""
        p = Path(path) if path is not None else default_path()
        try:
            mode = p.stat().st_mode
        except FileNotFoundError:
            mode = None
        except (OSError, ValueError) as exc:   # ValueError: a path with a NUL byte
            raise DatabaseError(f"cannot read best-config database {p}: {exc}") from exc
        if mode is not None and not stat.S_ISREG(mode):  # a FIFO would block the reader forever
            raise DatabaseError(f"best-config database {p} is not a regular file")
        try:
            raw = p.read_bytes() if mode is not None else b""
            text = raw.decode("utf-8")
            data = json.loads(text) if text.strip() else {"schema": SCHEMA_VERSION, "entries": []}
        except FileNotFoundError:   # removed since the stat: as missing
            raw, data = b"", {"schema": SCHEMA_VERSION, "entries": []}
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
            # ValueError: not JSON, or an integer of more digits than Python converts;
            # RecursionError: nesting deeper than the parser goes
            raise DatabaseError(f"cannot read best-config database {p}: {type(exc).__name__}: "
                                f"{_show(str(exc), 200, quote=False)}") from None
        entries, skipped = _parse(data, p, layer)
        db = cls(entries, p, layer)
        db.skipped = skipped
        db._as_loaded = dict(entries)
        db._loaded_digest = hashlib.sha256(raw).hexdigest()
        return db

    @classmethod
    def load_layers(cls, layers: Optional[list[tuple[str, Path]]] = None) -> "BestConfigDB":
        """The stack of `layers` ([(name, path)], lowest first; default `default_layers()`). A layer
        that cannot be read is left out and listed in `self.layers` with its error, so a broken user
        database does not hide the packaged one."""
        stacked = cls()
        for name, path in (default_layers() if layers is None else layers):
            try:
                db = cls.load(path, name)
            except DatabaseError as exc:
                stacked.layers.append((name, Path(path), None, str(exc)))
                continue
            stacked.layers.append((name, Path(path), len(db), None))
            stacked.skipped += db.skipped
            for key, entry in db._entries.items():
                if key in stacked._entries:
                    stacked._below.setdefault(key, []).append((stacked._layer_of[key], stacked._entries[key]))
                stacked._entries[key] = entry
                stacked._layer_of[key] = name
        readable = [p for _, p, n, err in stacked.layers if err is None]
        stacked.path = readable[-1] if readable else None
        return stacked

    @property
    def errors(self) -> list[tuple[str, Path, str]]:
        """[(layer, path, error)] of the layers that could not be read."""
        return [(name, path, err) for name, path, _, err in self.layers if err is not None]

    @property
    def entries(self) -> list[Entry]:
        """All entries, sorted by key (the top layer's per key)."""
        return [self._entries[k] for k in sorted(self._entries)]

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Entry]:
        return iter(self.entries)

    def get(self, key: str) -> Optional[Entry]:
        return self._entries.get(key)

    def layer_of(self, key: str) -> Optional[str]:
        """The layer the top entry of `key` comes from."""
        return self._layer_of.get(key)

    def shadowed(self, key: str) -> list[tuple[Optional[str], Entry]]:
        """The lower layers' entries of `key` that the top one hides, lowest first."""
        return list(self._below.get(key, ()))

    def unusable_entries(self, feasible: Optional[Any] = None) -> dict[tuple[Optional[str], str], list[str]]:
        """{(layer, key): reasons} of every entry of every layer that cannot be used at all: skipped at
        load (`skipped`, the reason naming the file) or unusable (`entry_problems`); pass its keys to
        `lookup(broken=...)`."""
        found = {}
        for key in sorted(self._entries):
            for layer, entry in self.shadowed(key) + [(self._layer_of.get(key), self._entries[key])]:
                problems = entry_problems(entry, feasible)
                if problems:
                    found[(layer, key)] = problems
        for s in self.skipped:
            found.setdefault((s.layer, s.key), []).append(f"{s.path}: {s.reason}")
        return found

    def candidate(self, key: str, fingerprint: Optional[str],
                  broken: frozenset = frozenset()) -> Optional[tuple[Optional[str], Entry]]:
        """(layer, entry) lookup uses for `key`: the highest layer's current entry, else the highest
        stale one (reported as stale, never used); entries listed in `broken` ((layer, key)) are
        skipped. None when the key has no entry left."""
        if key not in self._entries:
            return None
        stack = self._below.get(key, []) + [(self._layer_of.get(key), self._entries[key])]
        usable = [(layer, e) for layer, e in stack if (layer, key) not in broken]
        for layer, e in reversed(usable):
            if not e.is_stale(fingerprint):
                return layer, e
        return usable[-1] if usable else None

    def current_entries(self, fingerprint: Optional[str], broken: frozenset = frozenset()) -> list[Entry]:
        """Per key, the entry lookup would use (`candidate`), where it is current (not stale)."""
        found = (self.candidate(key, fingerprint, broken) for key in sorted(self._entries))
        return [entry for hit in found if hit is not None for entry in [hit[1]] if not entry.is_stale(fingerprint)]

    def lookup(self, arch: str, device_name: str, problem: Any, fingerprint: Optional[str] = None, *,
               max_distance: float = math.inf, broken: frozenset = frozenset(),
               tokens: Optional[int] = None) -> Lookup:
        """The best known configuration for a problem on a device.

        Exact: same bucket key. Nearest: the closest bucket (minimal log2 distance over (seqlen_q,
        seqlen_k, work) buckets, ties by key) of the same arch, device, dtype, head_dim, gqa_ratio and
        mask (`mask_key`: causal flag, window, softcap), used only within `max_distance` and when its
        configuration beat the default at
        its own shape by more than `NEIGHBOUR_MIN_GAIN` (`Lookup.passed_over` says why not). Entries of
        other devices are never used. Entries whose kernel fingerprint differs from `fingerprint` are
        never returned; they are listed in `Lookup.stale`. `fingerprint=None` trusts every entry.
        `broken`: (layer, key) of entries the caller found unusable (`entry_problems`).
        A varlen problem (mask "-varlen") meets varlen entries only, the total query tokens (`tokens`,
        else the problem's own) adding a fourth log2 term to the distance.
        """
        key = entry_key(arch, device_name, problem, tokens)
        sq_b, sk_b, work_b = bucket(problem.seqlen_q), bucket(problem.seqlen_k), bucket(_work(problem))
        tokens_b = _tokens_bucket(problem, tokens)
        mask = mask_key(problem.to_dict())
        stale: list[tuple[Optional[str], Entry]] = []
        fresh: list[tuple[Optional[str], Entry]] = []
        for k, top in self._entries.items():
            if not (top.arch == arch and top.dtype == problem.dtype and top.head_dim == int(problem.head_dim)
                    and top.gqa_ratio == int(problem.gqa_ratio) and top.mask == mask):
                continue
            found = self.candidate(k, fingerprint, broken)
            if found is None:
                continue
            (fresh if not found[1].is_stale(fingerprint) else stale).append(found)
        stale_entries = tuple(sorted((e for _, e in stale), key=lambda e: e.key))
        for layer, e in fresh:
            if e.key == key:
                return Lookup("exact", e, stale_entries, 0.0, layer)
        passed: list[str] = []
        others = sorted({e.device for _, e in fresh if e.device != device_name})
        if others:
            passed.append(f"entries tuned on {', '.join(others)} exist for this kind of problem; they are "
                          f"not used on {device_name} (another GPU model)")
        mine = sorted(((_log2_distance(e, sq_b, sk_b, work_b, tokens_b), e.key, layer, e)
                       for layer, e in fresh if e.device == device_name), key=lambda t: t[:2])
        if not mine:
            return Lookup("default", None, stale_entries, passed_over=tuple(passed))
        distance, _, layer, best = mine[0]
        if distance > max_distance:
            passed.append(f"the nearest entry, {best.key}, is {distance:g} log2 bucket steps away, past the "
                          f"limit of {max_distance:g} (${MAX_DISTANCE_ENV_VAR})")
            return Lookup("default", None, stale_entries, passed_over=tuple(passed))
        lost = neighbour_lost_to_default(best)
        if lost:
            passed.append(f"the nearest entry, {best.key}, {lost}: the default, which adapts to the shape, "
                          "is preferred")
            return Lookup("default", None, stale_entries, passed_over=tuple(passed))
        return Lookup("nearest", best, stale_entries, distance, layer, tuple(passed))

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
            self._layer_of[entry.key] = self.layer
            return True
        return False

    def put(self, entry: Entry) -> None:
        """Store `entry` for its key, replacing the one there (in memory; `save` writes)."""
        self._entries[entry.key] = entry
        self._layer_of[entry.key] = self.layer

    def to_json(self) -> str:
        """The file's text: every entry, and the entries skipped at load as they were in the file
        unless this database now holds another entry of their key; sorted by key."""
        rows = [(e.key, e.to_dict()) for e in self.entries]
        rows += [(s.key, s.raw) for s in self.skipped
                 if self._entries.get(s.key) is self._as_loaded.get(s.key)]
        doc = {"schema": SCHEMA_VERSION, "entries": [raw for _, raw in sorted(rows, key=lambda r: r[0])]}
        return json.dumps(doc, sort_keys=True, indent=2) + "\n"

    def checked_json(self) -> str:
        """`to_json`, once every entry passed the check; DatabaseError naming the first that fails."""
        for e in self.entries:
            error = field_error(e.to_dict())
            if error:
                raise DatabaseError(f"entry {_show(e.key, 300, quote=False)}: {error}")
        return self.to_json()

    def save(self, path: str | os.PathLike | None = None) -> Path:
        """Write the whole database atomically (temp file + rename) under the file's lock.

        A database loaded from this file (`load`) is written only if no one changed the file since
        it was read; else DatabaseError and nothing is written, since saving would drop what they
        recorded. `update(path, change)` changes a file in one locked step instead (read, change,
        write). An entry that fails the check (`field_error`) raises DatabaseError, nothing written.
        A stack of layers is a view: saving it would copy every layer's entries into one file, so it
        is refused."""
        if len(self.layers) > 1:
            raise DatabaseError("a stack of database layers cannot be saved: load the one file to change "
                                "(BestConfigDB.load(path)) and save that")
        p = Path(path) if path is not None else (self.path or default_path())
        text = self.checked_json()
        own_file = self._loaded_digest is not None and self.path is not None and _same_file(p, self.path)
        with _locked(p):
            if own_file and _digest_of(p) != self._loaded_digest:
                raise DatabaseError(f"{p} changed since it was loaded (another writer recorded into it): saving "
                                    "would drop that; load it again, or change it with "
                                    "fa4.database.update(path, change)")
            atomic_write(p, text)
        if own_file:
            self._loaded_digest = hashlib.sha256(text.encode()).hexdigest()
        return p


_Result = TypeVar("_Result")


def update(path: str | os.PathLike | None, change: Callable[[BestConfigDB], _Result]) -> _Result:
    """Change one database file in one locked step: take the file's lock, read it, call `change(db)`
    on what it holds now (it changes `db` in memory: `merge`, `put`), write the result atomically if
    it differs, and return what `change` returned. A concurrent writer's entries are never lost.
    `path=None`: the user's database (`default_path`).

    A file that cannot be read raises DatabaseError, and so does an entry `change` stored that fails
    the check (`field_error`); the file is left as it was. Entries of the file that failed the check
    are written back as they were, unless `change` stored another entry of their key. OSError: the
    file cannot be locked or written (a read-only folder, a path under a regular file)."""
    p = Path(path) if path is not None else default_path()
    with _locked(p):
        db = BestConfigDB.load(p)
        before = db.to_json()
        result = change(db)
        text = db.checked_json()
        if text != before:
            atomic_write(p, text)
    return result


def record(entry: Entry, path: str | os.PathLike | None = None) -> bool:
    """Add one entry to the file in one locked step (`update`), keeping the faster entry per key unless
    the stored one is stale (another kernel fingerprint). Returns True when the file changed. An entry
    that fails the check (`field_error`: a NaN or negative time, an unknown arch, ...) raises
    DatabaseError before the file is touched."""
    error = field_error(entry.to_dict())
    if error:
        raise DatabaseError(f"entry {_show(entry.key, 300, quote=False)} not recorded: {error}")
    return update(path, lambda db: db.merge(entry))


def neighbour_lost_to_default(entry: Entry) -> Optional[str]:
    """Why a neighbour's configuration should not be borrowed (it did not beat the heuristic default
    at its own shape by more than `NEIGHBOUR_MIN_GAIN`), or None. Unknown `default_us`: None."""
    if entry.default_us is None or entry.us <= 0:
        return None
    if entry.default_us <= entry.us * (1.0 + NEIGHBOUR_MIN_GAIN):
        return (f"did not beat the default there ({entry.us:.2f} us vs the default's "
                f"{entry.default_us:.2f} us, under {NEIGHBOUR_MIN_GAIN:.0%} apart)")
    return None


def entry_problems(entry: Entry, feasible: Optional[Any] = None) -> list[str]:
    """Why an entry cannot be used at all, whatever the problem: its architecture is unknown, its
    configuration names an unknown knob or a value out of range, or it cannot run the problem it was
    tuned on. Empty: usable. Reads the knob model of `fa4.kernels` and its feasibility (`feasible`:
    another `feasible(config, problem)`, the harness's kernel API)."""
    from fa4 import kernels

    if entry.arch not in kernels.KNOB_SETS:
        return [f"unknown architecture {entry.arch!r} (known: {', '.join(kernels.KNOB_SETS)})"]
    try:
        config = kernels.Config.from_dict(entry.arch, entry.config)
    except (ValueError, KeyError, TypeError) as exc:
        return [f"configuration: {exc}"]
    try:
        problem = kernels.AttentionProblem(**entry.problem)
    except (ValueError, TypeError) as exc:
        return [f"problem: {exc}"]
    return [f"infeasible for the problem it was tuned on: {r}"
            for r in (feasible or kernels.feasible)(config, problem)]


def merge_databases(databases: list["BestConfigDB"], fingerprints: Mapping[str, Optional[str]]) -> "BestConfigDB":
    """One database from several (e.g. tuned on several machines): per key, an entry with the current
    kernel fingerprint of its arch (`fingerprints`; an arch missing or None: every entry counts as
    current) beats a stale one whatever their times, then the faster wins (ties: the earlier
    database). Entries are not checked against each other's devices: the device is in the key."""
    merged = BestConfigDB()
    for db in databases:
        for entry in db.entries:
            old = merged.get(entry.key)
            if old is None or _merge_rank(entry, fingerprints) < _merge_rank(old, fingerprints):
                merged.put(entry)
    return merged


def _merge_rank(entry: Entry, fingerprints: Mapping[str, Optional[str]]) -> tuple[bool, float]:
    return entry.is_stale(fingerprints.get(entry.arch)), entry.us


def stale_entries(fingerprints: Mapping[str, str], path: str | os.PathLike | None = None) -> list[Entry]:
    return BestConfigDB.load(path).stale_entries(fingerprints)


def _parse(data: Any, path: Path, layer: Optional[str]) -> tuple[dict[str, Entry], list[Skipped]]:
    """The entries of a file's JSON, and those that fail the check (skipped); DatabaseError when the
    document as a whole is not a readable database."""
    if not isinstance(data, dict) or "entries" not in data:
        raise DatabaseError(f"{path}: not a best-config database (no 'entries')")
    schema = data.get("schema")
    if isinstance(schema, bool) or schema not in READABLE_SCHEMAS:
        raise DatabaseError(f"{path}: schema {_show(schema)}, this fa4 reads schemas "
                            f"{', '.join(map(str, READABLE_SCHEMAS))}")
    if not isinstance(data["entries"], list):
        raise DatabaseError(f"{path}: 'entries' must be a list")
    if schema == 1 and any(isinstance(e, dict) and ("backend_us" in e or "backend_source" in e)
                           for e in data["entries"]):
        raise DatabaseError(f"{path}: schema 1 has no backend_us or backend_source")
    out: dict[str, Entry] = {}
    skipped: list[Skipped] = []
    for place, raw in enumerate(data["entries"], 1):
        key = raw.get("key") if isinstance(raw, dict) else None
        label = _show(key, 300, quote=False) if isinstance(key, str) else f"entry {place}"
        error = field_error(raw) if isinstance(raw, dict) else "not an object"
        if error is None:
            entry = Entry(**{k: v for k, v in raw.items() if k != "key"})
            if entry.key in out:
                error = "its key appears twice in the file (the first is used)"
        if error is not None:
            skipped.append(Skipped(label, error, raw, path, layer))
            continue
        out[entry.key] = entry
    return out, skipped


def field_error(data: Mapping[str, Any]) -> Optional[str]:
    """Why an entry, given as its fields (as in the file; `key` optional), is malformed, or None: a
    field missing or unknown, a value of the wrong type or out of range (times finite and > 0,
    integers that are not booleans, buckets powers of two), an unknown arch or dtype, a problem that is
    no AttentionProblem, a key that does not match the fields. Every entry read is checked, and every
    entry written."""
    from fa4 import kernels

    fields = {f.name: f for f in dataclasses.fields(Entry)}
    missing = [name for name, f in fields.items() if name not in data
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        return f"lacks field(s): {', '.join(missing)}"
    unknown = [name for name in data if name not in fields and name != "key"]
    if unknown:
        return f"unknown field(s): {', '.join(_show(n, 60, quote=False) for n in unknown)}"
    checks = _field_checks(kernels.KNOB_SETS, kernels.DTYPES)
    for name, value in data.items():
        if name in checks and not checks[name][0](value):
            return f"{name} {_show(value)}: want {checks[name][1]}"
    problem_error = _problem_error(data["problem"], kernels)
    if problem_error:
        return f"problem: {problem_error}"
    if bool(data["problem"].get("causal")) != data["causal"]:
        return f"causal {data['causal']} differs from the problem's ({data['problem'].get('causal')})"
    lengths = data.get("varlen")
    if bool(data["problem"].get("varlen")) != (lengths is not None):
        return ("a varlen problem needs the batch's lengths (varlen), and only a varlen problem has them"
                if lengths is None else "varlen lengths given for a problem that is not varlen")
    if lengths is not None:
        from fa4.varlen_batch import VarlenProblem

        try:
            VarlenProblem(**data["problem"], **lengths)
        except (TypeError, ValueError) as exc:
            return f"varlen: {exc}"
    key = _key_from_fields(data["arch"], data["device"], data["dtype"], data["head_dim"], data["gqa_ratio"],
                           mask_key(data["problem"]), data["seqlen_q_bucket"], data["seqlen_k_bucket"],
                           data["work_bucket"], None if lengths is None else bucket(sum(lengths["lengths_q"])))
    if "key" in data and data["key"] != key:
        return f"key {_show(data['key'], 300)} does not match the entry's fields ({key})"
    return None


def _int_in(low: int, high: int) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and low <= v <= high


def _number(v: Any) -> bool:
    # comparisons, not math.isfinite: they exclude NaN and inf, and an int too large for a float
    # compares exactly instead of raising OverflowError
    return isinstance(v, (int, float)) and not isinstance(v, bool) and -MAX_NUMBER < v < MAX_NUMBER


def _time(v: Any) -> bool:
    return _number(v) and v > 0


def _power_of_two(v: Any) -> bool:
    return _int_in(1, MAX_SIZE)(v) and v & (v - 1) == 0


def _text(v: Any) -> bool:
    return isinstance(v, str)


def _times(v: Any) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) and _time(t) for k, t in v.items())


def _scalar(v: Any) -> bool:
    return v is None or isinstance(v, (str, bool)) or _number(v)


@functools.lru_cache(maxsize=None)
def _field_checks(archs, dtypes) -> dict[str, tuple[Callable[[Any], bool], str]]:
    """{field: (test, what it wants)} for every field of an entry but `problem` (`_problem_error`)."""
    optional_time = (lambda v: v is None or _time(v), "null or a finite number > 0")
    return {
        "arch": (lambda v: v in archs and isinstance(v, str), f"one of {', '.join(archs)}"),
        "device": (lambda v: isinstance(v, str) and v != "", "a device name"),
        "dtype": (lambda v: v in dtypes and isinstance(v, str), f"one of {', '.join(dtypes)}"),
        "head_dim": (_int_in(1, MAX_HEAD_DIM), f"an integer in 1..{MAX_HEAD_DIM}"),
        "gqa_ratio": (_int_in(1, MAX_HEAD_DIM), f"an integer in 1..{MAX_HEAD_DIM}"),
        "causal": (lambda v: isinstance(v, bool), "true or false"),
        "seqlen_q_bucket": (_power_of_two, f"a power of two up to 2**{MAX_SIZE.bit_length() - 1}"),
        "seqlen_k_bucket": (_power_of_two, f"a power of two up to 2**{MAX_SIZE.bit_length() - 1}"),
        "work_bucket": (_power_of_two, f"a power of two up to 2**{MAX_SIZE.bit_length() - 1}"),
        "problem": (lambda v: isinstance(v, dict), "an object of AttentionProblem fields"),
        "config": (lambda v: isinstance(v, dict) and all(isinstance(k, str) and _scalar(x) for k, x in v.items()),
                   "an object of knob names to plain values"),
        "us": (_time, "a finite number > 0 (GPU microseconds)"),
        "tflops": (lambda v: _number(v) and v >= 0, "a finite number >= 0"),
        "default_us": optional_time,
        "speedup": (_times, "an object of names to finite numbers > 0"),
        "max_err": (lambda v: v is None or (_number(v) and v >= 0), "null or a finite number >= 0"),
        "kernel_fingerprint": (_text, "text"),
        "versions": (lambda v: isinstance(v, dict) and all(isinstance(k, str) and (x is None or isinstance(x, str))
                                                             for k, x in v.items()),
                     "an object of names to version text or null"),
        "date": (_text, "text"),
        "study": (_text, "text"),
        "trial": (lambda v: v is None or _int_in(0, MAX_SIZE)(v), f"null or an integer in 0..2**{MAX_SIZE.bit_length() - 1}"),
        "backend_us": (_times, "an object of implementation names to finite numbers > 0 (GPU microseconds)"),
        "backend_source": (_text, "text"),
        "varlen": (lambda v: v is None or (isinstance(v, dict) and set(v) == {"lengths_q", "lengths_k"}
                                           and all(isinstance(x, list) and 0 < len(x) <= MAX_LENGTHS
                                                   and all(_int_in(0, MAX_SIZE)(n) for n in x)
                                                   for x in v.values())),
                   f"null or {{\"lengths_q\": [...], \"lengths_k\": [...]}}, each 1..{MAX_LENGTHS} integers >= 0"),
    }


def _problem_error(problem: dict, kernels) -> Optional[str]:
    """Why an entry's `problem` is not an AttentionProblem of sane sizes, or None."""
    fields = {f.name: f for f in dataclasses.fields(kernels.AttentionProblem)}
    missing = [name for name, f in fields.items() if name not in problem and f.default is dataclasses.MISSING]
    unknown = [name for name in problem if name not in fields]
    if missing or unknown:
        return (f"lacks {', '.join(missing)}" if missing else
                f"unknown field(s) {', '.join(_show(n, 60, quote=False) for n in unknown)}")
    for name, value in problem.items():
        if name == "dtype":
            ok, want = value in kernels.DTYPES and isinstance(value, str), f"one of {', '.join(kernels.DTYPES)}"
        elif name == "window":
            ok = (isinstance(value, list) and len(value) == 2
                  and all(_int_in(-1, MAX_SIZE)(side) for side in value))
            want = "a pair [left, right] of integers >= -1"
        elif name == "softcap":
            ok, want = _time(value), "a finite number > 0"
        elif fields[name].type in (bool, "bool"):
            ok, want = isinstance(value, bool), "true or false"
        else:
            limit = MAX_HEAD_DIM if name in ("head_dim", "head_dim_v") else MAX_SIZE
            ok, want = _int_in(1, limit)(value), f"an integer in 1..{limit}"
        if not ok:
            return f"{name} {_show(value)}: want {want}"
    try:
        kernels.AttentionProblem(**problem)
    except (TypeError, ValueError) as exc:
        return str(exc)
    return None


def _show(value: Any, limit: int = 40, quote: bool = True) -> str:
    """A value for a message, cut to `limit` characters (a planted value can be megabytes)."""
    text = repr(value) if quote else str(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _digest_of(path: Path) -> str:
    """sha256 of the file's bytes (of none when it is missing: it reads as an empty database)."""
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except FileNotFoundError:
        return hashlib.sha256(b"").hexdigest()


def _same_file(a: Path, b: Path) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


@contextlib.contextmanager
def _locked(path: Path):
    """The database file's lock: an `flock` on the file itself (`fa4.files.exclusive_file_lock`), so
    no lock file is left beside it; the folder is created if missing (the user's results folder)."""
    if path.exists() and not path.is_file():
        raise DatabaseError(f"best-config database {path} is not a regular file")
    if path.parent.exists() and not path.parent.is_dir():   # (mkdir would say "File exists")
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(path.parent))
    path.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_file_lock(path):
        yield
