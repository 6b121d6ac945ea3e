/* Folding rows in the canonical order (psring.core.fold), for every engine: element i of ring chunk c
 * is ((x_c op x_c+1) op ...) op x_c-1, ranks mod N; avg: that sum divided by N. sum, avg and prod of
 * float32, float64 and the 32- and 64-bit integers (integers in unsigned arithmetic: numpy's
 * wrap-around). Floats are folded one IEEE operation at a time (built with -ffp-contract=off, no
 * fast-math), so the bits are numpy's. */
#ifndef PSRING_FOLD_H
#define PSRING_FOLD_H
#include "native.h"

/* the op's code: 0 sum, 1 avg, 2 prod, -1 one this module does not fold */
int op_code(const char *op);
/* a kind's element size ('f', 'd', 'i', 'I', 'q', 'Q'), 0 for another */
Py_ssize_t kind_size(int kind);
/* rows[0..n-1] (n rows of len bytes, rank order) folded into `out` in the canonical order; 1 done, 0 a
 * (kind, op) this module does not fold, or a row or the output not aligned to its type */
int fold_rows(const char **rows, int n, void *out, Py_ssize_t len, int kind, int op);
/* rows[first], rows[first + 1], ..., rows[first - 1] (mod n) folded into out, count elements; avg: then
 * divided by n. out may be rows[first]. (kind, op) checked by the caller. */
void fold_from(const char **rows, int n, int first, void *out, Py_ssize_t count, int kind, int op);

#endif
