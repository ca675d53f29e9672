// Indexing kernels: Gather, GatherElements, GatherND. They move bits: entry points are suffixed by
// the element WIDTH in bytes (w1..w16; the launchers move contiguous runs as wider words) and the
// index type (i32, i64). Negative indices are normalised; an out-of-range index writes nothing and
// sets *flag to its position + 1 (the launcher then raises the CPU kernel's error).
//
// The deterministic scatters, shared by the com.microsoft gradient ops (GatherGrad,
// GatherElementsGrad) and ScatterND / ScatterElements (SliceGrad lives in shape.cu: it is the
// one-pass lattice kernel with fill 0):
//
// Row scatter (GatherGrad, ScatterND): dX[o, r, :] = init[o, r, :] (+)= dY[o, p, :] for every
// position p whose key is r, summed in position order, no float atomics:
//   csr_tile_sort  tiles of TILE positions: keys (normalised indices; range errors set the flag),
//                  stable block radix sort by key, and for every run of equal keys its place among
//                  the positions of that key in earlier tiles (tiles take turns in tile order for
//                  that, so the result does not depend on scheduling); integer atomics only.
//   csr_scan       one block: rowptr = exclusive scan of the per-key counts; long rows (more than C
//                  positions) are cut into chunks of C positions.
//   csr_place      sorted_pos[rowptr[key] + rank] = position (a stable counting sort).
//   csr_rows       one block per (outer, row) and per extra chunk of a long row: sums its positions
//                  in order (threads split positions, then a fixed tree), writes dX (every element
//                  exactly once, zero rows included: no memset), or a partial sum for long rows.
//   csr_long       long rows: adds their chunks' partial sums in chunk order.
//
// Line scatter (GatherElementsGrad, ScatterElements): one block per line of dX along the axis; the
// line lives in shared memory (or, when too long, in dX itself, owned by that block); positions are
// taken in tiles, stably sorted by target, and each run is folded into the line in position order.
// ge_atomic is the optional atomicAdd path of GatherElementsGrad.
//
// GatherGrad (up to GO_MAX positions, see gg_own below): one launch; blocks own row ranges, scan the
// indices in order and sum each row's positions in position order; the CSR kernels above serve larger
// position counts and ScatterND.
#define GG_PARTS 4  // compiled as 4 parts at once (common.h: GG_PART)
#include "common.h"
#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_scan.cuh>

template <typename IDX>
__device__ __forceinline__ bool gg_norm(IDX v, int64_t size, int64_t& out) {
    int64_t x = (int64_t)v;
    if (x < 0) x += size;
    out = x;
    return x >= 0 && x < size;
}

__device__ __forceinline__ void gg_set_flag(long long* flag, int64_t position) {
    atomicCAS(reinterpret_cast<unsigned long long*>(flag), 0ull, (unsigned long long)(position + 1));
}

struct MaxOp {
    __device__ __forceinline__ int operator()(int a, int b) const { return a > b ? a : b; }
};

// ------------------------------------------------------------------ row scatter (CSR)

constexpr int TS_THREADS = 256, TS_ITEMS = 8, TS_TILE = TS_THREADS * TS_ITEMS;

