/*
 * tiercache.transfer._copy_runs: the CPU copy-plan executor, compiled.
 *
 * Two C functions over one copy plan (tiercache/transfer/copy_plan.py): copy run
 * i from src[i] to dst[i], sizes[i] bytes, for every i < n.
 *
 * copy_runs: each run with memcpy, while the next run's first PREFETCH_BYTES
 * are prefetched on both sides (read for the source, write for the
 * destination). Why: the plan's runs are pages of a few KiB scattered over the
 * engine's KV tensors; the hardware prefetchers do not guess where the next
 * page starts, so without the hint every page begins with a full memory latency.
 *
 * copy_runs_stream (x86-64; elsewhere the same as copy_runs): each run whose
 * destination is 16-byte aligned and whose size is a multiple of 64 bytes with
 * non-temporal (streaming) stores, the source of the run STREAM_AHEAD runs on
 * prefetched; any other run with memcpy; one store fence at the end, so every
 * byte is visible to any thread that learns of the call's return. Why: a
 * cached store of a page first reads the destination's lines in (the
 * read-for-ownership), one more memory access per line that a streaming store
 * skips; on the AMD EPYC (Zen 4) VM this took two threads' scattered 2 KiB
 * pages from 0.67-0.94 to 0.98-1.27 of one memcpy (store) and 0.71-1.00 to
 * 1.04-2.25 (load) in a standalone test (docs/PERFORMANCE.md, host tier on the CPU, has
 * the copier's figures); Python picks it on AMD CPUs (host_kernel.streaming).
 * The copied bytes are not left in the cache (a load's blocks are read again
 * from memory by the forward pass).
 *
 * The module exposes the functions' addresses (COPY_RUNS, COPY_RUNS_STREAM);
 * Python calls them through ctypes, which releases the GIL for the call
 * (tiercache/transfer/host_kernel.py). They are stateless: any number of
 * threads may call them at once.
 *
 * copy_segments(geometry, store, stream, [(slot, first_block, block_ids), ...])
 * is the one Python function: the plans of many segments (each one chunk slot's
 * blocks) made and run in C, with the GIL released once for all of them (a copy
 * thread's batch of parts: a GIL hand-over costs as much as a 64 KiB copy); a
 * numpy plan costs 10-25 us of numpy calls, a 256 KiB chunk's copy about 20.
 * ``geometry`` is
 * bytes of int64 (host_kernel.segment_geometry): R, num_blocks, num_slots,
 * blocks_per_chunk, slot_step, then per region its engine base, block stride,
 * page bytes, host base and host block step, the values of copy_plan's
 * PlanGeometry for a slab of slots. It checks every index of every segment
 * before any byte moves (IndexError, nothing copied), lists, segment by segment,
 * region r's page of each block in region-major order (the
 * slot's host order), merges pages contiguous on both sides, and runs them
 * with copy_runs or copy_runs_stream with the GIL released. Returns the bytes
 * moved.
 *
 * Contract of copy_runs / copy_runs_stream: every address is valid for its run
 * for the whole call and no run's destination overlaps any source (the caller
 * checks bounds before planning: tiercache.transfer.device.check_segment);
 * nothing is checked or allocated there. copy_segments checks its own indices
 * against the geometry's counts; the geometry's addresses (the engine's KV
 * tensors, the slab) must stay valid while the copier that holds it lives.
 * A prefetch never faults, whatever the address.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define PREFETCH_BYTES 4096
#define CACHE_LINE 64

/* Hints the first PREFETCH_BYTES of a run's source (for reading) and, unless dst is NULL, of its
 * destination (for writing) into the cache. */
static inline void prefetch_run(const char *src, char *dst, int64_t size) {
    if (size > PREFETCH_BYTES) size = PREFETCH_BYTES;
    for (int64_t at = 0; at < size; at += CACHE_LINE) {
        __builtin_prefetch(src + at, 0, 3);
        if (dst != NULL) __builtin_prefetch(dst + at, 1, 3);
    }
}

