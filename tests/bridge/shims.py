"""TEST/DEVICE-ONLY SHIMS: `import shims` from tests/bridge/ (its tests, benchmarks/bridge_*.py) runs the one copy,
tests/bridge_env/shims.py (stand-ins for Transformer Engine and nvidia-resiliency-ext; see its docstring)."""
import os
import runpy

runpy.run_path(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bridge_env", "shims.py"))
