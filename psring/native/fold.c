/* The canonical fold's kernels (fold.h). */
#include "fold.h"

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
int op_code(const char *op) {
    return strcmp(op, "sum") == 0 ? 0 : strcmp(op, "avg") == 0 ? 1 : strcmp(op, "prod") == 0 ? 2 : -1;
}

Py_ssize_t kind_size(int kind) {
    return (kind == 'f' || kind == 'i' || kind == 'I') ? 4 : (kind == 'd' || kind == 'q' || kind == 'Q') ? 8 : 0;
}

/* rows[0..n-1] (n rows of len bytes, rank order) folded into `out` in the canonical order; 1 done, 0 a
 * (kind, op) this module does not fold, or a row or the output not aligned to its type (the vectorised
 * loops assume it) */
int fold_rows(const char **rows, int n, void *out, Py_ssize_t len, int kind, int op) {
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

void fold_from(const char **rows, int n, int first, void *out, Py_ssize_t count, int kind, int op) {
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
