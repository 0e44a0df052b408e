/* One pass that copies float32 values and checks them for NaN/Inf (shardline.services.tensor_checks).
 *
 * A one-copy push (ps_server/node.py, take_push) copies a gradient out of the client's shared memory
 * and must refuse NaN/Inf in the copy it keeps, never in the client's memory, which the client could
 * still change. Copying and then reading the copy back costs two passes; here every value is loaded
 * once, stored, and its exponent tested in the same register, so what is checked is exactly what was
 * stored. The GIL is released: the node's two copy threads run at once.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* NaN and +-Inf are the float32 values whose exponent bits are all ones. Integer tests vectorize
 * under -O3 (a float compare in a reduction would not, without -ffast-math). */
#define F32_EXPONENT 0x7F800000u

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
static int copy_f32_finite(uint32_t *restrict dst, const uint32_t *restrict src, size_t n)
{
    uint32_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t v = src[i];
        dst[i] = v;
        bad |= (uint32_t)((v & F32_EXPONENT) == F32_EXPONENT);
    }
    return bad == 0;
}

PyDoc_STRVAR(copy_f32_doc,
"copy_f32(dst, src) -> bool\n\n"
"Copy the float32 values of buffer src into buffer dst (same length, a multiple of 4 bytes, not\n"
"overlapping) and return True if none of the copied values is NaN or +-Inf.");

static PyObject *copy_f32(PyObject *self, PyObject *args)
{
    Py_buffer dst, src;
    if (!PyArg_ParseTuple(args, "w*y*:copy_f32", &dst, &src))
        return NULL;
    PyObject *result = NULL;
    const char *d = dst.buf, *s = src.buf;
    if (dst.len != src.len || dst.len % 4) {
        PyErr_Format(PyExc_ValueError, "copy_f32 needs equal lengths, a multiple of 4 bytes: dst %zd, src %zd bytes",
                     dst.len, src.len);
    } else if (d < s + src.len && s < d + dst.len) {
        PyErr_SetString(PyExc_ValueError, "copy_f32: dst and src overlap");
    } else {
        int finite;
        Py_BEGIN_ALLOW_THREADS
        finite = copy_f32_finite((uint32_t *)dst.buf, (const uint32_t *)src.buf, (size_t)dst.len / 4);
        Py_END_ALLOW_THREADS
        result = PyBool_FromLong(finite);
    }
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return result;
}

static PyMethodDef methods[] = {
    {"copy_f32", copy_f32, METH_VARARGS, copy_f32_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_copycheck", "A fused copy and NaN/Inf check of float32 buffers.", -1, methods,
};

PyMODINIT_FUNC PyInit__copycheck(void)
{
    return PyModule_Create(&module);
}
