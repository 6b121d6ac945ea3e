/* The data plane's ring over TCP in one thread (psring.topology.ring.plane.dataplane). */
#include "fold.h"
#include <linux/futex.h>
#include <pthread.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <unistd.h>

/* ------------------------------------------------------------------------------------------------------
 * The data plane's ring over TCP in one thread (psring.topology.ring.plane.dataplane): one all_reduce job's
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
    Py_ssize_t fwd_ready; /* forwards whose payload is ready (written by the receiving side, read by the sending) */
    uint32_t fwd_word;    /* counts fwd_ready's steps: the futex a sender thread waits on for the next forward */
    char hdr[PLANE_HEADER];
    char theirs[PLANE_MAX_CALL];
    Py_ssize_t theirs_n;
    int sender_sleeps;   /* a sender thread sleeps (or is about to) on fwd_word */
    long long sent;      /* bytes sent by this ring (those received go to the reader's count) */
    int err;             /* errno of a failed send or receive */
    int send_err;        /* errno of a failed send (the sending side's own: it may be another thread) */
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
    r->sent = 0, r->err = r->send_err = 0, r->theirs_n = 0, r->why[0] = 0, r->fwd_word = 0, r->sender_sleeps = 0;
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
            if (s[2] != R_STORE) { /* published whole to a sender thread, which may sleep on fwd_word */
                __atomic_store_n(&r->fwd_ready, r->fwd_ready + 1, __ATOMIC_RELEASE);
                __atomic_add_fetch(&r->fwd_word, 1, __ATOMIC_SEQ_CST);
                if (__atomic_load_n(&r->sender_sleeps, __ATOMIC_SEQ_CST))
                    syscall(SYS_futex, &r->fwd_word, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
            }
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
            if (k >= __atomic_load_n(&r->fwd_ready, __ATOMIC_ACQUIRE))
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
            r->send_err = errno;
            return -RING_SEND_ERR;
        }
        r->send_off += w, moved = 1;
        __atomic_store_n(&r->sent, r->sent + w, __ATOMIC_RELAXED);
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

/* The sending side on a thread of its own (run's `helper`): the receiving side folds a piece and
 * publishes it (fwd_ready, fwd_word), this thread sends it, each sleeping in the kernel when it has
 * nothing to do -- in poll on its socket, or on the futex -- as gloo's device loop and caller do. On a
 * busy machine two threads a rank that hand work over a futex earned more of the cores than one thread
 * that does both (benchmarks/ringsim.c; docs/performance.md, "Where the cores go, third look"). */
typedef struct {
    NRing *r;
    int hot;
    int stop;  /* the receiving side asks it to end (atomic) */
    int ended; /* it ended (atomic): code says how */
    int code;  /* RING_DONE, RING_SEND_ERR, or RING_WAIT (stopped) */
    int efd;   /* an eventfd it writes when it ends: the receiving side's poll wakes */
} Sender;

static void *sender_main(void *arg) {
    Sender *sd = arg;
    NRing *r = sd->r;
    int idle = 0;
    sd->code = RING_WAIT;
    while (!__atomic_load_n(&sd->stop, __ATOMIC_ACQUIRE)) {
        uint32_t word = __atomic_load_n(&r->fwd_word, __ATOMIC_SEQ_CST);
        int blocked = 0;
        int a = ring_send(r, &blocked);
        if (a < 0) {
            sd->code = RING_SEND_ERR;
            break;
        }
        if (r->send_i >= ring_sends(r)) {
            sd->code = RING_DONE;
            break;
        }
        if (a) {
            idle = 0;
            continue;
        }
        if (idle++ < sd->hot) {
            sched_yield();
            continue;
        }
        if (blocked) { /* the kernel's buffer is full: until the right neighbour reads (or a stop) */
            struct pollfd p = {r->send_fd, POLLOUT, 0};
            poll(&p, 1, 20);
            continue;
        }
        /* the next forward is not folded yet: sleep on the word, unless it moved since it was read */
        __atomic_store_n(&r->sender_sleeps, 1, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(&r->fwd_word, __ATOMIC_SEQ_CST) == word && !__atomic_load_n(&sd->stop, __ATOMIC_ACQUIRE)) {
            struct timespec ts = {0, 20 * 1000 * 1000};
            syscall(SYS_futex, &r->fwd_word, FUTEX_WAIT_PRIVATE, word, &ts, NULL, 0);
        }
        __atomic_store_n(&r->sender_sleeps, 0, __ATOMIC_SEQ_CST);
    }
    __atomic_store_n(&sd->ended, 1, __ATOMIC_RELEASE);
    uint64_t one = 1;
    ssize_t w = write(sd->efd, &one, sizeof one);
    (void)w;
    return NULL;
}

