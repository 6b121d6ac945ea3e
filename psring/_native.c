/* psring._native: the same-host board's hot loop in C (optional; psring/transport/board.py keeps the
 * pure-Python path and uses this only where it imports and PSRING_NATIVE is not off).
 *
 * A board (psring.transport.board) is a shared-memory pool of two slots, each a 256-byte head (four
 * int64: post number, mark, payload bytes, tag bytes; then the tag) and the payload, after one header
 * page that holds the owner's ack and sleep fields. This module reads and writes exactly those fields,
 * in the order the Python path does (payload, tag, sizes, the post number last, stored with release
 * semantics; readers load it with acquire semantics), so native and Python ranks share one board.
 *
 * What it does, per call, without a Python frame or a numpy call: post (and say which peers sleep
 * on the post), poll the peers' heads (spinning, then yielding the core between polls, for a time
 * budget), check every peer's post against this rank's call, and fold every rank's post in the
 * canonical order (element i of ring chunk c: ((x_c op x_c+1) op ...) op x_c-1, ranks mod N; avg:
 * that sum divided by N) for sum, avg and prod of float32, float64 and the 32- and 64-bit integers
 * (integers in unsigned arithmetic: numpy's wrap-around). Floats are folded one IEEE operation at a
 * time (built with -ffp-contract=off, no fast-math), so the bits are numpy's.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#define MAX_PEERS 63

typedef struct {
    PyObject_HEAD
    int npeers;
    int closed;
    Py_ssize_t page, head, tag_max, ack_at, sleep_at;
    Py_buffer own;
    Py_ssize_t own_slot;
    int own_held;
    Py_buffer peers[MAX_PEERS];
    Py_ssize_t peer_slot[MAX_PEERS];
    int peers_held;
} NBoard;

static inline char *slot_at(char *base, Py_ssize_t page, Py_ssize_t slot_bytes, long long k) {
    return base + page + (k & 1) * slot_bytes;
}

static inline char *own_slot(NBoard *b, long long k) {
    return slot_at((char *)b->own.buf, b->page, b->own_slot, k);
}

static inline char *peer_slot(NBoard *b, int i, long long k) {
    return slot_at((char *)b->peers[i].buf, b->page, b->peer_slot[i], k);
}

static inline int64_t load(const char *at) {
    return __atomic_load_n((const int64_t *)at, __ATOMIC_ACQUIRE);
}

static void nb_release(NBoard *b) {
    if (b->own_held) {
        PyBuffer_Release(&b->own);
        b->own_held = 0;
    }
    for (int i = 0; i < b->peers_held; i++)
        PyBuffer_Release(&b->peers[i]);
    b->peers_held = 0;
    b->closed = 1;
}

static void nb_dealloc(NBoard *b) {
    nb_release(b);
    Py_TYPE(b)->tp_free((PyObject *)b);
}

/* NBoard(own, own_slot_bytes, peers, page, head, tag_max, ack_at, sleep_at); peers: [(buffer, slot_bytes)] */
static int nb_init(NBoard *b, PyObject *args, PyObject *kwds) {
    PyObject *own, *peers;
    Py_ssize_t own_slot;
    if (!PyArg_ParseTuple(args, "OnOnnnnn", &own, &own_slot, &peers, &b->page, &b->head, &b->tag_max, &b->ack_at,
                          &b->sleep_at))
        return -1;
    nb_release(b);
    b->closed = 0;
    if (!PyList_Check(peers) || PyList_GET_SIZE(peers) > MAX_PEERS) {
        PyErr_Format(PyExc_ValueError, "peers: a list of at most %d (buffer, slot bytes) pairs", MAX_PEERS);
        return -1;
    }
    if (b->head < 32 || b->tag_max > b->head - 32 || b->sleep_at + 8 > b->page || b->ack_at + 8 > b->page) {
        PyErr_SetString(PyExc_ValueError, "a board's layout does not fit its page");
        return -1;
    }
    if (PyObject_GetBuffer(own, &b->own, PyBUF_WRITABLE | PyBUF_SIMPLE) < 0)
        return -1;
    b->own_held = 1;
    b->own_slot = own_slot;
    if (own_slot < b->head || b->own.len < b->page + 2 * own_slot) {
        PyErr_SetString(PyExc_ValueError, "the board's own pool is smaller than its two slots");
        nb_release(b);
        return -1;
    }
    Py_ssize_t n = PyList_GET_SIZE(peers);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(peers, i);
        PyObject *buf;
        Py_ssize_t slot;
        if (!PyArg_ParseTuple(item, "On", &buf, &slot)) {
            nb_release(b);
            return -1;
        }
        if (PyObject_GetBuffer(buf, &b->peers[i], PyBUF_SIMPLE) < 0) {
            nb_release(b);
            return -1;
        }
        b->peers_held = (int)i + 1;
        b->peer_slot[i] = slot;
        if (slot < b->head || b->peers[i].len < b->page + 2 * slot) {
            PyErr_Format(PyExc_ValueError, "peer %zd's pool is smaller than its two slots", i);
            nb_release(b);
            return -1;
        }
    }
    b->npeers = (int)n;
    b->closed = 0;
    return 0;
}

