"""`--teacher mkd:SAVE_DIR` (teacher/spec.py, read alike by the Bridge cache command and `megatron-kd cache
build`): a `megatron-kd train` checkpoint as the teacher. Needs megatron-core only (Python 3.11 or 3.12), no
Bridge. Reference: the trainer's own end-of-run evaluation CE over the validation samples, which the reloaded
teacher must reproduce."""
import pytest
import torch

pytest.importorskip("megatron.core")


@pytest.mark.slow
def test_a_megatron_kd_checkpoint_serves_as_the_teacher(tmp_path):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron_kd.teacher.spec import megatron_kd_teacher
    from megatron_kd.recipe.schema import DataConfig, KDConfig, ModelConfig, Recipe, TrainConfig
    from megatron_kd.data.datasets import build_datasets, load_tokenizer, samples_needed
    from megatron_kd.training.loop import run
    r = Recipe(model=ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                                 tie_embeddings=False, attention_backend="sdpa"),
               data=DataConfig(kind="mock", vocab_size=128, seq_length=16, seed=7),
               kd=KDConfig(mode="ce"),
               train=TrainConfig(iters=3, micro_batch_size=2, global_batch_size=4, eval_iters=2, lr=1e-2,
                                 save=str(tmp_path / "run"), progress=False, tensorboard=False, device="cpu"))
    summary = run(r, r.train.save)
    want = summary["eval"]["ce"]
    try:
        teacher = megatron_kd_teacher(r.train.save, vocab_size=128, seq_length=16, precision="fp32", device="cpu")
        tok = load_tokenizer(r.data)
        train_n, valid_n = samples_needed(r.train, r.data)
        _, valid = build_datasets(r.data, tok, train_n, valid_n)
        total, count = 0.0, 0.0
        for i in range(valid_n):
            s = valid[i]
            tokens = torch.as_tensor(s["tokens"]).long()[None]
            out = teacher(tokens)
            logits = (out.hidden.double() @ out.weight.double().t())[0, :, :128]
            ce = -torch.log_softmax(logits, -1).gather(1, torch.as_tensor(s["labels"]).long()[:, None])[:, 0]
            mask = torch.as_tensor(s["loss_mask"]).double()
            total += float((ce * mask).sum())
            count += float(mask.sum())
        assert abs(total / count - want) <= 1e-5 * abs(want), (total / count, want)
        assert teacher.vocab_size == 128 and teacher.identity()["weights_hash"]
    finally:
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
