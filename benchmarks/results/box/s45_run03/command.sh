source scripts/box_setup.sh >/dev/null
python3 benchmarks/ab_decode_configs.py vpad:gluon_v_pad=1 vpadalign:gluon_v_pad=1,gluon_copy_align=1 vpadbulk:gluon_v_pad=1,gluon_bulk_copy=1 align:gluon_copy_align=1 --formats q4+rope24,q4+rope,q3+rope24 --points llama8b:8:32768,llama8b:8:131072,llama8b:64:131072,llama70b-tp8:64:131072 --rounds 3 --out $OUT/r/ab_copy.json 2>&1 | grep -v "it/s" > $OUT/r/ab_copy.log
cat $OUT/r/ab_copy.log
