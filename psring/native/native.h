/* psring._native's shared part: the includes every engine uses, and the helpers they share (a clock,
 * reading and writing a Python object's integer attributes). psring/native/module.c has the module
 * table; each engine is one file: board.c (the same-host boards, streamed calls too), tcpmesh.c (the
 * TCP small-message links' read and one-hop exchange), twohop.c (the two-hop exchange), ring.c (the
 * data plane's ring); fold.c folds rows in the canonical order for all of them. */
#ifndef PSRING_NATIVE_H
#define PSRING_NATIVE_H
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

static inline double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* o.name as a Py_ssize_t (0 done, -1 with an exception set); and o.name = v */
int attr_ssize(PyObject *o, const char *name, Py_ssize_t *v);
int set_ssize(PyObject *o, const char *name, Py_ssize_t v);

/* the engines' types and functions, for the module table */
extern PyTypeObject NBoardType;
extern PyTypeObject NRingType;
PyObject *native_tcp_read(PyObject *module, PyObject *args);
PyObject *native_tcp_exchange(PyObject *module, PyObject *args);
PyObject *native_tcp_scatter(PyObject *module, PyObject *args);
PyObject *native_tcp_two_hop(PyObject *module, PyObject *args);
PyObject *native_fold_chunk(PyObject *module, PyObject *args);

#endif
