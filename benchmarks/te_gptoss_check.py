"""Where Transformer Engine's layer spec departs from GPT-OSS's attention, on one GPU with TE.

Part `core`: megatron-core's TEDotProductAttention and megatron-kd's SDPAttention against a float64 reference of
the same math (causal, GQA, learned per-head sinks in the softmax denominator, a left window of W-1 keys on odd
layers), for each feature alone and together, and for each of TE's attention backends TE will run (each in its own
process: NVTE_FLASH_ATTN / NVTE_FUSED_ATTN / NVTE_UNFUSED_ATTN), with TE's own backend choice (NVTE_DEBUG) kept.
Part `model`: a tiny GPT-OSS (2 layers, MoE, sinks, window, YaRN, clamped GLU) built by megatron-kd's builder on
the SDPA spec, on TE's spec as megatron-core gives it (TE's core attention) and on megatron-kd's TE spec, same
weights: max |logit difference| / max |logit|, with one feature turned off at a time.
Part `hf`: a tiny GPT-OSS Hugging Face checkpoint (4 layers, sliding / full, sinks, YaRN, biased experts) through
Megatron-Bridge as `megatron-kd` builds it (`build_hf_chunks`), against transformers' fp32 logits: SDPA spec, TE
spec (with and without TE's core attention), fp32 and bf16, and the TE spec with each of the provider's fusions
turned off in turn (the fusions `fused=True` keeps under TE), to locate a departure in the HF path.
Part `hf_layers`: the same checkpoint layer by layer (attention, MoE input, router, experts) against transformers.
TE's fp32 GEMMs round through TF32 unless NVIDIA_TF32_OVERRIDE=0 is set, and a rounded router input flips the
top-2 experts of near-tied tokens: run the fp32 parts with NVIDIA_TF32_OVERRIDE=0 to compare the math.

  source .whlte/device_install.sh && PYTHONPATH=$PYTHONPATH:$PWD python3 benchmarks/te_gptoss_check.py \\
      --out $OUT/te_gptoss_check_h200.json
  python3 benchmarks/te_gptoss_check.py --cpu-selfcheck   # the reference against SDPAttention, on a CPU
"""
import argparse
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

HEADS, GROUPS, DIM, SEQ, BATCH, WINDOW = 8, 2, 64, 256, 2, 16
CORE_CASES = {
    "vanilla": {},
    "sinks": {"softmax_type": "learnable"},
    "window": {"window_size": (WINDOW - 1, 0), "window_attn_skip_freq": 2},
    "sinks_window": {"softmax_type": "learnable", "window_size": (WINDOW - 1, 0), "window_attn_skip_freq": 2},
}
BACKENDS = {
    "default": {},
    "flash": {"NVTE_FUSED_ATTN": "0", "NVTE_UNFUSED_ATTN": "0"},
    "fused": {"NVTE_FLASH_ATTN": "0", "NVTE_UNFUSED_ATTN": "0"},
    "unfused": {"NVTE_FLASH_ATTN": "0", "NVTE_FUSED_ATTN": "0"},
}


def reference(q, k, v, sink, window, scale):
    """float64 attention. q [s, b, h, d], k/v [s, b, g, d], sink [h] or None, window: left keys or None
    -> [s, b, h * d]."""
    import torch
    q, k, v = (x.double().permute(1, 2, 0, 3) for x in (q, k, v))  # [b, heads, s, d]
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = q.shape[2]
    scores = (q @ k.transpose(-1, -2)) * scale
    i = torch.arange(s, device=q.device)[:, None]
    j = torch.arange(s, device=q.device)[None, :]
    masked = j > i
    if window is not None:
        masked = masked | (j < i - window)
    scores = scores.masked_fill(masked, float("-inf"))
    if sink is not None:
        col = sink.double().view(1, -1, 1, 1).expand(scores.shape[0], -1, s, 1)
        lse = torch.logsumexp(torch.cat([scores, col], dim=-1), dim=-1, keepdim=True)
    else:
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    out = torch.exp(scores - lse) @ v
    b, h, _, d = out.shape
    return out.permute(2, 0, 1, 3).reshape(s, b, h * d)


