/* The same-host boards (psring.transport.shmboard) in C.
 *
 * A board (psring.transport.shmboard) is a shared-memory pool of two slots, each a 256-byte head (four
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
 * (integers in unsigned arithmetic: numpy's wrap-around): fold.c.
 */
#include "fold.h"

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
    /* how a streamed call stores into the slots (st_stores_next): 1 streaming stores, 0 plain; and the
     * last adaptive call's cheapest post of each kind, seconds a byte (0: none timed), for stream_stores */
    int st_nt;
    long long st_k;
    double st_plain, st_stream;
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
 * it before it is folded), and copies every rank's folded piece out. A block's data is touched while it
 * is in the caches, so a rank reads its input once and writes its result once from memory, where a copy
 * in, a fold and a copy out of the whole tensor would each go to memory. Three counters at the start of
 * the slot's payload (a cache line each) say how far its owner is: blocks posted, folded and done (copied
 * out); a rank reuses a sub-slot once every peer is done with the block it held. Each rank takes
 * whichever step its peers' counters allow (st_step), so it runs up to `depth` blocks ahead of a late
 * peer rather than waiting at every block. The counters are zeroed before the post that begins the call
 * (Board.stream_post), so a reader that sees post k reads this call's. */
#define ST_POSTED 0
#define ST_FOLDED 64
#define ST_DONE 128
#define ST_DATA 256

static inline int64_t *st_own(NBoard *b, long long k, Py_ssize_t at) {
    return (int64_t *)(own_slot(b, k) + b->head + at);
}

typedef struct {
    const char *x;
    char *out;
    char *folded; /* a block's fold before it goes to the slot with streaming stores (st->slot_nt) */
    Py_ssize_t count, item, piece, depth;
    int64_t blocks; /* the call's blocks: pieces of its longest chunk */
    int n, me, kind, op, hot, nt;
    int slot_nt;    /* posts and folds go into the slots with streaming stores */
    int probe;      /* adaptive: every ST_PROBE_EVERY-th post is timed with the other kind of stores */
    int yield_us, nap_us; /* a wait yields the core for yield_us, then naps nap_us between polls (-1: never) */
    int crowded;          /* a yield took a time slice: the rest of the call naps (st_wait) */
    double budget;
} Stream;

/* a yield that kept the core from this thread longer than this, seconds: another runnable thread ran
 * in its place -- more runnable threads than cores */
#define ST_CROWDED_S 1e-3

/* every peer's counter `at` (of slot k's streamed call) is v or past */
static inline int st_all_at(NBoard *b, long long k, Py_ssize_t at, int64_t v) {
    for (int i = 0; i < b->npeers; i++)
        if (load(peer_slot(b, i, k) + b->head + at) < v)
            return 0;
    return 1;
}

enum { ST_NONE, ST_OUT, ST_FOLD, ST_POST, ST_END };

/* the step this rank can take now (its own counters say where it stands, its peers' what it may do):
 * copy its oldest folded block out, fold its oldest block every rank posted, post its next block into a
 * sub-slot every rank is done with -- in that order -- or ST_NONE: it waits; ST_END: the call is done.
 * So a rank runs ahead of a late peer by up to `depth` blocks where a rank in lockstep (post, fold, copy
 * out a block, then the next) waits at every block: where the ranks take turns on the cores (a busy
 * machine, more ranks than cores) each turn does up to `depth` blocks' work, not one. */
static int st_step(NBoard *b, const Stream *st, long long k) {
    int64_t posted = *st_own(b, k, ST_POSTED), folded = *st_own(b, k, ST_FOLDED), done = *st_own(b, k, ST_DONE);
    if (done == st->blocks)
        return ST_END;
    if (done < folded && st_all_at(b, k, ST_FOLDED, done + 1))
        return ST_OUT;
    if (folded < posted && st_all_at(b, k, ST_POSTED, folded + 1))
        return ST_FOLD;
    if (posted < st->blocks && posted - done < st->depth &&
        (posted < st->depth || st_all_at(b, k, ST_DONE, posted - st->depth + 1)))
        return ST_POST;
    return ST_NONE;
}

