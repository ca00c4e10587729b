"""Run the experts family's rendered kernel bodies on the CPU (no GPU): the CUDA source of both phases is
compiled as host C++20 with a host prelude in which every GPU thread of a block is a fiber on one OS thread
(:data:`FIBERS`: ``__syncthreads`` / ``__syncwarp`` are barriers that park a fiber until the last of their
threads arrives, shuffles go through a per-warp exchange buffer, ``mma.sync`` is computed from the PTX fragment
layouts), and the grid's blocks run one after another.

It checks the kernel's own logic (job table, expert dedup, chunk streaming, fragment ownership, activation
quant, epilogues, the ordered sum) on shapes small enough for a CPU; not the compiler, the hardware MMA's
internal precision, or timing. Used by ``tests/test_experts_family.py`` and runnable by hand:

    python tests/emulators/experts_emu.py            # a few tiny / medium shapes, both engines, vs the reference
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

if __package__ in (None, ""):  # run as a script: tests/, for emulators.*
    sys.path.append(str(Path(__file__).resolve().parents[1]))

from ds4c.runtime.families import experts as X  # noqa: E402
from ds4c.runtime.targets import target as make_target  # noqa: E402

FIBERS = r"""
// ---- GPU threads as fibers on one OS thread: a fiber runs until it waits at a barrier, which parks it until the
// barrier's last arrival makes every waiter ready again; ready fibers run in FIFO order. (OS threads meeting at
// std::barriers spent their time in the kernel's scheduler, ~10x slower on a busy 2-core machine.) On x86-64 a switch
// saves the callee-saved registers on the fiber's stack and swaps stack pointers (emu_switch, below): glibc's
// swapcontext also saves the signal mask with a system call on every switch, and the emulators switch at every
// barrier and every emulated warp instruction (elsewhere ucontext, as before).
// Needs <cstdio> <cstdlib> <vector> <ucontext.h>; no <thread> / <functional> / <memory>, which cost ~1 s each
// of every emulator's compile.
#include <cstdint>
static int emu_cur = 0;  // the running fiber: its GPU thread index in the block
static int emu_nfib = 0, emu_live = 0;
static int* emu_ready = nullptr;  // ring of ready fibers (each fiber is in it at most once)
static unsigned long long emu_rhead = 0, emu_rtail = 0;
static void (*emu_body)(void*, int) = nullptr;
static void* emu_body_arg = nullptr;
static void emu_entry();
#if defined(__x86_64__) && defined(__ELF__)
// emu_switch(&from_sp, to_sp): push rbp rbx r12-r15, save rsp in from_sp, load to_sp, pop them, return there (a
// return the CPU's shadow stack would refuse: the program is built with -fcf-protection=none, HOST_FLAGS)
extern "C" void emu_switch(void** from, void* to);
asm(".pushsection .text\n.globl emu_switch\n.type emu_switch,@function\nemu_switch:\n"
    "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
    "  movq %rsp, (%rdi)\n  movq %rsi, %rsp\n"
    "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n  ret\n"
    ".size emu_switch, .-emu_switch\n.popsection\n");
typedef void* EmuCtx;  // a parked fiber's stack pointer
static EmuCtx* emu_ctx = nullptr;
static EmuCtx emu_main_ctx;
static void emu_go(EmuCtx* from, EmuCtx* to) { emu_switch(from, *to); }
static void emu_make(EmuCtx* c, char* stack, size_t size) {  // the first switch to it "returns" into emu_entry
  void** top = (void**)(((uintptr_t)(stack + size)) & ~(uintptr_t)15);
  top[-1] = nullptr;             // emu_entry's return address slot (never used): rsp % 16 == 8 at its entry
  top[-2] = (void*)&emu_entry;   // emu_switch's ret
  for (int i = 3; i <= 8; ++i) top[-i] = nullptr;  // rbp rbx r12-r15
  *c = (void*)(top - 8);
}
#else
typedef ucontext_t EmuCtx;
static EmuCtx* emu_ctx = nullptr;
static EmuCtx emu_main_ctx;
static void emu_go(EmuCtx* from, EmuCtx* to) { swapcontext(from, to); }
static void emu_make(EmuCtx* c, char* stack, size_t size) {
  getcontext(c);
  c->uc_stack.ss_sp = stack;
  c->uc_stack.ss_size = size;
  c->uc_link = nullptr;
  makecontext(c, emu_entry, 0);
}
#endif
static void emu_push(int f) { emu_ready[emu_rtail++ % emu_nfib] = f; }
static int emu_pop() {
  if (emu_rhead == emu_rtail) {
    if (emu_live == 0) return -1;
    fprintf(stderr, "emulator deadlock: %d GPU threads wait at barriers no other thread will reach\n", emu_live);
    abort();
  }
  return emu_ready[emu_rhead++ % emu_nfib];
}
static void emu_park() {  // the running fiber waits (it is in a barrier's list): run the next ready one
  const int me = emu_cur, nx = emu_pop();
  emu_cur = nx;
  emu_go(&emu_ctx[me], &emu_ctx[nx]);
  emu_cur = me;
}
static void emu_entry() {  // a fiber's life; its end switches to the next ready fiber, or back to emu_run_fibers
  emu_body(emu_body_arg, emu_cur);
  --emu_live;
  const int me = emu_cur, nx = emu_pop();
  if (nx < 0) emu_go(&emu_ctx[me], &emu_main_ctx);
  emu_cur = nx;
  emu_go(&emu_ctx[me], &emu_ctx[nx]);
  abort();  // an ended fiber is never resumed
}
struct EmuBarrier {  // std::barrier's arrive_and_wait, between fibers
  int n, count = 0;
  std::vector<int> wait;
  explicit EmuBarrier(int n) : n(n) { wait.reserve(n); }
  void arrive_and_wait() {
    if (++count < n) { wait.push_back(emu_cur); emu_park(); return; }
    count = 0;
    for (int f : wait) emu_push(f);
    wait.clear();
  }
};
static void emu_run_fibers(int n, void (*body)(void*, int), void* arg) {  // body(arg, t), t < n; returns when all end
  const size_t stack = 512 * 1024;
  std::vector<EmuCtx> ctx(n);
  std::vector<int> ready(n);
  char* stacks = (char*)malloc(stack * n);  // untouched pages stay unmapped
  if (!stacks) { fprintf(stderr, "emulator: no memory for %d fiber stacks\n", n); abort(); }
  emu_ctx = ctx.data(); emu_ready = ready.data(); emu_nfib = emu_live = n; emu_rhead = emu_rtail = 0;
  emu_body = body; emu_body_arg = arg;
  for (int t = 0; t < n; ++t) {
    emu_make(&ctx[t], stacks + stack * t, stack);
    emu_push(t);
  }
  emu_cur = emu_pop();
  emu_go(&emu_main_ctx, &ctx[emu_cur]);
  free(stacks);
}
template <class F>
static void emu_run_fibers(int n, F& f) { emu_run_fibers(n, [](void* p, int t) { (*(F*)p)(t); }, &f); }
"""

HOST_PRELUDE = r"""
#include <cstdint>
#include <cstring>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <ucontext.h>
""" + FIBERS + r"""
#ifndef DS4C_WAVE  /* a HIP body's emulation defines DS4C_HIP and its wave first (compile_host) */
#define DS4C_CUDA 1
#define DS4C_WAVE 32
#endif
#define DS4C_GLOBAL extern "C"
#define DS4C_PDL_ENTRY() do { } while (0)  /* programmatic dependent launch: nothing to wait for on the host */
#define DS4C_DEVICE static inline
#define DS4C_SHARED
#define DS4C_RESTRICT __restrict__
#define __launch_bounds__(...)
#define DS4C_LAUNCH_BOUNDS(n)
typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef short i16;
typedef unsigned int u32;
typedef int i32;
typedef long long i64;
typedef unsigned long long u64;
#define DS4C_HAS_BYTE_PERM 1  /* prmt on the host: byte (sel >> 4i) & 7 of (b:a), as prelude/cuda.h.j2 */
static inline u32 ds4c_byte_perm(u32 a, u32 b, u32 sel) {
  const unsigned long long v = ((unsigned long long)b << 32) | a;
  u32 r = 0u;
  for (int i = 0; i < 4; ++i) r |= (u32)((v >> (8 * ((sel >> (4 * i)) & 7u))) & 0xffu) << (8 * i);
  return r;
}

