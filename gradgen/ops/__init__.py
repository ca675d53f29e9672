"""The op-semantics layer: what an op means, independent of where it runs.

Every other layer takes an op's meaning from here: the gradient rules (build time), the CPU
kernels and CUDA launchers (run time), the lowering to standard ONNX (portable mode) and the
passes that evaluate or infer shapes. Nothing here imports another gradgen layer except
``gradgen.errors``; modules hold plain functions on Python ints, lists and numpy arrays.

- ``attributes``: an onnx-ir attribute as a plain value; a node's attributes as a dict.
- ``axes``: axis normalisation and validation, integer-list arguments.
- ``elementwise``: broadcasting (which axes each operand was broadcast over).
- ``shape``: Slice geometry (starts/ends/axes/steps clamped as the spec says).
- ``indexing``: index normalisation (negative indices, range checks).
- ``conv``: Conv / ConvTranspose geometry (pads, auto_pad, output shapes).
- ``matmul``: how FusedMatMul reads its operands (transposes, transBatch), MatMul's output dims.
- ``pool``: pooling geometry (ceil_mode, declared pads) and Resize geometry and coefficients.
- ``schemas``: the com.microsoft ops gradgen emits and runs, with their output types.

Errors are ``KernelError`` (bad values, found at run time); a build-time caller that has a node
turns them into a ``ModelError`` naming it.
"""
