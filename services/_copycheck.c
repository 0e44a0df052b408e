/* The data plane's copies in C: one pass that copies float32 values and checks them for NaN/Inf
 * (shardline.services.tensor_checks), a receive from a TCP socket that checks each piece as it lands
 * (recv_f32, below), a copy that bypasses the caches (copy_stream), and a plain copy that lets
 * other threads run meanwhile (copy, at the end).
 *
 * A one-copy push (ps_server/node.py, take_push) copies a gradient out of the client's shared memory
 * and must refuse NaN/Inf in the copy it keeps, never in the client's memory, which the client could
 * still change. Copying and then reading the copy back costs two passes; here every value is loaded
 * once, stored, and its exponent tested in the same register, so what is checked is exactly what was
 * stored. The GIL is released: the node's two copy threads run at once. A push received through the
 * shm ring (ShmConnection.recv_checked_into) copies its chunks out the same way.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <math.h>
#include <poll.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#if defined(__x86_64__)
#include <emmintrin.h>
#endif

/* NaN and +-Inf are the float32 values whose exponent bits are all ones. Integer tests vectorize
 * under -O3 (a float compare in a reduction would not, without -ffast-math). */
#define F32_EXPONENT 0x7F800000u

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
static int copy_words_finite(char *restrict dst, const char *restrict src, size_t words)
{
    uint32_t bad = 0;
    for (size_t i = 0; i < words; i++) {
        uint32_t v;
        memcpy(&v, src + 4 * i, 4);  /* the ring's bytes need not be 4-aligned: an unaligned load */
        memcpy(dst + 4 * i, &v, 4);
        bad |= (uint32_t)((v & F32_EXPONENT) == F32_EXPONENT);
    }
    return bad == 0;
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
static int words_finite(const char *p, size_t words)
{
    uint32_t bad = 0;
    for (size_t i = 0; i < words; i++) {
        uint32_t v;
        memcpy(&v, p + 4 * i, 4);
        bad |= (uint32_t)((v & F32_EXPONENT) == F32_EXPONENT);
    }
    return bad == 0;
}

/* Both copies take two buffers of the same length that do not overlap: 1 if so, else 0 with a
 * ValueError naming the function. */
static int check_pair(const char *name, const Py_buffer *dst, const Py_buffer *src)
{
    const char *d = dst->buf, *s = src->buf;
    if (dst->len != src->len) {
        PyErr_Format(PyExc_ValueError, "%s needs equal lengths: dst %zd, src %zd bytes", name, dst->len, src->len);
        return 0;
    }
    if (d < s + src->len && s < d + dst->len) {
        PyErr_Format(PyExc_ValueError, "%s: dst and src overlap", name);
        return 0;
    }
    return 1;
}

PyDoc_STRVAR(copy_f32_doc,
"copy_f32(dst, src, start=0) -> bool\n\n"
"Copy buffer src into buffer dst (same length, not overlapping) and return True if no float32 value\n"
"lying wholly in the copy is NaN or +-Inf. dst[0] is byte `start` of a float32 array: values begin\n"
"where start plus the offset is a multiple of 4. Bytes of a value cut by either end of the copy are\n"
"copied, not checked (the caller checks that value once its other bytes are in).");

static PyObject *copy_f32(PyObject *self, PyObject *args)
{
    Py_buffer dst, src;
    Py_ssize_t start = 0;
    if (!PyArg_ParseTuple(args, "w*y*|n:copy_f32", &dst, &src, &start))
        return NULL;
    PyObject *result = NULL;
    char *d = dst.buf;
    const char *s = src.buf;
    if (start < 0) {
        PyErr_Format(PyExc_ValueError, "copy_f32: start must be >= 0, got %zd", start);
    } else if (check_pair("copy_f32", &dst, &src)) {
        size_t n = (size_t)dst.len, head = (size_t)((4 - start % 4) % 4);
        if (head > n)
            head = n;
        size_t words = (n - head) / 4, tail = n - head - 4 * words;
        int finite;
        Py_BEGIN_ALLOW_THREADS
        memcpy(d, s, head);
        finite = copy_words_finite(d + head, s + head, words);
        memcpy(d + head + 4 * words, s + head + 4 * words, tail);
        Py_END_ALLOW_THREADS
        result = PyBool_FromLong(finite);
    }
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return result;
}

/* A pull placed in a client's shared cache (ShmConnection.place_many) is written by the node and read
 * only by the client, later: stores that bypass the node's caches skip reading each destination line
 * before it is overwritten, which is a third of a large copy's memory traffic. glibc's memcpy streams
 * only copies larger than its non-temporal threshold (here 192 MiB: it takes the host's cache for
 * this VM's), never a 1 MiB block. Elsewhere than x86-64 this is memcpy. */
static void copy_streaming(char *d, const char *s, size_t n)
{
#if defined(__x86_64__)
    size_t head = (size_t)(-(uintptr_t)d & 15);  /* streaming stores need 16-byte aligned addresses */
    if (head > n)
        head = n;
    memcpy(d, s, head);
    d += head, s += head, n -= head;
    for (; n >= 64; n -= 64, d += 64, s += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)s), b = _mm_loadu_si128((const __m128i *)(s + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + 32)), e = _mm_loadu_si128((const __m128i *)(s + 48));
        _mm_stream_si128((__m128i *)d, a);
        _mm_stream_si128((__m128i *)(d + 16), b);
        _mm_stream_si128((__m128i *)(d + 32), c);
        _mm_stream_si128((__m128i *)(d + 48), e);
    }
    memcpy(d, s, n);
    _mm_sfence();  /* the streamed stores are visible before the reply that says they are there */
