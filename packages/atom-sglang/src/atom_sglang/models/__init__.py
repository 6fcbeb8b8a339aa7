"""ATOM's models as an SGLang external model package.

`SGLANG_EXTERNAL_MODEL_PACKAGE=atom_sglang.models` makes SGLang's model registry import
every module here and take its `EntryClass`, overriding SGLang's own classes of the
same architecture names. This works without the plugin entry point too.
"""
