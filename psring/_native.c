/* psring._native: the same-host board's hot loop in C, the TCP small-message links' exchange, and the
 * data plane's ring over TCP on one thread (optional; psring/transport/board.py, transport/tcpmesh.py and
 * topology/ring/dataplane.py keep the pure-Python paths and use this only where it imports and
 * PSRING_NATIVE is not off).
 *
 * A board (psring.transport.board) is a shared-memory pool of two slots, each a 256-byte head (four
 * int64: post number, mark, payload bytes, tag bytes; then the tag) and the payload, after one header
 * page that holds the owner's ack and sleep fields. This module reads and writes exactly those fields,
 * in the order the Python path does (payload, tag, sizes, the post number last, stored with release
 * semantics; readers load it with acquire semantics), so native and Python ranks share one board.
 *
 * What it does for a board, per call, without a Python frame or a numpy call: post (and say which peers sleep
 * on the post), poll the peers' heads (spinning, then yielding the core between polls, for a time
 * budget), check every peer's post against this rank's call, and fold every rank's post in the
 * canonical order (element i of ring chunk c: ((x_c op x_c+1) op ...) op x_c-1, ranks mod N; avg:
 * that sum divided by N) for sum, avg and prod of float32, float64 and the 32- and 64-bit integers
 * (integers in unsigned arithmetic: numpy's wrap-around). Floats are folded one IEEE operation at a
 * time (built with -ffp-contract=off, no fast-math), so the bits are numpy's.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#if defined(__x86_64__) || defined(__i386__)
#include <emmintrin.h>
#endif

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
    int cancel; /* a streamed call (nb_stream) is abandoned: it returns at its next wait */
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
static long long do_post_but(NBoard *b, long long k, const Py_buffer *tag, const void *pay, Py_ssize_t len,
                             Py_ssize_t skip_a, Py_ssize_t skip_z);

static long long do_post(NBoard *b, long long k, const Py_buffer *tag, const void *pay, Py_ssize_t len) {
    return do_post_but(b, k, tag, pay, len, 0, 0);
}

