/*
 * tiercache.transfer._copy_runs: the CPU copy-plan executor, compiled.
 *
 * One C function, copy_runs(dst, src, sizes, n): copy run i of a copy plan
 * (tiercache/transfer/copy_plan.py) from src[i] to dst[i], sizes[i] bytes, for
 * every i < n, each with memcpy, while the next run's first PREFETCH_BYTES are
 * prefetched on both sides (read for the source, write for the destination).
 * Why: the plan's runs are pages of a few KiB scattered over the engine's KV
 * tensors; the hardware prefetchers do not guess where the next page starts, so
 * without the hint every page begins with a full memory latency
 * (docs/PERFORMANCE.md, host tier on the CPU).
 *
 * The module exposes the function's address (COPY_RUNS) and nothing else; Python
 * calls it through ctypes, which releases the GIL for the call
 * (tiercache/transfer/host_kernel.py). It is stateless: any number of threads may
 * call it at once.
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

static inline void prefetch_run(const char *src, char *dst, int64_t size) {
    if (size > PREFETCH_BYTES) size = PREFETCH_BYTES;
    for (int64_t at = 0; at < size; at += CACHE_LINE) {
        __builtin_prefetch(src + at, 0, 3);
        __builtin_prefetch(dst + at, 1, 3);
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

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_copy_runs",
    "copy_runs(dst, src, sizes, n) of tiercache/transfer/native/copy_runs.c: its address is COPY_RUNS.",
    -1, NULL,
};

PyMODINIT_FUNC PyInit__copy_runs(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObject(m, "COPY_RUNS", PyLong_FromVoidPtr((void *)&copy_runs)) < 0 ||
        PyModule_AddIntConstant(m, "PREFETCH_BYTES", PREFETCH_BYTES) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
