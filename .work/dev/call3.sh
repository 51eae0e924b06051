export PYTHONUNBUFFERED=1
q() { grep -v -i "userwarning\|exe_args"; }
mkdir -p $OUT/b $OUT/w $OUT/t
timeout 230 python3 benchmarks/sm90_bwd_configs.py --jobs 14 --timeout 200 \
   --json $OUT/b/bwd_configs.json 2> >(q > $OUT/b/bwd_configs.log) > $OUT/b/bwd_configs.txt
tail -n 3 $OUT/b/bwd_configs.txt; echo "bwd rows: $(grep -c '"outcome"' $OUT/b/bwd_configs.json)"
(timeout 250 python3 -m pytest -v --tb=line -m gpu tests/gpu/test_varlen_gpu.py tests/gpu/test_transformers_gpu.py \
   "tests/gpu/test_backward_gpu.py::test_each_backward_implementation" -p no:cacheprovider 2>&1 | q > $OUT/t/tests_varlen_backward.txt) &
OUT=$OUT/w timeout 250 bash tests/gpu/run_sm90_suites.sh window 8 -k softcap > /dev/null
wait
for i in 0 1 2 3 4 5 6 7; do grep -E "FAILED|ERROR|passed|failed" /tmp/test_window_softcap_gpu.$i.log | grep -v "%\]" | tail -8; done > $OUT/w/window_softcap_summary.txt
cat $OUT/w/window_softcap_summary.txt | grep -E "passed|failed" ; grep -E "FAILED" $OUT/w/window_softcap_summary.txt | head -20
grep -E "FAILED|passed|failed" $OUT/t/tests_varlen_backward.txt | grep -v "%\]" | tail -15