/* do_post, the payload's bytes [skip_a, skip_z) not copied (the split fold writes them: split_rest) */
static long long do_post_but(NBoard *b, long long k, const Py_buffer *tag, const void *pay, Py_ssize_t len,
                             Py_ssize_t skip_a, Py_ssize_t skip_z) {
    if (tag->len > b->tag_max || len > b->own_slot - b->head) {
        PyErr_Format(PyExc_ValueError, "a post carries at most %zd bytes and a %zd-byte tag", b->own_slot - b->head,
                     b->tag_max);
        return -1;
    }
    char *slot = own_slot(b, k);
    if (skip_a > 0)
        memcpy(slot + b->head, pay, (size_t)skip_a);
    if (len > skip_z)
        memcpy(slot + b->head + skip_z, (const char *)pay + skip_z, (size_t)(len - skip_z));
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

/* rows[0..n-1] (n rows of len bytes, rank order) folded into `out` in the canonical order; 1 done, 0 a
 * (kind, op) this module does not fold, or a row or the output not aligned to its type (the vectorised
 * loops assume it) */
static int fold_rows(const char **rows, int n, void *out, Py_ssize_t len, int kind, int op) {
    Py_ssize_t item = kind_size(kind);
    if (item == 0 || op < 0 || (op == 1 && kind != 'f' && kind != 'd') || len % item)
        return 0;
    if ((uintptr_t)out % (uintptr_t)item)
        return 0;
    for (int r = 0; r < n; r++)
        if ((uintptr_t)rows[r] % (uintptr_t)item)
            return 0;
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

/* every rank's post k (this rank's own from `own`, at rank `me`) folded into `out` in the canonical
 * order (fold_rows); 1 done, 0 not here (fold_rows), -1 with an exception set */
static int do_fold(NBoard *b, long long k, int me, const void *own, void *out, Py_ssize_t len, int kind, int op) {
    int n = b->npeers + 1;
    if (kind_size(kind) == 0 || op < 0)
        return 0;
    if (me < 0 || me >= n || len % kind_size(kind)) {
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
    return fold_rows(rows, n, out, len, kind, op);
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

static void fold_from(const char **rows, int n, int first, void *out, Py_ssize_t count, int kind, int op);

/* the split fold's rest, every post k there and this call's (psring.topology.ring.board): fold ring chunk
 * `me` of every rank's post in the canonical order (this rank's first) over this rank's own post of it,
 * mark the post, and once every peer marked its own, copy every rank's folded chunk into out. 0 done; 3
 * marked, peers asleep on the mark (poke them, then wait for the marks); 5 marked, the marks not all
 * there within the budget */
static int split_rest(NBoard *b, long long k, int me, const char *x, char *out, Py_ssize_t len, int kind, int op,
                      int hot, double budget) {
    int n = b->npeers + 1;
    Py_ssize_t item = kind_size(kind), count = len / item;
    const char *rows[MAX_PEERS + 1];
    for (int r = 0; r < n; r++)
        rows[r] = (r == me ? own_slot(b, k) : peer_slot(b, r < me ? r : r - 1, k)) + b->head;
    Py_ssize_t a = (Py_ssize_t)((long long)me * count / n), z = (Py_ssize_t)((long long)(me + 1) * count / n);
    if (a < z) { /* this rank's own chunk from x (the post left it out), the result over the post's */
        const char *chunk[MAX_PEERS + 1];
        for (int r = 0; r < n; r++)
            chunk[r] = r == me ? x + a * item : rows[r] + a * item;
        fold_from(chunk, n, me, (char *)rows[me] + a * item, z - a, kind, op);
    }
    int64_t *head = (int64_t *)own_slot(b, k);
    __atomic_store_n(&head[1], (int64_t)k, __ATOMIC_RELEASE); /* marked: after the folded chunk */
    for (int i = 0; i < b->npeers; i++)
        if (load((char *)b->peers[i].buf + b->sleep_at) == 2 * (int64_t)k + 1)
            return 3;
    int ready = do_spin(b, k, 1, hot, budget);
    if (ready != 1)
        return ready < 0 ? -1 : 5; /* -1: closed meanwhile (its maps may be gone) */
    for (int r = 0; r < n; r++) {
        Py_ssize_t c0 = (Py_ssize_t)((long long)r * count / n), c1 = (Py_ssize_t)((long long)(r + 1) * count / n);
        if (c0 < c1)
            memcpy(out + c0 * item, rows[r] + c0 * item, (size_t)((c1 - c0) * item));
    }
    return 0;
}

/* exchange(k, tag, x, out, kind, op, me, hot, budget_s) -> 0: done (out holds the fold); 1: posted, the
 * peers not all there within the budget; 2: posted, a peer's post is another call's (differs);
 * 4 * mask (mask > 0): posted, and these peers sleep on it (poke them; nothing else done).
 * The whole of a small board all_reduce whose peers are there in time, in one call: post, poll,
 * check, fold. (kind, op) must be one the fold takes. split: the fold split over the ranks (see
 * split_rest), which may also return 3: folded and marked, and peers sleep on the mark (poke them), or
 * 5: folded and marked, the peers' marks not all there within the budget. */
static PyObject *nb_exchange(NBoard *b, PyObject *args) {
    long long k;
    Py_buffer tag, x, outb;
    int kind, me, hot, split = 0;
    const char *op;
    double budget;
    if (!PyArg_ParseTuple(args, "Ly*y*w*Csiid|p", &k, &tag, &x, &outb, &kind, &op, &me, &hot, &budget, &split))
        return NULL;
    long long result = -1;
    int code = op_code(op);
    if (!nb_usable(b))
        goto done;
    Py_ssize_t item = kind_size(kind);
    if (x.len != outb.len || code < 0 || item == 0 || (uintptr_t)x.buf % (uintptr_t)item ||
        (uintptr_t)outb.buf % (uintptr_t)item || me < 0 || me > b->npeers || x.len % item) {
        /* checked before anything is posted */
        PyErr_SetString(PyExc_ValueError, "exchange: a call the native fold does not take");
        goto done;
    }
    /* split: this rank's own ring chunk stays out of the post (nobody reads it before split_rest folds it there) */
    Py_ssize_t n_all = b->npeers + 1, count = x.len / item;
    Py_ssize_t skip_a = split ? (Py_ssize_t)((long long)me * count / n_all) * item : 0;
    Py_ssize_t skip_z = split ? (Py_ssize_t)((long long)(me + 1) * count / n_all) * item : 0;
    long long mask = do_post_but(b, k, &tag, x.buf, x.len, skip_a, skip_z);
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
    if (split) {
        result = split_rest(b, k, me, x.buf, outb.buf, x.len, kind, code, hot, budget);
        if (result < 0)
            PyErr_SetString(PyExc_ValueError, "the native board is closed");
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

/* ------------------------------------------------------------------------------------------------------
 * A streamed board call (psring.topology.ring.board: all_reduces too large for a post): the split fold
 * of the board, one block at a time. Block g holds piece g of every ring chunk (`piece` elements of
 * chunk c from its start, fewer at its end); it goes through sub-slot g % depth of every rank's slot
 * k % 2: each rank copies its pieces in (but its own chunk's), folds ring chunk `me`'s piece of every
 * rank's sub-slot -- its own from x -- in the canonical order into its own sub-slot (no other rank reads
 * it before it is folded), and copies every rank's folded piece out. A block's data is touched while it is in the caches, so a rank reads its input once
 * and writes its result once from memory, where a copy in, a fold and a copy out of the whole tensor
 * would each go to memory. Three counters at the start of the slot's payload (a cache line each) say
 * how far its owner is: blocks posted, folded and done (copied out); a rank reuses a sub-slot once every
 * peer is done with the block it held. The counters are zeroed before the post that begins the call
 * (Board.stream_post), so a reader that sees post k reads this call's. */
#define ST_POSTED 0
#define ST_FOLDED 64
#define ST_DONE 128
#define ST_DATA 256

static inline int64_t *st_own(NBoard *b, long long k, Py_ssize_t at) {
    return (int64_t *)(own_slot(b, k) + b->head + at);
}

/* wait until every peer's counter `at` is v or past: hot polls, then the core yielded between polls;
 * 1 it came, 0 not within budget_s, -1 the call was cancelled (GIL released by the caller) */
static int st_wait(NBoard *b, long long k, Py_ssize_t at, int64_t v, int hot, double budget) {
    double end = -1.0;
    for (int polls = 0;; polls++) {
        int i = 0;
        while (i < b->npeers && load(peer_slot(b, i, k) + b->head + at) >= v)
            i++;
        if (i == b->npeers)
            return 1;
        if (__atomic_load_n(&b->cancel, __ATOMIC_RELAXED))
            return -1;
        if (polls < hot)
            continue;
        if (end < 0.0)
            end = now_s() + budget;
        else if (now_s() >= end)
            return 0;
        sched_yield();
    }
}

/* a copy of a result out of the caches: streaming stores where x86 has them (the result is not read
 * again soon, and a plain store first reads each line from memory) */
static void copy_out(char *dst, const char *src, size_t len, int nt) {
#if defined(__x86_64__) || defined(__i386__)
    if (nt && len >= 256) {
        size_t head = (size_t)(-(uintptr_t)dst & 15);
        memcpy(dst, src, head);
        dst += head, src += head, len -= head;
        for (; len >= 64; len -= 64, dst += 64, src += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)src), c = _mm_loadu_si128((const __m128i *)(src + 16));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + 32)), e = _mm_loadu_si128((const __m128i *)(src + 48));
            _mm_stream_si128((__m128i *)dst, a);
            _mm_stream_si128((__m128i *)(dst + 16), c);
            _mm_stream_si128((__m128i *)(dst + 32), d);
            _mm_stream_si128((__m128i *)(dst + 48), e);
        }
    }
#else
    (void)nt;
#endif
    memcpy(dst, src, len);
}

/* rows[first], rows[first + 1], ..., rows[first - 1] (mod n) folded into out, count elements; avg: then
 * divided by n. out may be rows[first]. (kind, op) checked by the caller. */
/* (F: the op on two elements, a and b) */
#define FOLD_FROM(T, F)                                                                                            \
    do {                                                                                                           \
        T *o = (T *)out;                                                                                           \
        const T *f0 = (const T *)rows[first];                                                                      \
        if (n == 1) {                                                                                              \
            if (o != f0)                                                                                           \
                memcpy(o, f0, (size_t)count * sizeof(T));                                                          \
            break;                                                                                                 \
        }                                                                                                          \
        const T *r1 = (const T *)rows[(first + 1) % n];                                                            \
        for (Py_ssize_t i = 0; i < count; i++) /* o may be f0: in place */                                         \
            o[i] = F(f0[i], r1[i]);                                                                                \
        for (int j = 2; j < n; j++) {                                                                              \
            const T *r = (const T *)rows[(first + j) % n];                                                         \
            for (Py_ssize_t i = 0; i < count; i++)                                                                 \
                o[i] = F(o[i], r[i]);                                                                              \
        }                                                                                                          \
    } while (0)

#define F_ADD(a, b) ((a) + (b))
#define F_MUL(a, b) ((a) * (b))
#define F_ADD32(a, b) ((uint32_t)((a) + (b)))
#define F_MUL32(a, b) ((uint32_t)((a) * (b)))

#define FOLD_FROM_FLOAT(T)                                                                                         \
    do {                                                                                                           \
        if (op == 2)                                                                                               \
            FOLD_FROM(T, F_MUL);                                                                                   \
        else                                                                                                       \
            FOLD_FROM(T, F_ADD);                                                                                   \
        if (op == 1) {                                                                                             \
            T d = (T)n, *o = (T *)out;                                                                             \
            for (Py_ssize_t i = 0; i < count; i++)                                                                 \
                o[i] = o[i] / d;                                                                                   \
        }                                                                                                          \
    } while (0)

static void fold_from(const char **rows, int n, int first, void *out, Py_ssize_t count, int kind, int op) {
    switch (kind) {
    case 'f':
        FOLD_FROM_FLOAT(float);
        break;
    case 'd':
        FOLD_FROM_FLOAT(double);
        break;
    case 'i':
    case 'I':
        if (op == 2)
            FOLD_FROM(uint32_t, F_MUL32);
        else
            FOLD_FROM(uint32_t, F_ADD32);
        break;
    default: /* 'q', 'Q' */
        if (op == 2)
            FOLD_FROM(uint64_t, F_MUL);
        else
            FOLD_FROM(uint64_t, F_ADD);
        break;
    }
}

typedef struct {
    const char *x;
    char *out;
    Py_ssize_t count, item, piece, depth;
    int n, me, kind, op, hot, nt;
    double budget;
} Stream;

/* a rank's sub-slot s (this rank's own: r == me) */
static inline char *st_sub(NBoard *b, const Stream *st, long long k, int r, Py_ssize_t s) {
    char *slot = r == st->me ? own_slot(b, k) : peer_slot(b, r < st->me ? r : r - 1, k);
    return slot + b->head + ST_DATA + s * st->n * st->piece * st->item;
}

/* on from where this rank's counters say it is; 0 done, 1 a peer was not there within the budget, 2
 * cancelled. The caller holds no GIL. */
static int do_stream(NBoard *b, const Stream *st, long long k) {
    int n = st->n, me = st->me;
    Py_ssize_t item = st->item, piece = st->piece, longest = (st->count + n - 1) / n;
    Py_ssize_t blocks = (longest + piece - 1) / piece;
    int64_t *posted = st_own(b, k, ST_POSTED), *folded = st_own(b, k, ST_FOLDED), *done = st_own(b, k, ST_DONE);
    int w;
#define ST_WAIT(at, v)                                                                                             \
    if ((w = st_wait(b, k, at, v, st->hot, st->budget)) != 1)                                                      \
        return w == 0 ? 1 : 2;
    for (int64_t g = *done; g < blocks; g++) {
        Py_ssize_t s = g % st->depth;
        if (*posted == g) {
            if (g >= st->depth) {
                ST_WAIT(ST_DONE, g - st->depth + 1) /* every peer is done with the block this sub-slot held */
            }
            char *mine = st_sub(b, st, k, me, s);
            for (int c = 0; c < n; c++) { /* (its own chunk's piece the fold reads from x) */
                if (c == me)
                    continue;
                Py_ssize_t a = (Py_ssize_t)((long long)c * st->count / n) + g * piece;
                Py_ssize_t z = (Py_ssize_t)((long long)(c + 1) * st->count / n);
                if (a < z)
                    memcpy(mine + c * piece * item, st->x + a * item, (size_t)((z - a < piece ? z - a : piece) * item));
            }
            __atomic_store_n(posted, g + 1, __ATOMIC_RELEASE);
        }
        ST_WAIT(ST_POSTED, g + 1)
        if (*folded == g) {
            Py_ssize_t a = (Py_ssize_t)((long long)me * st->count / n) + g * piece;
            Py_ssize_t z = (Py_ssize_t)((long long)(me + 1) * st->count / n);
            if (a < z) {
                const char *rows[MAX_PEERS + 1];
                for (int r = 0; r < n; r++)
                    rows[r] = r == me ? st->x + a * item : st_sub(b, st, k, r, s) + me * piece * item;
                fold_from(rows, n, me, st_sub(b, st, k, me, s) + me * piece * item, z - a < piece ? z - a : piece,
                          st->kind, st->op);
            }
            __atomic_store_n(folded, g + 1, __ATOMIC_RELEASE);
        }
        ST_WAIT(ST_FOLDED, g + 1)
        for (int c = 0; c < n; c++) {
            Py_ssize_t a = (Py_ssize_t)((long long)c * st->count / n) + g * piece;
            Py_ssize_t z = (Py_ssize_t)((long long)(c + 1) * st->count / n);
            if (a < z)
                copy_out(st->out + a * item, st_sub(b, st, k, c, s) + c * piece * item,
                         (size_t)((z - a < piece ? z - a : piece) * item), st->nt);
        }
        __atomic_store_n(done, g + 1, __ATOMIC_RELEASE);
    }
#undef ST_WAIT
#if defined(__x86_64__) || defined(__i386__)
    _mm_sfence(); /* the streaming stores are out before another thread reads the result */
#endif
    return 0;
}

/* stream(k, me, x, out, kind, op, piece, depth, hot, budget_s, nt) -> 0: done (out holds the fold); 1: a
 * peer was not there within budget_s at one of the waits (call again: it goes on where it stands); 2:
 * cancelled (cancel_stream). Post k must be this call's on every board (stream_post, then differs); x
 * and out contiguous, alike, of a (kind, op) the fold takes; piece: elements of a chunk per block; nt:
 * streaming stores for the result. The GIL is released throughout. */
static PyObject *nb_stream(NBoard *b, PyObject *args) {
    long long k;
    Py_buffer x, outb;
    Stream st;
    const char *op;
    if (!PyArg_ParseTuple(args, "Liy*w*Csnnidi", &k, &st.me, &x, &outb, &st.kind, &op, &st.piece, &st.depth,
                          &st.hot, &st.budget, &st.nt))
        return NULL;
    PyObject *result = NULL;
    st.op = op_code(op);
    st.item = kind_size(st.kind);
    st.n = b->npeers + 1;
    if (!nb_usable(b))
        goto done;
    Py_ssize_t need = ST_DATA + st.depth * st.n * st.piece * st.item;
    int room = need <= b->own_slot - b->head;
    for (int i = 0; i < b->npeers; i++)
        room = room && need <= b->peer_slot[i] - b->head;
    if (x.len != outb.len || st.op < 0 || st.item == 0 || (st.op == 1 && st.kind != 'f' && st.kind != 'd') ||
        x.len % st.item || (uintptr_t)x.buf % (uintptr_t)st.item || (uintptr_t)outb.buf % (uintptr_t)st.item ||
        st.me < 0 || st.me >= st.n || st.piece < 1 || st.depth < 1 || !room) {
        PyErr_SetString(PyExc_ValueError, "stream: a call the native fold does not take, or one the slots do not hold");
        goto done;
    }
    st.x = (const char *)x.buf;
    st.out = (char *)outb.buf;
    st.count = x.len / st.item;
    int code;
    Py_BEGIN_ALLOW_THREADS
    code = do_stream(b, &st, k);
    Py_END_ALLOW_THREADS
    result = PyLong_FromLong(code);
done:
    PyBuffer_Release(&x);
    PyBuffer_Release(&outb);
    return result;
}

/* cancel_stream(flag): 1: a streamed call running or to run returns 2 at its next wait; 0: no more */
static PyObject *nb_cancel_stream(NBoard *b, PyObject *args) {
    int flag;
    if (!PyArg_ParseTuple(args, "p", &flag))
        return NULL;
    __atomic_store_n(&b->cancel, flag, __ATOMIC_RELAXED);
    Py_RETURN_NONE;
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
    {"stream", (PyCFunction)nb_stream, METH_VARARGS,
     "stream(k, me, x, out, kind, op, piece, depth, hot, budget_s, nt) -> 0 done, 1 wait, 2 cancelled"},
    {"cancel_stream", (PyCFunction)nb_cancel_stream, METH_VARARGS, "cancel_stream(flag): see stream"},
    {"close", (PyCFunction)nb_close, METH_NOARGS, "release the buffers (the board's maps may close)"},
    {NULL, NULL, 0, NULL},
};

/* ------------------------------------------------------------------------------------------------------
 * The TCP small-message links' read loop (psring.transport.tcpmesh): a link is a TcpLink whose `buf` (a
 * bytearray) holds buf[start:end] read and not used yet; a message is a 4-byte length and the message.
 * tcp_read reads the sockets and uses up messages exactly as TcpMesh.fill and TcpMesh.take do, and
 * writes start, end and bytes_received back, so the event loop reads on where this left off. */

#define TCP_READ (256 << 10) /* TcpMesh's _READ: the room a read asks for */
#define TCP_MAX_LINKS 4096

typedef struct {
    Py_buffer buf;
    Py_ssize_t start, end, row;
    long long got;
    int fd, done;
} TcpState;

static int attr_ssize(PyObject *o, const char *name, Py_ssize_t *v) {
    PyObject *a = PyObject_GetAttrString(o, name);
    if (a == NULL)
        return -1;
    *v = PyLong_AsSsize_t(a);
    Py_DECREF(a);
    return (*v == -1 && PyErr_Occurred()) ? -1 : 0;
}

static int set_ssize(PyObject *o, const char *name, Py_ssize_t v) {
    PyObject *a = PyLong_FromSsize_t(v);
    if (a == NULL)
        return -1;
    int r = PyObject_SetAttrString(o, name, a);
    Py_DECREF(a);
    return r;
}

/* the next message of a link: 1 it is `head` and `size` bytes more, whole (copied to `to`, used up);
 * 0 not whole yet and begins as `head` does so far; -1 it is another message */
static int tcp_take(TcpState *st, const char *head, Py_ssize_t hlen, Py_ssize_t size, char *to) {
    Py_ssize_t have = st->end - st->start;
    const char *at = (const char *)st->buf.buf + st->start;
    if (memcmp(at, head, (size_t)(have < hlen ? have : hlen)) != 0)
        return -1;
    if (have < hlen + size)
        return 0;
    memcpy(to, at + hlen, (size_t)size);
    st->start += hlen + size;
    return 1;
}

/* read what the kernel has for a link without blocking: >0 bytes read, 0 none, -1 it ended (errno: why;
 * 0 the peer closed it) */
static Py_ssize_t tcp_fill(TcpState *st) {
    char *buf = (char *)st->buf.buf;
    if (st->start == st->end) {
        st->start = st->end = 0;
    } else if (st->buf.len - st->end < TCP_READ) { /* move what is left to the front */
        memmove(buf, buf + st->start, (size_t)(st->end - st->start));
        st->end -= st->start;
        st->start = 0;
    }
    for (;;) {
        ssize_t n = recv(st->fd, buf + st->end, (size_t)(st->buf.len - st->end), MSG_DONTWAIT);
        if (n > 0) {
            st->end += n;
            st->got += n;
            return n;
        }
        if (n == 0) {
            errno = 0;
            return -1;
        }
        if (errno == EINTR)
            continue;
        return (errno == EAGAIN || errno == EWOULDBLOCK) ? 0 : -1;
    }
}

/* The links of one read: their states, loaded from the TcpLinks and written back by tcp_store. */
typedef struct {
    TcpState *sts;
    struct pollfd *fds;
    Py_ssize_t m, held;
    Py_ssize_t bad; /* the link that ended, or -1 */
    int err;        /* and why (errno; 0: the peer closed it) */
} TcpLinks;

/* load links[i] (a TcpLink) to read its next message into row ranks[i] of `out_len` bytes of rows of
 * `size`; -1 with an exception set (tcp_store still releases what was loaded) */
static int tcp_load(TcpLinks *L, PyObject *links, PyObject *ranks, Py_ssize_t hlen, Py_ssize_t size,
                    Py_ssize_t out_len) {
    L->m = PyList_GET_SIZE(links);
    L->held = 0, L->bad = -1, L->err = 0;
    L->sts = NULL, L->fds = NULL;
    if (L->m != PyList_GET_SIZE(ranks) || L->m > TCP_MAX_LINKS || size < 0) {
        PyErr_SetString(PyExc_ValueError, "tcp_read: links and ranks differ in length");
        return -1;
    }
    L->sts = PyMem_Calloc((size_t)(L->m > 0 ? L->m : 1), sizeof(*L->sts));
    L->fds = PyMem_Calloc((size_t)(L->m > 0 ? L->m : 1), sizeof(*L->fds));
    if (L->sts == NULL || L->fds == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < L->m; i++) {
        PyObject *link = PyList_GET_ITEM(links, i), *buf;
        TcpState *st = &L->sts[i];
        Py_ssize_t fd;
        if (attr_ssize(link, "start", &st->start) < 0 || attr_ssize(link, "end", &st->end) < 0 ||
            attr_ssize(link, "fd", &fd) < 0)
            return -1;
        st->fd = (int)fd;
        st->row = PyLong_AsSsize_t(PyList_GET_ITEM(ranks, i));
        if (st->row == -1 && PyErr_Occurred())
            return -1;
        if ((buf = PyObject_GetAttrString(link, "buf")) == NULL)
            return -1;
        int got = PyObject_GetBuffer(buf, &st->buf, PyBUF_WRITABLE | PyBUF_SIMPLE);
        Py_DECREF(buf);
        if (got < 0)
            return -1;
        L->held++;
        if (st->start < 0 || st->start > st->end || st->end > st->buf.len || st->row < 0 ||
            (st->row + 1) * size > out_len || st->buf.len < TCP_READ + hlen + size) {
            PyErr_SetString(PyExc_ValueError, "tcp_read: a link's buffer or a row is out of range");
            return -1;
        }
    }
    return 0;
}

/* the read loop (the GIL released): the code tcp_read returns */
static int tcp_loop(TcpLinks *L, const char *head, Py_ssize_t hlen, Py_ssize_t size, char *out, int yields,
                    double spin_s, double wait_s) {
    Py_ssize_t left = 0;
    for (Py_ssize_t i = 0; i < L->m; i++)
        left += !L->sts[i].done;
    double now = now_s(), spin_end = now + spin_s, end = now + wait_s;
    for (;;) {
        for (Py_ssize_t i = L->m - 1; i >= 0; i--) {
            TcpState *st = &L->sts[i];
            if (st->done)
                continue;
            char *to = out + st->row * size;
            int r = tcp_take(st, head, hlen, size, to);
            if (r == 0) {
                if (tcp_fill(st) < 0) {
                    L->bad = i, L->err = errno;
                    return 3;
                }
                r = tcp_take(st, head, hlen, size, to);
            }
            if (r < 0)
                return 2;
            if (r > 0)
                st->done = 1, left--;
        }
        if (left == 0)
            return 0;
        now = now_s();
        if (now >= end)
            return 1;
        if (yields > 0 && now < spin_end) {
            yields--;
            sched_yield(); /* a peer that shares this core sends sooner, and no sleep to wake from */
            continue;
        }
        int nfds = 0;
        for (Py_ssize_t i = 0; i < L->m; i++)
            if (!L->sts[i].done)
                L->fds[nfds].fd = L->sts[i].fd, L->fds[nfds].events = POLLIN, L->fds[nfds].revents = 0, nfds++;
        if (poll(L->fds, (nfds_t)nfds, (int)((end - now) * 1000.0) + 1) == 0 && now_s() >= end)
            return 1; /* (after one more look, for what came just as it timed out) */
    }
}

/* write every loaded link's state back (read or not), set the ended link's error as TcpMesh.fill does,
 * take the links read out of both lists, free L; returns `result`, or NULL (its reference dropped) if
 * that failed */
static PyObject *tcp_store(TcpLinks *L, PyObject *links, PyObject *ranks, PyObject *result) {
    for (Py_ssize_t i = 0; i < L->held; i++) {
        PyObject *link = PyList_GET_ITEM(links, i);
        TcpState *st = &L->sts[i];
        PyBuffer_Release(&st->buf);
        if (result == NULL)
            continue;
        if (set_ssize(link, "start", st->start) < 0 || set_ssize(link, "end", st->end) < 0) {
            Py_CLEAR(result);
            continue;
        }
        Py_ssize_t total;
        if (st->got && (attr_ssize(link, "bytes_received", &total) < 0 ||
                        set_ssize(link, "bytes_received", total + st->got) < 0))
            Py_CLEAR(result);
    }
    if (result != NULL && L->bad >= 0) { /* the error, or None for an orderly end */
        PyObject *exc = L->err ? PyObject_CallFunction(PyExc_OSError, "is", L->err, strerror(L->err)) : Py_NewRef(Py_None);
        if (exc == NULL || PyObject_SetAttrString(PyList_GET_ITEM(links, L->bad), "error", exc) < 0)
            Py_CLEAR(result);
        Py_XDECREF(exc);
    }
    for (Py_ssize_t i = L->held - 1; result != NULL && i >= 0; i--)
        if (L->sts[i].done && (PySequence_DelItem(links, i) < 0 || PySequence_DelItem(ranks, i) < 0))
            Py_CLEAR(result);
    PyMem_Free(L->sts);
    PyMem_Free(L->fds);
    L->sts = NULL, L->fds = NULL, L->held = 0;
    return result;
}

/* tcp_read(links, ranks, head, size, out, yields, spin_s, wait_s) -> code
 * Read every link in `links` (TcpLinks, open) for its next message, expected to begin with the bytes
 * `head` and carry `size` bytes after them; the payload from links[i] goes to row ranks[i] of `out`
 * (rows of `size` bytes). Those read are taken out of both lists. Meanwhile the core is yielded
 * `yields` times at most while spin_s lasts, then the thread sleeps in poll; it returns by wait_s.
 * The GIL is released throughout. Codes: 0 every message read; 1 wait_s passed; 2 a link's next
 * message is another (left there); 3 a link ended (its `error` set as TcpMesh.fill sets it). */
static PyObject *native_tcp_read(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *links, *ranks, *result = NULL;
    Py_buffer head, outb;
    Py_ssize_t size;
    int yields, code;
    double spin_s, wait_s;
    TcpLinks L;
    if (!PyArg_ParseTuple(args, "O!O!y*nw*idd", &PyList_Type, &links, &PyList_Type, &ranks, &head, &size, &outb,
                          &yields, &spin_s, &wait_s))
        return NULL;
    if (tcp_load(&L, links, ranks, head.len, size, outb.len) == 0) {
        Py_BEGIN_ALLOW_THREADS
        code = tcp_loop(&L, head.buf, head.len, size, outb.buf, yields, spin_s, wait_s);
        Py_END_ALLOW_THREADS
        result = PyLong_FromLong(code);
    }
    result = tcp_store(&L, links, ranks, result);
    PyBuffer_Release(&head);
    PyBuffer_Release(&outb);
    return result;
}

/* tcp_exchange(links, ranks, head, x, bufs, me, out, kind, op, yields, spin_s, wait_s) -> (code, i, sent)
 * A whole small all_reduce between hosts in one call: send the message `head` + x to every link, in
 * order (one sendmsg each, MSG_DONTWAIT), copy x to row `me` of `bufs` and read every peer's message
 * for the call into its row (as tcp_read), then fold the rows into `out` in the canonical order.
 * Codes: 0 done (out holds the fold); 1, 2, 3 as tcp_read's (the messages are all sent; the links read
 * were taken out of the lists); 4: links[i] did not take its whole message: `sent` bytes of it went (an
 * error: -errno), and nothing went to the links after it, nothing was read. (kind, op) must be one the
 * fold takes, x and out aligned to it. */
static PyObject *native_tcp_exchange(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *links, *ranks, *result = NULL;
    Py_buffer head, x, bufs, outb;
    int me, kind, yields, code = -1;
    const char *op;
    double spin_s, wait_s;
    TcpLinks L = {.bad = -1};
    Py_ssize_t bad = -1;
    long long sent = 0;
    if (!PyArg_ParseTuple(args, "O!O!y*y*w*iw*Csidd", &PyList_Type, &links, &PyList_Type, &ranks, &head, &x, &bufs,
                          &me, &outb, &kind, &op, &yields, &spin_s, &wait_s))
        return NULL;
    Py_ssize_t item = kind_size(kind), size = x.len, n = size > 0 ? bufs.len / size : 0;
    if (x.len != outb.len || op_code(op) < 0 || item == 0 || size == 0 || bufs.len % size || me < 0 || me >= n ||
        (uintptr_t)x.buf % (uintptr_t)item || (uintptr_t)outb.buf % (uintptr_t)item ||
        (uintptr_t)bufs.buf % (uintptr_t)item) {
        PyErr_SetString(PyExc_ValueError, "tcp_exchange: a call the native fold does not take");
        goto done;
    }
    if (tcp_load(&L, links, ranks, head.len, size, bufs.len) < 0)
        goto done;
    if (L.m + 1 != n) {
        PyErr_SetString(PyExc_ValueError, "tcp_exchange: not a link for every other rank");
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    struct iovec iov[2] = {{head.buf, (size_t)head.len}, {x.buf, (size_t)x.len}};
    struct msghdr msg = {0};
    msg.msg_iov = iov, msg.msg_iovlen = 2;
    for (Py_ssize_t i = 0; i < L.m; i++) {
        ssize_t w;
        do
            w = sendmsg(L.sts[i].fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
        while (w < 0 && errno == EINTR);
        if (w != head.len + x.len) {
            bad = i, sent = w >= 0 ? w : (errno == EAGAIN || errno == EWOULDBLOCK) ? 0 : -(long long)errno;
            break;
        }
    }
    if (bad < 0) {
        memcpy((char *)bufs.buf + me * size, x.buf, (size_t)size);
        code = tcp_loop(&L, head.buf, head.len, size, bufs.buf, yields, spin_s, wait_s);
        if (code == 0) {
            const char *rows[TCP_MAX_LINKS + 1];
            for (Py_ssize_t r = 0; r < n; r++)
                rows[r] = (const char *)bufs.buf + r * size;
            fold_rows(rows, (int)n, outb.buf, size, kind, op_code(op));
        }
    } else {
        code = 4;
    }
    Py_END_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < (bad < 0 ? L.m : bad + (sent > 0)); i++) { /* the links' books */
        PyObject *link = PyList_GET_ITEM(links, i);
        Py_ssize_t count, frames;
        Py_ssize_t wrote = i == bad ? (Py_ssize_t)sent : head.len + x.len;
        if (attr_ssize(link, "bytes_sent", &count) < 0 || set_ssize(link, "bytes_sent", count + wrote) < 0 ||
            (i != bad && (attr_ssize(link, "frames_sent", &frames) < 0 || set_ssize(link, "frames_sent", frames + 1) < 0)))
            goto done;
    }
    result = Py_BuildValue("(inL)", code, bad, sent);
done:
    result = tcp_store(&L, links, ranks, result);
    PyBuffer_Release(&head);
    PyBuffer_Release(&x);
    PyBuffer_Release(&bufs);
    PyBuffer_Release(&outb);
    return result;
}

/* ------------------------------------------------------------------------------------------------------
 * The two-hop all_reduce's exchanges over the same links (psring.topology.ring.twohop): each link sends
 * its own message (a head, a payload) and receives one whose payload goes straight into place -- the
 * head's missing bytes into the link's buffer and the payload into its destination in one recvmsg, so
 * a payload of hundreds of kilobytes is not copied through the buffer. What a call leaves is what
 * TcpMesh.fill and take would have left: a message half read when it returns is put back in the link's
 * buffer (its head, then the payload so far), and a message half sent is the caller's to queue. */

typedef struct {
    TcpState st;
    Py_buffer bufs[2][4]; /* each phase's: the head and payload to send, the head expected, where its payload goes */
    int held[2];          /* of each phase's bufs, how many are held */
    int reads[2];         /* whether this link reads a message in each phase */
    Py_buffer *sh, *sp, *rh, *dest; /* the phase under way's */
    Py_ssize_t soff, pgot; /* bytes sent (of sh + sp); payload bytes in dest */
    int phase;             /* 0 reading the head, 1 the payload, 2 read (or nothing to read) */
} ScLink;

/* send what is left of link l's message: 1 something went, 0 the kernel took nothing, -1 an error (errno) */
static int sc_send(ScLink *l) {
    Py_ssize_t total = l->sh->len + l->sp->len;
    int moved = 0;
    while (l->soff < total) {
        struct iovec iov[2];
        int cnt = 0;
        if (l->soff < l->sh->len)
            iov[cnt].iov_base = (char *)l->sh->buf + l->soff, iov[cnt].iov_len = (size_t)(l->sh->len - l->soff), cnt++;
        Py_ssize_t at = l->soff > l->sh->len ? l->soff - l->sh->len : 0;
        if (l->sp->len - at > 0)
            iov[cnt].iov_base = (char *)l->sp->buf + at, iov[cnt].iov_len = (size_t)(l->sp->len - at), cnt++;
        struct msghdr msg = {0};
        msg.msg_iov = iov, msg.msg_iovlen = (size_t)cnt;
        ssize_t w = sendmsg(l->st.fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return (errno == EAGAIN || errno == EWOULDBLOCK) ? moved : -1;
        }
        l->soff += w, moved = 1;
    }
    return moved;
}

/* recvmsg without blocking, again on EINTR: >0 the bytes read, 0 none now, -1 the link ended (errno; 0
 * the peer closed it) */
static ssize_t sc_read(int fd, struct msghdr *msg) {
    for (;;) {
        ssize_t n = recvmsg(fd, msg, MSG_DONTWAIT);
        if (n > 0)
            return n;
        if (n == 0) {
            errno = 0;
            return -1;
        }
        if (errno != EINTR)
            return (errno == EAGAIN || errno == EWOULDBLOCK) ? 0 : -1;
    }
}

/* read on link l: 1 something moved, 0 nothing now, -1 it ended (errno; 0 the peer closed it), -2 its
 * next message is another (left in the link's buffer) */
static int sc_recv(ScLink *l) {
    TcpState *st = &l->st;
    char *buf = (char *)st->buf.buf;
    const char *head = l->rh->buf;
    Py_ssize_t hlen = l->rh->len, size = l->dest->len;
    char *dest = l->dest->buf;
    int moved = 0;
    while (l->phase == 0) {
        Py_ssize_t have = st->end - st->start;
        if (memcmp(buf + st->start, head, (size_t)(have < hlen ? have : hlen)) != 0)
            return -2;
        if (have >= hlen) { /* the head is here: the payload the buffer holds, then the rest into place */
            Py_ssize_t take = have - hlen < size ? have - hlen : size;
            memcpy(dest, buf + st->start + hlen, (size_t)take);
            st->start += hlen + take, l->pgot = take, l->phase = take == size ? 2 : 1;
            if (st->start == st->end)
                st->start = st->end = 0;
            return 1;
        }
        if (st->buf.len - st->end < hlen) { /* room for the head at the end */
            memmove(buf, buf + st->start, (size_t)have);
            st->start = 0, st->end = have;
        }
        struct iovec iov[2] = {{buf + st->end, (size_t)(hlen - have)}, {dest, (size_t)size}};
        struct msghdr msg = {0};
        msg.msg_iov = iov, msg.msg_iovlen = size > 0 ? 2 : 1;
        ssize_t n = sc_read(st->fd, &msg);
        if (n <= 0)
            return n == 0 ? moved : -1;
        st->got += n, moved = 1;
        Py_ssize_t h = n < hlen - have ? n : hlen - have, extra = n - h;
        st->end += h;
        if (memcmp(buf + st->start, head, (size_t)(st->end - st->start)) != 0) {
            /* another message: its bytes back in the buffer, after what the buffer holds of it (less than a
             * head), moved to the front where the rest would not fit (the buffer holds a read and a message) */
            if (st->buf.len - st->end < extra) {
                Py_ssize_t held = st->end - st->start;
                memmove(buf, buf + st->start, (size_t)held);
                st->start = 0, st->end = held;
            }
            memcpy(buf + st->end, dest, (size_t)extra);
            st->end += extra;
            return -2;
        }
        if (st->end - st->start == hlen) {
            st->start = st->end = 0, l->pgot = extra, l->phase = extra == size ? 2 : 1;
            return 1;
        }
    }
    while (l->phase == 1) {
        struct iovec iov = {dest + l->pgot, (size_t)(size - l->pgot)};
        struct msghdr msg = {0};
        msg.msg_iov = &iov, msg.msg_iovlen = 1;
        ssize_t n = sc_read(st->fd, &msg);
        if (n <= 0)
            return n == 0 ? moved : -1;
        st->got += n, l->pgot += n, moved = 1;
        if (l->pgot == size)
            l->phase = 2;
    }
    return moved;
}

/* point link l at phase p's buffers, nothing of it sent or read yet */
static void sc_phase(ScLink *l, int p) {
    l->sh = &l->bufs[p][0], l->sp = &l->bufs[p][1], l->rh = &l->bufs[p][2], l->dest = &l->bufs[p][3];
    l->soff = 0, l->pgot = 0, l->phase = l->reads[p] ? 0 : 2;
}

/* hold phase p's buffers of link i from the lists: -1 with an exception set */
static int sc_hold(ScLink *l, int p, Py_ssize_t i, PyObject *sheads, PyObject *sends, PyObject *rheads,
                   PyObject *dests) {
    PyObject *objs[4] = {PyList_GET_ITEM(sheads, i), PyList_GET_ITEM(sends, i), PyList_GET_ITEM(rheads, i),
                         PyList_GET_ITEM(dests, i)};
    l->reads[p] = objs[3] != Py_None;
    for (int k = 0; k < 4; k++) {
        if (k == 3 && !l->reads[p]) {
            static char none[1];
            PyBuffer_FillInfo(&l->bufs[p][3], NULL, none, 0, 0, PyBUF_WRITABLE);
        } else if (PyObject_GetBuffer(objs[k], &l->bufs[p][k], k == 3 ? PyBUF_WRITABLE | PyBUF_SIMPLE : PyBUF_SIMPLE) <
                   0) {
            return -1;
        }
        l->held[p] = k + 1;
    }
    return 0;
}

/* a ring chunk's fold from every rank's copy of it: fold_chunk's, and tcp_scatter's between its phases */
typedef struct {
    Py_buffer rows, out, own;
    int held, first, kind, op, n;
    Py_ssize_t count;
} ScFold;

/* check a fold whose buffers, first rank and kind are parsed (and `op` its name): 0, or -1 with a
 * ValueError naming `who` */
static int chunk_fold_check(ScFold *f, const char *op, const char *who) {
    Py_ssize_t item = kind_size(f->kind), len = f->out.len;
    f->op = op_code(op);
    f->n = len > 0 ? (int)(f->rows.len / len) : 0;
    if (item == 0 || f->op < 0 || (f->op == 1 && f->kind != 'f' && f->kind != 'd') || len == 0 || len % item ||
        f->rows.len % len || f->n < 1 || f->n > TCP_MAX_LINKS + 1 || f->first < 0 || f->first >= f->n ||
        f->own.len != len || (uintptr_t)f->rows.buf % (uintptr_t)item || (uintptr_t)f->out.buf % (uintptr_t)item ||
        (uintptr_t)f->own.buf % (uintptr_t)item) {
        PyErr_Format(PyExc_ValueError, "%s: a fold the native fold does not take", who);
        return -1;
    }
    f->count = len / item;
    return 0;
}

/* the rows folded in the chunk's canonical order (row `first` read from own); no GIL needed */
static void chunk_fold(const ScFold *f) {
    const char *rp[TCP_MAX_LINKS + 1];
    for (int r = 0; r < f->n; r++)
        rp[r] = r == f->first ? (const char *)f->own.buf : (const char *)f->rows.buf + (Py_ssize_t)r * f->out.len;
    fold_from(rp, f->n, f->first, f->out.buf, f->count, f->kind, f->op);
}

/* tcp_scatter(links, sheads, sends, rheads, dests, hot, wait_s, then=None) -> (code, sent, read, phase)
 * For every link i (a TcpLink): send sheads[i] + sends[i] (bytes-like; empty: nothing to send), and read
 * its next message, which must begin with the bytes rheads[i] and carry len(dests[i]) bytes after them,
 * into dests[i] (writable); dests[i] None: read nothing. Sending and reading go on together, without
 * blocking; with nothing to do the core is yielded `hot` times (counted again after each move), then the
 * thread sleeps in poll; it returns by wait_s. The GIL is released throughout. `then`, a two-hop call's
 * second phase: (rows, first, out, kind, op, own, sheads2, sends2, rheads2, dests2) -- once every message
 * of the first is sent and read, fold_chunk(rows, first, out, kind, op, own) and go on with the second
 * phase's lists as the first's (`phase` says which one the result is of: 1 or 2). Codes: 0 all sent and
 * read; 1 wait_s passed; 2 a link's next message is another (left in its buffer); 3 a link ended (its
 * `error` set as TcpMesh.fill sets it; nothing more is sent). `sent`: the bytes of each link's message
 * that went (the rest is the caller's to queue); `read`: whether each link's message was read (one half
 * read is back in the link's buffer, as TcpMesh.fill would have left it). */
/* hold link `link`'s socket and buffer in l: -1 with an exception set */
static int sc_link(ScLink *l, PyObject *link) {
    PyObject *buf;
    Py_ssize_t fd;
    if (attr_ssize(link, "start", &l->st.start) < 0 || attr_ssize(link, "end", &l->st.end) < 0 ||
        attr_ssize(link, "fd", &fd) < 0)
        return -1;
    l->st.fd = (int)fd;
    if ((buf = PyObject_GetAttrString(link, "buf")) == NULL)
        return -1;
    int got = PyObject_GetBuffer(buf, &l->st.buf, PyBUF_WRITABLE | PyBUF_SIMPLE);
    Py_DECREF(buf);
    if (got < 0)
        return -1;
    l->st.done = 1; /* (here: the link's buffer is held) */
    return 0;
}

/* whether link l's buffer holds a read and phase p's message after what it holds: 0, or -1 with a ValueError */
static int sc_room(ScLink *l, int p, const char *who) {
    if (l->st.start < 0 || l->st.start > l->st.end || l->st.end > l->st.buf.len ||
        l->st.buf.len < TCP_READ + l->bufs[p][2].len + l->bufs[p][3].len) {
        PyErr_Format(PyExc_ValueError, "%s: a link's buffer is out of range or too small", who);
        return -1;
    }
    return 0;
}

/* the exchange, every link's message of each phase sent and read (the fold between the phases), the GIL
 * released by the caller: the code (tcp_scatter's); *bad the link that stopped it, *err its errno, *cur the
 * phase it stopped in (0 or 1) */
static int sc_run(ScLink *ls, Py_ssize_t m, struct pollfd *fds, int phases, const ScFold *fold, int hot,
                  double wait_s, Py_ssize_t *bad_out, int *err_out, int *cur_out) {
    int code = 1, cur = 0, err = 0;
    Py_ssize_t bad = -1;
    double now = now_s(), end = now + wait_s;
    int idle = 0;
    for (;;) {
        int moved = 0, left = 0;
        for (Py_ssize_t i = 0; i < m && bad < 0; i++) {
            ScLink *l = &ls[i];
            if (l->soff < l->sh->len + l->sp->len) {
                int s = sc_send(l);
                if (s < 0)
                    bad = i, err = errno, code = 3;
                moved |= s > 0;
                left += l->soff < l->sh->len + l->sp->len;
            }
            if (bad < 0 && l->phase < 2) {
                int r = sc_recv(l);
                if (r == -1)
                    bad = i, err = errno, code = 3;
                else if (r == -2)
                    bad = i, code = 2;
                moved |= r > 0;
                left += l->phase < 2;
            }
        }
        if (bad >= 0)
            break;
        if (left == 0) {
            if (cur + 1 < phases) { /* the first phase is in: fold, and on with the second */
                chunk_fold(fold);
                cur++;
                for (Py_ssize_t i = 0; i < m; i++)
                    sc_phase(&ls[i], cur);
                idle = 0;
                continue;
            }
            code = 0;
            break;
        }
        if (moved) {
            idle = 0;
            continue;
        }
        now = now_s();
        if (now >= end) {
            code = 1;
            break;
        }
        if (idle++ < hot) {
            sched_yield(); /* a peer that shares this core sends sooner, and no sleep to wake from */
            continue;
        }
        nfds_t nfds = 0;
        for (Py_ssize_t i = 0; i < m; i++) {
            ScLink *l = &ls[i];
            short ev = (short)((l->phase < 2 ? POLLIN : 0) | (l->soff < l->sh->len + l->sp->len ? POLLOUT : 0));
            if (ev)
                fds[nfds].fd = l->st.fd, fds[nfds].events = ev, fds[nfds].revents = 0, nfds++;
        }
        poll(fds, nfds, (int)((end - now) * 1000.0) + 1);
    }
    for (Py_ssize_t i = 0; i < m; i++) { /* a message half read goes back in the buffer: head, payload so far */
        ScLink *l = &ls[i];
        if (l->phase == 1) {
            memcpy((char *)l->st.buf.buf, l->rh->buf, (size_t)l->rh->len);
            memcpy((char *)l->st.buf.buf + l->rh->len, l->dest->buf, (size_t)l->pgot);
            l->st.start = 0, l->st.end = l->rh->len + l->pgot;
        }
    }
    *bad_out = bad, *err_out = err, *cur_out = cur;
    return code;
}

/* (code, sent, read, phase) of an exchange that ended, the links' books written back as fill and _push
 * keep them (and the error of a link that ended); NULL with an exception set */
static PyObject *sc_result(ScLink *ls, Py_ssize_t m, PyObject *links, int code, Py_ssize_t bad, int err, int cur) {
    PyObject *result = NULL;
    PyObject *sent = PyTuple_New(m), *read = PyTuple_New(m);
    if (sent == NULL || read == NULL) {
        Py_XDECREF(sent);
        Py_XDECREF(read);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        PyTuple_SET_ITEM(sent, i, PyLong_FromSsize_t(ls[i].soff));
        PyTuple_SET_ITEM(read, i, PyBool_FromLong(ls[i].phase == 2 && ls[i].reads[cur]));
    }
    result = Py_BuildValue("(iNNi)", code, sent, read, cur + 1);
    for (Py_ssize_t i = 0; i < m && result != NULL; i++) { /* the links' books, as fill and _push keep them */
        PyObject *link = PyList_GET_ITEM(links, i);
        ScLink *l = &ls[i];
        Py_ssize_t v, wrote = l->soff, frames = l->sh->len + l->sp->len > 0 && l->soff == l->sh->len + l->sp->len;
        if (cur == 1) { /* (the first phase's messages all went) */
            wrote += ls[i].bufs[0][0].len + ls[i].bufs[0][1].len;
            frames += ls[i].bufs[0][0].len + ls[i].bufs[0][1].len > 0;
        }
        if (set_ssize(link, "start", l->st.start) < 0 || set_ssize(link, "end", l->st.end) < 0 ||
            (l->st.got && (attr_ssize(link, "bytes_received", &v) < 0 ||
                           set_ssize(link, "bytes_received", v + (Py_ssize_t)l->st.got) < 0)) ||
            (wrote && (attr_ssize(link, "bytes_sent", &v) < 0 || set_ssize(link, "bytes_sent", v + wrote) < 0)) ||
            (frames && (attr_ssize(link, "frames_sent", &v) < 0 || set_ssize(link, "frames_sent", v + frames) < 0)))
            Py_CLEAR(result);
    }
    if (result != NULL && bad >= 0 && code == 3) { /* the error, or None for an orderly end */
        PyObject *exc = err ? PyObject_CallFunction(PyExc_OSError, "is", err, strerror(err)) : Py_NewRef(Py_None);
        if (exc == NULL || PyObject_SetAttrString(PyList_GET_ITEM(links, bad), "error", exc) < 0)
            Py_CLEAR(result);
        Py_XDECREF(exc);
    }
    return result;
}

/* let go of what the links hold */
static void sc_release(ScLink *ls, Py_ssize_t m) {
    for (Py_ssize_t i = 0; ls != NULL && i < m; i++) {
        ScLink *l = &ls[i];
        if (l->st.done)
            PyBuffer_Release(&l->st.buf);
        for (int p = 0; p < 2; p++)
            for (int k = 0; k < l->held[p]; k++)
                if (!(k == 3 && !l->reads[p]))
                    PyBuffer_Release(&l->bufs[p][k]);
    }
}

static PyObject *native_tcp_scatter(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *links, *lists[2][4], *then = Py_None, *result = NULL;
    int hot, code, phases = 1, cur = 0, err = 0;
    double wait_s;
    ScFold fold = {0};
    const char *op = NULL;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!id|O", &PyList_Type, &links, &PyList_Type, &lists[0][0], &PyList_Type,
                          &lists[0][1], &PyList_Type, &lists[0][2], &PyList_Type, &lists[0][3], &hot, &wait_s, &then))
        return NULL;
    Py_ssize_t m = PyList_GET_SIZE(links), bad = -1;
    ScLink *ls = NULL;
    struct pollfd *fds = NULL;
    if (then != Py_None) {
        if (!PyArg_ParseTuple(then, "y*iw*Csy*O!O!O!O!", &fold.rows, &fold.first, &fold.out, &fold.kind, &op, &fold.own,
                              &PyList_Type, &lists[1][0], &PyList_Type, &lists[1][1], &PyList_Type, &lists[1][2],
                              &PyList_Type, &lists[1][3]))
            return NULL;
        fold.held = 1, phases = 2;
        if (chunk_fold_check(&fold, op, "tcp_scatter") < 0)
            goto done;
    }
    for (int p = 0; p < phases; p++)
        for (int k = 0; k < 4; k++)
            if (PyList_GET_SIZE(lists[p][k]) != m || m > TCP_MAX_LINKS) {
                PyErr_SetString(PyExc_ValueError, "tcp_scatter: the lists differ in length");
                goto done;
            }
    ls = PyMem_Calloc((size_t)(m > 0 ? m : 1), sizeof(ScLink));
    fds = PyMem_Calloc((size_t)(m > 0 ? m : 1), sizeof(struct pollfd));
    if (ls == NULL || fds == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        ScLink *l = &ls[i];
        if (sc_link(l, PyList_GET_ITEM(links, i)) < 0)
            goto done;
        for (int p = 0; p < phases; p++)
            if (sc_hold(l, p, i, lists[p][0], lists[p][1], lists[p][2], lists[p][3]) < 0 ||
                sc_room(l, p, "tcp_scatter") < 0)
                goto done;
        sc_phase(l, 0);
    }
    Py_BEGIN_ALLOW_THREADS
    code = sc_run(ls, m, fds, phases, &fold, hot, wait_s, &bad, &err, &cur);
    Py_END_ALLOW_THREADS
    result = sc_result(ls, m, links, code, bad, err, cur);
done:
    sc_release(ls, m);
    if (fold.held) {
        PyBuffer_Release(&fold.rows);
        PyBuffer_Release(&fold.out);
        PyBuffer_Release(&fold.own);
    }
    PyMem_Free(ls);
    PyMem_Free(fds);
    return result;
}

/* tcp_two_hop(links, x, out, rows, order, bounds, first, h1, h2, kind, op, hot, wait_s) -> tcp_scatter's
 * A two-hop all_reduce's whole exchange, its messages made here rather than listed: link i goes to the rank
 * order[i] (bytes of int64), whose ring chunk is x's bytes bounds[2 order[i]] to bounds[2 order[i] + 1]
 * (bytes of int64, every rank's); this rank is `first`. The first phase sends each rank its chunk of x and
 * reads that rank's copy of this rank's chunk into row order[i] of rows (one row a rank, this rank's
 * chunk's size); then the fold (fold_chunk(rows, first, out's chunk, kind, op, x's chunk)); the second
 * sends the folded chunk to every rank and reads each rank's into place in out. Every message is a
 * 4-byte length, the header (h1 in the first phase, h2 in the second) and the payload: the messages
 * tcp_scatter would be given. The same result, codes and books as tcp_scatter with `then`. */
static PyObject *native_tcp_two_hop(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *links, *result = NULL;
    Py_buffer xb = {0}, ob = {0}, rb = {0}, orderb = {0}, boundsb = {0}, h[2] = {{0}, {0}};
    int first, hot, code, cur = 0, err = 0;
    double wait_s;
    const char *op;
    ScFold fold = {0};
    if (!PyArg_ParseTuple(args, "O!y*w*w*y*y*iy*y*Csid", &PyList_Type, &links, &xb, &ob, &rb, &orderb, &boundsb,
                          &first, &h[0], &h[1], &fold.kind, &op, &hot, &wait_s))
        return NULL;
    Py_ssize_t m = PyList_GET_SIZE(links), n = boundsb.len / (Py_ssize_t)(2 * sizeof(int64_t)), bad = -1;
    const int64_t *order = orderb.buf, *bounds = boundsb.buf;
    ScLink *ls = NULL;
    struct pollfd *fds = NULL;
    char *heads = NULL;
    if (m < 1 || m > TCP_MAX_LINKS || orderb.len != m * (Py_ssize_t)sizeof(int64_t) || n != m + 1 ||
        boundsb.len % (Py_ssize_t)(2 * sizeof(int64_t)) || first < 0 || first >= n || ob.len != xb.len ||
        h[0].len > (1 << 16) || h[1].len > (1 << 16)) {
        PyErr_SetString(PyExc_ValueError, "tcp_two_hop: links, order and bounds do not make a two-hop call");
        goto done;
    }
    for (Py_ssize_t r = 0; r < n; r++)
        if (bounds[2 * r] < 0 || bounds[2 * r] > bounds[2 * r + 1] || bounds[2 * r + 1] > xb.len ||
            bounds[2 * r + 1] - bounds[2 * r] > 0x7fffffff - (1 << 16)) {
            PyErr_SetString(PyExc_ValueError, "tcp_two_hop: a rank's chunk is outside the tensor");
            goto done;
        }
    Py_ssize_t a = bounds[2 * first], row = bounds[2 * first + 1] - a;
    if (rb.len != n * row) {
        PyErr_SetString(PyExc_ValueError, "tcp_two_hop: rows is not one row of this rank's chunk a rank");
        goto done;
    }
    /* the fold's buffers: views into x, out and rows, which this call holds */
    PyBuffer_FillInfo(&fold.rows, NULL, rb.buf, rb.len, 0, PyBUF_SIMPLE);
    PyBuffer_FillInfo(&fold.out, NULL, (char *)ob.buf + a, row, 0, PyBUF_WRITABLE);
    PyBuffer_FillInfo(&fold.own, NULL, (char *)xb.buf + a, row, 1, PyBUF_SIMPLE);
    fold.first = first;
    if (chunk_fold_check(&fold, op, "tcp_two_hop") < 0)
        goto done;
    ls = PyMem_Calloc((size_t)m, sizeof(ScLink));
    fds = PyMem_Calloc((size_t)m, sizeof(struct pollfd));
    Py_ssize_t hmax = 4 + (h[0].len > h[1].len ? h[0].len : h[1].len);
    heads = PyMem_Malloc((size_t)(m * 4 * hmax));
    if (ls == NULL || fds == NULL || heads == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < m; i++) { /* every other rank once: no two links read into one place */
        int64_t p = order[i];
        if (p < 0 || p >= n || p == first || fds[p < first ? p : p - 1].fd) {
            PyErr_SetString(PyExc_ValueError, "tcp_two_hop: order names a rank outside the call, or twice");
            goto done;
        }
        fds[p < first ? p : p - 1].fd = 1; /* (fds is zeroed: its fd fields serve as the marks here) */
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        ScLink *l = &ls[i];
        int64_t p = order[i];
        if (sc_link(l, PyList_GET_ITEM(links, i)) < 0)
            goto done;
        Py_ssize_t pa = bounds[2 * p], span = bounds[2 * p + 1] - pa;
        /* each phase: the head and payload sent, the head expected and where its payload goes */
        const Py_ssize_t sizes[2][2] = {{span, row}, {row, span}};
        void *sends[2] = {(char *)xb.buf + pa, (char *)ob.buf + a};
        void *dests[2] = {(char *)rb.buf + p * row, (char *)ob.buf + pa};
        for (int ph = 0; ph < 2; ph++) {
            for (int k = 0; k < 2; k++) { /* k 0: the head sent, 1: the head expected */
                char *at = heads + (i * 4 + ph * 2 + k) * hmax;
                uint32_t len = (uint32_t)(h[ph].len + sizes[ph][k]);
                for (int byte = 0; byte < 4; byte++) /* little-endian, as TcpMesh's length */
                    at[byte] = (char)((len >> (8 * byte)) & 0xff);
                memcpy(at + 4, h[ph].buf, (size_t)h[ph].len);
                PyBuffer_FillInfo(&l->bufs[ph][k * 2], NULL, at, 4 + h[ph].len, 1, PyBUF_SIMPLE);
            }
            PyBuffer_FillInfo(&l->bufs[ph][1], NULL, sends[ph], sizes[ph][0], 1, PyBUF_SIMPLE);
            PyBuffer_FillInfo(&l->bufs[ph][3], NULL, dests[ph], sizes[ph][1], 0, PyBUF_WRITABLE);
            l->reads[ph] = 1; /* (held stays 0: nothing of these to release) */
            if (sc_room(l, ph, "tcp_two_hop") < 0)
                goto done;
        }
        sc_phase(l, 0);
    }
    Py_BEGIN_ALLOW_THREADS
    code = sc_run(ls, m, fds, 2, &fold, hot, wait_s, &bad, &err, &cur);
    Py_END_ALLOW_THREADS
    result = sc_result(ls, m, links, code, bad, err, cur);
done:
    sc_release(ls, m);
    PyMem_Free(ls);
    PyMem_Free(fds);
    PyMem_Free(heads);
    PyBuffer_Release(&xb);
    PyBuffer_Release(&ob);
    PyBuffer_Release(&rb);
    PyBuffer_Release(&orderb);
    PyBuffer_Release(&boundsb);
    PyBuffer_Release(&h[0]);
    PyBuffer_Release(&h[1]);
    return result;
}

/* fold_chunk(rows, first, out, kind, op, own): the rows of a 2-D C-contiguous array (one a rank, each this
 * rank's ring chunk of that rank's tensor) folded into `out` in the canonical order of a ring chunk whose
 * first rank is `first`: rows[first], rows[first + 1], ... (mod n); avg divides by n at the end. Row
 * `first` is read from `own` instead (the first rank's chunk where it is, not copied into rows). */
static PyObject *native_fold_chunk(PyObject *Py_UNUSED(module), PyObject *args) {
    ScFold f = {0};
    const char *op;
    if (!PyArg_ParseTuple(args, "y*iw*Csy*", &f.rows, &f.first, &f.out, &f.kind, &op, &f.own))
        return NULL;
    PyObject *result = NULL;
    if (chunk_fold_check(&f, op, "fold_chunk") == 0) {
        Py_BEGIN_ALLOW_THREADS
        chunk_fold(&f);
        Py_END_ALLOW_THREADS
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&f.rows);
    PyBuffer_Release(&f.out);
    PyBuffer_Release(&f.own);
    return result;
}

/* ------------------------------------------------------------------------------------------------------
 * The data plane's ring over TCP in one thread (psring.topology.ring.dataplane): one all_reduce job's
 * frames -- the call descriptor, this rank's own pieces, every piece it folds or stores and hands on --
 * sent to the right and received from the left on the plane's two sockets, without blocking, by the
 * receive thread alone, in the frames the plane's two threads send (a 24-byte header: magic, index,
 * seq, nbytes; then the payload), so a native rank and a threaded one share a ring. The left link's
 * reader state (the _Reader's buf, start, end, skip, bytes_received) is loaded and written back on each
 * run, so the Python reader goes on where this stopped. */

#define PLANE_MAGIC 0x31445350u
#define PLANE_HEADER 24
#define PLANE_MAX_CALL 4096
enum { R_REDUCE, R_FINAL, R_STORE_FWD, R_STORE };
enum { RING_DONE, RING_WAIT, RING_MISMATCH, RING_AHEAD, RING_BAD, RING_RECV_ERR, RING_SEND_ERR };

typedef struct {
    PyObject_HEAD
    int send_fd, recv_fd, kind, op;
    unsigned long long seq;
    Py_ssize_t item, avg;
    Py_buffer call, x, out;
    int held; /* the buffers above are held */
    Py_ssize_t nsteps, nown, nfwd;
    long long *steps; /* (a, b, what) in elements, 3 a step */
    long long *own;   /* (a, b) of this rank's own pieces */
    Py_ssize_t *fwd;  /* forward item k: its step */
    /* progress */
    Py_ssize_t recv_i;   /* next frame from the left: 0 the call, 1 + i step i */
    Py_ssize_t recv_got; /* payload bytes of it read; -1: its header not yet */
    Py_ssize_t recv_n;
    Py_ssize_t send_i; /* next frame to the right: 0 the call, 1..nown own pieces, then forwards */
    Py_ssize_t send_off;
    Py_ssize_t fwd_ready; /* forwards whose payload is ready */
    char hdr[PLANE_HEADER];
    char theirs[PLANE_MAX_CALL];
    Py_ssize_t theirs_n;
    long long sent;      /* bytes sent by this ring (those received go to the reader's count) */
    int err;             /* errno of a failed send or receive */
    char why[160];       /* what was wrong with a bad frame */
} NRing;

static void nr_release(NRing *r) {
    if (r->held) {
        PyBuffer_Release(&r->call);
        PyBuffer_Release(&r->x);
        PyBuffer_Release(&r->out);
        r->held = 0;
    }
    PyMem_Free(r->steps);
    PyMem_Free(r->own);
    PyMem_Free(r->fwd);
    r->steps = r->own = NULL;
    r->fwd = NULL;
}

static void nr_dealloc(NRing *r) {
    nr_release(r);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

/* NRing(send_fd, recv_fd, seq, call, x, out, steps, own, kind, op, avg): steps a list of (a, b, what),
 * own a list of (a, b) -- DataPlane.all_reduce's job, in elements of x */
static int nr_init(NRing *r, PyObject *args, PyObject *Py_UNUSED(kwds)) {
    PyObject *steps, *own;
    int kind;
    const char *op;
    nr_release(r);
    if (!PyArg_ParseTuple(args, "iiKy*y*w*O!O!Csn", &r->send_fd, &r->recv_fd, &r->seq, &r->call, &r->x, &r->out,
                          &PyList_Type, &steps, &PyList_Type, &own, &kind, &op, &r->avg))
        return -1;
    r->held = 1;
    r->kind = kind, r->op = op_code(op), r->item = kind_size(kind);
    if (r->item == 0 || r->op < 0 || (r->op == 1 && kind != 'f' && kind != 'd') || r->x.len != r->out.len ||
        r->call.len > PLANE_MAX_CALL || (uintptr_t)r->x.buf % (uintptr_t)r->item ||
        (uintptr_t)r->out.buf % (uintptr_t)r->item) {
        PyErr_SetString(PyExc_ValueError, "NRing: a job the native ring does not take");
        return -1;
    }
    r->nsteps = PyList_GET_SIZE(steps), r->nown = PyList_GET_SIZE(own);
    r->steps = PyMem_Calloc((size_t)(3 * r->nsteps + 1), sizeof(long long));
    r->own = PyMem_Calloc((size_t)(2 * r->nown + 1), sizeof(long long));
    r->fwd = PyMem_Calloc((size_t)(r->nsteps + 1), sizeof(Py_ssize_t));
    if (r->steps == NULL || r->own == NULL || r->fwd == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t count = r->x.len / r->item;
    r->nfwd = 0;
    for (Py_ssize_t i = 0; i < r->nsteps; i++) {
        long long *s = r->steps + 3 * i;
        if (!PyArg_ParseTuple(PyList_GET_ITEM(steps, i), "LLL", &s[0], &s[1], &s[2]))
            return -1;
        if (s[0] < 0 || s[0] > s[1] || s[1] > count || s[2] < R_REDUCE || s[2] > R_STORE) {
            PyErr_SetString(PyExc_ValueError, "NRing: a step out of range");
            return -1;
        }
        if (s[2] != R_STORE)
            r->fwd[r->nfwd++] = i;
    }
    for (Py_ssize_t i = 0; i < r->nown; i++) {
        long long *s = r->own + 2 * i;
        if (!PyArg_ParseTuple(PyList_GET_ITEM(own, i), "LL", &s[0], &s[1]))
            return -1;
        if (s[0] < 0 || s[0] > s[1] || s[1] > count) {
            PyErr_SetString(PyExc_ValueError, "NRing: a piece out of range");
            return -1;
        }
    }
    r->recv_i = 0, r->recv_got = -1, r->send_i = 0, r->send_off = 0, r->fwd_ready = 0;
    r->sent = 0, r->err = 0, r->theirs_n = 0, r->why[0] = 0;
    return 0;
}

/* dst[i] = dst[i] op src[i] (canonical: the fold so far, then this rank's own); `fin`: then / avg */
static void fold_into(NRing *r, char *dst, const char *src, Py_ssize_t count, int fin) {
    int prod = r->op == 2;
#define FOLD2(T, EXPR)                                                                                             \
    do {                                                                                                           \
        T *o = (T *)dst;                                                                                           \
        const T *x = (const T *)src;                                                                               \
        for (Py_ssize_t i = 0; i < count; i++)                                                                     \
            o[i] = EXPR;                                                                                           \
    } while (0)
#define FOLD2_FLOAT(T)                                                                                             \
    do {                                                                                                           \
        if (prod)                                                                                                  \
            FOLD2(T, o[i] * x[i]);                                                                                 \
        else                                                                                                       \
            FOLD2(T, o[i] + x[i]);                                                                                 \
        if (fin && r->avg) {                                                                                       \
            T d = (T)r->avg, *o = (T *)dst;                                                                        \
            for (Py_ssize_t i = 0; i < count; i++)                                                                 \
                o[i] = o[i] / d;                                                                                   \
        }                                                                                                          \
    } while (0)
    switch (r->kind) {
    case 'f':
        FOLD2_FLOAT(float);
        break;
    case 'd':
        FOLD2_FLOAT(double);
        break;
    case 'i':
    case 'I':
        if (prod)
            FOLD2(uint32_t, (uint32_t)(o[i] * x[i]));
        else
            FOLD2(uint32_t, (uint32_t)(o[i] + x[i]));
        break;
    default:
        if (prod)
            FOLD2(uint64_t, o[i] * x[i]);
        else
            FOLD2(uint64_t, o[i] + x[i]);
        break;
    }
#undef FOLD2_FLOAT
#undef FOLD2
}

typedef struct {
    char *buf;
    Py_ssize_t cap, start, end, skip;
    long long got;
} PlaneReader;

/* read what the kernel has into the reader's buffer: 1 some, 0 none now, -1 the link ended (errno) */
static int pr_fill(NRing *r, PlaneReader *rd) {
    if (rd->start == rd->end) {
        rd->start = rd->end = 0;
    } else if (rd->cap - rd->end < PLANE_HEADER) {
        memmove(rd->buf, rd->buf + rd->start, (size_t)(rd->end - rd->start));
        rd->end -= rd->start;
        rd->start = 0;
    }
    for (;;) {
        ssize_t n = recv(r->recv_fd, rd->buf + rd->end, (size_t)(rd->cap - rd->end), MSG_DONTWAIT);
        if (n > 0) {
            rd->end += n, rd->got += n;
            return 1;
        }
        if (n == 0) {
            errno = 0;
            return -1;
        }
        if (errno == EINTR)
            continue;
        return (errno == EAGAIN || errno == EWOULDBLOCK) ? 0 : -1;
    }
}

/* the destination and size of receive item i (0: the call) */
static char *recv_dest(NRing *r, Py_ssize_t i, Py_ssize_t *n) {
    if (i == 0) {
        *n = r->theirs_n;
        return r->theirs;
    }
    long long *s = r->steps + 3 * (i - 1);
    *n = (Py_ssize_t)((s[1] - s[0]) * r->item);
    return (char *)r->out.buf + s[0] * r->item;
}

/* progress on the left link: 1 something moved, 0 nothing now, or -(RING_* code) */
static int ring_recv(NRing *r, PlaneReader *rd) {
    int moved = 0;
    while (r->recv_i <= r->nsteps) {
        if (rd->skip) { /* a frame of a collective this rank abandoned */
            if (rd->start == rd->end) {
                int f = pr_fill(r, rd);
                if (f < 0)
                    return r->err = errno, -RING_RECV_ERR;
                if (f == 0)
                    return moved;
            }
            Py_ssize_t take = rd->end - rd->start < rd->skip ? rd->end - rd->start : rd->skip;
            rd->start += take, rd->skip -= take, moved = 1;
            continue;
        }
        if (r->recv_got < 0) { /* the header */
            if (rd->end - rd->start < PLANE_HEADER) {
                int f = pr_fill(r, rd);
                if (f < 0)
                    return r->err = errno, -RING_RECV_ERR;
                if (f == 0)
                    return moved;
                moved = 1;
                continue;
            }
            uint32_t magic, index;
            unsigned long long seq, nbytes;
            memcpy(&magic, rd->buf + rd->start, 4);
            memcpy(&index, rd->buf + rd->start + 4, 4);
            memcpy(&seq, rd->buf + rd->start + 8, 8);
            memcpy(&nbytes, rd->buf + rd->start + 16, 8);
            if (magic != PLANE_MAGIC) {
                snprintf(r->why, sizeof r->why, "the data link from the left sent a bad frame (magic %#x)", magic);
                return -RING_BAD;
            }
            if (seq < r->seq) {
                rd->start += PLANE_HEADER, rd->skip = (Py_ssize_t)nbytes, moved = 1;
                continue;
            }
            if (seq > r->seq)
                return -RING_AHEAD;
            Py_ssize_t want;
            if (r->recv_i == 0) {
                want = (Py_ssize_t)nbytes;
                if (index != 0 || nbytes > PLANE_MAX_CALL) {
                    snprintf(r->why, sizeof r->why, "collective #%llu: the left neighbour's first frame is #%u",
                             r->seq, index);
                    return -RING_BAD;
                }
                r->theirs_n = want;
            } else {
                recv_dest(r, r->recv_i, &want);
                if ((Py_ssize_t)index != r->recv_i || (Py_ssize_t)nbytes != want) {
                    snprintf(r->why, sizeof r->why,
                             "collective #%llu: frame #%u of %llu bytes from the left neighbour, expected #%zd of %zd",
                             r->seq, index, nbytes, r->recv_i, want);
                    return -RING_BAD;
                }
            }
            rd->start += PLANE_HEADER;
            r->recv_got = 0, r->recv_n = want, moved = 1;
        }
        Py_ssize_t n;
        char *dest = recv_dest(r, r->recv_i, &n);
        if (r->recv_got < n && rd->end > rd->start) { /* what the buffer holds first */
            Py_ssize_t take = rd->end - rd->start < n - r->recv_got ? rd->end - rd->start : n - r->recv_got;
            memcpy(dest + r->recv_got, rd->buf + rd->start, (size_t)take);
            rd->start += take, r->recv_got += take, moved = 1;
        }
        while (r->recv_got < n) { /* then straight into place */
            ssize_t k = recv(r->recv_fd, dest + r->recv_got, (size_t)(n - r->recv_got), MSG_DONTWAIT);
            if (k > 0) {
                r->recv_got += k, rd->got += k, moved = 1;
                continue;
            }
            if (k < 0 && errno == EINTR)
                continue;
            if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
                return moved;
            r->err = k == 0 ? 0 : errno;
            return -RING_RECV_ERR;
        }
        if (r->recv_i == 0) {
            if (r->theirs_n != r->call.len || memcmp(r->theirs, r->call.buf, (size_t)r->theirs_n) != 0)
                return -RING_MISMATCH;
        } else {
            long long *s = r->steps + 3 * (r->recv_i - 1);
            if (s[2] <= R_FINAL)
                fold_into(r, dest, (const char *)r->x.buf + s[0] * r->item, (Py_ssize_t)(s[1] - s[0]),
                          s[2] == R_FINAL);
            if (s[2] != R_STORE)
                r->fwd_ready++;
        }
        r->recv_i++, r->recv_got = -1;
    }
    return moved;
}

/* frames to the right in all: the call, the own pieces, the forwards */
static inline Py_ssize_t ring_sends(NRing *r) {
    return 1 + r->nown + r->nfwd;
}

/* progress on the right link: 1 something moved, 0 nothing now (the kernel's buffer is full, or the
 * next frame is not ready), or -RING_SEND_ERR */
static int ring_send(NRing *r, int *blocked) {
    int moved = 0;
    *blocked = 0;
    while (r->send_i < ring_sends(r)) {
        const char *pay;
        Py_ssize_t n;
        Py_ssize_t i = r->send_i;
        if (i == 0) {
            pay = r->call.buf, n = r->call.len;
        } else if (i <= r->nown) {
            long long *s = r->own + 2 * (i - 1);
            pay = (const char *)r->x.buf + s[0] * r->item, n = (Py_ssize_t)((s[1] - s[0]) * r->item);
        } else {
            Py_ssize_t k = i - 1 - r->nown;
            if (k >= r->fwd_ready)
                return moved;
            long long *s = r->steps + 3 * r->fwd[k];
            pay = (const char *)r->out.buf + s[0] * r->item, n = (Py_ssize_t)((s[1] - s[0]) * r->item);
        }
        if (r->send_off == 0) {
            uint32_t magic = PLANE_MAGIC, index = (uint32_t)i;
            unsigned long long seq = r->seq, nb = (unsigned long long)n;
            memcpy(r->hdr, &magic, 4);
            memcpy(r->hdr + 4, &index, 4);
            memcpy(r->hdr + 8, &seq, 8);
            memcpy(r->hdr + 16, &nb, 8);
        }
        struct iovec iov[2];
        int cnt = 0;
        if (r->send_off < PLANE_HEADER)
            iov[cnt].iov_base = r->hdr + r->send_off, iov[cnt].iov_len = (size_t)(PLANE_HEADER - r->send_off), cnt++;
        Py_ssize_t at = r->send_off > PLANE_HEADER ? r->send_off - PLANE_HEADER : 0;
        if (n - at > 0)
            iov[cnt].iov_base = (char *)pay + at, iov[cnt].iov_len = (size_t)(n - at), cnt++;
        struct msghdr msg = {0};
        msg.msg_iov = iov, msg.msg_iovlen = (size_t)cnt;
        ssize_t w = sendmsg(r->send_fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                *blocked = 1;
                return moved;
            }
            r->err = errno;
            return -RING_SEND_ERR;
        }
        r->send_off += w, r->sent += w, moved = 1;
        if (r->send_off == PLANE_HEADER + n)
            r->send_i++, r->send_off = 0;
    }
    return moved;
}

static int attr_reader(PyObject *reader, PlaneReader *rd, Py_buffer *view) {
    PyObject *buf = PyObject_GetAttrString(reader, "buf");
    if (buf == NULL)
        return -1;
    int got = PyObject_GetBuffer(buf, view, PyBUF_WRITABLE | PyBUF_SIMPLE);
    Py_DECREF(buf);
    if (got < 0)
        return -1;
    rd->buf = view->buf, rd->cap = view->len, rd->got = 0;
    if (attr_ssize(reader, "start", &rd->start) < 0 || attr_ssize(reader, "end", &rd->end) < 0 ||
        attr_ssize(reader, "skip", &rd->skip) < 0) {
        PyBuffer_Release(view);
        return -1;
    }
    if (rd->start < 0 || rd->start > rd->end || rd->end > rd->cap || rd->cap < 2 * PLANE_HEADER || rd->skip < 0) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "NRing: the reader's state is out of range");
        return -1;
    }
    return 0;
}

