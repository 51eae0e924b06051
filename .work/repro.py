import os, traceback, torch
os.environ["FA4_BACKWARD"] = "ours"
import fa4
from fa4.kernels import sm90_bwd
B, S, HQ, HKV, D = 2, 16384, 8, 1, 128
g = torch.Generator(device="cuda").manual_seed(0)
q = torch.randn(B, S, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
k = torch.randn(B, S, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
v = torch.randn(B, S, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
do = torch.randn(B, S, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
try:
    print("choose:", __import__("fa4.backward", fromlist=["choose"]).choose(q, k=k, causal=True))
    ours = torch.autograd.grad(fa4.attention(q, k, v, causal=True), (q, k, v), do)
    torch.cuda.synchronize()
    os.environ["FA4_BACKWARD"] = "flash_attn_4"
    peer = torch.autograd.grad(fa4.attention(q, k, v, causal=True), (q, k, v), do)
    for n, a, b in zip("qkv", ours, peer):
        print(n, "max|ours-fa4|", (a.float() - b.float()).abs().max().item(), "max|fa4|", b.float().abs().max().item(),
              "nan", a.isnan().any().item())
except Exception:
    traceback.print_exc()
print("peak GiB", torch.cuda.max_memory_allocated() / 2**30)
