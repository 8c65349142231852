// Gaussian noise for kernels/cupy/gaussian.py (Numba twin: kernels/numba_cuda/gaussian.py):
// out[i] += std * N(0, 1) on a flat buffer, from the counter-based generator
// Philox4x64-10 (Salmon, Moraes, Dror & Shaw 2011, "Parallel random numbers:
// as easy as 1, 2, 3", SC'11; the same stream as numpy.random.Philox) and the
// Box-Muller transform. Thread b draws block (ctr + b) -> four 64-bit words
// -> four normals for out[4b .. 4b+3], so the numbers do not depend on the
// launch configuration. The _at entry reads the counter from device memory
// (two words, low then high, plus a block offset fixed at launch), so a
// captured CUDA graph draws fresh blocks at every replay from the counter the
// host stages before it. The transform runs in double on purpose (53-bit
// uniforms, tails to 8.5 sigma, the CPU kernel's precision); the sum is
// rounded to the buffer's type once, as on the CPU.

#define PHILOX_M0 0xD2E7470EE14C6C93ULL
#define PHILOX_M1 0xCA5A826395121157ULL
#define PHILOX_W0 0x9E3779B97F4A7C15ULL
#define PHILOX_W1 0xBB67AE8584CAA73BULL

__device__ __forceinline__ void philox4x64_10(unsigned long long c[4], unsigned long long k0,
                                              unsigned long long k1) {
    for (int round = 0; round < 10; ++round) {
        const unsigned long long hi0 = __umul64hi(PHILOX_M0, c[0]);
        const unsigned long long lo0 = PHILOX_M0 * c[0];
        const unsigned long long hi1 = __umul64hi(PHILOX_M1, c[2]);
        const unsigned long long lo1 = PHILOX_M1 * c[2];
        const unsigned long long c1 = c[1], c3 = c[3];
        c[0] = hi1 ^ c1 ^ k0;
        c[1] = lo1;
        c[2] = hi0 ^ c3 ^ k1;
        c[3] = lo0;
        k0 += PHILOX_W0;
        k1 += PHILOX_W1;
    }
}

// (0, 1]: never 0, so log() is finite.
__device__ __forceinline__ double uniform53(unsigned long long r) {
    return ((double)(r >> 11) + 1.0) * (1.0 / 9007199254740992.0);
}

template <typename T>
__device__ void philox_normal_add(T* out, long long n, double std, unsigned long long k0,
                                  unsigned long long k1, unsigned long long ctr_lo,
                                  unsigned long long ctr_hi) {
    const long long b = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long first = 4 * b;
    if (first >= n) return;
    unsigned long long c[4];
    c[0] = ctr_lo + (unsigned long long)b;
    c[1] = ctr_hi + (c[0] < ctr_lo ? 1ULL : 0ULL);
    c[2] = 0ULL;
    c[3] = 0ULL;
    philox4x64_10(c, k0, k1);
    const double two_pi = 6.283185307179586;
    double z[4];
    for (int pair = 0; pair < 2; ++pair) {
        const double r = sqrt(-2.0 * log(uniform53(c[2 * pair])));
        const double theta = two_pi * uniform53(c[2 * pair + 1]);
        z[2 * pair] = r * cos(theta);
        z[2 * pair + 1] = r * sin(theta);
    }
    for (int m = 0; m < 4 && first + m < n; ++m) {
        out[first + m] = (T)((double)out[first + m] + std * z[m]);
    }
}

extern "C" {

__global__ void philox_normal_add_f32(float* out, long long n, double std,
                                      unsigned long long k0, unsigned long long k1,
                                      unsigned long long ctr_lo, unsigned long long ctr_hi) {
    philox_normal_add<float>(out, n, std, k0, k1, ctr_lo, ctr_hi);
}
__global__ void philox_normal_add_f64(double* out, long long n, double std,
                                      unsigned long long k0, unsigned long long k1,
                                      unsigned long long ctr_lo, unsigned long long ctr_hi) {
    philox_normal_add<double>(out, n, std, k0, k1, ctr_lo, ctr_hi);
}

// The counter at ctr[0] (low word) and ctr[1] (high word), plus offset blocks.
__global__ void philox_normal_add_at_f32(float* out, long long n, double std,
                                         unsigned long long k0, unsigned long long k1,
                                         const long long* ctr, unsigned long long offset) {
    const unsigned long long lo = (unsigned long long)ctr[0] + offset;
    const unsigned long long hi = (unsigned long long)ctr[1] + (lo < offset ? 1ULL : 0ULL);
    philox_normal_add<float>(out, n, std, k0, k1, lo, hi);
}
__global__ void philox_normal_add_at_f64(double* out, long long n, double std,
                                         unsigned long long k0, unsigned long long k1,
                                         const long long* ctr, unsigned long long offset) {
    const unsigned long long lo = (unsigned long long)ctr[0] + offset;
    const unsigned long long hi = (unsigned long long)ctr[1] + (lo < offset ? 1ULL : 0ULL);
    philox_normal_add<double>(out, n, std, k0, k1, lo, hi);
}

}  // extern "C"
