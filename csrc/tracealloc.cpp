// megatron-memtrace tracing allocator: event core + trace writer + CUDA/host backends.
//
// Plain C++17, no torch and no CUDA headers: the CUDA runtime is resolved at run time with dlsym, so this
// builds everywhere (setup.py optional extension, or tracer/allocator.py's on-demand g++ build).
// File format: docs/FORMATS.md section 2 (64-byte header, blocks of 48-byte records each led by a checksummed
// block header slot, `.names` string table).
//
// Concurrency: one global mutex serialises every event. That gives the single global order the format
// requires and lets the live/peak counters (an open-addressing ptr->size map) equal a replay of the file
// exactly. The critical section is a few loads/stores plus a hash probe, so tens of ns per event.
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include <dlfcn.h>
#include <fcntl.h>
#include <link.h>
#include <pthread.h>
#include <sched.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define MT_API extern "C" __attribute__((visibility("default")))

// Bump when the C ABI or the file format changes: tracer/allocator.py refuses a stale prebuilt library.
static const int kAbiVersion = 3;  // 3: cudart bound from the process scope (RTLD_DEFAULT) too

namespace {

enum Kind : uint8_t { MALLOC = 1, FREE = 2, MALLOC_FAIL = 3, SCOPE_PUSH = 4, SCOPE_POP = 5, MARK = 6,
                      DEVICE_MEM = 7, BLOCK = 0xFF };
// FORMATS 2.1: header end states.
enum EndState : uint32_t { END_OPEN = 0, END_CLEAN = 1, END_SIGNAL = 2 };
constexpr uint32_t kFormatVersion = 2;
constexpr uint64_t kBlockMagic = 0x314B434F4C42544Dull;  // "MTBLOCK1" little-endian

#pragma pack(push, 1)
struct Record {  // FORMATS.md 2.1, little-endian on every platform we build for
  uint64_t t_ns, ptr, size, stream;
  uint32_t scope, tag, tid;
  int16_t device;
  uint8_t kind, flags;
};
struct Header {
  char magic[8];
  uint32_t version, record_size;
  uint64_t t0_ns;
  uint32_t pid, backend;
  uint32_t end_state, end_signal;  // how the writer stopped (EndState) and the fatal signal, if any
  uint64_t end_slots;              // 48-byte slots (records + block headers) in the file when it stopped
  uint64_t reserved;
  uint64_t check;                  // checksum of the 56 bytes before it
};
#pragma pack(pop)
static_assert(sizeof(Record) == 48, "record must be 48 bytes");
static_assert(sizeof(Header) == 64, "header must be 64 bytes");

inline uint64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return uint64_t(ts.tv_sec) * 1000000000ull + uint64_t(ts.tv_nsec);
}

// Block checksum (FORMATS 2.1): the sum mod 2^64 of mix(w_i + i * golden) over the 64-bit words w_i of a block, i
// counted from its header slot; mix(x) = y ^ (y >> 32) with y = x times an odd constant. mix is a bijection, so any
// change to one word changes the sum; the index makes it position-dependent. Word-parallel, unlike CRC32 or FNV:
// about 1 ns per word here, and numpy checks it as fast in the reader. Pure arithmetic: async-signal-safe.
constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;
inline uint64_t mix64(uint64_t x) {
  x *= 0xBF58476D1CE4E5B9ull;
  return x ^ (x >> 32);
}
inline uint64_t sum_words(const void* data, size_t n_words, uint64_t first_index) {
  const unsigned char* p = static_cast<const unsigned char*>(data);
  uint64_t s = 0;
  for (size_t i = 0; i < n_words; ++i) {
    uint64_t w;
    std::memcpy(&w, p + 8 * i, 8);
    s += mix64(w + (first_index + i) * kGolden);
  }
  return s;
}

