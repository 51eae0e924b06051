import sys, os, json, subprocess, tempfile
sys.path.insert(0, "benchmarks")
import sm90_bwd_sass as S
child = S._PEER_CHILD.replace('options="--gpu-arch sm_90a --keep-cubin --enable-tvm-ffi"', 'options="--gpu-arch sm_90a --keep-cubin --keep-ptx --dump-dir /tmp/peerdump --enable-tvm-ffi"')
os.makedirs("/tmp/peerdump", exist_ok=True)
cfg = S.flash_attn4_config(128, False)
proc = subprocess.run([sys.executable, "-c", child, json.dumps(cfg), "128", "4", "0", "bf16", "/tmp/peer.cubin"], capture_output=True, text=True, env={**os.environ, "CUTE_DSL_ARCH": "sm_90a"})
print(proc.returncode, proc.stderr[-500:])
