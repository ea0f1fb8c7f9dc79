"""nvfp4: per-tensor amax (its block scales are computed on the fly); ModelOpt runs it on CUDA tensors only."""
from . import QuantFormat

FORMAT = QuantFormat("nvfp4", "NVFP4_DEFAULT_CFG", lambda i, o: 2, cuda_only=True)
