"""fp32: the fp16 layout with the log-probs as float32 (lossless for an fp32 teacher; twice fp16's log-prob bytes)."""
import numpy as np

from .fp16 import Fp16Encoding


class Fp32Encoding(Fp16Encoding):
    """The fp16 layout with the log-probs as float32: lossless for an fp32 teacher's log-probs, for a student as
    close to its teacher as a quantized copy (its KL to the teacher of the order of fp16's rounding)."""
    name = "fp32"
    dtype = np.float32


ENCODING = Fp32Encoding
