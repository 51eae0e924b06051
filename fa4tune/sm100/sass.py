"""Static SASS analysis of sm100 attention forward kernels: what the compiler made of each warp role.

NO BLACKWELL GPU EXISTS HERE: every figure this module produces is read from code compiled for sm_100a
on a CPU and disassembled with `nvdisasm`; none was measured on hardware, and the throughput estimate
is a model built on public per-SM rates, not a timing.

Steps (each a plain function, testable on a SASS text):
1. `parse_sass` splits nvdisasm's output into instructions (address, predicate, opcode, operands).
2. `control_flow` cuts them into basic blocks and finds the natural loops (back edges).
3. Spin loops (an mbarrier try-wait retried with NANOSLEEP) are recognised and left out of the
   per-iteration counts: they run only when a wait has to wait.
4. `role_loops` names the main loop of each warp role by what it contains (softmax: exp2 on MUFU and a
   TMEM load of S; MMA: tcgen05.mma; correction: a wait plus a TMEM store of O without exp2; load:
   TMA loads), and normalises every count to one KV block of `tile_n` keys.
5. `static_estimate` turns the counts into clocks per KV block per CTA on the exp unit, the issue
   slots of the four sub-partitions and shared memory, against the tensor-core floor.

Compiling the kernels (ours and flash-attn-4's), disassembling them and the command line
(`fa4tune sass`) live in `fa4tune.sm100.sass_build`; this module only reads SASS text.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Optional

NOT_RUN_NOTE = ("compile-time figures: sm_100a code compiled on a CPU and disassembled; no Blackwell "
                "GPU exists here, so nothing was run or timed on hardware")

# --- public per-SM rates of a B200 (sm_100), used only by the static estimate --------------------
TENSOR_FLOP_PER_CLOCK = 8192   # dense fp16/bf16 tcgen05.mma FLOP per clock per SM (2.25 PFLOP/s at
#                                148 SMs and ~1.85 GHz)
EXP2_PER_CLOCK = 16            # MUFU.EX2 results per clock per SM (4 per sub-partition)
ISSUE_PER_CLOCK = 1            # warp instructions issued per clock per sub-partition
SMEM_BYTES_PER_CLOCK = 128     # shared-memory bandwidth per SM

# ------------------------------------------------------------------------------------------------
# 1. parsing

_INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;?\s*$")
_LABEL = re.compile(r"^(\.L_x_\d+|\.L_\w+):")
_FUNC = re.compile(r"^\s*\.text\.(\S+):\s*$")
_TARGET = re.compile(r"`\((\.L_\w+)\)")
_PRED = re.compile(r"^(@!?U?P[T0-9]+)\s+")


@dataclass(frozen=True)
class Instruction:
    address: int
    predicate: str      # "" or e.g. "@!P0"
    opcode: str         # with modifiers, e.g. "SYNCS.PHASECHK.TRANS64.TRYWAIT"
    operands: str

    @property
    def base(self) -> str:
        """The opcode without modifiers: FFMA2, MUFU, UTCHMMA, ..."""
        return self.opcode.split(".")[0]

    @property
    def target(self) -> Optional[str]:
        m = _TARGET.search(self.operands)
        return m.group(1) if m else None


@dataclass
class Function:
    name: str
    instructions: list = field(default_factory=list)
    labels: dict = field(default_factory=dict)  # label -> index of the instruction it names


def parse_sass(text: str) -> list[Function]:
    """nvdisasm output -> functions (the kernel and any internal subroutines), in order."""
    functions: list[Function] = []
    current: Optional[Function] = None
    pending: list[str] = []
    for line in text.splitlines():
        m = _FUNC.match(line)
        if m:
            current = Function(m.group(1))
            functions.append(current)
            pending = []
            continue
        if current is None:
            continue
        m = _LABEL.match(line.strip())
        if m:
            pending.append(m.group(1))
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        body = m.group(2).rstrip(" ;")
        pred = ""
        pm = _PRED.match(body)
        if pm:
            pred, body = pm.group(1), body[pm.end():]
        opcode, _, operands = body.partition(" ")
        for label in pending:
            current.labels[label] = len(current.instructions)
        pending = []
        current.instructions.append(Instruction(int(m.group(1), 16), pred, opcode, operands.strip()))
    return functions


def kernel_function(functions: list[Function]) -> Function:
    """The kernel itself: the largest function (the others are the compiler's trap subroutines)."""
    if not functions:
        raise ValueError("no function in the SASS text")
    return max(functions, key=lambda f: len(f.instructions))


# ------------------------------------------------------------------------------------------------
# 2. control flow

_ENDS_BLOCK = {"BRA", "BRX", "JMP", "JMX", "EXIT", "RET", "BPT", "KILL"}


@dataclass
class Block:
    index: int
    start: int  # instruction indices [start, end)
    end: int
    successors: list = field(default_factory=list)


@dataclass
class Loop:
    header: int
    blocks: frozenset
    spin: bool = False          # an mbarrier wait retried: runs only when the wait waits
    children: list = field(default_factory=list)
    parent: Optional["Loop"] = None


def control_flow(func: Function) -> tuple[list[Block], list[Loop]]:
    """Basic blocks and natural loops (one per header; a back edge is an edge to a block that
    dominates its source). Out-of-line blocks (spin-wait retries placed after the kernel's EXIT that
    branch back into the code) are not back edges unless their target dominates them."""
    ins = func.instructions
    leaders = {0}
    for i, instr in enumerate(ins):
        if instr.base in _ENDS_BLOCK:
            leaders.add(i + 1)
            if instr.target in func.labels:
                leaders.add(func.labels[instr.target])
    leaders |= {idx for idx in func.labels.values()}
    starts = sorted(x for x in leaders if x < len(ins))
    blocks = [Block(n, s, (starts[n + 1] if n + 1 < len(starts) else len(ins))) for n, s in enumerate(starts)]
    block_of = {b.start: b.index for b in blocks}
    for b in blocks:
        last = ins[b.end - 1]
        target = last.target
        if last.base in ("BRA", "JMP") and target in func.labels:
            b.successors.append(block_of[func.labels[target]])
        unconditional = not last.predicate and not (last.opcode.startswith("BRA.U") and
                                                    re.match(r"!?U?P[0-9]", last.operands))
        falls_through = last.base not in _ENDS_BLOCK or not unconditional
        if last.base in ("EXIT", "RET", "KILL", "BPT") and unconditional:
            falls_through = False
        if falls_through and b.index + 1 < len(blocks):
            b.successors.append(b.index + 1)
    preds: dict[int, list[int]] = {b.index: [] for b in blocks}
    for b in blocks:
        for s in b.successors:
            preds[s].append(b.index)
    dom = _dominators(blocks, preds)
    bodies: dict[int, set] = {}
    for b in blocks:
        for h in b.successors:
            if dom[b.index] >> h & 1:  # back edge b -> h: h dominates b
                body = bodies.setdefault(h, {h})
                stack = [b.index]
                while stack:
                    x = stack.pop()
                    if x in body:
                        continue
                    body.add(x)
                    stack.extend(preds[x])
    loops = [Loop(h, frozenset(body)) for h, body in sorted(bodies.items())]
    for loop in loops:
        opcodes = {ins[i].opcode for bi in loop.blocks for i in range(blocks[bi].start, blocks[bi].end)}
        loop.spin = (any(o.startswith("SYNCS.PHASECHK") for o in opcodes)
                     and all(o.startswith(("SYNCS.PHASECHK", "NANOSLEEP", "BRA", "MOV", "IMAD.MOV",
                                           "NOP", "YIELD")) for o in opcodes))
    # the way back from a retry (e.g. its final `BRA` into the code) is part of the retry: a block
    # all of whose predecessors are retry blocks joins the spin loop
    for loop in loops:
        if not loop.spin:
            continue
        grown = set(loop.blocks)
        changed = True
        while changed:
            changed = False
            for b in blocks:
                if b.index not in grown and preds[b.index] and all(p in grown for p in preds[b.index]):
                    grown.add(b.index)
                    changed = True
        loop.blocks = frozenset(grown)
    # nesting: the smallest strictly larger loop that contains it
    for loop in loops:
        outers = [o for o in loops if o is not loop and loop.blocks < o.blocks]
        if outers:
            loop.parent = min(outers, key=lambda o: len(o.blocks))
            loop.parent.children.append(loop)
    return blocks, loops


def _dominators(blocks: list[Block], preds: dict) -> list[int]:
    """dom[b] as a bit set of the blocks that dominate b (iterative data flow from block 0)."""
    n = len(blocks)
    full = (1 << n) - 1
    dom = [full] * n
    dom[0] = 1
    changed = True
    while changed:
        changed = False
        for b in range(1, n):
            ps = [dom[p] for p in preds[b]]
            new = full
            for d in ps:
                new &= d
            if not ps:
                new = 0  # unreachable
            new |= 1 << b
            if new != dom[b]:
                dom[b] = new
                changed = True
    return dom


# ------------------------------------------------------------------------------------------------
# 3-4. counting per loop and naming the roles

def classify(instr: Instruction) -> list[str]:
    """The counters one instruction adds to (besides `instructions`)."""
    op, base = instr.opcode, instr.base
    out = []
    if op.startswith("MUFU.EX2"):
        out.append("mufu_ex2")
    elif base == "MUFU":
        out.append("mufu_other")
    if base in ("FFMA", "FFMA2", "FADD", "FADD2", "FMUL", "FMUL2", "FMNMX", "FMNMX3", "FSEL", "F2FP"):
        out.append(base.lower())
    if op.startswith("SYNCS.PHASECHK") and "TRYWAIT" in op:
        out.append("barrier_waits")
    if op.startswith("SYNCS.ARRIVE") or op.startswith("UTCBAR"):
        out.append("barrier_arrives")
    if base.startswith("UTC") and "MMA" in base:
        out.append("tcgen05_mma")
    if base == "UTCBAR":
        out.append("tcgen05_commit")
    if base == "LDTM":
        out.append("tcgen05_ld")
    if base == "STTM":
        out.append("tcgen05_st")
    if base.startswith("UTMALDG"):
        out.append("tma_load")
    if base.startswith("UTMASTG"):
        out.append("tma_store")
    if base == "BAR":
        out.append("named_barrier")
    return out


COUNTERS = ("instructions", "mufu_ex2", "mufu_other", "ffma", "ffma2", "fadd", "fadd2", "fmul",
            "fmul2", "fmnmx", "fmnmx3", "fsel", "f2fp", "mask", "barrier_waits", "barrier_arrives",
            "tcgen05_mma", "tcgen05_commit", "tcgen05_ld", "tcgen05_st", "tma_load", "tma_store",
            "named_barrier", "tmem_ld_columns")


def _mask_instructions(instrs: list[Instruction]) -> int:
    """Instructions that apply a key mask: FSEL x, -INF by a predicate, and what sets those
    predicates in the same loop: integer compares (ISETP writing a predicate such an FSEL reads) and
    R2P (a keep-mask word moved into predicates P0-P6, 7 bits at a time)."""
    mask_preds = set()
    n = 0
    for instr in instrs:
        if instr.base == "FSEL" and "-INF" in instr.operands:
            n += 1
            mask_preds.add(instr.operands.split(",")[-1].strip().lstrip("!"))
    for instr in instrs:
        if instr.base == "ISETP":
            dest = instr.operands.split(",")[0].strip()
            if dest in mask_preds:
                n += 1
        elif instr.base == "R2P" and mask_preds & {f"P{i}" for i in range(7)}:
            n += 1
    return n


def count(instrs: Iterable[Instruction]) -> dict:
    instrs = list(instrs)
    c = Counter({k: 0 for k in COUNTERS})
    for instr in instrs:
        c["instructions"] += 1
        for k in classify(instr):
            c[k] += 1
        if instr.base == "LDTM":
            m = re.search(r"\.x(\d+)", instr.opcode)
            c["tmem_ld_columns"] += int(m.group(1)) if m else 1
    c["mask"] = _mask_instructions(instrs)
    return dict(c)


def _loop_instructions(func: Function, blocks: list[Block], loop: Loop, loops: list[Loop]) -> tuple[list, list]:
    """(main path, nested) instructions of a loop: blocks of spin loops inside it are dropped, blocks
    of nested non-spin loops go to `nested`."""
    spin_blocks = set().union(*[l.blocks for l in loops if l.spin and l.blocks <= loop.blocks
                                and l is not loop]) if loops else set()
    nested_blocks = set().union(*[l.blocks for l in loop.children if not l.spin]) - spin_blocks \
        if loop.children else set()
    main, nested = [], []
    for bi in sorted(loop.blocks):
        if bi in spin_blocks:
            continue
        dest = nested if bi in nested_blocks else main
        dest.extend(func.instructions[blocks[bi].start:blocks[bi].end])
    return main, nested


def _role(c: dict, all_c: dict) -> Optional[str]:
    if c["mufu_ex2"] >= 16 and c["tcgen05_ld"]:
        return "softmax"
    if c["tcgen05_mma"]:
        return "mma"
    if c["tma_load"]:
        return "load"
    if all_c["tcgen05_st"] and all_c["mufu_ex2"] < 16 and not all_c["tma_store"] and (
            c["barrier_waits"] or c["named_barrier"]):
        return "correction"
    return None


def _fast_path(func: Function, blocks: list[Block], loop: Loop, skip: set) -> int:
    """Instructions on the shortest way once around the loop (header to a back edge), spin-wait
    retries left out: the path of a block that takes no rare branch (no rescale, no retry)."""
    import heapq
    inside = set(loop.blocks) - skip
    size = {b: blocks[b].end - blocks[b].start for b in inside}
    best = {loop.header: size.get(loop.header, 0)}
    heap = [(best[loop.header], loop.header)]
    result = None
    while heap:
        d, b = heapq.heappop(heap)
        if d > best.get(b, 1 << 60):
            continue
        for s in blocks[b].successors:
            if s == loop.header:
                result = d if result is None else min(result, d)
                continue
            if s not in inside:
                continue
            nd = d + size[s]
            if nd < best.get(s, 1 << 60):
                best[s] = nd
                heapq.heappush(heap, (nd, s))
    return result or 0


@dataclass
class LoopReport:
    role: str
    address: int          # of the loop header
    body: dict            # counts over the loop body (spin-wait retries and nested loops left out)
    nested: dict          # counts of the nested (non-spin) loops, e.g. the O rescale chunk loop
    fast_path: int        # instructions on the shortest way around the loop
    blocks_per_iteration: float  # KV blocks of tile_n keys (both Q stages) one iteration handles

    def per_block(self, key: str) -> float:
        return self.body[key] / self.blocks_per_iteration if self.blocks_per_iteration else 0.0

    def to_dict(self) -> dict:
        return {"role": self.role, "address": hex(self.address), "body": self.body,
                "nested": {k: v for k, v in self.nested.items() if v}, "fast_path": self.fast_path,
                "blocks_per_iteration": self.blocks_per_iteration}


def role_loops(sass_text: str, tile_n: int, head_dim: int, q_stages: int) -> list[LoopReport]:
    """The innermost loop(s) of each warp role, with counts and their share of one KV block.

    A softmax loop iteration handles the S columns it loads from TMEM (tile_n per block); an MMA loop
    iteration issues `tcgen05.mma`s, 2 * q_stages GEMMs per block with K = 16 per instruction for
    16-bit inputs (head_dim/16 for Q K^T, tile_n/16 for P V; a 2-CTA pair's leader issues for both
    CTAs, M = 256, the same count); a correction loop iteration is one block for every Q stage.
    """
    func = kernel_function(parse_sass(sass_text))
    blocks, loops = control_flow(func)
    spin_blocks = set().union(*[l.blocks for l in loops if l.spin]) if loops else set()
    found = []
    for loop in loops:
        if loop.spin:
            continue
        main, nested = _loop_instructions(func, blocks, loop, loops)
        c, nc = count(main), count(nested)
        role = _role(c, {k: c[k] + nc[k] for k in c})
        if role is None:
            continue
        if role == "softmax":
            per_iter = c["tmem_ld_columns"] / tile_n / q_stages
        elif role == "mma":
            per_iter = c["tcgen05_mma"] / (q_stages * (head_dim // 16 + tile_n // 16))
        elif role == "correction":
            per_iter = 1.0
        else:
            per_iter = 0.0
        found.append((loop, LoopReport(role, func.instructions[blocks[loop.header].start].address, c,
                                       nc, _fast_path(func, blocks, loop, spin_blocks), per_iter)))
    # keep a role's innermost loops: drop a loop that holds another loop of the same role
    keep = []
    for loop, rep in found:
        inner = [l for l, r in found if r.role == rep.role and l is not loop and l.blocks < loop.blocks]
        if not inner:
            keep.append(rep)
    return keep


# ------------------------------------------------------------------------------------------------
# 5. summary and static estimate

def summarize(sass_text: str, *, tile_n: int, head_dim: int, q_stages: int, two_cta: bool) -> dict:
    """Per-role figures per KV block (tile_n keys, every Q stage of the CTA) and the static estimate."""
    loops = role_loops(sass_text, tile_n, head_dim, q_stages)
    by_role: dict[str, list[LoopReport]] = {}
    for rep in loops:
        by_role.setdefault(rep.role, []).append(rep)
    softmax = sorted(by_role.get("softmax", []), key=lambda r: r.address)
    # the steady state: softmax loops that apply no mask; masked loops are the diagonal/tail ones
    steady = [r for r in softmax if r.body["mask"] == 0] or softmax
    masked = [r for r in softmax if r.body["mask"] > 0 and r not in steady]
    per_elem = lambda r: r.body["instructions"] / r.body["tmem_ld_columns"]
    out = {
        "softmax_loops": [r.to_dict() for r in softmax],
        "softmax_steady": [{
            "address": hex(r.address),
            "instructions": r.body["instructions"],
            "instructions_per_score_element": round(per_elem(r), 3),
            "mask_instructions": r.body["mask"],
            "mufu_ex2_per_128": round(128 * r.body["mufu_ex2"] / r.body["tmem_ld_columns"], 1),
            **{k: r.body[k] for k in ("ffma", "ffma2", "fadd", "fadd2", "fmul", "fmul2", "fmnmx",
                                      "fmnmx3", "f2fp", "barrier_waits", "barrier_arrives",
                                      "tcgen05_ld", "tcgen05_st")},
        } for r in steady],
        "softmax_masked": [{"address": hex(r.address), "instructions": r.body["instructions"],
                            "mask_instructions": r.body["mask"]} for r in masked],
    }
    mma = by_role.get("mma", [])
    mma_main = max(mma, key=lambda r: r.body["tcgen05_mma"]) if mma else None
    if mma_main:
        out["mma"] = {"address": hex(mma_main.address), "blocks_per_iteration": mma_main.blocks_per_iteration,
                      **{k: round(mma_main.per_block(k), 2) for k in
                         ("instructions", "barrier_waits", "barrier_arrives", "tcgen05_mma", "tcgen05_commit")}}
    corr = by_role.get("correction", [])
    corr_main = min(corr, key=lambda r: r.fast_path) if corr else None
    if corr_main:
        out["correction"] = {"address": hex(corr_main.address), "no_rescale_path": corr_main.fast_path,
                             "body": corr_main.body["instructions"],
                             "rescale_loop": corr_main.nested["instructions"],
                             "barrier_waits": corr_main.body["barrier_waits"],
                             "named_barriers": corr_main.body["named_barrier"]}
    out["estimate"] = static_estimate(
        softmax_per_block=[r.body["instructions"] / (r.body["tmem_ld_columns"] / tile_n) for r in steady],
        mufu_per_block=max(r.body["mufu_ex2"] / (r.body["tmem_ld_columns"] / tile_n) for r in steady),
        correction_per_block=corr_main.fast_path if corr_main else 0,
        mma_per_block=mma_main.per_block("instructions") if mma_main else 0,
        tile_n=tile_n, head_dim=head_dim, q_stages=q_stages, two_cta=two_cta)
    return out


def static_estimate(*, softmax_per_block: list, mufu_per_block: float, correction_per_block: float,
                    mma_per_block: float, tile_n: int, head_dim: int, q_stages: int,
                    two_cta: bool) -> dict:
    """Clocks per KV block per CTA on each unit, as a fraction of the tensor-core floor.

    Tensor floor: q_stages x (Q K^T + P V) GEMMs of 128 x tile_n x head_dim at TENSOR_FLOP_PER_CLOCK.
    Exp unit: one softmax warpgroup (128 threads) per Q stage issues `mufu_per_block` MUFU.EX2 each.
    Issue slots: a sub-partition holds one warp of each softmax warpgroup and one correction warp, and
    one of the single warps (MMA on one of them): low = without, high = with the MMA warp.
    Shared memory: the MMAs' operand reads (Q and K for Q K^T, V for P V; P comes from TMEM; a
    2-CTA pair splits the B operands K and V between its two CTAs) at SMEM_BYTES_PER_CLOCK.
    A model of rates, not a timing: nothing here ran on a GPU.
    """
    gemm_flop = 2 * 128 * tile_n * head_dim
    tensor = q_stages * 2 * gemm_flop / TENSOR_FLOP_PER_CLOCK
    exp = q_stages * 128 * mufu_per_block / EXP2_PER_CLOCK
    warps = list(softmax_per_block) * (q_stages if len(softmax_per_block) == 1 else 1)
    issue_low = (sum(warps[:q_stages]) + correction_per_block) / ISSUE_PER_CLOCK
    issue_high = issue_low + mma_per_block / ISSUE_PER_CLOCK
    b_share = 0.5 if two_cta else 1.0
    tile_bytes = 2 * tile_n * head_dim
    smem_bytes = q_stages * (2 * 128 * head_dim + b_share * tile_bytes + b_share * tile_bytes)
    smem = smem_bytes / SMEM_BYTES_PER_CLOCK
    bound = max(tensor, exp, issue_high, smem)
    return {"tensor_floor_clocks": round(tensor, 1),
            "exp_clocks": round(exp, 1), "exp_vs_floor": round(exp / tensor, 3),
            "issue_clocks_low": round(issue_low, 1), "issue_clocks_high": round(issue_high, 1),
            "issue_vs_floor_low": round(issue_low / tensor, 3), "issue_vs_floor_high": round(issue_high / tensor, 3),
            "smem_clocks": round(smem, 1), "smem_vs_floor": round(smem / tensor, 3),
            "bound_clocks": round(bound, 1), "throughput_vs_floor": round(tensor / bound, 3)}
