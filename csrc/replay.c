/* estimator._replay: caching_allocator.replay for torch's default allocator settings, in C.
 *
 * The same rules as estimator/caching_allocator.py's CachingAllocator under the default PYTORCH_CUDA_ALLOC_CONF
 * (no device limit, no roundup divisions, no max_split_size, no garbage collection, no expandable segments):
 * requests round up to 512 B; <= 1 MiB goes to the small pool (2 MiB segments), larger to the large pool (20 MiB
 * segments below 10 MiB, else rounded up to 2 MiB); best fit by (size, address); a small block splits when
 * >= 512 B remain, a large one when > 1 MiB remains; a freed block merges with free neighbours of its segment.
 * The Python class stays the reference (tests/test_replay_accelerated.py compares the two on random and predicted
 * streams); this one exists because a predicted stream has 10^5 - 10^6 events per stage and the estimator's
 * single estimate spends nearly all of its time replaying them.
 *
 * replay_default(events) -> (allocated, reserved, peak_allocated, peak_reserved, segments, peak_segments)
 * events: a sequence of ("a", id, size) / ("f", id) tuples, ids and sizes Python ints; a free of an unknown id
 * is ignored. Raises NotImplementedError for anything else (the caller then replays in Python).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MIB (1LL << 20)
#define K_MIN_BLOCK 512LL
#define K_SMALL_SIZE MIB
#define K_SMALL_BUFFER (2 * MIB)
#define K_MIN_LARGE_ALLOC (10 * MIB)
#define K_ROUND_LARGE (2 * MIB)
#define K_LARGE_BUFFER (20 * MIB)

typedef struct {
    int64_t ptr, size;
    int32_t prev, next; /* neighbours in the segment, -1: none */
    uint8_t allocated, small;
} Block;

typedef struct { int64_t size, ptr; int32_t block; } Key;

typedef struct { Key *keys; Py_ssize_t n, cap; } Pool;

typedef struct {
    Block *blocks; int32_t n, cap;
    int32_t *spare; int32_t nspare, capspare; /* indices of merged-away blocks, reused */
    Pool pools[2];                             /* small, large */
    int64_t allocated, reserved, peak_allocated, peak_reserved, segments, peak_segments, next_ptr;
} Alloc;

/* ---- id -> block: open addressing, linear probing, backward-shift deletion */
typedef struct { int64_t *ids; int32_t *vals; uint8_t *used; size_t mask; } Map;

static int map_init(Map *m, size_t expect) {
    size_t cap = 16;
    while (cap < 2 * expect + 16) cap <<= 1;
    m->ids = malloc(cap * sizeof(int64_t));
    m->vals = malloc(cap * sizeof(int32_t));
    m->used = calloc(cap, 1);
    m->mask = cap - 1;
    return m->ids && m->vals && m->used;
}

static void map_free(Map *m) { free(m->ids); free(m->vals); free(m->used); }

static size_t slot_of(int64_t id, size_t mask) {
    uint64_t x = (uint64_t)id * 0x9E3779B97F4A7C15ULL;
    return (size_t)(x ^ (x >> 29)) & mask;
}

static void map_put(Map *m, int64_t id, int32_t v) {
    size_t i = slot_of(id, m->mask);
    while (m->used[i] && m->ids[i] != id) i = (i + 1) & m->mask;
    m->used[i] = 1; m->ids[i] = id; m->vals[i] = v;
}

/* pop: the block of id, or -1 */
static int32_t map_pop(Map *m, int64_t id) {
    size_t i = slot_of(id, m->mask);
    while (m->used[i] && m->ids[i] != id) i = (i + 1) & m->mask;
    if (!m->used[i]) return -1;
    int32_t v = m->vals[i];
    size_t j = i;
    for (;;) {   /* shift back the entries that probed past the freed slot */
        j = (j + 1) & m->mask;
        if (!m->used[j]) break;
        size_t home = slot_of(m->ids[j], m->mask);
        if (((j - home) & m->mask) >= ((j - i) & m->mask)) {
            m->ids[i] = m->ids[j]; m->vals[i] = m->vals[j]; i = j;
        }
    }
    m->used[i] = 0;
    return v;
}

