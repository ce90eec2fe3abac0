#!/usr/bin/env python
"""Micro-benchmark of in-place scatter strategies on one large bf16 buffer (GPU only).

Why the fused element scatter runs ~2.5x above the (6 + 64 B per change) floor: a 2-byte store
is a partial write of a 32-byte sector, which the memory system completes by a read-modify-write
when the sector leaves L2. Strategies, on the same sorted random changes (int64 addresses):

  elem     buf[a] = v, one thread per change (what the fused kernels do)
  touch    load buf[a] first (the sector enters L2 whole), then store if it differs
  sector   one 'leader' thread per touched 32 B sector (changes sorted by address) loads the
           sector (2 x 16 B), merges every change of that sector in registers, stores 2 x 16 B
  staged   per touched sector, the new 32 B staged in advance: 2 x 16 B stores only
  copy     device-to-device copy of the whole buffer (bandwidth reference)

    python benchmarks/scatter_variants.py [--elements 8.19e9] [--density 0.01]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
from apply_gpu import time_events  # same directory: benchmarks share one timer
from torch.utils.cpp_extension import load_inline

CUDA = r"""
#include <cuda_runtime.h>
#include <cstdint>

__global__ void k_elem(int16_t* buf, const int64_t* addr, const int16_t* val, int64_t n) {
  int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i < n) buf[addr[i]] = val[i];
}

__global__ void k_touch(int16_t* buf, const int64_t* addr, const int16_t* val, int64_t n) {
  int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i < n) {
    const int64_t a = addr[i];
    const int16_t v = val[i];
    const int16_t o = *((volatile int16_t*)(buf + a));
    if (o != v) buf[a] = v;
  }
}

__device__ __forceinline__ void put(uint32_t (&w)[8], int lane, uint32_t v) {
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    if (k == (lane >> 1)) w[k] = (lane & 1) ? ((w[k] & 0xFFFFu) | (v << 16)) : ((w[k] & 0xFFFF0000u) | (v & 0xFFFFu));
  }
}

__global__ void k_sector(int16_t* buf, const int64_t* addr, const int16_t* val, int64_t n) {
  int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int64_t s = addr[i] >> 4;
  if (i > 0 && (addr[i - 1] >> 4) == s) return;
  uint4* p = reinterpret_cast<uint4*>(buf + (s << 4));
  uint4 lo = p[0], hi = p[1];
  uint32_t w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
  for (int64_t j = i; j < n; ++j) {
    const int64_t a = addr[j];
    if ((a >> 4) != s) break;
    put(w, static_cast<int>(a & 15), static_cast<uint16_t>(val[j]));
  }
  p[0] = make_uint4(w[0], w[1], w[2], w[3]);
  p[1] = make_uint4(w[4], w[5], w[6], w[7]);
}

__global__ void k_staged(int16_t* buf, const int64_t* sec, const uint4* content, int64_t m) {
  int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i < m) {
    uint4* p = reinterpret_cast<uint4*>(buf + (sec[i] << 4));
    p[0] = content[2 * i];
    p[1] = content[2 * i + 1];
  }
}

// lane pairs: lanes 2k and 2k+1 hold the two 16 B halves of one sector, so one warp store
// instruction writes whole 32 B sectors (one request each, no partial-write fill)
__global__ void k_staged2(int16_t* buf, const int64_t* sec, const uint4* content, int64_t m) {
  int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  int64_t s = t >> 1;
  if (s < m) reinterpret_cast<uint4*>(buf + (sec[s] << 4))[t & 1] = content[t];
}

__device__ __forceinline__ void put4(uint32_t (&w)[4], int lane, uint32_t v) {
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if (k == (lane >> 1)) w[k] = (lane & 1) ? ((w[k] & 0xFFFFu) | (v << 16)) : ((w[k] & 0xFFFF0000u) | (v & 0xFFFFu));
  }
}

