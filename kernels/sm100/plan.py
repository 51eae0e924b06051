"""Static plan of the sm100 kernel: knobs + problem -> every compile-time constant and budget.

Pure Python (no DSL import): the feasibility model and the kernel read the same numbers from here, so
the shared-memory bytes the model predicts are the bytes the kernel's `SharedStorage` allocates (the
CPU compile test checks that equality), and the TMEM columns and register split are the ones the kernel
asks for. The kernel has NOT run on hardware (no Blackwell GPU here); see `kernel.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..device import B200, DeviceDescription, scaled_to_l2
# the FMA-pipe exp2's constants, declared once; the kernel and the emulation read them here, with this
# kernel's own column choice (the last `exp2_poly_columns` of every 32 keys)
from ..exp2_fit import EXP2_POLY, EXP2_POLY_CHUNK, EXP2_ROUND_MAGIC  # noqa: F401
from ..knobs import Config
from ..problem import AttentionProblem

TMEM_COLUMNS = 512
TMEM_LANES = 128
TILE_M = 128
REG_BUDGET_PER_THREAD_X4 = 512  # 64 K registers / 128 threads per warpgroup, summed over 4 warpgroups
REGS_OTHER = 48  # load, MMA and store warps (and the idle one): loop counters and addresses only
REGS_MIN = 24
# K+V bytes of a head group kept in L2 by the LPT order: chosen for the B200, scaled to another
# device's L2 (`device_key`)
LPT_L2_BYTES_ON_B200 = 48 << 20
SUPPORTED_HEAD_DIMS = (64, 128)
BUFFER_ALIGN = 1024

# key columns per 32-bit keep-mask word of a masked block (kernel `_mask_row`, emulation `keep_mask`)
MASK_CHUNK = 32

# Barrier kinds in the order they sit in shared memory, with the size of each slice and the number
# of arrivals that completes a phase.
_BARRIER_KINDS = ("q_full", "q_empty", "kv_full", "kv_empty", "s_full", "p_full",
                  "o_done", "o_ready", "mail_full", "mail_empty", "epi_full", "epi_empty",
                  "tmem_dealloc")


@dataclass(frozen=True)
class KernelPlan:
    head_dim: int
    dtype: str
    causal: bool
    return_lse: bool
    pack_gqa: bool
    gqa_ratio: int  # 1 unless pack_gqa (then it is a compile-time constant of the row mapping)
    tile_m: int
    tile_n: int
    q_stages: int
    kv_stages: int
    tmem_stages: int
    rescale_tile: int
    rescale_threshold: float
    scheduler: str
    softmax_regs: int
    exp2_poly_columns: int
    two_cta: bool
    num_sms: int       # compiled in: the persistent grid (`device_key`)
    lpt_l2_bytes: int  # compiled in: the LPT order's L2 budget (`device_key`)
    barrier_slices: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        sizes = {"q_full": self.q_stages, "q_empty": self.q_stages, "kv_full": self.kv_stages,
                 "kv_empty": self.kv_stages, "s_full": self.tmem_stages,
                 "p_full": self.tmem_stages, "o_done": self.q_stages, "o_ready": self.q_stages,
                 "mail_full": self.q_stages, "mail_empty": self.q_stages, "epi_full": self.q_stages,
                 "epi_empty": self.q_stages, "tmem_dealloc": 1 if self.two_cta else 0}
        offset = 0
        slices = {}
        for kind in _BARRIER_KINDS:
            slices[kind] = (offset, sizes[kind])
            offset += sizes[kind]
        object.__setattr__(self, "barrier_slices", slices)

    # --- barriers ---------------------------------------------------------------------------
    @property
    def barrier_offsets(self) -> dict:
        return {k: off for k, (off, _) in self.barrier_slices.items()}

    @property
    def num_barriers(self) -> int:
        return sum(n for _, n in self.barrier_slices.values())

    @property
    def barrier_arrivals(self) -> dict:
        """Arrivals completing a phase. With `two_cta` the leader CTA's MMA warp waits on p_full and
        o_ready, and the softmax and correction warpgroups of both CTAs arrive there (the peer's
        copies of those barriers stay unused); tmem_dealloc is the pair's TMEM-free handshake (one
        warp of the other CTA arrives)."""
        wg = TMEM_LANES  # one warpgroup
        pair = wg * self.cta_group
        # merged (`p_o_merged`): p_full also takes the correction warpgroup's O-ready arrivals
        p_full = 2 * pair if self.p_o_merged else pair
        return {"q_full": 1, "q_empty": 1, "kv_full": 1, "kv_empty": 1, "s_full": 1,
                "p_full": p_full, "o_done": 1, "o_ready": pair, "mail_full": wg, "mail_empty": wg,
                "epi_full": wg, "epi_empty": 1, "tmem_dealloc": 32}

    @property
    def p_o_merged(self) -> bool:
        """One barrier per Q stage for "P written and O safe" (flash-attn-4's S/P/O barrier): with
        tmem_stages == q_stages the S/P buffer of value MMA (i, q) is buffer q, so p_full[q] can
        take the correction warpgroup's O-ready arrivals too and the value MMA waits once, not
        twice; o_ready stays allocated but unused. Why the phases cannot mix: `kernel.py`,
        `FlashAttentionForwardSm100._setup_attributes`."""
        return self.tmem_stages == self.q_stages

    # --- the CTA pair ---------------------------------------------------------------------------
    @property
    def cta_group(self) -> int:
        """CTAs per MMA: 2 with `two_cta` (a cluster pair; the even CTA issues the MMAs)."""
        return 2 if self.two_cta else 1

    @property
    def mma_m(self) -> int:
        """M of one tcgen05 MMA: the 128-row tiles of one Q stage of every CTA of the pair."""
        return self.tile_m * self.cta_group

    # --- TMEM -------------------------------------------------------------------------------
    @property
    def tmem_columns(self) -> int:
        """O per Q stage plus the S/P ring."""
        return self.q_stages * self.head_dim + self.tmem_stages * self.tile_n

    @property
    def tmem_alloc_columns(self) -> int:
        """tcgen05.alloc takes a power of two >= 32."""
        cols = 32
        while cols < self.tmem_columns:
            cols *= 2
        return cols

    # --- shared memory (mirrors the kernel's SharedStorage field by field) ------------------
    @property
    def smem_bytes(self) -> int:
        elem = 2
        fields = [
            (self.q_stages * self.tile_m * self.head_dim * elem, BUFFER_ALIGN),  # sQ
            # sKV (K and V); in a pair each CTA holds half of every tile (K: half the keys, V: half
            # of the head dim)
            (self.kv_stages * self.tile_n * self.head_dim * elem // self.cta_group, BUFFER_ALIGN),
            (self.q_stages * self.tile_m * self.head_dim * elem, BUFFER_ALIGN),  # sO
            (self.num_barriers * 8, 8),                                         # mbarriers
            (self.q_stages * TMEM_LANES * 4, 4),                                # mail_a
            (self.q_stages * TMEM_LANES * 4, 4),                                # mail_b
            (self.q_stages * 4 * 4, 4),                                         # mail_moved
            (4, 4),                                                             # tmem_base
        ]
        offset = 0
        max_align = 1
        for size, align in fields:
            offset = (offset + align - 1) // align * align + size
            max_align = max(max_align, align)
        return (offset + max_align - 1) // max_align * max_align

    # --- registers --------------------------------------------------------------------------
    @property
    def regs_softmax(self) -> int:
        return self.softmax_regs

    @property
    def regs_other(self) -> int:
        return REGS_OTHER

    @property
    def regs_correction(self) -> int:
        """What is left of the 512-per-thread-slot budget after two softmax groups and the rest."""
        return (REG_BUDGET_PER_THREAD_X4 - 2 * self.softmax_regs - REGS_OTHER) // 8 * 8

    @property
    def regs_idle_softmax(self) -> int:
        return REGS_MIN

    @property
    def mma_lag(self) -> int:
        return self.tmem_stages - 1


def device_key(device: DeviceDescription) -> tuple:
    """What of the device is compiled into the kernel: the SM count of the persistent grids and the
    L2 budget of the LPT order (`LPT_L2_BYTES_ON_B200`, scaled to the device's L2)."""
    return (("num_sms", device.sm_count), ("lpt_l2_bytes", scaled_to_l2(LPT_L2_BYTES_ON_B200, B200, device)))


def make_plan(config: Config, problem: AttentionProblem, device: DeviceDescription = B200) -> KernelPlan:
    """The plan of `config` on `problem` for `device` (default: the reference B200)."""
    if config.arch != "sm100":
        raise ValueError(f"an sm100 plan needs an sm100 configuration, got {config.arch}")
    compiled_in = dict(device_key(device))
    return KernelPlan(
        head_dim=problem.head_dim, dtype=problem.dtype, causal=problem.causal,
        return_lse=problem.return_lse, pack_gqa=bool(config.pack_gqa),
        gqa_ratio=problem.gqa_ratio if config.pack_gqa else 1,
        tile_m=int(config.tile_m), tile_n=int(config.tile_n), q_stages=int(config.q_stages),
        kv_stages=int(config.kv_stages), tmem_stages=int(config.tmem_stages),
        rescale_tile=int(config.rescale_tile), rescale_threshold=float(config.rescale_threshold),
        scheduler=str(config.scheduler), softmax_regs=int(config.softmax_regs),
        exp2_poly_columns=int(config.exp2_poly_columns), two_cta=bool(config.two_cta),
        num_sms=compiled_in["num_sms"], lpt_l2_bytes=compiled_in["lpt_l2_bytes"])


def kv_ring_deadlock(q_stages: int, tmem_stages: int, kv_stages: int, blocks: int = 8) -> str | None:
    """Replay the MMA warp's issue order and the load warp's K/V ring; say why it would hang, if so.

    The load warp fills the ring in the order the MMA warp first needs each tile; slot reuse waits for
    the tcgen05.commit that follows the tile's last MMA. The MMA warp is one thread: if the tile it
    needs next can only land after a release it has not issued yet, the CTA hangs.
    """
    Q, L = q_stages, tmem_stages - 1
    total = blocks * Q
    needs: list[int] = []     # action index at which ring item j is first waited on
    releases: list[int] = []  # action index after which ring item j is released
    action = 0
    item_of = {}
    for s in range(total + L):
        if s < total:
            b, q = divmod(s, Q)
            if q == 0:
                item_of[("K", b)] = len(needs)
                needs.append(action)
                releases.append(-1)
            if q == Q - 1:
                releases[item_of[("K", b)]] = action
            action += 1
        p = s - L
        if 0 <= p < total:
            b, q = divmod(p, Q)
            if q == 0:
                item_of[("V", b)] = len(needs)
                needs.append(action)
                releases.append(-1)
            if q == Q - 1:
                releases[item_of[("V", b)]] = action
            action += 1
    for j in range(kv_stages, len(needs)):
        if releases[j - kv_stages] >= needs[j]:
            return (f"kv_stages={kv_stages} too shallow for q_stages={q_stages}, tmem_stages="
                    f"{tmem_stages}: the MMA warp issues {L} score MMA(s) ahead of the value MMA, so "
                    f"it waits for a K/V tile whose ring slot it has not released yet (deadlock)")
    return None
