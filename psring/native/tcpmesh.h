/* The TCP small-message links' state, shared by the one-hop read (tcpmesh.c) and the two-hop exchange
 * (twohop.c). */
#ifndef PSRING_TCPMESH_H
#define PSRING_TCPMESH_H
#include "native.h"

#define TCP_READ (256 << 10) /* TcpMesh's _READ: the room a read asks for */
#define TCP_MAX_LINKS 4096

typedef struct {
    Py_buffer buf;
    Py_ssize_t start, end, row;
    long long got;
    int fd, done;
} TcpState;

/* a message (head of hlen bytes, then size payload bytes) off st's buffer into `to`: 1 taken, 0 not all
 * there yet, -1 a message that is not this one */
int tcp_take(TcpState *st, const char *head, Py_ssize_t hlen, Py_ssize_t size, char *to);
/* read what the socket has into st's buffer: bytes read, 0 none now, -1 ended or an error */
Py_ssize_t tcp_fill(TcpState *st);

#endif
