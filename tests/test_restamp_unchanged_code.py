"""benchmarks/restamp_unchanged_code.py re-stamps an entry only where the old and today's sources
compile its configuration to the same instructions (CPU compiles, nvdisasm)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fa4 import kernels
from fa4.database import BestConfigDB, Entry
from fa4.kernels import AttentionProblem, Config

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "restamp_unchanged_code.py"
PROBLEM = AttentionProblem(batch=1, seqlen_q=1024, seqlen_k=1024, heads_q=32, heads_kv=8, head_dim=64,
                           dtype="fp16", causal=False)


def _old_fingerprint(old_kernels: Path, arch: str = "sm90") -> str:
    root = old_kernels.parent.parent
    out = subprocess.run([sys.executable, str(SCRIPT), "--child", str(root), "--nvdisasm", "unused"],
                         input="[]", capture_output=True, text=True, check=True, cwd="/")
    return json.loads(out.stdout)["fingerprints"][arch]


def _old_kernels_with(tmp_path: Path, relative: str, before: str, after: str) -> Path:
    """A copy of today's kernel sources (as a `fa4.kernels` package) with one edit in `relative`;
    skips where the DSL or nvdisasm is missing."""
    pytest.importorskip("cutlass")
    try:
        from fa4tune.sm100.sass_build import nvdisasm_path
        nvdisasm_path()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    old = tmp_path / "root" / "fa4" / "kernels"
    shutil.copytree(REPO / "kernels", old, ignore=shutil.ignore_patterns("__pycache__"))
    source = (old / relative).read_text()
    assert before in source
    (old / relative).write_text(source.replace(before, after))
    (old.parent / "__init__.py").write_text("")
    return old


def _restamp(tmp_path: Path, old: Path, entries: list[Entry]) -> tuple[dict, str]:
    """Run the re-stamp over a database of `entries` tuned with the `old` sources: ({sq bucket: the
    fingerprint after}, what it printed)."""
    db_path = tmp_path / "db.json"
    db = BestConfigDB()
    for entry in entries:
        db.put(entry)
    db.save(db_path)
    result = subprocess.run([sys.executable, str(SCRIPT), "--old-kernels", str(old), "--db", str(db_path)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    return {e.seqlen_q_bucket: e.kernel_fingerprint for e in BestConfigDB.load(db_path).entries}, result.stdout


def _entry(poly_columns: int, seqlen: int, fingerprint: str) -> Entry:
    problem = AttentionProblem(**{**PROBLEM.to_dict(), "seqlen_q": seqlen, "seqlen_k": seqlen})
    config = kernels.default_config("sm90", problem).replace(exp2_poly_columns=poly_columns)
    return Entry.from_result(arch="sm90", device="NVIDIA H200", problem=problem, config=config.to_dict(),
                             us=30.0, tflops=300.0, default_us=31.0, peers_us={}, max_err=1e-3,
                             kernel_fingerprint=fingerprint, versions={}, study="s", trial=1)


def test_only_entries_whose_code_is_unchanged_are_restamped(tmp_path):
    # the old sources: today's with other exp2 polynomial coefficients, which only configurations
    # that use the polynomial (exp2_poly_columns > 0) compile differently
    old = _old_kernels_with(tmp_path, "exp2_fit.py", "0.07706677168607712)", "0.0770668)")
    tuned_with = _old_fingerprint(old)
    assert tuned_with != kernels.kernel_fingerprint("sm90")

    after, printed = _restamp(tmp_path, old, [_entry(0, 1024, tuned_with),   # no polynomial: same code
                                              _entry(2, 2048, tuned_with),   # the polynomial: other constants
                                              _entry(0, 4096, "0123456789abcdef")])   # sources we do not have
    assert after == {1024: kernels.kernel_fingerprint("sm90"), 2048: tuned_with, 4096: "0123456789abcdef"}
    assert "re-stamped 1 of 3" in printed


def _backward_entry(dq_accum: str, seqlen: int, fingerprint: str) -> Entry:
    problem = AttentionProblem(**{**PROBLEM.to_dict(), "seqlen_q": seqlen, "seqlen_k": seqlen, "causal": True})
    config = kernels.default_config("sm90_bwd", problem).replace(dq_accum=dq_accum, group_split=1)
    return Entry.from_result(arch="sm90_bwd", device="NVIDIA H200", problem=problem, config=config.to_dict(),
                             us=100.0, tflops=100.0, default_us=101.0, peers_us={}, max_err=1e-2,
                             kernel_fingerprint=fingerprint, versions={}, study="s", trial=1)


def test_a_backward_entry_is_restamped_only_where_all_its_kernels_are_unchanged(tmp_path):
    """A backward pass is several kernels (preprocess, main, postprocess): the old sources pad the
    fragment-ordered dQ postprocess's shared-memory rows differently, which only configurations with
    dq_accum=fragment compile; the bulk entry is re-stamped, the fragment one stays stale."""
    old = _old_kernels_with(tmp_path, "sm90_bwd/prepost.py", "self.row_elems = self.head_dim + 8\n",
                            "self.row_elems = self.head_dim + 16\n")
    tuned_with = _old_fingerprint(old, "sm90_bwd")
    assert tuned_with != kernels.kernel_fingerprint("sm90_bwd")

    after, printed = _restamp(tmp_path, old, [_backward_entry("bulk", 1024, tuned_with),
                                              _backward_entry("fragment", 2048, tuned_with)])
    assert after == {1024: kernels.kernel_fingerprint("sm90_bwd"), 2048: tuned_with}
    assert "re-stamped 1 of 2" in printed