// kd.shape[t] = size of the axis indexed by component t, kd.strides[t] = its row multiplier;
// indices are (count, k) row-major. sync[0]: tile tickets, sync[1]: tiles done.
template <typename IDX>
__device__ void csr_tile_sort(const IDX* __restrict__ idx, uint32_t* keys_out, uint32_t* pos_out, uint32_t* rank_out,
                              uint32_t* counts, long long* flag, unsigned int* sync, TensorDesc kd, int64_t count,
                              int64_t sentinel, int64_t end_bit) {
    using Sort = cub::BlockRadixSort<uint32_t, TS_THREADS, TS_ITEMS, uint32_t>;
    using Scan = cub::BlockScan<int, TS_THREADS>;
    __shared__ union {
        typename Sort::TempStorage sort;
        typename Scan::TempStorage scan;
    } tmp;
    __shared__ uint32_t skeys[TS_TILE];
    __shared__ uint32_t sbase[TS_TILE];
    __shared__ unsigned int tile_s;
    if (threadIdx.x == 0) tile_s = atomicAdd(&sync[0], 1u);
    __syncthreads();
    const unsigned int tile = tile_s;
    const int64_t base = (int64_t)tile * TS_TILE;
    const int k = (int)kd.rank;
    uint32_t key[TS_ITEMS], val[TS_ITEMS];
#pragma unroll
    for (int i = 0; i < TS_ITEMS; ++i) {
        const int64_t p = base + threadIdx.x * TS_ITEMS + i;
        key[i] = (uint32_t)sentinel;
        val[i] = (uint32_t)p;
        if (p < count) {
            int64_t row = 0;
            bool ok = true;
            for (int t = 0; t < k; ++t) {
                int64_t x;
                ok = gg_norm(idx[p * k + t], kd.shape[t], x) && ok;
                row += x * kd.strides[t];
            }
            if (ok) key[i] = (uint32_t)row;
            else gg_set_flag(flag, p);
        }
    }
    Sort(tmp.sort).Sort(key, val, 0, (int)end_bit);
    __syncthreads();
#pragma unroll
    for (int i = 0; i < TS_ITEMS; ++i) skeys[threadIdx.x * TS_ITEMS + i] = key[i];
    __syncthreads();
    int head[TS_ITEMS], seg[TS_ITEMS];
#pragma unroll
    for (int i = 0; i < TS_ITEMS; ++i) {
        const int g = threadIdx.x * TS_ITEMS + i;
        head[i] = (g == 0 || skeys[g - 1] != key[i]) ? g : 0;
    }
    Scan(tmp.scan).InclusiveScan(head, seg, MaxOp());
#pragma unroll
    for (int i = 0; i < TS_ITEMS; ++i) {  // run lengths, kept at the run's head
        const int g = threadIdx.x * TS_ITEMS + i;
        const bool tail = g == TS_TILE - 1 || skeys[g + 1] != key[i];
        if (tail && key[i] != (uint32_t)sentinel) sbase[seg[i]] = (uint32_t)(g - seg[i] + 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {  // wait for the previous tile
        while (atomicAdd(&sync[1], 0u) != tile) {
        }
        __threadfence();
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < TS_ITEMS; ++i) {
        const int g = threadIdx.x * TS_ITEMS + i;
        if (seg[i] == g && key[i] != (uint32_t)sentinel) sbase[g] = atomicAdd(&counts[key[i]], sbase[g]);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicExch(&sync[1], tile + 1);
    }
#pragma unroll
    for (int i = 0; i < TS_ITEMS; ++i) {
        const int g = threadIdx.x * TS_ITEMS + i;
        const int64_t q = base + g;
        if (q < count) {
            keys_out[q] = key[i];
            pos_out[q] = val[i];
            rank_out[q] = key[i] != (uint32_t)sentinel ? sbase[seg[i]] + (uint32_t)(g - seg[i]) : 0u;
        }
    }
}

#if GG_PART(0)
extern "C" __global__ void csr_tile_sort_i32(const int32_t* idx, uint32_t* keys, uint32_t* pos, uint32_t* rank,
                                             uint32_t* counts, long long* flag, unsigned int* sync, TensorDesc kd,
                                             int64_t count, int64_t sentinel, int64_t end_bit) {
    csr_tile_sort(idx, keys, pos, rank, counts, flag, sync, kd, count, sentinel, end_bit);
}
extern "C" __global__ void csr_tile_sort_i64(const int64_t* idx, uint32_t* keys, uint32_t* pos, uint32_t* rank,
                                             uint32_t* counts, long long* flag, unsigned int* sync, TensorDesc kd,
                                             int64_t count, int64_t sentinel, int64_t end_bit) {
    csr_tile_sort(idx, keys, pos, rank, counts, flag, sync, kd, count, sentinel, end_bit);
}
#endif

struct ScanPrefix {
    uint32_t running;
    __device__ uint32_t operator()(uint32_t aggregate) {
        const uint32_t old = running;
        running += aggregate;
        return old;
    }
};

constexpr int SC_THREADS = 1024, SC_ITEMS = 8;

// rowptr[R+1] = exclusive scan of counts. Long rows (more than C positions) get C-position chunks:
// chunk 0 is the row's own, the others are listed in chunk_map as (row, chunk) pairs; each long row
// gets a run of partial-sum slots from row_slot[row] on. meta (zeroed): {extra chunks, slots, long
// rows}. Where in these lists a long row lands does not change any sum (chunks and their order are
// fixed by the positions), so plain integer atomics hand them out.
#if GG_PART(1)
extern "C" __global__ void __launch_bounds__(SC_THREADS) csr_scan(const uint32_t* counts, uint32_t* rowptr,
        uint32_t* row_slot, uint32_t* chunk_map, uint32_t* long_rows, uint32_t* meta, int64_t R, int64_t C) {
    using Scan = cub::BlockScan<uint32_t, SC_THREADS>;
    __shared__ typename Scan::TempStorage tmp;
    ScanPrefix prefix{0u};
    for (int64_t t0 = 0; t0 < R; t0 += (int64_t)SC_THREADS * SC_ITEMS) {
        uint32_t in[SC_ITEMS], out[SC_ITEMS];
#pragma unroll
        for (int i = 0; i < SC_ITEMS; ++i) {
            const int64_t r = t0 + threadIdx.x * SC_ITEMS + i;
            in[i] = r < R ? counts[r] : 0u;
        }
        Scan(tmp).ExclusiveSum(in, out, prefix);
        __syncthreads();
#pragma unroll
        for (int i = 0; i < SC_ITEMS; ++i) {
            const int64_t r = t0 + threadIdx.x * SC_ITEMS + i;
            if (r < R) {
                rowptr[r] = out[i];
                if (in[i] > (uint64_t)C) {
                    const uint32_t chunks = (uint32_t)((in[i] + C - 1) / C);
                    row_slot[r] = atomicAdd(&meta[1], chunks);
                    long_rows[atomicAdd(&meta[2], 1u)] = (uint32_t)r;
                    const uint32_t e = atomicAdd(&meta[0], chunks - 1);
                    for (uint32_t c = 1; c < chunks; ++c) {
                        chunk_map[2 * (e + c - 1)] = (uint32_t)r;
                        chunk_map[2 * (e + c - 1) + 1] = c;
                    }
                }
            }
        }
    }
    if (threadIdx.x == 0) rowptr[R] = prefix.running;
}
#endif

#if GG_PART(2)
extern "C" __global__ void csr_place(const uint32_t* keys, const uint32_t* pos, const uint32_t* rank,
                                     const uint32_t* rowptr, uint32_t* sorted_pos, int64_t count, int64_t sentinel) {
    GG_GRID_STRIDE(i, count) {
        const uint32_t key = keys[i];
        if (key != (uint32_t)sentinel) sorted_pos[rowptr[key] + rank[i]] = pos[i];
    }
}
#endif

template <typename T, int V> struct alignas(sizeof(T) * V) Vec { T v[V]; };

// mode 0: add (dX = init + sum), 1: none (the last position wins; rows without positions keep init).
template <typename T, int V>
__device__ void csr_rows(T* __restrict__ dx, const T* __restrict__ dy, const T* __restrict__ init,
                         const uint32_t* __restrict__ spos, const uint32_t* __restrict__ rowptr,
                         const uint32_t* __restrict__ row_slot, const uint32_t* __restrict__ chunk_map,
                         const uint32_t* __restrict__ meta,
                         typename Acc<T>::type* __restrict__ partial, int64_t outer, int64_t R, int64_t count,
                         int64_t inner_v, int64_t C, int64_t xbound, int64_t maxslots, int64_t col_lanes, int64_t mode) {
    using A = typename Acc<T>::type;
    using VT = Vec<T, V>;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    A* red = reinterpret_cast<A*>(smem_raw);
    const int cl = threadIdx.x % col_lanes, pl = threadIdx.x / col_lanes, P = blockDim.x / col_lanes;
    const uint32_t nextra = meta[0];
    const int64_t per_outer = R + xbound;
    const VT* dyv = reinterpret_cast<const VT*>(dy);
    const VT* initv = reinterpret_cast<const VT*>(init);
    VT* dxv = reinterpret_cast<VT*>(dx);
    for (int64_t w = blockIdx.x; w < outer * per_outer; w += gridDim.x) {
        const int64_t o = w / per_outer, t = w - o * per_outer;
        int64_t r, c;
        if (t < R) {
            r = t;
            c = 0;
        } else {
            const int64_t e = t - R;
            if (e >= nextra) continue;
            r = chunk_map[2 * e];
            c = chunk_map[2 * e + 1];
        }
        const int64_t row_a = rowptr[r], row_b = rowptr[r + 1];
        const bool is_long = mode == 0 && row_b - row_a > C;
        const int64_t a = mode == 0 ? row_a + c * C : row_a;
        const int64_t b = mode == 0 ? min(a + C, row_b) : row_b;
        int64_t slot = 0;
        if (is_long) slot = row_slot[r] + c;
        for (int64_t col0 = 0; col0 < inner_v; col0 += col_lanes) {
            const int64_t col = col0 + cl;
            const bool active = col < inner_v;
            A acc[V];
#pragma unroll
            for (int e = 0; e < V; ++e) acc[e] = A(0);
            if (active) {
                if (mode == 1) {
                    if (pl == 0 && b > a) {
                        VT y = dyv[(o * count + spos[b - 1]) * inner_v + col];
#pragma unroll
                        for (int e = 0; e < V; ++e) acc[e] = gg_load(&y.v[e]);
                    }
                } else {
                    for (int64_t p = a + pl; p < b; p += P) {
                        VT y = dyv[(o * count + spos[p]) * inner_v + col];
#pragma unroll
                        for (int e = 0; e < V; ++e) acc[e] += gg_load(&y.v[e]);
                    }
                }
            }
            if (P > 1) {
#pragma unroll
                for (int e = 0; e < V; ++e) red[threadIdx.x * V + e] = acc[e];
                __syncthreads();
                for (int s = P / 2; s > 0; s /= 2) {
                    if (pl < s) {
#pragma unroll
                        for (int e = 0; e < V; ++e) red[threadIdx.x * V + e] += red[(threadIdx.x + s * col_lanes) * V + e];
                    }
                    __syncthreads();
                }
#pragma unroll
                for (int e = 0; e < V; ++e) acc[e] = red[threadIdx.x * V + e];
                __syncthreads();
            }
            if (pl == 0 && active) {
                if (is_long) {
                    A* dst = partial + ((o * maxslots + slot) * inner_v + col) * V;
#pragma unroll
                    for (int e = 0; e < V; ++e) dst[e] = acc[e];
                } else {
                    VT out;
                    const int64_t at = (o * R + r) * inner_v + col;
                    if (mode == 1 && b == a) {
                        if (init) out = initv[at];
                        else {
#pragma unroll
                            for (int e = 0; e < V; ++e) gg_store(&out.v[e], A(0));
                        }
                    } else if (init && mode == 0) {
                        VT s0 = initv[at];
#pragma unroll
                        for (int e = 0; e < V; ++e) gg_store(&out.v[e], gg_load(&s0.v[e]) + acc[e]);
                    } else {
#pragma unroll
                        for (int e = 0; e < V; ++e) gg_store(&out.v[e], acc[e]);
                    }
                    dxv[at] = out;
                }
            }
        }
    }
}

template <typename T, int V>
__device__ void csr_long(T* __restrict__ dx, const T* __restrict__ init, const typename Acc<T>::type* __restrict__ partial,
                         const uint32_t* __restrict__ rowptr, const uint32_t* __restrict__ long_rows,
                         const uint32_t* __restrict__ row_slot, const uint32_t* __restrict__ meta, int64_t outer,
                         int64_t R, int64_t inner_v, int64_t C, int64_t maxslots) {
    using A = typename Acc<T>::type;
    using VT = Vec<T, V>;
    const uint32_t nlong = meta[2];
    for (int64_t w = blockIdx.x; w < outer * (int64_t)nlong; w += gridDim.x) {
        const int64_t o = w / nlong, li = w - o * nlong;
        const int64_t r = long_rows[li];
        const int64_t chunks = (rowptr[r + 1] - rowptr[r] + C - 1) / C;
        const int64_t s0 = row_slot[r];
        for (int64_t col = threadIdx.x; col < inner_v; col += blockDim.x) {
            const int64_t at = (o * R + r) * inner_v + col;
            A acc[V];
            if (init) {
                VT s = reinterpret_cast<const VT*>(init)[at];
#pragma unroll
                for (int e = 0; e < V; ++e) acc[e] = gg_load(&s.v[e]);
            } else {
#pragma unroll
                for (int e = 0; e < V; ++e) acc[e] = A(0);
            }
            for (int64_t c = 0; c < chunks; ++c) {
                const A* src = partial + ((o * maxslots + s0 + c) * inner_v + col) * V;
#pragma unroll
                for (int e = 0; e < V; ++e) acc[e] += src[e];
            }
            VT out;
#pragma unroll
            for (int e = 0; e < V; ++e) gg_store(&out.v[e], acc[e]);
            reinterpret_cast<VT*>(dx)[at] = out;
        }
    }
}

#define GG_CSR(sfx, T, V)                                                                                      \
    extern "C" __global__ void csr_rows_##sfx##_v##V(                                                          \
        T* dx, const T* dy, const T* init, const uint32_t* spos, const uint32_t* rowptr, const uint32_t* row_slot, \
        const uint32_t* chunk_map, const uint32_t* meta, Acc<T>::type* partial, int64_t outer,                 \
        int64_t R, int64_t count, int64_t inner_v, int64_t C, int64_t xbound, int64_t maxslots, int64_t col_lanes, \
        int64_t mode) {                                                                                        \
        csr_rows<T, V>(dx, dy, init, spos, rowptr, row_slot, chunk_map, meta, partial, outer, R, count, inner_v,   \
                       C, xbound, maxslots, col_lanes, mode);                                                  \
    }                                                                                                          \
    extern "C" __global__ void csr_long_##sfx##_v##V(T* dx, const T* init, const Acc<T>::type* partial,        \
                                                     const uint32_t* rowptr, const uint32_t* long_rows,        \
                                                     const uint32_t* row_slot, const uint32_t* meta, int64_t outer, \
                                                     int64_t R, int64_t inner_v, int64_t C, int64_t maxslots) { \
        csr_long<T, V>(dx, init, partial, rowptr, long_rows, row_slot, meta, outer, R, inner_v, C, maxslots);  \
    }

