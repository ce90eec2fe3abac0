// Fused in-place scatter / gather of bit patterns over a fused plan (vllm_delta/apply/scatter.py).
//
// A plan is a list of blocks of `block` slots. Block b has an int64 base (element offset from the
// base tensor's address); slot s of it addresses element block_base[b] + rel[s], or nothing when
// rel[s] < 0 (padding). All targets of one device share one flat address space, so one launch
// writes every tensor of a model. Pure CUDA: no torch headers (fast to build); the Python binding
// (fused_scatter.cpp) passes raw pointers and the current stream.
#include <cuda_runtime.h>

#include <cstdint>

namespace {

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// One thread block per plan block (grid-stride over blocks), VEC consecutive slots per thread per step:
// vector loads of offsets and values (16 B for VEC=4 int32 offsets), then VEC scattered stores.
template <typename T, typename R, int VEC, bool WRITE>
__global__ void blocks_kernel(T* __restrict__ base, const int64_t* __restrict__ block_base,
                              const R* __restrict__ rel, T* __restrict__ vals, int64_t n_blocks, int block) {
  for (int64_t b = blockIdx.x; b < n_blocks; b += gridDim.x) {
    const int64_t bb = block_base[b];
    const int64_t s0 = b * static_cast<int64_t>(block);
    for (int i = threadIdx.x * VEC; i < block; i += blockDim.x * VEC) {
      const Vec<R, VEC> r = *reinterpret_cast<const Vec<R, VEC>*>(rel + s0 + i);
      if (WRITE) {
        const Vec<T, VEC> v = *reinterpret_cast<const Vec<T, VEC>*>(vals + s0 + i);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          if (r.v[j] >= 0) base[bb + static_cast<int64_t>(r.v[j])] = v.v[j];
        }
      } else {
        Vec<T, VEC> v;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          v.v[j] = r.v[j] >= 0 ? base[bb + static_cast<int64_t>(r.v[j])] : T(0);
        }
        *reinterpret_cast<Vec<T, VEC>*>(vals + s0 + i) = v;
      }
    }
  }
}

template <typename T>
__global__ void gather_addr_kernel(const T* __restrict__ base, const int64_t* __restrict__ addr,
                                   T* __restrict__ out, int64_t n) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += step) {
    out[i] = base[addr[i]];
  }
}

template <typename T, typename R, int VEC>
cudaError_t launch_blocks(void* base, const void* block_base, const void* rel, void* vals, int64_t n_blocks,
                          int block, bool write, cudaStream_t stream) {
  int threads = block / VEC;
  if (threads > 1024) threads = 1024;
  const int64_t max_grid = 0x7fffffff;
  const unsigned grid = static_cast<unsigned>(n_blocks < max_grid ? n_blocks : max_grid);
  if (write) {
    blocks_kernel<T, R, VEC, true><<<grid, threads, 0, stream>>>(
        static_cast<T*>(base), static_cast<const int64_t*>(block_base), static_cast<const R*>(rel),
        static_cast<T*>(vals), n_blocks, block);
  } else {
    blocks_kernel<T, R, VEC, false><<<grid, threads, 0, stream>>>(
        static_cast<T*>(base), static_cast<const int64_t*>(block_base), static_cast<const R*>(rel),
        static_cast<T*>(vals), n_blocks, block);
  }
  return cudaGetLastError();
}

template <typename T, typename R>
cudaError_t dispatch_vec(int vec, void* base, const void* block_base, const void* rel, void* vals,
                         int64_t n_blocks, int block, bool write, cudaStream_t stream) {
  switch (vec) {
    case 1:
      return launch_blocks<T, R, 1>(base, block_base, rel, vals, n_blocks, block, write, stream);
    case 4:
      return launch_blocks<T, R, 4>(base, block_base, rel, vals, n_blocks, block, write, stream);
    case 8:
      return launch_blocks<T, R, 8>(base, block_base, rel, vals, n_blocks, block, write, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace

extern "C" {

// val_bytes: 2 or 4; rel_bytes: 4 or 8; vec: 1, 4 or 8 (block % vec == 0 and pointers aligned to it).
int vd_blocks(void* base, const void* block_base, const void* rel, void* vals, int64_t n_blocks, int block,
              int val_bytes, int rel_bytes, int vec, int write, void* stream) {
  if (n_blocks <= 0) return 0;
  if (block <= 0 || block % vec) return static_cast<int>(cudaErrorInvalidValue);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (val_bytes == 2 && rel_bytes == 4)
    return dispatch_vec<int16_t, int32_t>(vec, base, block_base, rel, vals, n_blocks, block, write, s);
  if (val_bytes == 2 && rel_bytes == 8)
    return dispatch_vec<int16_t, int64_t>(vec, base, block_base, rel, vals, n_blocks, block, write, s);
  if (val_bytes == 4 && rel_bytes == 4)
    return dispatch_vec<int32_t, int32_t>(vec, base, block_base, rel, vals, n_blocks, block, write, s);
  if (val_bytes == 4 && rel_bytes == 8)
    return dispatch_vec<int32_t, int64_t>(vec, base, block_base, rel, vals, n_blocks, block, write, s);
  return static_cast<int>(cudaErrorInvalidValue);
}

int vd_gather_addr(const void* base, const void* addr, void* out, int64_t n, int val_bytes, void* stream) {
  if (n <= 0) return 0;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int threads = 256;
  int64_t blocks = (n + threads - 1) / threads;
  if (blocks > 65536) blocks = 65536;
  if (val_bytes == 2) {
    gather_addr_kernel<int16_t><<<static_cast<unsigned>(blocks), threads, 0, s>>>(
        static_cast<const int16_t*>(base), static_cast<const int64_t*>(addr), static_cast<int16_t*>(out), n);
  } else if (val_bytes == 4) {
    gather_addr_kernel<int32_t><<<static_cast<unsigned>(blocks), threads, 0, s>>>(
        static_cast<const int32_t*>(base), static_cast<const int64_t*>(addr), static_cast<int32_t*>(out), n);
  } else {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  return static_cast<int>(cudaGetLastError());
}

const char* vd_error_string(int err) { return cudaGetErrorString(static_cast<cudaError_t>(err)); }

}  // extern "C"