struct EmuBlock {
  EmuBarrier* bar;
  EmuBarrier* wbar[32];
  EmuBarrier* gbar[8];  // per warpgroup (wgmma)
  float fx[1024];
  float wgA[8][64][16];  // per warpgroup: the wgmma A operand, assembled from its threads' fragments
  float wgA8[8][64][32];  // per warpgroup: the FP8 wgmma's A operand (k32)
  float mA[32][16][16], mB[32][16][8];  // per warp: the mma operands, assembled from the lanes' fragments
  float qA[32][16][32], qB[32][32][8];  // per warp: the m16n8k32 (8-bit) mma operands
  float xB[32][16][16];                 // per wave: a HIP matrix op's B (A in mA)
  bool xSet[32][16][16];                // per wave: the A elements the lanes gave (guards this file's layouts)
  const u8* px[1024];                     // ldmatrix: every lane's row address
};
static EmuBlock* g_blk;
static int t_bx, t_by, t_nbx;  // the block (every fiber runs the same one)
#define t_tid emu_cur

// ---- cp.async: a copy waits in its thread's queue until a wait_group completes its group, so a tile read before
// its wait sees the old bytes (as it may on the GPU); a block that ends with copies never waited for aborts
// With DS4C_EMU_CP_EAGER=1 in the environment a copy lands at its issue instead (the other extreme of the GPU's
// timing): a copy issued into a stage that another thread still reads (a missing barrier before the issue) then
// overwrites that thread's operands, which the deferred mode cannot show.
// wgmma bookkeeping (below): the shared-memory byte ranges each thread's wgmma groups still in flight read, so a
// copy into one of them (a stage refilled before its wgmma.wait_group) aborts
struct EmuWgRead { unsigned long long group; const u8* lo; const u8* hi; };
static std::vector<EmuWgRead> emu_wg_reads[1024];
static void emu_wg_check_write(const u8* p, int n, const char* what) {
  for (int t = 0; t < 1024; ++t)
    for (const EmuWgRead& r : emu_wg_reads[t])
      if (p < r.hi && p + n > r.lo) {
        fprintf(stderr, "emulator: %s by thread %d writes shared memory a wgmma of thread %d still reads (no "
                "wgmma.wait_group before it)\n", what, emu_cur, t);
        abort();
      }
}
struct EmuCp { u8* dst; const u8* src; unsigned long long group; int n; };
static std::vector<EmuCp> emu_cpq[1024];
static unsigned long long emu_cp_groups[1024];
static bool emu_cp_eager() {
  static const int eager = [] { const char* e = std::getenv("DS4C_EMU_CP_EAGER"); return e && e[0] == '1' ? 1 : 0; }();
  return eager != 0;
}
static void emu_cp(void* dst, const void* src, int n) {
  emu_wg_check_write((const u8*)dst, n, "a cp.async copy");
  if (emu_cp_eager()) std::memcpy(dst, src, n);
  else emu_cpq[t_tid].push_back({(u8*)dst, (const u8*)src, emu_cp_groups[t_tid], n});
}
DS4C_DEVICE void xp_cp16(void* dst, const void* src) { emu_cp(dst, src, 16); }
DS4C_DEVICE void xp_cp4(void* dst, const void* src) { emu_cp(dst, src, 4); }
DS4C_DEVICE void xp_cp8(void* dst, const void* src) { emu_cp(dst, src, 8); }
DS4C_DEVICE void xp_cp_commit() { ++emu_cp_groups[t_tid]; }
template <int N> DS4C_DEVICE void xp_cp_wait() {  // groups older than the N most recent commits complete
  std::vector<EmuCp>& qv = emu_cpq[t_tid];
  const unsigned long long n = emu_cp_groups[t_tid], done = n >= (unsigned long long)N ? n - N : 0ull;
  size_t k = 0;
  for (size_t i = 0; i < qv.size(); ++i) {
    if (qv[i].group < done) std::memcpy(qv[i].dst, qv[i].src, qv[i].n);
    else qv[k++] = qv[i];
  }
  qv.resize(k);
}
static void emu_cp_check_drained() {
  if (!emu_cpq[t_tid].empty()) {
    fprintf(stderr, "emulator: thread %d ended its block with %zu cp.async copies never waited for\n", t_tid,
            emu_cpq[t_tid].size());
    abort();
  }
}

