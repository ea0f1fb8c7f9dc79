"""Process groups, seeds and devices: torchrun or single process, NCCL or gloo, and the CPU patches megatron-core needs."""
