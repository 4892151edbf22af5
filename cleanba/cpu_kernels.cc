// The IMPALA ResNet's convolutions and max-pool gradient for XLA:CPU, as custom calls (cleanba/xla_cpu.py builds
// and registers them). Three kernels:
//
// CleanbaConv: a stride-1 NHWC x HWIO convolution, used for the forward pass and for the input gradient (the
// convolution of dy by the flipped, transposed kernel). Each output pixel is summed over taps and input channels
// in one fixed order, in register tiles of up to 28 pixels x 16 output channels or 12 x 32.
//
// CleanbaConvWeightGradient: the weight gradient of the same convolution,
//
//   dk[i][j][c][o] = sum over n, oh, ow of x[n][oh + i - lo_h][ow + j - lo_w][c] * dy[n][oh][ow][o]
//
// (x read as zero outside its bounds). XLA:CPU computes this as an Eigen convolution whose kernel is the whole batch
// and image and whose output is only KH x KW x CI x CO: Eigen runs it on one thread, after transposing x and dy
// into a batch-innermost layout. Here it reads x and dy as they are, on every core. The batch is cut into blocks
// whose size depends only on the shapes, each block sums into its own partial (a fixed loop order, per-lane float32
// accumulators), and the partials are added in block order.
//
// CleanbaMaxPoolGradient: the gradient of a 3x3, stride-2, SAME max pool (flax's nn.max_pool), bitwise XLA's
// select_and_scatter: each window's gradient goes to its first maximum in row-major order, and a position's shares
// are added to zero in row-major window order. XLA:CPU's select_and_scatter is slow, and the same routing written
// in jax.numpy (max_pool in xla_cpu.py) recomputes every window's maximum for each of its positions.
//
// All three are deterministic whatever the number of threads (every sum runs in an order fixed by the shapes) and
// run on XLA:CPU's own intra-op threads. The convolutions differ from XLA's in the last bits (another summation
// order), never between runs.
//
// The tiles' inner loops carry `#pragma GCC unroll`: without it GCC 12 kept the forward tile's accumulators in
// memory, with a load and a store around every multiply-add (half the speed on 16 output channels).
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// One vector register of float32, and how many of them: the tiles below keep their accumulators in registers (on
// an AVX2 machine, AVX-512-sized tiles spilled them to memory and ran 10x slower than XLA's own convolutions). The
// lane count and tiles change no result: each output's sum runs in the same order whatever the tile.
#ifdef __AVX512F__
constexpr int kLanes = 16, kRegisters = 32;
#else
constexpr int kLanes = 8, kRegisters = 16;  // AVX2 (GCC splits the vectors further on older machines)
#endif
constexpr int kAccumulators = kRegisters * 3 / 4;  // the rest: the loaded vectors and a broadcast input
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));

struct Shape {
  int64_t n, h, w, ci;  // x
  int64_t oh, ow, co;   // dy
  int64_t kh, kw, lo_h, lo_w;
  int64_t ph, pw;  // padded x: every tap of every output position in range
  int64_t cop;     // co rounded up to whole vectors
};

// Samples per block: what keeps a block's padded x and packed dy near 1 MiB (in a core's L2 while every tap and
// channel tile passes over it). Depends on the shapes only.
int64_t BlockSize(const Shape& s) {
  // dy's channels counted as 16-lane vectors whatever kLanes is: the blocks, and so the order in which their
  // partials are added, do not depend on the machine's vector width.
  int64_t bytes = (s.ph * s.pw * s.ci + s.oh * s.ow * ((s.co + 15) / 16 * 16)) * int64_t(sizeof(float));
  return std::clamp<int64_t>((int64_t(1) << 20) / std::max<int64_t>(bytes, 1), 1, s.n);
}

