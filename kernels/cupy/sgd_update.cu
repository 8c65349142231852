// SGD with momentum in one pass over flat buffers, for kernels/cupy/sgd_update.py
// (the Numba twin is kernels/numba_cuda/sgd_update.py; the contract is sgd_update in
// kernels/__init__.py): velocity = momentum * velocity + scale * grad, then
// params -= lr * velocity. One launch where torch's ops take three.
//
// 1-D grid-stride loop over the elements. Self-contained: CuPy compiles it
// with NVRTC, which has no system headers.

template <typename T>
__device__ void sgd_step(T* params, T* velocity, const T* grad, long long n, T scale, T lr,
                         T momentum) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const T v = momentum * velocity[i] + scale * grad[i];
        velocity[i] = v;
        params[i] -= lr * v;
    }
}

extern "C" {

__global__ void sgd_update_f32(float* params, float* velocity, const float* grad, long long n,
                               float scale, float lr, float momentum) {
    sgd_step<float>(params, velocity, grad, n, scale, lr, momentum);
}
__global__ void sgd_update_f64(double* params, double* velocity, const double* grad,
                               long long n, double scale, double lr, double momentum) {
    sgd_step<double>(params, velocity, grad, n, scale, lr, momentum);
}

}  // extern "C"