static void copy_runs(const int64_t *dst, const int64_t *src, const int64_t *sizes, int64_t n) {
    if (n <= 0) return;
    prefetch_run((const char *)(intptr_t)src[0], (char *)(intptr_t)dst[0], sizes[0]);
    for (int64_t i = 0; i < n; i++) {
        if (i + 1 < n)
            prefetch_run((const char *)(intptr_t)src[i + 1], (char *)(intptr_t)dst[i + 1], sizes[i + 1]);
        memcpy((void *)(intptr_t)dst[i], (const void *)(intptr_t)src[i], (size_t)sizes[i]);
    }
}

#if defined(__x86_64__)
#include <immintrin.h>
#define STREAM_AHEAD 2

static int have_avx2;

__attribute__((target("avx2"))) static void stream_avx2(char *dst, const char *src, int64_t size) {
    for (int64_t at = 0; at < size; at += 64) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(src + at));
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + at + 32));
        _mm256_stream_si256((__m256i *)(dst + at), a);
        _mm256_stream_si256((__m256i *)(dst + at + 32), b);
    }
}

static void stream_sse2(char *dst, const char *src, int64_t size) {
    for (int64_t at = 0; at < size; at += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + at));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + at + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + at + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + at + 48));
        _mm_stream_si128((__m128i *)(dst + at), a);
        _mm_stream_si128((__m128i *)(dst + at + 16), b);
        _mm_stream_si128((__m128i *)(dst + at + 32), c);
        _mm_stream_si128((__m128i *)(dst + at + 48), d);
    }
}

static void copy_runs_stream(const int64_t *dst, const int64_t *src, const int64_t *sizes, int64_t n) {
    /* the source alone: a streaming store reads nothing of the destination */
    for (int64_t i = 0; i < n && i < STREAM_AHEAD; i++) prefetch_run((const char *)(intptr_t)src[i], NULL, sizes[i]);
    for (int64_t i = 0; i < n; i++) {
        if (i + STREAM_AHEAD < n)
            prefetch_run((const char *)(intptr_t)src[i + STREAM_AHEAD], NULL, sizes[i + STREAM_AHEAD]);
        char *d = (char *)(intptr_t)dst[i];
        const char *s = (const char *)(intptr_t)src[i];
        int64_t size = sizes[i];
        if (size <= 0 || (size & 63) != 0 || ((uintptr_t)d & 15) != 0)
            memcpy(d, s, (size_t)(size > 0 ? size : 0));
        else if (have_avx2 && ((uintptr_t)d & 31) == 0)
            stream_avx2(d, s, size);
        else
            stream_sse2(d, s, size);
    }
    _mm_sfence();
}
#else
#define copy_runs_stream copy_runs
#endif

#define GEOMETRY_HEAD 5   /* R, num_blocks, num_slots, blocks_per_chunk, slot_step */
#define GEOMETRY_FIELDS 5 /* per region: engine base, block stride, page, host base, host block step */

typedef struct {
    int64_t regions, num_blocks, num_slots, bpc, slot_step;
    const int64_t *base, *stride, *page, *host_base, *block_step;
} geometry_t;

typedef struct {
    int64_t slot, first, n, at; /* the segment's block ids are ids[at .. at + n) */
} segment_t;