// Accumulates taps (i, j0..j0+KT-1) x channels [c0, c0 + CT) x vectors [v0, v0 + NV) of one block into out.
template <int CT, int NV, int KT>
void Tile(const Shape& s, const float* xp, const float* dp, int64_t samples, int64_t i, int64_t j0, int64_t c0,
          int64_t v0, float* out) {
  Vec acc[KT][CT][NV];
  for (auto& a : acc)
    for (auto& b : a)
      for (auto& v : b) v = Vec{};
  for (int64_t n = 0; n < samples; ++n) {
    for (int64_t r = 0; r < s.oh; ++r) {
      const float* xrow = xp + ((n * s.ph + r + i) * s.pw + j0) * s.ci + c0;
      const float* drow = dp + ((n * s.oh + r) * s.ow) * s.cop + v0 * kLanes;
      for (int64_t q = 0; q < s.ow; ++q) {
        Vec d[NV];
#pragma GCC unroll 2
        for (int v = 0; v < NV; ++v) std::memcpy(&d[v], drow + q * s.cop + v * kLanes, sizeof(Vec));
#pragma GCC unroll 3
        for (int j = 0; j < KT; ++j) {
          const float* xv = xrow + (q + j) * s.ci;
#pragma GCC unroll 8
          for (int c = 0; c < CT; ++c)
#pragma GCC unroll 2
            for (int v = 0; v < NV; ++v) acc[j][c][v] += xv[c] * d[v];
        }
      }
    }
  }
  for (int j = 0; j < KT; ++j)
    for (int c = 0; c < CT; ++c)
      for (int v = 0; v < NV; ++v) {
        float lanes[kLanes];
        std::memcpy(lanes, &acc[j][c][v], sizeof(Vec));
        int64_t o0 = (v0 + v) * kLanes;
        float* dst = out + ((i * s.kw + j0 + j) * s.ci + c0 + c) * s.co + o0;
        for (int64_t l = 0; l < std::min<int64_t>(kLanes, s.co - o0); ++l) dst[l] = lanes[l];
      }
}

using TileFn = void (*)(const Shape&, const float*, const float*, int64_t, int64_t, int64_t, int64_t, int64_t,
                        float*);

// The largest tile that fits: at most kAccumulators vector registers of accumulators, each dy vector loaded once
// for all taps and channels of the tile. Tiles of 1 to 3 taps, 1 or 2 vectors of dy, 1 to 8 channels.
template <int KT>
TileFn Pick(int64_t channels_left, bool two_vectors, int* ct) {
  // channels per tile with two vectors (KT x CT x 2 accumulators), and with one (KT x CT)
  constexpr int wide = KT * 8 * 2 <= kAccumulators ? 8 : KT * 4 * 2 <= kAccumulators ? 4 : 2;
  constexpr int narrow = KT * 8 <= kAccumulators ? 8 : 4;
  *ct = two_vectors ? (channels_left >= wide ? wide : channels_left >= 2 ? 2 : 1)
                    : (channels_left >= narrow ? narrow : channels_left >= 4 ? 4 : channels_left >= 2 ? 2 : 1);
  if (two_vectors) return *ct == wide ? Tile<wide, 2, KT> : *ct == 2 ? Tile<2, 2, KT> : Tile<1, 2, KT>;
  return *ct == narrow ? Tile<narrow, 1, KT> : *ct == 4 ? Tile<4, 1, KT> : *ct == 2 ? Tile<2, 1, KT> : Tile<1, 1, KT>;
}

void Block(const Shape& s, const float* xp, const float* dp, int64_t samples, float* out) {
  int64_t vectors = s.cop / kLanes;
  for (int64_t i = 0; i < s.kh; ++i)
    for (int64_t j0 = 0; j0 < s.kw; j0 += 3) {
      int64_t taps = std::min<int64_t>(3, s.kw - j0);
      for (int64_t v0 = 0; v0 < vectors; v0 += 2) {
        bool two = vectors - v0 >= 2;
        for (int64_t c0 = 0, ct = 0; c0 < s.ci; c0 += ct) {
          int picked;
          TileFn fn = taps == 3   ? Pick<3>(s.ci - c0, two, &picked)
                      : taps == 2 ? Pick<2>(s.ci - c0, two, &picked)
                                  : Pick<1>(s.ci - c0, two, &picked);
          fn(s, xp, dp, samples, i, j0, c0, v0, out);
          ct = picked;
        }
        if (!two) break;
      }
    }
}

