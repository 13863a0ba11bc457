// CPU allocator hook: wraps torch's CPU allocator (c10::GetCPUAllocator) so every CPU tensor allocation and
// free, on any thread (autograd, gloo workers, intra-op pools), is logged by the tracealloc event core.
//
// Built separately from tracealloc.cpp because it needs c10 headers (tracer/cpu_hook.py compiles it against
// the installed torch). It does not link the core: the core's loggers arrive as function pointers, so the
// one core instance the Python side loaded is the one that logs.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>

namespace {

using LogFn = void (*)(void*, size_t, int, void*);
using FailFn = void (*)(size_t, int, void*);

LogFn g_log_malloc = nullptr;
LogFn g_log_free = nullptr;
FailFn g_log_fail = nullptr;
c10::DeleterFnPtr g_orig_deleter = nullptr;  // the wrapped allocator's raw deleter (DefaultCPUAllocator's)
std::atomic<long> g_slow_allocs{0};

// Fast path: data == context and the original deleter is the raw one, so no extra context is needed.
void traced_delete(void* p) {
  // Log before the memory can be reused by another allocation. Raw deallocation of a zero-byte raw allocation
  // passes nullptr: nothing was allocated (and nothing logged), so nothing is freed.
  if (p) g_log_free(p, 0, -1, nullptr);
  g_orig_deleter(p);
}

// General path: keep the original context and deleter next to the data pointer.
struct Ctx {
  void* data;
  void* orig_ctx;
  c10::DeleterFnPtr orig_del;
};
void traced_delete_ctx(void* raw) {
  Ctx* c = static_cast<Ctx*>(raw);
  g_log_free(c->data, 0, -1, nullptr);
  if (c->orig_del) c->orig_del(c->orig_ctx);
  delete c;
}

class TracingCPUAllocator final : public c10::Allocator {
 public:
  explicit TracingCPUAllocator(c10::Allocator* orig) : orig_(orig) {}

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr dp;
    try {
      dp = orig_->allocate(n);
    } catch (...) {
      g_log_fail(n, -1, nullptr);
      throw;
    }
    void* p = dp.get();
    if (!p) return dp;  // zero-byte allocations have no memory behind them
    if (g_orig_deleter && dp.get_context() == p && dp.compare_exchange_deleter(g_orig_deleter, &traced_delete)) {
      g_log_malloc(p, n, -1, nullptr);
      return dp;
    }
    g_slow_allocs.fetch_add(1, std::memory_order_relaxed);
    c10::Device dev = dp.device();
    void* orig_ctx = dp.get_context();
    c10::DeleterFnPtr orig_del = dp.get_deleter();
    dp.release_context();  // ownership moves into Ctx
    g_log_malloc(p, n, -1, nullptr);
    return c10::DataPtr(p, new Ctx{p, orig_ctx, orig_del}, &traced_delete_ctx, dev);
  }

  // raw_allocate/raw_deallocate need data == context, which only the fast path gives.
  c10::DeleterFnPtr raw_deleter() const override { return g_orig_deleter ? &traced_delete : nullptr; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    orig_->copy_data(dest, src, count);
  }

 private:
  c10::Allocator* orig_;
};

TracingCPUAllocator* g_wrapper = nullptr;

}  // namespace

// Returns 0 on success, 1 if already installed, -1 on bad arguments.
extern "C" __attribute__((visibility("default"))) int mt_cpu_hook_install(void* log_malloc, void* log_free,
                                                                          void* log_fail, int priority) {
  if (!log_malloc || !log_free || !log_fail) return -1;
  if (g_wrapper) return 1;
  g_log_malloc = reinterpret_cast<LogFn>(log_malloc);
  g_log_free = reinterpret_cast<LogFn>(log_free);
  g_log_fail = reinterpret_cast<FailFn>(log_fail);
  c10::Allocator* orig = c10::GetCPUAllocator();
  g_orig_deleter = orig->raw_deleter();
  g_wrapper = new TracingCPUAllocator(orig);  // never freed: tensors outlive any uninstall point
  c10::SetCPUAllocator(g_wrapper, static_cast<uint8_t>(priority));
  return c10::GetCPUAllocator() == g_wrapper ? 0 : -2;
}

// Allocations that needed the general (extra context) path; 0 with torch's default CPU allocator.
extern "C" __attribute__((visibility("default"))) long mt_cpu_hook_slow_allocs() { return g_slow_allocs.load(); }