DS4C_DEVICE int ds4c_tid() { return t_tid; }
DS4C_DEVICE int ds4c_bid_x() { return t_bx; }
DS4C_DEVICE int ds4c_bid_y() { return t_by; }
DS4C_DEVICE int ds4c_nblk_x() { return t_nbx; }
DS4C_DEVICE int ds4c_lane() { return t_tid & (DS4C_WAVE - 1); }
DS4C_DEVICE void ds4c_sync() { g_blk->bar->arrive_and_wait(); }
DS4C_DEVICE void __syncwarp() { g_blk->wbar[t_tid / DS4C_WAVE]->arrive_and_wait(); }
DS4C_DEVICE float ds4c_as_float(u32 b) { float f; std::memcpy(&f, &b, 4); return f; }
DS4C_DEVICE u32 ds4c_as_u32(float f) { u32 b; std::memcpy(&b, &f, 4); return b; }
DS4C_DEVICE float ds4c_shfl_xor(float v, int mask) {
  g_blk->fx[t_tid] = v;
  __syncwarp();
  float r = g_blk->fx[(t_tid & ~(DS4C_WAVE - 1)) | ((t_tid & (DS4C_WAVE - 1)) ^ mask)];
  __syncwarp();
  return r;
}
DS4C_DEVICE int ds4c_shfl_xor_i(int v, int mask) { return (int)ds4c_as_u32(ds4c_shfl_xor(ds4c_as_float((u32)v), mask)); }
DS4C_DEVICE float ds4c_exp(float x) { return expf(x); }
DS4C_DEVICE float ds4c_rint(float x) { return rintf(x); }
DS4C_DEVICE float ds4c_log1p(float x) { return log1pf(x); }
DS4C_DEVICE float ds4c_sqrt(float x) { return sqrtf(x); }
DS4C_DEVICE float ds4c_rsqrt(float x) { return 1.0f / sqrtf(x); }
DS4C_DEVICE float ds4c_cos(float x) { return cosf(x); }
DS4C_DEVICE float ds4c_sin(float x) { return sinf(x); }

// ---- mma.sync / cvt emulation from the PTX fragment layouts (groupID g = lane>>2, threadID_in_group t = lane&3)
// (exponent and mantissa placed in fp32 bits: (1 + m / 8) 2^(e - 7) and (1 + m / 1024) 2^(e - 15), the top
// exponent code included, as ldexp gives them; subnormals m 2^-9 and m 2^-24, exact)
static inline float emu_e4m3(u32 b) {
  const u32 e = (b >> 3) & 15u, m = b & 7u;
  const float v = e ? ds4c_as_float(((e + 120u) << 23) | (m << 20)) : (float)m * (1.0f / 512.0f);
  return (b & 0x80u) ? -v : v;
}
static inline float emu_bf16(u32 h) { return ds4c_as_float((h & 0xffffu) << 16); }
static inline float emu_f16(u32 h) {
  const u32 e = (h >> 10) & 31u, m = h & 1023u;
  const float v = e ? ds4c_as_float(((e + 112u) << 23) | (m << 13)) : (float)m * (1.0f / 16777216.0f);
  return (h & 0x8000u) ? -v : v;
}
static inline u32 emu_f16_bits(float f) {  // exact values only (e4m3 values are)
  u32 u = ds4c_as_u32(f), sgn = (u >> 16) & 0x8000u;
  float a = std::fabs(f);
  if (a == 0.0f) return sgn;
  int ex; float mant = std::frexp(a, &ex);  // a = mant * 2^ex, mant in [0.5, 1)
  int e = ex - 1 + 15;
  if (e <= 0) return sgn | (u32)std::lround(a * 16777216.0f);  // subnormal: a / 2^-24
  return sgn | ((u32)e << 10) | ((u32)std::lround((mant * 2.0f - 1.0f) * 1024.0f) & 1023u);
}
DS4C_DEVICE void xp_e4m3x4_f16(u32 v, u32& lo, u32& hi) {
  u32 h[4];
  for (int i = 0; i < 4; ++i) h[i] = emu_f16_bits(emu_e4m3((v >> (8 * i)) & 0xffu));
  lo = h[0] | (h[1] << 16);
  hi = h[2] | (h[3] << 16);
}
DS4C_DEVICE void xp_i8x4_f16(u32 w, u32& lo, u32& hi) {
  u32 h[4];
  for (int i = 0; i < 4; ++i) h[i] = emu_f16_bits((float)(signed char)((w >> (8 * i)) & 0xffu));
  lo = h[0] | (h[1] << 16);
  hi = h[2] | (h[3] << 16);
}
DS4C_DEVICE float xp_h2f(u32 h) { return emu_f16(h & 0xffffu); }
// the end of an emulated m16n8kK: once the warp's lanes placed their fragments in A [16][K] / B [K][8], each lane's 4
// outputs (rows g, g + 8 x columns 2t, 2t + 1) as fp64 sums over k in order, + c, to fp32
template <int K>
static inline void emu_mma_out(float (&d)[4], float (*A)[K], float (*B)[8], float c0, float c1, float c2, float c3) {
  const int lane = t_tid & 31, g = lane >> 2, t = lane & 3;
  __syncwarp();
  const float c[4] = {c0, c1, c2, c3};
  float out[4];
  for (int i = 0; i < 4; ++i) {
    const int row = i < 2 ? g : g + 8, col = t * 2 + (i & 1);
    double s = 0;
    for (int k = 0; k < K; ++k) s += (double)A[row][k] * B[k][col];
    out[i] = (float)(s + c[i]);
  }
  __syncwarp();
  for (int i = 0; i < 4; ++i) d[i] = out[i];
}
// m16n8k16 with 16-bit A/B elements (conv: bits -> float): each lane places its own fragment's elements in the
// warp's A [16][16] / B [16][8], then computes its 4 outputs (fp64 sums over k in order, + c, to fp32)
template <float (*conv)(u32)>
static inline void emu_mma16(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1, float c0, float c1,
                             float c2, float c3) {
  const int lane = t_tid & 31, g = lane >> 2, t = lane & 3;
  float (*A)[16] = g_blk->mA[t_tid >> 5];
  float (*B)[8] = g_blk->mB[t_tid >> 5];
  const u32 ar[4] = {a0, a1, a2, a3}, br[2] = {b0, b1};
  for (int i = 0; i < 8; ++i) {
    const u32 h = (ar[i / 2] >> (16 * (i % 2))) & 0xffffu;
    const int row = (i < 2 || (i >= 4 && i < 6)) ? g : g + 8;
    const int col = (i < 4) ? t * 2 + (i & 1) : t * 2 + (i & 1) + 8;
    A[row][col] = conv(h);
  }
  for (int i = 0; i < 4; ++i) {
    const u32 h = (br[i / 2] >> (16 * (i % 2))) & 0xffffu;
    const int k = (i < 2) ? t * 2 + (i & 1) : t * 2 + (i & 1) + 8;
    B[k][g] = conv(h);
  }
  emu_mma_out<16>(d, A, B, c0, c1, c2, c3);
}
DS4C_DEVICE void xp_mma_f16(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1, float c0, float c1,
                            float c2, float c3) {
  emu_mma16<emu_f16>(d, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3);
}
DS4C_DEVICE void xp_mma_bf16(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1, float c0, float c1,
                             float c2, float c3) {
  emu_mma16<emu_bf16>(d, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3);
}

