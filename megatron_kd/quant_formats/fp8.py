"""fp8: per-tensor amax of weights and inputs."""
from . import QuantFormat, scheme_args

FORMAT = QuantFormat("fp8", "FP8_DEFAULT_CFG", lambda i, o: 2, weight_bits=(4, 3),
                     export={"format": "float-quantized", "weights": scheme_args(8, "float", "tensor"),
                             "input_activations": scheme_args(8, "float", "tensor")})