// Samples [first, first + samples) of x, zero-padded so that every tap of every output position is in range.
void Pad(const Shape& s, const float* x, int64_t first, int64_t samples, float* xp) {
  std::fill(xp, xp + samples * s.ph * s.pw * s.ci, 0.0f);
  for (int64_t n = 0; n < samples; ++n)
    for (int64_t r = 0; r < s.h; ++r)
      std::memcpy(xp + ((n * s.ph + r + s.lo_h) * s.pw + s.lo_w) * s.ci, x + ((first + n) * s.h + r) * s.w * s.ci,
                  s.w * s.ci * sizeof(float));
}

void RunBlock(const Shape& s, const float* x, const float* dy, int64_t first, int64_t samples, float* xp, float* dp,
              float* out) {
  // Pad this block's x, and copy dy with its channels rounded up to whole vectors.
  Pad(s, x, first, samples, xp);
  if (s.cop == s.co) {
    std::memcpy(dp, dy + first * s.oh * s.ow * s.co, samples * s.oh * s.ow * s.co * sizeof(float));
  } else {
    std::fill(dp, dp + samples * s.oh * s.ow * s.cop, 0.0f);
    for (int64_t p = 0; p < samples * s.oh * s.ow; ++p)
      std::memcpy(dp + p * s.cop, dy + (first * s.oh * s.ow + p) * s.co, s.co * sizeof(float));
  }
  Block(s, xp, dp, samples, out);
}

// Runs work(b) for b in [0, blocks) on the calling thread and XLA:CPU's own intra-op threads (those of its Eigen
// kernels, so that the two never compete for cores); each b must write only its own outputs. The caller claims
// blocks too and waits only for the blocks claimed, never for a helper that has not started: a late helper finds no
// block left and touches nothing of the caller's.
struct Claims {
  std::atomic<int64_t> next{0}, done{0};
  int64_t blocks = 0;
  const std::function<void(int64_t)>* work = nullptr;
  std::mutex mutex;
  std::condition_variable finished;
};

void Claim(Claims* claims) {
  for (int64_t b; (b = claims->next.fetch_add(1)) < claims->blocks;) {
    (*claims->work)(b);
    if (claims->done.fetch_add(1) + 1 == claims->blocks) {
      std::lock_guard<std::mutex> lock(claims->mutex);
      claims->finished.notify_all();
    }
  }
}

void ParallelFor(ffi::ThreadPool& pool, int64_t blocks, const std::function<void(int64_t)>& work) {
  auto claims = std::make_shared<Claims>();
  claims->blocks = blocks;
  claims->work = &work;
  for (int64_t t = 1; t < std::min<int64_t>(pool.num_threads(), blocks); ++t)
    pool.Schedule([claims] { Claim(claims.get()); });
  Claim(claims.get());
  std::unique_lock<std::mutex> lock(claims->mutex);
  claims->finished.wait(lock, [&] { return claims->done.load() == blocks; });
}

using Array4 = ffi::Buffer<ffi::F32, 4>;

// The shapes of a convolution of x (n, h, w, ci) into y (n, oh, ow, co) by a (kh, kw, ci, co) kernel; false if
// they do not agree (a stride-1 convolution with low padding lo_h, lo_w >= 0 and non-negative high padding).
bool MakeShape(ffi::Span<const int64_t> xd, ffi::Span<const int64_t> yd, ffi::Span<const int64_t> kd, int64_t lo_h,
               int64_t lo_w, Shape* s) {
  *s = Shape{xd[0], xd[1], xd[2], xd[3], yd[1], yd[2], yd[3], kd[0], kd[1], lo_h, lo_w, 0, 0, 0};
  s->ph = s->oh + s->kh - 1;
  s->pw = s->ow + s->kw - 1;
  s->cop = (s->co + kLanes - 1) / kLanes * kLanes;
  return yd[0] == s->n && kd[2] == s->ci && kd[3] == s->co && lo_h >= 0 && lo_w >= 0 && s->ph >= lo_h + s->h &&
         s->pw >= lo_w + s->w;
}

