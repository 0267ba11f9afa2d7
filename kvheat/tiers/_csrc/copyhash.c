/* kvheat.tiers._copyhash: a copy and its xxh3-64 checksum in one pass over memory.
 *
 * The host tier checks every read against the xxh3 taken at put time. Done as a copy and
 * then a hash, the hash reads every byte a second time and each costs a Python call. Here
 * the checksum comes with the copy (copyhash_kernels.c): each 64-byte stripe is hashed by
 * xxh3's own steps as it is copied, with AVX2 ("avx2", x86 CPUs that have it,
 * checked at run time) or with the vector unit the build targets ("portable": SSE2 on
 * x86-64, NEON on AArch64). Blocks those do not take (rows not a multiple of 64 bytes, or
 * 240 bytes or less) are copied in pieces of CHUNK bytes, each hashed while in L1.
 *
 * A block is `rows` runs of `row_bytes` contiguous bytes, the runs `src_stride` and
 * `dst_stride` bytes apart (a GQA block of a paged pool: K and V of each layer; a contiguous
 * tensor: one run). Its checksum is xxh3-64 (seed 0) of the runs in order, the same as
 * `xxhash.xxh3_64_intdigest` of their concatenation, taken from the source as it is read
 * (a get checks the slot, a put records the caller's bytes). Addresses are raw: only `host.py`
 * calls this, on tensors whose layout it has checked.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t on the stack */
#include "xxhash.h"
#ifdef KVHEAT_X86_DISPATCH
/* xxh3's one-shot and update on the best vector unit the CPU has, chosen at run time;
 * reset and digest stay xxhash.c's. */
#include "xxh_x86dispatch.h"
#endif
#include "copyhash.h"

/* copy_then_hash's piece: well inside any L1d. */
#define CHUNK ((Py_ssize_t)16 * 1024)
/* Calls moving at least this much let other threads run meanwhile. */
#define NOGIL_BYTES ((Py_ssize_t)256 * 1024)

static int use_avx2;

/* The last resort, for blocks the fused kernels do not take (rows not a multiple of 64
 * bytes, or short): pieces of CHUNK bytes copied, then hashed from the source in L1. */
static uint64_t copy_then_hash(char *dst, const char *src, const Layout *l,
                               XXH3_state_t *st)
{
    if (l->rows == 1 && l->row_bytes <= CHUNK) {
        memmove(dst, src, (size_t)l->row_bytes);
        return XXH3_64bits(src, (size_t)l->row_bytes);
    }
    XXH3_64bits_reset(st);
    for (Py_ssize_t r = 0; r < l->rows; r++) {
        char *d = dst + r * l->dst_stride;
        const char *s = src + r * l->src_stride;
        for (Py_ssize_t off = 0; off < l->row_bytes; off += CHUNK) {
            size_t n = (size_t)(l->row_bytes - off < CHUNK ? l->row_bytes - off : CHUNK);
            memmove(d + off, s + off, n);
            XXH3_64bits_update(st, s + off, n);
        }
    }
    return XXH3_64bits_digest(st);
}

static uint64_t copy_hash(char *dst, const char *src, const Layout *l, XXH3_state_t *st)
{
    if (l->row_bytes % 64 != 0 || l->rows * l->row_bytes <= 240)
        return copy_then_hash(dst, src, l, st);
#ifdef KVHEAT_HAVE_AVX2_KERNEL
    if (use_avx2)
        return kvheat_copy_hash_avx2(dst, src, l);
#endif
    return kvheat_copy_hash_fused(dst, src, l);
}

/* The arguments both calls share: six of them, the first four the layout. */
static int parse_layout(const char *name, PyObject *const *args, Py_ssize_t nargs,
                        Layout *l)
{
    if (nargs != 6) {
        PyErr_Format(PyExc_TypeError, "%s takes 6 arguments", name);
        return -1;
    }
    l->rows = PyLong_AsSsize_t(args[0]);
    l->row_bytes = PyLong_AsSsize_t(args[1]);
    l->dst_stride = PyLong_AsSsize_t(args[2]);
    l->src_stride = PyLong_AsSsize_t(args[3]);
    if (PyErr_Occurred())
        return -1;
    if (l->rows < 1 || l->row_bytes < 0 ||
        (l->rows > 1 && (l->dst_stride < l->row_bytes || l->src_stride < l->row_bytes))) {
        PyErr_SetString(PyExc_ValueError, "bad layout: rows >= 1, row_bytes >= 0 and "
                                          "strides >= row_bytes");
        return -1;
    }
    Py_ssize_t widest = l->dst_stride > l->src_stride ? l->dst_stride : l->src_stride;
    if (widest < l->row_bytes)
        widest = l->row_bytes;
    if (widest > 0 && l->rows > PY_SSIZE_T_MAX / widest) {
        PyErr_SetString(PyExc_OverflowError, "layout spans more bytes than an address holds");
        return -1;
    }
    return 0;
}

static void *address(PyObject *o)
{
    void *p = PyLong_AsVoidPtr(o);
    if (p == NULL && !PyErr_Occurred())
        PyErr_SetString(PyExc_ValueError, "null address");
    return p;
}

