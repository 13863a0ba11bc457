"""A model of PyTorch's CUDA caching allocator, replayed over a stream of alloc/free events (no torch).

The rules are those of c10/cuda/CUDACachingAllocator.cpp (torch 2.x; read at pytorch/pytorch commit 001074d,
constants and config defaults checked against the c10/core/AllocatorConfig.h that torch 2.13 installs); the code is
our own. What it models, each rule named after the C++ function that applies it:
- round_size: requests round up to a multiple of 512 B (at least 512), or with `roundup_power2_divisions` to the
  next of N equal divisions between two powers of two; `allocated_bytes` counts the *block* handed out, which is
  the rounded size or, where the block was not split, the whole cached block (alloc_found_block).
- get_pool / get_allocation_size: requests <= 1 MiB use the small pool and new 2 MiB segments; larger ones the
  large pool, with 20 MiB segments for requests < 10 MiB and the request rounded up to 2 MiB otherwise.
- get_free_block: best fit, the smallest cached block of the pool with size >= request (ties: lowest address);
  with `max_split_size_mb` a request below it never takes an oversize block, and a request at or above it takes a
  block only if it wastes less than `max_non_split_rounding_mb` (20 MiB by default).
- should_split: a small-pool block (or any block under expandable segments) is split when >= 512 B remain; a
  large-pool block when the request is below max_split_size and more than 1 MiB remains.
- free_block / try_merge_blocks: a freed block merges with free neighbours of its segment.
- alloc_block / release_available_cached_blocks / release_cached_blocks: a new segment is made when no cached
  block fits; at the device limit the allocator frees oversize cached blocks (with max_split_size), then every
  unsplit cached segment (and unmaps every free page of expandable segments), then retries; still too big: OOM.
- garbage_collection_threshold (only with a device limit, as torch applies it only with a memory fraction):
  before a new segment, while reserved exceeds threshold x limit, unsplit large cached segments at or above the
  average age (get_free_block calls since they were cached) are released.
- expandable_segments:True (find_expandable_block / map_block / try_allocate_expandable_block): one segment of
  reserved address space per pool (single stream), mapped in pages of 2 MiB (small pool) or 20 MiB (large pool,
  `large_segment_size`); a request no cached block fits maps just enough pages at the lowest address where free
  plus unmapped space fits it (normally the end), merging with the free block before it; best fit counts a block
  followed by unmapped space as that large. Pages are unmapped only when the device limit is hit.

Simplifications, said plainly: one stream (no cross-stream uses, events or graph pools); segment addresses are a
bump pointer (cudaMalloc's real addresses only break ties between equal-size cached blocks); the device limit,
when given, is a cap on reserved bytes (what set_per_process_memory_fraction checks; a real cudaMalloc fails
against what is free on the device). Checked against a GPU: replaying the request streams PyTorch's allocator
recorded on 12 H100 runs gives their max_memory_allocated and max_memory_reserved to the byte
(tests/test_gpu_validation.py); tests/test_caching_allocator.py checks the
rules on crafted sequences with values derived from the C++ source.
"""
from __future__ import annotations

from typing import Optional

from bisect import bisect_left, insort

MiB = 1 << 20
K_MIN_BLOCK = 512            # kMinBlockSize
K_SMALL_SIZE = MiB           # kSmallSize: largest small-pool request
K_SMALL_BUFFER = 2 * MiB     # kSmallBuffer: small segment, and the small pool's expandable page
K_MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc
K_ROUND_LARGE = 2 * MiB      # kRoundLarge
K_LARGE_BUFFER = 20 * MiB    # kLargeBuffer (large_segment_size default): 1-10 MiB segments, large expandable page
INF = float("inf")
_INTERVALS = 16              # roundup_power2_divisions: one entry per power of two from 1 MiB to 64 GiB


class AllocConfError(ValueError):
    pass


