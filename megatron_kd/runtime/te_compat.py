"""Transformer Engine beside megatron-core's own layers, as NeMo / Megatron-Bridge containers run them.

What goes wrong there unless handled, each with no word from the libraries:

- Weight-gradient accumulation fusion. megatron-core's config flag `gradient_accumulation_fusion` turns it on for
  TE's linears (TE fuses it itself) and for megatron-core's own ColumnParallelLinear / RowParallelLinear, which need
  apex's `fused_weight_gradient_mlp_cuda` and refuse to build without it. A TE layer spec still has one such layer:
  the output layer (our fused loss computes its gradient itself). `build_with_te_wgrad_fusion` builds a model with
  the flag on for TE and off for megatron-core's own linears where apex is missing, so TE keeps its fusion.
- Experts in place. megatron-core's expert MLP adds the bias to linear_fc2's output in place (scaled by the router
  probability); TE's Linear returns a view from its autograd function, which autograd refuses to modify in place.
  `fix_te_moe_spec` gives sequential experts a TE row-parallel linear that returns a tensor of its own.
- Attention sinks and sliding windows. TE's core attention has not been measured against transformers for
  models with learned sinks or alternate sliding-window layers (GPT-OSS): `te_attention_unverified` names those
  models and their TE layer spec (models/builder) keeps TE's linears, norms and experts with megatron-kd's core
  attention. FP8 for them is refused (`te_attention_refusal`) until it is measured against bf16.
- Clamped GLU with a fused bias. megatron-core's fused bias + quick-GEGLU (`bias_activation_fusion`, on in TE
  builds and in Bridge's GPT-OSS provider) clamps the linear layer's output before it adds the bias, where the
  unfused path and transformers clamp the biased value: GPT-OSS experts then depart from transformers wherever the
  clamp engages. `bias_activation_fusion_exact` keeps that fusion off for clamped activations (and where
  megatron-core has no fused kernel), decided on the final fields.
- Two cuDNNs in one process. TE may load a system cuDNN before torch's own pip cuDNN; torch's cuDNN attention then
  fails its version check and SDPA falls back to a slower kernel. `cudnn_clash` reads which cuDNN files this
  process has mapped and says which two, and `torch_cudnn_env` gives the environment that avoids it.
"""
import contextlib
import glob
import importlib.util
import os
import sys


def te_attention_unverified(config) -> bool:
    """A model whose attention TE's spec does not reproduce: learned (or off-by-one) sinks, or a sliding window.
    `config`: anything with megatron-core's field names (a recipe's ModelConfig, a TransformerConfig, a provider)."""
    return getattr(config, "softmax_type", "vanilla") != "vanilla" or bool(getattr(config, "window_size", None))


def bias_activation_fusion_exact(config) -> bool:
    """Whether megatron-core has a fused bias + activation for `config` (a recipe's ModelConfig, or anything with
    megatron-core's field names) that computes what the unfused path does: GELU or SwiGLU, and no clamp (GPT-OSS's
    fused kernel clamps before the bias is added; other activations have no fused kernel, and megatron-core's MLP
    raises for them)."""
    if getattr(config, "activation_func_clamp_value", None) is not None:
        return False
    act = getattr(config, "activation", None)
    if isinstance(act, str):  # a recipe's ModelConfig
        return act in ("swiglu", "gelu")
    name = getattr(getattr(config, "activation_func", None), "__name__", "")
    return name == "gelu" or (name == "silu" and bool(getattr(config, "gated_linear_unit", False)))


def own_attention_cp_refusal(section: str, cp: int) -> str:
    """The sentence that refuses parallel.cp > 1 for a model whose sinks / windows run in megatron-kd's core
    attention (under TE's layers too), which has no context-parallel exchange."""
    return (f"parallel.cp={cp}: {section} has attention sinks / sliding windows (GPT-OSS), which run in "
            "megatron-kd's core attention (with or without Transformer Engine), and that has no context-parallel "
            "exchange; set parallel.cp=1 (for memory: recompute more layers, or spread the experts with parallel.ep)")