/* ---- pools: keys sorted by (size, ptr) */
static Py_ssize_t lower_bound(const Pool *p, int64_t size, int64_t ptr) {
    Py_ssize_t lo = 0, hi = p->n;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        const Key *k = &p->keys[mid];
        if (k->size < size || (k->size == size && k->ptr < ptr)) lo = mid + 1; else hi = mid;
    }
    return lo;
}

static int pool_insert(Pool *p, const Block *b, int32_t idx) {
    if (p->n == p->cap) {
        Py_ssize_t cap = p->cap ? 2 * p->cap : 256;
        Key *k = realloc(p->keys, cap * sizeof(Key));
        if (!k) return -1;
        p->keys = k; p->cap = cap;
    }
    Py_ssize_t i = lower_bound(p, b->size, b->ptr);
    memmove(&p->keys[i + 1], &p->keys[i], (p->n - i) * sizeof(Key));
    p->keys[i].size = b->size; p->keys[i].ptr = b->ptr; p->keys[i].block = idx;
    p->n++;
    return 0;
}

static void pool_remove(Pool *p, const Block *b) {
    Py_ssize_t i = lower_bound(p, b->size, b->ptr);
    memmove(&p->keys[i], &p->keys[i + 1], (p->n - i - 1) * sizeof(Key));
    p->n--;
}

static int32_t new_block(Alloc *a, int64_t ptr, int64_t size, uint8_t small) {
    int32_t i;
    if (a->nspare) {
        i = a->spare[--a->nspare];
    } else {
        if (a->n == a->cap) {
            int32_t cap = a->cap ? 2 * a->cap : 1024;
            Block *bl = realloc(a->blocks, (size_t)cap * sizeof(Block));
            if (!bl) return -1;
            a->blocks = bl; a->cap = cap;
        }
        i = a->n++;
    }
    Block *b = &a->blocks[i];
    b->ptr = ptr; b->size = size; b->prev = b->next = -1; b->allocated = 0; b->small = small;
    return i;
}

static int spare_block(Alloc *a, int32_t i) {
    if (a->nspare == a->capspare) {
        int32_t cap = a->capspare ? 2 * a->capspare : 1024;
        int32_t *s = realloc(a->spare, (size_t)cap * sizeof(int32_t));
        if (!s) return -1;
        a->spare = s; a->capspare = cap;
    }
    a->spare[a->nspare++] = i;
    return 0;
}

/* alloc(size): the block handed out, or -1 (out of memory in this process) */
static int32_t do_alloc(Alloc *a, int64_t size) {
    size = size < K_MIN_BLOCK ? K_MIN_BLOCK : (size + K_MIN_BLOCK - 1) / K_MIN_BLOCK * K_MIN_BLOCK;
    uint8_t small = size <= K_SMALL_SIZE;
    Pool *pool = &a->pools[small ? 0 : 1];
    Py_ssize_t i = lower_bound(pool, size, -1);
    int32_t bi;
    if (i < pool->n) {   /* best fit among the cached blocks */
        bi = pool->keys[i].block;
        memmove(&pool->keys[i], &pool->keys[i + 1], (pool->n - i - 1) * sizeof(Key));
        pool->n--;
    } else {             /* a new segment */
        int64_t seg = size <= K_SMALL_SIZE ? K_SMALL_BUFFER
                      : size < K_MIN_LARGE_ALLOC ? K_LARGE_BUFFER
                      : (size + K_ROUND_LARGE - 1) / K_ROUND_LARGE * K_ROUND_LARGE;
        bi = new_block(a, a->next_ptr, seg, small);
        if (bi < 0) return -1;
        a->next_ptr += seg + K_ROUND_LARGE;
        a->reserved += seg;
        if (a->reserved > a->peak_reserved) a->peak_reserved = a->reserved;
        a->segments += 1;
        if (a->segments > a->peak_segments) a->peak_segments = a->segments;
    }
    Block *b = &a->blocks[bi];
    int64_t rest = b->size - size;
    if (small ? rest >= K_MIN_BLOCK : rest > K_SMALL_SIZE) {
        int32_t ri = new_block(a, b->ptr + size, rest, small);
        if (ri < 0) return -1;
        b = &a->blocks[bi];   /* new_block may have moved the array */
        Block *r = &a->blocks[ri];
        r->prev = bi; r->next = b->next;
        if (b->next >= 0) a->blocks[b->next].prev = ri;
        b->next = ri;
        b->size = size;
        if (pool_insert(pool, r, ri) < 0) return -1;
    }
    b->allocated = 1;
    a->allocated += b->size;
    if (a->allocated > a->peak_allocated) a->peak_allocated = a->allocated;
    return bi;
}