static int nb_usable(NBoard *b) {
    if (b->closed) {
        PyErr_SetString(PyExc_ValueError, "the native board is closed");
        return 0;
    }
    return 1;
}

/* write post k (payload, tag, sizes, the number last) and return the mask of the peers asleep on it
 * (their sleep field 2k); -1 with an exception set when it does not fit */
static long long do_post(NBoard *b, long long k, const Py_buffer *tag, const void *pay, Py_ssize_t len) {
    if (tag->len > b->tag_max || len > b->own_slot - b->head) {
        PyErr_Format(PyExc_ValueError, "a post carries at most %zd bytes and a %zd-byte tag", b->own_slot - b->head,
                     b->tag_max);
        return -1;
    }
    char *slot = own_slot(b, k);
    if (len)
        memcpy(slot + b->head, pay, (size_t)len);
    memcpy(slot + 32, tag->buf, (size_t)tag->len);
    int64_t *h = (int64_t *)slot;
    __atomic_store_n(&h[2], (int64_t)len, __ATOMIC_RELAXED);
    __atomic_store_n(&h[3], (int64_t)tag->len, __ATOMIC_RELAXED);
    __atomic_store_n(&h[0], (int64_t)k, __ATOMIC_RELEASE); /* last: a reader that sees k finds the rest */
    long long mask = 0;
    for (int i = 0; i < b->npeers; i++)
        if (load((char *)b->peers[i].buf + b->sleep_at) == 2 * (int64_t)k)
            mask |= 1LL << i;
    return mask;
}

/* post(k, tag, payload) -> the bit mask of the peers asleep on post k (their sleep field 2k) */
static PyObject *nb_post(NBoard *b, PyObject *args) {
    long long k;
    Py_buffer tag, pay;
    if (!PyArg_ParseTuple(args, "Ly*y*", &k, &tag, &pay))
        return NULL;
    PyObject *result = NULL;
    if (nb_usable(b)) {
        long long mask = do_post(b, k, &tag, pay.buf, pay.len);
        if (mask >= 0)
            result = PyLong_FromLongLong(mask);
    }
    PyBuffer_Release(&tag);
    PyBuffer_Release(&pay);
    return result;
}

static inline int all_at(NBoard *b, long long k, int field) {
    for (int i = 0; i < b->npeers; i++)
        if (load(peer_slot(b, i, k) + 8 * field) < k)
            return 0;
    return 1;
}

static int field_ok(int field) {
    if (field < 0 || field > 1) {
        PyErr_SetString(PyExc_ValueError, "field is 0 (posted) or 1 (marked)");
        return 0;
    }
    return 1;
}

/* all_at(k, field) -> whether every peer's slot k % 2 has head field (0: post, 1: mark) at k or past */
static PyObject *nb_all_at(NBoard *b, PyObject *args) {
    long long k;
    int field;
    if (!PyArg_ParseTuple(args, "Li", &k, &field))
        return NULL;
    if (!nb_usable(b) || !field_ok(field))
        return NULL;
    return PyBool_FromLong(all_at(b, k, field));
}