ffi::Error ConvWeightGradient(ffi::ThreadPool pool, Array4 x, Array4 dy, ffi::Result<Array4> dk, int64_t lo_h,
                              int64_t lo_w) {
  Shape s;
  if (!MakeShape(x.dimensions(), dy.dimensions(), dk->dimensions(), lo_h, lo_w, &s))
    return ffi::Error::InvalidArgument("cleanba_conv_weight_gradient: shapes of x, dy and dk do not agree");
  int64_t taps = s.kh * s.kw * s.ci * s.co;
  float* result = dk->typed_data();
  if (s.n == 0 || s.oh <= 0 || s.ow <= 0) {
    std::fill(result, result + taps, 0.0f);
    return ffi::Error::Success();
  }
  int64_t block = BlockSize(s), blocks = (s.n + block - 1) / block;
  std::vector<float> partials(blocks * taps);
  ParallelFor(pool, blocks, [&](int64_t b) {
    thread_local std::vector<float> xp, dp;
    xp.resize(block * s.ph * s.pw * s.ci);
    dp.resize(block * s.oh * s.ow * s.cop);
    RunBlock(s, x.typed_data(), dy.typed_data(), b * block, std::min(block, s.n - b * block), xp.data(), dp.data(),
             partials.data() + b * taps);
  });
  std::copy(partials.begin(), partials.begin() + taps, result);
  for (int64_t b = 1; b < blocks; ++b)
    for (int64_t k = 0; k < taps; ++k) result[k] += partials[b * taps + k];
  return ffi::Error::Success();
}

// Output pixels [q0, q0 + P) of row r of sample n (of the padded block xp), output vectors [v0, v0 + NV). Each
// output is summed over taps and input channels in one fixed order, whatever the tile.
template <int P, int NV, int CI>
void ForwardTile(const Shape& s, const float* xp, const float* kp, int64_t n, int64_t r, int64_t q0, int64_t v0,
                 float* y) {
  // CI: the input channels when known at compile time (0: s.ci), so that the P pixels' addresses are constants
  const int64_t ci = CI ? CI : s.ci;
  Vec acc[P][NV];
  for (auto& a : acc)
    for (auto& v : a) v = Vec{};
  for (int64_t i = 0; i < s.kh; ++i)
    for (int64_t j = 0; j < s.kw; ++j) {
      const float* xv = xp + ((n * s.ph + r + i) * s.pw + q0 + j) * ci;
      const float* kv = kp + (i * s.kw + j) * ci * s.cop + v0 * kLanes;
      for (int64_t c = 0; c < ci; ++c) {
        Vec k[NV];
#pragma GCC unroll 2
        for (int v = 0; v < NV; ++v) std::memcpy(&k[v], kv + c * s.cop + v * kLanes, sizeof(Vec));
#pragma GCC unroll 28
        for (int p = 0; p < P; ++p)
#pragma GCC unroll 2
          for (int v = 0; v < NV; ++v) acc[p][v] += xv[p * ci + c] * k[v];
      }
    }
  for (int p = 0; p < P; ++p)
    for (int v = 0; v < NV; ++v) {
      int64_t o0 = (v0 + v) * kLanes;
      float* dst = y + ((n * s.oh + r) * s.ow + q0 + p) * s.co + o0;
      if (o0 + kLanes <= s.co) {  // a whole vector: one store
        std::memcpy(dst, &acc[p][v], sizeof(Vec));
        continue;
      }
      float lanes[kLanes];
      std::memcpy(lanes, &acc[p][v], sizeof(Vec));
      for (int64_t l = 0; l < s.co - o0; ++l) dst[l] = lanes[l];
    }
}