static int do_free(Alloc *a, int32_t bi) {
    Block *b = &a->blocks[bi];
    Pool *pool = &a->pools[b->small ? 0 : 1];
    b->allocated = 0;
    a->allocated -= b->size;
    int32_t pi = b->prev;
    if (pi >= 0 && !a->blocks[pi].allocated) {   /* absorb the free block before it */
        Block *p = &a->blocks[pi];
        pool_remove(pool, p);
        b->ptr = p->ptr; b->prev = p->prev;
        if (b->prev >= 0) a->blocks[b->prev].next = bi;
        b->size += p->size;
        if (spare_block(a, pi) < 0) return -1;
    }
    int32_t ni = b->next;
    if (ni >= 0 && !a->blocks[ni].allocated) {   /* and the one after it */
        Block *n = &a->blocks[ni];
        pool_remove(pool, n);
        b->next = n->next;
        if (b->next >= 0) a->blocks[b->next].prev = bi;
        b->size += n->size;
        if (spare_block(a, ni) < 0) return -1;
    }
    return pool_insert(pool, b, bi);
}

static PyObject *not_handled(const char *why) {
    PyErr_SetString(PyExc_NotImplementedError, why);
    return NULL;
}

static PyObject *replay_default(PyObject *self, PyObject *arg) {
    PyObject *seq = PySequence_Fast(arg, "events must be a sequence");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Alloc a;
    memset(&a, 0, sizeof a);
    a.next_ptr = 1LL << 32;
    Map live;
    PyObject *out = NULL;
    Py_ssize_t allocs = 0;   /* the most ids live at once */
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *ev = items[k];
        if (PyTuple_Check(ev) && PyTuple_GET_SIZE(ev) == 3) allocs++;
    }
    if (!map_init(&live, (size_t)allocs)) { PyErr_NoMemory(); goto done; }
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *ev = items[k];
        if (!PyTuple_Check(ev) || PyTuple_GET_SIZE(ev) < 2) { not_handled("an event is not a tuple"); goto done; }
        PyObject *op = PyTuple_GET_ITEM(ev, 0), *id = PyTuple_GET_ITEM(ev, 1);
        if (!PyUnicode_Check(op) || PyUnicode_GET_LENGTH(op) != 1 || !PyLong_CheckExact(id)) {
            not_handled("an event is not (str, int, ...)"); goto done;
        }
        int overflow = 0;
        long long key = PyLong_AsLongLongAndOverflow(id, &overflow);
        if (overflow) { not_handled("an id beyond 64 bits"); goto done; }
        Py_UCS4 c = PyUnicode_READ_CHAR(op, 0);
        if (c == 'a') {
            if (PyTuple_GET_SIZE(ev) < 3 || !PyLong_CheckExact(PyTuple_GET_ITEM(ev, 2))) {
                not_handled("an allocation's size is not an int"); goto done;
            }
            long long size = PyLong_AsLongLongAndOverflow(PyTuple_GET_ITEM(ev, 2), &overflow);
            if (overflow || size > (1LL << 50)) { not_handled("a size beyond 2**50"); goto done; }
            int32_t bi = do_alloc(&a, size);
            if (bi < 0) { PyErr_NoMemory(); goto done; }
            map_put(&live, key, bi);
        } else {
            int32_t bi = map_pop(&live, key);
            if (bi >= 0 && do_free(&a, bi) < 0) { PyErr_NoMemory(); goto done; }
        }
    }
    out = Py_BuildValue("(LLLLLL)", (long long)a.allocated, (long long)a.reserved, (long long)a.peak_allocated,
                        (long long)a.peak_reserved, (long long)a.segments, (long long)a.peak_segments);
done:
    map_free(&live);
    free(a.blocks); free(a.spare); free(a.pools[0].keys); free(a.pools[1].keys);
    Py_DECREF(seq);
    return out;
}

static PyMethodDef methods[] = {
    {"replay_default", replay_default, METH_O,
     "replay_default(events) -> (allocated, reserved, peak_allocated, peak_reserved, segments, peak_segments)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_replay", NULL, -1, methods};

PyMODINIT_FUNC PyInit__replay(void) { return PyModule_Create(&module); }
