"""Install: the estimator needs only numpy; profiling (tracer) needs torch and megatron-core (extra `profile`).

The C++ tracing allocator is an optional extension: it is built as a plain shared library (no torch, no CUDA
headers). If the build fails, installation still succeeds and `tracer.allocator` compiles it on first use
(or says clearly why it cannot).
"""
from setuptools import Extension, find_packages, setup

tracealloc = Extension(
    "tracer._tracealloc",
    sources=["csrc/tracealloc.cpp"],
    extra_compile_args=["-O2", "-std=c++17", "-fvisibility=hidden"],
    libraries=["dl", "pthread"],
    optional=True,
)

# The caching-allocator replay under torch's default settings (estimator.caching_allocator.replay), in C: optional,
# the estimator replays in Python where it is missing (slower on large layouts, the same numbers).
replay = Extension("estimator._replay", sources=["csrc/replay.c"], extra_compile_args=["-O2"], optional=True)

setup(
    name="megatron-memtrace",
    version="0.1.0",
    description="Measured memory and communication estimates for Megatron-LM training",
    python_requires=">=3.9",
    packages=find_packages(include=["estimator*", "tracer*", "fit*"]),
    py_modules=["get_training_info"],
    package_data={"fit": ["sets/*.json"], "estimator": ["presets/*.json", "formula_sets/*.json"]},
    include_package_data=True,
    ext_modules=[tracealloc, replay],
    install_requires=["numpy>=1.21"],
    extras_require={
        "profile": ["torch>=2.1,<3", "megatron-core>=0.9,<1", "matplotlib>=3.5"],
        "fit": ["scipy>=1.7"],
    },
    # Drop-ins for the word `torchrun` in a launch script (README section 1): estimate, and profile under torchrun.
    entry_points={"console_scripts": ["get-training-info=estimator.cli:console_main",
                                      "profile-training-info=tracer.launch:main"]},
)
