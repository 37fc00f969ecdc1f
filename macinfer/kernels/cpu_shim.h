// Runs Metal Shading Language kernel source on the CPU, for verification only.
//
// Each GPU thread of a threadgroup is a std::thread; threadgroups run one after
// another. threadgroup_barrier and the simd_* collectives are std::barrier
// rendezvous, so a missing barrier is a real data race (ThreadSanitizer sees it)
// and threadgroup memory starts poisoned (0xFF bytes: NaN for floats), as
// uninitialised as on a GPU. Address spaces are erased: this cannot catch
// address-space or Metal compile errors, only Apple's compiler can.
#pragma once
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef _Float16 half;
typedef _Float16 float16_t;
struct uint3 {
  uint x, y, z;
};

namespace msl_cpu {

constexpr unsigned kSimdWidth = 32;
constexpr size_t kThreadgroupBytes = 32 * 1024;  // Apple GPUs' threadgroup memory limit

struct Simdgroup {
  std::barrier<>* rendezvous;
  unsigned width;                 // lanes actually present (the last one may be partial)
  alignas(16) unsigned char exchange[kSimdWidth][16];
};

struct Threadgroup {
  std::barrier<>* rendezvous;
  std::mutex mutex;
  std::map<int, size_t> offsets;  // threadgroup array id -> offset in memory
  size_t used = 0;
  alignas(64) unsigned char memory[kThreadgroupBytes];
};

struct Thread {
  unsigned lane;
  Simdgroup* simd;
  Threadgroup* group;
};
inline thread_local Thread* self = nullptr;

// Backing store for `threadgroup T name[N];`, shared by the threadgroup, poisoned.
inline void* threadgroup_array(int id, size_t bytes) {
  Threadgroup* g = self->group;
  std::lock_guard<std::mutex> lock(g->mutex);
  auto it = g->offsets.find(id);
  if (it != g->offsets.end()) return g->memory + it->second;
  size_t at = (g->used + 15) & ~size_t(15);
  if (at + bytes > kThreadgroupBytes) throw std::runtime_error("threadgroup memory over 32 KiB");
  std::memset(g->memory + at, 0xFF, bytes);
  g->offsets[id] = at;
  g->used = at + bytes;
  return g->memory + at;
}

// Every lane publishes its value, then reads the others'. Two rendezvous: one so
// all values are in, one so nobody overwrites a slot still being read.
template <typename T, typename F>
T simd_collective(T value, F combine) {
  static_assert(sizeof(T) <= 16, "simd value too large");
  Simdgroup* s = self->simd;
  std::memcpy(s->exchange[self->lane], &value, sizeof(T));
  s->rendezvous->arrive_and_wait();
  T result = combine(s);
  s->rendezvous->arrive_and_wait();
  return result;
}

template <typename T>
T lane_value(Simdgroup* s, unsigned lane) {
  T v;
  std::memcpy(&v, s->exchange[lane], sizeof(T));
  return v;
}

struct ThreadIds {
  uint3 thread_position_in_grid, thread_position_in_threadgroup, threadgroup_position_in_grid;
  uint3 threads_per_threadgroup, threadgroups_per_grid, threads_per_grid;
  uint thread_index_in_threadgroup;
};

template <typename Body>
void run_grid(uint3 grid, uint3 tg, Body body) {
  uint3 groups{(grid.x + tg.x - 1) / tg.x, (grid.y + tg.y - 1) / tg.y, (grid.z + tg.z - 1) / tg.z};
  for (uint gz = 0; gz < groups.z; gz++)
    for (uint gy = 0; gy < groups.y; gy++)
      for (uint gx = 0; gx < groups.x; gx++) {
        // dispatchThreads semantics: edge threadgroups may be smaller.
        uint3 size{std::min(tg.x, grid.x - gx * tg.x), std::min(tg.y, grid.y - gy * tg.y),
                   std::min(tg.z, grid.z - gz * tg.z)};
        unsigned n = size.x * size.y * size.z;
        unsigned nsimd = (n + kSimdWidth - 1) / kSimdWidth;
        auto group = std::make_unique<Threadgroup>();
        std::barrier<> group_barrier(n);
        group->rendezvous = &group_barrier;
        std::vector<Simdgroup> simds(nsimd);
        std::vector<std::unique_ptr<std::barrier<>>> simd_barriers;
        for (unsigned s = 0; s < nsimd; s++) {
          simds[s].width = std::min(kSimdWidth, n - kSimdWidth * s);
          simd_barriers.push_back(std::make_unique<std::barrier<>>(simds[s].width));
          simds[s].rendezvous = simd_barriers.back().get();
        }
        std::vector<std::thread> threads;
        for (unsigned t = 0; t < n; t++) {
          threads.emplace_back([&, t] {
            Thread me{t % kSimdWidth, &simds[t / kSimdWidth], group.get()};
            self = &me;
            ThreadIds ids;
            ids.thread_position_in_threadgroup = {t % size.x, (t / size.x) % size.y, t / (size.x * size.y)};
            ids.threadgroup_position_in_grid = {gx, gy, gz};
            ids.thread_position_in_grid = {gx * tg.x + ids.thread_position_in_threadgroup.x,
                                           gy * tg.y + ids.thread_position_in_threadgroup.y,
                                           gz * tg.z + ids.thread_position_in_threadgroup.z};
            ids.threads_per_threadgroup = size;
            ids.threadgroups_per_grid = groups;
            ids.threads_per_grid = grid;
            ids.thread_index_in_threadgroup = t;
            body(ids);
            // A finished thread no longer counts towards later rendezvous.
            me.simd->rendezvous->arrive_and_drop();
            group_barrier.arrive_and_drop();
          });
        }
        for (auto& th : threads) th.join();
      }
}

}  // namespace msl_cpu

