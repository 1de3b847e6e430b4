"""Triton kernels for the engine, one module per kernel family.

The modules import triton at import time, so import them only where a kernel is wanted (the
triton attention backend does so lazily). To run them on CPU tensors, set TRITON_INTERPRET=1
before triton is first imported: the interpreter executes the same kernels with numpy.
"""