__global__ void k_sector2(int16_t* buf, const int64_t* sec, const int32_t* csr, const uint8_t* lanes,
                          const int16_t* val, int64_t m) {
  int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  int64_t s = t >> 1;
  if (s >= m) return;
  const int h = t & 1;
  uint4* p = reinterpret_cast<uint4*>(buf + (sec[s] << 4)) + h;
  uint4 q = *p;
  uint32_t w[4] = {q.x, q.y, q.z, q.w};
  const int32_t e = csr[s + 1];
  for (int32_t j = csr[s]; j < e; ++j) {
    const int lane = lanes[j];
    if ((lane >> 3) == h) put4(w, lane & 7, static_cast<uint16_t>(val[j]));
  }
  *p = make_uint4(w[0], w[1], w[2], w[3]);
}

// persistent grid: the whole GPU walks the sorted changes in a window of gridDim*blockDim
__global__ void k_elem_gs(int16_t* buf, const int64_t* addr, const int16_t* val, int64_t n) {
  const int64_t step = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += step) buf[addr[i]] = val[i];
}

// cache hints on the element store / stream loads: 0 default, 1 st.cs, 2 st.wt, 3 st.cg, 4 ld.cs + st default
__global__ void k_elem_hint(int16_t* buf, const int64_t* addr, const int16_t* val, int64_t n, int hint) {
  int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i >= n) return;
  int64_t a;
  short v;
  if (hint == 4) { a = __ldcs(addr + i); v = __ldcs(reinterpret_cast<const short*>(val) + i); }
  else { a = addr[i]; v = val[i]; }
  short* p = reinterpret_cast<short*>(buf) + a;
  if (hint == 1) __stcs(p, v);
  else if (hint == 2) __stwt(p, v);
  else if (hint == 3) __stcg(p, v);
  else *p = v;
}

void launch_hint(int64_t buf, int64_t a, int64_t v, int64_t n, int hint) {
  k_elem_hint<<<(n + 1023) / 1024, 1024>>>((int16_t*)buf, (const int64_t*)a, (const int16_t*)v, n, hint);
}

void launch_gs(int64_t buf, int64_t a, int64_t v, int64_t n, int blocks, int threads) {
  k_elem_gs<<<blocks, threads>>>((int16_t*)buf, (const int64_t*)a, (const int16_t*)v, n);
}

void launch2(int64_t buf, int64_t sec, int64_t csr, int64_t lanes, int64_t v, int64_t m, int threads) {
  const int64_t blocks = (2 * m + threads - 1) / threads;
  k_sector2<<<blocks, threads>>>((int16_t*)buf, (const int64_t*)sec, (const int32_t*)csr, (const uint8_t*)lanes,
                                 (const int16_t*)v, m);
}

