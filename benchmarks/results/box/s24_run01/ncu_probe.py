"""One exact4 Gluon call (and its bf16 mode, and SDPA) at one grid point, for ncu."""
import os, sys
sys.path.insert(0, "benchmarks")
import torch
import bench_kv_exact as B
from weightszip.kernels import DEFAULT_CONFIGS, PagedDecodeAttention
from weightszip.kernels.paged_decode import PAGE_TYPES
Bt, L = int(os.environ.get("PB", 32)), int(os.environ.get("PL", 65536))
sets = {(m, k, l): x for m, k, l, x in B.load_sets([".boxdata/kv_pages_subset.npz"])}
kp, vp = B.llama_pages(sets[("qwen_8k", "K", 8)]), B.llama_pages(sets[("qwen_8k", "V", 8)])
n = Bt * L // 16
k_bf, k_heap, k_off, _ = B.build_pool(kp, None, n, "exact4")
v_bf, v_heap, v_off, _ = B.build_pool(vp, None, n, "exact4")
gen = torch.Generator(device="cuda").manual_seed(0)
perm = torch.randperm(n, device="cuda", generator=gen).to(torch.int32)
bt = perm.view(Bt, L // 16)
q = torch.randn(Bt, 32, 128, dtype=torch.bfloat16, device="cuda", generator=gen)
side = torch.randn(2, Bt, 16, 8, 128, dtype=torch.bfloat16, device="cuda", generator=gen)
cfg = DEFAULT_CONFIGS[PAGE_TYPES["exact4"]]
which = os.environ.get("PW", "x4")
for page_type in (["exact4"] if which == "x4" else ["bf16"]):
    att = PagedDecodeAttention(32, 8, 128, page_type=page_type, window=16, config=cfg, device="cuda")
    att.plan([L] * Bt, bt)
    for _ in range(3):
        if page_type == "exact4":
            o = att.run(q, k_heap, v_heap, k_side=side[0], v_side=side[1], k_offsets=k_off, v_offsets=v_off)
        else:
            o = att.run(q, k_bf, v_bf, k_side=side[0], v_side=side[1])
    torch.cuda.synchronize()
    print(page_type, att.last_split_kernel)
if which == "sdpa":
    kk = torch.randn(Bt, 8, L, 128, dtype=torch.bfloat16, device="cuda")
    qq = torch.randn(Bt, 32, 1, 128, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        torch.nn.functional.scaled_dot_product_attention(qq, kk, kk, enable_gqa=True)
    torch.cuda.synchronize()
