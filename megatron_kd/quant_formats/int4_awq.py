"""int4_awq: 4-bit weights (AWQ, blocks of AWQ_BLOCK inputs), 16-bit activations: w4a16_awq is its other name."""
from . import AWQ_BLOCK, QuantFormat, awq_floats, scheme_args

FORMAT = QuantFormat("int4_awq", "INT4_AWQ_CFG", awq_floats, weight_bits=4,
                     export={"format": "pack-quantized", "weights": scheme_args(4, "int", "group", AWQ_BLOCK),
                             "input_activations": None}, aliases=("w4a16_awq",))