#if GG_PART(3)
GG_CSR(f16, __half, 1)
GG_CSR(f16, __half, 8)
GG_CSR(bf16, __nv_bfloat16, 1)
GG_CSR(bf16, __nv_bfloat16, 8)
GG_CSR(f32, float, 1)
#endif
#if GG_PART(4)
GG_CSR(f32, float, 4)
GG_CSR(f64, double, 1)
GG_CSR(f64, double, 2)
#endif


constexpr int GR_COLS = 8;  // vectors per lane per pass over a row (GatherGrad)

// ------------------------------------------------------------------ GatherGrad: rows owned by blocks

// One launch, no sort and no workspace: block b owns rows [r0, r0 + RB) of one outer slice. It reads
// every index (tile by tile, in a fixed order per block), keeps the positions that hit its rows (an ordered compaction into
// shared memory), then one warp per row sums that row's positions in that order (a ballot scan
// of the list) and writes the row once with 16-byte stores; rows without positions get zeros. When
// the list would overflow, the rows are folded in rounds (a row seen in an earlier round is re-read
// from dX: the same warp wrote it). Block 0 reports range errors into the (zeroed) flag.
constexpr int GO_THREADS = 256, GO_ITEMS = 8, GO_TILE = GO_THREADS * GO_ITEMS, GO_CAP = 2 * GO_TILE;
constexpr int GO_MAXRB = 1024;