/* run(reader, hot, wait_s[, helper]) -> code: send and receive until the job is done (RING_DONE), or for
 * up to wait_s with nothing moving (RING_WAIT: look whether the job was abandoned, and run again), or
 * what stops it: RING_MISMATCH (the left neighbour's call: `theirs`), RING_AHEAD (the left neighbour is
 * past this collective), RING_BAD (a frame out of place: `why`), RING_RECV_ERR / RING_SEND_ERR (a link
 * failed: `err`, 0 for an orderly end). `reader`: the plane's _Reader, whose state is used and written
 * back. With nothing to do it yields the core `hot` times, then sleeps in poll. `helper`: the frames to
 * the right go out from a thread of its own for the length of this call (Sender), this one receives and
 * folds; the same frames, and the job's state carries on across calls either way. The GIL is released. */
static PyObject *nr_run(NRing *r, PyObject *args) {
    PyObject *reader;
    int hot, helper = 0;
    double wait_s;
    if (!PyArg_ParseTuple(args, "Oid|p", &reader, &hot, &wait_s, &helper))
        return NULL;
    if (!r->held) {
        PyErr_SetString(PyExc_ValueError, "NRing: not set up");
        return NULL;
    }
    PlaneReader rd;
    Py_buffer view;
    if (attr_reader(reader, &rd, &view) < 0)
        return NULL;
    int code, threaded = 0;
    Sender sd = {r, hot, 0, 0, RING_WAIT, -1};
    pthread_t th;
    Py_BEGIN_ALLOW_THREADS
    if (helper && r->send_i < ring_sends(r)) {
        sd.efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        sigset_t all, before; /* the thread takes no signal: the process's go to the threads that handle them */
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &before);
        threaded = sd.efd >= 0 && pthread_create(&th, NULL, sender_main, &sd) == 0;
        pthread_sigmask(SIG_SETMASK, &before, NULL);
        if (!threaded && sd.efd >= 0)
            close(sd.efd), sd.efd = -1; /* (no thread: this one does both, as without helper) */
    }
    double end = now_s() + wait_s;
    int idle = 0;
    long long sent_seen = r->sent;
    for (;;) {
        int blocked = 0, a = 0, send_done;
        if (threaded) {
            if (__atomic_load_n(&sd.ended, __ATOMIC_ACQUIRE) && sd.code == RING_SEND_ERR) {
                code = RING_SEND_ERR;
                break;
            }
            long long sent = __atomic_load_n(&r->sent, __ATOMIC_RELAXED);
            a = sent != sent_seen, sent_seen = sent;
            send_done = __atomic_load_n(&sd.ended, __ATOMIC_ACQUIRE) && sd.code == RING_DONE;
        } else {
            a = ring_send(r, &blocked);
            if (a < 0) {
                code = -a;
                break;
            }
            send_done = r->send_i >= ring_sends(r);
        }
        int b = ring_recv(r, &rd);
        if (b < 0) {
            code = -b;
            break;
        }
        if (r->recv_i > r->nsteps && send_done) {
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
        struct pollfd fds[3];
        int nfds = 0;
        if (blocked)
            fds[nfds].fd = r->send_fd, fds[nfds].events = POLLOUT, fds[nfds].revents = 0, nfds++;
        if (r->recv_i <= r->nsteps)
            fds[nfds].fd = r->recv_fd, fds[nfds].events = POLLIN, fds[nfds].revents = 0, nfds++;
        if (threaded && !__atomic_load_n(&sd.ended, __ATOMIC_ACQUIRE))
            fds[nfds].fd = sd.efd, fds[nfds].events = POLLIN, fds[nfds].revents = 0, nfds++;
        int ms = (int)((end - now) * 1000.0) + 1;
        if (threaded && r->recv_i > r->nsteps && ms > 20)
            ms = 20; /* only the sender's progress to look at (sent): look again soon */
        poll(fds, (nfds_t)nfds, ms);
    }
    if (threaded) {
        __atomic_store_n(&sd.stop, 1, __ATOMIC_RELEASE);
        syscall(SYS_futex, &r->fwd_word, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
        pthread_join(th, NULL);
        close(sd.efd);
        if (code == RING_WAIT && r->recv_i > r->nsteps && r->send_i >= ring_sends(r))
            code = RING_DONE; /* (it ended between the last look and the stop) */
    }
    if (code == RING_SEND_ERR)
        r->err = r->send_err;
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
            r->err = r->send_err;
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
    {"run", (PyCFunction)nr_run, METH_VARARGS, "run(reader, hot, wait_s[, helper]) -> code"},
    {"finish", (PyCFunction)nr_finish, METH_VARARGS, "finish(wait_s) -> no frame is left half sent"},
    {NULL, NULL, 0, NULL},
};

PyTypeObject NRingType = {
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
