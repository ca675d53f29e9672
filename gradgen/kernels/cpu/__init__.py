"""numpy CPU kernels, one small function per op, in one module per op family (the same family
names as grads/rules and kernels/cuda); gradgen/kernels/registry.py lists the families and imports
them on first use."""