static inline double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* poll until all_at(k, field): `hot` polls back to back, then polls with the core yielded (the GIL
 * released) between them until budget_s has passed; 1 came true, 0 not, -1 the board closed meanwhile */
static int do_spin(NBoard *b, long long k, int field, int hot, double budget) {
    if (all_at(b, k, field))
        return 1;
    for (int i = 0; i < hot; i++)
        if (all_at(b, k, field))
            return 1;
    double end = now_s() + budget;
    while (now_s() < end) {
        Py_BEGIN_ALLOW_THREADS
        sched_yield();
        Py_END_ALLOW_THREADS
        if (b->closed) /* closed meanwhile (the GIL was free): its maps may be gone */
            return -1;
        if (all_at(b, k, field))
            return 1;
    }
    return 0;
}

/* spin(k, field, hot, budget_s) -> whether all_at(k, field) came true (see do_spin) */
static PyObject *nb_spin(NBoard *b, PyObject *args) {
    long long k;
    int field, hot;
    double budget;
    if (!PyArg_ParseTuple(args, "Liid", &k, &field, &hot, &budget))
        return NULL;
    if (!nb_usable(b) || !field_ok(field))
        return NULL;
    return PyBool_FromLong(do_spin(b, k, field, hot, budget) == 1);
}

/* the index (in peer order) of the first peer whose slot k % 2 does not hold post k with this tag and
 * nbytes of payload, or -1 */
static int do_differs(NBoard *b, long long k, const Py_buffer *tag, Py_ssize_t nbytes) {
    if (tag->len > b->tag_max) /* no post carries it (and the compare would read past the head) */
        return b->npeers > 0 ? 0 : -1;
    for (int i = 0; i < b->npeers; i++) {
        char *slot = peer_slot(b, i, k);
        if (load(slot) != k || load(slot + 16) != nbytes || load(slot + 24) != tag->len ||
            memcmp(slot + 32, tag->buf, (size_t)tag->len) != 0)
            return i;
    }
    return -1;
}

/* differs(k, tag, nbytes) -> see do_differs */
static PyObject *nb_differs(NBoard *b, PyObject *args) {
    long long k;
    Py_buffer tag;
    Py_ssize_t nbytes;
    if (!PyArg_ParseTuple(args, "Ly*n", &k, &tag, &nbytes))
        return NULL;
    PyObject *result = nb_usable(b) ? PyLong_FromLong(do_differs(b, k, &tag, nbytes)) : NULL;
    PyBuffer_Release(&tag);
    return result;
}

#define FOLD(T, EXPR)                                                                                              \
    do {                                                                                                           \
        T *o = (T *)out;                                                                                           \
        for (int c = 0; c < n; c++) {                                                                              \
            Py_ssize_t a = (Py_ssize_t)((long long)c * count / n), z = (Py_ssize_t)((long long)(c + 1) * count / n); \
            const T *first = (const T *)rows[c];                                                                   \
            for (Py_ssize_t i = a; i < z; i++)                                                                     \
                o[i] = first[i];                                                                                   \
            for (int j = 1; j < n; j++) {                                                                          \
                const T *r = (const T *)rows[(c + j) % n];                                                         \
                for (Py_ssize_t i = a; i < z; i++)                                                                 \
                    o[i] = EXPR;                                                                                   \
            }                                                                                                      \
        }                                                                                                          \
    } while (0)

/* FOLD for a floating type: sum or prod, and avg's division by the ranks (one IEEE operation each) */
#define FOLD_FLOAT(T)                                                                                              \
    do {                                                                                                           \
        if (prod)                                                                                                  \
            FOLD(T, o[i] * r[i]);                                                                                  \
        else                                                                                                       \
            FOLD(T, o[i] + r[i]);                                                                                  \
        if (avg) {                                                                                                 \
            T d = (T)n, *o = (T *)out;                                                                             \
            for (Py_ssize_t i = 0; i < count; i++)                                                                 \
                o[i] = o[i] / d;                                                                                   \
        }                                                                                                          \
    } while (0)

