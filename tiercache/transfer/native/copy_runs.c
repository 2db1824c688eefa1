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
 * copy_segment(geometry, store, stream, slot, first_block, block_ids) is the
 * one Python function: the plan of one segment (one chunk slot's blocks) made
 * and run in C, for jobs too small for a numpy plan to pay off (a plan costs
 * 10-25 us of numpy calls, a 256 KiB chunk's copy about 20). ``geometry`` is
 * bytes of int64 (host_kernel.segment_geometry): R, num_blocks, num_slots,
 * blocks_per_chunk, slot_step, then per region its engine base, block stride,
 * page bytes, host base and host block step, the values of copy_plan's
 * PlanGeometry for a slab of slots. It checks every index (IndexError, nothing
 * copied), lists region r's page of each block in region-major order (the
 * slot's host order), merges pages contiguous on both sides, and runs them
 * with copy_runs or copy_runs_stream with the GIL released. Returns the bytes
 * moved.
 *
 * Contract of copy_runs / copy_runs_stream: every address is valid for its run
 * for the whole call and no run's destination overlaps any source (the caller
 * checks bounds before planning: tiercache.transfer.device.check_segment);
 * nothing is checked or allocated there. copy_segment checks its own indices
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
#define STACK_RUNS 1024

static PyObject *copy_segment(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "copy_segment(geometry, store, stream, slot, first_block, block_ids)");
        return NULL;
    }
    char *raw;
    Py_ssize_t raw_len;
    if (PyBytes_AsStringAndSize(args[0], &raw, &raw_len) < 0) return NULL;
    const int64_t *g = (const int64_t *)raw;
    if (raw_len < (Py_ssize_t)(GEOMETRY_HEAD * sizeof(int64_t)) || g[0] <= 0 ||
        raw_len != (Py_ssize_t)((GEOMETRY_HEAD + GEOMETRY_FIELDS * g[0]) * sizeof(int64_t))) {
        PyErr_SetString(PyExc_ValueError, "copy_segment: malformed geometry");
        return NULL;
    }
    int64_t regions = g[0], num_blocks = g[1], num_slots = g[2], bpc = g[3], slot_step = g[4];
    const int64_t *base = g + GEOMETRY_HEAD, *stride = base + regions, *page = stride + regions;
    const int64_t *host_base = page + regions, *block_step = host_base + regions;
    int store = PyObject_IsTrue(args[1]), stream = PyObject_IsTrue(args[2]);
    long long slot = PyLong_AsLongLong(args[3]), first = PyLong_AsLongLong(args[4]);
    if (store < 0 || stream < 0 || PyErr_Occurred()) return NULL;
    PyObject *seq = PySequence_Fast(args[5], "copy_segment: block_ids must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (slot < 0 || slot >= num_slots) {  /* the messages of tiercache.transfer.device.check_segment */
        Py_DECREF(seq);
        PyErr_Format(PyExc_IndexError, "slot %lld out of range [0, %lld)", slot, (long long)num_slots);
        return NULL;
    }
    if (first < 0 || first + n > bpc) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_IndexError, "%zd blocks from position %lld overflow a %lld-block chunk", n, first,
                     (long long)bpc);
        return NULL;
    }
    int64_t stack[3 * STACK_RUNS];
    int64_t *buf = stack;
    Py_ssize_t entries = n * regions;
    if (n > 0 && 3 * entries + n > 3 * STACK_RUNS) {
        buf = PyMem_Malloc((size_t)(3 * entries + n) * sizeof(int64_t));
        if (buf == NULL) {
            Py_DECREF(seq);
            return PyErr_NoMemory();
        }
    }
    int64_t *ids = buf + 3 * entries, *engine = buf, *host = buf + entries, *sizes = buf + 2 * entries;
    for (Py_ssize_t i = 0; i < n; i++) {
        long long id = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
        if (id == -1 && PyErr_Occurred()) goto fail;
        if (id < 0 || id >= num_blocks) {
            PyErr_Format(PyExc_IndexError, "block id %lld out of range [0, %lld)", id, (long long)num_blocks);
            goto fail;
        }
        ids[i] = id;
    }
    Py_DECREF(seq);
    seq = NULL;
    Py_ssize_t runs = 0;
    int64_t moved = 0;
    Py_BEGIN_ALLOW_THREADS
    for (int64_t r = 0; r < regions; r++) {
        int64_t host_at = host_base[r] + slot * slot_step + first * block_step[r];
        for (Py_ssize_t i = 0; i < n; i++, host_at += block_step[r]) {
            int64_t engine_at = base[r] + ids[i] * stride[r];
            if (runs > 0 && engine[runs - 1] + sizes[runs - 1] == engine_at &&
                host[runs - 1] + sizes[runs - 1] == host_at) {
                sizes[runs - 1] += page[r];
            } else {
                engine[runs] = engine_at;
                host[runs] = host_at;
                sizes[runs] = page[r];
                runs++;
            }
            moved += page[r];
        }
    }
    const int64_t *dst = store ? host : engine, *src = store ? engine : host;
    if (stream)
        copy_runs_stream(dst, src, sizes, runs);
    else
        copy_runs(dst, src, sizes, runs);
    Py_END_ALLOW_THREADS
    if (buf != stack) PyMem_Free(buf);
    return PyLong_FromLongLong(moved);
fail:
    Py_XDECREF(seq);
    if (buf != stack) PyMem_Free(buf);
    return NULL;
}

static PyMethodDef methods[] = {
    {"copy_segment", (PyCFunction)(void (*)(void))copy_segment, METH_FASTCALL,
     "copy_segment(geometry, store, stream, slot, first_block, block_ids) -> bytes moved (see the C source)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_copy_runs",
    "copy_runs and copy_runs_stream(dst, src, sizes, n) of tiercache/transfer/native/copy_runs.c: "
    "their addresses are COPY_RUNS and COPY_RUNS_STREAM; copy_segment plans and runs one segment.",
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
