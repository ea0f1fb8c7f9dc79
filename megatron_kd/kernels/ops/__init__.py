"""Raw pieces of the fused loss: Triton row kernels and the cuBLAS GEMM helpers. No autograd here."""
