"""A run's checkpoints: save, load, resume and read them (megatron-core dist_checkpointing, Megatron-LM layout)."""
