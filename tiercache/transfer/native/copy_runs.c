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
 * The copied bytes are not left in the cache: the executor runs only for parts
 * of 1 MiB and more, which would not stay there.
 *
 * The module exposes the functions' addresses (COPY_RUNS, COPY_RUNS_STREAM) and
 * nothing else; Python calls them through ctypes, which releases the GIL for the
 * call (tiercache/transfer/host_kernel.py). They are stateless: any number of
 * threads may call them at once.
 *
 * Contract: every address is valid for its run for the whole call and no run's
 * destination overlaps any source (the caller checks bounds before planning:
 * tiercache.transfer.device.check_segment); nothing is checked or allocated here.
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

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_copy_runs",
    "copy_runs and copy_runs_stream(dst, src, sizes, n) of tiercache/transfer/native/copy_runs.c: "
    "their addresses are COPY_RUNS and COPY_RUNS_STREAM.",
    -1, NULL,
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