namespace metal {
enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
inline void threadgroup_barrier(mem_flags) { msl_cpu::self->group->rendezvous->arrive_and_wait(); }
inline void simdgroup_barrier(mem_flags) { msl_cpu::self->simd->rendezvous->arrive_and_wait(); }

template <typename T, typename Op>
T simd_reduce(T v, Op op) {
  return msl_cpu::simd_collective(v, [&](msl_cpu::Simdgroup* s) {
    T acc = msl_cpu::lane_value<T>(s, 0);
    for (unsigned i = 1; i < s->width; i++) acc = op(acc, msl_cpu::lane_value<T>(s, i));
    return acc;
  });
}
template <typename T>
T simd_sum(T v) { return simd_reduce(v, [](T a, T b) { return T(a + b); }); }
template <typename T>
T simd_max(T v) { return simd_reduce(v, [](T a, T b) { return std::max(a, b); }); }
template <typename T>
T simd_min(T v) { return simd_reduce(v, [](T a, T b) { return std::min(a, b); }); }
template <typename T>
T simd_shuffle(T v, ushort lane) {
  return msl_cpu::simd_collective(v, [&](msl_cpu::Simdgroup* s) {
    return lane < s->width ? msl_cpu::lane_value<T>(s, lane) : v;
  });
}
template <typename T>
T simd_shuffle_xor(T v, ushort mask) {
  return simd_shuffle(v, ushort(msl_cpu::self->lane ^ mask));
}
template <typename T>
T simd_shuffle_down(T v, ushort delta) {
  unsigned src = msl_cpu::self->lane + delta;
  return simd_shuffle(v, ushort(src < msl_cpu::self->simd->width ? src : msl_cpu::self->lane));
}
template <typename T>
T simd_broadcast(T v, ushort lane) { return simd_shuffle(v, lane); }

inline float exp(float x) { return std::exp(x); }
inline float exp2(float x) { return std::exp2(x); }
inline float log(float x) { return std::log(x); }
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
inline float abs(float x) { return std::fabs(x); }
inline float cos(float x) { return std::cos(x); }
inline float sin(float x) { return std::sin(x); }
using std::max;
using std::min;
namespace fast {
inline float exp(float x) { return std::exp(x); }
inline float exp2(float x) { return std::exp2(x); }
inline float cos(float x) { return std::cos(x); }
inline float sin(float x) { return std::sin(x); }
}  // namespace fast
namespace precise {
inline float exp(float x) { return std::exp(x); }
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
}  // namespace precise
template <typename T>
using numeric_limits = std::numeric_limits<T>;
}  // namespace metal
using namespace metal;

// Keyword macros last: `thread` would otherwise break std::thread above.
#define device
#define constant
#define thread
#define threadgroup
#define METAL_FUNC inline