void launch(int which, int64_t buf, int64_t a, int64_t v, int64_t n, int threads) {
  const int64_t blocks = (n + threads - 1) / threads;
  auto B = (int16_t*)buf;
  if (which == 0) k_elem<<<blocks, threads>>>(B, (const int64_t*)a, (const int16_t*)v, n);
  if (which == 1) k_touch<<<blocks, threads>>>(B, (const int64_t*)a, (const int16_t*)v, n);
  if (which == 2) k_sector<<<blocks, threads>>>(B, (const int64_t*)a, (const int16_t*)v, n);
  if (which == 3) k_staged<<<blocks, threads>>>(B, (const int64_t*)a, (const uint4*)v, n);
  if (which == 4) k_staged2<<<(2 * n + threads - 1) / threads, threads>>>(B, (const int64_t*)a, (const uint4*)v, n);
}
"""
CPP = """void launch(int which, int64_t buf, int64_t a, int64_t v, int64_t n, int threads);
void launch2(int64_t buf, int64_t sec, int64_t csr, int64_t lanes, int64_t v, int64_t m, int threads);
void launch_gs(int64_t buf, int64_t a, int64_t v, int64_t n, int blocks, int threads);
void launch_hint(int64_t buf, int64_t a, int64_t v, int64_t n, int hint);"""


def median_ms(fn, reps=10):
    """Median CUDA-event time of `fn`, the same timer as apply_gpu.py."""
    return time_events([fn], reps, torch.device("cuda"))


@dataclass
class Data:
    """A buffer of `--elements` int16 values, the changed addresses at the density, their old and new
    values and touched 32-byte sectors, and the floors the kernels are measured against."""

    buf: torch.Tensor
    addr: torch.Tensor
    old: torch.Tensor
    new: torch.Tensor
    sec: torch.Tensor
    content_old: torch.Tensor  # staged sector content
    content_new: torch.Tensor
    floor: float
    sector_floor: float

    @property
    def n(self) -> int:
        return self.addr.numel()

    @property
    def m(self) -> int:
        return self.sec.numel()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--elements", type=float, default=8.19e9)
    ap.add_argument("--density", type=float, default=0.01)
    args = ap.parse_args()
    ext = load_inline(
        "scatter_variants",
        CPP,
        cuda_sources=CUDA,
        functions=["launch", "launch2", "launch_gs", "launch_hint"],
        extra_cuda_cflags=["-O3"],
    )
    d, bw_ms = make_data(args)
    element_kernels(ext, d)
    sector2_kernels(ext, d)
    hints_and_grid(ext, d)
    print(f"  copy (whole buffer) {bw_ms:.3f} ms")
    # staging-side costs of a sector plan: sort (if needed), sectors, CSR
    addr = d.addr
    shuffled = addr[torch.randperm(d.n, device=addr.device)]
    for label, fn in (
        ("sort 82M int64 (+indices)", lambda: torch.sort(shuffled)),
        ("unique_consecutive sectors", lambda: torch.unique_consecutive(addr >> 4, return_counts=True)),
        ("is sorted check", lambda: bool((addr[1:] > addr[:-1]).all())),
    ):
        print(f"  {label}: {median_ms(fn, 3):.2f} ms")


def make_data(args) -> tuple[Data, float]:
    """The buffer, the changes and the floors (and the whole buffer's copy time, ms)."""
    dev = torch.device("cuda")
    n_el = int(args.elements) // 16 * 16
    buf = torch.empty(n_el, dtype=torch.int16, device=dev).random_()
    gen = torch.Generator(device=dev).manual_seed(0)
    parts, step = [], 1 << 28
    for s in range(0, n_el, step):
        m = min(step, n_el - s)
        parts.append(torch.nonzero(torch.rand(m, generator=gen, device=dev) < args.density).reshape(-1) + s)
    addr = torch.cat(parts)
    del parts
    n = addr.numel()
    old = buf[addr]
    new = old + 1
    sec, inv = torch.unique_consecutive(addr >> 4, return_inverse=True)
    m = sec.numel()
    # staged sector content for new and old
    content_old = buf.view(-1, 16)[sec].contiguous()
    content_new = content_old.clone()
    content_new[inv, addr & 15] = new
    bw_ms = median_ms(lambda: buf.clone())
    bw = 2 * n_el * 2 / (bw_ms * 1e-3)
    floor = (6 + 64) * n / bw * 1e3
    sector_floor = (6 * n + 64 * m) / bw * 1e3
    print(
        f"{torch.cuda.get_device_name(dev)}: {n_el / 1e9:.2f}G elements, density {args.density:.2%}, "
        f"{n / 1e6:.1f}M changes in {m / 1e6:.1f}M sectors; copy {bw / 1e9:.0f} GB/s; "
        f"floor {floor:.3f} ms, sector floor {sector_floor:.3f} ms"
    )
    return Data(buf, addr, old, new, sec, content_old, content_new, floor, sector_floor), bw_ms


def element_kernels(ext, d: Data) -> None:
    """Per element, per element with a touch, per sector, staged sectors: timed, then checked."""
    buf, addr, new, old, sec, floor, sector_floor = d.buf, d.addr, d.new, d.old, d.sec, d.floor, d.sector_floor
    n, m = d.n, d.m
    for name, which, a, vals in (
        ("elem", 0, addr, (new, old)),
        ("touch", 1, addr, (new, old)),
        ("sector", 2, addr, (new, old)),
        ("staged", 3, sec, (d.content_new, d.content_old)),
        ("staged2", 4, sec, (d.content_new, d.content_old)),
    ):
        for threads in (256, 1024):
            count = m if which in (3, 4) else n
            flip = [0]

            def run(a=a, vals=vals, which=which, threads=threads, count=count, flip=flip):
                v = vals[flip[0] % 2]
                flip[0] += 1
                ext.launch(which, buf.data_ptr(), a.data_ptr(), v.data_ptr(), count, threads)

            ms = median_ms(run)
            # correctness: write new, check
            ext.launch(which, buf.data_ptr(), a.data_ptr(), vals[0].data_ptr(), count, threads)
            ok = torch.equal(buf[addr], new)
            ext.launch(which, buf.data_ptr(), a.data_ptr(), vals[1].data_ptr(), count, threads)
            ok = ok and torch.equal(buf[addr], old)
            print(
                f"  {name:7s} threads={threads:5d} {ms:8.3f} ms  {ms / floor:5.2f}x floor  "
                f"{ms / sector_floor:5.2f}x sector floor  {'ok' if ok else 'WRONG'}"
            )


def sector2_kernels(ext, d: Data) -> None:
    """Sectors with a CSR of their changed lanes: timed, then checked."""
    buf, addr, new, old, sec, m = d.buf, d.addr, d.new, d.old, d.sec, d.m
    counts = torch.unique_consecutive(addr >> 4, return_counts=True)[1]
    csr = torch.zeros(m + 1, dtype=torch.int32, device=addr.device)
    csr[1:] = torch.cumsum(counts, 0).to(torch.int32)
    lanes = (addr & 15).to(torch.uint8)
    for threads in (256, 1024):
        flip = [0]

        def run2(threads=threads, flip=flip):
            v = (new, old)[flip[0] % 2]
            flip[0] += 1
            ext.launch2(buf.data_ptr(), sec.data_ptr(), csr.data_ptr(), lanes.data_ptr(), v.data_ptr(), m, threads)

        ms = median_ms(run2)
        ext.launch2(buf.data_ptr(), sec.data_ptr(), csr.data_ptr(), lanes.data_ptr(), new.data_ptr(), m, threads)
        ok = torch.equal(buf[addr], new)
        ext.launch2(buf.data_ptr(), sec.data_ptr(), csr.data_ptr(), lanes.data_ptr(), old.data_ptr(), m, threads)
        ok = ok and torch.equal(buf[addr], old)
        print(
            f"  sector2 threads={threads:5d} {ms:8.3f} ms  {ms / d.floor:5.2f}x floor  "
            f"{ms / d.sector_floor:5.2f}x sector floor  {'ok' if ok else 'WRONG'}"
        )


def hints_and_grid(ext, d: Data) -> None:
    """Per element with cache hints on the stores, and a grid-stride loop with several blocks in flight."""
    buf, addr, new, old, n = d.buf, d.addr, d.new, d.old, d.n
    for hint, label in ((0, "default"), (1, "st.cs"), (2, "st.wt"), (3, "st.cg"), (4, "ld.cs")):
        flip = [0]

        def run_h(hint=hint, flip=flip):
            v = (new, old)[flip[0] % 2]
            flip[0] += 1
            ext.launch_hint(buf.data_ptr(), addr.data_ptr(), v.data_ptr(), n, hint)

        ms = median_ms(run_h, 20)
        print(f"  elem hint {label:8s} {ms:8.3f} ms  {ms / d.floor:5.2f}x floor")
    for blocks in (32, 64, 132, 264, 528, 1056, 4224):
        flip = [0]

        def run_gs(blocks=blocks, flip=flip):
            v = (new, old)[flip[0] % 2]
            flip[0] += 1
            ext.launch_gs(buf.data_ptr(), addr.data_ptr(), v.data_ptr(), n, blocks, 256)

        ms = median_ms(run_gs)
        print(f"  elem_gs in flight {blocks * 256:8d} {ms:8.3f} ms  {ms / d.floor:5.2f}x floor")


if __name__ == "__main__":
    main()
