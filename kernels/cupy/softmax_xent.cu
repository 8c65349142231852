// Softmax cross-entropy for kernels/cupy/softmax_xent.py (Numba twin:
// kernels/numba_cuda/softmax_xent.py). One thread per row (the classes are few):
// grad[i] = softmax(logits[i]) - onehot(labels[i]) and row_loss[i] =
// logsumexp(logits[i]) - logits[i, labels[i]], computed as the CPU kernel
// does (max-shifted). The caller sums row_loss (deterministic order).

__device__ __forceinline__ float exp_of(float x) { return expf(x); }
__device__ __forceinline__ double exp_of(double x) { return exp(x); }
__device__ __forceinline__ float log_of(float x) { return logf(x); }
__device__ __forceinline__ double log_of(double x) { return log(x); }

template <typename T>
__device__ void softmax_xent(const T* logits, long long ldl, const long long* labels, T* grad,
                             long long ldg, T* row_loss, long long k, long long c) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= k) return;
    const T* z = logits + i * ldl;
    T* g = grad + i * ldg;
    T m = z[0];
    for (long long j = 1; j < c; ++j) m = z[j] > m ? z[j] : m;
    T s = T(0);
    for (long long j = 0; j < c; ++j) s += exp_of(z[j] - m);
    const T lse = m + log_of(s);
    const long long y = labels[i];
    for (long long j = 0; j < c; ++j) g[j] = exp_of(z[j] - lse);
    g[y] -= T(1);
    row_loss[i] = lse - z[y];
}

extern "C" {

__global__ void softmax_xent_f32(const float* logits, long long ldl, const long long* labels,
                                 float* grad, long long ldg, float* row_loss, long long k,
                                 long long c) {
    softmax_xent<float>(logits, ldl, labels, grad, ldg, row_loss, k, c);
}
__global__ void softmax_xent_f64(const double* logits, long long ldl, const long long* labels,
                                 double* grad, long long ldg, double* row_loss, long long k,
                                 long long c) {
    softmax_xent<double>(logits, ldl, labels, grad, ldg, row_loss, k, c);
}

}  // extern "C"