// Row r of sample n: tiles of 28 pixels x 1 vector or 12 x 2 with AVX-512's 32 registers (12 x 1 or 6 x 2 with
// AVX2's 16), the accumulators and the kernel's vectors in registers, then smaller ones for the rest of the row.
template <int NV, int CI>
void ForwardRow(const Shape& s, const float* xp, const float* kp, int64_t n, int64_t r, int64_t v0, float* y) {
  constexpr int wide = kRegisters == 32 ? (NV == 1 ? 28 : 12) : (NV == 1 ? 12 : 6), half = wide / 2;
  int64_t q = 0;
  for (; q + wide <= s.ow; q += wide) ForwardTile<wide, NV, CI>(s, xp, kp, n, r, q, v0, y);
  for (; q + half <= s.ow; q += half) ForwardTile<half, NV, CI>(s, xp, kp, n, r, q, v0, y);
  for (; q + 7 <= s.ow; q += 7) ForwardTile<7, NV, CI>(s, xp, kp, n, r, q, v0, y);
  for (; q + 4 <= s.ow; q += 4) ForwardTile<4, NV, CI>(s, xp, kp, n, r, q, v0, y);
  for (; q + 2 <= s.ow; q += 2) ForwardTile<2, NV, CI>(s, xp, kp, n, r, q, v0, y);
  for (; q < s.ow; ++q) ForwardTile<1, NV, CI>(s, xp, kp, n, r, q, v0, y);
}

template <int CI>
void ForwardRows(const Shape& s, const float* xp, const float* kp, float* yn) {
  int64_t vectors = s.cop / kLanes;
  for (int64_t r = 0; r < s.oh; ++r)
    for (int64_t v0 = 0; v0 < vectors; v0 += 2) {
      if (vectors - v0 >= 2)
        ForwardRow<2, CI>(s, xp, kp, 0, r, v0, yn);
      else
        ForwardRow<1, CI>(s, xp, kp, 0, r, v0, yn);
    }
}

// CleanbaConv: y = the stride-1 convolution of x (NHWC) by k (HWIO), x padded with lo_h rows on top and lo_w columns
// on the left (the rest of the padding follows from y's shape). XLA:CPU's Eigen kernels reach a tenth of the
// machine's float32 peak on 4 input channels (the ResNet's first convolution, on its largest image).
ffi::Error Conv(ffi::ThreadPool pool, Array4 x, Array4 k, ffi::Result<Array4> y, int64_t lo_h, int64_t lo_w) {
  Shape s;
  if (!MakeShape(x.dimensions(), y->dimensions(), k.dimensions(), lo_h, lo_w, &s))
    return ffi::Error::InvalidArgument("cleanba_conv: shapes of x, k and y do not agree");
  // The kernel with its output channels rounded up to whole vectors (zeros), so that every load is whole.
  std::vector<float> kp(s.kh * s.kw * s.ci * s.cop, 0.0f);
  for (int64_t t = 0; t < s.kh * s.kw * s.ci; ++t)
    std::memcpy(kp.data() + t * s.cop, k.typed_data() + t * s.co, s.co * sizeof(float));
  const float* xs = x.typed_data();
  float* ys = y->typed_data();
  ParallelFor(pool, s.n, [&](int64_t n) {
    thread_local std::vector<float> xp;
    xp.resize(s.ph * s.pw * s.ci);
    Pad(s, xs, n, 1, xp.data());
    float* yn = ys + n * s.oh * s.ow * s.co;
    switch (s.ci) {  // the ResNet's channel counts, and the 4 stacked frames
      case 4: ForwardRows<4>(s, xp.data(), kp.data(), yn); break;
      case 16: ForwardRows<16>(s, xp.data(), kp.data(), yn); break;
      case 32: ForwardRows<32>(s, xp.data(), kp.data(), yn); break;
      default: ForwardRows<0>(s, xp.data(), kp.data(), yn);
    }
  });
  return ffi::Error::Success();
}