/* run(reader, hot, wait_s) -> code: send and receive until the job is done (RING_DONE), or for up to
 * wait_s with nothing moving (RING_WAIT: look whether the job was abandoned, and run again), or what
 * stops it: RING_MISMATCH (the left neighbour's call: `theirs`), RING_AHEAD (the left neighbour is
 * past this collective), RING_BAD (a frame out of place: `why`), RING_RECV_ERR / RING_SEND_ERR (a link
 * failed: `err`, 0 for an orderly end). `reader`: the plane's _Reader, whose state is used and written
 * back. With nothing to do it yields the core `hot` times, then sleeps in poll. The GIL is released. */
static PyObject *nr_run(NRing *r, PyObject *args) {
    PyObject *reader;
    int hot;
    double wait_s;
    if (!PyArg_ParseTuple(args, "Oid", &reader, &hot, &wait_s))
        return NULL;
    if (!r->held) {
        PyErr_SetString(PyExc_ValueError, "NRing: not set up");
        return NULL;
    }
    PlaneReader rd;
    Py_buffer view;
    if (attr_reader(reader, &rd, &view) < 0)
        return NULL;
    int code;
    Py_BEGIN_ALLOW_THREADS
    double end = now_s() + wait_s;
    int idle = 0;
    for (;;) {
        int blocked = 0;
        int a = ring_send(r, &blocked);
        if (a < 0) {
            code = -a;
            break;
        }
        int b = ring_recv(r, &rd);
        if (b < 0) {
            code = -b;
            break;
        }
        if (r->recv_i > r->nsteps && r->send_i >= ring_sends(r)) {
            code = RING_DONE;
            break;
        }
        if (a || b) {
            idle = 0;
            end = now_s() + wait_s;
            continue;
        }
        if (idle++ < hot) {
            sched_yield();
            continue;
        }
        double now = now_s();
        if (now >= end) {
            code = RING_WAIT;
            break;
        }
        struct pollfd fds[2];
        int nfds = 0;
        if (blocked)
            fds[nfds].fd = r->send_fd, fds[nfds].events = POLLOUT, fds[nfds].revents = 0, nfds++;
        if (r->recv_i <= r->nsteps)
            fds[nfds].fd = r->recv_fd, fds[nfds].events = POLLIN, fds[nfds].revents = 0, nfds++;
        poll(fds, (nfds_t)nfds, (int)((end - now) * 1000.0) + 1);
    }
    Py_END_ALLOW_THREADS
    PyObject *result = PyLong_FromLong(code);
    Py_ssize_t total;
    if (result != NULL &&
        (set_ssize(reader, "start", rd.start) < 0 || set_ssize(reader, "end", rd.end) < 0 ||
         set_ssize(reader, "skip", rd.skip) < 0 || attr_ssize(reader, "bytes_received", &total) < 0 ||
         set_ssize(reader, "bytes_received", total + (Py_ssize_t)rd.got) < 0))
        Py_CLEAR(result);
    PyBuffer_Release(&view);
    return result;
}

