"""Read a recipe (recipes/NAME.yaml, Hydra-composed when Hydra is present) into (shape, layout, training).

Recipes are read tolerantly: the student/teacher shape comes from a preset name (`model.preset`,
`student.name`, ...) and/or Megatron-style fields (num_layers, hidden_size, ...); the layout from
`parallel.tp` / `tensor_model_parallel_size` / ...; the step from `train.seq_length`, `train.micro_batch_size`,
`model.recompute_granularity`, `kd.mode`, `kd.top_k`, `kd.loss_impl`. Unknown keys are ignored.
"""
from pathlib import Path

from .memory import Training
from .shapes import Layout, ModelShape, preset

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"


def recipe_path(name: str) -> Path | None:
    p = Path(name)
    if p.suffix in (".yaml", ".yml") and p.is_file():
        return p
    cand = RECIPES / f"{name}.yaml"
    return cand if cand.is_file() else None


def load_recipe(name: str, overrides=()) -> dict:
    path = recipe_path(name)
    if path is None:
        raise FileNotFoundError(name)
    try:
        from hydra import compose, initialize_config_dir
        from omegaconf import OmegaConf
        with initialize_config_dir(config_dir=str(path.parent.absolute()), version_base=None):
            cfg = compose(config_name=path.stem, overrides=list(overrides))
        return OmegaConf.to_container(cfg, resolve=True)
    except ImportError:
        pass
    except Exception:
        if overrides:
            raise
    from omegaconf import OmegaConf
    cfg = OmegaConf.load(path)
    if overrides:
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))
    return OmegaConf.to_container(cfg, resolve=True)


def _flatten(d, prefix=""):
    out = {}
    if isinstance(d, dict):
        for k, v in d.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            if isinstance(v, dict):
                out.update(_flatten(v, key))
            else:
                out[key] = v
    return out


def _pick(flat: dict, aliases, sections=None):
    """First value whose dotted key equals an alias or ends with '.alias' (within `sections` if given)."""
    for a in aliases:
        for k, v in flat.items():
            if sections is not None and not any(k == s or k.startswith(s + ".") for s in sections):
                continue
            if (k == a or k.endswith("." + a)) and v is not None:
                return v
    return None


SHAPE_FIELDS = {
    "num_layers": ("num_layers",), "hidden": ("hidden_size", "hidden"),
    "num_heads": ("num_attention_heads", "num_heads"), "num_kv_heads": ("num_query_groups", "num_kv_heads"),
    "head_dim": ("kv_channels", "head_dim"), "ffn_hidden": ("ffn_hidden_size", "ffn_hidden"),
    "vocab": ("vocab_size", "padded_vocab_size", "vocab"),
    "num_experts": ("num_moe_experts", "num_experts"), "moe_topk": ("moe_router_topk", "moe_topk"),
    "moe_ffn_hidden": ("moe_ffn_hidden_size", "moe_ffn_hidden"),
}


def shape_from(flat: dict, sections) -> ModelShape | None:
    name = _pick(flat, ("preset", "shape", "arch", "name", "hf_name", "model_name"), sections)
    base = None
    if isinstance(name, str):
        for cand in (name, name.split("/")[-1]):
            try:
                base = preset(cand)
                break
            except KeyError:
                continue
    kw = {}
    for f, aliases in SHAPE_FIELDS.items():
        v = _pick(flat, aliases, sections)
        if v is not None:
            kw[f] = int(v)
    tied = _pick(flat, ("share_embeddings_and_output_weights", "tied_embeddings", "tie_word_embeddings"), sections)
    untie = _pick(flat, ("untie_embeddings_and_output_weights",), sections)
    if tied is not None:
        kw["tied_embeddings"] = bool(tied)
    elif untie is not None:
        kw["tied_embeddings"] = not bool(untie)
    if base is None:
        need = ("num_layers", "hidden", "num_heads", "ffn_hidden", "vocab")
        if not all(k in kw for k in need):
            return None
        kw.setdefault("num_kv_heads", kw["num_heads"])
        kw.setdefault("head_dim", kw["hidden"] // kw["num_heads"])
        return ModelShape(name=str(name or "recipe-model"), **kw)
    return base.with_(**kw)


def from_recipe(cfg: dict):
    """(student shape, layout, training) of a composed recipe (a plain dict)."""
    flat = _flatten(cfg)
    student = shape_from(flat, ["student", "model"]) or shape_from(flat, None)
    if student is None:
        raise ValueError("recipe names no student shape (model.preset / student.name or Megatron shape fields)")
    teacher = shape_from(flat, ["teacher"])
    par = ["parallel", "distributed", "model", "train", "student"]
    lay = dict(
        tp=_pick(flat, ("tp", "tensor_model_parallel_size"), par),
        pp=_pick(flat, ("pp", "pipeline_model_parallel_size"), par),
        ep=_pick(flat, ("ep", "expert_model_parallel_size"), par),
        etp=_pick(flat, ("etp", "expert_tensor_parallel_size"), par),
        cp=_pick(flat, ("cp", "context_parallel_size"), par),
        dp=_pick(flat, ("dp", "data_parallel_size"), par),
    )
    lay = {k: int(v) for k, v in lay.items() if v is not None}
    sp = _pick(flat, ("sequence_parallel", "sp"), par)
    world = _pick(flat, ("gpus", "world_size", "num_gpus", "nproc_per_node"), None)
    nodes = _pick(flat, ("nodes", "num_nodes"), None)
    if "dp" not in lay and world:
        w = int(world) * int(nodes or 1)
        lay["dp"] = max(1, w // (lay.get("tp", 1) * lay.get("pp", 1) * lay.get("cp", 1)))
    layout = Layout(sequence_parallel=None if sp is None else bool(sp), **lay)
    tr = {}
    seq = _pick(flat, ("seq_length", "seq_len", "sequence_length", "max_seq_length"), None)
    if seq:
        tr["seq_len"] = int(seq)
    mbs = _pick(flat, ("micro_batch_size", "micro_batch", "mbs"), None)
    if mbs:
        tr["micro_batch"] = int(mbs)
    gbs = _pick(flat, ("global_batch_size", "gbs"), None)
    if gbs and mbs:
        tr["num_microbatches"] = max(1, int(gbs) // (int(mbs) * layout.dp))
    rc = _pick(flat, ("recompute_granularity", "recompute"), None)
    if rc is not None:
        tr["recompute"] = "none" if rc in (None, False, "none", "null", "") else str(rc)
        if tr["recompute"] not in ("full", "selective", "none"):
            tr["recompute"] = "full"
    rn = _pick(flat, ("recompute_num_layers",), None)
    rm = _pick(flat, ("recompute_method",), None)
    if rn is not None and rm == "block":
        tr["recompute_layers"] = int(rn)
    mode = _pick(flat, ("mode",), ["kd", "distill", "distillation", "train"])
    if mode in ("offline", "online", "ce"):
        tr["mode"] = mode
    k = _pick(flat, ("top_k", "topk"), None)
    if k:
        tr["topk"] = int(k)
    impl = _pick(flat, ("loss_impl", "impl"), ["kd", "loss"])
    if impl in ("fused", "chunked", "forward_chunked", "dense"):
        tr["loss"] = impl
    if tr.get("mode") == "online":
        if teacher is None:
            raise ValueError("online recipe names no teacher shape (teacher.preset / teacher.name)")
        tr["teacher"] = teacher
    return student, layout, Training(**tr), teacher
