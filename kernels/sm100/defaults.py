"""The sm100 heuristic default configuration: the knobs' declared defaults plus per-problem rules.

Kept out of the source fingerprint (`SOURCE_FILES`): a rule picks among configurations, it does not
change what any configuration compiles to.
"""

from __future__ import annotations

from typing import Optional

from ..device import DeviceDescription, apply_default_rules, reads_device
from ..knobs import Config
from ..problem import AttentionProblem
from .feasibility import REFERENCE_DEVICE, resource_reasons
from .plan import TILE_M

ARCH = "sm100"


# The heuristic default: the knobs' declared defaults (FA4's shape: 2 Q stages, 2 TMEM stages,
# 128-key blocks, rescale_tile 16, threshold 8, 192 softmax registers), then these rules in order.
# A model of a kernel that has never run: the search decides on hardware.

def _persistent_scheduler(config: Config, problem: AttentionProblem) -> Config:
    """Persistent CTAs over the SMs, longest tiles first when causal (as FA4)."""
    return config.replace(scheduler="lpt" if problem.causal else "static")


def _pack_gqa_when_it_divides(config: Config, problem: AttentionProblem) -> Config:
    """GQA packing when the ratio divides the 128-row tile (K/V loaded once per group)."""
    return config.replace(pack_gqa=problem.gqa_ratio > 1 and TILE_M % problem.gqa_ratio == 0)


def _exp2_poly_for_head_dim(config: Config, problem: AttentionProblem) -> Config:
    """The polynomial exp2 share the static estimate of `fa4tune sass` favours: at D=128, 4 of 32
    keys (the declared default: exp unit 88 % of the tensor floor, est. throughput 1.00; 0: 0.99, 8:
    1.00 with more issue slots); at D=64, where the exp unit bounds the block, 8 of 32 (est. 0.65 of
    the floor; 4: 0.57, 0: 0.50)."""
    return config.replace(exp2_poly_columns=8) if problem.head_dim <= 64 else config


# (softmax_regs, kv_stages) tried in this order: the deepest K/V ring that fits, at 192 softmax
# registers, else 200, else 184; none fitting leaves the declared defaults.
_FIT_ORDER = tuple((regs, kv) for regs in (192, 200, 184) for kv in (3, 2, 4))


@reads_device("smem_per_block_bytes")
def _deepest_kv_ring_that_fits(config: Config, problem: AttentionProblem, device: DeviceDescription) -> Config:
    for regs, kv in _FIT_ORDER:
        candidate = config.replace(softmax_regs=regs, kv_stages=kv)
        if not resource_reasons(candidate, problem, device):
            return candidate
    return config


DEFAULT_RULES = (_persistent_scheduler, _pack_gqa_when_it_divides, _exp2_poly_for_head_dim,
                 _deepest_kv_ring_that_fits)


def default_config(problem: AttentionProblem, device: Optional[DeviceDescription] = None) -> Config:
    """The knobs' declared defaults, then `DEFAULT_RULES` in order, for `device` (default: the
    reference B200)."""
    return apply_default_rules(DEFAULT_RULES, Config.make(ARCH), problem, device or REFERENCE_DEVICE)