def te_attention_refusal(key: str, fp8) -> str:
    """The sentence that refuses FP8 for such a model, with the fix. `key`: the recipe key that set FP8
    (`model.fp8`, or `model.megatron.fp8` where the pass-through sets it)."""
    return (f"{key}={fp8}: FP8 has not been checked against bf16 for models with attention sinks / sliding "
            f"windows (GPT-OSS); set {key}=null (the model then trains in bf16 on Transformer Engine's "
            "layers with megatron-kd's sink / window attention)")


def apex_wgrad_available() -> bool:
    """apex's weight-gradient GEMM extension, which megatron-core's own linears need for the fusion."""
    try:
        import megatron.core.tensor_parallel.layers as layers
    except Exception:
        return False
    return bool(getattr(layers, "_grad_accum_fusion_available", False))


@contextlib.contextmanager
def _allow_fusion_flag():
    import megatron.core.tensor_parallel.layers as layers
    before = layers._grad_accum_fusion_available
    layers._grad_accum_fusion_available = True
    try:
        yield
    finally:
        layers._grad_accum_fusion_available = before


def local_linears_unfused(model) -> int:
    """Turn the weight-gradient fusion off on megatron-core's own (non-TE) linears of `model`; returns how many."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    n = 0
    for mod in model.modules():
        if isinstance(mod, (ColumnParallelLinear, RowParallelLinear)) and mod.gradient_accumulation_fusion:
            mod.gradient_accumulation_fusion = False
            n += 1
    return n


def build_with_te_wgrad_fusion(config, build):
    """`build()` a model whose config may ask for gradient_accumulation_fusion. Where apex's extension is missing,
    megatron-core's own linears would refuse the flag at construction: build with the check lifted, then turn the
    fusion off on exactly those linears (they then accumulate through autograd, as without the flag); TE's linears
    keep it. Where apex is present, or the flag is off, this is `build()`."""
    if not getattr(config, "gradient_accumulation_fusion", False) or apex_wgrad_available():
        return build()
    with _allow_fusion_flag():
        model = build()
    local_linears_unfused(model)
    return model


_EXPERT_TE_FC2 = []
# The class's name: Megatron-Bridge finds how to split or gather a weight by its module's class name, so its
# loaders are told this one is row-parallel (megatron_kd/hf registers it)
EXPERT_TE_FC2_NAME = "ExpertTERowParallelLinear"


def _expert_te_row_linear():
    if _EXPERT_TE_FC2:
        return _EXPERT_TE_FC2[0]
    from megatron.core.extensions.transformer_engine import TERowParallelLinear

    class ExpertTERowParallelLinear(TERowParallelLinear):
        """TE's row-parallel linear for sequential experts: the output is returned as a tensor of its own, not the
        view TE's autograd function hands back, so megatron-core's in-place bias add (scaled by the router
        probability) is allowed. One copy of the expert's [tokens, hidden] output; the math is unchanged."""

        def forward(self, x):
            out, bias = super().forward(x)
            if out.requires_grad and out._is_view():
                out = out.clone()
            return out, bias

    assert ExpertTERowParallelLinear.__name__ == EXPERT_TE_FC2_NAME
    _EXPERT_TE_FC2.append(ExpertTERowParallelLinear)
    return ExpertTERowParallelLinear


def spec_submodules(spec):
    """A ModuleSpec's or (megatron-core 0.19) functools.partial's submodules."""
    return spec.submodules if hasattr(spec, "submodules") else spec.keywords["submodules"]


def fix_te_moe_spec(spec):
    """TE layer spec of a MoE model with sequential experts (moe_grouped_gemm=false): experts' linear_fc2 ->
    ExpertTERowParallelLinear (in place). Grouped experts and dense MLPs are left as they are."""
    try:
        experts = spec_submodules(spec_submodules(spec_submodules(spec).mlp).experts)
    except (AttributeError, KeyError, TypeError):
        return spec
    from megatron.core.extensions.transformer_engine import TERowParallelLinear
    if getattr(experts, "linear_fc2", None) is TERowParallelLinear:
        experts.linear_fc2 = _expert_te_row_linear()
    return spec


