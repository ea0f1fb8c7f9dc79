#!/usr/bin/env bash
# One node, any number of GPUs (or CPU processes): start one worker per GPU with torchrun.
#
#   launch/torchrun.sh train --config-name llama31_8b_to_3b_32k_1xh200 kd.top_k=64
#   launch/torchrun.sh launch/dist_smoke.py          # check the process group before a long job
#
# The first argument is a megatron-kd command (run as `python -m megatron_kd ...`), a path to a .py script,
# or `-m package.module` (e.g. `-m megatron_kd.bridge.run --recipe ...` for Megatron-Bridge).
# Settings come from the environment; every one has a default and every one can be overridden:
#   NPROC_PER_NODE  workers on this node (default: visible GPUs, else 1)
#   NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT   multi-node rendezvous (slurm.sbatch sets them;
#                   NODE_RANK falls back to SLURM_NODEID); one node without MASTER_PORT uses --standalone
#   PYTHON          interpreter (default python3)
#   DRY_RUN=1       print the command instead of running it
set -euo pipefail

if [[ $# -lt 1 ]]; then
    sed -n '2,14p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
    exit 2
fi

PYTHON=${PYTHON:-python3}

count_gpus() {
    # CUDA_VISIBLE_DEVICES wins (Slurm and docker set it); otherwise ask the driver.
    if [[ -n "${CUDA_VISIBLE_DEVICES:-}" ]]; then
        local ids
        IFS=',' read -r -a ids <<<"${CUDA_VISIBLE_DEVICES}"
        echo "${#ids[@]}"
    elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        nvidia-smi -L | grep -c '^GPU'
    else
        echo 0
    fi
}

GPUS=$(count_gpus)
NPROC_PER_NODE=${NPROC_PER_NODE:-$((GPUS > 0 ? GPUS : 1))}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}

# NCCL on our H200 nodes: NVLink multicast (NVLS) must stay off. Defaults only; a value already in the
# environment wins, so a cluster that needs something else just exports it.
: "${NCCL_NVLS_ENABLE:=0}"
: "${TORCH_SYMM_MEM_DISABLE_MULTICAST:=1}"
: "${NVSHMEM_DISABLE_NVLS:=1}"
# Megatron's TP/SP communication overlap needs one hardware queue per device to keep kernel order.
: "${CUDA_DEVICE_MAX_CONNECTIONS:=1}"
: "${TORCH_NCCL_ASYNC_ERROR_HANDLING:=1}"
# One OpenMP thread per worker unless told otherwise: N workers x all cores oversubscribes the node.
: "${OMP_NUM_THREADS:=1}"
export NCCL_NVLS_ENABLE TORCH_SYMM_MEM_DISABLE_MULTICAST NVSHMEM_DISABLE_NVLS CUDA_DEVICE_MAX_CONNECTIONS \
    TORCH_NCCL_ASYNC_ERROR_HANDLING OMP_NUM_THREADS

cmd=("$PYTHON" -m torch.distributed.run --nproc-per-node "$NPROC_PER_NODE")
if [[ "$NNODES" == 1 && -z "${MASTER_PORT:-}" ]]; then
    cmd+=(--standalone)  # picks a free local port: concurrent single-node jobs do not collide
else
    cmd+=(--nnodes "$NNODES" --node-rank "$NODE_RANK"
        --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "${MASTER_PORT:-29500}")
fi

if [[ "$1" == *.py || "$1" == -m ]]; then  # a script, or `-m package.module args` (e.g. megatron_kd.bridge.run)
    cmd+=("$@")
else
    cmd+=(-m megatron_kd "$@")
fi

if [[ "${DRY_RUN:-0}" == 1 ]]; then  # the exact command, with the environment this script settles
    for v in NCCL_NVLS_ENABLE TORCH_SYMM_MEM_DISABLE_MULTICAST NVSHMEM_DISABLE_NVLS CUDA_DEVICE_MAX_CONNECTIONS \
        TORCH_NCCL_ASYNC_ERROR_HANDLING OMP_NUM_THREADS; do
        printf '%s=%q ' "$v" "${!v}"
    done
    printf '%q' "${cmd[0]}"
    printf ' %q' "${cmd[@]:1}"
    echo
    exit 0
fi

echo "[torchrun.sh] node ${NODE_RANK}/${NNODES}: ${NPROC_PER_NODE} workers, ${GPUS} GPUs visible," \
    "NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE}" >&2
exec "${cmd[@]}"
