"""Structural pruning of a Hugging Face decoder checkpoint, on its files (safetensors + config.json; no transformers,
no Megatron-Bridge): by depth (keep the listed layers) and by MLP width (keep the `ffn_size` channels of largest
weight importance in every layer). The pruned folder is a checkpoint transformers loads, the student that KD
recovers.

Width importance of MLP channel j in a layer: |gate_j| x |up_j| x |down_:,j| (L2 norms of its rows of gate_proj
and up_proj and its column of down_proj), kept in their original order: a weight-only score, with no calibration
data. NVIDIA ModelOpt's Minitron pruning ranks channels, heads and layers by activations on calibration data; it
runs on Megatron-Core models through its own plugin, so it is not used here.

The weight names are the family's (megatron_kd/families, by config.json's model_type): depth for every registered
family, width where its MLP is a dense gated one; an unregistered family, MoE expert widths and a checkpoint whose
tensors do not follow its family's names are refused before anything is written.
"""
import errno
import json
import os
import re
import shutil

from .. import families
from ..errors import HFCheckpointError, PruneError

INDEX = "model.safetensors.index.json"


def _read_config(src: str) -> dict:
    cfg_path = os.path.join(src, "config.json")
    if not os.path.isfile(cfg_path):
        raise PruneError(f"{src} has no config.json; give a Hugging Face checkpoint folder")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PruneError(f"{cfg_path} is not readable JSON ({type(e).__name__}: {e}); restore it (e.g. download "
                         "the checkpoint again)") from None
    if not isinstance(cfg, dict):
        raise PruneError(f"{cfg_path} holds no JSON object; restore it (e.g. download the checkpoint again)")
    return cfg


def _family(src: str, cfg: dict):
    try:
        return families.for_config(cfg, f"--hf {src}")
    except HFCheckpointError as e:
        raise PruneError(f"{e}; prune knows the weight names of these families only") from None


def _shards(src: str) -> list:
    index = os.path.join(src, INDEX)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise PruneError(f"{index} is not a safetensors index ({type(e).__name__}: {e}); restore it (e.g. "
                             "download the checkpoint again)") from None
        missing = [s for s in shards if not os.path.isfile(os.path.join(src, s))]
        if missing:
            raise PruneError(f"{index} names shard(s) {missing} that are not in {src}; download the missing "
                             "file(s) (or the whole checkpoint) again")
        return shards
    if os.path.isfile(os.path.join(src, "model.safetensors")):
        return ["model.safetensors"]
    raise PruneError(f"{src} has no model.safetensors (or {INDEX}); give a Hugging Face checkpoint folder saved "
                     "with safetensors (transformers' save_pretrained)")


def _tensor_names(src: str, shards: list) -> dict:
    """{shard: [tensor names]}, each shard's header read whole (a truncated file is refused here)."""
    from safetensors import safe_open
    out = {}
    for shard in shards:
        path = os.path.join(src, shard)
        try:
            with safe_open(path, "pt") as f:
                out[shard] = list(f.keys())
        except Exception as e:  # safetensors' SafetensorError (truncated / not safetensors), OSError
            raise PruneError(f"{path} is not a complete safetensors file ({type(e).__name__}: {e}); download it "
                             "again") from None
    return out


def _layer_pattern(fam):
    pre, _, post = fam.weights.layer.partition("{}")
    return re.compile(rf"^({re.escape(pre)})(\d+)({re.escape(post)}.*)$")


def _check_names(src: str, fam, names: dict, n: int, pattern) -> None:
    """The checkpoint's layer tensors are named as its family's and number config.json's layers."""
    found = sorted({int(m.group(2)) for ns in names.values() for k in ns for m in [pattern.match(k)] if m})
    if found != list(range(n)):
        example = fam.weights.layer.format("N")
        raise PruneError(f"--hf {src}: config.json says {n} layers ({fam.name}) but its tensors name "
                         f"{len(found)} layers as {example}*; the weights do not follow the {fam.name} family's "
                         "names, so prune would write a wrong checkpoint: give a checkpoint saved by transformers")


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


def _ffn_keep(tensors: dict, layer_prefix: str, mlp: tuple, ffn_size: int):
    import torch
    g, u, d = (tensors[f"{layer_prefix}{k}.weight"].float() for k in mlp)
    score = g.norm(dim=1) * u.norm(dim=1) * d.norm(dim=0)
    return torch.sort(torch.topk(score, ffn_size).indices).values


