"""CUDA launchers, registered next to the CPU kernels, one module per op family (the same family
names as grads/rules and kernels/cpu; each X.py compiles its kernels from X.cu).
gradgen/kernels/registry.py lists the families and imports them when CUDA is requested; importing
needs no GPU: each imports gradgen.cuda.runtime (and so PyCUDA) only when it runs."""
