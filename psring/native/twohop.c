/* The two-hop all_reduce's exchanges (psring.topology.ring.twohop). */
#include "fold.h"
#include "tcpmesh.h"

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

PyObject *native_tcp_scatter(PyObject *Py_UNUSED(module), PyObject *args) {
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
PyObject *native_tcp_two_hop(PyObject *Py_UNUSED(module), PyObject *args) {
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
PyObject *native_fold_chunk(PyObject *Py_UNUSED(module), PyObject *args) {
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

