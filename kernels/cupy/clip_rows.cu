// Per-example clipping in book-keeping form, for kernels/cupy/clip_rows.py
// (the Numba twin is kernels/numba_cuda/clip_rows.py; the contract is clip_rows
// in kernels/__init__.py). For Linear layers with inputs a_l (k x d_in+1, ones
// column included) and output gradients g_l (k x d_out), example i's squared
// gradient norm is sum_l |a_l,i|^2 |g_l,i|^2 (Goodfellow 2015; Li et al. 2021).
//
//   clip_fused_rows_*     one block per row, up to MPIDP_FUSED_LAYERS layers in one
//                         launch: sq[i] = sum_l |a_l,i|^2 |g_l,i|^2, factors[i], and
//                         g_l[i, :] *= factors[i] for every layer
//   clip_row_sq_norms_*   one block per row: sq[i] (+)= |a_i|^2 |g_i|^2, once per layer
//   clip_factors_*        one block: factors[i] = min(1, C / sqrt(sq[i])), count of clipped
//   clip_scale_rows_*     g[i, :] *= factors[i], once per layer
//
// Up to MPIDP_FUSED_LAYERS layers a call is clip_fused_rows then clip_factors (which
// recomputes the same factors from sq and counts the clipped rows): two launches
// instead of 2L + 1. The fused kernel adds the layers' products in the same order
// and precision as clip_row_sq_norms does (the compiler may contract a product and
// its sum differently in the two, so they agree to rounding).
//
// Block reductions use shared memory only (no warp shuffles), like the Numba
// kernels, which the CUDA simulator runs in tests. Rows are row-major with a
// leading dimension (elements); columns are contiguous. Self-contained: CuPy
// compiles it with NVRTC, which has no system headers.

#define MPIDP_MAX_THREADS 256
#define MPIDP_FUSED_LAYERS 4

__device__ __forceinline__ float sqrt_of(float x) { return sqrtf(x); }
__device__ __forceinline__ double sqrt_of(double x) { return sqrt(x); }

// |a_i|^2 |g_i|^2 of row i by the whole block (blockDim.x a power of two <=
// MPIDP_MAX_THREADS), valid in thread 0; every thread must call it.
template <typename T>
__device__ T row_sq_product(const T* a, long long lda, long long da, const T* g,
                            long long ldg, long long dg, long long i) {
    __shared__ T sa_s[MPIDP_MAX_THREADS];
    __shared__ T sg_s[MPIDP_MAX_THREADS];
    const int t = threadIdx.x;
    T sa = T(0), sg = T(0);
    for (long long j = t; j < da; j += blockDim.x) {
        const T v = a[i * lda + j];
        sa += v * v;
    }
    for (long long j = t; j < dg; j += blockDim.x) {
        const T v = g[i * ldg + j];
        sg += v * v;
    }
    __syncthreads();  // a previous call's thread 0 has read sa_s[0], sg_s[0]
    sa_s[t] = sa;
    sg_s[t] = sg;
    __syncthreads();
    for (int step = blockDim.x / 2; step > 0; step /= 2) {
        if (t < step) {
            sa_s[t] += sa_s[t + step];
            sg_s[t] += sg_s[t + step];
        }
        __syncthreads();
    }
    return sa_s[0] * sg_s[0];
}

// gridDim.x = rows.
template <typename T>
__device__ void row_sq_norms(const T* a, long long lda, long long da, const T* g,
                             long long ldg, long long dg, T* sq, int accumulate) {
    const long long i = blockIdx.x;
    const T p = row_sq_product<T>(a, lda, da, g, ldg, dg, i);
    if (threadIdx.x == 0) sq[i] = accumulate ? sq[i] + p : p;
}

// gridDim.x = rows; layers <= MPIDP_FUSED_LAYERS, the unused slots ignored.
template <typename T>
__device__ void fused_rows(const T* const a[MPIDP_FUSED_LAYERS],
                           const long long lda[MPIDP_FUSED_LAYERS],
                           const long long da[MPIDP_FUSED_LAYERS],
                           T* const g[MPIDP_FUSED_LAYERS],
                           const long long ldg[MPIDP_FUSED_LAYERS],
                           const long long dg[MPIDP_FUSED_LAYERS], int layers, T max_norm,
                           T* sq, T* factors) {
    __shared__ T factor_s;
    const long long i = blockIdx.x;
    T s = T(0);
    for (int l = 0; l < layers; ++l) {
        const T p = row_sq_product<T>(a[l], lda[l], da[l], g[l], ldg[l], dg[l], i);
        s = l == 0 ? p : s + p;
    }
    if (threadIdx.x == 0) {
        const T norm = sqrt_of(s);
        const T f = norm > max_norm ? max_norm / norm : T(1);
        sq[i] = s;
        factors[i] = f;
        factor_s = f;
    }
    __syncthreads();
    const T f = factor_s;
    if (f == T(1)) return;
    for (int l = 0; l < layers; ++l) {
        T* row = g[l] + i * ldg[l];
        for (long long j = threadIdx.x; j < dg[l]; j += blockDim.x) row[j] *= f;
    }
}

