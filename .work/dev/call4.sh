export PYTHONUNBUFFERED=1
q() { grep -v -i "userwarning\|exe_args"; }
mkdir -p $OUT/b $OUT/t
timeout 75 python3 benchmarks/sm90_bwd_configs.py --jobs 7 --timeout 70 --shape 2,4096,32,8,128,full \
  --shape 8,1024,16,16,64,causal --shape 4,2048,16,4,64,causal --config default \
  --config "tile_m=64 tile_n=128 q_stages=2 dq_accum=bulk sdp_swap=on scheduler=single_lpt pds_stages=2" \
  --config "tile_m=64 tile_n=128 q_stages=2 dq_accum=bulk sdp_swap=on scheduler=single pds_stages=2" \
  --config "tile_m=128 tile_n=128 q_stages=2 dq_accum=bulk sdp_swap=on scheduler=single pds_stages=2" \
  --config "tile_m=128 tile_n=128 q_stages=2 dq_accum=bulk sdp_swap=on scheduler=single_lpt pds_stages=2" \
  --config "tile_m=64 tile_n=128 q_stages=2 dq_accum=bulk sdp_swap=on scheduler=single_lpt pds_stages=1" \
  --json $OUT/b/bwd_configs_rule.json 2> >(q > $OUT/b/bwd_configs_rule.log) | tee $OUT/b/bwd_configs_rule.txt
timeout 115 python3 -m pytest -v --tb=line -m gpu tests/gpu/test_varlen_gpu.py tests/gpu/test_transformers_gpu.py \
   "tests/gpu/test_backward_gpu.py::test_each_backward_implementation" -k "not test_matches_the_reference" \
   -p no:cacheprovider 2>&1 | q > $OUT/t/tests_varlen_rest.txt
grep -E "FAILED|PASSED|passed|failed" $OUT/t/tests_varlen_rest.txt | sed 's/.*:://' | tail -45
