"""Structural pruning of a Hugging Face decoder checkpoint, on its files (safetensors + config.json; no transformers,
no Megatron-Bridge): by depth (keep the listed layers) and by MLP width (keep the `ffn_size` channels of largest
weight importance in every layer). The pruned folder is a checkpoint transformers loads, the student that KD
recovers.

Width importance of MLP channel j in a layer: |gate_j| x |up_j| x |down_:,j| (L2 norms of its rows of gate_proj
and up_proj and its column of down_proj), kept in their original order: a weight-only score, with no calibration
data. NVIDIA ModelOpt's Minitron pruning ranks channels, heads and layers by activations on calibration data; it
runs on Megatron-Core models through its own plugin, so it is not used here.
"""
import json
import os
import re
import shutil

from ..errors import PruneError

LAYER = re.compile(r"^(model\.layers\.)(\d+)(\..*)$")
INDEX = "model.safetensors.index.json"



def _shards(src: str) -> list:
    if os.path.isfile(os.path.join(src, INDEX)):
        with open(os.path.join(src, INDEX)) as f:
            return sorted(set(json.load(f)["weight_map"].values()))
    if os.path.isfile(os.path.join(src, "model.safetensors")):
        return ["model.safetensors"]
    raise PruneError(f"{src} has no model.safetensors (or {INDEX}); give a Hugging Face checkpoint folder saved "
                     "with safetensors (transformers' save_pretrained)")


def parse_layers(text: str, n: int) -> list:
    """'0,2,4-7' -> [0, 2, 4, 5, 6, 7], checked against the model's n layers."""
    keep = []
    try:
        for part in str(text).split(","):
            a, _, b = part.strip().partition("-")
            keep += list(range(int(a), int(b) + 1)) if b else [int(a)]
    except ValueError:
        raise PruneError(f"--keep-layers {text!r}: give layer numbers such as 0,2,4-7") from None
    if not keep or sorted(set(keep)) != keep or keep[0] < 0 or keep[-1] >= n:
        raise PruneError(f"--keep-layers {text!r}: give increasing layer numbers from 0 to {n - 1} (the model has "
                         f"{n} layers), e.g. {','.join(str(i) for i in range(0, n, 2))}")
    return keep


def _ffn_keep(tensors: dict, layer_prefix: str, ffn_size: int):
    import torch
    g, u, d = (tensors[f"{layer_prefix}mlp.{k}.weight"].float() for k in ("gate_proj", "up_proj", "down_proj"))
    score = g.norm(dim=1) * u.norm(dim=1) * d.norm(dim=0)
    return torch.sort(torch.topk(score, ffn_size).indices).values


def prune(src: str, out: str, *, keep_layers: str | None = None, ffn_size: int | None = None,
          overwrite: bool = False) -> dict:
    """src -> out pruned; refuses before writing anything when a setting does not fit the checkpoint. Written
    beside out and moved into place at the end; an existing out is replaced only with overwrite."""
    from safetensors.torch import load_file, save_file
    cfg_path = os.path.join(src, "config.json")
    if not os.path.isfile(cfg_path):
        raise PruneError(f"{src} has no config.json; give a Hugging Face checkpoint folder")
    if os.path.abspath(out) == os.path.abspath(src):
        raise PruneError(f"--out {out} is the source checkpoint; give another folder")
    if os.path.exists(out) and not overwrite:
        raise PruneError(f"{out} already exists; pass --overwrite to replace it, or give another --out")
    with open(cfg_path) as f:
        cfg = json.load(f)
    n = int(cfg.get("num_hidden_layers", 0))
    keep = parse_layers(keep_layers, n) if keep_layers is not None else list(range(n))
    shards = _shards(src)
    if keep_layers is None and ffn_size is None:
        raise PruneError("nothing to prune: give --keep-layers (depth) and/or --ffn-size (MLP width)")
    if ffn_size is not None:
        inter = cfg.get("intermediate_size")
        if cfg.get("num_local_experts") or cfg.get("num_experts") or not isinstance(inter, int):
            raise PruneError(f"--ffn-size: {src} is not a dense-MLP model (MoE or no intermediate_size); prune it "
                             "by depth (--keep-layers)")
        if not 0 < ffn_size < inter:
            raise PruneError(f"--ffn-size {ffn_size}: give a width between 1 and {inter - 1} (the model's "
                             f"intermediate_size is {inter})")
    renumber = {old: new for new, old in enumerate(keep)}
    tmp = f"{out.rstrip(os.sep)}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        weight_map = {}
        for shard in shards:
            tensors, kept = load_file(os.path.join(src, shard)), {}
            for name, t in tensors.items():
                m = LAYER.match(name)
                if m is None:
                    kept[name] = t
                    continue
                i = int(m.group(2))
                if i not in renumber:
                    continue
                if ffn_size is not None and m.group(3).startswith(".mlp."):
                    pre = f"{m.group(1)}{i}."
                    idx = _ffn_keep(tensors, pre, ffn_size)
                    t = t[:, idx] if m.group(3) == ".mlp.down_proj.weight" else t[idx]
                kept[f"{m.group(1)}{renumber[i]}{m.group(3)}"] = t.contiguous()
            save_file(kept, os.path.join(tmp, shard), metadata={"format": "pt"})
            weight_map.update({k: shard for k in kept})
        if len(shards) > 1 or os.path.isfile(os.path.join(src, INDEX)):
            size = sum(os.path.getsize(os.path.join(tmp, s)) for s in shards)
            with open(os.path.join(tmp, INDEX), "w") as f:
                json.dump({"metadata": {"total_size": size}, "weight_map": weight_map}, f, indent=2)
        cfg["num_hidden_layers"] = len(keep)
        if isinstance(cfg.get("layer_types"), list) and len(cfg["layer_types"]) == n:
            cfg["layer_types"] = [cfg["layer_types"][i] for i in keep]
        if ffn_size is not None:
            cfg["intermediate_size"] = int(ffn_size)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
        for name in os.listdir(src):  # tokenizer, generation config, ...
            p = os.path.join(src, name)
            if os.path.isfile(p) and name not in (*shards, INDEX, "config.json") and not name.endswith(".safetensors"):
                shutil.copy2(p, os.path.join(tmp, name))
        old = None
        if os.path.exists(out):
            old = f"{out.rstrip(os.sep)}.old{os.getpid()}"
            os.rename(out, old)
        os.rename(tmp, out)
        if old:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"layers": f"{n} -> {len(keep)} (kept {keep})", "intermediate_size": cfg.get("intermediate_size"),
            "out": os.path.abspath(out)}
