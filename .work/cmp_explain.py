import sys, torch, fa4
shapes = [(1,1024,32,8,128,True),(8,512,16,16,64,False),(4,4096,32,8,128,True),(1,8192,32,8,128,False),(2,2048,16,2,64,True)]
for b,s,hq,hk,d,c in shapes:
    q=torch.empty(b,s,hq,d,dtype=torch.bfloat16,device="meta"); k=torch.empty(b,s,hk,d,dtype=torch.bfloat16,device="meta")
    e=fa4.explain(q,k,k,causal=c,arch="sm90",device_name="NVIDIA H100 80GB HBM3")
    txt=str(e)
    runs=[l for l in txt.splitlines() if "runs:" in l or "chosen by" in l or "eager:" in l]
    print((b,s,hq,hk,d,c)); print("\n".join("   "+l.strip()[:150] for l in runs))
