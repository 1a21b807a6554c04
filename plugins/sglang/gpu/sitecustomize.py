# GPU-machine-only shim: SGLang imports CUDA-only packages (sgl_kernel, flashinfer, ...) at module
# level when CUDA is present.  They are not installable there; stub ONLY those that are missing,
# and make every stub attribute raise when called, so a code path that really uses one fails loud.
import importlib.abc, importlib.machinery, sys, types
STUBS = {"sgl_kernel", "flashinfer", "deep_gemm", "sgl_deep_gemm", "flash_mla", "sgl_flash_mla", "humming",
         "tilelang", "quack", "torch_memory_saver", "xgrammar", "nvshmem", "deep_ep", "flash_attn",
         "flash_attn_4", "cutlass", "nvidia_cutlass_dsl", "llguidance", "outlines", "openai_harmony", "kernels"}
class _Leaf:
    def __init__(self, name):
        self._name = name
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Leaf(f"{self._name}.{name}")
    def __call__(self, *a, **k):
        raise RuntimeError(f"{self._name} is a stub on the GPU test machine")
class _Stub(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Leaf(f"{self.__name__}.{name}")
class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in STUBS:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
    def create_module(self, spec):
        m = _Stub(spec.name); m.__path__ = []; return m
    def exec_module(self, module):
        pass
sys.meta_path.append(_Finder())  # after the real finders: an installed package always wins
