"""Kernels: the numerical machinery merge methods share, below the methods and above the runtime.

Sorting replay (TIES' bit-equal magnitude selection), keyed random masks (DARE's and DELLA's counter-based
draws), bfloat16 mixing with mergekit's rounding, compiled loops (numba, where installed) and reductions whose
bits do not depend on the thread count. Nothing here knows a merge method's name or a config: a method calls
these with tensors and numbers, and each compiled group announces its own warm-up (compiled.KernelGroup).
"""
