"""Vocab-parallel and sequence-parallel loss on real gloo process groups vs the single-process reference."""
import itertools

import pytest
import torch
import torch.distributed as dist

from megatron_kd import topk_kl_loss
from dist_utils import run_ranks
from reference import make_inputs, reference_loss
from test_loss_memory import LargestAllocation

IMPLS = ["dense", "chunked", "forward_chunked"]
TAILS = ["none", "renormalize", "bucket"]


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _gather_rows(x, group=None):
    parts = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, x, group=group)
    return torch.cat(parts)


def _check_case(rank, world, impl, tail, sp, temperature, ce, padded, uneven, reduction="mean", seed=0, div=None):
    s, b, V = 4 * world, 3, 13 * world
    inp = make_inputs(n_shape=(s, b), V=V, H=8, K=5, seed=seed)
    valid = V - 3 if padded else None
    if padded:
        inp["ids"] = inp["ids"].masked_fill(inp["ids"] >= V - 3, -1)  # teacher never names padding
        inp["labels"] = inp["labels"].masked_fill(inp["labels"] >= V - 3, 0)
    if uneven:  # rank r holds rows [starts[r], starts[r+1])
        cuts = [0] + [13 * (r + 1) + (2 if r < world - 1 else 0) for r in range(world)]
        cuts[-1] = V
        lo, hi = cuts[rank], cuts[rank + 1]
        start = lo
    else:
        lo, hi, start = rank * 13, (rank + 1) * 13, None
    w = inp["weight"][lo:hi].clone().requires_grad_(True)
    h_full = inp["hidden"]
    n_loc = s // world
    h = (h_full[rank * n_loc:(rank + 1) * n_loc] if sp else h_full).clone().requires_grad_(True)
    kw = dict(tail=tail, temperature=temperature, ce_weight=ce, reduction=reduction, **(div or {}))
    out = topk_kl_loss(h, w, inp["ids"], inp["logp"], labels=inp["labels"], loss_mask=inp["loss_mask"],
                       impl=impl, chunk_size=5, tp_group=dist.group.WORLD, sequence_parallel=sp,
                       vocab_start_index=start, valid_vocab_size=valid, **kw)
    gout = torch.linspace(0.5, 1.5, out.numel(), dtype=torch.float64).reshape(out.shape)
    (out * gout).sum().backward()
    h64 = h_full.clone().requires_grad_(True)
    w64 = inp["weight"].clone().requires_grad_(True)
    ref = reference_loss(h64, w64, inp["ids"], inp["logp"], inp["labels"], inp["loss_mask"],
                         valid_vocab_size=valid, **kw)
    (ref * gout).sum().backward()
    tag = (impl, tail, sp, temperature, ce, padded, uneven, reduction, div)
    assert _rel(out.detach(), ref.detach()) <= 1e-9, tag
    gh_ref = h64.grad[rank * n_loc:(rank + 1) * n_loc] if sp else h64.grad
    assert _rel(h.grad, gh_ref) <= 1e-9, tag
    assert _rel(w.grad, w64.grad[lo:hi]) <= 1e-9, tag
    # every rank returns the same loss
    assert _rel(_gather_rows(out.detach().reshape(1, -1))[0], out.detach().reshape(-1)) == 0.0


def _all_cases(rank, world, cases):
    for case in cases:
        _check_case(rank, world, *case)


