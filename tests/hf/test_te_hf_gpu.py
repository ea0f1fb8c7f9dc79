"""Hugging Face checkpoints under Transformer Engine's layer spec, against transformers, on a GPU with TE.

A fresh random tiny Llama 3 checkpoint (its RoPE scaling) is built by megatron-kd in bf16 with
`attention_backend=te` and with `sdpa`; both are compared with transformers' fp32 logits of the same checkpoint.
bf16 tolerance: the TE spec's largest logit error, relative to the largest logit, is under 3e-2, and at most twice
the SDPA spec's error plus 5e-3 (the two specs round differently, but a missing RoPE factor shows as an error of
the logits' own size). GPT-OSS checkpoints (learned sinks, alternate sliding-window / full layers, YaRN, biased
experts, sequential and grouped), built with `attention_backend=auto` where TE imports (TE's layers, what users
get): in fp32 both specs give transformers' logits (largest error under 5e-3 of the largest logit); in bf16 a
random top-2 router flips experts for some tokens, so the largest error says little and the yardstick is
transformers' own bf16 run of the same checkpoint: the TE spec's mean error is at most twice transformers' own plus
5e-3, and at most twice the SDPA spec's plus 5e-3.

fp32 means fp32 GEMMs: TE rounds fp32 GEMM inputs through TF32 unless NVIDIA_TF32_OVERRIDE=0 (torch does not by
default), and a TF32 rounding of a random router's input flips the top-2 experts of near-tied tokens, which moves
those tokens' logits by their own size; so tests/conftest.py sets NVIDIA_TF32_OVERRIDE=0 before CUDA starts,
and the fp32 test first checks that an fp32 GEMM with TF32 allowed is still fp32-exact.

Run on the device (Bridge and TE installed):
  PYTHONPATH=/tmp/te_site:/tmp/site:$PWD python3 -m pytest -q -m gpu tests/hf/test_te_hf_gpu.py"""
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.bridge]

SEQ = 64  # longer than the sliding window (8): the window changes the logits
FULL, SLIDING = "full_attention", "sliding_attention"
CASES = {  # name: (arch, make_hf keyword arguments)
    "gptoss_sequential": ("gptoss", dict(layers=4, config={"layer_types": [SLIDING, FULL] * 2})),
    "gptoss_grouped": ("gptoss", dict(layers=4, config={"layer_types": [SLIDING, FULL] * 2})),
    "llama3_rope": ("llama", dict(layers=2, config={"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}})),
}


def _error(hf_dir, backend, grouped, tokens, ref, precision="bf16", mean=False, spec=None):
    from megatron_kd.models.builder import build_hf_chunks
    from megatron_kd.recipe.schema import ModelConfig, ParallelConfig
    m = ModelConfig(hf_path=hf_dir, attention_backend=backend,
                    megatron={"moe_grouped_gemm": grouped} if "gptoss" in hf_dir else {})
    chunks, _ = build_hf_chunks(m, ParallelConfig(etp=1), SEQ, precision)
    model = chunks[0].eval()
    if spec is not None:  # the layers megatron-kd built: te, sdpa or local (what a cache records)
        from megatron_kd.teacher.megatron import layer_backend
        spec.append(layer_backend(model))
    pos = torch.arange(SEQ, device="cuda").expand_as(tokens)
    with torch.no_grad():
        logits = model(input_ids=tokens, position_ids=pos, attention_mask=None).float()[..., :ref.shape[-1]]
    if mean:
        return ((logits - ref).abs().mean() / ref.abs().mean()).item()
    return ((logits - ref).abs().max() / ref.abs().max()).item()


def _case(tmp_path, case):
    import tiny
    from transformers import AutoModelForCausalLM
    arch, kw = CASES[case]
    hf_dir = str(tmp_path / case)
    tiny.make_hf(hf_dir, arch, hidden=256, heads=4, kv_heads=2, ffn=256, seed=3, **kw)
    tokens = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(5)).cuda()
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        ref = hf(tokens).logits.float()
        own = hf.to(torch.bfloat16)(tokens).logits.float()
    return hf_dir, tokens, ref, ((own - ref).abs().mean() / ref.abs().mean()).item()


def _gpt_oss_errors(tmp_path, case, candidate):
    """fp32 largest and bf16 mean errors of `candidate` (a backend) and of the SDPA spec, transformers' own bf16
    mean error, and the layers `candidate` built (teacher.megatron.layer_backend)."""
    hf_dir, tokens, ref, own_mean = _case(tmp_path, case)
    grouped, spec = case.endswith("grouped"), []
    fp32 = {b: _error(hf_dir, b, grouped, tokens, ref, "fp32", spec=spec if b == candidate else None)
            for b in (candidate, "sdpa")}
    bf16 = {b: _error(hf_dir, b, grouped, tokens, ref, "bf16", mean=True) for b in (candidate, "sdpa")}
    print(f"{case} ({candidate}, layers {spec[0]}): fp32 max error {fp32}; bf16 mean error {bf16}, transformers' "
          f"own bf16 {own_mean:.3g}")
    return fp32, bf16, own_mean, spec[0]


def _assert_fp32_gemms():
    """cuBLAS computes fp32 GEMMs in fp32 even where TF32 is allowed (NVIDIA_TF32_OVERRIDE=0 took effect)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    a, b = (torch.randn(512, 512, device="cuda", generator=g) for _ in range(2))
    allowed = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        err = ((a @ b).double() - a.double() @ b.double()).abs().max().item()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed
    assert err < 1e-3, f"fp32 GEMMs round through TF32 ({err:.2g}): run with NVIDIA_TF32_OVERRIDE=0 (module docstring)"


def _assert_gpt_oss_bounds(fp32, bf16, own_mean, candidate):
    assert fp32[candidate] < 5e-3 and fp32["sdpa"] < 5e-3, fp32
    assert bf16[candidate] <= 2 * own_mean + 5e-3 and bf16[candidate] <= 2 * bf16["sdpa"] + 5e-3, (bf16, own_mean)


@pytest.mark.parametrize("case", ["gptoss_sequential", "gptoss_grouped"])
def test_gpt_oss_checkpoint_under_auto_with_te_gives_transformers_logits(mcore_te_gpu, tmp_path, case):
    _assert_fp32_gemms()
    fp32, bf16, own_mean, layers = _gpt_oss_errors(tmp_path, case, "auto")
    assert layers == "te"  # TE's layers (linears, norms, experts; megatron-kd's core attention for sinks)
    _assert_gpt_oss_bounds(fp32, bf16, own_mean, "auto")


@pytest.mark.parametrize("case", ["llama3_rope"])
def test_te_spec_logits_match_transformers(mcore_te_gpu, tmp_path, case):
    hf_dir, tokens, ref, _ = _case(tmp_path, case)
    grouped = False
    sdpa = _error(hf_dir, "sdpa", grouped, tokens, ref)
    te = _error(hf_dir, "te", grouped, tokens, ref)
    print(f"{case}: max |logit - transformers' fp32| / max |logit|: te {te:.3g}, sdpa {sdpa:.3g}")
    assert te < 3e-2 and te <= 2 * sdpa + 5e-3, f"{case}: TE spec {te:.3g} vs SDPA spec {sdpa:.3g}"
