"""The peer backends behind one protocol and one registry (`fa4.backends`).

What holds "adding a peer is one module and its test": a fake peer registered here, and nowhere else,
is compared by dispatch, explained, run by fa4.attention (chosen and forced), timed by the harness,
asked for by the bench, read by the host-time table, drawn in the report with its own colour and
recorded with its version; and no other list of the peers' names or titles is left in the sources.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass, field, replace
from importlib import metadata
from pathlib import Path
from typing import Optional

import pytest
import torch

import fa4
from fa4 import backends, dispatch, fallback
from fa4.checks import UnsupportedInputError
from fa4.kernels import AttentionProblem
from fa4.reference import attention_fp32 as reference
from test_runtime import fake, qkv  # noqa: F401  (fake: the fixture)
from test_runtime_dispatch import measured

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class FakePeer:
    """A peer as a new module would declare it: SDPA underneath, no LSE, calls recorded."""

    name: str = "fake_peer"
    title: str = "Fake Peer"
    color: str = "#123456"
    distribution: Optional[str] = "pytest"  # any installed distribution: its version is recorded
    compiles_on_first_call: bool = False
    expand_kv_if_refused: bool = True
    direct_row: Optional[str] = "Fake Peer called directly"
    refuse_gqa: bool = False
    calls: list = field(default_factory=list, compare=False)

    def unavailable(self) -> Optional[str]:
        return None

    def supports(self, problem) -> Optional[str]:
        return f"{self.title} returns no LSE" if problem.return_lse else None

    def runner(self, causal):
        def run(q, k, v, scale, return_lse):
            if self.refuse_gqa and q.shape[2] != k.shape[2]:
                raise RuntimeError(f"{self.title}: no GQA")
            self.calls.append(tuple(q.shape))
            return fallback.sdpa_attention(q, k, v, causal, scale, False)[0], None

        return run

    def direct_call(self, q, k, v, causal):
        return self.runner(causal), ""


@pytest.fixture
def fake_peer():
    peer = backends.register(FakePeer())
    yield peer
    del backends.REGISTRY[peer.name]


# --- the registry -----------------------------------------------------------------------------------

def test_every_peer_implements_the_protocol_with_a_colour_of_its_own():
    from fa4tune.report.draw import impl_colors

    assert backends.peer_names() == ("flash_attn_4", "sdpa_cudnn", "sdpa_flash")
    assert all(isinstance(peer, backends.Backend) for peer in backends.peers())
    colors = impl_colors()
    assert len(set(colors.values())) == len(colors), colors
    assert [backends.title(n) for n in backends.implementations()] == [
        "ours", "flash-attn-4", "SDPA cuDNN", "SDPA flash (FA2)"]
    assert backends.title("no_such_backend") == "no_such_backend"  # a file from another version
    with pytest.raises(ValueError, match="unknown backend 'xformers'; known: ours, flash_attn_4"):
        backends.get("xformers")


def test_register_refuses_what_would_break_a_table(fake_peer):
    with pytest.raises(ValueError, match="registered already"):
        backends.register(FakePeer(color="#654321"))
    for name in ("ours", "auto"):
        with pytest.raises(ValueError, match="reserved"):
            backends.register(FakePeer(name=name, color="#654321"))
    with pytest.raises(ValueError, match="lower-case identifier"):
        backends.register(FakePeer(name="Fake-2", color="#654321"))
    with pytest.raises(ValueError, match="color #123456 is fake_peer's already"):
        backends.register(FakePeer(name="fake_two"))
    with pytest.raises(ValueError, match="#rrggbb"):
        backends.register(FakePeer(name="fake_two", color="red"))

    @dataclass
    class NoRunner:  # supports, runner and direct_call missing
        name: str = "fake_two"
        title: str = "x"
        color: str = "#654321"
        distribution: Optional[str] = None
        compiles_on_first_call: bool = False
        expand_kv_if_refused: bool = False
        direct_row: Optional[str] = None

        def unavailable(self):
            return None

    with pytest.raises(TypeError, match="does not implement fa4.backends.Backend"):
        backends.register(NoRunner())
    assert backends.peer_names()[-1] == "fake_peer" and "fake_two" not in backends.REGISTRY


def test_what_sdpa_cannot_give_our_semantics_for():
    p = AttentionProblem(1, 128, 256, 8, 2, 64, "fp16", causal=True)
    assert backends.unsupported("flash_attn_4", replace(p, return_lse=True)) is None
    assert backends.unsupported("sdpa_flash", p) is None
    assert backends.unsupported("sdpa_flash", replace(p, return_lse=True)) == (
        "SDPA flash (FA2) returns no LSE (return_lse=True)")
    assert backends.unsupported("sdpa_cudnn", replace(p, return_lse=True)) == (
        "SDPA cuDNN returns no LSE (return_lse=True); SDPA cuDNN with a bottom-right causal mask and "
        "Sq != Sk: torch runs its own flash or memory-efficient kernel for causal_lower_right, not cuDNN")
    assert backends.unsupported("sdpa_cudnn", replace(p, seqlen_q=256)) is None


# --- a registered peer is picked up everywhere ------------------------------------------------------

def test_dispatch_compares_the_registered_peers_only():
    times = {"ours": 30.0, "fake_peer": 10.0}
    assert dispatch.choose(times, {}, "graph").backend == "ours"  # no such peer: its time decides nothing
    backends.register(FakePeer())
    try:
        choice = dispatch.choose(times, {}, "graph")
        assert choice.backend == "fake_peer" and str(choice).startswith("graph: Fake Peer (GPU time 10.0 us")
        # eager calls on a GPU whose host times were measured: none for the new peer yet
        eager = dispatch.choose(times, {"ours": 9.6}, "eager")
        assert eager.backend == "ours" and "Fake Peer left out: no host time measured" in eager.reason
    finally:
        del backends.REGISTRY["fake_peer"]


def test_explain_and_attention_run_a_registered_peer(fake, fake_peer):
    measured(fake.db_path, {"ours": 30.0, "fake_peer": 10.0, "sdpa_cudnn": 40.0})
    q, k, v = qkv()
    e = fa4.explain(q, k, v)
    # graph mode judges GPU time; the shipped H200 host table has no time for it, so eager keeps ours
    assert e.runs == {"eager": "ours", "graph": "fake_peer"}
    assert "under CUDA-graph capture or torch.compile: Fake Peer (GPU time 10.0 us vs ours 30.0 us" in str(e)
    fa4.attention(q, k, v)  # eager: ours, and the graph-only peer once (warm for a later capture)
    out, _ = torch.ops.fa4.attention(q, k, v, False, None, False, None, "error", False)  # graph mode
    assert fake_peer.calls == [tuple(q.shape)] * 2
    torch.testing.assert_close(out.float(), reference(q, k, v, False)[0], rtol=1e-2, atol=1e-2)
    # forced, in every mode; what it does not support is refused in its own words
    assert "runs: Fake Peer (forced: backend='fake_peer')" in str(fa4.explain(q, k, v, backend="fake_peer"))
    fa4.attention(q, k, v, backend="fake_peer")
    assert len(fake_peer.calls) == 3
    with pytest.raises(UnsupportedInputError, match="backend='fake_peer' cannot run these inputs: Fake Peer returns no LSE"):
        fa4.attention(q, k, v, return_lse=True, backend="fake_peer")
    # and with return_lse, auto dispatch leaves it out, saying why
    lse = fa4.explain(q, k, v, return_lse=True)
    assert lse.runs == {"eager": "ours", "graph": "ours"}
    assert any(n.startswith("graph: Fake Peer measured fastest") and "returns no LSE" in n for n in lse.notes)


def test_the_harness_times_a_registered_peer_through_its_runner(fake_peer):
    from fa4tune.workers.peers import peer_available, peer_call

    q, k, v = qkv(hq=4, hkv=2)
    assert peer_available("fake_peer") is None
    call, notes = peer_call("fake_peer", q, k, v, True, 0.125)
    torch.testing.assert_close(call().float(), reference(q, k, v, True, 0.125)[0], rtol=1e-2, atol=1e-2)
    assert notes == {}
    # one that refuses GQA and says it may: timed on K and V expanded to the query heads, and marked
    backends.REGISTRY["fake_peer"] = replace(fake_peer, refuse_gqa=True)
    call, notes = peer_call("fake_peer", q, k, v, True, 0.125)
    assert notes == {"kv_expanded": True}
    backends.REGISTRY["fake_peer"] = replace(fake_peer, refuse_gqa=True, expand_kv_if_refused=False)
    with pytest.raises(RuntimeError, match="Fake Peer: no GQA"):
        peer_call("fake_peer", q, k, v, True, 0.125)


def test_the_bench_asks_for_a_registered_peer_and_records_its_times(tmp_path, fake_peer):
    from fa4tune.benchmark.runner import backend_times, run_bench
    from fa4tune.searches.runner import Progress, SearchSettings

    assert SearchSettings().peers[-1] == "fake_peer"  # a search times it too
    p = AttentionProblem(1, 1024, 1024, 32, 8, 128, "fp16", True)
    doc = run_bench("sm90", [p], db_path=str(tmp_path / "db.json"), processes=1,
                    evaluator="test_search_fakes:FakeEvaluator", api="test_search_fakes",
                    progress=Progress(quiet=True), rounds=1, time_dispatched=False)
    assert [r["variant"] for r in doc["rows"]] == ["tuned", "default", "flash_attn_4", "sdpa_cudnn", "sdpa_flash",
                                                   "fake_peer"]
    # its time at an exact entry's shape goes into the database entry's backend_us
    shape = doc["rows"][0]["shape"]
    rows = [{"shape": shape, "variant": "tuned", "outcome": "ok", "us": 20.0, "lookup": "exact", "db_key": "k"},
            {"shape": shape, "variant": "fake_peer", "outcome": "ok", "us": 15.0}]
    assert backend_times({"rows": rows}) == {"k": {"ours": 20.0, "fake_peer": 15.0}}


def test_the_host_table_the_report_and_the_record_read_the_registry(tmp_path, fake_peer):
    from fa4tune import cli
    from fa4tune.benchmark import host_overhead
    from fa4tune.report import data as report_data, draw as report_draw
    from fa4tune.environment import versions

    run = tmp_path / "overhead.json"
    run.write_text(json.dumps({"device": "NVIDIA H200", "rows": [
        {"name": "fa4.attention(backend='ours')", "host_us": 9.0},
        {"name": "Fake Peer called directly", "host_us": 30.0}]}))
    [h200] = host_overhead.derive([run])["devices"].values()
    assert h200["host_us"] == {"ours": 9.0, "fake_peer": 30.0} and h200["measured"]["fake_peer"] == "called directly"

    assert report_data.impls()[-2:] == ("fake_peer", "dispatched") and report_data.baselines()[-1] == "fake_peer"
    assert report_draw.impl_colors()["fake_peer"] == "#123456"
    row = report_data.ShapeRow("sm90", "NVIDIA H200", {}, "B1 S1024", "bench",
                               {"tuned": {"us": 20.0, "tflops": 500.0}, "fake_peer": {"us": 30.0, "tflops": 333.0}})
    row.compute_speedups()
    assert row.speedup == {"fake_peer": 1.5} and "fake_peer" in report_data.speedup_summary([row])
    [bar] = [t for t in report_draw.comparison_figure([row]).data if t.name == "Fake Peer" and t.yaxis == "y"]
    assert bar.marker.color == "#123456"

    assert versions()["fake_peer"] == metadata.version("pytest")
    assert cli._picked({"eager": {"backend": "fake_peer", "ratio": 1.5}}, "eager") == "Fake Peer 1.5x"


# --- one declaration --------------------------------------------------------------------------------

# Files that name a peer on purpose, and why: none of them lists the peers.
NAMES_A_PEER = {
    # compiles flash-attn-4's own sm100 kernel to compare its SASS with ours: a tool about that package
    "fa4tune/sm100/sass_build.py": {"flash-attn-4", "flash_attn.cute"},
    # compiles flash-attn-4's own sm90 backward kernel to count its SASS beside ours: the same
    "benchmarks/sm90_bwd_sass.py": {"flash-attn-4", "flash_attn.cute"},
    # writes database entries and bench rows as a run would, to damage them
    "benchmarks/fault_injection.py": {"sdpa_cudnn", "flash_attn_4"},
    # reads transformers' FLASH_ATTENTION_DETERMINISTIC, the switch transformers gives flash-attn: no peer
    "fa4/transformers_attention.py": {"FLASH_ATTENTION"},
}


def _strings(path: Path) -> list[str]:
    """The string constants of a Python file, docstrings left out (prose may name a peer)."""
    tree = ast.parse(path.read_text())
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    return [node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]


def test_no_other_list_of_peers_is_left():
    """A peer's name, title and package appear in code only in its module of fa4/backends/ (and in the
    files above, for their reason): everything else reads the registry."""
    words = {w for peer in backends.peers() for w in (peer.name, peer.title, peer.direct_row) if w}
    words |= {"flash_attn.cute", "CUDNN_ATTENTION", "FLASH_ATTENTION"}
    files = [p for folder in ("fa4", "fa4tune", "benchmarks", "kernels") for p in (REPO / folder).rglob("*.py")]
    assert len(files) > 50
    found = {}
    for path in files:
        rel = str(path.relative_to(REPO))
        if rel.startswith("fa4/backends/") and rel != "fa4/backends/__init__.py":
            continue
        hits = {w for text in _strings(path) for w in words if w in text}
        # the files allowed to name a peer do (the scan finds what it looks for), and nothing more
        assert NAMES_A_PEER.get(rel, set()) <= hits, rel
        if hits - NAMES_A_PEER.get(rel, set()):
            found[rel] = sorted(hits - NAMES_A_PEER.get(rel, set()))
    assert found == {}