template <typename T, int V, typename IDX>
__device__ void gg_own(T* __restrict__ dx, const T* __restrict__ dy, const IDX* __restrict__ idx, long long* flag,
                       int64_t outer, int64_t R, int64_t count, int64_t inner_v, int64_t RB, int64_t rotate) {
    using A = typename Acc<T>::type;
    using VT = Vec<T, V>;
    using Scan = cub::BlockScan<int, GO_THREADS>;
    __shared__ typename Scan::TempStorage scan_tmp;
    __shared__ int lkey[GO_CAP];
    __shared__ uint32_t lpos[GO_CAP];
    __shared__ unsigned char touched[GO_MAXRB];
    __shared__ int s_m;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int64_t nbo = (R + RB - 1) / RB;
    const int64_t o = blockIdx.x / nbo;
    const int64_t r0 = (blockIdx.x - o * nbo) * RB;
    const int64_t nrows = min(RB, R - r0);
    const bool report = blockIdx.x == 0;
    for (int k = tid; k < nrows; k += GO_THREADS) touched[k] = 0;
    const VT* dyv = reinterpret_cast<const VT*>(dy);
    VT* dxv = reinterpret_cast<VT*>(dx);
    // Tiles are read from tile `shift` on, wrapping around (rotate: blocks start at different tiles, so
    // they do not all read the same lines at once); the order is fixed per block, so sums are too.
    const int64_t ntiles = (count + GO_TILE - 1) / GO_TILE;
    const int64_t shift = rotate ? (int64_t)blockIdx.x % ntiles : 0;
    int64_t done = 0;
    for (;;) {
        if (tid == 0) s_m = 0;
        __syncthreads();
        while (done < ntiles && s_m + GO_TILE <= GO_CAP) {
            int64_t cursor = done + shift;
            cursor = (cursor >= ntiles ? cursor - ntiles : cursor) * GO_TILE;
            int key[GO_ITEMS];
            int hits = 0;
#pragma unroll
            for (int i = 0; i < GO_ITEMS; ++i) {
                const int64_t p = cursor + (int64_t)tid * GO_ITEMS + i;
                key[i] = -1;
                if (p < count) {
                    int64_t x;
                    if (gg_norm(idx[p], R, x)) {
                        if (x >= r0 && x < r0 + nrows) {
                            key[i] = (int)(x - r0);
                            ++hits;
                        }
                    } else if (report) {
                        gg_set_flag(flag, p);
                    }
                }
            }
            int off, total;
            Scan(scan_tmp).ExclusiveSum(hits, off, total);
            const int m = s_m;
#pragma unroll
            for (int i = 0; i < GO_ITEMS; ++i) {
                if (key[i] >= 0) {
                    lkey[m + off] = key[i];
                    lpos[m + off] = (uint32_t)(cursor + (int64_t)tid * GO_ITEMS + i);
                    ++off;
                }
            }
            __syncthreads();
            if (tid == 0) s_m = m + total;
            __syncthreads();
            ++done;
        }
        const bool last = done >= ntiles;
        const int m = s_m;
        for (int k = warp; k < nrows; k += GO_THREADS / 32) {
            const int64_t row = (o * R + r0 + k) * inner_v;
            const bool was = touched[k] != 0;
            bool any = false;
            for (int64_t cb = 0; cb < inner_v; cb += 32 * GR_COLS) {
                A acc[GR_COLS][V];
#pragma unroll
                for (int c = 0; c < GR_COLS; ++c) {
                    const int64_t col = cb + lane + c * 32;
                    if (was && col < inner_v) {
                        const VT w = dxv[row + col];
#pragma unroll
                        for (int e = 0; e < V; ++e) acc[c][e] = gg_load(&w.v[e]);
                    } else {
#pragma unroll
                        for (int e = 0; e < V; ++e) acc[c][e] = A(0);
                    }
                }
                for (int j0 = 0; j0 < m; j0 += 32) {
                    const int j = j0 + lane;
                    unsigned int mask = __ballot_sync(0xffffffffu, j < m && lkey[j] == k);
                    while (mask) {
                        const int b = __ffs(mask) - 1;
                        mask &= mask - 1;
                        any = true;
                        const int64_t src = (o * count + lpos[j0 + b]) * inner_v + cb + lane;
                        VT y[GR_COLS];
#pragma unroll
                        for (int c = 0; c < GR_COLS; ++c)
                            if (cb + lane + c * 32 < inner_v) y[c] = dyv[src + c * 32];
#pragma unroll
                        for (int c = 0; c < GR_COLS; ++c)
                            if (cb + lane + c * 32 < inner_v) {
#pragma unroll
                                for (int e = 0; e < V; ++e) acc[c][e] += gg_load(&y[c].v[e]);
                            }
                    }
                }
                if (any || (last && !was)) {
#pragma unroll
                    for (int c = 0; c < GR_COLS; ++c) {
                        const int64_t col = cb + lane + c * 32;
                        if (col < inner_v) {
                            VT w;
#pragma unroll
                            for (int e = 0; e < V; ++e) gg_store(&w.v[e], acc[c][e]);
                            dxv[row + col] = w;
                        }
                    }
                }
            }
            if (any && lane == 0) touched[k] = 1;
        }
        if (last) break;
        __syncthreads();
    }
}

#define GG_OWN(sfx, T, V, isfx, IDX)                                                                           \
    extern "C" __global__ void __launch_bounds__(GO_THREADS, 3) gg_own_##sfx##_v##V##_##isfx(                     \
        T* dx, const T* dy, const IDX* idx, long long* flag, int64_t outer, int64_t R, int64_t count,          \
        int64_t inner_v, int64_t RB, int64_t rotate) {                                                         \
        gg_own<T, V, IDX>(dx, dy, idx, flag, outer, R, count, inner_v, RB, rotate);                            \
    }
#define GG_OWN_I(sfx, T, V) GG_OWN(sfx, T, V, i32, int32_t) GG_OWN(sfx, T, V, i64, int64_t)
#if GG_PART(5)
GG_OWN_I(f16, __half, 1)
GG_OWN_I(f16, __half, 8)
GG_OWN_I(bf16, __nv_bfloat16, 1)
GG_OWN_I(bf16, __nv_bfloat16, 8)
GG_OWN_I(f32, float, 1)
#endif
#if GG_PART(6)
GG_OWN_I(f32, float, 4)
GG_OWN_I(f64, double, 1)
GG_OWN_I(f64, double, 2)
#endif

// ------------------------------------------------------------------ line scatter

constexpr int LS_THREADS = 256, LS_ITEMS = 4, LS_TILE = LS_THREADS * LS_ITEMS;