/* the op's code: 0 sum, 1 avg, 2 prod, -1 one this module does not fold */
static int op_code(const char *op) {
    return strcmp(op, "sum") == 0 ? 0 : strcmp(op, "avg") == 0 ? 1 : strcmp(op, "prod") == 0 ? 2 : -1;
}

static Py_ssize_t kind_size(int kind) {
    return (kind == 'f' || kind == 'i' || kind == 'I') ? 4 : (kind == 'd' || kind == 'q' || kind == 'Q') ? 8 : 0;
}

/* every rank's post k (this rank's own from `own`, at rank `me`) folded into `out` in the canonical
 * order; 1 done, 0 a (kind, op) this module does not fold, or an input or output not aligned to its
 * type (the vectorised loops assume it), -1 with an exception set */
static int do_fold(NBoard *b, long long k, int me, const void *own, void *out, Py_ssize_t len, int kind, int op) {
    int n = b->npeers + 1;
    Py_ssize_t item = kind_size(kind);
    if (item == 0 || op < 0 || (op == 1 && kind != 'f' && kind != 'd'))
        return 0;
    if ((uintptr_t)own % (uintptr_t)item || (uintptr_t)out % (uintptr_t)item)
        return 0;
    if (me < 0 || me >= n || len % item) {
        PyErr_SetString(PyExc_ValueError, "fold: the rank or the input's size is wrong");
        return -1;
    }
    const char *rows[MAX_PEERS + 1];
    for (int r = 0; r < n; r++) {
        if (r == me) {
            rows[r] = (const char *)own;
            continue;
        }
        int i = r < me ? r : r - 1;
        if (len > b->peer_slot[i] - b->head) {
            PyErr_Format(PyExc_ValueError, "fold: %zd bytes do not fit peer %d's slot", len, i);
            return -1;
        }
        rows[r] = peer_slot(b, i, k) + b->head;
    }
    Py_ssize_t count = len / item;
    int prod = op == 2, avg = op == 1;
    switch (kind) {
    case 'f':
        FOLD_FLOAT(float);
        break;
    case 'd':
        FOLD_FLOAT(double);
        break;
    case 'i':
    case 'I':
        if (prod)
            FOLD(uint32_t, (uint32_t)(o[i] * r[i]));
        else
            FOLD(uint32_t, (uint32_t)(o[i] + r[i]));
        break;
    default: /* 'q', 'Q' */
        if (prod)
            FOLD(uint64_t, o[i] * r[i]);
        else
            FOLD(uint64_t, o[i] + r[i]);
        break;
    }
    return 1;
}

/* fold(k, me, own, out, kind, op) -> True, or False for a (kind, op) this module does not fold.
 * kind: 'f' float32, 'd' float64, 'i' int32, 'I' uint32, 'q' int64, 'Q' uint64; op: "sum", "avg"
 * (floats), "prod". Call once differs(...) said every post is this call's. */
static PyObject *nb_fold(NBoard *b, PyObject *args) {
    long long k;
    int me, kind;
    Py_buffer own, outb;
    const char *op;
    if (!PyArg_ParseTuple(args, "Liy*w*Cs", &k, &me, &own, &outb, &kind, &op))
        return NULL;
    PyObject *result = NULL;
    if (nb_usable(b)) {
        if (own.len != outb.len) {
            PyErr_SetString(PyExc_ValueError, "fold: the input and the output differ in size");
        } else {
            int done = do_fold(b, k, me, own.buf, outb.buf, own.len, kind, op_code(op));
            if (done >= 0)
                result = PyBool_FromLong(done);
        }
    }
    PyBuffer_Release(&own);
    PyBuffer_Release(&outb);
    return result;
}

