"""w4a8_awq: int4 weights then a second, fp8 per-tensor weight stage, and fp8 activations."""
from . import QuantFormat, awq_floats

FORMAT = QuantFormat("w4a8_awq", "W4A8_AWQ_BETA_CFG", lambda i, o: awq_floats(i, o) + 2)