def _cudnn_dirs(maps_text: str) -> dict:
    """{directory: [cuDNN library names]} of the cuDNN files a /proc/PID/maps text shows mapped."""
    dirs = {}
    for line in maps_text.splitlines():
        path = line.split()[-1] if line.split() else ""
        name = os.path.basename(path)
        if name.startswith("libcudnn") and ".so" in name:
            dirs.setdefault(os.path.dirname(path), set()).add(name)
    return {d: sorted(n) for d, n in dirs.items()}


def torch_cudnn_dir() -> str | None:
    """The directory of the pip cuDNN torch's CUDA wheels load (package nvidia-cudnn-*), or None (a container's torch
    links the system cuDNN, the one every library there shares)."""
    try:
        spec = importlib.util.find_spec("nvidia.cudnn")
    except (ImportError, ValueError):
        return None
    for base in (spec.submodule_search_locations or []) if spec else []:
        lib = os.path.join(base, "lib")
        if glob.glob(os.path.join(lib, "libcudnn*.so*")):
            return lib
    return None


def torch_cudnn_env(env: dict | None = None) -> dict | None:
    """The environment that makes every library of a new process load torch's own cuDNN first (its directory first
    on LD_LIBRARY_PATH), or None where nothing needs changing."""
    env = dict(os.environ if env is None else env)
    lib = torch_cudnn_dir()
    if lib is None:
        return None
    path = env.get("LD_LIBRARY_PATH", "")
    if path.split(":")[0] == lib:
        return None
    env["LD_LIBRARY_PATH"] = lib + (":" + path if path else "")
    return env


def cudnn_clash(maps_text: str | None = None) -> str | None:
    """A one-sentence warning when this process has cuDNN libraries mapped from two directories (two versions), or
    torch's cuDNN fails its own version check; None when one cuDNN serves every library."""
    if maps_text is None:
        try:
            with open("/proc/self/maps") as f:
                maps_text = f.read()
        except OSError:
            maps_text = ""
    dirs = _cudnn_dirs(maps_text)
    import torch
    problem = None
    if len(dirs) > 1:
        problem = "cuDNN is loaded from " + " and ".join(sorted(dirs))
    if problem is None and torch.cuda.is_available():
        try:
            torch.backends.cudnn.version()
        except RuntimeError as e:  # torch's own check: "cuDNN version incompatibility: ..."
            problem = str(e).splitlines()[0]
    if problem is None:
        return None
    lib = torch_cudnn_dir()
    fix = (f"export LD_LIBRARY_PATH={lib}:$LD_LIBRARY_PATH before starting (torch's cuDNN first)" if lib else
           "give every library the same cuDNN (LD_LIBRARY_PATH / CUDNN_PATH)")
    return (f"{problem}: two cuDNN versions in one process make torch's cuDNN attention fail its version check and "
            f"SDPA fall back to a slower kernel; fix: {fix}")


def reexec_with_torch_cudnn() -> None:
    """Where torch brings its own pip cuDNN and Transformer Engine is installed, restart this process once with
    torch's cuDNN first on LD_LIBRARY_PATH (the loader reads it only at start), so TE cannot load another cuDNN
    first. MEGATRON_KD_NO_CUDNN_REEXEC=1 turns it off; a container whose torch uses the system cuDNN is left alone."""
    if os.environ.get("MEGATRON_KD_NO_CUDNN_REEXEC") == "1" or importlib.util.find_spec("transformer_engine") is None:
        return
    env = torch_cudnn_env()
    if env is None:
        return
    env["MEGATRON_KD_NO_CUDNN_REEXEC"] = "1"  # once: never loop
    argv = list(getattr(sys, "orig_argv", None) or [sys.executable] + sys.argv)
    os.execve(sys.executable, [sys.executable] + argv[1:], env)