/* The geometry's bytes (host_kernel.segment_runner) as pointers into them; -1 with ValueError if malformed. */
static int parse_geometry(PyObject *obj, geometry_t *g) {
    char *raw;
    Py_ssize_t raw_len;
    if (PyBytes_AsStringAndSize(obj, &raw, &raw_len) < 0) return -1;
    const int64_t *v = (const int64_t *)raw;
    if (raw_len < (Py_ssize_t)(GEOMETRY_HEAD * sizeof(int64_t)) || v[0] <= 0 ||
        raw_len != (Py_ssize_t)((GEOMETRY_HEAD + GEOMETRY_FIELDS * v[0]) * sizeof(int64_t))) {
        PyErr_SetString(PyExc_ValueError, "copy_segments: malformed geometry");
        return -1;
    }
    g->regions = v[0], g->num_blocks = v[1], g->num_slots = v[2], g->bpc = v[3], g->slot_step = v[4];
    g->base = v + GEOMETRY_HEAD, g->stride = g->base + g->regions, g->page = g->stride + g->regions;
    g->host_base = g->page + g->regions, g->block_step = g->host_base + g->regions;
    return 0;
}

/* Segment ``seg``'s slot, position and block ids checked against the geometry (IndexError with the
 * messages of tiercache.transfer.device.check_segment) and its ids written to ids[seg->at ..]; the
 * caller made room for them (seg->n of them). GIL held. */
static int take_segment(const geometry_t *g, segment_t *seg, PyObject *ids_seq, int64_t *ids) {
    if (seg->slot < 0 || seg->slot >= g->num_slots) {
        PyErr_Format(PyExc_IndexError, "slot %lld out of range [0, %lld)", (long long)seg->slot,
                     (long long)g->num_slots);
        return -1;
    }
    if (seg->first < 0 || seg->n > g->bpc || seg->first > g->bpc - seg->n) { /* (no overflow) */
        PyErr_Format(PyExc_IndexError, "%lld blocks from position %lld overflow a %lld-block chunk",
                     (long long)seg->n, (long long)seg->first, (long long)g->bpc);
        return -1;
    }
    for (int64_t i = 0; i < seg->n; i++) {
        long long id = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(ids_seq, i));
        if (id == -1 && PyErr_Occurred()) return -1;
        if (id < 0 || id >= g->num_blocks) {
            PyErr_Format(PyExc_IndexError, "block id %lld out of range [0, %lld)", id, (long long)g->num_blocks);
            return -1;
        }
        ids[seg->at + i] = id;
    }
    return 0;
}

/* Plans and copies every segment, one after another (region r's page of each block in region-major
 * order, the slot's host order; pages contiguous on both sides merged). ``runs`` has room for
 * 3 * regions * (the largest n) entries. Needs no GIL. Returns the bytes moved. */
static int64_t run_segments(const geometry_t *g, int store, int stream, const segment_t *segs, Py_ssize_t count,
                            const int64_t *ids, int64_t *runs, int64_t room) {
    int64_t moved = 0;
    int64_t *engine = runs, *host = runs + room, *sizes = runs + 2 * room;
    for (Py_ssize_t s = 0; s < count; s++) {
        const segment_t *seg = &segs[s];
        int64_t n_runs = 0;
        for (int64_t r = 0; r < g->regions; r++) {
            int64_t host_at = g->host_base[r] + seg->slot * g->slot_step + seg->first * g->block_step[r];
            for (int64_t i = 0; i < seg->n; i++, host_at += g->block_step[r]) {
                int64_t engine_at = g->base[r] + ids[seg->at + i] * g->stride[r];
                if (n_runs > 0 && engine[n_runs - 1] + sizes[n_runs - 1] == engine_at &&
                    host[n_runs - 1] + sizes[n_runs - 1] == host_at) {
                    sizes[n_runs - 1] += g->page[r];
                } else {
                    engine[n_runs] = engine_at;
                    host[n_runs] = host_at;
                    sizes[n_runs] = g->page[r];
                    n_runs++;
                }
                moved += g->page[r];
            }
        }
        const int64_t *dst = store ? host : engine, *src = store ? engine : host;
        if (stream)
            copy_runs_stream(dst, src, sizes, n_runs);
        else
            copy_runs(dst, src, sizes, n_runs);
    }
    return moved;
}

/* copy_segments(geometry, store, stream, segments): ``segments`` a sequence of (slot, first_block,
 * block_ids) tuples. Every segment is checked before any byte moves; the copies run with the GIL
 * released. */
