"""HFModel: a Hugging Face checkpoint as megatron-core GPTModel chunks (this rank's shards) and back.

Bridge's model provider (a megatron-core TransformerConfig) carries the architecture of config.json: sizes,
GQA, tied embeddings, RoPE base and scaling (Llama 3, YaRN), attention sinks, sliding windows, MoE; the values
its bridges hard-code or drop (GPT-OSS YaRN and layer_types, Llama 3 frequency factors) exact.py sets from
config.json, or refuses when the checkpoint is opened. We set the
parallel layout, precision and run settings on it and build with the caller's layer spec; Bridge's mappings then
copy each HF tensor's slice onto the rank that holds it (TP, PP, EP, VPP), and gather them back on export.
"""
import os

import torch

from . import exact
from .checks import HFCheckpointError, check_architecture, check_hf_dir, check_layout, require_bridge

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Fusions Bridge's providers turn on that need TE / apex / CUDA kernels; the caller's `fused=True` keeps them.
FUSIONS = ("gradient_accumulation_fusion", "masked_softmax_fusion", "bias_activation_fusion", "apply_rope_fusion",
           "persist_layer_norm", "cross_entropy_loss_fusion", "bias_dropout_fusion", "moe_permute_fusion")
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                      "vocab.json", "merges.txt", "chat_template.jinja", "generation_config.json")


def _cpu_mask_patch() -> None:
    """megatron-core's unfused softmax builds its causal / sliding-window masks on "cuda"; on CPU build them
    on the CPU (same values: True = masked). Only the local DotProductAttention uses them."""
    import megatron.core.fusions.fused_softmax as fs
    if getattr(fs, "_megatron_kd_cpu", False):
        return
    fs.get_default_causal_mask = lambda sq: torch.ones(sq, sq, dtype=torch.bool).triu(1)
    fs.get_sliding_window_causal_mask = lambda sq, sk, w: ~torch.ones(sq, sk, dtype=torch.bool).triu(
        sk - sq - w[0]).tril(sk - sq + w[1])
    fs._megatron_kd_cpu = True


def set_fusions(prov, fused: bool, overrides: dict | None = None) -> None:
    """Bridge's provider fusions: all off (fused=False: no TE / apex / CUDA kernels), or Bridge's own settings but
    for those that would not compute the unfused result (a clamped GLU's fused bias + activation); then
    `overrides` (the `megatron:` pass-through, which may set a clamp), whose own bias_activation_fusion wins."""
    from ..runtime.te_compat import bias_activation_fusion_exact
    for k in FUSIONS:
        if hasattr(prov, k) and not fused:
            setattr(prov, k, False)
    for k, v in (overrides or {}).items():
        setattr(prov, k, v)
    if "bias_activation_fusion" not in (overrides or {}) and not bias_activation_fusion_exact(prov):
        prov.bias_activation_fusion = False  # GPT-OSS: megatron-core's kernel clamps before adding the bias


def register_module_types() -> None:
    """Tell Megatron-Bridge's weight mappings how megatron-kd's own layer classes are split: it reads a module's
    parallelism from its class name, and knows megatron-core's and TE's classes only."""
    from megatron.bridge.models.conversion.param_mapping import AutoMapping
    from ..runtime.te_compat import EXPERT_TE_FC2_NAME
    AutoMapping.register_module_type(EXPERT_TE_FC2_NAME, "row")  # a TERowParallelLinear (sequential TE experts)


def needs_sinks_or_window(config) -> bool:
    return getattr(config, "softmax_type", "vanilla") != "vanilla" or bool(getattr(config, "window_size", None))


def local_layer_spec(core_attention=None):
    """A provider -> ModuleSpec function: megatron-core's local spec for the provider's architecture, with
    `core_attention` (e.g. megatron-kd's SDPA attention) in place of Megatron's DotProductAttention if given.
    Models with attention sinks or sliding windows (GPT-OSS) keep Megatron's (unfused) DotProductAttention unless
    the class says `supports_sinks_and_window = True`."""
    def spec(config, vp_stage=None):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        s = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm,
                                     qk_layernorm=config.qk_layernorm, normalization=config.normalization)
        keep = needs_sinks_or_window(config) and not getattr(core_attention, "supports_sinks_and_window", False)
        if core_attention is not None and not keep:
            s.submodules.self_attention.submodules.core_attention = core_attention
        return s
    return spec