// lines.shape = dX's shape without the axis, lines.strides = dX's strides without it;
// ilines.shape/.strides: the same for indices (and dY, which has the indices' shape and layout).
// mode: 0 add, 1 none (last wins), 2 mul, 3 max, 4 min. shared_line: the line fits in shared memory.
// vec: the line is contiguous (sx == 1) and 16-byte aligned with s a multiple of 16 / sizeof(T), so
// the shared line is filled and written back with 16-byte words. The sort carries the values
// themselves (stable: a target's values stay in position order). dx and init are not __restrict__:
// the memory plan may write ScatterElements' output over its dying data input (dx == init); each
// line is read from init before any of its elements is written to dx.
template <typename T, typename IDX>
__device__ void line_scatter(T* dx, const T* __restrict__ dy, const IDX* __restrict__ idx,
                             const T* init, long long* flag, TensorDesc lines, TensorDesc ilines,
                             int64_t s, int64_t sx, int64_t n, int64_t si, int64_t nlines, int64_t end_bit,
                             int64_t mode, int64_t shared_line, int64_t vec, int64_t pad_key) {
    using A = typename Acc<T>::type;
    constexpr int V = 16 / sizeof(T);
    using VT = Vec<T, V>;
    using Sort = cub::BlockRadixSort<uint32_t, LS_THREADS, LS_ITEMS, A>;
    __shared__ union {
        typename Sort::TempStorage sort;
        struct {
            uint32_t keys[LS_TILE];
            A vals[LS_TILE];
        } runs;
    } tmp;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    A* sline = reinterpret_cast<A*>(smem_raw);
    const int rank = (int)lines.rank;
    for (int64_t L = blockIdx.x; L < nlines; L += gridDim.x) {
        int64_t rest = L, xoff = 0, ioff = 0;
        bool covered = true;
        for (int d = rank - 1; d >= 0; --d) {
            const int64_t c = rest % lines.shape[d];
            rest /= lines.shape[d];
            xoff += c * lines.strides[d];
            ioff += c * ilines.strides[d];
            covered = covered && c < ilines.shape[d];
        }
        if (shared_line && vec) {
            for (int64_t j = threadIdx.x; j < s / V; j += blockDim.x) {
                if (init) {
                    const VT w = reinterpret_cast<const VT*>(init + xoff)[j];
#pragma unroll
                    for (int e = 0; e < V; ++e) sline[j * V + e] = gg_load(&w.v[e]);
                } else {
#pragma unroll
                    for (int e = 0; e < V; ++e) sline[j * V + e] = A(0);
                }
            }
        } else {
            for (int64_t j = threadIdx.x; j < s; j += blockDim.x) {
                const A v = init ? gg_load(init + xoff + j * sx) : A(0);
                if (shared_line) sline[j] = v;
                else gg_store(dx + xoff + j * sx, v);
            }
        }
        __syncthreads();
        for (int64_t t0 = 0; covered && t0 < n; t0 += LS_TILE) {
            uint32_t key[LS_ITEMS];
            A val[LS_ITEMS];
#pragma unroll
            for (int i = 0; i < LS_ITEMS; ++i) {
                const int64_t p = t0 + threadIdx.x * LS_ITEMS + i;
                key[i] = pad_key >= 0 ? (uint32_t)pad_key : (uint32_t)s;
                val[i] = A(0);
                if (p < n) {
                    int64_t x;
                    if (gg_norm(idx[ioff + p * si], s, x)) {
                        key[i] = (uint32_t)x;
                        val[i] = gg_load(dy + ioff + p * si);
                    } else {
                        gg_set_flag(flag, ioff + p * si);
                    }
                }
            }
            Sort(tmp.sort).Sort(key, val, 0, (int)end_bit);
            __syncthreads();
#pragma unroll
            for (int i = 0; i < LS_ITEMS; ++i) {
                tmp.runs.keys[threadIdx.x * LS_ITEMS + i] = key[i];
                tmp.runs.vals[threadIdx.x * LS_ITEMS + i] = val[i];
            }
            __syncthreads();
#pragma unroll
            for (int i = 0; i < LS_ITEMS; ++i) {
                const int g = threadIdx.x * LS_ITEMS + i;
                const uint32_t k = key[i];
                if (k == (uint32_t)s || (g > 0 && tmp.runs.keys[g - 1] == k)) continue;
                A acc = shared_line ? sline[k] : gg_load(dx + xoff + (int64_t)k * sx);
                for (int j = g; j < LS_TILE && tmp.runs.keys[j] == k; ++j) {
                    const A v = tmp.runs.vals[j];
                    switch (mode) {
                        case 0: acc += v; break;
                        case 1: acc = v; break;
                        case 2: acc *= v; break;
                        case 3: acc = v > acc ? v : acc; break;
                        default: acc = v < acc ? v : acc; break;
                    }
                }
                if (shared_line) sline[k] = acc;
                else gg_store(dx + xoff + (int64_t)k * sx, acc);
            }
            __syncthreads();
        }
        if (shared_line) {
            if (vec) {
                for (int64_t j = threadIdx.x; j < s / V; j += blockDim.x) {
                    VT w;
#pragma unroll
                    for (int e = 0; e < V; ++e) gg_store(&w.v[e], sline[j * V + e]);
                    reinterpret_cast<VT*>(dx + xoff)[j] = w;
                }
            } else {
                for (int64_t j = threadIdx.x; j < s; j += blockDim.x) gg_store(dx + xoff + j * sx, sline[j]);
            }
            __syncthreads();
        }
    }
}

// Atomic GatherElementsGrad: dx (zeroed) += dy at the target of every index. d: indices' shape with
// dX's strides.
template <typename T, typename IDX, typename I>
__device__ void ge_atomic(T* dx, const T* __restrict__ dy, const IDX* __restrict__ idx, long long* flag, TensorDesc d,
                          int64_t axis, int64_t s, int64_t n) {
    for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < (I)n; i += (I)blockDim.x * gridDim.x) {
        I rest = i, off = 0;
        bool ok = true;
        for (int k = (int)d.rank - 1; k >= 0; --k) {
            const I size = (I)d.shape[k];
            const I next = rest / size;
            I c = rest - next * size;
            rest = next;
            if (k == axis) {
                int64_t x;
                ok = gg_norm(idx[i], s, x);
                if (!ok) gg_set_flag(flag, i);
                c = (I)x;
            }
            off += c * (I)d.strides[k];
        }
        if (ok) atomicAdd(dx + off, dy[i]);
    }
}

#define GG_LINE(sfx, T, isfx, IDX)                                                                              \
    extern "C" __global__ void __launch_bounds__(LS_THREADS) line_scatter_##sfx##_##isfx(                        \
        T* dx, const T* dy, const IDX* idx, const T* init, long long* flag, TensorDesc lines, TensorDesc ilines, \
        int64_t s, int64_t sx, int64_t n, int64_t si, int64_t nlines, int64_t end_bit, int64_t mode,           \
        int64_t shared_line, int64_t vec, int64_t pad_key) {                                                     \
        line_scatter<T, IDX>(dx, dy, idx, init, flag, lines, ilines, s, sx, n, si, nlines, end_bit, mode,       \
                             shared_line, vec, pad_key);                                                         \
    }                                                                                                            \
    extern "C" __global__ void ge_atomic_##sfx##_##isfx(T* dx, const T* dy, const IDX* idx, long long* flag,    \
                                                        TensorDesc d, int64_t axis, int64_t s, int64_t n) {     \
        ge_atomic<T, IDX, int64_t>(dx, dy, idx, flag, d, axis, s, n);                                           \
    }                                                                                                            \
    extern "C" __global__ void ge_atomic32_##sfx##_##isfx(T* dx, const T* dy, const IDX* idx, long long* flag,  \
                                                          TensorDesc d, int64_t axis, int64_t s, int64_t n) {   \
        ge_atomic<T, IDX, int32_t>(dx, dy, idx, flag, d, axis, s, n);                                           \
    }

#define GG_LINE_T(sfx, T) GG_LINE(sfx, T, i32, int32_t) GG_LINE(sfx, T, i64, int64_t)
#if GG_PART(7)
GG_LINE_T(f16, __half)
GG_LINE_T(bf16, __nv_bfloat16)
GG_LINE_T(f32, float)
GG_LINE_T(f64, double)
#endif

// ------------------------------------------------------------------ gathers

