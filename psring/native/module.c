/* psring._native: the same-host board's hot loop in C, the TCP small-message links' exchanges, and the
 * data plane's ring over TCP on one thread (optional; psring/transport/shmboard.py, transport/tcpmesh.py and
 * topology/ring/plane/ keep the pure-Python paths and use this only where it imports and
 * PSRING_NATIVE is not off). This file is the module table; native.h says where each engine is. */
#include "native.h"

int attr_ssize(PyObject *o, const char *name, Py_ssize_t *v) {
    PyObject *a = PyObject_GetAttrString(o, name);
    if (a == NULL)
        return -1;
    *v = PyLong_AsSsize_t(a);
    Py_DECREF(a);
    return (*v == -1 && PyErr_Occurred()) ? -1 : 0;
}

int set_ssize(PyObject *o, const char *name, Py_ssize_t v) {
    PyObject *a = PyLong_FromSsize_t(v);
    if (a == NULL)
        return -1;
    int r = PyObject_SetAttrString(o, name, a);
    Py_DECREF(a);
    return r;
}

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
