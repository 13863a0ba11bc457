"""The caching-allocator model against the rules of c10/cuda/CUDACachingAllocator.cpp (torch 2.x), on crafted
allocation sequences. Expected values are worked out by hand from the C++ source (pytorch/pytorch, read at commit
001074d; function names cited) - not from this model - so a wrong rule fails a test. Unvalidated on a GPU."""
import pytest

from estimator.caching_allocator import (AllocConfError, CachingAllocator, OutOfMemory, allocation_size,
                                         parse_alloc_conf, replay, round_size)

MiB = 1 << 20
DEFAULT = parse_alloc_conf("")


def test_round_size_512_and_allocated_counts_rounded():
    # round_size: size < kMinBlockSize (512) -> 512, else the next multiple of 512.
    assert [round_size(n, DEFAULT) for n in (1, 511, 512, 513, 1024, 1025)] == [512, 512, 512, 1024, 1024, 1536]
    m = CachingAllocator()
    m.alloc(1)
    m.alloc(513)
    # alloc_found_block: allocated_bytes += block->size (the rounded size); the small pool's first request made one
    # kSmallBuffer (2 MiB) segment (get_allocation_size) that both requests were split from (should_split, small:
    # remaining >= 512).
    assert m.stats()["allocated_bytes"] == 512 + 1024
    assert m.reserved == 2 * MiB and m.segments == 1


def test_segment_sizes():
    # get_allocation_size: <= 1 MiB -> 2 MiB; < 10 MiB -> kLargeBuffer 20 MiB; else round up to 2 MiB.
    assert allocation_size(MiB) == 2 * MiB
    assert allocation_size(MiB + 512) == 20 * MiB
    assert allocation_size(10 * MiB - 512) == 20 * MiB
    assert allocation_size(10 * MiB) == 10 * MiB
    assert allocation_size(10 * MiB + 512) == 12 * MiB


def test_small_pool_packs_2mib_segments():
    m = CachingAllocator()
    for _ in range(4):
        m.alloc(512 * 1024)          # four 512 KiB requests fill one 2 MiB segment exactly
    assert (m.reserved, m.segments) == (2 * MiB, 1)
    m.alloc(512 * 1024)              # the fifth needs a second segment
    assert (m.reserved, m.segments) == (4 * MiB, 2)


def test_small_split_keeps_a_512_byte_rest():
    m = CachingAllocator()
    m.alloc(MiB)
    m.alloc(MiB - 512)        # 512 B remain in the 2 MiB segment: split (should_split, small: remaining >= 512)
    m.alloc(512)              # ... so this fits there
    assert (m.reserved, m.allocated, m.segments) == (2 * MiB, 2 * MiB, 1)


def test_large_split_rule_and_unsplit_block_counted_whole():
    m = CachingAllocator()
    a = m.alloc(3 * MiB)             # 20 MiB segment, 17 MiB remain > kSmallSize: split (should_split, large)
    m.alloc(3 * MiB)                 # best fit: the 17 MiB remainder; no new segment
    assert (m.allocated, m.reserved) == (6 * MiB, 20 * MiB)
    m.free(a)
    # 19.5 MiB (>= 10 MiB) makes a 20 MiB segment (rounded to 2 MiB); 0.5 MiB would remain, not > 1 MiB: no split,
    # so the whole 20 MiB block is handed out and counted in allocated_bytes.
    m2 = CachingAllocator()
    m2.alloc(19 * MiB + 512 * 1024)
    assert (m2.allocated, m2.reserved) == (20 * MiB, 20 * MiB)
    # Exactly 1 MiB left is not more than kSmallSize: still unsplit.
    m3 = CachingAllocator()
    m3.alloc(19 * MiB)
    assert m3.allocated == 20 * MiB
    # Pool by rounded size: 1 MiB is small (<= kSmallSize, a 2 MiB segment), 1 MiB + 1 B is large (20 MiB).
    m4 = CachingAllocator()
    m4.alloc(MiB)
    assert m4.reserved == 2 * MiB
    m4.alloc(MiB + 1)
    assert (m4.reserved, m4.allocated) == (22 * MiB, 2 * MiB + 512)


def test_best_fit_smallest_block():
    m = CachingAllocator()
    a, b = m.alloc(40 * MiB), m.alloc(30 * MiB)
    m.free(a)
    m.free(b)
    c = m.alloc(25 * MiB)            # get_free_block: lower_bound by size -> the 30 MiB block, split (5 MiB > 1 MiB)
    assert c.size == 25 * MiB and m.reserved == 70 * MiB
    m.alloc(35 * MiB)                # the 40 MiB block; the 5 MiB remainder of the 30 MiB block was not big enough
    assert m.reserved == 70 * MiB and m.allocated == 60 * MiB