// One block (blockDim.x a power of two <= MPIDP_MAX_THREADS) strides over the rows;
// the count of clipped rows is reduced in shared memory, so no atomics and
// no zeroing of *count beforehand.
template <typename T>
__device__ void clip_factors(const T* sq, long long k, T max_norm, T* factors, int* count) {
    __shared__ int counts[MPIDP_MAX_THREADS];
    const int t = threadIdx.x;
    int clipped = 0;
    for (long long i = t; i < k; i += blockDim.x) {
        const T norm = sqrt_of(sq[i]);
        if (norm > max_norm) {
            factors[i] = max_norm / norm;
            clipped += 1;
        } else {
            factors[i] = T(1);
        }
    }
    counts[t] = clipped;
    __syncthreads();
    for (int step = blockDim.x / 2; step > 0; step /= 2) {
        if (t < step) counts[t] += counts[t + step];
        __syncthreads();
    }
    if (t == 0) *count = counts[0];
}

// 2-D grid: x over columns, y over rows (grid-stride in y).
template <typename T>
__device__ void scale_rows(T* g, long long ldg, long long k, long long d, const T* factors) {
    const long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= d) return;
    for (long long i = (long long)blockIdx.y * blockDim.y + threadIdx.y; i < k;
         i += (long long)gridDim.y * blockDim.y) {
        g[i * ldg + j] *= factors[i];
    }
}

extern "C" {

__global__ void clip_fused_rows_f32(const float* a0, long long lda0, long long da0, float* g0,
                                    long long ldg0, long long dg0, const float* a1, long long lda1,
                                    long long da1, float* g1, long long ldg1, long long dg1,
                                    const float* a2, long long lda2, long long da2, float* g2,
                                    long long ldg2, long long dg2, const float* a3, long long lda3,
                                    long long da3, float* g3, long long ldg3, long long dg3,
                                    int layers, float max_norm, float* sq, float* factors) {
    const float* const a[MPIDP_FUSED_LAYERS] = {a0, a1, a2, a3};
    const long long lda[MPIDP_FUSED_LAYERS] = {lda0, lda1, lda2, lda3};
    const long long da[MPIDP_FUSED_LAYERS] = {da0, da1, da2, da3};
    float* const g[MPIDP_FUSED_LAYERS] = {g0, g1, g2, g3};
    const long long ldg[MPIDP_FUSED_LAYERS] = {ldg0, ldg1, ldg2, ldg3};
    const long long dg[MPIDP_FUSED_LAYERS] = {dg0, dg1, dg2, dg3};
    fused_rows<float>(a, lda, da, g, ldg, dg, layers, max_norm, sq, factors);
}
__global__ void clip_fused_rows_f64(const double* a0, long long lda0, long long da0, double* g0,
                                    long long ldg0, long long dg0, const double* a1, long long lda1,
                                    long long da1, double* g1, long long ldg1, long long dg1,
                                    const double* a2, long long lda2, long long da2, double* g2,
                                    long long ldg2, long long dg2, const double* a3, long long lda3,
                                    long long da3, double* g3, long long ldg3, long long dg3,
                                    int layers, double max_norm, double* sq, double* factors) {
    const double* const a[MPIDP_FUSED_LAYERS] = {a0, a1, a2, a3};
    const long long lda[MPIDP_FUSED_LAYERS] = {lda0, lda1, lda2, lda3};
    const long long da[MPIDP_FUSED_LAYERS] = {da0, da1, da2, da3};
    double* const g[MPIDP_FUSED_LAYERS] = {g0, g1, g2, g3};
    const long long ldg[MPIDP_FUSED_LAYERS] = {ldg0, ldg1, ldg2, ldg3};
    const long long dg[MPIDP_FUSED_LAYERS] = {dg0, dg1, dg2, dg3};
    fused_rows<double>(a, lda, da, g, ldg, dg, layers, max_norm, sq, factors);
}

__global__ void clip_row_sq_norms_f32(const float* a, long long lda, long long da,
                                      const float* g, long long ldg, long long dg, float* sq,
                                      int accumulate) {
    row_sq_norms<float>(a, lda, da, g, ldg, dg, sq, accumulate);
}
__global__ void clip_row_sq_norms_f64(const double* a, long long lda, long long da,
                                      const double* g, long long ldg, long long dg, double* sq,
                                      int accumulate) {
    row_sq_norms<double>(a, lda, da, g, ldg, dg, sq, accumulate);
}
__global__ void clip_factors_f32(const float* sq, long long k, float max_norm, float* factors,
                                 int* count) {
    clip_factors<float>(sq, k, max_norm, factors, count);
}
__global__ void clip_factors_f64(const double* sq, long long k, double max_norm,
                                 double* factors, int* count) {
    clip_factors<double>(sq, k, max_norm, factors, count);
}
__global__ void clip_scale_rows_f32(float* g, long long ldg, long long k, long long d,
                                    const float* factors) {
    scale_rows<float>(g, ldg, k, d, factors);
}
__global__ void clip_scale_rows_f64(double* g, long long ldg, long long k, long long d,
                                    const double* factors) {
    scale_rows<double>(g, ldg, k, d, factors);
}

}  // extern "C"