// Open addressing, linear probing, backward-shift deletion: no per-insert malloc (std::unordered_map
// would allocate a node per event) and no tombstones to degrade long runs. Key 0 marks an empty slot, so the
// null pointer (torch's raw deleter is called with nullptr for zero-byte raw allocations) lives outside the table:
// looked up in the table, it would match any empty slot and return that slot's stale size.
class PtrMap {
 public:
  PtrMap() { rehash(1 << 16); }
  // Drop every entry (rehash alone would carry the old ones over into the new table).
  void clear() { keys_.clear(); vals_.clear(); rehash(1 << 16); null_live_ = false; }
  // Returns the previous size if `p` was live (replaced), else 0 with *had = false.
  uint64_t put(uint64_t p, uint64_t size, bool* had) {
    if (!p) {
      uint64_t old = null_live_ ? null_size_ : 0;
      *had = null_live_;
      null_live_ = true; null_size_ = size;
      return old;
    }
    if ((count_ + 1) * 2 > cap_) rehash(cap_ * 2);
    size_t i = slot(p);
    while (keys_[i]) {
      if (keys_[i] == p) { uint64_t old = vals_[i]; vals_[i] = size; *had = true; return old; }
      i = (i + 1) & (cap_ - 1);
    }
    keys_[i] = p; vals_[i] = size; ++count_; *had = false;
    return 0;
  }
  bool take(uint64_t p, uint64_t* size) {
    if (!p) {
      if (!null_live_) return false;
      null_live_ = false; *size = null_size_;
      return true;
    }
    size_t i = slot(p);
    while (keys_[i] != p) {
      if (!keys_[i]) return false;
      i = (i + 1) & (cap_ - 1);
    }
    *size = vals_[i];
    // Backward shift: pull later entries of the cluster into the hole if it is on their probe path.
    size_t hole = i, j = i;
    for (;;) {
      j = (j + 1) & (cap_ - 1);
      if (!keys_[j]) break;
      size_t home = slot(keys_[j]);
      if (((j - home) & (cap_ - 1)) >= ((j - hole) & (cap_ - 1))) {
        keys_[hole] = keys_[j]; vals_[hole] = vals_[j]; hole = j;
      }
    }
    keys_[hole] = 0; --count_;
    return true;
  }

 private:
  size_t slot(uint64_t p) const { return size_t(((p >> 4) * 0x9E3779B97F4A7C15ull) >> shift_); }
  void rehash(size_t cap) {
    std::vector<uint64_t> ok(std::move(keys_)), ov(std::move(vals_));
    keys_.assign(cap, 0); vals_.assign(cap, 0);
    cap_ = cap; shift_ = 64 - __builtin_ctzll(cap); count_ = 0;
    for (size_t k = 0; k < ok.size(); ++k)
      if (ok[k]) { bool h; put(ok[k], ov[k], &h); }
  }
  std::vector<uint64_t> keys_, vals_;
  size_t cap_ = 0, count_ = 0;
  int shift_ = 64;
  bool null_live_ = false;
  uint64_t null_size_ = 0;
};

constexpr size_t kBufRecords = 1 << 15;  // 1.5 MiB blocks: one write(2) per 32k events

// The state word (Core::state): bits 0-15 the complete records in the buffer, bit 16 FROZEN, bits 17-63 the slots
// already in the file. One word, so a fatal-signal handler snapshots (file position, count) and freezes the buffer
// in one atomic step: once FROZEN is set no thread adds a record or starts refilling the buffer, so the handler
// writes exactly the bytes a normal flush of that block would (FORMATS 2.1 "signals").
constexpr uint64_t kCountMask = 0xFFFF, kFrozen = 1ull << 16;
constexpr int kBaseShift = 17;
static_assert(kBufRecords <= kCountMask, "count field too small");

struct Core {
  std::mutex mu;
  // Published state for the lock-free fast "is tracing on" check and for the signal handler.
  std::atomic<bool> open{false};
  std::atomic<int> fd{-1};
  int names_fd = -1;
  std::atomic<uint64_t> state{0};  // see kCountMask
  std::atomic<int> in_handler{0};  // signal handlers between reading fd and their last write (close waits for 0)
  // A chained handler (the process may go on) marked the header END_SIGNAL: the next flush marks it open again.
  std::atomic<bool> header_says_signal{false};
  Header header{};                 // as written at open; close and the signal handler rewrite it with the end state
  Record* buf = nullptr;
  uint64_t t0 = 0;
  uint64_t last_t = 0;  // clamp: clocks are read before taking the lock, file order must stay monotone
  uint32_t backend = 0;
  // Counters: exact, maintained under `mu` in file order.
  PtrMap live_map;
  uint64_t live = 0, peak = 0;
  // Process-wide scope stack (FORMATS 2.1).
  std::vector<uint32_t> scopes;
  uint32_t next_scope = 0;
  // String table; survives close/open so cached ids in Python stay valid.
  std::unordered_map<std::string, uint32_t> name_ids;
  std::vector<std::string> names{""};
  std::atomic<uint32_t> tid_gen{1}, next_tid{0};
  std::string last_error;
};

