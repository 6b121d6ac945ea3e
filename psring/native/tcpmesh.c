/* The TCP small-message links' read loop and one-hop exchange (psring.transport.tcpmesh). */
#include "fold.h"
#include "tcpmesh.h"

/* ------------------------------------------------------------------------------------------------------
 * The TCP small-message links' read loop (psring.transport.tcpmesh): a link is a TcpLink whose `buf` (a
 * bytearray) holds buf[start:end] read and not used yet; a message is a 4-byte length and the message.
 * tcp_read reads the sockets and uses up messages exactly as TcpMesh.fill and TcpMesh.take do, and
 * writes start, end and bytes_received back, so the event loop reads on where this left off. */


/* the next message of a link: 1 it is `head` and `size` bytes more, whole (copied to `to`, used up);
 * 0 not whole yet and begins as `head` does so far; -1 it is another message */
int tcp_take(TcpState *st, const char *head, Py_ssize_t hlen, Py_ssize_t size, char *to) {
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
Py_ssize_t tcp_fill(TcpState *st) {
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
PyObject *native_tcp_read(PyObject *Py_UNUSED(module), PyObject *args) {
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
PyObject *native_tcp_exchange(PyObject *Py_UNUSED(module), PyObject *args) {
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

