"""Checkpoints with megatron-core's dist_checkpointing, laid out as Megatron-LM does.

    <save>/iter_0000100/                  one dist_checkpointing directory per saved iteration
    <save>/latest_checkpointed_iteration.txt   written last (atomically): a save is complete once it names it

Sharded state: model ('model', or 'model0'.. under virtual pipeline), the Megatron optimizer's sharded state,
and common state (iteration, consumed samples, LR scheduler, the recipe, the layer spec that built the model:
checkpoint/spec.py). dist_checkpointing reshards on load, so a run may resume (or a teacher load) under another
TP/PP layout.
"""
import contextlib
import os
import shutil
import warnings

import torch

from ..errors import RecipeError, RunError
from ..runtime.dist import barrier, is_rank0
from ..runtime.interrupt import is_interrupt
from ..models.builder import unwrap

from . import spec as layer_spec
from .layout import TRACKER, iter_dir, latest_iteration, resolve  # noqa: F401  (re-exported: ckpt.iter_dir ...)


@contextlib.contextmanager
def _dcp_notice_off():
    """torch's distributed checkpoint warns "deprecating ShardedTensor" whenever
    megatron-core's dist_checkpointing loads (Megatron's own tensor type, nothing a user can change); drop that
    one FutureWarning around our dist_checkpointing.load calls only."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning,
                                message="Please use DTensor instead and we are deprecating ShardedTensor")
        yield


# DistributedOptimizer state layout: one ShardedTensor per buffer, resharded across DP only, as Megatron-LM
# saves by default. Explicit because megatron-core 0.19 defaults to a layout its own saver no longer
# supports ("ShardedTensor.flattened_range is not supported"); other optimizers ignore it.
OPTIM_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}

def _require_psutil():
    try:
        import psutil  # noqa: F401
    except ImportError:
        raise RuntimeError("megatron-core's dist_checkpointing writer needs psutil: pip install psutil") from None


def _model_keys(chunks) -> list:
    return ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]


def _model_state(chunks) -> dict:
    return {k: unwrap(c).sharded_state_dict() for k, c in zip(_model_keys(chunks), chunks)}


def _quant_common(chunks) -> dict:
    """A quantized model's ModelOpt state, for the common state: loading rebuilds its quantizers from it before
    the values (amax, AWQ scales: sharded like the weights) are read. Empty for a model ModelOpt never touched."""
    import sys
    if "modelopt" not in sys.modules:  # nothing was quantized in this process
        return {}
    from ..models import quant
    m = unwrap(chunks[0])
    return {quant.STATE_KEY: quant.quantizer_state(m), quant.FORMAT_KEY: getattr(m, quant.FORMAT_KEY, None)} \
        if quant.is_quantized(m) else {}


def _quantize_like(common: dict, chunks) -> None:
    """Quantize still-unquantized chunks as the checkpoint's model was (its ModelOpt state), before its sharded
    state is named: the quantizers' values load with the weights."""
    from ..models import quant
    state = common.get(quant.STATE_KEY)
    if state is None:
        return
    for c in chunks:
        m = unwrap(c)
        if not quant.is_quantized(m):
            quant.restore_quantizers(m, state)
            setattr(m, quant.FORMAT_KEY, common.get(quant.FORMAT_KEY))


def _load_chunks(loaded: dict, chunks) -> None:
    # by build order: sorted() would put model10 before model2 under virtual pipeline
    for key, c in zip(_model_keys(chunks), chunks):
        unwrap(c).load_state_dict(loaded[key], strict=True)


def _rng_state(layout: tuple):
    from megatron.core import parallel_state as ps, tensor_parallel
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    state = {"torch": torch.get_rng_state(), "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    shape = (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size())
    offset = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank())
    return ShardedObject("rng_state_tp{}_pp{}".format(*layout), state, shape, offset,
                         replica_id=ps.get_data_parallel_rank(with_context_parallel=True))


def _layout() -> tuple:
    from megatron.core import parallel_state as ps
    return (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size())