// Leaked on purpose: frees may arrive from static destructors after atexit (torch tears down late).
Core& core() {
  static Core* c = new Core();
  return *c;
}

// initial-exec: a plain TLS load instead of a __tls_get_addr call per event (8 bytes fit glibc's static surplus).
__attribute__((tls_model("initial-exec"))) thread_local uint32_t t_gen = 0, t_tid = 0;
inline uint32_t my_tid(Core& c) {
  uint32_t g = c.tid_gen.load(std::memory_order_relaxed);
  if (t_gen != g) { t_tid = c.next_tid.fetch_add(1, std::memory_order_relaxed); t_gen = g; }
  return t_tid;
}

bool write_all_at(int fd, const void* data, size_t n, uint64_t off) {
  const char* p = static_cast<const char*>(data);
  while (n) {
    ssize_t w = pwrite(fd, p, n, off_t(off));
    if (w < 0) { if (errno == EINTR) continue; return false; }
    p += w; n -= size_t(w); off += uint64_t(w);
  }
  return true;
}

inline uint64_t slot_offset(uint64_t slot) { return sizeof(Header) + slot * sizeof(Record); }

// Spin until a signal handler running on another thread unfreezes the buffer (a chained handler that returns) or
// the process dies (a terminating one). Returns the state then.
inline uint64_t wait_unfrozen(Core& c) {
  uint64_t st;
  while ((st = c.state.load(std::memory_order_acquire)) & kFrozen) sched_yield();
  return st;
}

// The block of the n records in buf at slot `base`, written with one pwritev. Used by flush and by the signal
// handler; both write the same bytes for the same (base, n), so which write lands last does not matter.
bool write_block(const Core& c, int fd, uint64_t base, uint64_t n) {
  Record h;
  std::memset(&h, 0, sizeof(h));
  h.t_ns = kBlockMagic; h.size = n; h.stream = base; h.kind = BLOCK;
  h.ptr = sum_words(&h, 6, 0) + sum_words(c.buf, 6 * n, 6);
  iovec iov[2] = {{&h, sizeof(h)}, {c.buf, size_t(n) * sizeof(Record)}};
  size_t left = iov[0].iov_len + iov[1].iov_len;
  uint64_t off = slot_offset(base);
  int k = 0;
  while (left) {
    ssize_t w = pwritev(fd, iov + k, 2 - k, off_t(off));
    if (w < 0) { if (errno == EINTR) continue; return false; }
    left -= size_t(w); off += uint64_t(w);
    while (w > 0) {  // advance over what was written
      size_t take = size_t(w) < iov[k].iov_len ? size_t(w) : iov[k].iov_len;
      iov[k].iov_base = static_cast<char*>(iov[k].iov_base) + take; iov[k].iov_len -= take; w -= ssize_t(take);
      if (!iov[k].iov_len && k < 1) ++k;
    }
  }
  return true;
}

bool write_header(Core& c, int fd, uint32_t end_state, uint32_t sig, uint64_t end_slots) {
  Header h = c.header;
  h.end_state = end_state; h.end_signal = sig; h.end_slots = end_slots;
  h.check = sum_words(&h, 7, 0);
  return write_all_at(fd, &h, sizeof(h), 0);
}

// Caller holds mu.
void flush_locked(Core& c) {
  uint64_t st = c.state.load(std::memory_order_relaxed);
  if (st & kFrozen) st = wait_unfrozen(c);
  uint64_t n = st & kCountMask, base = st >> kBaseShift;
  int fd = c.fd.load(std::memory_order_relaxed);
  if (!n || fd < 0) return;
  if (!write_block(c, fd, base, n)) c.last_error = std::strerror(errno);
  // Fails only if a signal handler froze the buffer meanwhile: it writes (or wrote) this same block and, if the
  // process goes on, advances the state itself.
  if (!c.state.compare_exchange_strong(st, (base + n + 1) << kBaseShift, std::memory_order_acq_rel)) {
    wait_unfrozen(c);
    return;
  }
  if (c.header_says_signal.exchange(false) && !write_header(c, fd, END_OPEN, 0, 0)) c.last_error = std::strerror(errno);
}