/* wait until this rank can take a step (st_step): hot polls, then the core yielded between polls for
 * yield_us (-1: for the whole wait), then a nap of nap_us between polls. A yield leaves the thread
 * runnable: where there are more runnable threads than cores (a busy machine: a data loader, another job)
 * each yield can cost a whole time slice, taken from the very peer it waits for, so once one yield took
 * longer than ST_CROWDED_S the call naps at every wait from then on (st->crowded). The step; ST_NONE
 * where none came within budget_s; -1 the call was cancelled (GIL released by the caller) */
static int st_wait(NBoard *b, long long k, Stream *st) {
    double end = -1.0, nap_from = 0.0;
    int hot = st->crowded ? 0 : st->hot;
    for (int polls = 0;; polls++) {
        int step = st_step(b, st, k);
        if (step != ST_NONE)
            return step;
        if (__atomic_load_n(&b->cancel, __ATOMIC_RELAXED))
            return -1;
        if (polls < hot)
            continue;
        double t = now_s();
        if (end < 0.0) {
            end = t + st->budget;
            nap_from = t + st->yield_us * 1e-6;
        } else if (t >= end)
            return ST_NONE;
        if (!st->crowded && (st->yield_us < 0 || t < nap_from)) {
            sched_yield();
            if (st->yield_us >= 0 && now_s() - t > ST_CROWDED_S)
                st->crowded = 1;
        } else {
            struct timespec nap = {0, (long)st->nap_us * 1000L};
            nanosleep(&nap, NULL);
        }
    }
}

/* the streaming stores before it are seen by every core before the stores after it (nt: there were some) */
static inline void st_fence(int nt) {
#if defined(__x86_64__) || defined(__i386__)
    if (nt)
        _mm_sfence();
#else
    (void)nt;
#endif
}

/* a copy; nt: with streaming stores where x86 has them, which do not read each line of dst first (from
 * memory, or from a peer's cache) and leave it out of the caches: for a result not read again soon, or a
 * slot line a peer read (see ST_PROBE_EVERY) */
