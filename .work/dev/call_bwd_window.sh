# one device call: backward configurations (partial results kept), then the window/softcap suite
export PYTHONUNBUFFERED=1
mkdir -p $OUT/b $OUT/w
timeout 300 python3 benchmarks/sm90_bwd_configs.py --config-file .work/dev/bwd_configs.txt --jobs 14 --timeout 200 \
   --json $OUT/b/bwd_configs.json 2> >(grep -v -i "userwarning\|exe_args" > $OUT/b/bwd_configs.log) | tee $OUT/b/bwd_configs.txt
echo "bwd rows: $(grep -c '"outcome"' $OUT/b/bwd_configs.json)"
OUT=$OUT/w timeout 245 bash tests/gpu/run_sm90_suites.sh window
for i in 0 1 2 3 4 5 6 7; do echo "=== shard $i"; grep -E "FAILED|ERROR|passed|failed" /tmp/test_window_softcap_gpu.$i.log | tail -12; done > $OUT/w/window_summary.txt
cat $OUT/w/window_summary.txt | tail -40
