#!/usr/bin/env bash
# Container entrypoint (docker/Dockerfile): distributed commands get one worker per GPU, the rest run as is.
#   docker run --gpus all IMAGE train --config-name llama31_8b_to_3b_32k_1xh200   -> launch/torchrun.sh train ...
#   docker run IMAGE demo | cache ... | data ... | prune ... | export ... | --help  -> megatron-kd ...
#   docker run --gpus all IMAGE launch/torchrun.sh cache build ...                 -> any command, as given
#   docker run -it IMAGE bash                                                      -> bash
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

case "${1:-}" in
"") exec megatron-kd --help ;;
train) exec bash "$here/torchrun.sh" "$@" ;;
demo | cache | data | launch | plan | loss-demo | compare | export | prune | help | -h | --help) exec megatron-kd "$@" ;;
*) exec "$@" ;;
esac