def save_checkpoint(root: str, iteration: int, chunks, optimizer, scheduler, common: dict) -> str:
    """Write iteration's checkpoint under root; the tracker moves only after every rank finished."""
    _require_psutil()
    path = iter_dir(root, iteration)
    if latest_iteration(root) == iteration and os.path.isdir(path):
        return path  # already saved (e.g. the last interval save is also the final one)
    if is_rank0():
        os.makedirs(root, exist_ok=True)
        if os.path.exists(path):  # left by a save that died before the tracker named it: incomplete
            shutil.rmtree(path)
        os.makedirs(path)
    barrier()
    common = {**common, **_quant_common(chunks), **layer_spec.record(chunks)}
    sd = _model_state(chunks)
    _notify("save", iteration, optimizer)
    sd["optimizer"] = optimizer.sharded_state_dict(sd, metadata=OPTIM_METADATA)
    sd["scheduler"] = scheduler.state_dict()
    sd["rng_state"] = _rng_state(_layout())
    return _publish(root, path, iteration, sd, common)


def _publish(root: str, path: str, iteration: int, sd: dict, common: dict) -> str:
    """Write sd (with common, the iteration and the layout) into path, its manifest, then move the tracker."""
    from megatron.core import dist_checkpointing
    sd.update(common)
    sd["iteration"] = iteration
    sd["layout"] = list(_layout())
    dist_checkpointing.save(sd, path)
    barrier()
    from .integrity import write_manifest
    write_manifest(path, iteration, is_rank0())  # after every file, before the tracker: its presence = complete
    barrier()
    if is_rank0():
        tmp = os.path.join(root, TRACKER + ".tmp")
        with open(tmp, "w") as f:
            f.write(str(iteration))
        os.replace(tmp, os.path.join(root, TRACKER))
    barrier()
    return path


def save_weights(root: str, iteration: int, chunks, common: dict) -> str:
    """A weights-only checkpoint (no optimizer, scheduler or RNG state), as train.pretrained, teacher.load and
    load_weights read it: a model made outside training (e.g. a pruned teacher). Refuses to replace one."""
    _require_psutil()
    if latest_iteration(root) is not None:
        raise FileExistsError(f"{root} already holds a checkpoint; not replacing it")
    path = iter_dir(root, iteration)
    if is_rank0():
        os.makedirs(path, exist_ok=True)
    barrier()
    return _publish(root, path, iteration, _model_state(chunks),
                    {**common, **_quant_common(chunks), **layer_spec.record(chunks)})


# Test seam: callables (event, iteration, optimizer) run after each save ("save") and load ("load") of the
# optimizer state. Tests install one to compare a saved run's optimizer with the resumed one.
OPTIMIZER_OBSERVERS: list = []


def _notify(event: str, iteration: int, optimizer) -> None:
    for observer in OPTIMIZER_OBSERVERS:
        observer(event, iteration, optimizer)


def _materialize_optimizer_state(optimizer) -> None:
    """megatron-core's DistributedOptimizer without apex/TE reads a 'step' from every param state when it
    builds its state dict ("assert len(steps) == 1"), and a fresh optimizer has none: fill the states with
    megatron-core's own zero-grad dummy step (as it does for Megatron-FSDP); the load then overwrites them."""
    try:
        from megatron.core.optimizer.distrib_optimizer import HAVE_APEX_OR_TE
    except ImportError:  # pragma: no cover
        HAVE_APEX_OR_TE = False
    if HAVE_APEX_OR_TE:  # apex/TE Adam keeps its step in the param groups: the empty-state path works there
        return
    for o in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        init = getattr(o, "_init_optimizer_states_with_dummy_values", None)
        inner = getattr(o, "optimizer", None)
        if init is not None and inner is not None and len(inner.state) == 0:
            init()


def _restore_steps(optimizer) -> None:
    """Without apex/TE, the DistributedOptimizer saves Adam's step in its param groups and hands it to the
    per-param states while loading, but those are left holding the dummy step's count (1): Adam's bias
    correction then restarts. Put the saved step back into every per-param state."""
    for o in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(o, "optimizer", None)
        if inner is None or not hasattr(o, "_init_optimizer_states_with_dummy_values"):
            continue
        for g in inner.param_groups:
            if g.get("step") is None:
                continue
            for p in g["params"]:
                st = inner.state.get(p, {})
                if torch.is_tensor(st.get("step")):
                    st["step"] = torch.full_like(st["step"], float(g["step"]))