def _config(dtype, **kw):
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig
    return TransformerConfig(num_layers=2, hidden_size=HEADS * DIM, num_attention_heads=HEADS,
                             num_query_groups=GROUPS, kv_channels=DIM, attention_dropout=0.0, hidden_dropout=0.0,
                             bf16=dtype == torch.bfloat16, params_dtype=dtype,
                             use_cpu_initialization=not torch.cuda.is_available(), **kw)


def _init(cuda):
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        torch.distributed.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    if ps.model_parallel_is_initialized():  # an earlier part of this process made the groups
        return
    ps.initialize_model_parallel()
    if cuda:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)


def _err(a, ref):
    return float((a.double() - ref).abs().max() / ref.abs().max())


def core_child(cuda: bool) -> dict:
    """Every core case on this process's TE backend (or only SDPAttention on a CPU): {case/layer: errors}."""
    import torch
    from megatron.core.transformer.enums import AttnMaskType
    from megatron_kd.models.attention import SDPAttention
    _init(cuda)
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    out = {}
    for name, kw in CORE_CASES.items():
        cfg = _config(dtype, **kw)
        for layer in (1, 2):
            g = torch.Generator().manual_seed(layer)
            q = torch.randn(SEQ, BATCH, HEADS, DIM, generator=g).to(dev, dtype)
            k = torch.randn(SEQ, BATCH, GROUPS, DIM, generator=g).to(dev, dtype)
            v = torch.randn(SEQ, BATCH, GROUPS, DIM, generator=g).to(dev, dtype)
            sink = (torch.randn(HEADS, generator=g) * 2).to(dev, dtype) if "softmax_type" in kw else None
            window = WINDOW - 1 if "window_size" in kw and layer % 2 == 1 else None
            ref = reference(q, k, v, sink, window, DIM ** -0.5)
            mods = {"sdpa": SDPAttention(cfg, layer, AttnMaskType.causal, "self")}
            if cuda:
                from megatron.core.extensions.transformer_engine import TEDotProductAttention
                mods["te"] = TEDotProductAttention(cfg, layer_number=layer, attn_mask_type=AttnMaskType.causal,
                                                   attention_type="self")
            row = {"window": window, "sink": sink is not None}
            for mname, mod in mods.items():
                params = dict(mod.named_parameters())
                if sink is not None:
                    if "softmax_offset" not in params:
                        row[mname] = f"no softmax_offset parameter; parameters: {sorted(params)}"
                        continue
                    with torch.no_grad():
                        params["softmax_offset"].copy_(sink.reshape(params["softmax_offset"].shape))
                try:
                    with torch.no_grad():
                        o = mod(q, k, v, None, attn_mask_type=AttnMaskType.causal)
                    row[mname] = _err(o, ref)
                except Exception as e:  # noqa: BLE001  (a backend that refuses the case: recorded)
                    row[mname] = f"{type(e).__name__}: {str(e)[:300]}"
            out[f"{name}/layer{layer}"] = row
    return out


def run_core(a) -> dict:
    res = {}
    for bname, env in BACKENDS.items():
        e = dict(os.environ, **env, NVTE_DEBUG="1", NVTE_DEBUG_LEVEL="2")
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--core-child"], env=e, capture_output=True,
                           text=True, timeout=a.child_s)
        lines = (p.stdout + p.stderr).splitlines()
        got = [ln for ln in lines if ln.startswith("RESULT ")]
        picked = sorted({ln.split("Selected backend")[-1].strip()[:80] for ln in lines if "Selected backend" in ln})
        res[bname] = {"env": env, "rc": p.returncode, "selected": picked,
                      "cases": json.loads(got[-1][7:]) if got else None,
                      "tail": None if got else lines[-15:]}
        print(bname, json.dumps(res[bname])[:2000], flush=True)
    return res


def _gpt_oss(backend, **change):
    from megatron_kd.recipe.schema import ModelConfig
    kw = dict(num_layers=2, hidden_size=256, ffn_hidden_size=256, num_attention_heads=8, num_query_groups=2,
              kv_channels=64, normalization="RMSNorm", activation="quick_geglu", activation_func_clamp_value=7.0,
              glu_linear_offset=1.0, add_bias_linear=True, add_qkv_bias=True, position_embedding_type="yarn",
              rotary_base=150000, yarn=dict(rotary_scaling_factor=32.0, original_max_position_embeddings=4096,
                                            beta_fast=32.0, beta_slow=1.0, mscale=None, mscale_all_dim=None,
                                            correction_range_round_to_int=False),
              softmax_type="learnable", window_size=[15, 0], window_attn_skip_freq=2, tie_embeddings=False,
              num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=256, moe_grouped_gemm=False,
              attention_backend=backend, megatron={"moe_token_dispatcher_type": "allgather"})
    kw.update(change)
    return ModelConfig(**kw)


