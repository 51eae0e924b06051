"""Every tunable knob of our attention kernels, declared once.

A knob is a name, its allowed values, a default, one line of meaning, whether it changes the generated
code, and the architectures it applies to. Everything else derives from this table: the search space
(`search_spaces/*.toml` may only narrow the choices), validation of a configuration, the compile key,
the database columns and the report axes. Nothing here knows about budgets: feasibility is a separate
function (`fa4.kernels.feasible`) because it depends on the problem too.

A knob belongs to knob sets (its `archs`): a forward family's architecture ("sm90", "sm100"), or a
backward kernel's key (`BACKWARD_KERNELS`: "sm90_bwd", our sm90 backward, `fa4.kernels.sm90_bwd`).
A backward kernel is another kernel with its own knobs, so it is one more key of the same table, and
`Config`, `knobs_for`, the search-space files and the labels serve it unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Union

from .archs import ARCHS  # the registry of families  # noqa: F401  (re-exported)

Scalar = Union[bool, int, float, str]  # optuna categoricals must be plain scalars


@dataclass(frozen=True)
class Knob:
    name: str
    choices: tuple[Scalar, ...]
    default: Scalar
    meaning: str
    codegen: bool
    archs: tuple[str, ...]

    def __post_init__(self) -> None:
        if self.default not in self.choices:
            raise ValueError(f"knob {self.name}: default {self.default!r} not in {self.choices}")
        unknown = set(self.archs) - set(KNOB_SETS)
        if unknown:
            raise ValueError(f"knob {self.name}: unknown architectures {sorted(unknown)}")


# the backward kernels' knob sets, beside the forward families' (ARCHS)
BACKWARD_KERNELS = ("sm90_bwd",)
KNOB_SETS = ARCHS + BACKWARD_KERNELS

SM90 = ("sm90",)
SM100 = ("sm100",)
BOTH = ARCHS
SM90_BWD = ("sm90_bwd",)

# Order matters only for display: it is the column order of tables and reports.
KNOBS: tuple[Knob, ...] = (
    # --- tiles ----------------------------------------------------------------------------------
    Knob("tile_m", (64, 128, 192), 128,
         "query rows per CTA tile; 64 rows per consumer warpgroup, so it sets the warpgroup count",
         codegen=True, archs=SM90),
    Knob("tile_m", (128,), 128,
         "query rows per Q stage (one tcgen05 MMA of M=128; two Q stages make a 256-row CTA)",
         codegen=True, archs=SM100),
    Knob("tile_n", (64, 80, 96, 112, 128, 144, 160, 176, 192), 128,
         "key/value rows per inner-loop block (the N of S = Q K^T)",
         codegen=True, archs=SM90),
    Knob("tile_n", (64, 128), 128,
         "key/value rows per block (BLK_N); S/P needs tile_n TMEM columns per buffer and a softmax "
         "thread holds a tile_n-column row in registers (160 compiles clean at softmax_regs=200 "
         "in the sm100 register measurements but is not offered until the feasibility model is calibrated for it)",
         codegen=True, archs=SM100),
    # --- pipelines ------------------------------------------------------------------------------
    Knob("kv_stages", (2, 3, 4), 2,
         "depth of the shared-memory ring of K and V tiles filled by TMA",
         codegen=True, archs=BOTH),
    Knob("q_stages", (1, 2), 1,
         "Q tiles in flight per CTA: 2 lets a persistent CTA load the next tile's Q during this one",
         codegen=True, archs=SM90),
    Knob("q_stages", (1, 2), 2,
         "Q stages (128-row tiles) per CTA, one softmax warpgroup each (1: the second softmax "
         "warpgroup idles with its registers given back; rows are not split)",
         codegen=True, archs=SM100),
    Knob("tmem_stages", (1, 2, 3), 2,
         "depth of the S/P ring in TMEM (tile_n columns each); the MMA warp runs tmem_stages-1 "
         "score MMAs ahead of the value MMA",
         codegen=True, archs=SM100),
    # --- softmax --------------------------------------------------------------------------------
    Knob("rescale_threshold", (0.0, 4.0, 8.0, 12.0), 8.0,
         "log2 headroom before the running max basis is raised and O rescaled (0: whenever it moves)",
         codegen=True, archs=BOTH),
    Knob("rescale_tile", (8, 16, 32, 64), 16,
         "O columns per TMEM -> register -> TMEM round trip of the correction warpgroup",
         codegen=True, archs=SM100),
    Knob("softmax_overlap", (False, True), True,
         "issue the next block's S = Q K^T before finishing this block's softmax (intra-warpgroup overlap)",
         codegen=True, archs=SM90),
    Knob("pv_operand", ("rs", "ss"), "rs",
         "where the value MMA reads P: registers (rs) or shared memory (ss)",
         codegen=True, archs=SM90),
    Knob("exp2_poly_columns", (0, 2, 4), 0,
         "of every 32 exps of a softmax row, how many come from a degree-3 FMA polynomial instead "
         "of MUFU.EX2 (the exp unit bounds a head-dim-64 block; the FMA pipe has some room)",
         codegen=True, archs=SM90),
    Knob("exp2_poly_columns", (0, 4, 8), 4,
         "of every 32 keys of a softmax row, how many get exp2 from a degree-3 FMA polynomial "
         "(packed FFMA2) instead of MUFU.EX2: moves work from the exp unit to the FMA pipe",
         codegen=True, archs=SM100),
    # --- work distribution ----------------------------------------------------------------------
    Knob("scheduler", ("single", "single_lpt", "static", "lpt"), "single",
         "tile scheduler: one CTA per tile (m ascending, or longest first on a 1-D grid that the "
         "hardware hands out greedily), static persistent (grid = SMs), or persistent longest-first",
         codegen=True, archs=SM90),
    Knob("scheduler", ("single", "static", "lpt"), "single",
         "tile scheduler: one CTA per tile, static persistent (grid = SMs), or persistent longest-first",
         codegen=True, archs=SM100),
    Knob("pack_gqa", (False, True), True,
         "pack the Hq/Hkv query heads sharing a KV head into one Q tile (K/V loaded once for all)",
         codegen=True, archs=BOTH),
    Knob("two_cta", (False, True), False,
         "cluster pair (tcgen05 cta_group::2): one M=256 MMA for both CTAs' Q tiles, each CTA loading "
         "half of every K/V tile (halves K/V shared-memory reads per CTA); non-causal only",
         codegen=True, archs=SM100),
    # --- registers ------------------------------------------------------------------------------
    Knob("softmax_regs", (176, 184, 192, 200), 192,
         "setmaxnreg for the softmax warpgroups; correction and the load/MMA/store warps get the rest",
         codegen=True, archs=SM100),
    # --- the sm90 backward (fa4.kernels.sm90_bwd) -------------------------------------------------
    Knob("tile_m", (64, 80, 128), 64,
         "query rows per block of the backward's inner loop (the M of S = Q K^T, the K of dV and dK; "
         "80, not a multiple of a wgmma's 64-row M, only as an N: with sdp_swap, and dQ^T = K^T dS^T)",
         codegen=True, archs=SM90_BWD),
    Knob("tile_n", (64, 128), 128,
         "key rows per backward CTA: the K and V block it loads once and whose dK and dV it "
         "accumulates in registers",
         codegen=True, archs=SM90_BWD),
    Knob("q_stages", (1, 2), 2,
         "depth of the shared-memory ring of Q and dO tiles the backward's producer warp fills by TMA",
         codegen=True, archs=SM90_BWD),
    Knob("dq_accum", ("atomic", "bulk", "fragment", "fragment_atomic"), "atomic",
         "how each block's dQ = dS K reaches the fp32 dQ accumulator in global memory: atomic = one "
         "red.global.add.f32 per element from the MMA warpgroups; bulk = an fp32 shared-memory tile "
         "that a producer warp adds with one TMA reduce-add; fragment = the same, the tile and the "
         "accumulator in the MMA fragment's own order (128-bit shared-memory stores; the postprocess "
         "puts each element back in its row); fragment_atomic = that accumulator, added into by the "
         "MMA warpgroups from registers, one red.global.add.v4.f32 per 4 values (no shared-memory "
         "tile: neither its bytes nor its writes and reads)",
         codegen=True, archs=SM90_BWD),
    Knob("sdp_swap", (False, True), False,
         "compute S^T = K Q^T and dP^T = V dO^T (keys as the wgmma's M, tile_n = 128): P^T and dS^T "
         "feed dV and dK from registers (no P in shared memory), exp2 runs under dP's wgmma, dQ is "
         "added under dK's",
         codegen=True, archs=SM90_BWD),
    Knob("scheduler", ("single", "single_lpt", "sectioned_lpt"), "single",
         "order of the backward's CTAs (one per key block, KV head, batch) on the grid the hardware "
         "hands out greedily: key blocks fastest (single), or key block outermost, the longest first "
         "(single_lpt: under causal, key block 0 sees the most query blocks), or that within "
         "sections of GQA groups whose Q, dO and dQ rows fit a byte budget (sectioned_lpt: "
         "longest first's balance, the plain order's L2 reuse across sections)",
         codegen=True, archs=SM90_BWD),
    Knob("pds_stages", (1, 2), 1,
         "P / dS shared-memory buffers: 2 lets a block write its P and dS while the previous block's "
         "are still read, one named barrier a block fewer",
         codegen=True, archs=SM90_BWD),
    Knob("group_split", (1, 2, 4, 8), 1,
         "CTAs that share one (key block, KV head) of the backward: 1 walks the whole GQA group in one "
         "CTA and stores dK and dV once in 16 bits; n splits the group's query heads over n CTAs (more "
         "CTAs for short or few-head problems), each adding its partial dK and dV to fp32 accumulators "
         "by TMA reduce-add, which a postprocess converts",
         codegen=True, archs=SM90_BWD),
)


def knobs_for(arch: str) -> tuple[Knob, ...]:
    """The knobs of one knob set (an architecture's forward, or a backward kernel), in declaration order."""
    if arch not in KNOB_SETS:
        raise ValueError(f"unknown architecture {arch!r}; known: {', '.join(KNOB_SETS)}")
    return tuple(k for k in KNOBS if arch in k.archs)


def knob(arch: str, name: str) -> Knob:
    for k in knobs_for(arch):
        if k.name == name:
            return k
    names = ", ".join(k.name for k in knobs_for(arch))
    raise KeyError(f"unknown knob {name!r} for {arch}; known: {names}")


def _check_declarations() -> None:
    for arch in KNOB_SETS:
        names = [k.name for k in knobs_for(arch)]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"knobs declared twice for {arch}: {sorted(dup)}")