def load_checkpoint(root: str, chunks, optimizer, scheduler) -> dict | None:
    """Resume from root's latest checkpoint: weights, optimizer, scheduler, RNG. Returns its common state."""
    from megatron.core import dist_checkpointing
    it = latest_iteration(root)
    if it is None:
        return None
    path = resolve(root)
    common = dist_checkpointing.load_common_state_dict(path)
    _quantize_like(common, chunks)
    sd = _model_state(chunks)
    _materialize_optimizer_state(optimizer)
    sd["optimizer"] = optimizer.sharded_state_dict(sd, is_loading=True, metadata=OPTIM_METADATA)
    if tuple(common.get("layout", ())) == _layout():  # RNG streams only resume under the same TP/PP layout
        sd["rng_state"] = _rng_state(_layout())
    with _dcp_notice_off():
        loaded = dist_checkpointing.load(sd, path)
    _load_chunks(loaded, chunks)
    optimizer.load_state_dict(loaded["optimizer"])
    _restore_steps(optimizer)
    _notify("load", it, optimizer)
    scheduler.load_state_dict(common["scheduler"])
    rng = loaded.get("rng_state")
    if rng:
        from megatron.core import tensor_parallel
        torch.set_rng_state(rng["torch"])
        tensor_parallel.get_cuda_rng_tracker().set_states(rng["tracker"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return common


def load_weights(path: str, chunks) -> int:
    """Model weights only (teacher, or a pretrained student) from a save dir or an iter_* dir; any layout."""
    from megatron.core import dist_checkpointing
    from .integrity import require_intact
    require_intact(path)
    d = resolve(path)
    common = dist_checkpointing.load_common_state_dict(d)
    _quantize_like(common, chunks)
    sd = _model_state(chunks)
    with _dcp_notice_off():
        loaded = dist_checkpointing.load(sd, d)
    _load_chunks(loaded, chunks)
    return int(common.get("iteration", 0))


def read_common(path: str) -> dict:
    from megatron.core import dist_checkpointing
    return dist_checkpointing.load_common_state_dict(resolve(path))


# The checkpoint at a path against the layer spec a model is built on here (checkpoint/spec.py holds the rules and
# the sentences; these read the checkpoint they apply to).

def _common_at(path: str) -> dict:
    """The common state of the checkpoint at `path` (a save dir or iter_* dir); empty where it cannot be read: that
    is left to the load, whose failure names it (load_spec_weights)."""
    try:
        return read_common(path)
    except BaseException as e:  # torch's CheckpointException derives from BaseException
        if is_interrupt(e):
            raise
        return {}


def check_spec(path: str, m, what: str, setting: str) -> None:
    """layer_spec.refusal for the checkpoint at `path` (a save dir or iter_* dir), raised as RunError."""
    why = layer_spec.refusal(_common_at(path), m, what, setting)
    if why:
        raise RunError(why)


def build_as_saved_at(path: str, m, chosen: str | None, what: str, setting: str) -> None:
    """layer_spec.build_as_saved for the checkpoint at `path` (a save dir or iter_* dir)."""
    layer_spec.build_as_saved(_common_at(path), m, chosen, what, setting)


def load_spec_weights(path: str, chunks, what: str, setting: str) -> int:
    """load_weights with a failure as one sentence (RunError): the spec hint for a checkpoint of another spec that
    records none, else a damaged or incomplete checkpoint. Our own errors (the intact check's refusal) and
    interrupts pass as they are."""
    try:
        return load_weights(path, chunks)
    except BaseException as e:  # torch's CheckpointException derives from BaseException
        if is_interrupt(e) or isinstance(e, RecipeError):
            raise
        hint = layer_spec.spec_hint(e, chunks, what, setting)
        raise RunError(hint or f"{what} cannot be loaded ({layer_spec.summary(e)}): the checkpoint is damaged or "
                       "incomplete; load an intact one instead (another iter_* directory of that run, or a fresh "
                       "save)") from None
