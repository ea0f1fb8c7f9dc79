"""TEST/DEVICE-ONLY SHIMS (vendored from ../shared/bridge/shims.py for the Python 3.12 CI job and the H200 device
machine, which carry only this repository). Not used by the package: import this before `megatron.bridge` where
Transformer Engine and nvidia-resiliency-ext are absent. In the NeMo container the real packages are there and this
module changes nothing (a real TE / nvrx import wins).
TEST SHIMS, not real packages. 1) megatron-core is imported first with no transformer_engine present (its HAVE_TE
flags settle to False), then a stub `transformer_engine.pytorch` is put in sys.modules so Bridge's unconditional
`import transformer_engine.pytorch as te` (megatron/bridge/peft/lora_layers.py:20) passes; any use of it raises.
2) nvidia_resiliency_ext: PyPI's newest (0.4.1) breaks `import megatron.core` 0.19.2 (nvrx.py:85 reads __version__,
needs >=0.6.0); Bridge's pretrain.py:19 only needs the name CallWrapper (a type annotation)."""
import sys, types
if "nvidia_resiliency_ext" not in sys.modules:
    try:
        import nvidia_resiliency_ext.inprocess  # noqa: F401  (a real >=0.6.0 install wins)
    except ImportError:
        nv = types.ModuleType("nvidia_resiliency_ext"); nv.__path__ = []
        ip = types.ModuleType("nvidia_resiliency_ext.inprocess"); ip.CallWrapper = type("CallWrapper", (), {})
        nv.inprocess = ip; sys.modules.update({"nvidia_resiliency_ext": nv, "nvidia_resiliency_ext.inprocess": ip})
import megatron.core, megatron.core.extensions.transformer_engine, megatron.core.fp8_utils, megatron.core.fp4_utils  # noqa
import megatron.core.distributed, megatron.core.optimizer, megatron.core.models.gpt, megatron.core.transformer.moe.moe_utils  # noqa
for _m in ("peft", "diffusers"):  # import before the stub: they probe find_spec('transformer_engine')
    try:
        __import__(_m)
    except Exception:
        pass
try:
    import transformer_engine.pytorch  # noqa: F401  (real TE: nothing to do)
except ImportError:
    class _Dummy:
        def __init__(self, *a, **k): raise RuntimeError("transformer_engine stub: not Transformer Engine")
    class _NS(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"): raise AttributeError(name)
            cls = type(name, (_Dummy,), {}); setattr(self, name, cls); return cls
    import importlib.machinery
    te = types.ModuleType("transformer_engine"); te.__version__ = "0.0.0+stub"; te.__path__ = []
    te.__spec__ = importlib.machinery.ModuleSpec("transformer_engine", None, is_package=True)
    tp = _NS("transformer_engine.pytorch"); tp.__path__ = []; tp.ops = _NS("transformer_engine.pytorch.ops"); te.pytorch = tp
    sys.modules.update({"transformer_engine": te, "transformer_engine.pytorch": tp, "transformer_engine.pytorch.ops": tp.ops})
# The megatron-core wheel ships its C++ dataset helpers prebuilt (helpers_cpp) but no Makefile; Bridge's
# initialize_megatron calls compile_helpers(), which runs `make` and exits on failure.
import megatron.core.datasets.utils as _du
_du.compile_helpers = lambda: None
try:
    import megatron.bridge.training.initialize as _bi
    _bi.compile_helpers = lambda: None
except Exception:
    pass