def _copy(src, dst):
    def key(n):
        return (n.replace("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight")
                 .replace("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"))
    import torch
    d = dict(dst.named_parameters())
    s = {(n if n in d else key(n)): p for n, p in src.named_parameters()}
    with torch.no_grad():
        for n, p in d.items():
            if n in s:
                p.copy_(s[n].reshape(p.shape))
    return sorted(set(d) - set(s))


def run_model(a) -> dict:
    import torch
    from megatron_kd.models import builder
    from megatron_kd.recipe.schema import ParallelConfig
    from megatron_kd.runtime import te_compat
    _init(True)
    variants = {"all": {}, "no_sinks": {"softmax_type": "vanilla"},
                "no_window": {"window_size": None, "window_attn_skip_freq": None},
                "rope_not_yarn": {"position_embedding_type": "rope", "yarn": None},
                "dense": {"num_moe_experts": None, "moe_router_topk": 2, "moe_ffn_hidden_size": None,
                          "megatron": {}}}
    toks = torch.randint(0, 512, (2, 128), generator=torch.Generator().manual_seed(7)).cuda()
    pos = torch.arange(128, device="cuda").expand_as(toks)
    real = te_compat.te_attention_unverified
    out = {}
    for name, ch in variants.items():
        for precision in ("fp32", "bf16"):
            row = {}
            try:
                torch.manual_seed(0)
                ref = builder.build_gpt(_gpt_oss("sdpa", **ch), ParallelConfig(), 512, 128, precision)
                with torch.no_grad():
                    a_ = ref(toks, pos, None).float()
                for arm in ("te_core_attention", "megatron_kd_te_spec"):
                    te_compat.te_attention_unverified = (lambda c: False) if arm == "te_core_attention" else real
                    try:
                        torch.manual_seed(0)
                        m = builder.build_gpt(_gpt_oss("te", **ch), ParallelConfig(), 512, 128, precision)
                    finally:
                        te_compat.te_attention_unverified = real
                    missing = _copy(ref, m)
                    with torch.no_grad():
                        b_ = m(toks, pos, None).float()
                    row[arm] = {"err": float((a_ - b_).abs().max() / a_.abs().max()),
                                "err_mean": float((a_ - b_).abs().mean() / a_.abs().mean()), "missing": missing,
                                "core_attention": type(m.decoder.layers[0].self_attention.core_attention).__name__}
                    del m
                del ref
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            out[f"{name}_{precision}"] = row
            print(f"{name}_{precision}", json.dumps(row), flush=True)
    return out


def _tiny_gpt_oss_hf(dev):
    """A random tiny GPT-OSS checkpoint (4 layers, sliding / full, sinks, YaRN, biased experts) in a temporary
    directory: (its path, tokens [2, 64] on dev, transformers' fp32 model of it on dev)."""
    import tempfile

    import torch
    sys.path.insert(0, os.path.join(ROOT, "tests", "hf"))
    import tiny  # noqa: E402  (tests/hf/tiny.py: random tiny HF checkpoints)
    from transformers import AutoModelForCausalLM
    full, sliding = "full_attention", "sliding_attention"
    hf_dir = tempfile.mkdtemp(prefix="te_gptoss_hf_")
    tiny.make_hf(hf_dir, "gptoss", hidden=256, heads=4, kv_heads=2, ffn=256, seed=3, layers=4,
                 config={"layer_types": [sliding, full] * 2})
    toks = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(5)).to(dev)
    return hf_dir, toks, AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).to(dev).eval()