// Caller holds mu and has checked c.open. `t` is read before the lock (keeps the slow clock call out of the
// critical section); clamping to the last stamp keeps t_ns monotone in file order.
inline void emit(Core& c, uint64_t t, uint8_t kind, uint64_t ptr, uint64_t size, uint64_t stream, uint32_t tag,
                 int device, uint32_t scope) {
  if (t > c.last_t) c.last_t = t;
  uint64_t st = c.state.load(std::memory_order_relaxed);
  size_t n;
  for (;;) {
    if (st & kFrozen) st = wait_unfrozen(c);
    n = size_t(st & kCountMask);
    Record& r = c.buf[n];
    r.t_ns = c.last_t - c.t0;
    r.ptr = ptr; r.size = size; r.stream = stream;
    r.scope = scope; r.tag = tag; r.tid = my_tid(c);
    r.device = int16_t(device); r.kind = kind; r.flags = 0;
    // Publish only a complete record, and never into a frozen buffer: a handler that froze it before this CAS
    // writes the records before this one; once it unfreezes (and moved the file position), write this one again.
    if (c.state.compare_exchange_strong(st, st + 1, std::memory_order_release, std::memory_order_relaxed)) break;
  }
  if (n + 1 == kBufRecords) flush_locked(c);
}

inline uint32_t cur_scope(const Core& c) { return c.scopes.empty() ? 0 : c.scopes.back(); }

void log_malloc(void* p, size_t size, int device, void* stream) {
  Core& c = core();
  if (!c.open.load(std::memory_order_acquire)) return;
  uint64_t t = now_ns();
  std::lock_guard<std::mutex> g(c.mu);
  if (!c.open.load(std::memory_order_relaxed)) return;
  bool had;
  uint64_t old = c.live_map.put(uint64_t(p), size, &had);
  // A MALLOC of a pointer still live replaces it (never expected; replay applies the same rule).
  if (had) c.live -= old;
  c.live += size;
  if (c.live > c.peak) c.peak = c.live;
  emit(c, t, MALLOC, uint64_t(p), size, uint64_t(stream), 0, device, cur_scope(c));
}

void log_free(void* p, size_t size, int device, void* stream) {
  Core& c = core();
  if (!c.open.load(std::memory_order_acquire)) return;
  uint64_t t = now_ns();
  std::lock_guard<std::mutex> g(c.mu);
  if (!c.open.load(std::memory_order_relaxed)) return;
  uint64_t known;
  // Unknown pointers (allocated before tracing) are logged with the caller's size and ignored by counters.
  if (c.live_map.take(uint64_t(p), &known)) { c.live -= known; size = known; }
  emit(c, t, FREE, uint64_t(p), size, uint64_t(stream), 0, device, cur_scope(c));
}

void log_simple(uint8_t kind, uint64_t ptr, uint64_t size, int device, void* stream) {
  Core& c = core();
  if (!c.open.load(std::memory_order_acquire)) return;
  uint64_t t = now_ns();
  std::lock_guard<std::mutex> g(c.mu);
  if (!c.open.load(std::memory_order_relaxed)) return;
  emit(c, t, kind, ptr, size, uint64_t(stream), 0, device, cur_scope(c));
}

// ---- fatal signals and exit ----------------------------------------------------------------------

const int kSignals[] = {SIGSEGV, SIGABRT, SIGTERM, SIGINT, SIGBUS, SIGFPE};
struct sigaction g_old[sizeof(kSignals) / sizeof(int)];
std::atomic<bool> g_handlers{false};