_check_declarations()


@dataclass(frozen=True)
class Config:
    """A complete, validated assignment of every knob of one architecture.

    Immutable and hashable. Build with `Config.make(arch, **overrides)` (defaults fill the rest) or
    `Config.from_dict(arch, mapping)` (every knob must be present). Unknown names or values raise.
    """

    arch: str
    items: tuple[tuple[str, Scalar], ...]

    def __post_init__(self) -> None:
        declared = knobs_for(self.arch)
        given = dict(self.items)
        if len(given) != len(self.items):
            raise ValueError("a knob is given twice")
        missing = [k.name for k in declared if k.name not in given]
        unknown = sorted(set(given) - {k.name for k in declared})
        if unknown:
            raise ValueError(f"unknown knob(s) for {self.arch}: {', '.join(unknown)}")
        if missing:
            raise ValueError(f"missing knob(s) for {self.arch}: {', '.join(missing)}")
        for k in declared:
            value = given[k.name]
            if not _in_choices(value, k.choices):
                raise ValueError(
                    f"{self.arch} knob {k.name}={value!r} is not one of {list(k.choices)}")
        # canonical order and canonical types (e.g. 8 -> 8.0 for a float knob)
        canon = tuple((k.name, _canonical(given[k.name], k.choices)) for k in declared)
        object.__setattr__(self, "items", canon)

    @classmethod
    def make(cls, arch: str, **overrides: Scalar) -> "Config":
        values = {k.name: k.default for k in knobs_for(arch)}
        values.update(overrides)
        return cls(arch, tuple(values.items()))

    @classmethod
    def from_dict(cls, arch: str, values: Mapping[str, Any]) -> "Config":
        return cls(arch, tuple(values.items()))

    def replace(self, **overrides: Scalar) -> "Config":
        values = dict(self.items)
        unknown = sorted(set(overrides) - set(values))
        if unknown:
            raise ValueError(f"unknown knob(s) for {self.arch}: {', '.join(unknown)}")
        values.update(overrides)
        return Config(self.arch, tuple(values.items()))

    def to_dict(self) -> dict[str, Scalar]:
        return dict(self.items)

    def __getattr__(self, name: str) -> Scalar:
        # only called when normal lookup fails, i.e. for knob names
        if name.startswith("__"):
            raise AttributeError(name)
        for key, value in object.__getattribute__(self, "items"):
            if key == name:
                return value
        raise AttributeError(f"{self.arch} configuration has no knob {name!r}")

    def __iter__(self) -> Iterator[tuple[str, Scalar]]:
        return iter(self.items)

    def codegen_items(self) -> tuple[tuple[str, Scalar], ...]:
        """The knobs that change the generated code: the configuration's share of a compile key."""
        return tuple((n, v) for n, v in self.items if knob(self.arch, n).codegen)

    def label(self) -> str:
        return label_of(self.items)


def _in_choices(value: Any, choices: tuple[Scalar, ...]) -> bool:
    # bool is an int in Python: keep True from matching 1 and 1 from matching True
    for c in choices:
        if isinstance(c, bool) or isinstance(value, bool):
            if isinstance(c, bool) and isinstance(value, bool) and c == value:
                return True
        elif c == value:
            return True
    return False


def _canonical(value: Any, choices: tuple[Scalar, ...]) -> Scalar:
    for c in choices:
        if _in_choices(value, (c,)):
            return c
    raise AssertionError("checked before")


def label_of(pairs) -> str:
    """The label text of (name, value) pairs: `name=value` separated by spaces, booleans as on/off,
    whole floats without ".0" (`Config.label`; the one text form of a configuration)."""
    return " ".join(f"{n}={_short(v)}" for n, v in pairs)


def _short(v: Scalar) -> str:
    if isinstance(v, bool):
        return "on" if v else "off"
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)