def run_hf(a) -> dict:
    import torch

    from megatron_kd.hf.model import FUSIONS
    from megatron_kd.models.builder import build_hf_chunks
    from megatron_kd.recipe.schema import ModelConfig, ParallelConfig
    from megatron_kd.runtime import te_compat
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    _init(cuda)
    hf_dir, toks, hf = _tiny_gpt_oss_hf(dev)
    seq = toks.shape[1]
    with torch.no_grad():
        ref = hf(toks).logits.float()
        hf16 = hf.to(torch.bfloat16)(toks).logits.float()  # transformers' own bf16 rounding: the yardstick
    del hf
    out = {"transformers_bf16": {"err": float((hf16 - ref).abs().max() / ref.abs().max()),
                                 "err_mean": float((hf16 - ref).abs().mean() / ref.abs().mean())}}
    print("transformers_bf16", json.dumps(out["transformers_bf16"]), flush=True)
    real = te_compat.te_attention_unverified

    def err(backend, precision, grouped, megatron=None, te_core=False):
        te_compat.te_attention_unverified = (lambda c: False) if te_core else real
        try:
            m = ModelConfig(hf_path=hf_dir, attention_backend=backend,
                            megatron={"moe_grouped_gemm": grouped, **(megatron or {})})
            chunks, _ = build_hf_chunks(m, ParallelConfig(etp=1), seq, precision)
        finally:
            te_compat.te_attention_unverified = real
        model = chunks[0].eval()
        pos = torch.arange(seq, device=dev).expand_as(toks)
        with torch.no_grad():
            logits = model(input_ids=toks, position_ids=pos, attention_mask=None).float()[..., :ref.shape[-1]]
        fus = {k: getattr(model.config, k, None) for k in FUSIONS}
        return {"err": float((logits - ref).abs().max() / ref.abs().max()),
                "err_mean": float((logits - ref).abs().mean() / ref.abs().mean()),
                "core_attention": type(model.decoder.layers[0].self_attention.core_attention).__name__,
                "fusions_on": sorted(k for k, v in fus.items() if v)}

    arms = [(f"{b}_{p}_{'grouped' if g else 'sequential'}", dict(backend=b, precision=p, grouped=g))
            for g in (False, True) for p in ("fp32", "bf16") for b in ("sdpa", "te")]
    arms += [(f"te_core_attention_{p}_grouped", dict(backend="te", precision=p, grouped=True, te_core=True))
             for p in ("fp32", "bf16")]
    arms += [(f"te_fp32_grouped_no_{k}", dict(backend="te", precision="fp32", grouped=True, megatron={k: False}))
             for k in FUSIONS]
    for name, kw in arms:
        try:
            out[name] = err(**kw)
        except Exception as e:  # noqa: BLE001
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(name, json.dumps(out[name]), flush=True)
        if cuda:
            torch.cuda.empty_cache()
    return out


def _first(x):
    return x[0] if isinstance(x, (tuple, list)) else x


def _with_bias(x):
    """A megatron-core module's (output, bias) as the sum a layer adds: out + bias where the bias is returned apart."""
    if isinstance(x, (tuple, list)):
        return x[0] + x[1] if len(x) > 1 and x[1] is not None else x[0]
    return x


def _catch(mods, store, conv):
    hooks = []
    for name, mod in mods:
        def hook(_m, _i, out, _n=name):
            store[_n] = conv(out).detach().float().clone()
        hooks.append(mod.register_forward_hook(hook))
    return hooks


def _expert_key(n):
    """A TE grouped expert's parameter name -> the same weight's name in a sequential-experts model."""
    m = re.match(r"(.*mlp\.experts\.)linear_fc(\d)\.(weight|bias)(\d+)$", n)
    if m:
        return f"{m.group(1)}local_experts.{m.group(4)}.linear_fc{m.group(2)}.{m.group(3)}"
    return (n.replace("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight")
             .replace("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"))


