"""Tracing side: the C++ allocator's Python bindings, scopes, the profiling launcher, trace parsing and exports."""
