#!/usr/bin/env bash
# Eighth session (kind nvidia-h200; carry .whl and .carry_ab with base.tar = git archive
# of cfb7438; COMMIT=<sha> literally): the throughput workload, base and this tree
# alternating (2 rounds), then batch-1 latency at TP = 1 the same way (1 round).
source benchmarks/h200/setup.sh
ab_throughput 2
ab_latency 1 1
for f in $OUT/thr_head_1.json; do python3 - "$f" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for b in d["results"]["step_summary"]:
    print(b)
PY
done
