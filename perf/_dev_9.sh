python -m pytest --collect-only -q -m gpu tests/test_prefill_gpu.py -k "stale_max or tile_info_smem or ragged_sweep or ragged_persistent or warpgroup_counts or loop_order or rescale_threshold or single_prefill" | grep :: > $OUT/ids.txt
wc -l < $OUT/ids.txt
for k in 0 1 2 3 4 5 6 7; do (awk "NR%8==$k" $OUT/ids.txt > /tmp/ids$k; timeout 140 python -m pytest -q $(cat /tmp/ids$k) > $OUT/shard$k.log 2>&1; echo "shard $k rc=$?" >> $OUT/tests.txt) & done
wait
cat $OUT/tests.txt; for k in 0 1 2 3 4 5 6 7; do tail -n 1 $OUT/shard$k.log; done
grep -h "FAILED\|Error" $OUT/shard*.log | head
cd perf && timeout 60 python ab_prefill.py --case "h64 d64" --variants "default;p_wait_lead=0;fa4" --rounds 14 --reps 1 --out $OUT 2>&1 | grep "^|"