// Async-signal-safe: no lock (the interrupted thread may hold it), only atomics, arithmetic and pwrite. The
// fetch_or freezes the buffer (see kCountMask): the records it counts stay as they are until unfrozen. The header
// says END_SIGNAL even when a chained handler may let the process go on (Python turns SIGINT into
// KeyboardInterrupt and, uncaught, kills itself with SIGINT again behind our back); the next flush or close says
// otherwise. Returns the frozen state word and whether this call set FROZEN (a handler on another thread may have).
uint64_t signal_flush(int sig, bool* owner) {
  Core& c = core();
  uint64_t st = c.state.fetch_or(kFrozen, std::memory_order_acq_rel);
  *owner = !(st & kFrozen);
  c.in_handler.fetch_add(1, std::memory_order_seq_cst);
  int fd = c.fd.load(std::memory_order_seq_cst);
  uint64_t n = st & kCountMask, base = st >> kBaseShift;
  if (fd >= 0) {
    if (n) write_block(c, fd, base, n);
    write_header(c, fd, END_SIGNAL, uint32_t(sig), n ? base + n + 1 : base);
    c.header_says_signal.store(true);
  }
  c.in_handler.fetch_sub(1, std::memory_order_seq_cst);
  return st & ~kFrozen;
}

// The process goes on after the chained handler: the block is on disk, so move past it and let writers resume.
void signal_resume(uint64_t st) {
  uint64_t n = st & kCountMask, base = st >> kBaseShift;
  core().state.store((n ? base + n + 1 : base) << kBaseShift, std::memory_order_release);
}

void on_signal(int sig, siginfo_t* info, void* uctx) {
  int saved = errno;
  for (size_t k = 0; k < sizeof(kSignals) / sizeof(int); ++k) {
    if (kSignals[k] != sig) continue;
    const struct sigaction& old = g_old[k];
    bool chained = (old.sa_flags & SA_SIGINFO) ? old.sa_sigaction != nullptr
                                               : (old.sa_handler != SIG_DFL);
    bool owner;
    uint64_t st = signal_flush(sig, &owner);
    if (chained) {
      if (owner) signal_resume(st);
      errno = saved;
      if (old.sa_flags & SA_SIGINFO) old.sa_sigaction(sig, info, uctx);
      else if (old.sa_handler != SIG_IGN) old.sa_handler(sig);  // e.g. Python's SIGINT handler -> KeyboardInterrupt
      return;
    }
    // Default action: restore it and re-raise so the exit status says which signal killed us.
    sigaction(sig, &old, nullptr);
    raise(sig);
    return;
  }
}

void install_handlers() {
  bool expected = false;
  if (!g_handlers.compare_exchange_strong(expected, true)) return;
  for (size_t k = 0; k < sizeof(kSignals) / sizeof(int); ++k) {
    struct sigaction sa;
    std::memset(&sa, 0, sizeof(sa));
    sa.sa_sigaction = on_signal;
    sa.sa_flags = SA_SIGINFO | SA_RESTART;
    sigemptyset(&sa.sa_mask);  // our other fatal signals wait until this handler is done (no nested flush)
    for (int other : kSignals) sigaddset(&sa.sa_mask, other);
    sigaction(kSignals[k], &sa, &g_old[k]);
  }
}

void close_locked(Core& c) {
  if (!c.open.load(std::memory_order_relaxed)) return;
  flush_locked(c);
  c.open.store(false, std::memory_order_release);
  int fd = c.fd.exchange(-1, std::memory_order_seq_cst);
  if (fd >= 0) {
    uint64_t st = c.state.load(std::memory_order_acquire);
    if (!(st & kFrozen) && !write_header(c, fd, END_CLEAN, 0, st >> kBaseShift)) c.last_error = std::strerror(errno);
    // A handler that read the fd before the exchange may still write to it: never close it under its feet (nor
    // let the number be reused by the next open).
    while (c.in_handler.load(std::memory_order_seq_cst)) sched_yield();
    close(fd);
  }
  if (c.names_fd >= 0) { close(c.names_fd); c.names_fd = -1; }
}

void at_exit_flush() {
  Core& c = core();
  std::lock_guard<std::mutex> g(c.mu);
  close_locked(c);
}

// A forked child must not write into the parent's trace (it shares the fd and a copy of the buffer).
void after_fork_child() {
  Core& c = core();
  new (&c.mu) std::mutex();  // the parent may have held it at fork time
  c.open.store(false);
  c.fd.store(-1);
  c.names_fd = -1;
  c.state.store(0);
  c.in_handler.store(0);
}

void write_name_line(Core& c, uint32_t id, const std::string& name) {
  if (c.names_fd < 0) return;
  std::string line = std::to_string(id) + "\t";
  for (char ch : name) line += (ch == '\n' || ch == '\r' || ch == '\t') ? ' ' : ch;
  line += "\n";
  const char* p = line.data();
  size_t n = line.size();
  while (n) {
    ssize_t w = write(c.names_fd, p, n);
    if (w < 0) { if (errno == EINTR) continue; c.last_error = std::strerror(errno); return; }
    p += w; n -= size_t(w);
  }
}

