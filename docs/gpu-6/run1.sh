#!/bin/bash
# One prepared device check: CUDA tests, decode speed and memory of a random-weight 8B at 32k/64k, 4-bit too.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 S4R_HOME=/tmp/home
m=/tmp/home/models/smollm2-135m; mkdir -p $m && xz -dc .gpu/tokenizer.json.xz > $m/tokenizer.json && cp .gpu/*.json .gpu/*.jinja $m/
nvidia-smi -L; python3 -c "import torch, transformers, bitsandbytes; print(torch.__version__, transformers.__version__, bitsandbytes.__version__)"
S=$(date +%s); t() { echo "== $(( $(date +%s) - S )) s: $*"; }
t pytest; timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_random_quant.py 2>&1 | tail -15 | tee $OUT/pytest.log
t bf16; timeout 200 python3 -m s4r.bench.decode_speed --device cuda --random-weights -m llama-3.1-8b-instruct --lengths 32k,64k --prefill 32768 --steps 16 --warmup 4 --json $OUT/ds-bf16.json 2>&1 | tail -25 | tee $OUT/ds-bf16.log
t 4bit; timeout 130 python3 -m s4r.bench.decode_speed --device cuda --random-weights --quant 4bit -m llama-3.1-8b-instruct --lengths 32k --ratios 5 --steps 16 --warmup 4 --json $OUT/ds-4bit.json 2>&1 | tail -15 | tee $OUT/ds-4bit.log
t bench; timeout 100 python3 -c "from s4r_cli.app import main; main()" bench --random-weights -m llama-3.1-8b-instruct --lengths 32k,96k --methods s4r@5 --json $OUT/bench-random.json 2>&1 | tail -30 | tee $OUT/bench.log
t done
