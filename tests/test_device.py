"""Device facts come from one description (`fa4.kernels.device`), and feasibility, grid limits included,
from the family: the scheduler, the default rules and the launch limits read the device they are given
(CPU; the grids are the schedulers' own code on plain integers)."""

from __future__ import annotations

import dataclasses
import math
import types
from pathlib import Path

import pytest

from fa4.kernels import AttentionProblem, Config, compile_key, default_config, family, feasible, knob
from fa4.kernels import device as devices
from fa4.kernels.device import B200, H200, DeviceDescription, MiB
from fa4.kernels.launch import MAX_CTAS_PER_TILE

# an H20: Hopper with 78 SMs (not a measured description: only the SM count matters here)
H20 = dataclasses.replace(H200, name="NVIDIA H20", sm_count=78)


def test_the_reference_devices_are_declared_once_per_family():
    for arch in ("sm90", "sm100"):
        assert family(arch).REFERENCE_DEVICE is devices.reference_device(arch)
        assert devices.reference_device(arch).arch == arch
    assert (H200.sm_count, B200.sm_count) == (132, 148)
    assert DeviceDescription("an A100", (8, 0), 108, 166_912, 40 * MiB).arch is None
    with pytest.raises(ValueError, match="unknown architecture"):
        devices.reference_device("sm80")


def test_from_torch_reads_the_device_properties(monkeypatch):
    import torch

    props = types.SimpleNamespace(name="NVIDIA H100 PCIe", major=9, minor=0, multi_processor_count=114,
                                  shared_memory_per_block_optin=232_448, L2_cache_size=50 * MiB)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    described = devices.from_torch(0)
    assert described == DeviceDescription("NVIDIA H100 PCIe", (9, 0), 114, 232_448, 50 * MiB)
    assert described.arch == "sm90" and described.max_grid == (2**31 - 1, 65_535, 65_535)