// ---- CUDA runtime, resolved at run time -----------------------------------------------------------

struct Cuda {
  int (*malloc_)(void**, size_t) = nullptr;
  int (*free_)(void*) = nullptr;
  int (*mem_get_info)(size_t*, size_t*) = nullptr;
  int (*get_device)(int*) = nullptr;
  int (*set_device)(int) = nullptr;
  int (*get_last_error)() = nullptr;
  bool ok = false;
  std::string where;
};

int find_cudart_cb(dl_phdr_info* info, size_t, void* out) {
  if (info->dlpi_name && std::strstr(info->dlpi_name, "libcudart")) {
    *static_cast<std::string*>(out) = info->dlpi_name;
    return 1;
  }
  return 0;
}

// `h` may be RTLD_DEFAULT, which is the null pointer on glibc: callers check their dlopen results themselves.
bool bind_cuda(Cuda& cu, void* h, const std::string& where) {
  cu.malloc_ = reinterpret_cast<int (*)(void**, size_t)>(dlsym(h, "cudaMalloc"));
  cu.free_ = reinterpret_cast<int (*)(void*)>(dlsym(h, "cudaFree"));
  cu.mem_get_info = reinterpret_cast<int (*)(size_t*, size_t*)>(dlsym(h, "cudaMemGetInfo"));
  cu.get_device = reinterpret_cast<int (*)(int*)>(dlsym(h, "cudaGetDevice"));
  cu.set_device = reinterpret_cast<int (*)(int)>(dlsym(h, "cudaSetDevice"));
  cu.get_last_error = reinterpret_cast<int (*)()>(dlsym(h, "cudaGetLastError"));
  cu.ok = cu.malloc_ && cu.free_ && cu.mem_get_info && cu.get_device;
  if (cu.ok) cu.where = where;
  return cu.ok;
}

// Prefer the cudart torch already loaded (same runtime instance), then common sonames.
Cuda& cuda() {
  static Cuda cu;
  static std::once_flag once;
  std::call_once(once, [] {
    if (bind_cuda(cu, RTLD_DEFAULT, "process (RTLD_DEFAULT)")) return;
    std::string path;
    dl_iterate_phdr(find_cudart_cb, &path);
    auto bind_opened = [](const char* name, int flags) {
      void* h = dlopen(name, flags);
      return h && bind_cuda(cu, h, name);
    };
    if (!path.empty() && bind_opened(path.c_str(), RTLD_LAZY | RTLD_NOLOAD)) return;
    const char* sonames[] = {"libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"};
    for (const char* s : sonames)
      if (bind_opened(s, RTLD_LAZY | RTLD_NOLOAD)) return;
    for (const char* s : sonames)
      if (bind_opened(s, RTLD_LAZY | RTLD_GLOBAL)) return;
  });
  return cu;
}

}  // namespace

// ---- C ABI ---------------------------------------------------------------------------------------

MT_API int mt_abi_version() { return kAbiVersion; }

// backend: 0 host, 1 cuda, 2 cpu-hook. Returns 0, or -errno. Reopening resets counters and the stack.
MT_API int mt_open(const char* path_prefix, int backend) {
  Core& c = core();
  std::lock_guard<std::mutex> g(c.mu);
  close_locked(c);
  std::string pre(path_prefix);
  int fd = ::open((pre + ".trace").c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) { c.last_error = std::strerror(errno); return -errno; }
  int nfd = ::open((pre + ".names").c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0644);
  if (nfd < 0) { int e = errno; c.last_error = std::strerror(e); close(fd); return -e; }
  if (!c.buf) c.buf = static_cast<Record*>(std::calloc(kBufRecords, sizeof(Record)));
  c.t0 = c.last_t = now_ns();
  c.backend = uint32_t(backend);
  Header& h = c.header;
  std::memset(&h, 0, sizeof(h));
  std::memcpy(h.magic, "MTRACE01", 8);
  h.version = kFormatVersion; h.record_size = sizeof(Record); h.t0_ns = c.t0;
  h.pid = uint32_t(getpid()); h.backend = uint32_t(backend);
  if (!write_header(c, fd, END_OPEN, 0, 0)) { int e = errno; close(fd); close(nfd); return -e; }
  c.names_fd = nfd;
  for (uint32_t i = 0; i < c.names.size(); ++i) write_name_line(c, i, c.names[i]);
  c.live_map.clear();
  c.live = c.peak = 0;
  c.scopes.clear();
  c.next_scope = 0;
  c.tid_gen.fetch_add(1);
  c.next_tid.store(0);
  c.state.store(0);
  c.header_says_signal.store(false);
  c.fd.store(fd, std::memory_order_release);
  c.open.store(true, std::memory_order_release);
  static std::once_flag once;
  std::call_once(once, [] {
    std::atexit(at_exit_flush);
    pthread_atfork(nullptr, nullptr, after_fork_child);
  });
  install_handlers();
  return 0;
}

