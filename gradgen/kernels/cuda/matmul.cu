// Kernels of the matmul family that are not cuBLAS calls (matmul.py): Det.
#include "common.h"

// ---------------------------------------------------------------------------------------------
// Det: one thread per matrix of m (batch, n, n), a C-contiguous copy in the compute type that the
// thread overwrites: LU factorisation with partial pivoting (the largest |value| of the column,
// the first such row on ties, as LAPACK's getrf), the determinant being the product of the
// pivots, negated per row swap; a zero column gives 0 at once. Meant for small n (the launcher's
// limit): each thread's reads are strided, and its work is n^3 / 3.
template <typename A>
__device__ void det_lu(A* __restrict__ out, A* __restrict__ m, int64_t batch, int64_t n) {
    GG_GRID_STRIDE(b, batch) {
        A* a = m + b * n * n;
        A det = A(1);
        for (int64_t k = 0; k < n; ++k) {
            int64_t p = k;
            A largest = fabs(a[k * n + k]);
            for (int64_t r = k + 1; r < n; ++r) {
                const A v = fabs(a[r * n + k]);
                if (v > largest) {
                    largest = v;
                    p = r;
                }
            }
            if (largest == A(0)) {
                det = A(0);
                break;
            }
            if (p != k) {
                for (int64_t c = k; c < n; ++c) {
                    const A t = a[k * n + c];
                    a[k * n + c] = a[p * n + c];
                    a[p * n + c] = t;
                }
                det = -det;
            }
            const A pivot = a[k * n + k];
            det *= pivot;
            for (int64_t r = k + 1; r < n; ++r) {
                const A f = a[r * n + k] / pivot;
                for (int64_t c = k + 1; c < n; ++c) a[r * n + c] -= f * a[k * n + c];
            }
        }
        out[b] = det;
    }
}

extern "C" __global__ void det_lu_f32(float* out, float* m, int64_t batch, int64_t n) { det_lu<float>(out, m, batch, n); }
extern "C" __global__ void det_lu_f64(double* out, double* m, int64_t batch, int64_t n) { det_lu<double>(out, m, batch, n); }
