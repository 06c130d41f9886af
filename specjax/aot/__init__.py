"""Ahead-of-time compilation of the production graphs for NVIDIA H100/H200, with or without the GPU (specjax compile).

device.py: where a compile runs (an attached GPU, or a deviceless topology from the committed target configs);
graphs.py: the kernel's block-plan sweep and the plain and speculative loops as shapes only; compile.py: compile
each, the compiler's memory analysis, kernels and collectives, the command; memory.py: the memory plan next to the
compiler's figure for the same loop.
"""
