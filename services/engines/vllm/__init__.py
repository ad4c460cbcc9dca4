"""The vLLM engine: real models on CUDA GPUs through vLLM's v1 AsyncLLM (`engine.py`).

Importing this package needs neither vLLM nor a GPU: vLLM is imported when an engine is built
(`loader.load_vllm`), and a machine without it gets an ImportError that names the extra to
install, `pip install 'ripplemesh[vllm]'`.
"""

from services.engines.vllm.engine import VllmEngine, make_vllm_engine
from services.engines.vllm.loader import MISSING_VLLM, load_vllm, vllm_available

__all__ = ["MISSING_VLLM", "VllmEngine", "load_vllm", "make_vllm_engine", "vllm_available"]
