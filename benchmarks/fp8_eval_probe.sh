#!/usr/bin/env bash
# FP8 against bf16 early in training, seen closely: the 1.07 B student of te_stack.py's fp8 part (the same shape,
# corpus and learning rate, 40 steps with the warmup of 20), evaluated every 5 steps, once in bf16 and once per FP8
# scaling recipe. Needs Transformer Engine on a GPU and te_stack.py's corpus (--data there).
# Usage: bash benchmarks/fp8_eval_probe.sh DATA_PREFIX OUT_DIR   (logs: OUT_DIR/fp8_eval_probe_{bf16,delayed,tensorwise}.log)
set -u
data=$1; out=$2; mkdir -p "$out"
base="--config-name llama31_8b_to_3b_32k_1xh200 kd=ce data=pydoc data.path=$data data.tokenizer=$(dirname "$data")/tokenizer.json
 data.seq_length=2048 train.iters=40 train.global_batch_size=8 train.micro_batch_size=4 train.lr=3e-4 train.min_lr=3e-5
 train.lr_warmup_iters=20 train.optimizer=adam train.eval_interval=5 train.eval_iters=4 train.save_interval=null
 train.save_at_end=false train.log_interval=5 train.progress=false train.tensorboard=false model.num_layers=22
 model.hidden_size=2048 model.num_attention_heads=16 model.num_query_groups=8 model.kv_channels=128
 model.ffn_hidden_size=5632 model.tie_embeddings=false model.recompute_granularity=null model.recompute_method=null
 model.recompute_num_layers=null"
for arm in "bf16:" "delayed:model.fp8=hybrid model.fp8_recipe=delayed" "tensorwise:model.fp8=hybrid model.fp8_recipe=tensorwise"; do
  name=${arm%%:*}; extra=${arm#*:}
  scratch=$(mktemp -d)
  # shellcheck disable=SC2086
  python3 -m megatron_kd train $base $extra train.save="$scratch" hydra.run.dir="$scratch" > "$out/fp8_eval_probe_$name.log" 2>&1
  echo "$name rc=$?"; grep -iE "eval @|^iter|done:" "$out/fp8_eval_probe_$name.log" | cut -c1-120
  rm -rf "$scratch"
done