def run_hf_layers(a) -> dict:
    """Part `hf_layers`: where in the HF GPT-OSS path a backend departs from transformers' fp32: per decoder
    layer, the attention output (with its bias), the MLP (experts, with biases) and the layer's output, each as
    max |difference| / max |transformers'|; and every weight Bridge loaded into the TE spec against the same
    weight loaded into the SDPA spec (the mapping of TE's fused norms and grouped experts)."""
    import torch

    from megatron_kd.models.builder import build_hf_chunks
    from megatron_kd.recipe.schema import ModelConfig, ParallelConfig
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    if not cuda:  # the script's own check on a CPU (SDPA arm only)
        from megatron_kd.runtime.cpu_patches import apply_cpu_patches
        apply_cpu_patches()
    _init(cuda)
    hf_dir, toks, hf = _tiny_gpt_oss_hf(dev)
    seq = toks.shape[1]
    ref = {}
    mods = []
    for i, layer in enumerate(hf.model.layers):
        mods += [(f"{i}.attn", layer.self_attn), (f"{i}.mlp_in", layer.post_attention_layernorm),
                 (f"{i}.mlp", layer.mlp), (f"{i}.layer", layer)]
    hooks = _catch(mods, ref, _first)
    with torch.no_grad():
        ref["logits"] = hf(toks).logits.float()
    for h in hooks:
        h.remove()
    del hf
    out, params, inner = {}, {}, {}
    # arm -> (backend, megatron overrides): the provider's dispatcher (alltoall on CUDA), and allgather (the
    # builder's, with which TE's grouped experts match the SDPA spec's sequential ones)
    arms = {"sdpa": ("sdpa", {}), "sdpa_allgather": ("sdpa", {"moe_token_dispatcher_type": "allgather"})}
    if cuda:
        arms |= {"te": ("te", {}), "te_allgather": ("te", {"moe_token_dispatcher_type": "allgather"})}
    for arm, (backend, over) in arms.items():
        row = {}
        try:
            m = ModelConfig(hf_path=hf_dir, attention_backend=backend, megatron={"moe_grouped_gemm": True, **over})
            chunks, _ = build_hf_chunks(m, ParallelConfig(etp=1), seq, "fp32")
            model = chunks[0].eval()
            got, mods = {}, []
            inner[arm] = ins = {}
            for i, layer in enumerate(model.decoder.layers):
                mods += [(f"{i}.attn", layer.self_attention), (f"{i}.mlp", layer.mlp), (f"{i}.layer", layer)]
                if not isinstance(layer.pre_mlp_layernorm, torch.nn.Identity):
                    mods.append((f"{i}.mlp_in", layer.pre_mlp_layernorm))

                def pre(_m, args, _i=i):  # the experts' inputs: permuted tokens, tokens per expert, their probs
                    for j, t in enumerate(args[:3]):
                        if torch.is_tensor(t):
                            ins[f"{_i}.experts_in{j}"] = t.detach().float().clone()
                mods_hook = layer.mlp.experts.register_forward_pre_hook(pre)
                hooks_inner = _catch([(f"{i}.router", layer.mlp.router), (f"{i}.experts", layer.mlp.experts)],
                                     ins, _first)
                model._kd_inner_hooks = getattr(model, "_kd_inner_hooks", []) + [mods_hook, *hooks_inner]
            hooks = _catch(mods, got, _with_bias) + model._kd_inner_hooks
            pos = torch.arange(seq, device=dev).expand_as(toks)
            with torch.no_grad():
                got["logits"] = model(input_ids=toks, position_ids=pos, attention_mask=None).float()[
                    ..., :ref["logits"].shape[-1]]
            for h in hooks:
                h.remove()
            for k, r in ref.items():
                if k not in got:
                    continue
                g = got[k] if k == "logits" else got[k].transpose(0, 1)  # megatron keeps [s, b, h]
                g = g.reshape(r.shape)
                row[k] = float((g - r).abs().max() / r.abs().max())
            row["experts"] = type(model.decoder.layers[0].mlp.experts).__name__
            params[arm] = {n: p.detach().float().cpu() for n, p in model.named_parameters()}
            del model, chunks
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        out[arm] = row
        print(f"hf_layers {arm}", json.dumps(row), flush=True)
        if cuda:
            torch.cuda.empty_cache()
    for a, b in (("te", "sdpa"), ("te_allgather", "sdpa_allgather"), ("sdpa_allgather", "sdpa")):
        if a in inner and b in inner:  # the MoE's pieces, arm against arm (same dispatcher: same token order)
            row = {}
            for k, t in inner[a].items():
                u = inner[b].get(k)
                row[k] = (float((t - u).abs().max() / u.abs().max().clamp_min(1e-30))
                          if u is not None and u.shape == t.shape else f"shape {tuple(t.shape)} vs "
                          f"{None if u is None else tuple(u.shape)}")
            out[f"moe_{a}_vs_{b}"] = row
            print(f"moe_{a}_vs_{b}", json.dumps(row)[:3000], flush=True)
    if "te" in params and "sdpa" in params:
        s, diffs, missing = params["sdpa"], {}, []
        for n, p in params["te"].items():
            k = n if n in s else _expert_key(n)
            if k not in s:
                missing.append(n)
                continue
            q = s[k]
            fam = re.sub(r"\d+", "N", n)
            if p.numel() != q.numel():
                diffs[fam] = f"shape {tuple(p.shape)} vs {tuple(q.shape)}"
                continue
            p = p.reshape(q.shape)
            d = float((p - q).abs().max())
            if d > 0:
                e = diffs.setdefault(fam, {"max_abs": 0.0, "shape": list(q.shape), "relations": set()})
                e["max_abs"] = max(d, e["max_abs"])
                rel = {"transposed": lambda x: x.t() if x.dim() == 2 and x.shape[0] == x.shape[1] else None,
                       "rows_interleaved": lambda x: torch.cat([x[0::2], x[1::2]]),
                       "rows_deinterleaved": lambda x: torch.stack([x[: len(x) // 2], x[len(x) // 2:]], 1)
                       .reshape(x.shape),
                       "halves_swapped": lambda x: torch.cat([x[len(x) // 2:], x[: len(x) // 2]])}
                for rname, f in rel.items():
                    y = f(q)
                    if y is not None and torch.equal(p, y):
                        e["relations"].add(rname)
        for e in diffs.values():
            if isinstance(e, dict):
                e["relations"] = sorted(e["relations"])
        out["weights_te_vs_sdpa"] = {"differing": diffs, "not_in_sdpa": missing[:20]}
        print("weights_te_vs_sdpa", json.dumps(out["weights_te_vs_sdpa"])[:3000], flush=True)
        try:  # the TE spec with every weight as the SDPA spec loaded it: is the loading the whole departure?
            m = ModelConfig(hf_path=hf_dir, attention_backend="te", megatron={"moe_grouped_gemm": True})
            model = build_hf_chunks(m, ParallelConfig(etp=1), seq, "fp32")[0][0].eval()
            with torch.no_grad():
                for n, p in model.named_parameters():
                    k = n if n in s else _expert_key(n)
                    if k in s and s[k].numel() == p.numel():
                        p.copy_(s[k].reshape(p.shape).to(p.device))
                pos = torch.arange(seq, device=dev).expand_as(toks)
                lg = model(input_ids=toks, position_ids=pos, attention_mask=None).float()[..., :ref["logits"].shape[-1]]
            r = ref["logits"]
            out["te_with_sdpa_weights"] = {"logits": float((lg - r).abs().max() / r.abs().max())}
        except Exception as e:  # noqa: BLE001
            out["te_with_sdpa_weights"] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
        print("te_with_sdpa_weights", json.dumps(out["te_with_sdpa_weights"]), flush=True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--parts", nargs="+", default=["core", "model"], choices=["core", "model", "hf", "hf_layers"])
    ap.add_argument("--child-s", type=float, default=120)
    ap.add_argument("--core-child", action="store_true")
    ap.add_argument("--cpu-selfcheck", action="store_true")
    a = ap.parse_args()
    if a.core_child or a.cpu_selfcheck:
        import torch
        res = core_child(torch.cuda.is_available() and not a.cpu_selfcheck)
        print("RESULT " + json.dumps(res), flush=True)
        if a.cpu_selfcheck:
            bad = {k: r["sdpa"] for k, r in res.items() if not (isinstance(r["sdpa"], float) and r["sdpa"] < 1e-4)}
            print("selfcheck:", "ok" if not bad else f"FAILED {bad}")
            sys.exit(1 if bad else 0)
        return
    from long_context import env_info  # noqa: E402  (benchmarks/)
    # TE rounds fp32 GEMMs through TF32 unless NVIDIA_TF32_OVERRIDE=0; its fp32 arms are exact only with it
    out = {"benchmark": "TE spec vs GPT-OSS attention", "env": env_info(),
           "NVIDIA_TF32_OVERRIDE": os.environ.get("NVIDIA_TF32_OVERRIDE")}
    if "core" in a.parts:
        out["core"] = run_core(a)
    if "model" in a.parts:
        out["model"] = run_model(a)
    if "hf" in a.parts:
        out["hf"] = run_hf(a)
    if "hf_layers" in a.parts:
        out["hf_layers"] = run_hf_layers(a)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    main()
