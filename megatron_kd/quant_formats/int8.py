"""int8: per-output-channel weight amax, per-tensor input amax."""
from . import QuantFormat, scheme_args

FORMAT = QuantFormat("int8", "INT8_DEFAULT_CFG", lambda i, o: o + 1, weight_bits=8,
                     export={"format": "int-quantized", "weights": scheme_args(8, "int", "channel"),
                             "input_activations": scheme_args(8, "int", "tensor")})