#else
    memcpy(d, s, n);
#endif
}

/* A push received over TCP (services/dataplane_server.py) is checked for NaN/Inf where it lands:
 * the values each recv() completed are tested right after it, while they are still in this core's
 * cache, instead of in a pass over the whole 1 MiB block once it is in (by then partly evicted by
 * the bytes that followed it), and the loop runs without the GIL and without a Python call per
 * recv(). RECV_PIECE bounds what one recv() lands, so what is tested next is cache-hot. */
#define RECV_PIECE (256 * 1024)

static double monotonic_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);  /* the clock of Python's time.monotonic() */
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

PyDoc_STRVAR(recv_f32_doc,
"recv_f32(fd, dst, deadline) -> (received, finite)\n\n"
"Receive into writable buffer dst from stream socket fd until dst is full, the peer closes, or\n"
"time.monotonic() passes deadline (a negative deadline: no limit), whatever the socket's blocking\n"
"mode. Returns the bytes received and whether no float32 value lying wholly in them is NaN or +-Inf\n"
"(dst[0] begins a value). Raises OSError for a failed recv().");

static PyObject *recv_f32(PyObject *self, PyObject *args)
{
    int fd;
    Py_buffer dst;
    double deadline;
    if (!PyArg_ParseTuple(args, "iw*d:recv_f32", &fd, &dst, &deadline))
        return NULL;
    char *d = dst.buf;
    size_t n = (size_t)dst.len, got = 0, checked = 0;
    int finite = 1, err = 0;
    Py_BEGIN_ALLOW_THREADS
    while (got < n) {
        double left = deadline < 0 ? 0 : deadline - monotonic_seconds();
        if (deadline >= 0 && left <= 0)
            break;  /* however the bytes trickle in: the caller sees fewer than asked */
        size_t want = n - got < RECV_PIECE ? n - got : RECV_PIECE;
        ssize_t r = recv(fd, d + got, want, MSG_DONTWAIT);
        if (r > 0) {
            got += (size_t)r;
            size_t upto = got & ~(size_t)3;  /* a value cut by this recv() is tested after the next */
            if (upto > checked) {
                finite &= words_finite(d + checked, (upto - checked) / 4);
                checked = upto;
            }
            continue;
        }
        if (r == 0)
            break;  /* the peer closed */
        if (errno == EINTR)
            continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) {
            err = errno;
            break;
        }
        int wait_ms = -1;
        if (deadline >= 0)
            wait_ms = left > 86400.0 ? 86400000 : (int)ceil(left * 1000.0);
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, wait_ms) < 0 && errno != EINTR) {
            err = errno;
            break;
        }
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dst);
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return Py_BuildValue("(nO)", (Py_ssize_t)got, finite ? Py_True : Py_False);
}

PyDoc_STRVAR(copy_stream_doc,
"copy_stream(dst, src)\n\n"
"Copy buffer src into buffer dst (same length, not overlapping), bypassing this CPU's caches where\n"
"the CPU allows (x86-64): for a copy the process will not read back, as a pull placed in a client's\n"
"shared memory. The GIL is released meanwhile.");

/* Below this a copy keeps the GIL: handing it over and taking it back can cost more than a small
 * copy, and a thread that releases it may wait for another's Python to give it back. */
#define RELEASE_GIL_BYTES (256 * 1024)

/* copy_stream and copy: parse (dst, src), check them as a pair, run `copier` on them, with the GIL
 * released for copies of `release_from` bytes or more. */
static PyObject *copy_pair(PyObject *args, const char *format, const char *name,
                           void (*copier)(char *, const char *, size_t), Py_ssize_t release_from)
{
    Py_buffer dst, src;
    if (!PyArg_ParseTuple(args, format, &dst, &src))
        return NULL;
    PyObject *result = NULL;
    if (check_pair(name, &dst, &src)) {
        if (dst.len >= release_from) {
            Py_BEGIN_ALLOW_THREADS
            copier(dst.buf, src.buf, (size_t)dst.len);
            Py_END_ALLOW_THREADS
        } else {
            copier(dst.buf, src.buf, (size_t)dst.len);
        }
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return result;
}

static PyObject *copy_stream(PyObject *self, PyObject *args)
{
    return copy_pair(args, "w*y*:copy_stream", "copy_stream", copy_streaming, 0);
}

PyDoc_STRVAR(copy_doc,
"copy(dst, src)\n\n"
"Copy buffer src into buffer dst (same length, not overlapping), as memoryview slice assignment\n"
"does, but with the GIL released for copies of 256 KiB or more: two threads of a node placing two\n"
"pulls, or a client's sender and its training thread, then run at once.");

static void copy_plain(char *d, const char *s, size_t n)
{
    memcpy(d, s, n);
}

static PyObject *copy(PyObject *self, PyObject *args)
{
    return copy_pair(args, "w*y*:copy", "copy", copy_plain, RELEASE_GIL_BYTES);
}

static PyMethodDef methods[] = {
    {"copy", copy, METH_VARARGS, copy_doc},
    {"copy_f32", copy_f32, METH_VARARGS, copy_f32_doc},
    {"copy_stream", copy_stream, METH_VARARGS, copy_stream_doc},
    {"recv_f32", recv_f32, METH_VARARGS, recv_f32_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_copycheck", "The data plane's copies: a fused copy and NaN/Inf check of float32 buffers, a receive that checks float32 values as they land, a copy that bypasses the caches, and a copy without the GIL.", -1, methods,
};

PyMODINIT_FUNC PyInit__copycheck(void)
{
    return PyModule_Create(&module);
}
