// Per-example clipping in book-keeping form, for kernels/cupy/clip_rows.py
// (the Numba twin is kernels/numba_cuda/clip_rows.py; the contract is clip_rows
// in kernels/__init__.py). For Linear layers with inputs a_l (k x d_in+1, ones
// column included) and output gradients g_l (k x d_out), example i's squared
// gradient norm is sum_l |a_l,i|^2 |g_l,i|^2 (Goodfellow 2015; Li et al. 2021).
//
//   clip_row_sq_norms_*   one block per row: sq[i] (+)= |a_i|^2 |g_i|^2, once per layer
//   clip_factors_*        one block: factors[i] = min(1, C / sqrt(sq[i])), count of clipped
//   clip_scale_rows_*     g[i, :] *= factors[i], once per layer
//
// Block reductions use shared memory only (no warp shuffles), like the Numba
// kernels, which the CUDA simulator runs in tests. Rows are row-major with a
// leading dimension (elements); columns are contiguous. Self-contained: CuPy
// compiles it with NVRTC, which has no system headers.

#define MPIDP_MAX_THREADS 256

__device__ __forceinline__ float sqrt_of(float x) { return sqrtf(x); }
__device__ __forceinline__ double sqrt_of(double x) { return sqrt(x); }

// blockDim.x must be a power of two <= MPIDP_MAX_THREADS; gridDim.x = rows.
template <typename T>
__device__ void row_sq_norms(const T* a, long long lda, long long da, const T* g,
                             long long ldg, long long dg, T* sq, int accumulate) {
    __shared__ T sa_s[MPIDP_MAX_THREADS];
    __shared__ T sg_s[MPIDP_MAX_THREADS];
    const long long i = blockIdx.x;
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
    if (t == 0) {
        const T p = sa_s[0] * sg_s[0];
        sq[i] = accumulate ? sq[i] + p : p;
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