// out (outer, count, inner) = data (outer, size, inner) at idx along the middle axis.
template <typename E, typename IDX>
__device__ void gather(E* __restrict__ out, const E* __restrict__ data, const IDX* __restrict__ idx, long long* flag,
                       int64_t count, int64_t size, int64_t inner, int64_t n) {
    GG_GRID_STRIDE(i, n) {
        const int64_t c = i % inner, rest = i / inner;
        const int64_t j = rest % count, o = rest / count;
        int64_t x;
        if (gg_norm(idx[j], size, x)) out[i] = data[(o * size + x) * inner + c];
        else gg_set_flag(flag, j);
    }
}

// out has the indices' shape d.shape; d.strides are data's strides.
template <typename E, typename IDX>
__device__ void gather_elements(E* __restrict__ out, const E* __restrict__ data, const IDX* __restrict__ idx,
                                long long* flag, TensorDesc d, int64_t axis, int64_t size, int64_t n) {
    GG_GRID_STRIDE(i, n) {
        int64_t rest = i, off = 0;
        bool ok = true;
        for (int k = (int)d.rank - 1; k >= 0; --k) {
            int64_t c = rest % d.shape[k];
            rest /= d.shape[k];
            if (k == axis) ok = gg_norm(idx[i], size, c);
            off += c * d.strides[k];
        }
        if (ok) out[i] = data[off];
        else gg_set_flag(flag, i);
    }
}

// out (B, M, inner) = data[b, idx[b, m, 0..k-1], :]; kd.shape = sizes of the indexed axes,
// kd.strides = their strides in data (in words); batch_stride = data words per batch.
template <typename E, typename IDX>
__device__ void gather_nd(E* __restrict__ out, const E* __restrict__ data, const IDX* __restrict__ idx,
                          long long* flag, TensorDesc kd, int64_t M, int64_t inner, int64_t batch_stride, int64_t n) {
    const int k = (int)kd.rank;
    GG_GRID_STRIDE(i, n) {
        const int64_t c = i % inner, bm = i / inner, b = bm / M;
        int64_t off = b * batch_stride + c;
        bool ok = true;
        for (int t = 0; t < k; ++t) {
            int64_t x;
            ok = gg_norm(idx[bm * k + t], kd.shape[t], x) && ok;
            off += x * kd.strides[t];
        }
        if (ok) out[i] = data[off];
        else gg_set_flag(flag, bm * k);
    }
}

#define GG_INDEXING(W, isfx, IDX)                                                                              \
    extern "C" __global__ void gather_w##W##_##isfx(Word<W>::type* out, const Word<W>::type* data,             \
                                                    const IDX* idx, long long* flag, int64_t count,            \
                                                    int64_t size, int64_t inner, int64_t n) {                  \
        gather(out, data, idx, flag, count, size, inner, n);                                                   \
    }                                                                                                          \
    extern "C" __global__ void gather_elements_w##W##_##isfx(Word<W>::type* out, const Word<W>::type* data,    \
                                                             const IDX* idx, long long* flag, TensorDesc d,    \
                                                             int64_t axis, int64_t size, int64_t n) {          \
        gather_elements(out, data, idx, flag, d, axis, size, n);                                               \
    }                                                                                                          \
    extern "C" __global__ void gather_nd_w##W##_##isfx(Word<W>::type* out, const Word<W>::type* data,          \
                                                       const IDX* idx, long long* flag, TensorDesc kd,         \
                                                       int64_t M, int64_t inner, int64_t batch_stride, int64_t n) { \
        gather_nd(out, data, idx, flag, kd, M, inner, batch_stride, n);                                        \
    }

#define GG_INDEXING_W(W) GG_INDEXING(W, i32, int32_t) GG_INDEXING(W, i64, int64_t)
#if GG_PART(8)
GG_INDEXING_W(1)
GG_INDEXING_W(2)
GG_INDEXING_W(4)
#endif
#if GG_PART(9)
GG_INDEXING_W(8)
GG_INDEXING_W(16)
#endif

// ------------------------------------------------------------------ OneHot
// out viewed as (outer, depth, inner), indices as (outer, inner): out[o, j, k] = vals[1] where the
// index (negative ones plus depth) equals j, else vals[0]. Indices outside [-depth, depth) give an
// all-off line, as the spec says (not an error). Moves bits: W-byte values.
template <typename E, typename IDX>
__device__ __forceinline__ void one_hot(E* __restrict__ dst, const IDX* __restrict__ idx, const E* __restrict__ vals,
                                        int64_t depth, int64_t inner, int64_t n) {
    const E off = vals[0], on = vals[1];
    GG_GRID_STRIDE(i, n) {
        const int64_t k = i % inner, r = i / inner;
        const int64_t j = r % depth, o = r / depth;
        int64_t v = (int64_t)idx[o * inner + k];
        if (v < 0) v += depth;
        dst[i] = v == j ? on : off;
    }
}

#define GG_ONE_HOT(W, S, IDX)                                                                                 \
    extern "C" __global__ void one_hot_w##W##_##S(Word<W>::type* dst, const IDX* idx, const Word<W>::type* vals, \
                                                  int64_t depth, int64_t inner, int64_t n) {                  \
        one_hot<Word<W>::type, IDX>(dst, idx, vals, depth, inner, n);                                         \
    }
#define GG_ONE_HOT_W(W) GG_ONE_HOT(W, i32, int32_t) GG_ONE_HOT(W, i64, int64_t)
#if GG_PART(10)
GG_ONE_HOT_W(1)
GG_ONE_HOT_W(2)
GG_ONE_HOT_W(4)
GG_ONE_HOT_W(8)
#endif

// ------------------------------------------------------------------ TensorScatter (opset 24)
// out (batch, mid, room, inner), already a copy of the cache, gets update (batch, mid, length,
// inner) at rows starts[b] + t of batch row b (modulo room when circular; starts null: 0). A
// negative start, or in linear mode a row past the axis, writes nothing and sets *flag (the
// launcher then raises the CPU kernel's error). Moves bits: W-byte words of the inner runs.
template <typename E, typename IDX>
__device__ void tensor_scatter(E* __restrict__ out, const E* __restrict__ update, const IDX* __restrict__ starts,
                               long long* flag, int64_t mid, int64_t length, int64_t room, int64_t inner,
                               int64_t circular, int64_t n) {
    GG_GRID_STRIDE(i, n) {
        const int64_t c = i % inner, rest = i / inner;
        const int64_t t = rest % length, line = rest / length;  // line = b * mid + m
        const int64_t b = line / mid;
        const int64_t start = starts ? (int64_t)starts[b] : 0;
        int64_t row = start + t;
        if (circular) row %= room;
        if (start < 0 || row >= room) gg_set_flag(flag, b);
        else out[(line * room + row) * inner + c] = update[i];
    }
}

#define GG_TENSOR_SCATTER(W, S, IDX)                                                                           \
    extern "C" __global__ void tensor_scatter_w##W##_##S(Word<W>::type* out, const Word<W>::type* update,     \
                                                         const IDX* starts, long long* flag, int64_t mid,     \
                                                         int64_t length, int64_t room, int64_t inner,         \
                                                         int64_t circular, int64_t n) {                       \
        tensor_scatter<Word<W>::type, IDX>(out, update, starts, flag, mid, length, room, inner, circular, n); \
    }
