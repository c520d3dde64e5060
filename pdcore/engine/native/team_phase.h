#pragma once
// Work handed out in phases inside one parallel region (#47), instead of a fixed share and an
// OpenMP barrier after each phase. A phase has a count of items; a thread takes the next item
// (an atomic counter) until none is left, and counts each one done when it has written it. A
// phase that reads another's results first waits until that one's done count reaches its
// total. A thread the OS took off its core (a busy neighbour: the server's HTTP process, the
// client) therefore delays only the item it holds, if any: the others take the rest of the
// phase and go on, where at a barrier they all waited for it to arrive; when it comes back it
// finds the phases since done and runs through them, taking nothing. Every phase's data lives in
// shared buffers written only by its items, and each phase waits for the one before it, which
// waited for the one before that: so a phase's buffers are not written again while a late
// thread could still read them (no thread reads outside an item it holds).
// Which thread runs an item changes nothing in it: the items are the operators' own (a panel
// of a GEMM, a row of a norm or of the attention), so the bits do not depend on the handout.
#include <atomic>
#include <memory>
#include <sched.h>

namespace {

struct alignas(64) TeamPhase {
  std::atomic<int64_t> next{0};  // the next item to take
  char pad[56];
  std::atomic<int64_t> done{0};  // items written
  std::atomic<int64_t> total{0};  // every thread stores the same count before it reads it
};

// this thread's share of phase p: fn(i) for each item it takes
template <typename F>
inline void phase_run(TeamPhase& p, const F& fn) {
  for (;;) {
    const int64_t i = p.next.fetch_add(1, std::memory_order_relaxed);
    if (i >= p.total.load(std::memory_order_relaxed)) return;
    fn(i);
    p.done.fetch_add(1, std::memory_order_release);
  }
}

// until every item of p is written: spins briefly (an item is a few us), then yields the core
// (the thread it waits for may need it)
inline void phase_wait(const TeamPhase& p) {
  for (int spins = 0; p.done.load(std::memory_order_acquire) < p.total.load(std::memory_order_relaxed); ++spins) {
    if (spins < 20000)
      _mm_pause();
    else
      sched_yield();
  }
}

// a step's phases in order; run(total, fn): wait for the phase before, then take items
struct TeamPhases {
  std::unique_ptr<TeamPhase[]> p;
  int64_t n = 0;
  explicit TeamPhases(int64_t count) : p(new TeamPhase[count]), n(count) {}
};

struct PhaseCursor {  // one thread's place in the step's phases
  TeamPhases& ph;
  int64_t at = 0;
  template <typename F>
  void run(int64_t total, const F& fn) {
    TORCH_CHECK(at < ph.n, "team phases: more phases than counted");
    TeamPhase& p = ph.p[at];
    if (at > 0) phase_wait(ph.p[at - 1]);
    p.total.store(total, std::memory_order_relaxed);
    phase_run(p, fn);
    ++at;
  }
};

}  // namespace