class AllocatorConfig:
    """The PYTORCH_CUDA_ALLOC_CONF settings that change reserved memory, with torch's defaults."""
    __slots__ = ("max_split_size", "max_non_split_rounding", "divisions", "gc_threshold", "expandable",
                 "large_segment_size", "text")

    def __init__(self):
        self.max_split_size = INF              # max_split_size_mb (unlimited)
        self.max_non_split_rounding = K_LARGE_BUFFER  # max_non_split_rounding_mb (20)
        self.divisions = [0] * _INTERVALS      # roundup_power2_divisions (off)
        self.gc_threshold = 0.0                # garbage_collection_threshold (off)
        self.expandable = False                # expandable_segments
        self.large_segment_size = K_LARGE_BUFFER
        self.text = ""

    def to_dict(self) -> dict:
        return {"conf": self.text, "expandable_segments": self.expandable,
                "max_split_size_mb": None if self.max_split_size == INF else self.max_split_size // MiB,
                "max_non_split_rounding_mb": self.max_non_split_rounding // MiB,
                "roundup_power2_divisions": list(self.divisions) if any(self.divisions) else None,
                "garbage_collection_threshold": self.gc_threshold or None}

    def plain_rules(self) -> bool:
        """No setting that changes a rule: no roundup divisions, expandable segments or max_split_size (garbage
        collection acts only under a device limit)."""
        return not any(self.divisions) and not self.expandable and self.max_split_size == INF

    def round_divisions(self, size: int) -> int:
        """AcceleratorAllocatorConfig::roundup_power2_divisions(size): the entry of size's power-of-two interval."""
        log = size.bit_length() - 1
        return self.divisions[min(max(log - 20, 0), _INTERVALS - 1)]


def parse_alloc_conf(text: str) -> AllocatorConfig:
    """`key:value,...` as PYTORCH_CUDA_ALLOC_CONF; keys that do not change reserved memory (backend,
    pinned_*, release_lock_on_cudamalloc, ...) are accepted and ignored."""
    cfg = AllocatorConfig()
    cfg.text = text or ""
    tokens = _tokens(cfg.text)
    i = 0
    while i < len(tokens):
        key = tokens[i]
        if i + 2 >= len(tokens) or tokens[i + 1] != ":":
            raise AllocConfError(f"PYTORCH_CUDA_ALLOC_CONF: '{key}' needs a value (key:value)")
        i += 2
        if tokens[i] == "[":
            j = tokens.index("]", i) if "]" in tokens[i:] else -1
            if j < 0:
                raise AllocConfError("PYTORCH_CUDA_ALLOC_CONF: unclosed '['")
            value, i = tokens[i + 1:j], j + 1
        else:
            value, i = tokens[i], i + 1
        _apply(cfg, key, value)
        if i < len(tokens):
            if tokens[i] != ",":
                raise AllocConfError(f"PYTORCH_CUDA_ALLOC_CONF: expected ',' after '{key}'")
            i += 1
    return cfg


def _tokens(text: str) -> list:
    out, buf = [], ""
    for ch in text:
        if ch in ",:[]":
            if buf.strip():
                out.append(buf.strip())
            out.append(ch)
            buf = ""
        else:
            buf += ch
    if buf.strip():
        out.append(buf.strip())
    return out


def _number(key: str, v, kind=float):
    try:
        return kind(v)
    except (TypeError, ValueError):
        raise AllocConfError(f"PYTORCH_CUDA_ALLOC_CONF: {key} needs a number, got {v!r}") from None


def _megabytes_from_20(key: str, value) -> int:
    """A size option in MB that torch takes only from kLargeBuffer (20 MB) on, in bytes."""
    mb = _number(key, value, int)
    if mb < K_LARGE_BUFFER // MiB:
        raise AllocConfError(f"PYTORCH_CUDA_ALLOC_CONF: {key} too small, must be >= {K_LARGE_BUFFER // MiB}")
    return mb * MiB


