"""Child process of tests/test_cuda_backend_stub.py: load the stub cudart, then drive the tracer's CUDA backend
through the C ABI torch's CUDAPluggableAllocator calls, and print what the stub saw as JSON.

    python tests/stub_cudart/drive.py STUB.so MODE TRACE_PREFIX

MODE "global": the stub is loaded RTLD_GLOBAL, so the tracer finds cudaMalloc & co. through RTLD_DEFAULT (as when
torch loaded libcudart globally). MODE "soname": a copy named libcudart.so.12 is loaded RTLD_LOCAL, so only the
tracer's search of the loaded libraries by name finds it (torch's own libcudart is loaded that way).
A separate process because the tracer binds the CUDA runtime once per process.
"""
import ctypes
import json
import os
import random
import shutil
import sys

STREAM = 0x7F00   # any non-null cudaStream_t: the tracer records it as given
FAIL_SIZE = 3 << 20


def main() -> None:
    stub_path, mode, prefix = sys.argv[1:4]
    if mode == "global":
        stub = ctypes.CDLL(stub_path, mode=ctypes.RTLD_GLOBAL)
    else:
        named = os.path.join(os.path.dirname(prefix), "libcudart.so.12")
        shutil.copyfile(stub_path, named)
        stub = ctypes.CDLL(named, mode=ctypes.RTLD_LOCAL)
    stub.stub_used.restype = stub.stub_peak.restype = ctypes.c_uint64
    stub.stub_calls_get_last_error.restype = stub.stub_calls_set_device.restype = ctypes.c_long

    from tracer import allocator as A
    A.open_trace(prefix, "cuda")
    lib = A.lib()
    assert lib.mt_cuda_available() == 1, "the tracer did not bind the stub cudart"
    # The two entry points exactly as torch calls them: dlsym'd by name, alloc(size, device, stream) and
    # free(ptr, size, device, stream) (torch/csrc/cuda/CUDAPluggableAllocator.h).
    handle = ctypes.CDLL(A.library_path())
    alloc = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)(
        ("mt_cuda_malloc", handle))
    free = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)(
        ("mt_cuda_free", handle))

    rng = random.Random(7)
    live = []
    A.mark("start")                       # + a cudaMemGetInfo reading of device 0
    for i in range(300):
        if live and rng.random() < 0.45:
            p, n = live.pop(rng.randrange(len(live)))
            free(p, n, 0, STREAM)
        else:
            n = rng.choice([512, 4096, 1 << 20, 3 * 5 * 7 * 512, rng.randrange(1, 1 << 22)])
            p = alloc(n, 0, STREAM)
            assert p, "stub cudaMalloc refused"
            live.append((p, n))
        if i == 150:
            A.mark("mid")
    assert alloc(0, 0, STREAM) is None    # size 0: no allocation, no record
    free(None, 0, 0, STREAM)               # null: nothing
    # Device 1, as torch calls it under its device guard: the tracer records the device torch passes.
    stub.cudaSetDevice(1)
    p1 = alloc(1 << 16, 1, STREAM)
    free(p1, 1 << 16, 1, STREAM)
    stub.cudaSetDevice(0)
    assert A.device_mem(1)                 # a reading of another device: the tracer switches and switches back
    stub.stub_fail_next_mallocs(1)
    assert alloc(FAIL_SIZE, 0, STREAM) is None
    A.mark("after_fail")
    for p, n in live[: len(live) // 2]:    # the rest stays live at close
        free(p, n, 0, STREAM)
    out = {"source": lib.mt_cuda_source().decode(), "tracer_peak": A.peak_bytes(), "tracer_live": A.live_bytes()}
    A.close()
    log = []
    kind, dev, a, b = ctypes.c_int(), ctypes.c_int(), ctypes.c_uint64(), ctypes.c_uint64()
    for i in range(stub.stub_log_len()):
        stub.stub_log_get(i, ctypes.byref(kind), ctypes.byref(dev), ctypes.byref(a), ctypes.byref(b))
        log.append([kind.value, dev.value, a.value, b.value])
    out.update(log=log, used=[stub.stub_used(0), stub.stub_used(1)],
               get_last_error_calls=stub.stub_calls_get_last_error(), set_device_calls=stub.stub_calls_set_device(),
               pending_error=stub.stub_pending_error(), stream=STREAM, fail_size=FAIL_SIZE)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
