"""The engines `atom bench` can run, and the environment each one's subprocess gets.

Host plugins (atom-vllm, atom-sglang) are found by their hosts through package entry
points, which a source checkout on PYTHONPATH does not provide. `entry_point_shim` writes
the minimal `*.dist-info` folder that `importlib.metadata` reads, so a plugin's source
folder on PYTHONPATH is enough, without pip.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from atom.bench.workloads import BenchError


@dataclass(frozen=True)
class Plugin:
    distribution: str
    group: str  # the host's entry-point group
    entry_point: str  # "name = module:function"
    disable_env: str


@dataclass(frozen=True)
class EngineSpec:
    name: str
    host: str  # the module the driver runs: "atom", "vllm" or "sglang"
    plugin: Plugin | None  # the ATOM plugin of the host; None runs the host's own model
    description: str


VLLM_PLUGIN = Plugin(
    "atom_vllm", "vllm.general_plugins", "atom = atom_vllm:register", "ATOM_DISABLE_VLLM_PLUGIN"
)
SGLANG_PLUGIN = Plugin(
    "atom_sglang", "sglang.srt.plugins", "atom = atom_sglang:register", "ATOM_DISABLE_SGLANG_PLUGIN"
)
PLUGINS = {"vllm": VLLM_PLUGIN, "sglang": SGLANG_PLUGIN}

ENGINES = {
    spec.name: spec
    for spec in (
        EngineSpec("atom", "atom", None, "ATOM's native engine"),
        EngineSpec("vllm", "vllm", None, "vLLM with its own model"),
        EngineSpec("vllm-atom", "vllm", VLLM_PLUGIN, "vLLM with atom-vllm (ATOM's model)"),
        EngineSpec("sglang", "sglang", None, "SGLang with its own model, triton attention"),
        EngineSpec(
            "sglang-atom", "sglang", SGLANG_PLUGIN, "SGLang with atom-sglang (ATOM's attention)"
        ),
    )
}
DEFAULT_ENGINES = "atom,vllm"


def parse_engines(text: str) -> list[EngineSpec]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in ENGINES]
    if unknown or not names:
        raise BenchError(f"unknown engine(s) {unknown or text!r}; known: {', '.join(ENGINES)}")
    if len(set(names)) != len(names):
        raise BenchError(f"engines {text!r} repeat one")
    return [ENGINES[n] for n in names]


def entry_point_shim(root: Path, plugin: Plugin) -> Path:
    """A folder holding `<plugin>.dist-info` that declares the plugin's entry point."""
    folder = root / f"entry-points-{plugin.distribution}"
    info = folder / f"{plugin.distribution}-0+source.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    name = plugin.distribution.replace("_", "-")
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0+source\n")
    (info / "entry_points.txt").write_text(f"[{plugin.group}]\n{plugin.entry_point}\n")
    return folder


def engine_env(spec: EngineSpec, host_paths: dict[str, str | None], work: Path) -> dict[str, str]:
    """The child's environment: its host's PYTHONPATH prefix and the plugin switched on
    (entry-point shim on the path) or off (the plugin's disable variable)."""
    env = dict(os.environ)
    prefix = []
    if spec.host in PLUGINS:
        if host_paths.get(spec.host):
            prefix.append(host_paths[spec.host])
        plugin = PLUGINS[spec.host]
        if spec.plugin is None:
            env[plugin.disable_env] = "1"
        else:
            env.pop(plugin.disable_env, None)
            prefix.append(str(entry_point_shim(work, plugin)))
    if spec.host == "vllm":
        # Spawned workers do not inherit torch's CPU threads; FlashInfer's sampler needs
        # a JIT toolchain the staged vLLM lacks.
        env["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    env["PYTHONPATH"] = os.pathsep.join(prefix + [p for p in [env.get("PYTHONPATH")] if p])
    return env
