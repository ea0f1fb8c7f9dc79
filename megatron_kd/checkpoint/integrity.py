"""Checkpoint integrity: a checksum manifest per saved iteration, written last, checked before a load.

    <save>/iter_0000100/checksums.json   {"files": {relative path: [bytes, sha256]}, "iteration": 100}

A save writes it after dist_checkpointing.save returned on every rank and before the tracker moves, so a
checkpoint with a manifest is complete. Loading verifies sizes and checksums first: a bit flip, a truncated
file or a missing one is found before megatron-core reads it (its own errors there are EOFError, AssertionError
or a CheckpointException, which derives from BaseException). A damaged latest checkpoint makes the resume fall
back to the newest intact one, with a message. Hashing is split over the ranks (each hashes every world-th file).
"""
import json
import os

import torch.distributed as dist

from ..rules import file_sha256

MANIFEST = "checksums.json"


def _files(path: str) -> list:
    out = []
    for root, _, names in os.walk(path):
        for n in names:
            rel = os.path.relpath(os.path.join(root, n), path)
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def _split(items: list) -> tuple:
    """This rank's share of items and a function gathering every rank's results (a dict) on all ranks."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        rank, world = dist.get_rank(), dist.get_world_size()

        def gather(mine: dict) -> dict:
            parts = [None] * world
            dist.all_gather_object(parts, mine)
            return {k: v for p in parts for k, v in p.items()}
        return items[rank::world], gather
    return items, lambda mine: mine


def _hashes(path: str, files: list) -> dict:
    mine, gather = _split(files)
    out = {}
    for rel in mine:
        p = os.path.join(path, rel)
        try:
            out[rel] = [os.path.getsize(p), file_sha256(p)]
        except OSError as e:
            out[rel] = [None, f"unreadable: {e.strerror or e}"]
    return gather(out)


def write_manifest(path: str, iteration: int, rank0: bool) -> None:
    """On every rank, after the checkpoint's files are complete; rank 0 writes the manifest (atomically)."""
    files = _files(path)
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [files]
        dist.broadcast_object_list(box, src=0)  # one file list for all ranks, whatever each sees in its listing
        files = box[0]
    digests = _hashes(path, files)
    if rank0:
        tmp = os.path.join(path, MANIFEST + ".tmp")
        with open(tmp, "w") as f:
            json.dump({"iteration": iteration, "files": digests}, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(path, MANIFEST))


def has_manifest(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST))


def problems(path: str, checksums: bool = True) -> list:
    """What is wrong with the checkpoint directory `path` (empty: intact). checksums=False checks presence and
    sizes only (cheap, needs no process group); True also hashes (a collective when a group is up)."""
    if not os.path.isdir(path):
        return [f"{path} does not exist"]
    m = os.path.join(path, MANIFEST)
    if not os.path.isfile(m):
        return [f"{path} has no {MANIFEST} (a complete save writes it last)"]
    try:
        want = json.load(open(m))["files"]
    except (ValueError, KeyError, TypeError) as e:
        return [f"{m} is not a valid checksum manifest ({e})"]
    out = []
    for rel, (size, _) in sorted(want.items()):
        p = os.path.join(path, rel)
        if not os.path.isfile(p):
            out.append(f"{rel} is missing")
        elif os.path.getsize(p) != size:
            out.append(f"{rel} has {os.path.getsize(p)} bytes, {size} were written")
    if out or not checksums:
        return out
    got = _hashes(path, sorted(want))
    return [f"{rel} does not match its checksum" for rel in sorted(want) if got[rel][1] != want[rel][1]]


def _iterations(root: str) -> list:
    out = []
    for n in os.listdir(root) if os.path.isdir(root) else []:
        if n.startswith("iter_") and n[5:].isdigit():
            out.append(int(n[5:]))
    return sorted(out, reverse=True)


def newest_intact(root: str, checksums: bool = True) -> tuple:
    """(iteration, notes) of the checkpoint to resume from in `root`: the tracker's when intact, else the newest
    intact one before it (notes say why); (None, []) when root holds no tracker. Raises RunError when the tracker
    names checkpoints of which none is intact. A run saved before checksum manifests existed (no iteration has
    one) resumes from the tracker's iteration unverified."""
    from . import layout as ckpt
    from ..recipe.schema import RunError
    latest = ckpt.latest_iteration(root)
    if latest is None:
        return None, []
    candidates = [latest] + [i for i in _iterations(root) if i < latest]
    if not any(has_manifest(ckpt.iter_dir(root, i)) for i in candidates) and os.path.isdir(ckpt.iter_dir(root, latest)):
        return latest, [f"{ckpt.iter_dir(root, latest)} was saved without a checksum manifest; loaded unverified"]
    reasons = []
    for i in candidates:
        d = ckpt.iter_dir(root, i)
        bad = problems(d, checksums)
        if not bad:
            if i == latest:
                return i, []
            return i, [f"resuming from iteration {i}, the newest intact checkpoint in {root}: "
                       + "; ".join(reasons)]
        if i == latest and not os.path.isdir(d):
            reasons.append(f"{ckpt.TRACKER} names iteration {latest}, but {d} does not exist")
        else:
            reasons.append(f"iteration {i} is damaged ({bad[0]})")
    raise RunError(f"train.load={root}: no intact checkpoint ({'; '.join(reasons)}); resume from another save dir "
                   f"(train.load), or start over with another train.save")


def use_iteration(root: str, iteration: int, rank0: bool) -> None:
    """Point root's tracker at `iteration` (after a fallback): the run resumes from there and its next saves
    replace the damaged checkpoints instead of taking them for done."""
    from . import layout as ckpt
    if rank0:
        tmp = os.path.join(root, ckpt.TRACKER + ".tmp")
        with open(tmp, "w") as f:
            f.write(str(iteration))
        os.replace(tmp, os.path.join(root, ckpt.TRACKER))
    if dist.is_initialized():
        dist.barrier()


def require_intact(path: str) -> None:
    """A weights-only load (teacher.load, train.pretrained, export): the directory's checkpoint must be intact."""
    from . import layout as ckpt
    from ..recipe.schema import RunError
    d = ckpt.resolve(path)
    if not has_manifest(d):
        return  # saved before checksum manifests existed
    bad = problems(d)
    if bad:
        raise RunError(f"the checkpoint {d} is damaged ({bad[0]}); load an intact one instead (another iter_* "
                       f"directory of that run, or a fresh save)")