/* exchange(k, tag, x, out, kind, op, me, hot, budget_s) -> 0: done (out holds the fold); 1: posted, the
 * peers not all there within the budget; 2: posted, a peer's post is another call's (differs);
 * 4 * mask (mask > 0): posted, and these peers sleep on it (poke them; nothing else done).
 * The whole of a small board all_reduce whose peers are there in time, in one call: post, poll,
 * check, fold. (kind, op) must be one the fold takes. */
static PyObject *nb_exchange(NBoard *b, PyObject *args) {
    long long k;
    Py_buffer tag, x, outb;
    int kind, me, hot;
    const char *op;
    double budget;
    if (!PyArg_ParseTuple(args, "Ly*y*w*Csiid", &k, &tag, &x, &outb, &kind, &op, &me, &hot, &budget))
        return NULL;
    long long result = -1;
    int code = op_code(op);
    if (!nb_usable(b))
        goto done;
    Py_ssize_t item = kind_size(kind);
    if (x.len != outb.len || code < 0 || item == 0 || (uintptr_t)x.buf % (uintptr_t)item ||
        (uintptr_t)outb.buf % (uintptr_t)item) { /* checked before anything is posted */
        PyErr_SetString(PyExc_ValueError, "exchange: a call the native fold does not take");
        goto done;
    }
    long long mask = do_post(b, k, &tag, x.buf, x.len);
    if (mask != 0) {
        result = mask < 0 ? -1 : 4 * mask;
        goto done;
    }
    int ready = do_spin(b, k, 0, hot, budget);
    if (ready < 0) {
        PyErr_SetString(PyExc_ValueError, "the native board is closed");
        goto done;
    }
    if (!ready) {
        result = 1;
        goto done;
    }
    if (do_differs(b, k, &tag, x.len) >= 0) {
        result = 2;
        goto done;
    }
    int folded = do_fold(b, k, me, x.buf, outb.buf, x.len, kind, code);
    if (folded == 0)
        PyErr_SetString(PyExc_ValueError, "exchange: a call the native fold does not take");
    result = folded == 1 ? 0 : -1;
done:
    PyBuffer_Release(&tag);
    PyBuffer_Release(&x);
    PyBuffer_Release(&outb);
    return result < 0 ? NULL : PyLong_FromLongLong(result);
}

static PyObject *nb_close(NBoard *b, PyObject *Py_UNUSED(ignored)) {
    nb_release(b);
    Py_RETURN_NONE;
}

static PyMethodDef nb_methods[] = {
    {"post", (PyCFunction)nb_post, METH_VARARGS, "post(k, tag, payload) -> mask of the peers asleep on k"},
    {"all_at", (PyCFunction)nb_all_at, METH_VARARGS, "all_at(k, field) -> every peer's field at k or past"},
    {"spin", (PyCFunction)nb_spin, METH_VARARGS, "spin(k, field, hot, budget_s) -> all_at came true"},
    {"differs", (PyCFunction)nb_differs, METH_VARARGS, "differs(k, tag, nbytes) -> first differing peer or -1"},
    {"fold", (PyCFunction)nb_fold, METH_VARARGS, "fold(k, me, own, out, kind, op) -> folded (False: not here)"},
    {"exchange", (PyCFunction)nb_exchange, METH_VARARGS, "exchange(k, tag, x, out, kind, op, me, hot, budget_s)"},
    {"close", (PyCFunction)nb_close, METH_NOARGS, "release the buffers (the board's maps may close)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject NBoardType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "psring._native.NBoard",
    .tp_basicsize = sizeof(NBoard),
    .tp_dealloc = (destructor)nb_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "a board's own pool and its peers' pools, seen from C",
    .tp_methods = nb_methods,
    .tp_init = (initproc)nb_init,
    .tp_new = PyType_GenericNew,
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT, "psring._native", "The same-host board's hot loop in C (optional).", -1, NULL,
};

PyMODINIT_FUNC PyInit__native(void) {
    if (PyType_Ready(&NBoardType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&native_module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&NBoardType);
    if (PyModule_AddObject(m, "NBoard", (PyObject *)&NBoardType) < 0) {
        Py_DECREF(&NBoardType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
