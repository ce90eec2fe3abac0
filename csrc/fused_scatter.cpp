// Python binding of csrc/fused_scatter.cu: raw device pointers and the stream come in as integers
// (vllm_delta/apply/_cuda.py takes them from torch tensors), so no torch header is compiled here.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

extern "C" {
int vd_blocks(void* base, const void* block_base, const void* rel, void* vals, int64_t n_blocks, int block,
              int val_bytes, int rel_bytes, int vec, int write, void* stream);
int vd_gather_addr(const void* base, const void* addr, void* out, int64_t n, int val_bytes, void* stream);
const char* vd_error_string(int err);
}

namespace {

void check(int err) {
  if (err) throw std::runtime_error(std::string("vllm-delta fused scatter: ") + vd_error_string(err));
}

void* ptr(std::uintptr_t p) { return reinterpret_cast<void*>(p); }

void blocks(std::uintptr_t base, std::uintptr_t block_base, std::uintptr_t rel, std::uintptr_t vals,
            int64_t n_blocks, int block, int val_bytes, int rel_bytes, int vec, bool write, std::uintptr_t stream) {
  check(vd_blocks(ptr(base), ptr(block_base), ptr(rel), ptr(vals), n_blocks, block, val_bytes, rel_bytes, vec,
                  write ? 1 : 0, ptr(stream)));
}

void gather_addr(std::uintptr_t base, std::uintptr_t addr, std::uintptr_t out, int64_t n, int val_bytes,
                 std::uintptr_t stream) {
  check(vd_gather_addr(ptr(base), ptr(addr), ptr(out), n, val_bytes, ptr(stream)));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "vllm-delta fused in-place scatter/gather (CUDA)";
  m.def("blocks", &blocks, "scatter (write=True) or gather a fused plan's blocks");
  m.def("gather_addr", &gather_addr, "gather at int64 element offsets from a base pointer");
}
