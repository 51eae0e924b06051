"""Re-stamp tuned entries whose generated code a kernel-source change left instruction for instruction
the same, so a refactor does not throw away the tuning.

The kernel fingerprint covers our sources and the DSL toolchain: any edit of a family's sources makes
every entry tuned before it stale. Where the edit did not change what a configuration compiles to (a
refactor, a constant moved, a change confined to other configurations) the old measurement still
describes the code that runs. For each stale entry this compiles the entry's configuration for the
problem it was tuned on twice on this CPU, with the kernel sources the entry was tuned with and with
today's, disassembles both (nvdisasm) and compares the instructions (names, addresses and offsets left
out). Identical code: the entry gets today's fingerprint. Different code: it stays stale (re-tune it).
A backward entry (`sm90_bwd`) is every kernel of its pass (preprocess, main, postprocesses): each must
be unchanged. The launch code written in Python around the kernels (which buffers, in which order) is
not compared: a change there needs a re-tune however its SASS reads.

The old sources come from a commit (`--rev`, extracted with `git archive`) or a folder (`--old-kernels`,
a copy of `kernels/`); an entry is compared only when the old sources give exactly the fingerprint it
carries (the same sources and the same DSL toolchain), so nothing is re-stamped on a guess.

    python benchmarks/restamp_unchanged_code.py --rev REV [--db fa4/data/best_configs.json]

Exit status 0; the lines say what was re-stamped, what stays stale and why.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


# ---- in a child process: one set of kernel sources -----------------------------------------------

def code_hashes(tasks: list[dict], nvdisasm: str) -> dict:
    """{"fingerprints": {arch: fingerprint}, "hashes": [SASS hash or "error: ..."]} of the kernels
    importable as `fa4.kernels` in this process (the caller puts the sources first on sys.path)."""
    from fa4 import kernels
    from fa4.kernels import AttentionProblem, Config, compiling

    fingerprint = getattr(kernels, "kernel_fingerprint", kernels.source_fingerprint)  # older sources
    backward = tuple(getattr(kernels, "BACKWARD_KERNELS", ()))
    hashes = []
    for task in tasks:
        try:
            config = Config.from_dict(task["arch"], task["config"])
            problem = AttentionProblem(**task["problem"])
            if task["arch"] in backward:
                cubins = backward_cubins(kernels.backward_kernel(task["arch"]), config, problem)
            else:
                cubins = [compiling.compile_cubin(config, problem)]
            hashes.append(hashlib.sha256("".join(sass_hash(c, nvdisasm) for c in cubins).encode()).hexdigest())
        except Exception as exc:   # a configuration these sources cannot build: not comparable
            hashes.append(f"error: {type(exc).__name__}: {str(exc)[:200]}")
    return {"fingerprints": {arch: fingerprint(arch) for arch in (*kernels.ARCHS, *backward)},
            "hashes": hashes, "module": kernels.__file__}


def backward_cubins(module, config, problem) -> list[bytes]:
    """The cubins of a backward configuration's kernels (preprocess, main, postprocesses), in the
    module's order: the pass is all of them, so each must be unchanged. Through the module's
    `_compile_all` because old sources have it too (a helper added now would not be in them)."""
    with tempfile.TemporaryDirectory(prefix="fa4-restamp-bwd-") as tmp:
        compiled = module._compile_all(config, problem, options=f"--keep-cubin --dump-dir {tmp}", tvm_ffi=False)
        return [bytes(compiled[name][0].__cubin__) for name in module.kernel_names(config)]


def sass_hash(cubin: bytes, nvdisasm: str) -> str:
    """sha256 of the instructions of a cubin: each SASS line without its address comment; the
    kernel's symbol names (they carry the Python module path) and section headers are left out."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        text = subprocess.run([nvdisasm, "-c", handle.name], check=True, capture_output=True,
                              text=True).stdout
    body = [re.sub(r"/\*[0-9a-f]{4,}\*/", "", line).strip() for line in text.splitlines()
            if line.strip().startswith("/*")]
    return hashlib.sha256("\n".join(body).encode()).hexdigest()


def child_main(root: str, nvdisasm: str) -> None:
    if root:
        sys.path.insert(0, root)   # `fa4.kernels` from there (a bare `fa4` package around it)
    tasks = json.load(sys.stdin)
    json.dump(code_hashes(tasks, nvdisasm), sys.stdout)