/* copy(rows, row_bytes, dst_stride, src_stride, dst, src) -> xxh3-64 of what was copied */
static PyObject *py_copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    Layout l;
    if (parse_layout("copy", args, nargs, &l) < 0)
        return NULL;
    char *dst = address(args[4]);
    const char *src = dst ? address(args[5]) : NULL;
    if (src == NULL)
        return NULL;
    XXH3_state_t st;
    XXH3_INITSTATE(&st);
    uint64_t h;
    if (l.rows * l.row_bytes >= NOGIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        h = copy_hash(dst, src, &l, &st);
        Py_END_ALLOW_THREADS
    } else {
        h = copy_hash(dst, src, &l, &st);
    }
    return PyLong_FromUnsignedLongLong(h);
}

/* copy_many(rows, row_bytes, dst_stride, src_stride, dsts, srcs) -> [xxh3-64, ...]:
 * `copy` for each pair of addresses of two equally long lists. */
static PyObject *py_copy_many(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    Layout l;
    if (parse_layout("copy_many", args, nargs, &l) < 0)
        return NULL;
    if (!PyList_Check(args[4]) || !PyList_Check(args[5]) ||
        PyList_GET_SIZE(args[4]) != PyList_GET_SIZE(args[5])) {
        PyErr_SetString(PyExc_ValueError, "dsts and srcs must be lists of one length");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(args[4]);
    char **dsts = PyMem_Malloc((size_t)(n ? n : 1) * 2 * sizeof(char *));
    uint64_t *sums = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(uint64_t));
    PyObject *out = NULL;
    if (dsts == NULL || sums == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    char **srcs = dsts + n;
    for (Py_ssize_t i = 0; i < n; i++) {
        if ((dsts[i] = address(PyList_GET_ITEM(args[4], i))) == NULL ||
            (srcs[i] = address(PyList_GET_ITEM(args[5], i))) == NULL)
            goto done;
    }
    XXH3_state_t st;
    XXH3_INITSTATE(&st);
    if (n > 0 && l.rows * l.row_bytes >= NOGIL_BYTES / n) {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++)
            sums[i] = copy_hash(dsts[i], srcs[i], &l, &st);
        Py_END_ALLOW_THREADS
    } else {
        for (Py_ssize_t i = 0; i < n; i++)
            sums[i] = copy_hash(dsts[i], srcs[i], &l, &st);
    }
    if ((out = PyList_New(n)) == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(sums[i]);
        if (v == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, v);
    }
done:
    PyMem_Free(dsts);
    PyMem_Free(sums);
    return out;
}

/* kernel() -> "avx2" or "portable": the kernel calls use. */
static PyObject *py_kernel(PyObject *self, PyObject *unused)
{
    (void)self, (void)unused;
    return PyUnicode_FromString(use_avx2 ? "avx2" : "portable");
}

/* use_kernel(name): "portable", or "avx2" where the CPU has it (tests compare the two). */
static PyObject *py_use_kernel(PyObject *self, PyObject *name)
{
    (void)self;
    if (!PyUnicode_Check(name)) {
        PyErr_SetString(PyExc_TypeError, "the kernel's name must be a str");
        return NULL;
    }
    if (PyUnicode_CompareWithASCIIString(name, "portable") == 0) {
        use_avx2 = 0;
        Py_RETURN_NONE;
    }
    if (PyUnicode_CompareWithASCIIString(name, "avx2") == 0) {
#ifdef KVHEAT_HAVE_AVX2_KERNEL
        if (__builtin_cpu_supports("avx2")) {
            use_avx2 = 1;
            Py_RETURN_NONE;
        }
#endif
        PyErr_SetString(PyExc_ValueError, "this CPU or build has no AVX2 kernel");
        return NULL;
    }
    PyErr_Format(PyExc_ValueError, "no kernel %R: 'avx2' or 'portable'", name);
    return NULL;
}

static PyMethodDef methods[] = {
    {"kernel", py_kernel, METH_NOARGS, "kernel() -> str: 'avx2' or 'portable'."},
    {"use_kernel", py_use_kernel, METH_O,
     "use_kernel(name): 'portable', or 'avx2' where the CPU has it."},
    {"copy", (PyCFunction)(void (*)(void))py_copy, METH_FASTCALL,
     "copy(rows, row_bytes, dst_stride, src_stride, dst, src) -> int\n"
     "Copy `rows` runs of `row_bytes` bytes from address `src` to address `dst`, the runs "
     "`src_stride` and `dst_stride` bytes apart; return xxh3-64 of the bytes copied."},
    {"copy_many", (PyCFunction)(void (*)(void))py_copy_many, METH_FASTCALL,
     "copy_many(rows, row_bytes, dst_stride, src_stride, dsts, srcs) -> list[int]\n"
     "`copy` for each pair of addresses in the lists `dsts` and `srcs`."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_copyhash",
    "A copy and its xxh3-64 checksum in one pass over memory (kvheat's host tier).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__copyhash(void)
{
#ifdef KVHEAT_HAVE_AVX2_KERNEL
    __builtin_cpu_init();
    use_avx2 = __builtin_cpu_supports("avx2");
#endif
    return PyModule_Create(&module);
}