def test_the_compiled_in_l2_budgets_are_the_reference_devices_own():
    # what the generated code held before the budgets were derived from the device: byte-identical
    # code on the reference devices needs exactly these numbers there
    assert dict(family("sm90").device_key(H200)) == {"num_sms": 132, "l2_bytes_for_kv": 32 * MiB}
    assert dict(family("sm100").device_key(B200)) == {"num_sms": 148, "lpt_l2_bytes": 48 * MiB}
    half = dataclasses.replace(H200, l2_bytes=H200.l2_bytes // 2)
    assert dict(family("sm90").device_key(half))["l2_bytes_for_kv"] == 16 * MiB
    assert devices.scaled_to_l2(32 * MiB, H200, dataclasses.replace(H200, l2_bytes=H200.l2_bytes + 1)) == 32 * MiB


def test_a_78_sm_device_gets_a_78_cta_persistent_grid_and_its_own_compile():
    pytest.importorskip("cutlass")   # the grid is the scheduler's code, written in the DSL
    problem = AttentionProblem(4, 2048, 2048, 16, 16, 128)   # 16 m blocks x 16 heads x 4: 1024 tiles
    for arch in ("sm90", "sm100"):
        fam = family(arch)
        config = Config.make(arch, scheduler="static", q_stages=2, pack_gqa=False)
        assert fam.launch_grid(config, problem, H20 if arch == "sm90" else dataclasses.replace(B200, sm_count=78)) \
            == (78, 1, 1)
        assert fam.launch_grid(config, problem) == (fam.REFERENCE_DEVICE.sm_count, 1, 1)
    sm90 = family("sm90")
    config = Config.make("sm90", scheduler="lpt", q_stages=2, pack_gqa=False)
    assert compile_key(config, problem, H20) != compile_key(config, problem)   # compiled for 78 SMs
    assert sm90.make_kernel(config, problem, H20).num_sms == 78
    assert sm90.make_kernel(config, problem, H200).num_sms == 132


def test_the_default_rules_wave_arithmetic_counts_the_devices_sms():
    from fa4.kernels.sm90 import defaults

    assert defaults.persistent_for_short_keys.device_facts == ("sm_count", "smem_per_block_bytes")
    # 8 key blocks (short keys) and 8 m blocks x 20 heads = 160 tiles: two waves of 78 SMs (156), not
    # of 132 (264)
    problem = AttentionProblem(1, 1024, 1024, 20, 20, 128)
    on_h200, on_h20 = default_config("sm90", problem), default_config("sm90", problem, H20)
    assert (on_h200.scheduler, on_h200.q_stages) == ("single", 1)
    assert (on_h20.scheduler, on_h20.q_stages) == ("static", 2)
    assert not feasible(on_h20, problem, H20)


def test_a_rule_names_the_facts_it_reads():
    with pytest.raises(ValueError, match="facts of DeviceDescription"):
        devices.reads_device("sm_cuont")
    with pytest.raises(ValueError, match="facts of DeviceDescription"):
        devices.reads_device()


def test_feasibility_refuses_a_grid_the_device_cannot_launch():
    small = dataclasses.replace(H200, name="a small-grid device", max_grid_y=100, max_grid_z=100)
    problem = AttentionProblem(1, 128, 128, 200, 200, 64)   # one m block, 200 heads
    single = Config.make("sm90", scheduler="single", pack_gqa=False)
    assert not feasible(single, problem)                       # the H200 launches 200 on y
    [reason] = family("sm90").launch_reasons(single, problem, small)
    assert "its y (200) > 100, the limit of the grid's y on a small-grid device" in reason
    assert reason in feasible(single, problem, small)         # the one feasibility call says it too
    assert not feasible(single.replace(scheduler="single_lpt"), problem, small)   # a 1-D grid fits
    narrow = dataclasses.replace(B200, name="a narrow device", max_grid_x=100)
    sm100 = Config.make("sm100", scheduler="single")
    assert any("its x (200) > 100, the limit of the grid's x on a narrow device" in r
               for r in feasible(sm100, AttentionProblem(1, 256, 256, 200, 200, 64), narrow))


def test_a_device_with_less_shared_memory_refuses_what_the_reference_takes():
    small = dataclasses.replace(H200, name="a 100 KiB device", smem_per_block_bytes=100 * 1024)
    problem = AttentionProblem(1, 1024, 1024, 8, 8, 128)
    config = default_config("sm90", problem)
    assert not feasible(config, problem)
    assert any("B per block (a 100 KiB device)" in r for r in feasible(config, problem, small))
    sm100 = default_config("sm100", problem)
    assert not feasible(sm100, problem)
    assert any("B per block (a 100 KiB device)" in r
               for r in feasible(sm100, problem, dataclasses.replace(B200, name="a 100 KiB device",
                                                                      smem_per_block_bytes=100 * 1024)))


# ---- CUDA's grid limits on the reference devices ----------------------------------------------------

def test_launch_limits_of_the_grid():
    sm90, sm100 = family("sm90"), family("sm100")
    single = Config.make("sm90", scheduler="single", pack_gqa=False)
    ok = AttentionProblem(65_535, 1, 1, 65_535, 65_535, 64)
    assert sm90.launch_reasons(single, ok) == []
    for problem, what, axis in ((AttentionProblem(65_536, 1, 1, 1, 1, 64), "65536 batch", "z (65536)"),
                                (AttentionProblem(1, 1, 1, 65_536, 65_536, 64), "65536 heads", "y (65536)")):
        [reason] = sm90.launch_reasons(single, problem)
        assert what in reason and axis in reason and "65535" in reason and "single_lpt" in reason
        assert sm90.launch_reasons(single.replace(scheduler="single_lpt"), problem) == []
        assert sm90.launch_reasons(single.replace(scheduler="static", q_stages=2), problem) == []
    # GQA packing folds the query heads into the rows: the grid has KV heads
    packed = AttentionProblem(1, 1, 1, 4 * 20_000, 20_000, 64)
    assert sm90.launch_reasons(single.replace(pack_gqa=True), packed) == []
    assert sm90.launch_reasons(single, packed) != []
    # every scheduler indexes its tiles with 32-bit integers
    huge = AttentionProblem(2**16, 2**16, 1, 2**10, 2**10, 64)
    assert any("tiles >" in r for r in sm90.launch_reasons(single.replace(scheduler="single_lpt"), huge))
    assert any("tiles >" in r for r in sm100.launch_reasons(Config.make("sm100"), huge))
    # a cluster pair launches two CTAs per task of twice a CTA's rows (q_stages x 128 = 256 by default):
    # one more CTA per head than one CTA per tile where a head has an odd number of 256-row tiles
    over = AttentionProblem(1, 256 * (2**21 - 1), 1, 2**10, 2**10, 64)  # 2**31 - 2**10 256-row tiles
    assert sm100.launch_reasons(Config.make("sm100"), over) == []
    assert any("the limit of the grid's x on NVIDIA B200" in r
               for r in sm100.launch_reasons(Config.make("sm100", two_cta=True), over))
    even = AttentionProblem(1, 256 * (2**21 - 2), 1, 2**10, 2**10, 64)
    assert sm100.launch_reasons(Config.make("sm100", two_cta=True), even) == []


def _kinds(arch):
    return knob(arch, "scheduler").choices


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_the_launch_grid_is_the_schedulers(arch):
    """launch_grid asks the family's own scheduler; the tile counts hold q_stages (sm100) and GQA packing."""
    fam = family(arch)
    problem = AttentionProblem(3, 1000, 1000, 16, 4, 128)
    for kind in _kinds(arch):
        config = Config.make(arch, scheduler=kind, pack_gqa=True)
        m_blocks, heads, batch = fam.tile_counts(config, problem)
        rows = config.tile_m * (config.q_stages if arch == "sm100" else 1)
        assert (m_blocks, heads, batch) == (-(-4000 // rows), 4, 3)
        grid = fam.launch_grid(config, problem)
        if kind == "single" and arch == "sm90":
            assert grid == (m_blocks, heads, batch)
        elif kind in ("static", "lpt"):
            assert grid == (min(m_blocks * heads * batch, fam.REFERENCE_DEVICE.sm_count), 1, 1)
        else:
            assert grid == (m_blocks * heads * batch, 1, 1)


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_no_scheduler_launches_more_than_two_ctas_per_tile(arch):
    """What lets launch_reasons skip the scheduler (and the DSL) while twice the tiles fit the grid."""
    fam = family(arch)
    pairs = (False, True) if arch == "sm100" else (False,)
    for problem in (AttentionProblem(1, 1, 1, 1, 1, 64), AttentionProblem(7, 333, 900, 24, 8, 64),
                    AttentionProblem(2, 40_000, 40_000, 1, 1, 128), AttentionProblem(1, 0, 0, 8, 8, 128)):
        for kind in _kinds(arch):
            for pack in (False, True):
                for pair in pairs:
                    extra = {"two_cta": pair} if arch == "sm100" else {}
                    config = Config.make(arch, scheduler=kind, pack_gqa=pack, **extra)
                    grid = fam.launch_grid(config, problem)
                    bound = MAX_CTAS_PER_TILE * math.prod(fam.tile_counts(config, problem))
                    assert math.prod(grid) <= bound, (kind, pair, grid)


def test_the_tile_counts_are_the_kernels():
    # each family's tile_counts mirrors these lines of its kernel's __call__ (the counts its scheduler
    # is built from); when they change, so must it. The grids themselves come from the schedulers.
    import fa4.kernels

    here = Path(fa4.kernels.__file__).parent
    kernel = (here / "sm90" / "kernel.py").read_text()
    for line in ("rows_q = seqlen_q\n", "heads_tile = heads_q\n", "rows_q = seqlen_q * self.pack_ratio\n",
                 "heads_tile = heads_kv\n", "num_m_blocks = (rows_q + self.tile_m - 1) // self.tile_m\n",
                 "TileScheduler.create(self.scheduler_kind, num_m_blocks, heads_tile, batch",
                 "grid = sched.grid_shape()\n",
                 # a varlen batch's one-CTA-per-task grid: at most the full grid's tasks, which the
                 # counts bound (each sequence's blocks <= the longest's)
                 "varlen_grid_tasks(seqlen_q, batch, self.tile_m, heads_tile)"):
        assert line in kernel, line
    assert "gqa_pack_ratio=problem.gqa_ratio if pack_gqa else None" in (here / "sm90" / "__init__.py").read_text()
    sm100 = (here / "sm100" / "kernel.py").read_text()
    for line in ("self.cta_rows = self.q_stages * self.tile_m\n", "rows_per_head = seqlen_q * self.gqa_ratio\n",
                 "task_heads = heads_kv\n", "rows_per_head = seqlen_q\n", "task_heads = heads_q\n",
                 "self.task_rows = self.cta_rows * self.cta_group\n",
                 "num_m_blocks = (rows_per_head + self.task_rows - 1) // self.task_rows\n",
                 "TileScheduler.create(self.scheduler, num_m_blocks, task_heads, batch", "grid=sched.grid_shape()"):
        assert line in sm100, line


# ---- the search judges as the runtime does ------------------------------------------------------------

def test_the_search_judges_for_the_workers_gpu():
    from fa4tune.searches.runner import worker_device

    reported = {"name": "NVIDIA H20", "sm_count": 78, "smem_per_block_bytes": H200.smem_per_block_bytes,
                "l2_bytes": H200.l2_bytes, "cc": "9.0", "driver": "580"}
    assert worker_device("sm90", reported) == H20
    assert worker_device("sm100", reported) is B200          # a GPU of another family: the reference
    assert worker_device("sm90", {}) is H200                  # CPU workers report nothing
    assert worker_device("sm90", {"name": "Fake H200", "sm_count": 132, "cc": "9.0"}) is H200


def test_the_search_rejects_before_compiling_what_the_runtime_would_refuse(monkeypatch):
    import optuna

    from fa4 import kernels
    from fa4tune.progress import Progress
    from fa4tune.searches.runner import SearchSettings
    from fa4tune.inputs.space import load_space
    from fa4tune.searches.study import search_distributions
    from fa4tune.searches.trial_loop import TrialLoop

    small = dataclasses.replace(H200, name="a small-grid device", max_grid_y=100, max_grid_z=100)
    problem = AttentionProblem(1, 128, 128, 200, 200, 64)
    submitted, finished = [], []
    pool = types.SimpleNamespace(submit=lambda kind, payload, compile_key=None: submitted.append(payload) or 1)
    storage = optuna.storages.InMemoryStorage()
    study = optuna.create_study(storage=storage)
    loop = TrialLoop(study=study, storage=storage, arch="sm90", problem=problem,
                     distributions=search_distributions(load_space("sm90"), default_config("sm90", problem, small)),
                     kernels=kernels, pool=pool, settings=SearchSettings(trials=4, peers=()),
                     progress=Progress(quiet=True), owner={"host": "h", "pid": 1, "start": "1"}, name="grid",
                     device=small)
    monkeypatch.setattr(loop, "finish", lambda entry, result: finished.append(result))
    monkeypatch.setattr(loop, "within_budget", lambda number: True)
    entry = types.SimpleNamespace(trial=types.SimpleNamespace(number=0), is_default=False, compile_key=None)
    single = Config.make("sm90", scheduler="single", pack_gqa=False)
    loop.screen_and_submit(entry, single)
    assert finished[-1]["outcome"] == "infeasible" and not submitted
    assert "the limit of the grid's y on a small-grid device" in finished[-1]["error"]
    loop.screen_and_submit(entry, single.replace(scheduler="single_lpt"))
    assert len(submitted) == 1