#define GG_TENSOR_SCATTER_W(W) GG_TENSOR_SCATTER(W, i32, int32_t) GG_TENSOR_SCATTER(W, i64, int64_t)
#if GG_PART(11)
GG_TENSOR_SCATTER_W(1)
GG_TENSOR_SCATTER_W(2)
GG_TENSOR_SCATTER_W(4)
GG_TENSOR_SCATTER_W(8)
GG_TENSOR_SCATTER_W(16)
#endif

// ------------------------------------------------------------------ NonZero
// slots: the inclusive running count of X's non-zero elements in C order (the launcher composes it
// from the cast and CumSum launchers), so flat element i is non-zero where slots[i] differs from the
// count before it, and its coordinates (over shape) go to column slots[i] - 1 of out (rank, count).
#if GG_PART(12)
extern "C" __global__ void nonzero_coords(int64_t* __restrict__ out, const int64_t* __restrict__ slots, TensorDesc shape,
                                          int64_t count, int64_t n) {
    GG_GRID_STRIDE(i, n) {
        const int64_t before = i ? slots[i - 1] : 0;
        if (slots[i] == before) continue;
        int64_t rest = i;
        for (int d = (int)shape.rank - 1; d >= 0; --d) {
            const int64_t size = shape.shape[d];
            out[d * count + before] = rest % size;
            rest /= size;
        }
    }
}
#endif

// ------------------------------------------------------------------ Unique (flattened)
// After reduction.cu's sort of X's (key, position) pairs (keys in numpy's order, equal keys by
// position): a run of equal keys is one unique value, its first pair the value's first occurrence.
//   unique_starts   starts[i]: sorted pair i begins a run;
//   unique_runs     slots: the inclusive running count of the starts (the launcher's CumSum), so
//                   pair i is in run slots[i] - 1: inverse[position] = run; a run's first position
//                   and its place in the sorted pairs (begin) are written by its first pair;
//   unique_outputs  output j is run order[j] (order null: run j): X's element at the run's first
//                   position (its bits), that position, the run's length (the next run's begin, or n,
//                   minus its own) and, where rank is given, rank[run] = j;
//   unique_remap    inverse[p] = rank[inverse[p]] (sorted=0: runs renumbered by first occurrence).
#if GG_PART(13)
extern "C" __global__ void unique_starts(bool* __restrict__ starts, const unsigned long long* __restrict__ key, int64_t n) {
    GG_GRID_STRIDE(i, n) starts[i] = i == 0 || key[i] != key[i - 1];
}

extern "C" __global__ void unique_runs(int64_t* __restrict__ inverse, int64_t* __restrict__ first, int64_t* __restrict__ begin,
                                       const int64_t* __restrict__ pos, const int64_t* __restrict__ slots, int64_t n) {
    GG_GRID_STRIDE(i, n) {
        const int64_t run = slots[i] - 1, p = pos[i];
        inverse[p] = run;
        if (i == 0 || slots[i - 1] != slots[i]) {
            first[run] = p;
            begin[run] = i;
        }
    }
}

extern "C" __global__ void unique_remap(int64_t* __restrict__ inverse, const int64_t* __restrict__ rank, int64_t n) {
    GG_GRID_STRIDE(p, n) inverse[p] = rank[inverse[p]];
}
#endif

template <typename E>
__device__ void unique_outputs(E* __restrict__ values, int64_t* __restrict__ first_out, int64_t* __restrict__ counts,
                               int64_t* __restrict__ rank, const E* __restrict__ x, const int64_t* __restrict__ first,
                               const int64_t* __restrict__ begin, const int64_t* __restrict__ order, int64_t runs, int64_t n) {
    GG_GRID_STRIDE(j, runs) {
        const int64_t run = order ? order[j] : j;
        const int64_t f = first[run];
        values[j] = x[f];
        first_out[j] = f;
        counts[j] = (run + 1 < runs ? begin[run + 1] : n) - begin[run];
        if (rank) rank[run] = j;
    }
}

#define GG_UNIQUE_OUTPUTS(W)                                                                                       \
    extern "C" __global__ void unique_outputs_w##W(Word<W>::type* values, int64_t* first_out, int64_t* counts,    \
                                                   int64_t* rank, const Word<W>::type* x, const int64_t* first,   \
                                                   const int64_t* begin, const int64_t* order, int64_t runs,      \
                                                   int64_t n) {                                                   \
        unique_outputs<Word<W>::type>(values, first_out, counts, rank, x, first, begin, order, runs, n);           \
    }
#if GG_PART(14)
GG_UNIQUE_OUTPUTS(2)
GG_UNIQUE_OUTPUTS(4)
GG_UNIQUE_OUTPUTS(8)
#endif

