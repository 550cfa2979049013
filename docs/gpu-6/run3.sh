#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 S4R_HOME=/tmp/home
m=/tmp/home/models/smollm2-135m; mkdir -p $m && xz -dc .gpu/tokenizer.json.xz > $m/tokenizer.json && cp .gpu/*.json .gpu/*.jinja $m/
S=$(date +%s); t() { echo "== $(( $(date +%s) - S )) s: $*"; }
t 4bit; timeout 150 python3 -m s4r.bench.decode_speed --device cuda --random-weights --quant 4bit -m llama-3.1-8b-instruct --lengths 32k,64k --prefill 32768 --ratios 5 --steps 16 --warmup 4 --json $OUT/ds-4bit.json 2>&1 | tail -8 | tee $OUT/ds-4bit.log
t bench; timeout 170 python3 -c "from s4r_cli.app import main; main()" bench --random-weights -m llama-3.1-8b-instruct --lengths 32k,128k --methods s4r@5,s4r@2.5 --json $OUT/bench-random.json 2>&1 | tail -24 | tee $OUT/bench.log
t done