def _apply(cfg: AllocatorConfig, key: str, value) -> None:
    if key == "max_split_size_mb":
        # parseMaxSplitSize: at least kLargeBuffer in MB, so a 1-10 MiB request's segment is never oversize.
        cfg.max_split_size = _megabytes_from_20(key, value)
    elif key == "max_non_split_rounding_mb":
        cfg.max_non_split_rounding = _megabytes_from_20(key, value)
    elif key == "garbage_collection_threshold":
        t = _number(key, value)
        if not 0.0 < t < 1.0:
            raise AllocConfError("PYTORCH_CUDA_ALLOC_CONF: garbage_collection_threshold must be in (0.0, 1.0)")
        cfg.gc_threshold = t
    elif key == "expandable_segments":
        if value not in ("True", "False"):   # torch takes exactly these spellings
            raise AllocConfError("PYTORCH_CUDA_ALLOC_CONF: expandable_segments must be True or False")
        cfg.expandable = value == "True"
    elif key == "roundup_power2_divisions":
        cfg.divisions = _divisions(value)
    elif key == "large_segment_size_mb":
        cfg.large_segment_size = _number(key, value, int) * MiB


def _divisions(value) -> list:
    """roundup_power2_divisions: one number for every interval, or [MB:N, ..., >:N], MB naming the interval
    [MB, 2 MB) (parseRoundUpPower2Divisions: the intervals before the first listed one take its value; '>' fills
    from the last listed interval, that one included, to the end)."""
    out = [0] * _INTERVALS
    if not isinstance(value, list):
        n = _number("roundup_power2_divisions", value, int)
        _check_pow2(n)
        return [n] * _INTERVALS
    items = [t for t in value if t != ","]
    if len(items) % 3:
        raise AllocConfError("PYTORCH_CUDA_ALLOC_CONF: roundup_power2_divisions wants [MB:N, ...]")
    last, first = 0, True
    for k in range(0, len(items), 3):
        bound, colon, n = items[k:k + 3]
        n = _number("roundup_power2_divisions", n, int)
        _check_pow2(n)
        if colon != ":":
            raise AllocConfError("PYTORCH_CUDA_ALLOC_CONF: roundup_power2_divisions wants [MB:N, ...]")
        if bound == ">":
            out[last:] = [n] * (_INTERVALS - last)
            continue
        mb = _number("roundup_power2_divisions", bound, int)
        if mb <= 0 or mb & (mb - 1):
            raise AllocConfError("PYTORCH_CUDA_ALLOC_CONF: roundup_power2_divisions bounds must be powers of 2 (MB)")
        idx = min(mb.bit_length() - 1, _INTERVALS - 1)
        if first:
            out[:idx] = [n] * idx
            first = False
        out[idx] = n
        last = idx
    return out


def _check_pow2(n: int) -> None:
    if n != 0 and (n < 0 or n & (n - 1)):
        raise AllocConfError("PYTORCH_CUDA_ALLOC_CONF: roundup_power2_divisions must be a power of 2")


class OutOfMemory(Exception):
    pass


class _Block:
    __slots__ = ("ptr", "size", "small", "allocated", "prev", "next", "mapped", "seg", "gc_base")

    def __init__(self, ptr, size, small, seg=None, mapped=True):
        self.ptr, self.size, self.small = ptr, size, small
        self.allocated, self.prev, self.next = False, None, None
        self.mapped, self.seg, self.gc_base = mapped, seg, 0

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


class _Pool:
    """Cached free blocks of one pool ordered by (size, address), plus expandable segments' unmapped ranges."""
    __slots__ = ("small", "keys", "by_key", "unmapped", "calls")

    def __init__(self, small: bool):
        self.small = small
        self.keys: list = []         # sorted (size, ptr)
        self.by_key: dict = {}
        self.unmapped: dict = {}     # ptr -> unmapped block (expandable segments)
        self.calls = 0               # get_free_blocks_call_count (garbage collection ages)

    def insert(self, b: _Block) -> None:
        b.gc_base = self.calls
        k = (b.size, b.ptr)
        insort(self.keys, k)
        self.by_key[k] = b

    def remove(self, b: _Block) -> None:
        k = (b.size, b.ptr)
        i = bisect_left(self.keys, k)
        del self.keys[i]
        del self.by_key[k]


