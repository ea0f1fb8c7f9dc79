"""A cache's teacher precision, read from the identity its manifest records (teacher.fp8 under Transformer
Engine adds 'fp8'; older FP8 caches say it only through their backend)."""
from megatron_kd.cache.reader import fp8_precision, mixed_precision_note, teacher_precision


def test_precision_of_each_identity_form():
    assert teacher_precision({"name": "t", "backend": "te"}) == "bf16"
    assert teacher_precision({"name": "t", "backend": "sdpa"}) == "bf16"
    assert teacher_precision({"name": "t"}) == "bf16" == teacher_precision("t")  # a declared teacher name
    assert teacher_precision({"backend": "te+fp8"}) == "fp8"
    ident = {"backend": "te+fp8+fp8_attention", "fp8": fp8_precision("hybrid", "delayed")}
    assert teacher_precision(ident) == "fp8 (hybrid/delayed)"


def test_fp8_recipe_enum_reads_as_its_value():
    class Recipe:  # megatron-core's Fp8Recipe is a str enum: its value names it
        value = "tensorwise"
    assert fp8_precision("hybrid", Recipe()) == "hybrid/tensorwise"


def test_note_only_when_precisions_differ():
    bf16, fp8 = {"backend": "te"}, {"backend": "te+fp8", "fp8": "hybrid/tensorwise"}
    assert mixed_precision_note({"a": bf16, "b": dict(bf16)}) is None
    assert mixed_precision_note({"a": fp8, "b": dict(fp8)}) is None
    note = mixed_precision_note({"a": bf16, "b": fp8})
    assert "a: bf16" in note and "b: fp8 (hybrid/tensorwise)" in note and note.count(".") <= 1
