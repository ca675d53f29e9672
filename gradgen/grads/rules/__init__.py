"""Gradient rules, one module per op family (the same family names as kernels/cpu, kernels/cuda and
passes/lowering). gradgen/grads/registry.py lists the families and imports them on first use."""
