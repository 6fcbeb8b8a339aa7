"""`EntryClass` of SGLang's external-model-package route: every served architecture.

Naming this package in SGLANG_EXTERNAL_MODEL_PACKAGE is an explicit request for ATOM, so
on an SGLang outside the tested range importing it raises `UnsupportedHostVersion`
(SGLang's registry logs that as an import error and keeps its own classes).
"""

from atom.hosts.plugin import check_host_version
from atom_sglang import SUPPORTED, served_architectures, sglang_version
from atom_sglang.model import wrapper_class

check_host_version(SUPPORTED, sglang_version(), True, None)
EntryClass = [wrapper_class(arch) for arch in served_architectures()]