/* finish(wait_s) -> whether no frame is left half sent (the one under way sent whole, blocking in poll
 * for up to wait_s): what an abandoned job owes the link, so that the next job's frames follow whole ones */
static PyObject *nr_finish(NRing *r, PyObject *args) {
    double wait_s;
    if (!PyArg_ParseTuple(args, "d", &wait_s))
        return NULL;
    if (!r->held || r->send_off == 0)
        Py_RETURN_TRUE;
    int ok = 1;
    Py_BEGIN_ALLOW_THREADS
    double end = now_s() + wait_s;
    Py_ssize_t i = r->send_i;
    while (r->send_i == i && r->send_off != 0) {
        int blocked = 0;
        if (ring_send(r, &blocked) < 0) {
            ok = 0;
            break;
        }
        if (r->send_i != i)
            break;
        double now = now_s();
        if (now >= end) {
            ok = 0;
            break;
        }
        struct pollfd p = {r->send_fd, POLLOUT, 0};
        poll(&p, 1, (int)((end - now) * 1000.0) + 1);
    }
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(ok);
}

static PyObject *nr_get(NRing *r, void *closure) {
    switch ((int)(intptr_t)closure) {
    case 0:
        return PyBytes_FromStringAndSize(r->theirs, r->theirs_n);
    case 1:
        return PyUnicode_FromString(r->why);
    case 2:
        return PyLong_FromLong(r->err);
    default:
        return PyLong_FromLongLong(r->sent);
    }
}