def round_size(size: int, conf: AllocatorConfig) -> int:
    """CUDACachingAllocator round_size (+ roundup_power2_next_division)."""
    if size < K_MIN_BLOCK:
        return K_MIN_BLOCK
    div = conf.round_divisions(size)
    if div > 1 and size > K_MIN_BLOCK * div:
        if size & (size - 1) == 0:
            return size
        floor = 1 << (size.bit_length() - 1)
        step = floor >> (div.bit_length() - 1)
        if step == 0:
            return floor << 1
        low = size & ~(step - 1)
        return size if low == size else low + step
    return -(-size // K_MIN_BLOCK) * K_MIN_BLOCK


def allocation_size(size: int) -> int:
    """get_allocation_size: the segment a rounded request makes when nothing cached fits."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE


class CachingAllocator:
    """alloc(size) -> handle, free(handle); `allocated` / `reserved` now and their peaks, segments, retries.
    limit: device bytes the allocator may reserve (None: unlimited, reserved grows as the rules make it)."""

    def __init__(self, conf: Optional[AllocatorConfig] = None, limit: Optional[int] = None):
        self.conf = conf or AllocatorConfig()
        self.limit = limit
        self.pools = (_Pool(True), _Pool(False))   # small, large
        self.allocated = self.reserved = 0
        self.peak_allocated = self.peak_reserved = 0
        self.segments = self.peak_segments = 0     # cudaMalloc'd segments + expandable segments
        self.num_alloc_retries = self.num_ooms = 0
        self._next_ptr = 1 << 32
        self._esegs: dict = {}                     # small flag -> its expandable segment id (one stream)
        self._plain_round = not any(self.conf.divisions)   # round_size is then the 512 B rule alone
        self._gc = self.conf.gc_threshold > 0 and limit is not None
        # The default settings: no oversize rules, no garbage collection, no expandable segments. alloc() then
        # takes a shorter path to the same result (the general one stays the reference: tests compare them).
        self._plain = self.conf.plain_rules() and not self._gc

    # ---- public
    def alloc(self, size: int) -> _Block:
        size = int(size)
        if self._plain:
            block = self._alloc_plain(size)
            if block is not None:
                return block
        if self._plain_round:
            size = K_MIN_BLOCK if size < K_MIN_BLOCK else -(-size // K_MIN_BLOCK) * K_MIN_BLOCK
        else:
            size = round_size(size, self.conf)
        pool = self.pools[0] if size <= K_SMALL_SIZE else self.pools[1]
        block = self._get_free_block(pool, size)
        if block is None:
            alloc_size = allocation_size(size)
            if self._gc:
                self._garbage_collect()
            block = self._alloc_block(pool, size, alloc_size)
            if block is None and self._release_available(pool, size):
                block = self._alloc_block(pool, size, alloc_size)
            if block is None:
                self._release_cached()
                self.num_alloc_retries += 1
                block = self._alloc_block(pool, size, alloc_size)
            if block is None:
                self.num_ooms += 1
                raise OutOfMemory(f"tried to allocate {size} B with {self.reserved} B reserved "
                                  f"of {self.limit} B allowed ({self.allocated} B allocated)")
        if self._should_split(block, size):
            rest = _Block(block.ptr + size, block.size - size, block.small, block.seg)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            pool.insert(rest)
        block.allocated = True
        self.allocated += block.size
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        return block

    def _alloc_plain(self, size: int) -> Optional[_Block]:
        """alloc() under the default settings when a cached block fits: best fit, split, count (no new segment)."""
        size = K_MIN_BLOCK if size < K_MIN_BLOCK else -(-size // K_MIN_BLOCK) * K_MIN_BLOCK
        small = size <= K_SMALL_SIZE
        pool = self.pools[0] if small else self.pools[1]
        keys = pool.keys
        i = bisect_left(keys, (size, -1))
        if i == len(keys):
            return None
        key = keys.pop(i)
        block = pool.by_key.pop(key)
        rest_size = block.size - size
        if rest_size >= K_MIN_BLOCK if small else rest_size > K_SMALL_SIZE:
            rest = _Block(block.ptr + size, rest_size, small)
            nxt = block.next
            rest.prev, rest.next = block, nxt
            if nxt is not None:
                nxt.prev = rest
            block.next = rest
            block.size = size
            k = (rest_size, rest.ptr)
            insort(keys, k)
            pool.by_key[k] = rest
        block.allocated = True
        self.allocated += block.size
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        return block

    def free(self, block: _Block) -> None:
        block.allocated = False
        self.allocated -= block.size
        pool = self.pools[0] if block.small else self.pools[1]
        prev, nxt = block.prev, block.next
        if prev is not None and not prev.allocated:
            self._merge(block, prev, pool)
        if nxt is not None and not nxt.allocated:
            self._merge(block, nxt, pool)
        pool.insert(block)

    def empty_cache(self) -> None:
        self._release_cached()

    def stats(self) -> dict:
        return {"allocated_bytes": self.allocated, "reserved_bytes": self.reserved,
                "peak_allocated_bytes": self.peak_allocated, "peak_reserved_bytes": self.peak_reserved,
                "segments": self.segments, "peak_segments": self.peak_segments,
                "num_alloc_retries": self.num_alloc_retries, "num_ooms": self.num_ooms}

    # ---- search and split
    def _get_free_block(self, pool: _Pool, size: int) -> Optional[_Block]:
        conf = self.conf
        if self._gc:
            pool.calls += 1
        keys = pool.keys
        i = bisect_left(keys, (size, -1))
        if i == len(keys):
            return None
        b = pool.by_key[keys[i]]
        if b.seg is not None:
            # A free block followed by unmapped space counts as the size it can grow to (get_free_block).
            def grow(x):
                return x.size + (x.next.size if x.next is not None and not x.next.mapped else 0)
            while b.seg is not None and i + 1 < len(keys) and grow(pool.by_key[keys[i + 1]]) < grow(b):
                i += 1
                b = pool.by_key[keys[i]]
        if size < conf.max_split_size and b.size >= conf.max_split_size:
            return None   # no oversize block for a request below max_split_size
        if size >= conf.max_split_size and b.size >= size + conf.max_non_split_rounding:
            return None   # an oversize block may be taken whole, wasting less than max_non_split_rounding
        pool.remove(b)
        return b

    def _should_split(self, block: _Block, size: int) -> bool:
        remaining = block.size - size
        if block.small or self.conf.expandable:
            return remaining >= K_MIN_BLOCK
        return size < self.conf.max_split_size and remaining > K_SMALL_SIZE

    def _merge(self, dst: _Block, src: Optional[_Block], pool: _Pool) -> int:
        """try_merge_blocks: dst absorbs a free neighbour of the same mapped state."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return 0
        if src.mapped:
            pool.remove(src)
        else:
            del pool.unmapped[src.ptr]
        if dst.prev is src:
            dst.ptr = src.ptr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        return src.size

    # ---- new memory
    def _grow_reserved(self, n: int) -> None:
        self.reserved += n
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved

    def _count_segment(self, d: int) -> None:
        self.segments += d
        if self.segments > self.peak_segments:
            self.peak_segments = self.segments

    def _alloc_block(self, pool: _Pool, size: int, alloc_size: int) -> Optional[_Block]:
        if self.limit is not None and self.reserved + alloc_size > self.limit:
            return None   # the memory-fraction check uses the non-expandable segment size in either mode
        if self.conf.expandable:
            return self._alloc_expandable(pool, size)
        b = _Block(self._next_ptr, alloc_size, pool.small)
        self._next_ptr += alloc_size + K_ROUND_LARGE
        self._grow_reserved(alloc_size)
        self._count_segment(1)
        return b

    def _page(self, pool: _Pool) -> int:
        return K_SMALL_BUFFER if pool.small else self.conf.large_segment_size

    def _alloc_expandable(self, pool: _Pool, size: int) -> Optional[_Block]:
        c = self._find_expandable(pool, size)
        if not c.mapped and not self._map(c, min(c.size, size), pool):
            return None
        while c.size < size:
            nxt = c.next
            if not self._map(nxt, min(size - c.size, nxt.size), pool):
                return None
            c = nxt   # map merged it with c
        pool.remove(c)
        return c

    def _find_expandable(self, pool: _Pool, size: int) -> _Block:
        """Lowest-address unmapped range (with the free block before it) holding `size`; else a new segment."""
        for ptr in sorted(pool.unmapped):
            c = pool.unmapped[ptr]
            if c.prev is not None and not c.prev.allocated:
                c = c.prev
            room, x = 0, c
            while room < size and x is not None and not x.allocated:
                room += x.size
                x = x.next
            if room >= size:
                return c
        # A new segment: address space for 1 1/8 of the device (here: of the limit, else 1 TiB), nothing mapped.
        span = (self.limit + self.limit // 8) if self.limit else (1 << 40)
        span = -(-span // self._page(pool)) * self._page(pool)
        seg = len(self._esegs) + 1
        self._esegs[seg] = pool.small
        c = _Block(self._next_ptr, span, pool.small, seg, mapped=False)
        self._next_ptr += span + K_ROUND_LARGE
        pool.unmapped[c.ptr] = c
        self._count_segment(1)
        return c

    def _map(self, b: _Block, size: int, pool: _Pool) -> bool:
        """map_block: map the pages covering [b.ptr, b.ptr + size) (b starts on a page)."""
        page = self._page(pool)
        n = -(-size // page) * page
        if self.limit is not None and self.reserved + n > self.limit:
            return False
        del pool.unmapped[b.ptr]
        b.mapped = True
        if n < b.size:
            rest = _Block(b.ptr + n, b.size - n, b.small, b.seg, mapped=False)
            rest.prev, rest.next = b, b.next
            if b.next is not None:
                b.next.prev = rest
            b.next = rest
            b.size = n
            pool.unmapped[rest.ptr] = rest
        self._merge(b, b.prev, pool)
        self._merge(b, b.next, pool)
        pool.insert(b)
        self._grow_reserved(n)
        return True

    # ---- giving memory back
    def _release_block(self, b: _Block, pool: _Pool) -> None:
        pool.remove(b)
        self.reserved -= b.size
        self._count_segment(-1)

    def _release_available(self, pool: _Pool, size: int) -> bool:
        """release_available_cached_blocks: free oversize cached blocks, just enough for the request."""
        ms = self.conf.max_split_size
        if ms == INF:
            return False
        key = max(size, ms)
        keys = pool.keys
        i = bisect_left(keys, (key, -1))
        if i < len(keys):
            self._release_block(pool.by_key[keys[i]], pool)
            return True
        released = 0
        i -= 1
        while i >= 0 and released < key and keys[i][0] >= ms:
            b = pool.by_key[keys[i]]
            released += b.size
            self._release_block(b, pool)
            i -= 1
        return released >= key

    def _release_cached(self) -> None:
        """release_cached_blocks: every unsplit cached segment back to the device; free pages unmapped."""
        for pool in self.pools:
            unmap = []
            for k in list(pool.keys):
                b = pool.by_key[k]
                if b.seg is not None:
                    unmap.append(b)
                elif not b.is_split():
                    self._release_block(b, pool)
            for b in unmap:
                self._unmap(b, pool)

    def _unmap(self, b: _Block, pool: _Pool) -> None:
        page = self._page(pool)
        base = self._seg_base(b)
        lo = base + -(-(b.ptr - base) // page) * page
        hi = base + ((b.ptr + b.size - base) // page) * page
        if lo >= hi:
            return
        pool.remove(b)
        if lo > b.ptr:
            before = _Block(b.ptr, lo - b.ptr, b.small, b.seg)
            before.prev, before.next = b.prev, b
            if b.prev is not None:
                b.prev.next = before
            b.prev = before
            pool.insert(before)
        if b.ptr + b.size > hi:
            after = _Block(hi, b.ptr + b.size - hi, b.small, b.seg)
            after.prev, after.next = b, b.next
            if b.next is not None:
                b.next.prev = after
            b.next = after
            pool.insert(after)
        b.ptr, b.size, b.mapped = lo, hi - lo, False
        self._merge(b, b.prev, pool)
        self._merge(b, b.next, pool)
        pool.unmapped[b.ptr] = b
        self.reserved -= hi - lo
        if not b.is_split():   # the whole segment is unmapped: its address space goes back too
            del pool.unmapped[b.ptr]
            self._count_segment(-1)

    @staticmethod
    def _seg_base(b: _Block) -> int:
        while b.prev is not None:
            b = b.prev
        return b.ptr

    def _garbage_collect(self) -> None:
        """garbage_collect_cached_blocks: release old unsplit large cached segments down to threshold x limit."""
        threshold = int(self.conf.gc_threshold * self.limit)
        if self.reserved <= threshold:
            return
        target, reclaimed = self.reserved - threshold, 0
        pool = self.pools[1]
        free = [pool.by_key[k] for k in pool.keys if not pool.by_key[k].is_split() and pool.by_key[k].seg is None]
        if not free:
            return
        total_age = sum(pool.calls - b.gc_base for b in free)
        count = len(free)
        freed = True
        while reclaimed < target and freed and count > 0:
            threshold_age = total_age / count
            freed = False
            for k in list(pool.keys):
                b = pool.by_key.get(k)
                if b is None or b.is_split() or b.seg is not None:
                    continue
                age = pool.calls - b.gc_base
                if age >= threshold_age:
                    freed = True
                    reclaimed += b.size
                    total_age -= age
                    count -= 1
                    self._release_block(b, pool)


try:   # the same replay under the default settings, in C (csrc/replay.c; built by setup.py where a compiler is)
    from estimator import _replay as _accelerated
except ImportError:
    _accelerated = None


def replay(events, conf: Optional[AllocatorConfig] = None, limit: Optional[int] = None,
           timeline: bool = False, accelerated: bool = True) -> dict:
    """Replay ("a", id, size) / ("f", id) events; stats() plus, with timeline, [(allocated, reserved)] per event.
    A free of an unknown id is ignored (a trace may start with tensors allocated before it). accelerated: under
    torch's default settings with no limit, replay in C where the extension is built (the same numbers; the class
    below is the reference, tests/test_replay_accelerated.py)."""
    plain = conf is None or conf.plain_rules()
    if accelerated and _accelerated is not None and plain and limit is None and not timeline:
        try:
            allocated, reserved, peak_allocated, peak_reserved, segments, peak_segments = \
                _accelerated.replay_default(events)
        except NotImplementedError:   # ids or sizes that are not plain ints: the class handles them
            pass
        else:
            return {"allocated_bytes": allocated, "reserved_bytes": reserved, "peak_allocated_bytes": peak_allocated,
                    "peak_reserved_bytes": peak_reserved, "segments": segments, "peak_segments": peak_segments,
                    "num_alloc_retries": 0, "num_ooms": 0}
    m = CachingAllocator(conf, limit)
    live: dict = {}
    tl = [] if timeline else None
    alloc, free, pop = m.alloc, m.free, live.pop
    for ev in events:
        if ev[0] == "a":
            live[ev[1]] = alloc(ev[2])
        else:
            b = pop(ev[1], None)
            if b is not None:
                free(b)
        if tl is not None:
            tl.append((m.allocated, m.reserved))
    out = m.stats()
    if tl is not None:
        out["timeline"] = tl
    return out
