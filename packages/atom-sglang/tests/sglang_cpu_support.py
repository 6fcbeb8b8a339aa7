"""Every workaround that SGLang's engine (0.5.21 and 0.5.23) needs on a CPU-only test machine
(each one re-checked on both: without 2 or 3 its import fails; its source still reads 1
and imports triton unconditionally, 4).

Used only by these tests; atom_sglang itself needs none of it. `install()` runs in each
process that imports SGLang: the pytest process (conftest.py), each engine job's main
process, and SGLang's scheduler / detokenizer subprocesses, which reach it through the
`sitecustomize.py` that `engine_env()` puts first on their PYTHONPATH.

1. `SGLANG_USE_CPU_ENGINE=1`: `device="cpu"` alone is not enough; without it SGLang's
   rotary embedding imports `vllm._custom_ops`.
2. A stub `sgl_kernel` (SGLang's CPU kernel package is not on PyPI). With the stub,
   `torch.ops.sgl_kernel` has no ops, so SGLang's `cpu_has_amx_support()` is False and
   every layer runs its `forward_native` torch path; an op that is really called fails
   loudly with its name instead of a silent wrong result. Its one submodule,
   `sgl_kernel.mamba`, is a stub too: SGLang's hybrid linear-attention backend imports
   its CPU conv ops from there while the engine builds its attention backends, and
   reads two `torch.ops.sgl_kernel` GDN ops at import, which get schemas without
   kernels (`_GDN_OPS`; ATOM's Gated DeltaNet layers call none of these, and a call
   would fail: no kernel). `convert_weight_packed`, the op SGLang's AMX check looks
   for, stays undefined.
3. torchvision: PyPI's wheel is CUDA-linked, so its `_C` extension does not load against
   torch+cpu and `torchvision/_meta_registrations.py` fails on the two unguarded
   `register_fake("torchvision::nms" / "qnms")`. Defining those two op schemas (no
   kernels) before torchvision is imported lets the import succeed; nothing calls them.
4. The `triton` wheel must be installed (SGLang imports it unconditionally; it imports
   fine without a GPU). That is an install step (noxfile `tests_sglang`), not code here.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types
from pathlib import Path

HERE = Path(__file__).parent
STUB_PACKAGE = "sgl_kernel"
STUB_SUBMODULES = {f"{STUB_PACKAGE}.mamba"}
_TORCHVISION_OPS = {
    "nms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
# torch.ops.sgl_kernel ops that SGLang's GDN backend modules read at import on CPU.
_GDN_OPS = ("fused_sigmoid_gating_delta_rule_update_cpu", "fused_gdn_gating_cpu")
_installed = False


class _StubKernelModule(types.ModuleType):
    """`from sgl_kernel import name` succeeds for any name; calling it raises."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)

        def missing(*args, **kwargs):
            raise NotImplementedError(
                f"sgl_kernel stub (tests/sglang_cpu_support.py): {self.__name__}.{name} "
                "has no CPU implementation here"
            )

        missing.__name__ = name
        return missing


class _StubKernelFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves `sgl_kernel` and `STUB_SUBMODULES` as stub modules.

    Any other submodule is not found: `from sgl_kernel.scalar_type import ...` and the
    like raise ImportError, which is what SGLang's own fallbacks (mock scalar types, ...)
    expect.
    """

    def find_spec(self, fullname, path=None, target=None):
        if fullname != STUB_PACKAGE and fullname not in STUB_SUBMODULES:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=fullname == STUB_PACKAGE)

    def create_module(self, spec):
        module = _StubKernelModule(spec.name)
        if spec.name == STUB_PACKAGE:
            module.__path__ = []  # a package, so that its stub submodules import
        return module

    def exec_module(self, module) -> None:
        pass


def is_stub(op) -> bool:
    """Whether `op`, imported from `sgl_kernel`, is this stub's (calling it raises)."""
    return getattr(op, "__module__", None) == __name__ and op.__qualname__.startswith(
        "_StubKernelModule."
    )


def _define_torchvision_op_schemas() -> None:
    import torch

    if hasattr(torch.ops, "torchvision") and hasattr(torch.ops.torchvision, "nms"):
        return  # a torchvision whose extension loads (e.g. a CPU build) defines them
    library = torch.library.Library("torchvision", "FRAGMENT")
    for name, schema in _TORCHVISION_OPS.items():
        library.define(name + schema)
    _define_torchvision_op_schemas.library = library  # keep the fragment alive


def _define_gdn_op_schemas() -> None:
    import torch

    library = torch.library.Library(STUB_PACKAGE, "FRAGMENT")
    for name in _GDN_OPS:
        library.define(f"{name}(Tensor stub) -> Tensor")
    _define_gdn_op_schemas.library = library  # keep the fragment alive


def install() -> None:
    """Applies the workarounds in this process (idempotent)."""
    global _installed
    if _installed:
        return
    _installed = True
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    if not any(isinstance(f, _StubKernelFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _StubKernelFinder())
    _define_torchvision_op_schemas()
    _define_gdn_op_schemas()


def engine_env(workdir: Path, env: dict[str, str] | None = None) -> dict[str, str]:
    """An environment whose Python processes all run `install()` at start-up."""
    site = workdir / "cpu-site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(
        "import sglang_cpu_support\n\nsglang_cpu_support.install()\n"
    )
    env = dict(os.environ if env is None else env)
    paths = [str(site), str(HERE)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    return env
