source scripts/box_setup.sh
python3 benchmarks/ab_decode_configs.py default vpad:gluon_v_pad=1 --formats q4,q4+rope24,q4+rope --points llama8b:8:32768,llama8b:8:131072,llama8b:64:32768,llama8b:64:131072,llama70b-tp8:8:131072,llama70b-tp8:64:131072 --rounds 5 --out $OUT/r/ab_vpad2.json 2>&1 | grep -v "it/s" > $OUT/r/ab_vpad2.log
cat $OUT/r/ab_vpad2.log
