"""checkpoint.py's two mends for megatron-core's DistributedOptimizer without apex/TE (GPU only, so tested
here on stand-ins with the same attributes): an empty optimizer gets megatron-core's dummy step before the
loading state dict is built, and the saved Adam step returns to every per-param state after the load.
The GPU runs behind them are in benchmarks/results/gpu_checks_h200.md."""
import torch

from megatron_kd.checkpoint.store import _materialize_optimizer_state, _restore_steps


class DistOptStandIn:
    """What the mends touch: .optimizer (a torch Adam) and megatron-core's dummy-state helper."""

    def __init__(self, params):
        self.optimizer = torch.optim.AdamW(params, lr=0.0)
        self.dummy_calls = 0

    def _init_optimizer_states_with_dummy_values(self):  # megatron-core's: zero grads, one step
        self.dummy_calls += 1
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                p.grad = torch.zeros_like(p)
        self.optimizer.step()
        self.optimizer.zero_grad()


class Chained:
    def __init__(self, subs):
        self.chained_optimizers = subs


def test_empty_state_gets_the_dummy_step_once():
    a = DistOptStandIn([torch.nn.Parameter(torch.ones(3))])
    b = DistOptStandIn([torch.nn.Parameter(torch.ones(2))])
    b.optimizer.state[b.optimizer.param_groups[0]["params"][0]]["exp_avg"] = torch.zeros(2)  # already has state
    _materialize_optimizer_state(Chained([a, b]))
    assert a.dummy_calls == 1 and b.dummy_calls == 0
    assert all("step" in st for st in a.optimizer.state.values())
    _materialize_optimizer_state(a)
    assert a.dummy_calls == 1  # not twice


def test_saved_group_step_returns_to_every_param_state():
    ps = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(4))]
    o = DistOptStandIn(ps)
    o._init_optimizer_states_with_dummy_values()  # per-param steps are 1 now
    o.optimizer.param_groups[0]["step"] = 3.0  # what the DistributedOptimizer loaded from the checkpoint
    _restore_steps(Chained([o]))
    assert [float(o.optimizer.state[p]["step"]) for p in ps] == [3.0, 3.0]
    # the restored steps are separate tensors: one param's next step does not advance another's
    o.optimizer.state[ps[0]]["step"] += 1
    assert float(o.optimizer.state[ps[1]]["step"]) == 3.0


def test_optimizers_without_the_helper_are_left_alone():
    p = torch.nn.Parameter(torch.ones(2))
    inner = torch.optim.AdamW([p])
    p.grad = torch.ones(2)
    inner.step()

    class FP32Like:  # FP32Optimizer / lean_adam: steps live where torch keeps them
        optimizer = inner
    inner.param_groups[0]["step"] = 9.0
    _restore_steps(FP32Like())
    _materialize_optimizer_state(FP32Like())
    assert float(inner.state[p]["step"]) == 1.0