def activation_name(act: str, gated: bool) -> str:
    """megatron-kd's ModelConfig.activation of a provider's activation_func name and gated_linear_unit: silu gated
    is swiglu, quick_gelu gated is GPT-OSS's quick_geglu (a gated MLP: fc1 is 2 x ffn wide in the FLOP count)."""
    if gated and act in ("silu", "quick_gelu"):
        return {"silu": "swiglu", "quick_gelu": "quick_geglu"}[act]
    return "gelu" if "gelu" in act else "squared_relu"


class HFModel:
    """One local HF checkpoint directory. Checks it (directory, Bridge, architecture) when made; `key` is the
    recipe key the errors name (teacher.hf_path, model.hf_path)."""

    def __init__(self, path, key: str = "hf_path"):
        self.path, self.key = os.fspath(path), key
        check_hf_dir(self.path, key)
        AutoBridge = require_bridge(key)
        register_module_types()
        check_architecture(self.path, key)
        self.bridge = AutoBridge.from_hf_pretrained(self.path)  # lazy: tensors are read when loaded
        self.hf_config = self.bridge.hf_pretrained.config
        # config.json's fields Bridge drops or hard-codes: read (or refused) now, set on every provider and model
        self.exact = exact.settings(self.hf_config, f"{key}={self.path!r}")

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    def provider(self, parallel, *, precision: str = "fp32", seq_length: int = 4096, layer_spec=None,
                 fused: bool = False, make_vocab_size_divisible_by: int = 128, overrides: dict | None = None,
                 recompute: dict | None = None):
        """Bridge's provider for this checkpoint, set to `parallel` (tp, pp, vpp, cp, ep, etp, sequence_parallel
        attributes, e.g. megatron-kd's ParallelConfig) and finalized. layer_spec: a ModuleSpec or a
        provider -> ModuleSpec function (default: megatron-core's local spec)."""
        p = parallel
        check_layout(self.path, self.key, tp=p.tp, pp=p.pp, vpp=p.vpp, ep=p.ep, etp=p.etp)
        prov = self.bridge.to_megatron_provider(load_weights=False)
        prov.transformer_layer_spec = layer_spec or local_layer_spec()
        cuda = torch.cuda.is_available()
        if not cuda:
            prov.moe_token_dispatcher_type = "allgather"  # alltoall makes a torch.cuda.Stream
            _cpu_mask_patch()
        dtype = DTYPES[precision]
        prov.tensor_model_parallel_size, prov.pipeline_model_parallel_size = p.tp, p.pp
        prov.virtual_pipeline_model_parallel_size = p.vpp
        prov.context_parallel_size, prov.expert_model_parallel_size = p.cp, p.ep
        prov.expert_tensor_parallel_size = self._expert_tp(p, prov)
        prov.sequence_parallel = bool(p.sequence_parallel and p.tp > 1)
        prov.bf16, prov.fp16 = precision == "bf16", precision == "fp16"
        prov.params_dtype = prov.pipeline_dtype = dtype
        if hasattr(prov, "autocast_dtype"):
            prov.autocast_dtype = dtype
        prov.seq_length = seq_length
        # Megatron's padded vocabulary under TP (the padding rows never leave Megatron). At TP=1 the checkpoint's
        # own rows: Bridge 0.6.2 pads the HF embedding only when it splits it (ColumnParallelMapping, tp > 1), so a
        # vocab_size that is not a multiple of make_vocab_size_divisible_by would not load at TP=1
        prov.should_pad_vocab = p.tp > 1
        prov.make_vocab_size_divisible_by = make_vocab_size_divisible_by
        prov.hidden_dropout = prov.attention_dropout = 0.0
        prov.attention_softmax_in_fp32 = True  # as megatron-kd's own builder (megatron-core's default; Bridge: False)
        prov.calculate_per_token_loss = True  # megatron-kd's losses are per-token sums
        exact.apply(prov, self.exact)
        prov.use_cpu_initialization = not cuda
        prov.deallocate_pipeline_outputs = p.pp > 1
        for k, v in (recompute or {}).items():
            setattr(prov, k, v)
        for k in overrides or {}:
            if not hasattr(prov, k):
                raise HFCheckpointError(f"{self.key}: {k!r} is not a field of Bridge's provider (a megatron-core "
                                        "TransformerConfig); check the `megatron:` pass-through keys")
        set_fusions(prov, fused, overrides)  # last: on the final fields (the checkpoint's exact settings, overrides)
        prov.finalize()
        from megatron.core.process_groups_config import ProcessGroupCollection
        prov._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        return prov

    def _expert_tp(self, p, prov) -> int:
        """Expert TP: parallel.etp, else that of the Megatron groups already made (the model's layers split over
        those groups, so a provider of another size would not load), else Megatron's default (TP). MoE layers with
        biases (GPT-OSS) split only at expert TP 1."""
        from megatron.core import parallel_state as ps
        made = ps.get_expert_tensor_parallel_world_size() if ps.model_parallel_is_initialized() else None
        biased = bool(prov.num_moe_experts and prov.add_bias_linear)
        etp = p.etp if p.etp is not None else made if made is not None else (1 if biased else p.tp)
        if made is not None and etp != made and prov.num_moe_experts:
            raise HFCheckpointError(f"{self.key}={self.path!r}: parallel.etp={p.etp} but the Megatron process "
                                    f"groups were made with expert TP {made}; pass the same etp to both")
        if etp > 1 and biased:
            raise HFCheckpointError(f"{self.key}={self.path!r}: its experts have biases, which Megatron splits "
                                    f"only with parallel.etp=1 (got {etp}); set parallel.etp=1"
                                    + ("" if p.etp is not None else " (also when making the Megatron groups)"))
        return etp

    def build(self, parallel, *, load_weights: bool = True, **provider_kw):
        """This rank's model chunks (one, or vpp under virtual pipeline), on the current device, with the
        checkpoint's weights (load_weights=False: randomly initialized, e.g. before loading a Megatron save).
        Returns (chunks, provider); the provider is the chunks' TransformerConfig."""
        from megatron.core import parallel_state as ps
        from ..runtime.te_compat import build_with_te_wgrad_fusion
        prov = self.provider(parallel, **provider_kw)
        prov.perform_initialization = not load_weights
        chunks = []
        vpp = parallel.vpp
        for vp in range(vpp or 1):
            stage = vp if vpp else None
            first = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage)
            last = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage)
            m = build_with_te_wgrad_fusion(prov, lambda: prov.provide(pre_process=first, post_process=last,
                                                                       vp_stage=stage))
            exact.fix_model(m, self.exact)
            if stage is not None:
                m.vp_stage = stage
            if torch.cuda.is_available():
                m.cuda(torch.cuda.current_device())
            chunks.append(m)
        from megatron.core import tensor_parallel
        for m in chunks:
            for name, prm in m.named_parameters():
                if name.endswith("softmax_offset") and parallel.tp > 1 and not hasattr(prm, "tensor_model_parallel"):
                    # learned sinks hold this rank's heads, but megatron-core's DotProductAttention leaves them
                    # unmarked (megatron-kd's SDPAttention marks them itself, and a second mark is an error):
                    # mark them, so weight hashes, grad norms and checkpoints treat them as the TP shards they are
                    tensor_parallel.set_tensor_model_parallel_attributes(prm, True, 0, 1)
            for prm in m.parameters():
                tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(prm)
        if load_weights:
            self.load(chunks)
        return chunks, prov

    def load(self, chunks) -> None:
        """Copy the checkpoint's tensors onto this rank's shards of `chunks` (collective over the model's ranks)."""
        with torch.no_grad():
            self.bridge.load_hf_weights(list(chunks))

    def export(self, chunks, out_dir, *, dtype=None, show_progress: bool = False) -> None:
        """Write `chunks` (all ranks call it; rank 0 writes) as an HF checkpoint: config.json with `dtype`
        (default: the chunks' parameter dtype), safetensors in that dtype, and the source's tokenizer files."""
        import torch.distributed as dist
        params = [p for c in chunks for p in c.parameters()]
        dtype = dtype or (params[0].dtype if params else torch.float32)
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        if rank0:
            os.makedirs(out_dir, exist_ok=True)
        self.bridge.hf_pretrained.config.dtype = dtype  # config.json names the dtype the tensors are in
        self.bridge.save_hf_pretrained(list(chunks), out_dir, show_progress=show_progress, weight_dtype=dtype)
        if rank0:
            import shutil
            for f in HF_TOKENIZER_FILES:  # Bridge copies the tokenizer when transformers loads one; be sure
                src, dst = os.path.join(self.path, f), os.path.join(out_dir, f)
                if os.path.isfile(src) and not os.path.exists(dst):
                    shutil.copy2(src, dst)

    def convert(self, chunks, tensor_for):
        """Bridge's Megatron -> HF mapping of other tensors than the parameters: for each parameter of `chunks`
        for which tensor_for(param_name) gives a tensor of its shape, yields (param_name, {hf_name: tensor}),
        that tensor split and renamed as the export writes the parameter (rows of a fused qkv or gate/up weight
        into q, k, v / gate, up). One process, the chunks' own layout (TP 1: nothing to gather)."""
        bridge = self.bridge._model_bridge
        tasks = bridge.build_conversion_tasks(self.bridge.hf_pretrained, list(chunks))
        for task in tasks:
            if task is None or task.megatron_module is None:
                continue
            t = tensor_for(task.param_name)
            if t is not None:
                yield task.param_name, task.mapping.megatron_to_hf(t, task.megatron_module)

    def te_attention_unverified(self) -> bool:
        """Whether TE's spec would not reproduce this checkpoint's attention (sinks, sliding windows: see
        runtime/te_compat), from Bridge's provider with config.json's exact fields."""
        from ..runtime.te_compat import te_attention_unverified
        prov = self.bridge.to_megatron_provider(load_weights=False)
        exact.apply(prov, self.exact)
        return te_attention_unverified(prov)

    def architecture(self) -> dict:
        """The architecture in megatron-kd's ModelConfig names (for FLOP counts, plans, resume checks)."""
        prov = self.bridge.to_megatron_provider(load_weights=False)
        act = getattr(prov.activation_func, "__name__", "")
        gated = bool(prov.gated_linear_unit)
        return dict(
            num_layers=prov.num_layers, hidden_size=prov.hidden_size, ffn_hidden_size=prov.ffn_hidden_size,
            num_attention_heads=prov.num_attention_heads, num_query_groups=prov.num_query_groups,
            kv_channels=prov.kv_channels, normalization=prov.normalization, layernorm_epsilon=prov.layernorm_epsilon,
            activation=activation_name(act, gated),
            add_bias_linear=prov.add_bias_linear, add_qkv_bias=prov.add_qkv_bias, qk_layernorm=prov.qk_layernorm,
            position_embedding_type="rope" if prov.position_embedding_type in ("rope", "yarn")
            else prov.position_embedding_type,
            rotary_base=int(prov.rotary_base), tie_embeddings=bool(prov.share_embeddings_and_output_weights),
            num_moe_experts=prov.num_moe_experts, moe_router_topk=prov.moe_router_topk,
            moe_ffn_hidden_size=prov.moe_ffn_hidden_size, **exact.recipe_rope_scaling(self.hf_config))


_OPEN = {}


def open_hf(path, key: str):
    """One HFModel per directory and process (Bridge reads config and tokenizer once)."""
    real = os.path.realpath(path)
    if real not in _OPEN:
        _OPEN[real] = HFModel(path, key)
    hf = _OPEN[real]
    hf.key = key
    return hf