static PyGetSetDef nr_getset[] = {
    {"theirs", (getter)nr_get, NULL, "the left neighbour's call (after RING_MISMATCH)", (void *)0},
    {"why", (getter)nr_get, NULL, "what was wrong with a frame (after RING_BAD)", (void *)1},
    {"err", (getter)nr_get, NULL, "errno of a failed link (0: it ended in order)", (void *)2},
    {"sent", (getter)nr_get, NULL, "bytes sent to the right", (void *)3},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef nr_methods[] = {
    {"run", (PyCFunction)nr_run, METH_VARARGS, "run(reader, hot, wait_s) -> code"},
    {"finish", (PyCFunction)nr_finish, METH_VARARGS, "finish(wait_s) -> no frame is left half sent"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject NRingType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "psring._native.NRing",
    .tp_basicsize = sizeof(NRing),
    .tp_dealloc = (destructor)nr_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "one all_reduce job of the data plane over TCP, both links driven from one thread",
    .tp_methods = nr_methods,
    .tp_getset = nr_getset,
    .tp_init = (initproc)nr_init,
    .tp_new = PyType_GenericNew,
};

static PyMethodDef native_functions[] = {
    {"tcp_read", native_tcp_read, METH_VARARGS, "tcp_read(links, ranks, head, size, out, yields, spin_s, wait_s)"},
    {"tcp_exchange", native_tcp_exchange, METH_VARARGS,
     "tcp_exchange(links, ranks, head, x, bufs, me, out, kind, op, yields, spin_s, wait_s) -> (code, i, sent)"},
    {"tcp_scatter", native_tcp_scatter, METH_VARARGS,
     "tcp_scatter(links, sheads, sends, rheads, dests, hot, wait_s, then=None) -> (code, sent, read, phase)"},
    {"tcp_two_hop", native_tcp_two_hop, METH_VARARGS,
     "tcp_two_hop(links, x, out, rows, order, bounds, first, h1, h2, kind, op, hot, wait_s) -> (code, sent, read, phase)"},
    {"fold_chunk", native_fold_chunk, METH_VARARGS, "fold_chunk(rows, first, out, kind, op, own)"},
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
    PyModuleDef_HEAD_INIT, "psring._native",
    "The same-host board's, the TCP small links' and the data plane's hot loops in C (optional).", -1,
    native_functions,
};

PyMODINIT_FUNC PyInit__native(void) {
    if (PyType_Ready(&NBoardType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&native_module);
    if (m == NULL)
        return NULL;
    if (PyType_Ready(&NRingType) < 0 || PyModule_AddType(m, &NBoardType) < 0 || PyModule_AddType(m, &NRingType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