static void copy_nt(char *dst, const char *src, size_t len, int nt) {
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


/* Plain stores into a slot line a peer has read first take the line back from the peer's cache; where
 * the cores' caches are far apart (a VM whose virtual cores the host spreads out: seen on the 2-core VMs
 * with every core busy) that made a streamed call's posts and folds 4-5x slower while its copies out, which
 * only read the slots, kept their speed. Streaming stores do not read the line first. But where the caches
 * are near, the peer then reads the block from memory rather than from a cache: ~15% more time a call.
 * So an adaptive call (stores -1) times each post, every ST_PROBE_EVERY-th with the other kind of stores,
 * and the next call takes streaming stores once the cheapest plain post cost ST_TO_STREAM times the
 * cheapest streaming one, plain again below ST_TO_PLAIN (st_stores_next). A rank's own choice: the
 * same frames, counters and bits either way. */
#define ST_PROBE_EVERY 16
#define ST_TO_STREAM 1.5
#define ST_TO_PLAIN 1.15

/* a post of this call (block g) takes streaming stores */
static inline int st_post_nt(const Stream *st, int64_t g) {
    return st->slot_nt ^ (st->probe && g % ST_PROBE_EVERY == ST_PROBE_EVERY - 1);
}

/* an adaptive call's post of `bytes` took `secs`, with streaming stores or plain */
static inline void st_timed(NBoard *b, int nt, double secs, Py_ssize_t bytes) {
    double per = secs / (double)bytes;
    double *best = nt ? &b->st_stream : &b->st_plain;
    if (*best == 0.0 || per < *best)
        *best = per;
}

/* the stores of the calls after an adaptive one that ended (see ST_PROBE_EVERY) */
static void st_stores_next(NBoard *b) {
    if (b->st_plain == 0.0 || b->st_stream == 0.0)
        return;
    if (b->st_plain > ST_TO_STREAM * b->st_stream)
        b->st_nt = 1;
    else if (b->st_plain < ST_TO_PLAIN * b->st_stream)
        b->st_nt = 0;
}

/* ring chunk c's piece of block g: its first element (*a) and its elements (0: the chunk ended before) */
static inline Py_ssize_t st_span(const Stream *st, int c, int64_t g, Py_ssize_t *a) {
    *a = (Py_ssize_t)((long long)c * st->count / st->n) + g * st->piece;
    Py_ssize_t z = (Py_ssize_t)((long long)(c + 1) * st->count / st->n);
    return *a < z ? (z - *a < st->piece ? z - *a : st->piece) : 0;
}

/* a rank's sub-slot s (this rank's own: r == me) */
static inline char *st_sub(NBoard *b, const Stream *st, long long k, int r, Py_ssize_t s) {
    char *slot = r == st->me ? own_slot(b, k) : peer_slot(b, r < st->me ? r : r - 1, k);
    return slot + b->head + ST_DATA + s * st->n * st->piece * st->item;
}

/* on from where this rank's counters say it is, a step at a time (st_step); 0 done, 1 a peer was not
 * there within the budget, 2 cancelled. The caller holds no GIL. */
static int do_stream(NBoard *b, Stream *st, long long k) {
    int n = st->n, me = st->me;
    Py_ssize_t item = st->item, piece = st->piece;
    int64_t *posted = st_own(b, k, ST_POSTED), *folded = st_own(b, k, ST_FOLDED), *done = st_own(b, k, ST_DONE);
    for (;;) {
        int step = st_step(b, st, k);
        if (step == ST_NONE && (step = st_wait(b, k, st)) <= ST_NONE)
            return step == ST_NONE ? 1 : 2;
        if (step == ST_END)
            break;
        if (step == ST_POST) { /* block g's pieces in (but its own chunk's: the fold reads that from x) */
            int64_t g = *posted;
            char *mine = st_sub(b, st, k, me, g % st->depth);
            int nt = st_post_nt(st, g);
            Py_ssize_t bytes = 0;
            double t0 = st->probe ? now_s() : 0.0;
            for (int c = 0; c < n; c++) {
                Py_ssize_t a, m = c == me ? 0 : st_span(st, c, g, &a);
                if (m > 0) {
                    copy_nt(mine + c * piece * item, st->x + a * item, (size_t)(m * item), nt);
                    bytes += m * item;
                }
            }
            st_fence(nt); /* the block is out before its count says so */
            if (st->probe && bytes >= piece * item)
                st_timed(b, nt, now_s() - t0, bytes);
            __atomic_store_n(posted, g + 1, __ATOMIC_RELEASE);
        } else if (step == ST_FOLD) { /* chunk me's piece of block g, every rank's, into its own sub-slot */
            int64_t g = *folded;
            Py_ssize_t s = g % st->depth, a, m = st_span(st, me, g, &a);
            if (m > 0) {
                const char *rows[MAX_PEERS + 1];
                char *to = st_sub(b, st, k, me, s) + me * piece * item;
                for (int r = 0; r < n; r++)
                    rows[r] = r == me ? st->x + a * item : st_sub(b, st, k, r, s) + me * piece * item;
                fold_from(rows, n, me, st->slot_nt ? st->folded : to, m, st->kind, st->op);
                if (st->slot_nt) /* folded in the caches, then to the slot without reading its lines */
                    copy_nt(to, st->folded, (size_t)(m * item), 1);
            }
            st_fence(st->slot_nt);
            __atomic_store_n(folded, g + 1, __ATOMIC_RELEASE);
        } else { /* ST_OUT: every rank's folded piece of block g out */
            int64_t g = *done;
            Py_ssize_t s = g % st->depth;
            for (int c = 0; c < n; c++) {
                Py_ssize_t a, m = st_span(st, c, g, &a);
                if (m > 0)
                    copy_nt(st->out + a * item, st_sub(b, st, k, c, s) + c * piece * item, (size_t)(m * item), st->nt);
            }
            __atomic_store_n(done, g + 1, __ATOMIC_RELEASE);
        }
    }
    st_fence(st->nt); /* the result's streaming stores are out before another thread reads it */
    return 0;
}

/* stream(k, me, x, out, kind, op, piece, depth, hot, budget_s, nt[, yield_us, nap_us, stores]) -> 0: done
 * (out holds the fold); 1: a peer was not there within budget_s at one of the waits (call again: it goes on
 * where it stands); 2: cancelled (cancel_stream). Post k must be this call's on every board (stream_post,
 * then differs); x and out contiguous, alike, of a (kind, op) the fold takes; piece: elements of a chunk per
 * block; nt: streaming stores for the result; stores: how posts and folds go into the slots (-1 adaptive:
 * see ST_PROBE_EVERY; 0 plain; 1 streaming stores). The GIL is released throughout. */
static PyObject *nb_stream(NBoard *b, PyObject *args) {
    long long k;
    Py_buffer x, outb;
    Stream st;
    const char *op;
    int stores = -1;
    st.yield_us = -1;
    st.crowded = 0;
    st.nap_us = 50;
    st.folded = NULL;
    if (!PyArg_ParseTuple(args, "Liy*w*Csnnidi|iii", &k, &st.me, &x, &outb, &st.kind, &op, &st.piece, &st.depth,
                          &st.hot, &st.budget, &st.nt, &st.yield_us, &st.nap_us, &stores))
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
        st.me < 0 || st.me >= st.n || st.piece < 1 || st.depth < 1 || st.nap_us < 0 || st.nap_us > 1000000 || !room ||
        stores < -1 || stores > 1) {
        PyErr_SetString(PyExc_ValueError, "stream: a call the native fold does not take, or one the slots do not hold");
        goto done;
    }
    st.x = (const char *)x.buf;
    st.out = (char *)outb.buf;
    st.count = x.len / st.item;
    st.blocks = ((st.count + st.n - 1) / st.n + st.piece - 1) / st.piece;
#if defined(__x86_64__) || defined(__i386__)
    st.slot_nt = stores < 0 ? b->st_nt : stores;
    st.probe = stores < 0 && st.blocks >= 2 * ST_PROBE_EVERY; /* a few timed posts of each kind */
#else
    st.slot_nt = st.probe = 0; /* copy_nt's stores are plain: nothing to choose */
#endif
    if (st.probe && b->st_k != k) { /* the call's first go (a call that waited too long goes on: k again) */
        b->st_k = k;
        b->st_plain = b->st_stream = 0.0;
    }
    if (st.slot_nt && (st.folded = PyMem_RawMalloc((size_t)(st.piece * st.item))) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int code;
    Py_BEGIN_ALLOW_THREADS
    code = do_stream(b, &st, k);
    Py_END_ALLOW_THREADS
    if (code == 0 && st.probe)
        st_stores_next(b);
    result = PyLong_FromLong(code);
done:
    PyMem_RawFree(st.folded);
    PyBuffer_Release(&x);
    PyBuffer_Release(&outb);
    return result;
}

/* stream_stores() -> (streaming, plain_s, streaming_s): whether the next adaptive streamed call stores into
 * the slots with streaming stores, and the last adaptive call's cheapest post of each kind, seconds a byte
 * (0.0: none was timed) */
static PyObject *nb_stream_stores(NBoard *b, PyObject *Py_UNUSED(ignored)) {
    return Py_BuildValue("(Odd)", b->st_nt ? Py_True : Py_False, b->st_plain, b->st_stream);
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
     "stream(k, me, x, out, kind, op, piece, depth, hot, budget_s, nt[, yield_us, nap_us, stores]) -> 0 done, 1 wait, "
     "2 cancelled"},
    {"stream_stores", (PyCFunction)nb_stream_stores, METH_NOARGS,
     "stream_stores() -> (streaming, plain_s, streaming_s): the next adaptive call's stores; the last one's posts"},
    {"cancel_stream", (PyCFunction)nb_cancel_stream, METH_VARARGS, "cancel_stream(flag): see stream"},
    {"close", (PyCFunction)nb_close, METH_NOARGS, "release the buffers (the board's maps may close)"},
    {NULL, NULL, 0, NULL},
};

PyTypeObject NBoardType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "psring._native.NBoard",
    .tp_basicsize = sizeof(NBoard),
    .tp_dealloc = (destructor)nb_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "a board's own pool and its peers' pools, seen from C",
    .tp_methods = nb_methods,
    .tp_init = (initproc)nb_init,
    .tp_new = PyType_GenericNew,
};

