"""Bridge callbacks (megatron.bridge.training.callbacks.Callback protocol: on_* methods taking a context)."""
import json
import os


class LossLog:
    """One JSON line per training step on the first rank: iteration, the reduced losses (full precision, unlike
    Bridge's console line), grad norm, skipped. `pretrain(cfg, step, callbacks=[LossLog(path)])`; appends, so a
    resumed run continues the same file."""

    def __init__(self, path: str):
        self.path = path

    def on_train_step_end(self, context) -> None:
        import torch.distributed as dist
        if dist.is_initialized() and dist.get_rank() != dist.get_world_size() - 1:
            return  # the reduced losses live on the last pipeline stage; the last rank has them
        losses = {k: float(v.item() if hasattr(v, "item") else v) for k, v in (context.loss_dict or {}).items()}
        # Bridge fires on_train_step_end before it advances train_state.step (training/train.py), so the step
        # that just ran is step + 1, the number Bridge's console line shows for it.
        rec = {"iteration": int(context.state.train_state.step) + 1, "losses": losses,
               "grad_norm": None if context.grad_norm is None else float(context.grad_norm),
               "skipped": bool(context.skipped_iter)}
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
