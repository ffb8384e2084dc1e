"""Register caps (occupancy) of the Gluon exact4 kernel: bench_kv_exact grid at 4 points."""
import os, sys
sys.path.insert(0, "benchmarks")
import bench_kv_exact as B
from weightszip.kernels import paged_decode as pd
pd.KernelConfig.__post_init__ = lambda self: None
B.main(["--kv", ".boxdata/kv_pages_subset.npz", "--format", "exact4", "--k-set", "qwen_8k:K:8",
        "--v-set", "qwen_8k:V:8", "--batches", "8,64", "--contexts", "32768,131072", "--rep", "30",
        "--no-sdpa", "--gluon", "4:2,2:2,2:2:168,4:2:168,2:2:128,4:2:128", "--out", os.environ["OUT"] + "/regs"])
