#!/usr/bin/env bash
# CI job: megatron-kd from a wheel with no extras (torch + the wheel's own dependencies, nothing else).
# Every command that needs no extra finishes; every feature that needs an extra refuses in one sentence naming
# the key and the `pip install 'megatron-kd[EXTRA]'` that brings it, before any work and without a traceback.
# Usage: bash .ci/base_install.sh VENV   (VENV holds the wheel; the commands run outside the checkout)
set -euo pipefail
venv=$(cd "${1:?usage: base_install.sh VENV}" && pwd)
export PATH="$venv/bin:$PATH"
work=$(mktemp -d)
cd "$work"
# the checkout must not shadow the wheel
python - <<'EOF'
import megatron_kd, sys
assert "site-packages" in megatron_kd.__file__, megatron_kd.__file__
for extra in ("modelopt", "transformer_engine", "megatron.bridge", "pyarrow", "lm_eval", "compressed_tensors"):
    try:
        __import__(extra)
    except ImportError:
        continue
    sys.exit(f"base install: {extra} is installed, so this job cannot show that megatron-kd runs without it")
print(f"base install: megatron_kd from {megatron_kd.__file__}, no optional extra present")
EOF

n=0
ok() {  # a command that must finish
  local name=$1; shift
  local t0=$SECONDS
  if ! "$@" > "$work/$name.log" 2>&1; then
    echo "FAILED: $name: $*"; tail -n 30 "$work/$name.log"; exit 1
  fi
  n=$((n + 1)); echo "ok      $name ($((SECONDS - t0)) s)"
}
refuses() {  # a command that must refuse in one sentence naming $2 (and the extra's install)
  local name=$1 want=$2; shift 2
  local rc=0
  "$@" > "$work/$name.log" 2>&1 || rc=$?
  if [ "$rc" -eq 0 ] || grep -q "Traceback" "$work/$name.log" || ! grep -qF -- "$want" "$work/$name.log"; then
    echo "FAILED: $name: expected a one-sentence refusal naming '$want' (exit $rc):"; tail -n 30 "$work/$name.log"
    exit 1
  fi
  n=$((n + 1)); echo "refused $name: $(grep -F -- "$want" "$work/$name.log" | head -n 1 | cut -c1-160)"
}
fast=(train.iters=2 train.eval_interval=2 train.progress=false train.tensorboard=false)

ok data-prepare megatron-kd data prepare --pydoc --output-prefix "$work/data/pydoc" --vocab-size 300
# CE on the teacher's shape: the CE baseline, and the teacher of the online run
ok train-ce megatron-kd train --config-name tiny_cpu kd=ce model=tiny_teacher "${fast[@]}" train.save="$work/ce"
ok train-offline megatron-kd train --config-name tiny_cpu "${fast[@]}" train.save="$work/offline"
ok train-online megatron-kd train --config-name tiny_cpu kd=online teacher.load="$work/ce" "${fast[@]}" \
  train.save="$work/online"
ok train-sampled megatron-kd train --config-name tiny_cpu kd.cache_encoding=sampled kd.cache_samples=8 kd.top_k=null \
  "${fast[@]}" train.save="$work/sampled"
ok train-topp megatron-kd train --config-name tiny_cpu kd.cache_encoding=topp kd.cache_top_p=0.9 "${fast[@]}" \
  train.save="$work/topp"
ok cache-build megatron-kd cache build --recipe tiny_cpu --out "$work/cache" --num-samples 4 --no-progress \
  teacher.load="$work/ce" train.save="$work/cache_run"
ok cache-verify megatron-kd cache verify "$work/cache"
ok cache-inspect megatron-kd cache inspect "$work/cache"
ok compare megatron-kd compare "$work/offline" "$work/online" "$work/sampled"
ok plan megatron-kd plan llama31_8b_to_3b_32k_1xh200
ok launch-dry-run megatron-kd launch --dry-run tiny_cpu
ok demo-small megatron-kd demo --small --no-progress --out "$work/demo"

refuses quant-fp8 "megatron-kd[quant]" megatron-kd train --config-name tiny_cpu kd=ce quant.format=fp8 "${fast[@]}" \
  train.save="$work/q"
refuses te-backend "model.attention_backend" megatron-kd train --config-name tiny_cpu kd=ce \
  model.attention_backend=te "${fast[@]}" train.save="$work/te"
mkdir -p "$work/hf" && printf '{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}\n' > "$work/hf/config.json"
touch "$work/hf/model.safetensors"
refuses teacher-hf "megatron-kd[bridge]" megatron-kd train --config-name tiny_cpu teacher.hf_path="$work/hf" \
  "${fast[@]}" train.save="$work/hft"
printf 'PAR1' > "$work/corpus.parquet"
refuses parquet "megatron-kd[parquet]" megatron-kd data prepare --input "$work/corpus.parquet" \
  --output-prefix "$work/data/pq" --vocab-size 300
echo "base install: $n commands as expected"