// m16n8k32 with e4m3 A/B elements (mma.sync ... .f32.e4m3.e4m3.f32, sm_89+): a0 / a1 row g / g + 8, k 4t + i; a2 / a3
// the same rows, k 16 + 4t + i; b0 k 4t + i, b1 k 16 + 4t + i, column g (byte i of each register). The sum over k in
// fp64, + c, to fp32: the exact sum (the hardware's narrower internal accumulation is not modelled)
DS4C_DEVICE void xp_mma_e4m3(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1, float c0, float c1,
                             float c2, float c3) {
  const int lane = t_tid & 31, g = lane >> 2, t = lane & 3;
  float (*A)[32] = g_blk->qA[t_tid >> 5];
  float (*B)[8] = g_blk->qB[t_tid >> 5];
  const u32 ar[4] = {a0, a1, a2, a3}, br[2] = {b0, b1};
  for (int r = 0; r < 4; ++r)
    for (int i = 0; i < 4; ++i)
      A[(r & 1) ? g + 8 : g][(r >> 1) * 16 + 4 * t + i] = emu_e4m3((ar[r] >> (8 * i)) & 0xffu);
  for (int r = 0; r < 2; ++r)
    for (int i = 0; i < 4; ++i) B[r * 16 + 4 * t + i][g] = emu_e4m3((br[r] >> (8 * i)) & 0xffu);
  emu_mma_out<32>(d, A, B, c0, c1, c2, c3);
}

// ldmatrix .x4 (.trans): lane l gives the address of row l % 8 of matrix l / 8 (8 rows of 8 16-bit elements);
// register j of lane l holds matrix j's elements (row l/4, columns 2(l%4), 2(l%4)+1), transposed: (rows 2(l%4),
// 2(l%4)+1, column l/4)
template <bool TRANS>
static inline void emu_ldsm_x4(u32 (&r)[4], const void* p) {
  const int lane = t_tid & 31, w0 = t_tid & ~31;
  g_blk->px[t_tid] = (const u8*)p;
  __syncwarp();
  u32 v[4];
  for (int j = 0; j < 4; ++j) {
    u16 lo, hi;
    if (TRANS) {
      std::memcpy(&lo, g_blk->px[w0 + 8 * j + 2 * (lane & 3)] + 2 * (lane >> 2), 2);
      std::memcpy(&hi, g_blk->px[w0 + 8 * j + 2 * (lane & 3) + 1] + 2 * (lane >> 2), 2);
    } else {
      std::memcpy(&lo, g_blk->px[w0 + 8 * j + (lane >> 2)] + 4 * (lane & 3), 2);
      std::memcpy(&hi, g_blk->px[w0 + 8 * j + (lane >> 2)] + 4 * (lane & 3) + 2, 2);
    }
    v[j] = (u32)lo | ((u32)hi << 16);
  }
  __syncwarp();
  for (int j = 0; j < 4; ++j) r[j] = v[j];
}
DS4C_DEVICE void xp_ldsm_x4(u32 (&r)[4], const void* p) { emu_ldsm_x4<false>(r, p); }
DS4C_DEVICE void xp_ldsm_x4_t(u32 (&r)[4], const void* p) { emu_ldsm_x4<true>(r, p); }

