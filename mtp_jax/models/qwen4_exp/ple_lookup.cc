// qwen4_exp PLE n-gram rows looked up on the host without blocking the thread that launches
// the program (ple_native.py beside it builds, loads and documents this file).
//
// jax.pure_callback makes XLA's launching thread wait for the device to reach the callback and
// launch the rest of the program only after it returns, so the device idles for that launch.
// The CUDA handler here only enqueues, on the program's stream: a copy of the ids to pinned
// host memory, a host function (cuLaunchHostFunc) that hashes them and gathers the rows from
// the tables, and a copy of the rows back. The launching thread goes on at once; the stream
// waits for the host function alone.
//
// The hash is the one of mtp_jax/models/qwen4_exp/ple.py (ngram_ids, shifted_tokens), in
// int64 arithmetic that wraps as numpy's does; the rows are converted as NgramTable.lookup
// converts them (stored dtype -> out dtype, round to nearest even) and then to float32.
// Tables are the caller's memory (memory-mapped checkpoint files or a host array): Python
// keeps them alive while the source is registered (mtp_ple_unregister drops it).

#include <dlfcn.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

enum Dtype : int32_t { kF32 = 0, kBF16 = 1, kF16 = 2 };

struct Layer {
  std::vector<int64_t> multipliers;  // [N]
  std::vector<int64_t> vocab;        // [(N-1) * heads]
  std::vector<int64_t> offsets;      // [(N-1) * heads]
  std::vector<const uint8_t*> parts;
  std::vector<int64_t> part_starts;  // first row of each part
};

struct Source {
  int32_t ngram_size = 0, heads = 0, row_dim = 0, stored = kF32, out = kF32;
  int64_t eos = 0;
  std::vector<Layer> layers;
  // pinned staging of the CUDA handler: [contexts | ids | rows]; grown, never shrunk.
  void* pinned = nullptr;
  size_t pinned_bytes = 0;
  void* last_stream = nullptr;
  std::mutex mu;
};

std::mutex g_mu;
std::unordered_map<int64_t, std::shared_ptr<Source>> g_sources;
std::vector<void*> g_retired;  // outgrown staging: an enqueued copy may still use it

std::shared_ptr<Source> find(int64_t id) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_sources.find(id);
  return it == g_sources.end() ? nullptr : it->second;
}

float half_to_float(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    int e = -1;
    do { ++e; man <<= 1; } while ((man & 0x400u) == 0);
    bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

float stored_value(const uint8_t* row, int32_t dtype, int64_t i) {
  if (dtype == kF32) {
    float f;
    std::memcpy(&f, row + 4 * i, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, row + 2 * i, 2);
  if (dtype == kF16) return half_to_float(h);
  uint32_t bits = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t float_to_half(float f) {  // round to nearest even, as numpy's astype(float16)
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u);
  if (ax >= 0x477ff000u) return sign | 0x7c00u;  // from 65520 up: infinity
  if (ax < 0x38800000u) {  // below 2^-14: a subnormal half, m * 2^-24 (2^24 scales exactly)
    float a;
    std::memcpy(&a, &ax, 4);
    return sign | (uint16_t)std::nearbyint(a * 16777216.0f);
  }
  uint32_t h = (((ax >> 23) - 112) << 10) | ((ax & 0x7fffffu) >> 13);
  const uint32_t rest = ax & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // a carry moves the exponent
  return sign | h;
}

float round_to(float f, int32_t dtype) {  // f32 -> the out dtype (nearest even) -> f32
  if (dtype == kF16) return half_to_float(float_to_half(f));
  if (dtype != kBF16 || std::isnan(f)) return f;
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  bits &= 0xffff0000u;
  std::memcpy(&f, &bits, 4);
  return f;
}

int64_t py_mod(int64_t a, int64_t m) {
  int64_t r = a % m;
  return r < 0 ? r + m : r;
}

// rows [B, T, n_layers * (N-1) * heads * row_dim] of ids [B, T] after contexts [B, N-1].
void lookup(const Source& s, const int32_t* ctx, const int32_t* ids, int64_t B, int64_t T,
            float* out) {
  const int64_t n = s.ngram_size, c = n - 1, heads = c * s.heads, len = c + T;
  const int64_t width = (int64_t)s.layers.size() * heads * s.row_dim;
  const int64_t elem = s.stored == kF32 ? 4 : 2;
  std::vector<int64_t> hist(len), prev(len);
  std::vector<uint64_t> acc(n);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < c; ++i) hist[i] = ctx[b * c + i];
    for (int64_t t = 0; t < T; ++t) hist[c + t] = ids[b * T + t];
    int64_t last = -1;  // the last eos strictly before each position
    for (int64_t p = 0; p < len; ++p) {
      prev[p] = last;
      if (hist[p] == s.eos) last = p;
    }
    for (int64_t t = 0; t < T; ++t) {
      const int64_t pos = c + t;
      float* o = out + (b * T + t) * width;
      for (const Layer& L : s.layers) {
        uint64_t x = 0;  // acc[s]: XOR of the first s + 1 shifted products
        for (int64_t sh = 0; sh < n; ++sh) {
          const bool inside = pos - sh >= 0 && pos - (prev[pos] + 1) >= sh;
          const int64_t tok = inside ? hist[pos - sh] : s.eos;
          x ^= (uint64_t)tok * (uint64_t)L.multipliers[sh];
          acc[sh] = x;
        }
        for (int64_t h = 0; h < heads; ++h) {
          const int64_t mixed = (int64_t)acc[1 + h / s.heads];
          const int64_t row = py_mod(mixed, L.vocab[h]) + L.offsets[h];
          size_t part = L.part_starts.size() - 1;
          while (part > 0 && L.part_starts[part] > row) --part;
          const uint8_t* src = L.parts[part] + (row - L.part_starts[part]) * s.row_dim * elem;
          for (int64_t v = 0; v < s.row_dim; ++v)
            *o++ = round_to(stored_value(src, s.stored, v), s.out);
        }
      }
    }
  }
}