static PyObject *copy_segments(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "copy_segments(geometry, store, stream, segments)");
        return NULL;
    }
    geometry_t g;
    if (parse_geometry(args[0], &g) < 0) return NULL;
    int store = PyObject_IsTrue(args[1]), stream = PyObject_IsTrue(args[2]);
    if (store < 0 || stream < 0) return NULL;
    PyObject *list =
        PySequence_Fast(args[3], "copy_segments: segments must be a sequence of (slot, first_block, block_ids)");
    if (list == NULL) return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(list);
    PyObject **id_seqs = PyMem_Calloc((size_t)(count > 0 ? count : 1), sizeof(PyObject *));
    segment_t *segs = PyMem_Calloc((size_t)(count > 0 ? count : 1), sizeof(segment_t));
    int64_t *buf = NULL, total = 0, largest = 0, moved = 0;
    PyObject *result = NULL;
    if (id_seqs == NULL || segs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t s = 0; s < count; s++) {
        PyObject *item = PySequence_Fast_GET_ITEM(list, s);
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 3) {
            PyErr_SetString(PyExc_TypeError, "copy_segments: each segment is a (slot, first_block, block_ids) tuple");
            goto done;
        }
        PyObject *const *fields = &PyTuple_GET_ITEM(item, 0);
        segs[s].slot = PyLong_AsLongLong(fields[0]);
        segs[s].first = PyLong_AsLongLong(fields[1]);
        if (PyErr_Occurred()) goto done;
        id_seqs[s] = PySequence_Fast(fields[2], "copy_segments: block_ids must be a sequence");
        if (id_seqs[s] == NULL) goto done;
        segs[s].n = PySequence_Fast_GET_SIZE(id_seqs[s]);
        segs[s].at = total;
        total += segs[s].n;
        if (segs[s].n > largest) largest = segs[s].n;
    }
    int64_t room = largest * g.regions;
    buf = PyMem_Malloc((size_t)(total + 3 * room + 1) * sizeof(int64_t));
    if (buf == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t s = 0; s < count; s++)
        if (take_segment(&g, &segs[s], id_seqs[s], buf) < 0) goto done;
    Py_BEGIN_ALLOW_THREADS
    moved = run_segments(&g, store, stream, segs, count, buf, buf + total, room);
    Py_END_ALLOW_THREADS
    result = PyLong_FromLongLong(moved);
done:
    if (id_seqs != NULL)
        for (Py_ssize_t s = 0; s < count; s++) Py_XDECREF(id_seqs[s]);
    PyMem_Free(id_seqs);
    PyMem_Free(segs);
    PyMem_Free(buf);
    Py_DECREF(list);
    return result;
}

static PyMethodDef methods[] = {
    {"copy_segments", (PyCFunction)(void (*)(void))copy_segments, METH_FASTCALL,
     "copy_segments(geometry, store, stream, [(slot, first_block, block_ids), ...]) -> bytes moved"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_copy_runs",
    "copy_runs and copy_runs_stream(dst, src, sizes, n) of tiercache/transfer/native/copy_runs.c: "
    "their addresses are COPY_RUNS and COPY_RUNS_STREAM; copy_segments plans and runs many segments.",
    -1, methods,
};

PyMODINIT_FUNC PyInit__copy_runs(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
#if defined(__x86_64__)
    __builtin_cpu_init();
    have_avx2 = __builtin_cpu_supports("avx2");
#endif
    if (PyModule_AddObject(m, "COPY_RUNS", PyLong_FromVoidPtr((void *)&copy_runs)) < 0 ||
        PyModule_AddObject(m, "COPY_RUNS_STREAM", PyLong_FromVoidPtr((void *)&copy_runs_stream)) < 0 ||
        PyModule_AddIntConstant(m, "PREFETCH_BYTES", PREFETCH_BYTES) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