// One sample's max-pool gradient. C: the channels when known at compile time (0: c), so that the per-channel
// loops below become whole vector operations.
template <int C>
void MaxPoolSample(const float* xs, const float* ys, const float* ds, int64_t h, int64_t w, int64_t c, int64_t oh,
                   int64_t ow, int64_t top, int64_t left, float* dxs) {
  const int64_t channels = C ? C : c;
  std::fill(dxs, dxs + h * w * channels, 0.0f);
  thread_local std::vector<int32_t> first_storage;
  first_storage.resize(channels);
  int32_t* first = first_storage.data();
  for (int64_t r = 0; r < oh; ++r)
    for (int64_t q = 0; q < ow; ++q) {
      const float* yv = ys + (r * ow + q) * channels;
      const float* dv = ds + (r * ow + q) * channels;
      // The first of the 9 window positions (row-major) that holds the maximum, per channel; 9: none (NaN).
      for (int64_t f = 0; f < channels; ++f) first[f] = 9;
      for (int k = 8; k >= 0; --k) {
        int64_t row = 2 * r + k / 3 - top, col = 2 * q + k % 3 - left;
        if (row < 0 || row >= h || col < 0 || col >= w) continue;
        const float* xv = xs + (row * w + col) * channels;
        for (int64_t f = 0; f < channels; ++f) first[f] = xv[f] == yv[f] ? k : first[f];
      }
      // Adding +0.0 where the window routes elsewhere changes no sum: a sum that starts at +0.0 is never -0.0.
      for (int k = 0; k < 9; ++k) {
        int64_t row = 2 * r + k / 3 - top, col = 2 * q + k % 3 - left;
        if (row < 0 || row >= h || col < 0 || col >= w) continue;
        float* gv = dxs + (row * w + col) * channels;
        for (int64_t f = 0; f < channels; ++f) gv[f] += first[f] == k ? dv[f] : 0.0f;
      }
    }
}

ffi::Error MaxPoolGradient(ffi::ThreadPool pool, Array4 x, Array4 y, Array4 dy, ffi::Result<Array4> dx) {
  auto xd = x.dimensions(), yd = y.dimensions();
  int64_t n = xd[0], h = xd[1], w = xd[2], c = xd[3], oh = yd[1], ow = yd[2];
  if (yd[0] != n || yd[3] != c || oh != (h + 1) / 2 || ow != (w + 1) / 2 || dy.dimensions()[1] != oh ||
      dy.dimensions()[2] != ow)
    return ffi::Error::InvalidArgument("cleanba_max_pool_gradient: x, y and dy are not a 3x3 stride-2 SAME pool");
  // SAME padding of a 3x3 window at stride 2: 2 * out + 1 - in rows in all, the smaller half on top.
  int64_t top = (2 * oh + 1 - h) / 2, left = (2 * ow + 1 - w) / 2;
  const float *xs = x.typed_data(), *ys = y.typed_data(), *ds = dy.typed_data();
  float* out = dx->typed_data();
  ParallelFor(pool, n, [&](int64_t s) {
    auto sample = c == 32 ? MaxPoolSample<32> : MaxPoolSample<0>;  // 16 fixed: 4x slower (GCC 12)
    sample(xs + s * h * w * c, ys + s * oh * ow * c, ds + s * oh * ow * c, h, w, c, oh, ow, top, left,
           out + s * h * w * c);
  });
  return ffi::Error::Success();
}

// x, a kernel or dy, the result, and the low padding: the bindings of both convolution kernels.
auto ConvolutionBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<Array4>()
      .Arg<Array4>()
      .Ret<Array4>()
      .Attr<int64_t>("lo_h")
      .Attr<int64_t>("lo_w");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(CleanbaConv, Conv, ConvolutionBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(CleanbaConvWeightGradient, ConvWeightGradient, ConvolutionBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(CleanbaMaxPoolGradient, MaxPoolGradient,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Array4>()
                                  .Arg<Array4>()
                                  .Arg<Array4>()
                                  .Ret<Array4>());
