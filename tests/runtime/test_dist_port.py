"""A single-process group whose made-up port another process took meanwhile takes another one; a launcher's port
is never replaced."""
import os
import socket

import pytest
import torch.distributed as dist

from megatron_kd.runtime import dist as rdist


@pytest.fixture
def taken_port(monkeypatch):
    """A port some other process listens on, and free_port() handing it out first (as when another process binds
    it between free_port() and the group's store)."""
    if dist.is_initialized():  # a group an earlier test in this process left behind: init would just join it
        from megatron.core import parallel_state
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    saved = {k: os.environ.pop(k, None) for k in rdist.ENV_KEYS}
    s = socket.socket()
    s.bind(("0.0.0.0", 0))
    s.listen()
    taken = s.getsockname()[1]
    picks = []
    real = rdist.free_port

    def free_port():
        picks.append(taken if not picks else real())
        return picks[-1]
    monkeypatch.setattr(rdist, "free_port", free_port)
    yield taken, picks
    if dist.is_initialized():
        dist.destroy_process_group()
    rdist.restore_env(saved)
    s.close()


def test_a_made_up_port_taken_meanwhile_is_replaced(taken_port):
    taken, picks = taken_port
    assert rdist.init_process_group(False)
    assert dist.get_world_size() == 1 and len(picks) == 2 and os.environ["MASTER_PORT"] == str(picks[1]) != str(taken)


def test_a_launchers_port_is_not_replaced(taken_port):
    taken, picks = taken_port
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(taken))
    with pytest.raises(rdist.DistNetworkError):
        rdist.init_process_group(False)
    assert not dist.is_initialized() and not picks