// ---- the CUDA driver, opened at first use (no CUDA headers or link-time library) ----------
using CUresult = int;
struct Driver {
  CUresult (*dtoh)(void*, uint64_t, size_t, void*) = nullptr;
  CUresult (*htod)(uint64_t, const void*, size_t, void*) = nullptr;
  CUresult (*host_func)(void*, void (*)(void*), void*) = nullptr;
  CUresult (*host_alloc)(void**, size_t, unsigned) = nullptr;
  CUresult (*sync)(void*) = nullptr;
  std::string error;
};

const Driver& driver() {
  static Driver d = [] {
    Driver r;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!lib) {
      r.error = "libcuda.so.1 could not be opened";
      return r;
    }
    r.dtoh = (decltype(r.dtoh))dlsym(lib, "cuMemcpyDtoHAsync_v2");
    r.htod = (decltype(r.htod))dlsym(lib, "cuMemcpyHtoDAsync_v2");
    r.host_func = (decltype(r.host_func))dlsym(lib, "cuLaunchHostFunc");
    r.host_alloc = (decltype(r.host_alloc))dlsym(lib, "cuMemHostAlloc");
    r.sync = (decltype(r.sync))dlsym(lib, "cuStreamSynchronize");
    if (!r.dtoh || !r.htod || !r.host_func || !r.host_alloc || !r.sync)
      r.error = "libcuda.so.1 lacks a function this lookup needs";
    return r;
  }();
  return d;
}

struct Job {
  std::shared_ptr<Source> source;
  const int32_t* ctx;
  const int32_t* ids;
  float* rows;
  int64_t B, T;
};

void run_job(void* p) {  // on CUDA's host-function thread: no CUDA calls here
  std::unique_ptr<Job> job(static_cast<Job*>(p));
  lookup(*job->source, job->ctx, job->ids, job->B, job->T, job->rows);
}

ffi::Error check(CUresult r, const char* what) {
  if (r == 0) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kInternal,
                    std::string("PLE lookup: ") + what + " failed with CUDA error " +
                        std::to_string(r));
}

ffi::Error shapes(const std::shared_ptr<Source>& s, int64_t id, ffi::AnyBuffer ctx,
                  ffi::AnyBuffer ids, ffi::Result<ffi::AnyBuffer> rows) {
  if (!s)
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "PLE lookup: source " + std::to_string(id) +
                          " has no live tables (its model was dropped; keep the loaded "
                          "model alive while its programs run)");
  const auto d = ids.dimensions();
  const int64_t B = d.size() == 2 ? d[0] : -1, T = d.size() == 2 ? d[1] : -1;
  const int64_t width =
      (int64_t)s->layers.size() * (s->ngram_size - 1) * s->heads * s->row_dim;
  if (ctx.element_type() != ffi::S32 || ids.element_type() != ffi::S32 ||
      rows->element_type() != ffi::F32 || B < 0 ||
      (int64_t)ctx.element_count() != B * (s->ngram_size - 1) ||
      (int64_t)rows->element_count() != B * T * width)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "PLE lookup: contexts [B, N-1] and ids [B, T] int32 and rows "
                      "[B, T, width] float32 expected");
  return ffi::Error::Success();
}

ffi::Error lookup_cpu(ffi::AnyBuffer ctx, ffi::AnyBuffer ids, ffi::Result<ffi::AnyBuffer> rows,
                      int64_t source) {
  auto s = find(source);
  if (auto e = shapes(s, source, ctx, ids, rows); e.failure()) return e;
  lookup(*s, static_cast<const int32_t*>(ctx.untyped_data()),
         static_cast<const int32_t*>(ids.untyped_data()), ids.dimensions()[0],
         ids.dimensions()[1], static_cast<float*>(rows->untyped_data()));
  return ffi::Error::Success();
}

