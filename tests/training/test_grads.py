"""One training step of a tiny Megatron GPT student through our hook + loss (Megatron DDP, forward_step/loss_func,
finalize_model_grads) equals the same model computing full logits and a dense float64 loss: TP=1, TP=2, DP=2.

Also: no output-layer GEMM runs on the hook path (the class forward of the output layer is never called).
"""
import pytest
import torch
import torch.nn.functional as F

from dist_utils import run_ranks

V, S, B, K = 100, 16, 4, 6          # vocabulary 100, padded by Megatron (8 x TP): padding rows never count
KL_W, CE_W, T = 1.0, 0.5, 2.0


def student_cfg(tp):
    from megatron_kd.recipe.schema import ModelConfig, ParallelConfig
    m = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                    make_vocab_size_divisible_by=8, init_method_std=0.2, attention_backend="sdpa")
    return m, ParallelConfig(tp=tp)


def global_batch():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, V, (B, S), generator=g)
    labels = torch.randint(0, V, (B, S), generator=g)
    loss_mask = (torch.rand(B, S, generator=g) > 0.2).float()
    teacher = torch.log_softmax(torch.randn(B, S, V, generator=g, dtype=torch.float64) * 3, dim=-1)
    lp, ids = teacher.topk(K, dim=-1)
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask,
            "position_ids": torch.arange(S).expand(B, S).contiguous(), "topk_ids": ids,
            "topk_logprobs": lp.float()}


def dense_reference(model, batch, tp_group):
    """Mean over counted tokens of KL_W T^2 KL(top-K || softmax(z/T)) + CE_W CE, from full float64 logits."""
    logits = model(batch["tokens"], batch["position_ids"], None)           # [b, s, V_pad / tp]
    if tp_group.size() > 1:  # Megatron's gather: backward keeps this rank's slice (every rank has the same loss)
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
        logits = gather_from_tensor_model_parallel_region(logits, group=tp_group)
    z = logits[..., :V].double()
    lq = torch.log_softmax(z / T, dim=-1).gather(-1, batch["topk_ids"])
    p = batch["topk_logprobs"].double().exp()
    kl = (p * (batch["topk_logprobs"].double() - lq)).sum(-1)
    ce = F.cross_entropy(z.reshape(-1, V), batch["labels"].reshape(-1), reduction="none").reshape(B, S)
    per = KL_W * T * T * kl + CE_W * ce
    m = batch["loss_mask"].double()
    return (per * m).sum() / m.sum()


def _worker(rank, world, tp, impl="chunked"):
    import megatron.core.tensor_parallel.layers as layers
    from megatron.core import parallel_state as ps
    from megatron_kd.recipe.schema import KDConfig
    from megatron_kd.runtime.dist import init_model_parallel, set_seed
    from megatron_kd.models.builder import build_gpt
    from megatron_kd.optim.setup import wrap_ddp
    from megatron_kd.training.schedule import forward_backward
    from megatron_kd.training.step import KDStep
    from megatron_kd.training.loop import reduce_reports

    torch.set_num_threads(1)  # two ranks on a 2-core runner
    m, p = student_cfg(tp)
    init_model_parallel(p, cuda=False)
    set_seed(1234)
    ours = build_gpt(m, p, V, S)
    set_seed(1234)
    ref = build_gpt(m, p, V, S)
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), ref.parameters()))
    ddp = wrap_ddp([ours], ours.config, p, cuda=False)
    from megatron.core.distributed import finalize_model_grads
    ours.config.finalize_model_grads_func = finalize_model_grads
    ours.config.no_sync_func = ddp[0].no_sync

    batch = global_batch()
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mine = [{k: v[i:i + 1] for k, v in batch.items()} for i in range(dp_rank, B, dp)]  # micro-batches of 1
    kd = KDConfig(mode="offline", top_k=K, kl_weight=KL_W, ce_weight=CE_W, temperature=T, impl=impl,
                  chunk_size=5)
    called = []
    orig = layers.ColumnParallelLinear.forward
    layers.ColumnParallelLinear.forward = lambda self, *a, **k: called.append(self) or orig(self, *a, **k)
    try:
        ddp[0].zero_grad_buffer()
        reports = forward_backward(KDStep(kd, V), iter(mine), ddp, len(mine), S, 1)
    finally:
        layers.ColumnParallelLinear.forward = orig
    assert not any(c is ours.output_layer for c in called), "the output layer made logits on the hook path"
    loss = reduce_reports(reports)["total"]

    want = dense_reference(ref, batch, ps.get_tensor_model_parallel_group())
    want.backward()
    assert abs(loss - want.item()) < 1e-5 * max(1.0, abs(want.item())), (loss, want.item())
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        g, r = a.main_grad, b.grad
        assert r is not None and r.abs().max() > 0, name
        err = (g.double() - r.double()).abs().max().item() / r.abs().max().item()
        assert err < 2e-4, (name, err)


@pytest.mark.parametrize("world,tp,impl", [(1, 1, "chunked"), (2, 2, "chunked"), (2, 1, "chunked"),
                                           (1, 1, "fused"), (2, 2, "fused")],
                         ids=["tp1", "tp2", "dp2", "tp1-fused", "tp2-fused"])
def test_one_step_matches_dense_reference(world, tp, impl, monkeypatch):
    """impl "fused" (Triton; the interpreter on CPU): its weight gradient lands in DDP's main_grad in forward."""
    if impl == "fused":
        pytest.importorskip("triton")
        if not torch.cuda.is_available():
            monkeypatch.setenv("TRITON_INTERPRET", "1")  # the spawned ranks import triton after this
    run_ranks(world, _worker, tp, impl)


def test_output_processor_path_of_megatron_core_019():
    """megatron-core >= 0.19 calls output_processor(hidden_states=..., output_layer=..., output_weight=..., ...)
    instead of its output layer; the hook's processor takes exactly those keywords and returns [b, s, ...]."""
    from megatron_kd.models.hook import forward_with_head

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(7, 3))

    class Fake019(torch.nn.Module):
        post_process = True

        def __init__(self):
            super().__init__()
            self.output_layer = Layer()

        def forward(self, input_ids, position_ids, attention_mask, *, output_processor=None,
                    output_processor_context=None):
            hidden = torch.randn(input_ids.shape[1], input_ids.shape[0], 3)   # [s, b, h]
            return output_processor(hidden_states=hidden, output_layer=self.output_layer, output_weight=None,
                                    labels=None, loss_mask=None, input_ids=input_ids, position_ids=position_ids,
                                    attention_mask=attention_mask, decoder_input=None, inference_context=None,
                                    packed_seq_params=None, runtime_gather_output=None,
                                    context=output_processor_context, compute_language_model_loss=None,
                                    scale_logits=None, config=None)

    seen = {}

    def head(hidden, weight):
        seen["weight"] = weight
        return hidden.sum(-1)  # [s, b]

    model = Fake019()
    out = forward_with_head(model, head, torch.zeros(2, 5, dtype=torch.long), None, None)
    assert out.shape == (2, 5) and seen["weight"] is model.output_layer.weight