MT_API void mt_close() {
  Core& c = core();
  std::lock_guard<std::mutex> g(c.mu);
  close_locked(c);
}

MT_API int mt_is_open() { return core().open.load() ? 1 : 0; }

MT_API void mt_flush() {
  Core& c = core();
  std::lock_guard<std::mutex> g(c.mu);
  flush_locked(c);
}

MT_API uint32_t mt_intern(const char* name) {
  Core& c = core();
  std::lock_guard<std::mutex> g(c.mu);
  std::string s(name ? name : "");
  auto it = c.name_ids.find(s);
  if (it != c.name_ids.end()) return it->second;
  if (s.empty()) return 0;
  uint32_t id = uint32_t(c.names.size());
  c.names.push_back(s);
  c.name_ids.emplace(s, id);
  write_name_line(c, id, s);  // appended and flushed right away (FORMATS 2.2)
  return id;
}

MT_API uint32_t mt_scope_push(uint32_t name_id) {
  Core& c = core();
  std::lock_guard<std::mutex> g(c.mu);
  uint32_t id = ++c.next_scope;
  if (c.open.load(std::memory_order_relaxed)) emit(c, now_ns(), SCOPE_PUSH, 0, id, 0, name_id, -1, cur_scope(c));
  c.scopes.push_back(id);
  return id;
}

// Returns the closed instance id, 0 if the stack was empty (nothing logged).
MT_API uint32_t mt_scope_pop() {
  Core& c = core();
  std::lock_guard<std::mutex> g(c.mu);
  if (c.scopes.empty()) return 0;
  uint32_t id = c.scopes.back();
  if (c.open.load(std::memory_order_relaxed)) emit(c, now_ns(), SCOPE_POP, 0, 0, 0, 0, -1, id);
  c.scopes.pop_back();
  return id;
}

MT_API uint32_t mt_current_scope() {
  Core& c = core();
  std::lock_guard<std::mutex> g(c.mu);
  return cur_scope(c);
}

MT_API void mt_mark(uint32_t name_id) {
  Core& c = core();
  std::lock_guard<std::mutex> g(c.mu);
  if (c.open.load(std::memory_order_relaxed)) emit(c, now_ns(), MARK, 0, 0, 0, name_id, -1, cur_scope(c));
}

MT_API uint64_t mt_live_bytes() {
  Core& c = core();
  std::lock_guard<std::mutex> g(c.mu);
  return c.live;
}

MT_API uint64_t mt_peak_bytes() {
  Core& c = core();
  std::lock_guard<std::mutex> g(c.mu);
  return c.peak;
}

// Peak restarts at the current live level. Logged as MARK "reset_peak" so a replay can do the same.
MT_API void mt_reset_peak() {
  uint32_t tag = mt_intern("reset_peak");
  Core& c = core();
  std::lock_guard<std::mutex> g(c.mu);
  c.peak = c.live;
  if (c.open.load(std::memory_order_relaxed)) emit(c, now_ns(), MARK, 0, 0, 0, tag, -1, cur_scope(c));
}

MT_API const char* mt_last_error() { return core().last_error.c_str(); }

// Raw loggers: the CPU-allocator hook (csrc/cpu_hook.cpp) receives these as function pointers.
MT_API void mt_log_malloc(void* p, size_t size, int device, void* stream) { log_malloc(p, size, device, stream); }
MT_API void mt_log_free(void* p, size_t size, int device, void* stream) { log_free(p, size, device, stream); }
MT_API void mt_log_malloc_fail(size_t size, int device, void* stream) {
  log_simple(MALLOC_FAIL, 0, size, device, stream);
}