#if defined(DS4C_HIP)
// ---- AMD matrix ops (templates/attention/chunk_hip_matrix.cu.j2's xm_mma) from the ISA's fragment layouts, written
// here apart from the template's xm_a_k / xm_c_row (which the body keeps): wave 64 = v_mfma_f32_16x16x16_bf16 (A
// lane l: row l % 16, k = 4 (l / 16) + e; B: column l % 16, the same k; C: row 4 (l / 16) + e, column l % 16); wave
// 32 = gfx11 v_wmma_f32_16x16x16_bf16 (A lane l: row l % 16, every k, lanes 16..31 repeating 0..15, which the
// emulator checks; B: column l % 16, every k; C: row 2 e + l / 16, column l % 16). Each lane places its fragments
// in the wave's A [16][16] / B [16][16], then computes its C elements (fp64 sums over k in order, + c, to fp32), as
// the mma.sync emulation does.
static inline int emu_xm_k(int lane, int e) { return DS4C_WAVE == 64 ? 4 * (lane >> 4) + e : e; }
static inline int emu_xm_row(int lane, int e) { return DS4C_WAVE == 64 ? 4 * (lane >> 4) + e : 2 * e + (lane >> 4); }
template <int CN, class F>
DS4C_DEVICE void xm_mma(float (&c)[CN], F a, F b) {
  constexpr int AK = DS4C_WAVE == 64 ? 4 : 16;
  static_assert(sizeof(F) == 2 * AK && CN == (DS4C_WAVE == 64 ? 4 : 8), "fragment sizes differ from the ISA's");
  const int lane = ds4c_lane(), w = t_tid / DS4C_WAVE, r = lane & 15;
  float (*A)[16] = g_blk->mA[w];
  float (*B)[16] = g_blk->xB[w];
  bool (*set)[16] = g_blk->xSet[w];
  if (lane == 0) std::memset(set, 0, sizeof(bool) * 256);
  __syncwarp();
  if (lane < 16 || DS4C_WAVE == 64)
    for (int e = 0; e < AK; ++e) {
      const int k = emu_xm_k(lane, e);
      A[r][k] = emu_bf16((u16)a[e]);
      B[k][r] = emu_bf16((u16)b[e]);
      set[r][k] = true;
    }
  __syncwarp();
  if (DS4C_WAVE == 32 && lane >= 16)
    for (int e = 0; e < AK; ++e) {
      const float va = emu_bf16((u16)a[e]), vb = emu_bf16((u16)b[e]);
      if ((va != A[r][e] && !(std::isnan(va) && std::isnan(A[r][e]))) ||
          (vb != B[e][r] && !(std::isnan(vb) && std::isnan(B[e][r])))) {
        fprintf(stderr, "emulator: wmma lane %d's fragment differs from lane %d's (lanes 16..31 repeat 0..15)\n",
                lane, r);
        abort();
      }
    }
  for (int i = 0; i < 16; ++i)
    for (int k = 0; k < 16; ++k)
      if (!set[i][k]) { fprintf(stderr, "emulator: matrix op with A[%d][%d] given by no lane\n", i, k); abort(); }
  float out[CN];
  for (int e = 0; e < CN; ++e) {
    const int row = emu_xm_row(lane, e);
    double acc = 0;
    for (int k = 0; k < 16; ++k) acc += (double)A[row][k] * B[k][r];
    out[e] = (float)(acc + c[e]);
  }
  __syncwarp();
  for (int e = 0; e < CN; ++e) c[e] = out[e];
}
#endif

