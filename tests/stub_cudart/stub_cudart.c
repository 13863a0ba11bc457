/* A stand-in for libcudart exporting the six symbols csrc/tracealloc.cpp resolves with dlsym (cudaMalloc, cudaFree,
 * cudaMemGetInfo, cudaGetDevice, cudaSetDevice, cudaGetLastError), over malloc/free. tests/test_cuda_backend_stub.py
 * compiles it at test time so CI proves the CUDA backend's binding and plumbing without a GPU.
 *
 * It keeps its own log of what it was asked and what it answered (stub_log_*), so the test can compare the trace
 * the tracer wrote with what the "runtime" saw, record by record. Two fake devices; each has a fake total and a
 * fixed "context" that cudaMemGetInfo counts as used, as a real driver's context is.
 * Plain C, no headers beyond libc: cudaError_t is an int, cudaSuccess is 0. Not thread-safe (the test is not
 * threaded; the tracer's own locking is covered by tests/test_allocator.py). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define N_DEVICES 2
#define LOG_CAP 4096
#define ERR_MEMORY_ALLOCATION 2 /* cudaErrorMemoryAllocation */
#define ERR_INVALID_DEVICE 101  /* cudaErrorInvalidDevice */
#define HDR 16                  /* room before each block for its size and device (keeps 16-byte alignment) */

enum { EV_MALLOC = 1, EV_FREE = 2, EV_MALLOC_FAIL = 3, EV_MEM_GET_INFO = 7 }; /* the trace's kind codes */

struct ev { int kind, device; uint64_t a, b; }; /* MALLOC: ptr, size; FREE: ptr, size; MEM_GET_INFO: free, total */

static struct ev g_log[LOG_CAP];
static int g_n;
static int g_device;
static uint64_t g_total[N_DEVICES] = {80ull << 30, 40ull << 30};
static uint64_t g_context[N_DEVICES] = {512ull << 20, 300ull << 20};
static uint64_t g_used[N_DEVICES], g_peak[N_DEVICES];
static int g_fail_next, g_last_error;
static long g_calls_get_last_error, g_calls_set_device;

static void log_ev(int kind, int device, uint64_t a, uint64_t b) {
  if (g_n < LOG_CAP) { g_log[g_n].kind = kind; g_log[g_n].device = device; g_log[g_n].a = a; g_log[g_n].b = b; }
  g_n++;
}

int cudaMalloc(void** p, size_t size) {
  if (g_fail_next > 0) {  /* the test asked for an out-of-memory answer */
    g_fail_next--;
    *p = NULL;
    g_last_error = ERR_MEMORY_ALLOCATION;
    log_ev(EV_MALLOC_FAIL, g_device, 0, size);
    return ERR_MEMORY_ALLOCATION;
  }
  unsigned char* raw = malloc(size + HDR);
  if (!raw) { *p = NULL; g_last_error = ERR_MEMORY_ALLOCATION; return ERR_MEMORY_ALLOCATION; }
  memcpy(raw, &size, sizeof(size));
  memcpy(raw + 8, &g_device, sizeof(g_device));
  *p = raw + HDR;
  g_used[g_device] += size;
  if (g_used[g_device] > g_peak[g_device]) g_peak[g_device] = g_used[g_device];
  log_ev(EV_MALLOC, g_device, (uint64_t)(uintptr_t)*p, size);
  return 0;
}

int cudaFree(void* p) {
  if (!p) return 0;
  unsigned char* raw = (unsigned char*)p - HDR;
  size_t size;
  int dev;
  memcpy(&size, raw, sizeof(size));
  memcpy(&dev, raw + 8, sizeof(dev));
  g_used[dev] -= size;
  log_ev(EV_FREE, dev, (uint64_t)(uintptr_t)p, size);
  free(raw);
  return 0;
}

int cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
  *total_bytes = g_total[g_device];
  *free_bytes = g_total[g_device] - g_context[g_device] - g_used[g_device];
  log_ev(EV_MEM_GET_INFO, g_device, *free_bytes, *total_bytes);
  return 0;
}

int cudaGetDevice(int* device) { *device = g_device; return 0; }

int cudaSetDevice(int device) {
  g_calls_set_device++;
  if (device < 0 || device >= N_DEVICES) { g_last_error = ERR_INVALID_DEVICE; return ERR_INVALID_DEVICE; }
  g_device = device;
  return 0;
}

int cudaGetLastError(void) {  /* returns and clears, as the real one does */
  int e = g_last_error;
  g_calls_get_last_error++;
  g_last_error = 0;
  return e;
}

/* ---- control and inspection, for the test (not part of cudart) ---- */
void stub_fail_next_mallocs(int n) { g_fail_next = n; }
int stub_log_len(void) { return g_n; }
void stub_log_get(int i, int* kind, int* device, uint64_t* a, uint64_t* b) {
  *kind = g_log[i].kind; *device = g_log[i].device; *a = g_log[i].a; *b = g_log[i].b;
}
uint64_t stub_used(int device) { return g_used[device]; }
uint64_t stub_peak(int device) { return g_peak[device]; }
long stub_calls_get_last_error(void) { return g_calls_get_last_error; }
long stub_calls_set_device(void) { return g_calls_set_device; }
int stub_pending_error(void) { return g_last_error; }
