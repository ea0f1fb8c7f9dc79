"""int8_wo: int8 weights with one scale per output channel (amax / 127), activations unquantized (weight-only, as
compressed-tensors' W8A16: w8a16 is its other name). ModelOpt runs it on the CPU as well."""
from . import QuantFormat, scheme_args

FORMAT = QuantFormat("int8_wo", "INT8_WEIGHT_ONLY_CFG", lambda i, o: o, weight_bits=8,
                     export={"format": "int-quantized", "weights": scheme_args(8, "int", "channel"),
                             "input_activations": None}, aliases=("w8a16",))