// ---- wgmma (sm_90a) emulation: computed at its issue (fence / commit / wait are no-ops), from the PTX layouts: A
// m64k16 from the warpgroup's registers (warp w rows 16w .., the m16n8k16 A fragment), B k16 x n64 from shared
// memory through the descriptor (start address >> 4 in bits 0-13, leading byte offset >> 4 in 16-29: between
// core matrices adjacent in K, stride byte offset >> 4 in 32-45: between 8-row groups of n; no swizzle: core
// matrix = 8 rows of n x 16 contiguous bytes of k), D m64n64 fp32 (rows 16w + g (+8) x columns 8j + 2t (+1)).
// Shared addresses: the array the kernel gave xp_smem_u32 (its dynamic shared memory) sits at EMU_SMEM_ADDR, a
// 16-aligned non-zero address, so a descriptor built without that base reads the wrong bytes. The ordering rules are
// checked per thread: a wgmma needs a wgmma.fence since the last wait_group (its A registers are written between), a
// thread ends its block with no group uncommitted or not waited for, and no copy or store lands in the bytes an
// unwaited group reads (emu_wg_check_write; the MMA itself is computed at its issue).
#define EMU_SMEM_ADDR 0x1230u
static const u8* emu_smem0 = nullptr;
static bool emu_wg_fenced[1024];
static int emu_wg_open[1024];                      // wgmma issued since the last commit
static unsigned long long emu_wg_groups[1024];     // commits so far
DS4C_DEVICE u32 xp_smem_u32(const void* p) { emu_smem0 = (const u8*)p; return EMU_SMEM_ADDR; }
DS4C_DEVICE void xp_wg_fence() { emu_wg_fenced[t_tid] = true; }
DS4C_DEVICE void xp_wg_proxy_fence() {}  // one memory on the host
DS4C_DEVICE void xp_wg_commit() { ++emu_wg_groups[t_tid]; emu_wg_open[t_tid] = 0; }
template <int N> DS4C_DEVICE void xp_wg_wait() {  // groups older than the N most recent commits complete
  const unsigned long long n = emu_wg_groups[t_tid], done = n >= (unsigned long long)N ? n - N : 0ull;
  std::vector<EmuWgRead>& v = emu_wg_reads[t_tid];
  size_t k = 0;
  for (size_t i = 0; i < v.size(); ++i)
    if (v[i].group >= done) v[k++] = v[i];
  v.resize(k);
  emu_wg_fenced[t_tid] = false;  // what the thread writes next into its fragments needs a fence before the next wgmma
}
static void emu_wg_check_drained() {
  if (emu_wg_open[t_tid] || !emu_wg_reads[t_tid].empty()) {
    fprintf(stderr, "emulator: thread %d ended its block with wgmma groups not committed or not waited for\n", t_tid);
    abort();
  }
  emu_wg_fenced[t_tid] = false;
}
// a wgmma's issue: the ordering and descriptor checks, one more MMA in the thread's open group
static void emu_wg_issue(u64 desc) {
  if (!emu_wg_fenced[t_tid]) {
    fprintf(stderr, "emulator: thread %d issues a wgmma with no wgmma.fence since its last wait_group\n", t_tid);
    abort();
  }
  if ((desc >> 46) != 0ull || (desc & 0xc000c000ull) != 0ull) {  // base offset and swizzle 0, reserved bits clear
    fprintf(stderr, "emulator: wgmma descriptor %llx: swizzle / base offset / reserved bits set\n", desc);
    abort();
  }
  ++emu_wg_open[t_tid];
}
// the rest of an m64n64kK, once the warpgroup's threads placed their A fragments in A [64][K]: B through the
// descriptor (the read registered for the hazard checks; bval(base, lbo, sbo, n, k) is element (k, n)), each thread's
// 32 outputs as fp64 sums over k in order, + d (acc) or from 0 (scale-d 0), to fp32
template <int K, class BV>
static void emu_wg_product(float (&d)[32], float (*A)[K], u64 desc, bool acc, BV bval) {
  const int wg = t_tid >> 7, w = (t_tid >> 5) & 3, lane = t_tid & 31, g = lane >> 2, t = lane & 3;
  g_blk->gbar[wg]->arrive_and_wait();
  const u8* base = emu_smem0 + (((desc & 0x3fffull) << 4) - EMU_SMEM_ADDR);
  const u64 lbo = ((desc >> 16) & 0x3fffull) << 4, sbo = ((desc >> 32) & 0x3fffull) << 4;
  emu_wg_reads[t_tid].push_back({emu_wg_groups[t_tid], base, base + 7 * sbo + lbo + 128});  // 8 x 2 core matrices
  float out[32];
  for (int j = 0; j < 8; ++j)
    for (int i = 0; i < 4; ++i) {
      const int row = 16 * w + g + (i >= 2 ? 8 : 0), n = 8 * j + 2 * t + (i & 1);
      double s = 0;
      for (int k = 0; k < K; ++k) s += (double)A[row][k] * bval(base, lbo, sbo, n, k);
      out[4 * j + i] = (float)(s + (acc ? d[4 * j + i] : 0.0f));
    }
  g_blk->gbar[wg]->arrive_and_wait();
  for (int i = 0; i < 32; ++i) d[i] = out[i];
}
DS4C_DEVICE void xp_wg_m64n64k16(float (&d)[32], u32 a0, u32 a1, u32 a2, u32 a3, u64 desc) {
  const int wg = t_tid >> 7, w = (t_tid >> 5) & 3, lane = t_tid & 31, g = lane >> 2, t = lane & 3;
  emu_wg_issue(desc);
  float (*A)[16] = g_blk->wgA[wg];
  const u32 ar[4] = {a0, a1, a2, a3};
  for (int i = 0; i < 8; ++i) {
    const u32 h = (ar[i / 2] >> (16 * (i % 2))) & 0xffffu;
    const int row = 16 * w + ((i < 2 || (i >= 4 && i < 6)) ? g : g + 8);
    const int col = (i < 4) ? t * 2 + (i & 1) : t * 2 + (i & 1) + 8;
    A[row][col] = emu_bf16(h);
  }
  emu_wg_product<16>(d, A, desc, true, [](const u8* base, u64 lbo, u64 sbo, int n, int k) {
    u16 b;
    std::memcpy(&b, base + (n >> 3) * sbo + (k >> 3) * lbo + (n & 7) * 16 + (k & 7) * 2, 2);
    return emu_bf16(b);
  });
}
// the FP8 form, m64n64k32 e4m3 x e4m3 (A from registers: warp w rows 16w .., the mma.sync m16n8k32 A fragment; B k32 x
// n64 e4m3 codes from shared memory, core matrices of 8 rows of n x 16 bytes of k); acc 0: D = A . B (scale-d 0), else
// D += A . B. The k sum in fp64 to fp32 (the tensor core's narrower FP8 accumulation is not modelled)
DS4C_DEVICE void xp_wg8_m64n64k32(float (&d)[32], u32 a0, u32 a1, u32 a2, u32 a3, u64 desc, int acc) {
  const int wg = t_tid >> 7, w = (t_tid >> 5) & 3, lane = t_tid & 31, g = lane >> 2, t = lane & 3;
  emu_wg_issue(desc);
  float (*A)[32] = g_blk->wgA8[wg];
  const u32 ar[4] = {a0, a1, a2, a3};
  for (int r = 0; r < 4; ++r)
    for (int i = 0; i < 4; ++i)
      A[16 * w + ((r & 1) ? g + 8 : g)][(r >> 1) * 16 + 4 * t + i] = emu_e4m3((ar[r] >> (8 * i)) & 0xffu);
  emu_wg_product<32>(d, A, desc, acc != 0, [](const u8* base, u64 lbo, u64 sbo, int n, int k) {
    return emu_e4m3(base[(n >> 3) * sbo + (k >> 4) * lbo + (n & 7) * 16 + (k & 15)]);
  });
}
static inline u32 emu_bf16_bits(float f) {  // round to nearest even (finite values)
  const u32 u = ds4c_as_u32(f);
  return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}
DS4C_DEVICE u32 xp_bmul2(u32 a, u32 b) {  // mul.rn.bf16x2 (subnormals kept, as on sm_90)
  return emu_bf16_bits(emu_bf16(a) * emu_bf16(b)) | (emu_bf16_bits(emu_bf16(a >> 16) * emu_bf16(b >> 16)) << 16);
}