// ------------------------------------------------------------------ NonMaxSuppression
// ONNX's reference selection (the CPU kernel's), its arithmetic and comparisons in A (float; double
// for double boxes): every operation rounded on its own (the _rn intrinsics: no fused multiply-add),
// Python's max / min (the first operand unless the second is larger / smaller), and every test
// written as the reference writes it, so that NaN passes none of them.
//   nms_corners  per box: (y_min, x_min, y_max, x_max, area); [y1, x1, y2, x2] boxes order the two
//                ends of each axis (the reference's max_min), [x_center, y_center, width, height]
//                ones are the centre -+ half the size; area = (x_max - x_min) * (y_max - y_min);
//   nms_select   one block per (batch, class) pair: a bitonic sort of the pair's (score key, box)
//                pairs in its scratch (descending score, equal scores by box, NaN last, -0 tied with
//                +0), the candidates (scores above the threshold: a prefix of that order), then the
//                greedy loop: the next candidate not yet suppressed is kept, and the block's threads
//                mark the later candidates whose IoU with it is above the threshold; writes the
//                pair's kept boxes (best first) and their count;
//   nms_pack     the output rows (batch, class, box) of every pair's kept boxes, pair after pair
//                (ends: the inclusive running count of the pairs' counts).
__device__ __forceinline__ float nms_add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double nms_add(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float nms_sub(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ double nms_sub(double a, double b) { return __dsub_rn(a, b); }
__device__ __forceinline__ float nms_mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double nms_mul(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float nms_div(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ double nms_div(double a, double b) { return __ddiv_rn(a, b); }

constexpr int NMS_BOX = 5;  // y_min, x_min, y_max, x_max, area

template <typename T>
__device__ void nms_corners(typename Acc<T>::type* __restrict__ corners, const T* __restrict__ boxes, int64_t center,
                            int64_t n) {
    using A = typename Acc<T>::type;
    GG_GRID_STRIDE(i, n) {
        const T* box = boxes + 4 * i;
        const A v0 = gg_load(box), v1 = gg_load(box + 1), v2 = gg_load(box + 2), v3 = gg_load(box + 3);
        A y_lo, x_lo, y_hi, x_hi;
        if (center) {  // width / 2 and width * 0.5 round alike
            const A half_w = nms_mul(v2, A(0.5)), half_h = nms_mul(v3, A(0.5));
            x_lo = nms_sub(v0, half_w);
            x_hi = nms_add(v0, half_w);
            y_lo = nms_sub(v1, half_h);
            y_hi = nms_add(v1, half_h);
        } else {  // max_min(lhs, rhs): (rhs, lhs) where lhs >= rhs, else (lhs, rhs)
            y_lo = v0 >= v2 ? v2 : v0;
            y_hi = v0 >= v2 ? v0 : v2;
            x_lo = v1 >= v3 ? v3 : v1;
            x_hi = v1 >= v3 ? v1 : v3;
        }
        A* out = corners + NMS_BOX * i;
        out[0] = y_lo;
        out[1] = x_lo;
        out[2] = y_hi;
        out[3] = x_hi;
        out[4] = nms_mul(nms_sub(x_hi, x_lo), nms_sub(y_hi, y_lo));
    }
}

// The reference's suppress_by_iou(candidate, kept box).
template <typename A>
__device__ __forceinline__ bool nms_overlapping(const A* cand, const A* top, double iou_threshold) {
    const A y_lo = top[0] > cand[0] ? top[0] : cand[0];
    const A x_lo = top[1] > cand[1] ? top[1] : cand[1];
    const A y_hi = top[2] < cand[2] ? top[2] : cand[2];
    const A x_hi = top[3] < cand[3] ? top[3] : cand[3];
    if (x_hi <= x_lo || y_hi <= y_lo) return false;
    const A inter = nms_mul(nms_sub(x_hi, x_lo), nms_sub(y_hi, y_lo));
    if (inter <= A(0)) return false;
    const A area1 = cand[4], area2 = top[4];
    const A uni = nms_sub(nms_add(area1, area2), inter);
    if (area1 <= A(0) || area2 <= A(0) || uni <= A(0)) return false;
    return (double)nms_div(inter, uni) > iou_threshold;  // a float threshold is exact in double
}

// Descending score order as an ascending uint64 key: NaN last (~0, after every number), -0 as +0.
__device__ __forceinline__ unsigned long long nms_score_key(double v) {
    if (v != v) return ~0ULL;
    if (v == 0.0) v = 0.0;
    const unsigned long long b = (unsigned long long)__double_as_longlong(v);
    return (b >> 63) ? b : ~(b | 0x8000000000000000ULL);
}

// keys / order: P (a power of two >= n) entries per pair; gone: n flags per pair; kept: capacity
// boxes per pair (capacity = min(n, limit) >= 1); corners: nms_corners' (batches, n, 5).
template <typename T>
__device__ void nms_select(int64_t* __restrict__ kept, int64_t* __restrict__ counts, unsigned long long* __restrict__ keys,
                           int64_t* __restrict__ order, unsigned char* gone_all,
                           const typename Acc<T>::type* __restrict__ corners, const T* __restrict__ scores, int64_t pairs,
                           int64_t classes, int64_t n, int64_t P, int64_t capacity, int64_t filter,
                           double score_threshold, double iou_threshold) {
    using A = typename Acc<T>::type;
    __shared__ unsigned int candidates_s;
    for (int64_t pair = blockIdx.x; pair < pairs; pair += gridDim.x) {
        const T* score = scores + pair * n;
        unsigned long long* key = keys + pair * P;
        int64_t* box = order + pair * P;
        unsigned char* gone = gone_all + pair * n;
        const A* corner = corners + (pair / classes) * n * NMS_BOX;
        if (threadIdx.x == 0) candidates_s = 0u;
        __syncthreads();
        unsigned int mine = 0u;
        for (int64_t j = threadIdx.x; j < P; j += blockDim.x) {
            key[j] = ~0ULL;
            box[j] = j;
            if (j < n) {
                const double v = (double)gg_load(score + j);
                key[j] = nms_score_key(v);
                gone[j] = 0;
                mine += !filter || v > score_threshold;
            }
        }
        atomicAdd(&candidates_s, mine);
        __syncthreads();
        for (int64_t size = 2; size <= P; size <<= 1) {
            for (int64_t stride = size >> 1; stride > 0; stride >>= 1) {
                for (int64_t t = threadIdx.x; t < (P >> 1); t += blockDim.x) {
                    const int64_t lo = ((t & ~(stride - 1)) << 1) | (t & (stride - 1)), hi = lo + stride;
                    const unsigned long long a = key[lo], b = key[hi];
                    const int64_t ba = box[lo], bb = box[hi];
                    const bool greater = a > b || (a == b && ba > bb);
                    if (greater == ((lo & size) == 0)) {
                        key[lo] = b;
                        key[hi] = a;
                        box[lo] = bb;
                        box[hi] = ba;
                    }
                }
                __syncthreads();
            }
        }
        const int64_t candidates = candidates_s;
        int64_t count = 0;  // the same in every thread: the loop below runs in lockstep
        for (int64_t r = 0; r < candidates && count < capacity; ++r) {
            if (gone[r]) continue;
            const int64_t top = box[r];
            if (threadIdx.x == 0) kept[pair * capacity + count] = top;
            ++count;
            for (int64_t q = r + 1 + threadIdx.x; q < candidates; q += blockDim.x) {
                if (!gone[q] && nms_overlapping(corner + NMS_BOX * box[q], corner + NMS_BOX * top, iou_threshold)) gone[q] = 1;
            }
            __syncthreads();
        }
        if (threadIdx.x == 0) counts[pair] = count;
        __syncthreads();
    }
}

#define GG_NMS(sfx, T)                                                                                           \
    extern "C" __global__ void nms_corners_##sfx(Acc<T>::type* corners, const T* boxes, int64_t center,          \
                                                 int64_t n) {                                                    \
        nms_corners<T>(corners, boxes, center, n);                                                               \
    }                                                                                                            \
    extern "C" __global__ void nms_select_##sfx(int64_t* kept, int64_t* counts, unsigned long long* keys,        \
                                                int64_t* order, unsigned char* gone, const Acc<T>::type* corners, \
                                                const T* scores, int64_t pairs, int64_t classes, int64_t n,      \
                                                int64_t P, int64_t capacity, int64_t filter,                     \
                                                double score_threshold, double iou_threshold) {                  \
        nms_select<T>(kept, counts, keys, order, gone, corners, scores, pairs, classes, n, P, capacity, filter,  \
                      score_threshold, iou_threshold);                                                           \
    }
#if GG_PART(15)
GG_NMS(f16, __half)
GG_NMS(bf16, __nv_bfloat16)
GG_NMS(f32, float)
GG_NMS(f64, double)

extern "C" __global__ void nms_pack(int64_t* __restrict__ out, const int64_t* __restrict__ kept,
                                    const int64_t* __restrict__ counts, const int64_t* __restrict__ ends, int64_t classes,
                                    int64_t capacity, int64_t n) {
    GG_GRID_STRIDE(i, n) {
        const int64_t pair = i / capacity, k = i - pair * capacity, count = counts[pair];
        if (k >= count) continue;
        int64_t* row = out + 3 * (ends[pair] - count + k);
        row[0] = pair / classes;
        row[1] = pair % classes;
        row[2] = kept[i];
    }
}
#endif
