#!/usr/bin/env bash
# For the next session (kind nvidia-h200, .whl carried; ~2 min): decode attention by split
# count over the throughput workload's falling batch. At e696bf5 the KV read rate fell from
# 3.8 TB/s at batch 256 to 3.1-3.4 at 64-128: the split rule
# (about two programs per SM) leaves batches from 33 up one split each, and the longest
# contexts then run alone at the end. If a larger split count wins there, change
# decode_num_splits (keeping batch 1 and the preload rule as they are) and A/B the workload.
# Then the 36 layers' GEMMs in one graph by batch size against their read/compute floor:
# cuBLAS, and up to 64 rows the Triton skinny GEMM (gemv.linear, not used by the engine
# for M > 1): if it beats cuBLAS at some batch sizes, route those through it in ops.linear.
source benchmarks/h200/setup.sh
timeout 400 python3 benchmarks/throughput_kernels.py --only splits,chain 2>&1 | tee $OUT/splits_chain.txt | tail -20
