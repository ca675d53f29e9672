// Pre-included in every NVRTC compile: what nvcc's implicit <cuda_runtime.h> (through <math.h>)
// gives gradgen's kernels and NVRTC does not.
#pragma once
#include <cuda/std/limits>
#ifndef INFINITY
#define INFINITY (::cuda::std::numeric_limits<float>::infinity())
#endif
#ifndef NAN
#define NAN (::cuda::std::numeric_limits<float>::quiet_NaN())
#endif
