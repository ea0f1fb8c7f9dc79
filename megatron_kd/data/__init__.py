"""Text to Megatron's indexed datasets, the tokenizers, and the sample order a run trains in."""
