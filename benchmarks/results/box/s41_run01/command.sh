# Session 41 (any card): restore and offload with aligned arena slices (HostArena(align=)) at 16 B,
# 4 KiB and 2 MiB, paired rounds.
source scripts/box_setup.sh
timeout 280 python3 benchmarks/bench_restore.py --kv .boxdata/kv_pages_subset.npz --sweep "" --repeats 5 --max-len 8 \
  --align-sweep 16,4096,2097152 --align-rounds 7 --out $OUT/r/restore_L8 > $OUT/r/restore_L8.log 2>&1
echo "== exit $?"; grep -E '^\||^align_sweep|"ratio"|bit_exact|equal_rust|Error' $OUT/r/restore_L8.log | cut -c1-1500; tail -5 $OUT/r/restore_L8.log
