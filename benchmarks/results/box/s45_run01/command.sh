source scripts/box_setup.sh
python3 -m pytest -q -p no:cacheprovider tests/test_kernels_compact.py -k "rotary and gpu" 2>&1 | tail -3 > $OUT/r/gputest.txt
cat $OUT/r/gputest.txt
python3 benchmarks/ab_decode_configs.py default vpad:gluon_v_pad=1 w8:gluon_rope_warps=8 w8vpad:gluon_rope_warps=8,gluon_v_pad=1 --formats q4+rope24,q4+rope,q3+rope24 --points llama8b:8:131072,llama8b:64:131072 --rounds 3 --out $OUT/r/ab_vpad.json 2>&1 | grep -v "it/s" > $OUT/r/ab_vpad.log
tail -4 $OUT/r/ab_vpad.log
python3 benchmarks/bench_decode_attention.py --shapes llama8b --batches 8,64 --contexts 32768,131072 --kernels sdpa,bf16,fp8,q4,q3.5,q3,q4+rope24,q3+rope24,q4+rope --rep 20 --out $OUT/r/fp8cmp 2>&1 | grep -v "it/s" > $OUT/r/fp8cmp.log
tail -12 $OUT/r/fp8cmp.log