// ---- CUDA backend (torch.cuda.memory.CUDAPluggableAllocator ABI) ---------------------------------

MT_API int mt_cuda_available() { return cuda().ok ? 1 : 0; }
MT_API const char* mt_cuda_source() { return cuda().where.c_str(); }

MT_API void* mt_cuda_malloc(size_t size, int device, void* stream) {
  if (size == 0) return nullptr;  // cudaMalloc(0) gives nullptr; not an allocation, not a failure
  Cuda& cu = cuda();
  void* p = nullptr;
  int err = cu.ok ? cu.malloc_(&p, size) : -1;
  if (err != 0 || !p) {
    if (cu.get_last_error) cu.get_last_error();  // clear, as torch's caching allocator does after OOM
    log_simple(MALLOC_FAIL, 0, size, device, stream);
    return nullptr;
  }
  log_malloc(p, size, device, stream);
  return p;
}

MT_API void mt_cuda_free(void* ptr, size_t size, int device, void* stream) {
  if (!ptr) return;
  log_free(ptr, size, device, stream);  // before the real free: the address cannot be reused before this
  Cuda& cu = cuda();
  if (cu.ok) cu.free_(ptr);
}

// Logs a DEVICE_MEM record (ptr = free bytes, size = total bytes). device < 0: the current device.
// Returns 0, or a CUDA error code / -1 without a runtime.
MT_API int mt_device_mem(int device) {
  Cuda& cu = cuda();
  if (!cu.ok) return -1;
  int cur = 0;
  int err = cu.get_device(&cur);
  if (err) return err;
  bool switch_dev = device >= 0 && device != cur && cu.set_device;
  if (switch_dev && (err = cu.set_device(device))) return err;
  size_t fr = 0, tot = 0;
  err = cu.mem_get_info(&fr, &tot);
  if (switch_dev) cu.set_device(cur);
  if (err) return err;
  log_simple(DEVICE_MEM, fr, tot, switch_dev ? device : cur, nullptr);
  return 0;
}

// ---- host backend (malloc) for tests and the speed benchmark -------------------------------------

MT_API void* mt_host_malloc(size_t size) {
  void* p = std::malloc(size ? size : 1);
  if (!p) { log_simple(MALLOC_FAIL, 0, size, -1, nullptr); return nullptr; }
  log_malloc(p, size, -1, nullptr);
  return p;
}

MT_API void mt_host_free(void* ptr, size_t size) {
  if (!ptr) return;
  log_free(ptr, size, -1, nullptr);
  std::free(ptr);
}

// n_events alloc+free events split over n_threads; each thread keeps a window of 64 live blocks.
// logging=0: plain malloc/free (baseline). Returns wall ns per event, or -1 if logging with no trace open.
MT_API double mt_host_bench(long n_events, int n_threads, int logging) {
  if (logging && !core().open.load()) return -1.0;
  if (n_threads < 1) n_threads = 1;
  long per_thread = n_events / n_threads / 2;  // pairs
  auto work = [per_thread, logging](unsigned seed) {
    void* win[64] = {nullptr};
    size_t sizes[64] = {0};
    uint64_t x = seed * 2654435761u + 1;
    for (long i = 0; i < per_thread; ++i) {
      x ^= x << 13; x ^= x >> 7; x ^= x << 17;
      size_t k = size_t(i & 63), sz = 16 + (x & 4095);
      if (win[k]) { if (logging) mt_host_free(win[k], sizes[k]); else std::free(win[k]); }
      win[k] = logging ? mt_host_malloc(sz) : std::malloc(sz);
      sizes[k] = sz;
    }
    for (int k = 0; k < 64; ++k)
      if (win[k]) { if (logging) mt_host_free(win[k], sizes[k]); else std::free(win[k]); }
  };
  uint64_t t = now_ns();
  std::vector<std::thread> ts;
  for (int i = 1; i < n_threads; ++i) ts.emplace_back(work, unsigned(i + 1));
  work(1u);
  for (auto& th : ts) th.join();
  double total_events = 2.0 * double(per_thread) * n_threads;
  return double(now_ns() - t) / total_events;
}
