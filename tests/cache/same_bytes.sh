#!/bin/bash
# Are the caches two trees build byte-identical? Builds a tiny cache with every encoding at TP=1 and TP=2 (CPU,
# gloo) from each tree and compares every file:
#   tests/cache/same_bytes.sh OLD_TREE NEW_TREE OUT_DIR      (PYTHON: the interpreter, default python)
# The teacher is tests/teacher/test_pipeline.py's make_teacher (a 4-layer GPT, fixed seed); the samples a fixed
# token array. Used to show a refactor of the cache code changed no byte (its commit message records the result).
set -u
OLD=$1; NEW=$2; OUT=$3; PY=${PYTHON:-python}
HERE=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT/factory"
cat > "$OUT/factory/same_bytes_teacher.py" <<'PYEOF'
def make(tp: int = 1):
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    from test_pipeline import make_teacher
    return make_teacher(tp=tp)
PYEOF
PYTHONPATH="$HERE/teacher:$HERE" "$PY" -c "
import numpy as np; from test_pipeline import tokens_dataset; np.save('$OUT/tokens.npy', tokens_dataset().numpy())"
for side in old new; do
  tree=$OLD; [ $side = new ] && tree=$NEW
  for tp in 1 2; do
    for enc in fp16 fp32 compact topp sampled; do
      case $enc in topp) extra="--top-p 0.9 --top-k 6";; sampled) extra="--samples 8";; *) extra="--top-k 6";; esac
      PYTHONPATH="$tree:$OUT/factory:$HERE/teacher:$HERE:${PYTHONPATH:-}" "$PY" -m torch.distributed.run \
        --nproc-per-node $tp -m megatron_kd cache build --out "$OUT/$side/tp$tp-$enc" \
        --teacher same_bytes_teacher:make --teacher-args "{\"tp\": $tp}" --tokens "$OUT/tokens.npy" \
        --encoding $enc $extra --no-progress > "$OUT/$side-tp$tp-$enc.log" 2>&1 || echo "$side tp$tp $enc: build failed"
    done
  done
done
"$PY" - "$OUT/old" "$OUT/new" <<'PYEOF'
import hashlib, os, sys
def files(d):
    return {os.path.relpath(os.path.join(r, n), d): hashlib.sha256(open(os.path.join(r, n), "rb").read()).hexdigest()
            for r, _, names in os.walk(d) for n in names}
for case in sorted(os.listdir(sys.argv[1])):
    a, b = files(os.path.join(sys.argv[1], case)), files(os.path.join(sys.argv[2], case))
    diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    print(f"{case}: {len(a)} files, " + ("byte-identical" if not diff else "DIFFER: " + ", ".join(diff)))
PYEOF