def test_freed_neighbours_merge():
    m = CachingAllocator()
    a, b = m.alloc(3 * MiB), m.alloc(3 * MiB)
    m.free(a)
    m.free(b)                        # free_block: try_merge_blocks with prev and next -> one 20 MiB free block
    m.alloc(19 * MiB)                # fits the merged block: no second segment
    assert (m.reserved, m.segments) == (20 * MiB, 1)


def test_fragmentation_reserved_far_above_allocated_and_expandable_avoids_it():
    # Growing requests, one live at a time: each new size fits no cached block (each >= 10 MiB, its own segment
    # rounded to 2 MiB), so every one is a new cudaMalloc: reserved = 12+14+16+18+20 MiB, allocated peak 20 MiB.
    events = []
    for i, mb in enumerate((12, 14, 16, 18, 20)):
        events += [("a", i, mb * MiB), ("f", i)]
    plain = replay(events)
    assert plain["peak_allocated_bytes"] == 20 * MiB
    assert plain["peak_reserved_bytes"] == (12 + 14 + 16 + 18 + 20) * MiB
    # expandable_segments: one large-pool segment mapped in 20 MiB pages; every request up to 20 MiB reuses the
    # first page (map_block maps ceil(size / 20 MiB) pages; free_block merges the block back into one).
    exp = replay(events, parse_alloc_conf("expandable_segments:True"))
    assert exp["peak_reserved_bytes"] == 20 * MiB and exp["peak_segments"] == 1
    # 25 MiB more than the mapped 20: the free block before the unmapped tail grows by one more page.
    exp2 = replay(events + [("a", 9, 25 * MiB)], parse_alloc_conf("expandable_segments:True"))
    assert exp2["reserved_bytes"] == 40 * MiB and exp2["allocated_bytes"] == 25 * MiB


def test_expandable_small_pool_pages_are_2mib():
    m = CachingAllocator(parse_alloc_conf("expandable_segments:True"))
    m.alloc(MiB)                      # small pool: 2 MiB pages (kSmallBuffer)
    m.alloc(MiB)
    assert m.reserved == 2 * MiB
    m.alloc(512)
    assert m.reserved == 4 * MiB and m.segments == 1


def test_max_split_size_oversize_blocks():
    conf = parse_alloc_conf("max_split_size_mb:100")
    m = CachingAllocator(conf)
    a = m.alloc(120 * MiB)
    m.free(a)
    # get_free_block: a request below max_split_size never takes an oversize (>= 100 MiB) cached block.
    m.alloc(90 * MiB)
    assert m.reserved == 210 * MiB
    # A request >= max_split_size takes an oversize block whole if it wastes < max_non_split_rounding (20 MiB):
    # 120 < 110 + 20, no split (size >= max_split_size), so allocated counts 120 MiB.
    m.alloc(110 * MiB)
    assert m.reserved == 210 * MiB and m.allocated == 210 * MiB
    # Without max_split_size the 120 MiB block is split for the 90 MiB request.
    m2 = CachingAllocator()
    m2.free(m2.alloc(120 * MiB))
    m2.alloc(90 * MiB)
    assert (m2.reserved, m2.allocated) == (120 * MiB, 90 * MiB)
    with pytest.raises(AllocConfError):
        parse_alloc_conf("max_split_size_mb:19")   # parseMaxSplitSize: must be >= kLargeBuffer in MB


def test_release_cached_and_retry_at_limit():
    m = CachingAllocator(limit=40 * MiB)
    m.free(m.alloc(30 * MiB))
    # 32 MiB fits no cached block; 30 + 32 > 40: alloc_block fails, release_cached_blocks frees the unsplit cached
    # 30 MiB segment, the retry succeeds.
    m.alloc(32 * MiB)
    assert (m.reserved, m.peak_reserved, m.num_alloc_retries, m.segments) == (32 * MiB, 32 * MiB, 1, 1)
    # 9 MiB wants a 20 MiB segment: 52 > 40 and nothing cached to free: out of memory.
    with pytest.raises(OutOfMemory):
        m.alloc(9 * MiB)
    assert m.num_ooms == 1