def _cases(world):
    cases = []
    for impl, tail, sp in itertools.product(IMPLS, TAILS, [False, True]):
        cases.append((impl, tail, sp, 1.0, 0.0, False, False))
    cases += [(impl, tail, sp, 2.0, 0.3, True, False) for impl in IMPLS for tail in TAILS for sp in (False, True)]
    cases += [(impl, "bucket", False, 0.7, 0.2, False, True) for impl in IMPLS]
    cases += [(impl, "none", sp, 1.0, 0.5, False, False, "none") for impl in IMPLS for sp in (False, True)]
    cases += [(impl, "none", True, 1.0, 0.5, True, False, "sum") for impl in IMPLS]
    # reverse KL and JSD: every impl x tail x SP, with temperature, CE and padding; uneven shards; "none"
    for div in (dict(divergence="reverse_kl"), dict(divergence="jsd", jsd_beta=0.3)):
        cases += [(impl, tail, sp, 1.7, 0.3, True, False, "mean", 1, div)
                  for impl in IMPLS for tail in TAILS for sp in (False, True)]
        cases += [(impl, "bucket", False, 0.7, 0.0, False, True, "sum", 2, div) for impl in IMPLS]
        cases += [(impl, "none", True, 1.0, 0.5, False, False, "none", 3, div) for impl in IMPLS]
    return cases


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_tp_matches_single_process_reference(world):
    run_ranks(world, _all_cases, _cases(world))


def _no_global_vocab_rows(rank, world):
    N, V, H, K, chunk = 512, 256 * world, 4, 8, 16
    inp = make_inputs(n_shape=(N,), V=V, H=H, K=K, dtype=torch.float32, seed=1)
    vl = V // world
    w = inp["weight"][rank * vl:(rank + 1) * vl].clone().requires_grad_(True)
    h = inp["hidden"].clone().requires_grad_(True)
    for impl, tail, div in [("chunked", "bucket", "forward_kl"), ("forward_chunked", "none", "forward_kl"),
                            ("chunked", "renormalize", "forward_kl"), ("chunked", "bucket", "reverse_kl"),
                            ("forward_chunked", "bucket", "jsd")]:
        with LargestAllocation() as m:
            loss = topk_kl_loss(h, w, inp["ids"], inp["logp"], labels=inp["labels"], ce_weight=0.5, impl=impl,
                                tail=tail, chunk_size=chunk, tp_group=dist.group.WORLD, divergence=div)
            loss.backward()
        assert m.largest <= chunk * vl, f"rank {rank} {impl}: {m.largest} elements > one local chunk {chunk * vl}"


@pytest.mark.slow
def test_tp_never_allocates_global_vocab_per_token():
    run_ranks(2, _no_global_vocab_rows)


def _megatron_column_parallel(rank, world):
    from megatron.core import ModelParallelConfig, parallel_state
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron_kd.runtime.cpu_patches import apply_cpu_patches, seed_model_parallel_rng
    apply_cpu_patches()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    seed_model_parallel_rng(1234)
    H, V, K = 16, 64, 6
    cfg = ModelParallelConfig(tensor_model_parallel_size=world, use_cpu_initialization=True,
                              params_dtype=torch.float64, perform_initialization=True)
    layer = ColumnParallelLinear(H, V, config=cfg, init_method=torch.nn.init.normal_, bias=False,
                                 gather_output=False, skip_bias_add=True)
    inp = make_inputs(n_shape=(6, 2), V=V, H=H, K=K, seed=3)
    group = parallel_state.get_tensor_model_parallel_group()
    w_full = _gather_rows(layer.weight.detach(), group)
    h = inp["hidden"].clone().requires_grad_(True)
    loss = topk_kl_loss(h, layer.weight, inp["ids"], inp["logp"], labels=inp["labels"], ce_weight=0.25,
                        loss_mask=inp["loss_mask"], tail="bucket", impl="chunked", chunk_size=4, tp_group=group)
    loss.backward()
    h64 = inp["hidden"].clone().requires_grad_(True)
    w64 = w_full.clone().requires_grad_(True)
    ref = reference_loss(h64, w64, inp["ids"], inp["logp"], inp["labels"], inp["loss_mask"], ce_weight=0.25,
                         tail="bucket")
    ref.backward()
    vl = V // world
    assert _rel(loss.detach(), ref.detach()) <= 1e-9
    assert _rel(h.grad, h64.grad) <= 1e-9
    assert _rel(layer.weight.grad, w64.grad[rank * vl:(rank + 1) * vl]) <= 1e-9
    parallel_state.destroy_model_parallel()


@pytest.mark.slow
def test_megatron_column_parallel_output_layer():
    run_ranks(2, _megatron_column_parallel)