ffi::Error lookup_cuda(void* stream, ffi::AnyBuffer ctx, ffi::AnyBuffer ids,
                       ffi::Result<ffi::AnyBuffer> rows, int64_t source) {
  auto s = find(source);
  if (auto e = shapes(s, source, ctx, ids, rows); e.failure()) return e;
  const Driver& cu = driver();
  if (!cu.error.empty()) return ffi::Error(ffi::ErrorCode::kInternal, cu.error);
  const size_t cb = ctx.size_bytes(), ib = ids.size_bytes(), rb = rows->size_bytes();
  std::lock_guard<std::mutex> lock(s->mu);
  if (s->last_stream && s->last_stream != stream) {  // staging is ordered by one stream
    if (auto e = check(cu.sync(s->last_stream), "cuStreamSynchronize"); e.failure()) return e;
  }
  s->last_stream = stream;
  const size_t need = ((cb + ib + 15) / 16) * 16 + rb;
  if (s->pinned_bytes < need) {
    void* p = nullptr;
    const size_t bytes = need < (1u << 20) ? (1u << 20) : need * 2;
    if (auto e = check(cu.host_alloc(&p, bytes, 0), "cuMemHostAlloc"); e.failure()) return e;
    if (s->pinned) {
      std::lock_guard<std::mutex> g(g_mu);
      g_retired.push_back(s->pinned);
    }
    s->pinned = p;
    s->pinned_bytes = bytes;
  }
  auto* base = static_cast<uint8_t*>(s->pinned);
  auto* hctx = reinterpret_cast<int32_t*>(base);
  auto* hids = reinterpret_cast<int32_t*>(base + cb);
  auto* hrows = reinterpret_cast<float*>(base + ((cb + ib + 15) / 16) * 16);
  if (cb) {
    auto e = check(cu.dtoh(hctx, (uint64_t)ctx.untyped_data(), cb, stream), "copy to host");
    if (e.failure()) return e;
  }
  if (ib) {
    auto e = check(cu.dtoh(hids, (uint64_t)ids.untyped_data(), ib, stream), "copy to host");
    if (e.failure()) return e;
  }
  auto* job = new Job{s, hctx, hids, hrows, ids.dimensions()[0], ids.dimensions()[1]};
  if (auto e = check(cu.host_func(stream, run_job, job), "cuLaunchHostFunc"); e.failure()) {
    delete job;
    return e;
  }
  if (rb) return check(cu.htod((uint64_t)rows->untyped_data(), hrows, rb, stream), "copy back");
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MtpPleLookupCpu, lookup_cpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("source"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(MtpPleLookupCuda, lookup_cuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void*>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("source"));

extern "C" {

// A source's hash constants and tables. multipliers [L * N], vocab and offsets
// [L * (N-1) * heads]; parts: per layer `parts_per_layer[j]` entries of part_ptrs (row-major
// [rows, row_dim] tables of the stored dtype) and part_starts (first row of each part).
// Returns 0, or -1 for a dtype code or a constant out of range (the caller keeps its own).
int mtp_ple_register(int64_t source, int32_t ngram_size, int32_t heads, int64_t eos,
                     int32_t row_dim, int32_t stored, int32_t out, int32_t n_layers,
                     const int64_t* multipliers, const int64_t* vocab, const int64_t* offsets,
                     const int32_t* parts_per_layer, const uint64_t* part_ptrs,
                     const int64_t* part_starts) {
  const bool ok = stored >= kF32 && stored <= kF16 && out >= kF32 && out <= kF16;
  if (!ok || ngram_size < 2 || heads < 1 || row_dim < 1 || n_layers < 1) return -1;
  auto s = std::make_shared<Source>();
  s->ngram_size = ngram_size;
  s->heads = heads;
  s->eos = eos;
  s->row_dim = row_dim;
  s->stored = stored;
  s->out = out;
  const int64_t hn = (int64_t)(ngram_size - 1) * heads;
  int64_t p = 0;
  for (int32_t j = 0; j < n_layers; ++j) {
    Layer L;
    L.multipliers.assign(multipliers + j * ngram_size, multipliers + (j + 1) * ngram_size);
    L.vocab.assign(vocab + j * hn, vocab + (j + 1) * hn);
    L.offsets.assign(offsets + j * hn, offsets + (j + 1) * hn);
    for (int32_t k = 0; k < parts_per_layer[j]; ++k, ++p) {
      L.parts.push_back(reinterpret_cast<const uint8_t*>(part_ptrs[p]));
      L.part_starts.push_back(part_starts[p]);
    }
    s->layers.push_back(std::move(L));
  }
  std::lock_guard<std::mutex> lock(g_mu);
  g_sources[source] = std::move(s);
  return 0;
}

void mtp_ple_unregister(int64_t source) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_sources.erase(source);
}

// The lookup itself on host buffers (tests compare it with the numpy path). 0, or -1 when the
// source is not registered.
int mtp_ple_lookup_host(int64_t source, const int32_t* ctx, const int32_t* ids, int64_t B,
                        int64_t T, float* rows) {
  auto s = find(source);
  if (!s) return -1;
  lookup(*s, ctx, ids, B, T, rows);
  return 0;
}

}  // extern "C"
