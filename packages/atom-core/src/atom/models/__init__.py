"""ATOM model implementations; `atom.registry` maps HF architectures onto them."""
