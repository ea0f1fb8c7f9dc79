import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

# GPU tests compare fp32 math against references: TE rounds fp32 GEMM inputs through TF32 unless this is 0 (torch
# does not by default), which can flip a random router's top-k and moves logits by their own size. cuBLAS reads
# it when it starts, after collection; a whole-suite setting, so no test sees another's choice.
os.environ.setdefault("NVIDIA_TF32_OVERRIDE", "0")

# Without CUDA the Triton kernels run under Triton's CPU interpreter. The switch must precede the first import of
# any module that defines a @triton.jit function (a test module collected earlier may import megatron_kd.loss,
# and with it megatron_kd.kernels), so it is set here, before any test module is imported.
if "TRITON_INTERPRET" not in os.environ:
    import torch
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


# --- tests marked `bridge` need real Megatron-Bridge 0.6.2 + megatron-core 0.19.2 ------------
# (Python 3.12: .ci/run's second job). Elsewhere they are skipped; `--require-bridge` turns the skip into an error.
import pytest  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--require-bridge", action="store_true",
                     help="fail (instead of skipping) when tests marked `bridge` cannot import Megatron-Bridge")


def pytest_collection_modifyitems(config, items):
    marked = [it for it in items if "bridge" in it.keywords]
    if not marked:
        return
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "hf"))
    from bridge_env_check import bridge_import_error
    err = bridge_import_error()
    if err is None:
        return
    if config.getoption("--require-bridge"):
        raise pytest.UsageError(f"--require-bridge: Megatron-Bridge does not import here ({err})")
    skip = pytest.mark.skip(reason=f"needs Megatron-Bridge 0.6.2 + megatron-core 0.19.2 (Python 3.12 job of "
                                   f".ci/run): {err}")
    for it in marked:
        it.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """--require-bridge: a `bridge` test that skips because Bridge does not import (a skip of its own, e.g. in a
    folder's conftest) fails instead, so the Python 3.12 job cannot pass with its tests skipped."""
    outcome = yield
    rep = outcome.get_result()
    if rep.skipped and "bridge" in item.keywords and item.config.getoption("--require-bridge"):
        reason = str(rep.longrepr[-1]) if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        if "bridge" in reason.lower():
            rep.outcome = "failed"
            rep.longrepr = f"--require-bridge: skipped: {reason}"


# --- the launch environment: a test that starts a one-process group in this process writes MASTER_PORT (and RANK,
# WORLD_SIZE, ...) into os.environ; a later test's subprocess would inherit it (torchrun.sh then leaves
# --standalone, a child binds a port still held). Each test gets back the variables it started with.
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _restore_launch_env():
    saved = {k: os.environ.get(k) for k in LAUNCH_ENV}
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


# Per test, and per module too: a module-scoped fixture sets its variables before any test's own copy is taken, so
# only a module-level restore takes them back before the next module's subprocesses inherit a port still bound.
_launch_env_restored = pytest.fixture(autouse=True)(_restore_launch_env)
_launch_env_restored_per_module = pytest.fixture(autouse=True, scope="module")(_restore_launch_env)


# --- GPU tests with Transformer Engine: one NCCL rank and megatron-core's groups, per test module -------------------

@pytest.fixture(scope="module")
def mcore_te_gpu():
    """Megatron's model-parallel groups on one NCCL rank, for tests that build TE models (skipped without CUDA + TE)."""
    import torch
    from megatron_kd.runtime.features import te_available
    if not te_available():
        pytest.skip("needs CUDA and Transformer Engine")
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    if not torch.distributed.is_initialized():
        from dist_utils import free_port
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
        torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    ps.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    yield
    ps.destroy_model_parallel()