def _check_width(src: str, fam, cfg: dict, ffn_size: int) -> None:
    w = fam.weights
    if w.mlp is None:
        what = f"mixture-of-experts ({w.experts}*)" if w.experts else "not a dense gated MLP"
        raise PruneError(f"--ffn-size: {src} is a {fam.name} checkpoint whose MLP is {what}; pruning expert "
                         "widths is not supported: prune it by depth (--keep-layers)")
    inter = cfg.get(w.width_key)
    if cfg.get("num_local_experts") or cfg.get("num_experts") or not isinstance(inter, int):
        raise PruneError(f"--ffn-size: {src} is not a dense-MLP model (MoE or no {w.width_key}); prune it by "
                         "depth (--keep-layers)")
    if not 0 < ffn_size < inter:
        raise PruneError(f"--ffn-size {ffn_size}: give a width between 1 and {inter - 1} (the model's "
                         f"{w.width_key} is {inter})")


def prune(src: str, out: str, *, keep_layers: str | None = None, ffn_size: int | None = None,
          overwrite: bool = False) -> dict:
    """src -> out pruned; refuses before writing anything when a setting does not fit the checkpoint. Written
    beside out and moved into place at the end; an existing out is replaced only with overwrite, and stays as it
    was when the write fails."""
    cfg = _read_config(src)
    if os.path.abspath(out) == os.path.abspath(src):
        raise PruneError(f"--out {out} is the source checkpoint; give another folder")
    if os.path.exists(out) and not overwrite:
        raise PruneError(f"{out} already exists; pass --overwrite to replace it, or give another --out")
    fam = _family(src, cfg)
    n = int(cfg.get("num_hidden_layers", 0))
    keep = parse_layers(keep_layers, n) if keep_layers is not None else list(range(n))
    shards = _shards(src)
    if keep_layers is None and ffn_size is None:
        raise PruneError("nothing to prune: give --keep-layers (depth) and/or --ffn-size (MLP width)")
    pattern = _layer_pattern(fam)
    _check_names(src, fam, _tensor_names(src, shards), n, pattern)
    if ffn_size is not None:
        _check_width(src, fam, cfg, ffn_size)
    tmp = f"{out.rstrip(os.sep)}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.makedirs(tmp)
        _write(src, tmp, cfg, fam, pattern, shards, keep, n, ffn_size)
        old = None
        if os.path.exists(out):
            old = f"{out.rstrip(os.sep)}.old{os.getpid()}"
            os.rename(out, old)
        os.rename(tmp, out)
        if old:
            shutil.rmtree(old, ignore_errors=True)
    except OSError as e:
        what = "the disk is full" if e.errno == errno.ENOSPC else f"{type(e).__name__}: {e}"
        raise PruneError(f"writing the pruned checkpoint beside --out {out} failed ({what}); nothing was changed "
                         "at --out: free space (or fix the folder) and run prune again") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"layers": f"{n} -> {len(keep)} (kept {keep})", "intermediate_size": cfg.get("intermediate_size"),
            "family": fam.name, "out": os.path.abspath(out)}


def _write(src, tmp, cfg, fam, pattern, shards, keep, n, ffn_size) -> None:
    from safetensors.torch import load_file, save_file
    renumber = {old: new for new, old in enumerate(keep)}
    mlp, post = fam.weights.mlp, fam.weights.layer.partition("{}")[2]
    weight_map = {}
    for shard in shards:
        tensors, kept = load_file(os.path.join(src, shard)), {}
        for name, t in tensors.items():
            m = pattern.match(name)
            if m is None:
                kept[name] = t
                continue
            i = int(m.group(2))
            if i not in renumber:
                continue
            rest = m.group(3)
            if ffn_size is not None and rest in [f"{post}{k}.weight" for k in mlp]:
                idx = _ffn_keep(tensors, f"{m.group(1)}{i}{post}", mlp, ffn_size)
                t = t[:, idx] if rest == f"{post}{mlp[2]}.weight" else t[idx]
            kept[f"{m.group(1)}{renumber[i]}{rest}"] = t.contiguous()
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
        cfg[fam.weights.width_key] = int(ffn_size)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    for name in os.listdir(src):  # tokenizer, generation config, ...
        p = os.path.join(src, name)
        if os.path.isfile(p) and name not in (*shards, INDEX, "config.json") and not name.endswith(".safetensors"):
            shutil.copy2(p, os.path.join(tmp, name))
