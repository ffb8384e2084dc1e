source scripts/box_setup.sh > /dev/null
python3 benchmarks/ab_decode_configs.py default fold:gluon_rope_fold=1 --formats q4+rope24,q4+rope,q3+rope24,q3.5+rope --points llama8b:8:32768,llama8b:8:131072,llama8b:64:32768,llama8b:64:131072,llama70b-tp8:64:131072 --rounds 5 --out $OUT/r/ab_fold5.json 2>&1 | grep -v "it/s" > $OUT/r/ab_fold5.log
cat $OUT/r/ab_fold5.log