# ---- the parent: entries, both compiles, the database ----------------------------------------------

def old_sources(rev: str | None, old_kernels: str | None, into: Path) -> Path:
    """A folder holding `fa4/kernels` as the old sources, for a child's sys.path."""
    package = into / "fa4"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    if old_kernels:
        subprocess.run(["cp", "-r", old_kernels, str(package / "kernels")], check=True)
    else:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "kernels"], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "x", "-C", str(package)], input=archive, check=True)
    return into


def run_child(root: str, tasks: list[dict], nvdisasm: str) -> subprocess.Popen:
    """A child process computing `code_hashes` of `tasks` with the kernel sources under `root`
    ("": the installed ones); its answer is JSON on its stdout."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    child = subprocess.Popen([sys.executable, __file__, "--child", root, "--nvdisasm", nvdisasm],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd="/")
    child.stdin.write(json.dumps(tasks))
    child.stdin.close()
    return child


def restamp(db_path: Path, root_old: str, root_new: str, nvdisasm: str) -> list[str]:
    """Compare and re-stamp; returns one line per stale entry."""
    from fa4.database import BestConfigDB, update

    probe = run_child(root_new, [], nvdisasm)
    current = json.loads(probe.stdout.read())["fingerprints"]
    if probe.wait():
        raise SystemExit(f"the new sources do not import (exit {probe.returncode})")
    stale = [e for e in BestConfigDB.load(db_path).entries if e.kernel_fingerprint != current.get(e.arch)]
    if not stale:
        return ["no stale entries"]
    tasks = [{"arch": e.arch, "config": e.config, "problem": e.problem} for e in stale]
    children = [run_child(root_old, tasks, nvdisasm), run_child(root_new, tasks, nvdisasm)]
    old, new = (json.loads(child.stdout.read()) for child in children)
    for child in children:
        if child.wait():
            raise SystemExit(f"a compile process failed (exit {child.returncode})")
    lines, same = [], {}
    for entry, old_hash, new_hash in zip(stale, old["hashes"], new["hashes"]):
        if entry.kernel_fingerprint != old["fingerprints"][entry.arch]:
            lines.append(f"{entry.key}: tuned with {entry.kernel_fingerprint}, the old sources give "
                         f"{old['fingerprints'][entry.arch]}: not compared, stays stale")
        elif old_hash.startswith("error") or new_hash.startswith("error"):
            lines.append(f"{entry.key}: not compared ({old_hash if old_hash.startswith('error') else new_hash})")
        elif old_hash != new_hash:
            lines.append(f"{entry.key}: generated code changed: stays stale (re-tune it)")
        else:
            same[entry.key] = entry.kernel_fingerprint
            lines.append(f"{entry.key}: same generated code: {entry.kernel_fingerprint} -> "
                         f"{current[entry.arch]}")

    def change(db):
        for key, fingerprint in same.items():
            entry = db.get(key)
            if entry is not None and entry.kernel_fingerprint == fingerprint:   # not re-tuned meanwhile
                db.put(dataclasses.replace(entry, kernel_fingerprint=current[entry.arch]))

    update(db_path, change)
    lines.append(f"re-stamped {len(same)} of {len(stale)} stale entries in {db_path}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", help="the commit whose kernel sources the stale entries were tuned with")
    ap.add_argument("--old-kernels", help="instead of --rev: a folder with those sources (a copy of kernels/)")
    ap.add_argument("--new-kernels", help="today's sources from a folder instead of the installed fa4.kernels")
    ap.add_argument("--db", default=str(REPO / "fa4" / "data" / "best_configs.json"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--nvdisasm", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child_main(args.child, args.nvdisasm)
        return
    if bool(args.rev) == bool(args.old_kernels):
        ap.error("give --rev or --old-kernels")
    from fa4tune.sm100.sass_build import nvdisasm_path

    with tempfile.TemporaryDirectory(prefix="fa4-restamp-") as tmp:
        root_old = old_sources(args.rev, args.old_kernels, Path(tmp) / "old")
        root_new = old_sources(None, args.new_kernels, Path(tmp) / "new") if args.new_kernels else ""
        for line in restamp(Path(args.db), str(root_old), str(root_new), nvdisasm_path()):
            print(line)


if __name__ == "__main__":
    main()
