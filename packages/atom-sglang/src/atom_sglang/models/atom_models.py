"""`EntryClass` of SGLang's external-model-package route: every served architecture."""

from atom_sglang import served_architectures
from atom_sglang.model import wrapper_class

EntryClass = [wrapper_class(arch) for arch in served_architectures()]
