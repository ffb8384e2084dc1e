source scripts/box_setup.sh
python3 benchmarks/ab_decode_configs.py default lanes:gluon_rope_lanes=1 fold:gluon_rope_fold=1 lanesfold:gluon_rope_fold=1,gluon_rope_lanes=1 pos:gluon_rope_pos=1 chains:gluon_rope_chains=2 --formats q4+rope24,q4+rope,q3+rope24 --points llama8b:8:131072,llama8b:64:32768,llama8b:64:131072,llama70b-tp8:64:131072 --rounds 3 --out $OUT/r/ab_after_vpad.json 2>&1 | grep -v "it/s" > $OUT/r/ab_after_vpad.log
cat $OUT/r/ab_after_vpad.log
