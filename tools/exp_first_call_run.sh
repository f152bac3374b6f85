# Device-call script for tools/exp_cp_first_call.py's plugin mode (docs/lab/shared_gpu.md).
set -o pipefail; source tools/device_env.sh; export TSGEN_SHARE_GPUS=1 PYTHONPATH=tools:$PYTHONPATH
s=$SECONDS
EXP_LOG_DIR=$OUT/n1 timeout -k 10 300 python3 -m pytest -q -s -m gpu tests/test_cp_attention_gpu.py -n 1 -p exp_cp_first_call -p no:cacheprovider --timeout 180 > $OUT/n1.txt 2>&1
echo "n1 took $((SECONDS-s)) s"
grep -h -E "^(SLOW|HOST|RESULT.*failed|TEST)|tsgen: timeout" $OUT/n1.txt $OUT/n1/*.txt | cut -c1-200 | head -120
tar czf $OUT/all.tgz -C $OUT n1 n1.txt