template <class K>
static void run_grid(int gx, int gy, int nt, const K& kernel) {  // the grid's blocks one after another
  EmuBlock blk;
  EmuBarrier bar(nt);
  blk.bar = &bar;
  std::vector<EmuBarrier> wb(nt / DS4C_WAVE, EmuBarrier(DS4C_WAVE));
  for (int w = 0; w < nt / DS4C_WAVE; ++w) blk.wbar[w] = &wb[w];
  std::vector<EmuBarrier> gb((nt + 127) / 128, EmuBarrier(nt < 128 ? nt : 128));
  for (int w = 0; w < (nt + 127) / 128; ++w) blk.gbar[w] = &gb[w];
  g_blk = &blk;
  t_nbx = gx;
  auto body = [&](int) {
    for (int by = 0; by < gy; ++by)
      for (int bx = 0; bx < gx; ++bx) {
        t_bx = bx; t_by = by;
        kernel();
        emu_cp_check_drained();
        emu_wg_check_drained();
        bar.arrive_and_wait();
      }
  };
  emu_run_fibers(nt, body);
}
static std::vector<u8> load(const char* dir, const char* name) {
  char p[4096];
  snprintf(p, sizeof p, "%s/%s", dir, name);
  FILE* f = fopen(p, "rb");
  if (!f) { fprintf(stderr, "cannot open %s\n", p); exit(2); }
  fseek(f, 0, SEEK_END); long n = ftell(f); fseek(f, 0, SEEK_SET);
  std::vector<u8> b(n + 64);
  if (fread(b.data(), 1, n, f) != (size_t)n) exit(3);
  fclose(f);
  return b;
}
static void save(const char* dir, const char* name, const void* p, size_t n) {
  char s[4096];
  snprintf(s, sizeof s, "%s/%s", dir, name);
  FILE* f = fopen(s, "wb");
  fwrite(p, 1, n, f);
  fclose(f);
}
"""


def host_body(src: Any) -> str:
    """The rendered CUDA source without the CUDA prelude and the inline-PTX MMA helpers."""
    from ds4c.runtime.render import TEMPLATE_DIR

    text = src.source
    vendor = src.target.vendor
    prelude = (TEMPLATE_DIR / "prelude" / f"{vendor}.h.j2").read_text().replace("{{ wave }}", str(src.target.wave))
    if prelude not in text:
        raise RuntimeError(f"experts_emu: the rendered source does not start with the {vendor} prelude")
    text = text.replace(prelude, "", 1)
    for head in ("// ---- mma.sync helpers (inline PTX", "// ---- matrix helpers (AMDGPU builtins"):
        a = text.find(head)
        if a >= 0:
            b = text.index("// ---- shape and format parameters", a)
            text = text[:a] + text[b:]
    return text


def vendor_defines(target: Any) -> str:
    """What a host program around ``target``'s kernel bodies defines before the host prelude: nothing for CUDA (the
    prelude's defaults: DS4C_CUDA, 32-lane warps); for HIP, DS4C_HIP and the target's wave (32 or 64)."""
    return "" if target.vendor == "cuda" else f"#define DS4C_HIP 1\n#define DS4C_WAVE {target.wave}\n"


#: C expressions of every kernel argument the emulator's main() binds (arg_names of experts.py)
_ARG_EXPR = {"x": "(const u16*)x.data()", "ids": "(const i64*)ids.data()", "weights": "(const float*)wts.data()",
             "w1": "w1.data()", "w3": "w3.data()", "w2": "w2.data()", "sh_w1": "s1.data()", "sh_w3": "s3.data()",
             "sh_w2": "s2.data()", "hbuf": "h.data()", "out": "out.data()", "xq": "xq.data()", "xs": "xs.data()",
             "hq": "hq.data()", "hs": "hs.data()", "ybuf": "yb.data()"}


def build(spec: X.ExpertsSpec, workdir: Path, arch: str = "sm_90") -> Path:
    """Compile the emulator of ``spec`` (every kernel of the call, :func:`experts.kernel_names`) into
    ``workdir/emu``; returns the executable. The activation quant kernels of a prequant call (templates/actq) keep
    their block reduction in a function-local shared array: there ``DS4C_SHARED`` is ``static`` (one array for
    the block's fibers)."""
    tgt = make_target(arch)
    srcs = X.render_experts(spec, tgt, "emu")
    launches = X.launch_shapes(spec, tgt)
    names = X.arg_names(spec, tgt)
    q, k, D, F = spec.q, spec.k, spec.hidden, spec.inter
    spaces, calls = [], []
    for i, (src, la) in enumerate(zip(srcs, launches)):
        local_shared = la.kernel.startswith("actq_")
        body = host_body(src)
        if local_shared:
            body = "#undef DS4C_SHARED\n#define DS4C_SHARED static\n" + body + "\n#undef DS4C_SHARED\n#define DS4C_SHARED\n"
        spaces.append(f"namespace k{i}_ns {{\n{body}\nalignas(16) u8 xp_smem[{la.smem} + 64];\n}}\n")
        args = ", ".join(_ARG_EXPR[n] for n in names[la.kernel])
        calls.append(f"  run_grid({la.grid[0]}, {la.grid[1]}, {la.block[0]}, [&] {{ k{i}_ns::{src.entry}({args}); }});\n")
    main = "".join(spaces) + f"""
int main(int argc, char** argv) {{
  const char* d = argv[1];
  auto x = load(d, "x"), ids = load(d, "ids"), wts = load(d, "weights"), w1 = load(d, "w1"), w3 = load(d, "w3"),
       w2 = load(d, "w2"), s1 = load(d, "sh_w1"), s3 = load(d, "sh_w3"), s2 = load(d, "sh_w2");
  std::vector<u16> h({q} * ({k} + 1) * {F}, 0x7fc1), out({q} * {D}, 0x7fc1);
  std::vector<u16> xq({q} * {D}, 0x7e01), hq({q} * ({k} + 1) * {F}, 0x7e01);  // f16 NaN poison
  std::vector<float> xs({q} * ({D} / 128), NAN), hs({q} * ({k} + 1) * ({F} / 128), NAN);
  std::vector<u16> yb({q} * ({k} + 1) * {D}, 0x7fc1);  // down_split's y_e per slot
  (void)xq; (void)hq; (void)xs; (void)hs; (void)yb;
{"".join(calls)}  save(d, "hbuf", h.data(), h.size() * 2);
  save(d, "out", out.data(), out.size() * 2);
  save(d, "xq", xq.data(), xq.size() * 2);
  save(d, "xs", xs.data(), xs.size() * 4);
  return 0;
}}
"""
    return compile_host(main, workdir, "experts_emu")


def host_cxx() -> str | None:
    """The host C++ compiler the emulators build with (g++, else clang++), or None."""
    return shutil.which("g++") or shutil.which("clang++-19") or shutil.which("clang++")


#: the emulators' host build: on x86-64 without CET branch protection, whose shadow stack would refuse the fibers'
#: stack switch (FIBERS' emu_switch) where the kernel and glibc enforce it
HOST_FLAGS = ("-std=c++20", "-O1", "-w") + (("-fcf-protection=none",) if platform.machine() in ("x86_64", "AMD64")
                                             else ())


@functools.lru_cache(maxsize=None)
def _cxx_identity(cxx: str) -> str:
    """The compiler's path and ``--version`` banner: part of every cached program's key."""
    p = subprocess.run([cxx, "--version"], capture_output=True, text=True)
    return f"{cxx}\n{p.stdout}"


def _program_cache() -> Path | None:
    """Where compiled emulator programs are kept by content (``$DS4C_EMU_CACHE``, default a per-user folder under the
    system temp dir; ``0`` or empty: none). Tests that emulate the same kernels with other inputs, and runs after the
    first, reuse a program instead of compiling it again (~1 s each). The folder must be this user's and writable by
    no one else (its programs are run): else no cache."""
    v = os.environ.get("DS4C_EMU_CACHE")
    if v in ("", "0"):
        return None
    d = Path(v) if v is not None else Path(tempfile.gettempdir()) / f"ds4c-emu-cache-{os.getuid()}"
    try:
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = d.stat()
    except OSError:
        return None
    return d if st.st_uid == os.getuid() and not st.st_mode & 0o022 else None


@functools.lru_cache(maxsize=None)
def host_unavailable() -> str | None:
    """Why the emulators cannot run here (no host C++ compiler, or no C++20 mode or ``<ucontext.h>``, which the
    fibers need), or None: the skip reason of the tests that emulate kernels."""
    cxx = host_cxx()
    if not cxx:
        return "no host C++ compiler"
    p = subprocess.run([cxx, "-std=c++20", "-x", "c++", "-fsyntax-only", "-"], input="#include <ucontext.h>\n",
                       capture_output=True, text=True)
    return None if p.returncode == 0 else f"{cxx} lacks C++20 or <ucontext.h> (the emulators' fibers)"


def compile_host(main: str, workdir: Path, who: str, defines: str = "") -> Path:
    """Compile ``defines + HOST_PRELUDE + main`` (a host program built around rendered kernel bodies; ``defines``:
    :func:`vendor_defines`) into ``workdir/emu`` with the host C++20 compiler. ``who`` names the emulator in errors.

    Raises:
        RuntimeError: no g++ / clang++, or the compile failed (its log attached)."""
    workdir.mkdir(parents=True, exist_ok=True)
    text = defines + HOST_PRELUDE + main
    (workdir / "emu.cpp").write_text(text)
    cxx = host_cxx()
    if not cxx:
        raise RuntimeError(f"{who}: no host C++ compiler (g++ / clang++)")
    exe, cache = workdir / "emu", _program_cache()
    key = hashlib.sha256(f"{_cxx_identity(cxx)}\n{HOST_FLAGS}\n{text}".encode()).hexdigest()
    hit = cache / key[:2] / key if cache is not None else None
    if hit is not None:
        try:
            shutil.copy2(hit, exe)
            return exe
        except OSError:
            pass  # not cached (or removed meanwhile): compile
    p = subprocess.run([cxx, *HOST_FLAGS, "-o", "emu", "emu.cpp"], cwd=workdir, capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"{who}: host compile failed:\n{p.stdout}{p.stderr[-6000:]}")
    if hit is not None:  # published whole (a private temp copy, then an atomic rename): a reader sees none or all of it
        try:
            hit.parent.mkdir(mode=0o700, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=hit.parent, prefix=f"{key}.", suffix=".tmp")
            os.close(fd)
            shutil.copy2(exe, tmp)
            os.replace(tmp, hit)
        except OSError:
            pass  # a cache that cannot be written only costs the next compile
    return exe


def run_host(exe: Path, workdir: Path, inputs: dict[str, torch.Tensor], who: str, timeout: int = 3600) -> None:
    """Write each input tensor's raw bytes to ``workdir/<name>`` and run ``exe workdir`` (it writes its outputs
    there).

    Raises:
        RuntimeError: the program failed (its output attached)."""
    for name, t in inputs.items():
        (workdir / name).write_bytes(t.contiguous().cpu().view(torch.uint8).numpy().tobytes())
    p = subprocess.run([str(exe), str(workdir)], capture_output=True, text=True, timeout=timeout)
    if p.returncode:
        raise RuntimeError(f"{who}: run failed ({p.returncode}):\n{p.stdout}{p.stderr}")


def run(spec: X.ExpertsSpec, inputs: dict[str, torch.Tensor], workdir: Path, arch: str = "sm_90",
        exe: Path | None = None) -> dict[str, torch.Tensor]:
    """Emulate one call on CPU ``inputs`` (:func:`ds4c.runtime.families.experts.random_inputs` names).
    Returns ``{"out": bf16 [q, D], "hbuf": bf16 [q, k+1, F], "xq": f16 [q, D], "xs": fp32 [q, D/128]}`` (the
    last two: a prequant call's quantized x, else their NaN poison)."""
    run_host(exe or build(spec, workdir, arch), workdir, inputs, "experts_emu")

    def rd(name: str, shape: tuple) -> torch.Tensor:
        a = np.frombuffer((workdir / name).read_bytes(), dtype=np.int16).copy()
        return torch.from_numpy(a).view(torch.bfloat16).view(shape)

    out = {"out": rd("out", (spec.q, spec.hidden)), "hbuf": rd("hbuf", (spec.q, spec.k + 1, spec.inter))}
    out["xq"] = torch.from_numpy(np.frombuffer((workdir / "xq").read_bytes(), dtype=np.float16).copy()).view(
        spec.q, spec.hidden)
    out["xs"] = torch.from_numpy(np.frombuffer((workdir / "xs").read_bytes(), dtype=np.float32).copy()).view(
        spec.q, spec.hidden // 128)
    return out


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    g, w = got.float(), want.float()
    if not torch.isfinite(g).all():
        return float("inf")
    return float((g - w).norm() / w.norm().clamp(min=1e-30))


def main() -> int:
    import time

    cases = [dict(q=1, hidden=256, inter=128, k=4, n_experts=16), dict(q=5, hidden=256, inter=128, k=4, n_experts=16),
             dict(q=5, hidden=1024, inter=2048, k=6, n_experts=12), dict(q=3, hidden=4096, inter=256, k=6, n_experts=8)]
    ok = True
    for c in cases:
        for eng in ("mma", "simt"):
            spec = X.ExpertsSpec(**c, engine=eng)
            g = torch.Generator().manual_seed(1)
            inp = X.random_inputs(spec, g)
            t0 = time.perf_counter()
            with tempfile.TemporaryDirectory() as d:
                got = run(spec, inp, Path(d))
            t1 = time.perf_counter()
            want = X.reference(spec, **inp)
            e = rel_err(got["out"], want)
            ok &= e < 2e-2
            print(f"{spec.short():60s} {eng:5s} rel_err {e:.2e}  {t1 - t0:.1f} s", flush=True)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
