"""`atom bench`: ATOM's native engine and its peers on one GPU, same checkpoint, same prompts.

Each engine runs in its own subprocess (`atom.bench.driver`), one checkpoint shape at a
time; hosts with conflicting pins (vLLM, SGLang) get their own PYTHONPATH prefix. The
parent never imports torch, and checkpoints are written by a process of their own (vLLM
hangs in a process that did CPU torch work before it forked its engine).
"""
