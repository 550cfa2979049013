#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 S4R_HOME=/tmp/home
m=/tmp/home/models/smollm2-135m; mkdir -p $m && xz -dc .gpu/tokenizer.json.xz > $m/tokenizer.json && cp .gpu/*.json .gpu/*.jinja $m/
S=$(date +%s); t() { echo "== $(( $(date +%s) - S )) s: $*"; }
t pytest; timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tail -3
t bf16; timeout 170 python3 -m s4r.bench.decode_speed --device cuda --random-weights -m llama-3.1-8b-instruct --lengths 32k,64k --prefill 32768 --methods s4r,s4r-fast --ratios 5 --steps 12 --warmup 3 --json $OUT/ds-bf16-pre-nosync.json 2>&1 | tail -12 | tee $OUT/ds-bf16-pre-nosync.log
t done
