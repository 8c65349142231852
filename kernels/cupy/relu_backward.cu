// ReLU backward for kernels/cupy/relu_backward.py (Numba twin:
// kernels/numba_cuda/relu_backward.py): grad[i, j] = 0 where out[i, j] <= 0, in
// place (masked entries become +0, as the CPU Numba kernel makes them).
// 2-D grid: x over columns, y over rows (grid-stride in y); row-major with
// leading dimensions.

template <typename T>
__device__ void relu_backward(T* grad, long long ldg, const T* out, long long ldo, long long k,
                              long long d) {
    const long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= d) return;
    for (long long i = (long long)blockIdx.y * blockDim.y + threadIdx.y; i < k;
         i += (long long)gridDim.y * blockDim.y) {
        if (!(out[i * ldo + j] > T(0))) grad[i * ldg + j] = T(0);
    }
}

extern "C" {

__global__ void relu_backward_f32(float* grad, long long ldg, const float* out, long long ldo,
                                  long long k, long long d) {
    relu_backward<float>(grad, ldg, out, ldo, k, d);
}
__global__ void relu_backward_f64(double* grad, long long ldg, const double* out,
                                  long long ldo, long long k, long long d) {
    relu_backward<double>(grad, ldg, out, ldo, k, d);
}

}  // extern "C"