def test_release_available_oversize_first():
    m = CachingAllocator(parse_alloc_conf("max_split_size_mb:40"), limit=120 * MiB)
    m.free(m.alloc(50 * MiB))
    m.free(m.alloc(60 * MiB))
    # 55 MiB request (>= max_split): best fit is the 60 MiB block, wasting 5 < 20 MiB: taken whole, unsplit.
    b = m.alloc(55 * MiB)
    assert m.reserved == 110 * MiB and b.size == 60 * MiB and m.allocated == 60 * MiB
    m.free(b)
    # 30 MiB (< max_split) takes no oversize block; 110 + 30 > 120: release_available_cached_blocks frees the
    # smallest oversize block >= max(30, 40) MiB (the 50 MiB one) and the first retry succeeds (no full release).
    m.alloc(30 * MiB)
    assert (m.reserved, m.num_alloc_retries) == (90 * MiB, 0)
    assert m.pools[1].keys == [(60 * MiB, b.ptr)]   # the 60 MiB block stayed cached


def test_expandable_unmaps_free_pages_at_limit():
    conf = parse_alloc_conf("expandable_segments:True")
    m = CachingAllocator(conf, limit=60 * MiB)
    a = m.alloc(30 * MiB)            # maps two 20 MiB pages: [0, 40)
    m.alloc(8 * MiB)                 # from the 10 MiB free block after a (split: remaining >= 512 when expandable)
    m.free(a)                        # [0,30) free, [30,38) allocated, [38,40) free
    assert m.reserved == 40 * MiB
    # 35 MiB (rounded 36 MiB for the limit check): 40 + 36 > 60 fails; release_cached_blocks unmaps the fully free
    # page [0,20) (reserved 20); the retry finds the free [38,40) before the unmapped tail and maps 40 MiB more.
    m.alloc(35 * MiB)
    assert (m.reserved, m.allocated, m.num_alloc_retries) == (60 * MiB, 43 * MiB, 1)


def test_roundup_power2_divisions():
    conf = parse_alloc_conf("roundup_power2_divisions:4")
    # 1.2 MiB lies in [1, 2) MiB; 4 divisions: 1, 1.25, 1.5, 1.75 MiB -> 1.25 MiB (roundup_power2_next_division).
    assert round_size(1258291, conf) == 1310720
    assert round_size(1258291, DEFAULT) == 1258496
    # Below kMinBlockSize * divisions the 512 B rule applies.
    assert round_size(1200, conf) == 1536
    conf2 = parse_alloc_conf("roundup_power2_divisions:[256:1,>:4]")
    assert round_size(1258291, conf2) == 1258496        # intervals up to 256 MiB: 1 division (off)
    # '>' fills from the last listed interval on, that one included (parseRoundUpPower2Divisions):
    # [256, 512) MiB in 4 divisions: 256, 320, 384, 448.
    assert round_size(300 * MiB + 1, conf2) == 320 * MiB


def test_garbage_collection_threshold():
    # Only with a device limit (torch: a memory fraction). 60 MiB cached > 0.5 x 100 MiB: before a new segment,
    # garbage_collect_cached_blocks releases unsplit large cached blocks of at least the average age (here both).
    events = [("a", 1, 30 * MiB), ("a", 2, 30 * MiB), ("f", 1), ("f", 2), ("a", 3, 40 * MiB)]
    gc = replay(events, parse_alloc_conf("garbage_collection_threshold:0.5"), limit=100 * MiB)
    assert gc["reserved_bytes"] == 40 * MiB
    assert replay(events, limit=100 * MiB)["reserved_bytes"] == 100 * MiB


def test_conf_parsing_errors_and_ignored_keys():
    c = parse_alloc_conf("backend:native, expandable_segments:True,pinned_use_background_threads:True")
    assert c.expandable
    for bad in ("expandable_segments", "expandable_segments:true", "roundup_power2_divisions:3",
                "garbage_collection_threshold:1.5", "max_split_size_mb:abc"):
        with pytest.raises(AllocConfError):
            parse_alloc_conf(bad)


def test_default_fast_path_equals_the_general_rules():
    # alloc() takes a shorter path under the default settings; forced off, the general path must agree event by
    # event on a random stream across both pools, with splits, merges and new segments.
    import random
    rng = random.Random(7)
    fast, slow = CachingAllocator(), CachingAllocator()
    slow._plain = False
    live = []
    for _ in range(4000):
        if live and rng.random() < 0.45:
            a, b = live.pop(rng.randrange(len(live)))
            fast.free(a)
            slow.free(b)
        else:
            n = rng.choice([rng.randrange(1, 4096), rng.randrange(1, 2 * MiB), rng.randrange(MiB, 40 * MiB)])
            live.append((fast.alloc(n), slow.alloc(n)))
        assert (fast.allocated, fast.reserved, fast.segments) == (slow.allocated, slow.reserved, slow.segments)
    assert fast.stats() == slow.stats() and fast.peak_reserved > fast.peak_allocated
