/* stepwatch.otel_bridge._fastpath: OTLP metrics (protobuf wire format) -> line protocol.
 *
 * The bridge's common path in C: it reads an ExportMetricsServiceRequest body straight from
 * the wire format and writes exactly the lines the Python converter (_convert.py, _fields.py,
 * _buckets.py, _bucket_text.py; compact layout) writes for the same request, in the same
 * order. It handles what stepwatch's exporters send (delta temporality, positive-only
 * exponential histograms, gauges, sums) and declines everything else: any field it does not
 * know, any value the Python path would reject or treat specially, anything malformed. A
 * declined request (convert() returns None) takes the Python path unchanged, so behaviour
 * (lines, rejection reasons, metrics, errors) cannot differ. docs/deployment.md, "Bridge vs
 * influxd CPU".
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* Status of a parse step: OK, DECLINE (not handled: the Python path runs), ERROR (a Python
 * exception is set). */
#define OK 0
#define DECLINE 1
#define ERROR (-1)
#define CHECK(expr)                                                                           \
    do {                                                                                      \
        int status_ = (expr);                                                                 \
        if (status_ != OK) return status_;                                                    \
    } while (0)

#define MAX_TIME_UNIX_NANO 9223372036854775806ULL /* 2**63 - 2: InfluxDB's last timestamp */
#define MAX_BUCKETS 4096
#define DERIVED_BITS 12

static const char JOB_ID[] = "stepwatch.job.id";
static const char RANK[] = "stepwatch.rank";
static const char WORLD_SIZE[] = "stepwatch.world_size";
static const char PREFIX[] = "stepwatch.";
static const char STEP_DURATION[] = "stepwatch.step.duration";
static const char *const IDENTITY_KEYS[] = {"host.name", "service.instance.id", "process.pid"};

/* ---- bytes ------------------------------------------------------------------------------ */

typedef struct {
    const char *p;
    Py_ssize_t n;
} Slice;

static int slice_eq(Slice s, const char *text) {
    size_t n = strlen(text);
    return (size_t)s.n == n && memcmp(s.p, text, n) == 0;
}

static int slice_ends(Slice s, char c) { return s.n > 0 && s.p[s.n - 1] == c; }

static int slice_cmp(Slice a, Slice b) {
    Py_ssize_t n = a.n < b.n ? a.n : b.n;
    int c = n ? memcmp(a.p, b.p, (size_t)n) : 0;
    if (c) return c;
    return a.n < b.n ? -1 : a.n > b.n;
}

typedef struct {
    char *b;
    size_t n, cap;
} Buf;

static int buf_realloc(Buf *buf, size_t extra) {
    size_t cap = buf->cap ? buf->cap : 256;
    while (cap < buf->n + extra) cap *= 2;
    char *b = PyMem_Realloc(buf->b, cap);
    if (!b) {
        PyErr_NoMemory();
        return ERROR;
    }
    buf->b = b;
    buf->cap = cap;
    return OK;
}

static inline __attribute__((always_inline)) int buf_grow(Buf *buf, size_t extra) {
    if (buf->n + extra <= buf->cap) return OK;
    return buf_realloc(buf, extra);
}

static inline __attribute__((always_inline)) int buf_put(Buf *buf, const void *data, size_t n) {
    CHECK(buf_grow(buf, n));
    if (n) memcpy(buf->b + buf->n, data, n);
    buf->n += n;
    return OK;
}

static int buf_str(Buf *buf, const char *text) { return buf_put(buf, text, strlen(text)); }

/* a string literal, its length known at compile time */
#define buf_lit(buf, text) buf_put((buf), (text), sizeof(text) - 1)

static int buf_u64(Buf *buf, uint64_t v) {
    char tmp[24];
    int i = 24;
    do {
        tmp[--i] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    return buf_put(buf, tmp + i, (size_t)(24 - i));
}

static int buf_i64(Buf *buf, int64_t v) {
    if (v < 0) {
        CHECK(buf_put(buf, "-", 1));
        return buf_u64(buf, (uint64_t)0 - (uint64_t)v);
    }
    return buf_u64(buf, (uint64_t)v);
}

/* ---- repr(float) ------------------------------------------------------------------------
 *
 * The shortest decimal that reads back as the double, the closest to it when several are as
 * short (ties: the even one) -- CPython's repr(), written here with the Schubfach method
 * (R. Giulietti, "The Schubfach way to render doubles", 2020): three 128-bit products per
 * value instead of dtoa's big-number arithmetic (~330 instructions per value with the layout,
 * against ~6,700 for CPython's routine, callgrind; the sum, min and max of each histogram
 * point are unique values, so dtoa was a third of the converter's time). The digits are then
 * laid out as repr() does. Checked
 * against repr() on millions of values (tests/otel_bridge/test_fastpath_float.py). Compilers
 * without a 128-bit integer type use CPython's own routine. */
#if defined(__SIZEOF_INT128__)
#define HAVE_SHORTEST 1
#include "pow10.h"

#define C_MIN (1ULL << 52) /* the smallest normal significand */
#define Q_MIN (-1074)      /* the subnormals' binary exponent */
#define MASK63 ((1ULL << 63) - 1)

/* floor(q * log10(2)), floor(log10(3/4 * 2**q)) and floor(e * log2(10)) by fixed-point
 * products (exact over the doubles' exponents; the test checks them exhaustively). The right shifts of negative
 * values are arithmetic (floor) on every compiler this builds with (GCC, Clang). */
static inline int flog10pow2(int q) { return (int)(((int64_t)q * 661971961083LL) >> 41); }

static inline int flog10_three_quarters_pow2(int q) {
    return (int)(((int64_t)q * 661971961083LL - 274743187321LL) >> 41);
}

static inline int flog2pow10(int e) { return (int)(((int64_t)e * 913124641741LL) >> 38); }

/* floor(g * cp / 2**127) with g = g1 * 2**63 + g0, its lowest bit set when the quotient is
 * inexact (round to odd: comparisons against it are then exact). */
static inline uint64_t round_odd(uint64_t g1, uint64_t g0, uint64_t cp) {
    uint64_t x1 = (uint64_t)(((unsigned __int128)g0 * cp) >> 64);
    unsigned __int128 y = (unsigned __int128)g1 * cp;
    uint64_t y0 = (uint64_t)y, y1 = (uint64_t)(y >> 64);
    uint64_t z = (y0 >> 1) + x1;
    return (y1 + (z >> 63)) | (((z & MASK63) + MASK63) >> 63);
}

/* The decimal digits * 10**exponent chosen for c * 2**q (c > 0). The rounding interval is
 * c * 2**q +- half an ulp (a quarter ulp below, at a power of two),
 * its ends included when c is even (round-half-even reads them back as c). Scaled by 10**-k
 * (k = floor(log10(ulp)), so the interval is 1 to 10 units wide), there is at most one
 * multiple of 10 in it: if there is, it is the shortest; otherwise the shortest are the whole
 * units in it, and the closest of them is floor or ceil of the value. */
static void to_decimal(int q, uint64_t c, uint64_t *digits, int *exponent) {
    uint64_t out = c & 1;
    uint64_t cb = c << 2, cbr = cb + 2, cbl;
    int k;
    if (c != C_MIN || q == Q_MIN) {
        cbl = cb - 2;
        k = flog10pow2(q);
    } else { /* a power of two: the gap below is half the gap above */
        cbl = cb - 1;
        k = flog10_three_quarters_pow2(q);
    }
    int h = q + flog2pow10(-k) + 2;
    const uint64_t *g = POW10_G[k - POW10_K_MIN];
    /* 4 * (c * 2**q) * 10**-k and the interval's ends, rounded to odd */
    uint64_t vb = round_odd(g[0], g[1], cb << h);
    uint64_t vbl = round_odd(g[0], g[1], cbl << h);
    uint64_t vbr = round_odd(g[0], g[1], cbr << h);
    uint64_t s = vb >> 2;
    *exponent = k;
    if (s >= 10) { /* the multiples of 10 around the value: one digit shorter, or more */
        uint64_t sp10 = s / 10 * 10, tp10 = sp10 + 10;
        int upin = vbl + out <= sp10 << 2;
        int wpin = (tp10 << 2) + out <= vbr;
        if (upin != wpin) {
            *digits = upin ? sp10 : tp10;
            return;
        }
    }
    uint64_t t = s + 1;
    int uin = vbl + out <= s << 2;
    int win = (t << 2) + out <= vbr;
    if (uin != win) {
        *digits = uin ? s : t;
        return;
    }
    /* both in: the closer; halfway, the even one */
    uint64_t middle = (s + t) << 1;
    *digits = vb < middle || (vb == middle && (s & 1) == 0) ? s : t;
}

/* repr() of a finite, non-zero double: -d.ddde+XX or fixed notation, as CPython lays out the
 * shortest digits ('r' format, Py_DTSF_ADD_DOT_0). */
static int buf_shortest(Buf *buf, double v) {
    uint64_t bits;
    memcpy(&bits, &v, sizeof bits);
    uint64_t fraction = bits & (C_MIN - 1);
    int biased = (int)((bits >> 52) & 0x7FF);
    uint64_t digits;
    int exponent;
    if (biased)
        to_decimal(biased - 1075, C_MIN | fraction, &digits, &exponent);
    else
        to_decimal(Q_MIN, fraction, &digits, &exponent);
    while (digits % 10 == 0) { /* digits > 0 */
        digits /= 10;
        exponent++;
    }
    char text[24];
    int n = 0, i = 24;
    do {
        text[--i] = (char)('0' + digits % 10);
        digits /= 10;
        n++;
    } while (digits);
    const char *d = text + i;
    int point = n + exponent; /* the value is 0.d1d2...dn * 10**point */
    CHECK(buf_grow(buf, 32));
    char *o = buf->b + buf->n;
    if (bits >> 63) *o++ = '-';
    if (point <= -4 || point > 16) {
        *o++ = d[0];
        if (n > 1) {
            *o++ = '.';
            memcpy(o, d + 1, (size_t)(n - 1));
            o += n - 1;
        }
        int e = point - 1;
        *o++ = 'e';
        *o++ = e < 0 ? '-' : '+';
        if (e < 0) e = -e;
        if (e >= 100) *o++ = (char)('0' + e / 100);
        *o++ = (char)('0' + e / 10 % 10);
        *o++ = (char)('0' + e % 10);
    } else if (point <= 0) {
        *o++ = '0';
        *o++ = '.';
        for (int z = 0; z < -point; z++) *o++ = '0';
        memcpy(o, d, (size_t)n);
        o += n;
    } else if (point < n) {
        memcpy(o, d, (size_t)point);
        o += point;
        *o++ = '.';
        memcpy(o, d + point, (size_t)(n - point));
        o += n - point;
    } else {
        memcpy(o, d, (size_t)n);
        o += n;
        for (int z = n; z < point; z++) *o++ = '0';
        *o++ = '.';
        *o++ = '0';
    }
    buf->n = (size_t)(o - buf->b);
    return OK;
}
#endif

/* repr(float) by CPython's routine where the routine above is not built (and for -0.0, inf
 * and nan), remembered: the derived quantiles (12 significant bits), counts and bounds
 * repeat from window to window. Direct-mapped by the value's bits; the GIL guards it. */
#define REPR_SLOTS 8192
static struct {
    uint64_t bits;
    char text[32];
} repr_cache[REPR_SLOTS];

static int buf_double(Buf *buf, double v) {
    if (fabs(v) < 9007199254740992.0 && v == (double)(int64_t)v && (v != 0.0 || !signbit(v))) {
        /* an integer below 2**53: its digits are the shortest repr, plus ".0" */
        CHECK(buf_i64(buf, (int64_t)v));
        return buf_lit(buf, ".0");
    }
#ifdef HAVE_SHORTEST
    if (isfinite(v) && v != 0.0) return buf_shortest(buf, v);
#endif
    uint64_t bits;
    memcpy(&bits, &v, sizeof bits);
    size_t slot = (size_t)((bits * 0x9E3779B97F4A7C15ULL) >> 51) & (REPR_SLOTS - 1);
    if (repr_cache[slot].text[0] && repr_cache[slot].bits == bits)
        return buf_str(buf, repr_cache[slot].text);
    char *text = PyOS_double_to_string(v, 'r', 0, Py_DTSF_ADD_DOT_0, NULL);
    if (!text) return ERROR;
    size_t n = strlen(text);
    if (n < sizeof repr_cache[slot].text) {
        memcpy(repr_cache[slot].text, text, n + 1);
        repr_cache[slot].bits = bits;
    }
    int status = buf_put(buf, text, n);
    PyMem_Free(text);
    return status;
}

/* escape_measurement (escape_key adds '='); the text never ends in a backslash here */
static int buf_escaped(Buf *buf, Slice s, int key) {
    CHECK(buf_grow(buf, (size_t)s.n * 2));
    for (Py_ssize_t i = 0; i < s.n; i++) {
        char c = s.p[i];
        if (c == ',' || c == ' ' || (key && c == '=')) {
            buf->b[buf->n++] = '\\';
            buf->b[buf->n++] = c;
        } else if (c == '\n') {
            buf->b[buf->n++] = '\\';
            buf->b[buf->n++] = 'n';
        } else {
            buf->b[buf->n++] = c;
        }
    }
    return OK;
}

/* ---- wire format ------------------------------------------------------------------------- */

typedef struct {
    const uint8_t *p, *end;
} Rd;

static inline __attribute__((always_inline)) int rd_varint(Rd *rd, uint64_t *out) {
    if (rd->p < rd->end && !(*rd->p & 0x80)) { /* one byte: most tags and lengths */
        *out = *rd->p++;
        return OK;
    }
    uint64_t v = 0;
    for (int i = 0; i < 10; i++) {
        if (rd->p >= rd->end) return DECLINE;
        uint8_t byte = *rd->p++;
        if (i == 9 && byte > 1) return DECLINE;
        v |= (uint64_t)(byte & 0x7f) << (7 * i);
        if (!(byte & 0x80)) {
            *out = v;
            return OK;
        }
    }
    return DECLINE;
}

static int rd_fixed64(Rd *rd, uint64_t *out) {
    if (rd->end - rd->p < 8) return DECLINE;
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | rd->p[i];
    rd->p += 8;
    *out = v;
    return OK;
}

static int rd_double(Rd *rd, double *out) {
    uint64_t bits;
    CHECK(rd_fixed64(rd, &bits));
    memcpy(out, &bits, sizeof bits);
    return OK;
}

/* A tag or a length: upb reads them as 32-bit varints, of at most 5 bytes; a longer encoding,
 * even of a small value (0x80 0x80 0x80 0x80 0x80 0x00), is malformed there: declined here. */
static inline __attribute__((always_inline)) int rd_varint32(Rd *rd, uint64_t *out) {
    const uint8_t *start = rd->p;
    CHECK(rd_varint(rd, out));
    return rd->p - start > 5 ? DECLINE : OK;
}

/* The next field's number and wire type; *done at the end of the message. */
static int rd_tag(Rd *rd, uint32_t *field, uint32_t *wire, int *done) {
    if (rd->p >= rd->end) {
        *done = 1;
        return OK;
    }
    uint64_t tag;
    CHECK(rd_varint32(rd, &tag));
    if (tag >> 3 == 0 || tag >> 3 > 536870911u) return DECLINE;
    *field = (uint32_t)(tag >> 3);
    *wire = (uint32_t)(tag & 7);
    *done = 0;
    return OK;
}

static int rd_len(Rd *rd, Rd *sub) {
    uint64_t n;
    CHECK(rd_varint32(rd, &n));
    if (n > (uint64_t)(rd->end - rd->p)) return DECLINE;
    sub->p = rd->p;
    sub->end = rd->p + n;
    rd->p += n;
    return OK;
}

/* Strict UTF-8 (what upb requires of a proto3 string): no overlongs, surrogates, > U+10FFFF. */
static int utf8_valid(const uint8_t *p, const uint8_t *end) {
    while (p < end) {
        uint8_t c = *p;
        if (c < 0x80) {
            p++;
            continue;
        }
        int n;
        uint32_t cp;
        if (c >= 0xc2 && c <= 0xdf) {
            n = 1;
            cp = c & 0x1f;
        } else if (c >= 0xe0 && c <= 0xef) {
            n = 2;
            cp = c & 0x0f;
        } else if (c >= 0xf0 && c <= 0xf4) {
            n = 3;
            cp = c & 0x07;
        } else {
            return 0;
        }
        if (end - p <= n) return 0;
        for (int i = 1; i <= n; i++) {
            if ((p[i] & 0xc0) != 0x80) return 0;
            cp = (cp << 6) | (p[i] & 0x3f);
        }
        if ((n == 2 && (cp < 0x800 || (cp >= 0xd800 && cp <= 0xdfff))) ||
            (n == 3 && (cp < 0x10000 || cp > 0x10ffff)))
            return 0;
        p += n + 1;
    }
    return 1;
}

static int rd_string(Rd *rd, Slice *out) {
    Rd sub;
    CHECK(rd_len(rd, &sub));
    if (!utf8_valid(sub.p, sub.end)) return DECLINE;
    out->p = (const char *)sub.p;
    out->n = sub.end - sub.p;
    return OK;
}

/* ---- attributes -------------------------------------------------------------------------- */

enum { V_NONE, V_STRING, V_BOOL, V_INT, V_DOUBLE };

typedef struct {
    Slice key;
    int type;
    Slice s;
    int64_t i;
    double d;
} Attr;

typedef struct {
    Attr *items;
    Py_ssize_t n, cap;
} Attrs;

static int parse_anyvalue(Rd rd, Attr *attr) {
    uint32_t field, wire;
    int done;
    uint64_t v;
    for (;;) {
        CHECK(rd_tag(&rd, &field, &wire, &done));
        if (done) return OK;
        if (field == 1 && wire == 2) {
            CHECK(rd_string(&rd, &attr->s));
            attr->type = V_STRING;
        } else if (field == 2 && wire == 0) {
            CHECK(rd_varint(&rd, &v));
            attr->type = V_BOOL;
            attr->i = v != 0;
        } else if (field == 3 && wire == 0) {
            CHECK(rd_varint(&rd, &v));
            attr->type = V_INT;
            attr->i = (int64_t)v;
        } else if (field == 4 && wire == 1) {
            CHECK(rd_double(&rd, &attr->d));
            attr->type = V_DOUBLE;
        } else {
            return DECLINE; /* arrays, maps, bytes, unknown fields */
        }
    }
}

static int parse_keyvalue(Rd rd, Attrs *attrs) {
    if (attrs->n == attrs->cap) {
        Py_ssize_t cap = attrs->cap ? attrs->cap * 2 : 16;
        Attr *items = PyMem_Realloc(attrs->items, (size_t)cap * sizeof(Attr));
        if (!items) {
            PyErr_NoMemory();
            return ERROR;
        }
        attrs->items = items;
        attrs->cap = cap;
    }
    Attr *attr = &attrs->items[attrs->n];
    memset(attr, 0, sizeof *attr);
    attr->key.p = "";
    uint32_t field, wire;
    int done, seen_value = 0;
    for (;;) {
        CHECK(rd_tag(&rd, &field, &wire, &done));
        if (done) break;
        if (field == 1 && wire == 2) {
            CHECK(rd_string(&rd, &attr->key));
        } else if (field == 2 && wire == 2 && !seen_value) {
            Rd sub;
            CHECK(rd_len(&rd, &sub));
            CHECK(parse_anyvalue(sub, attr));
            seen_value = 1;
        } else {
            return DECLINE;
        }
    }
    for (Py_ssize_t i = 0; i < attrs->n; i++) /* a repeated key: the Python path decides */
        if (slice_cmp(attrs->items[i].key, attr->key) == 0) return DECLINE;
    attrs->n++;
    return OK;
}

/* _tag_value: the attribute as a tag string; 0 when it is not a scalar (None). */
static int tag_text(const Attr *attr, Buf *buf) {
    switch (attr->type) {
        case V_STRING:
            return buf_put(buf, attr->s.p, (size_t)attr->s.n) == OK ? 1 : ERROR;
        case V_INT:
            return buf_i64(buf, attr->i) == OK ? 1 : ERROR;
        case V_BOOL:
            return buf_str(buf, attr->i ? "true" : "false") == OK ? 1 : ERROR;
        case V_DOUBLE:
            return buf_double(buf, attr->d) == OK ? 1 : ERROR;
        default:
            return 0;
    }
}

/* A tag of a series key: the key, and ",key=value" escaped (empty: value "", not stored). */
typedef struct {
    Slice key;
    size_t off, len; /* the piece in the owner's Buf */
} Piece;

typedef struct {
    Slice *keys; /* the allowlist as UTF-8 */
    Py_ssize_t n;
} Allow;

static int allowed(const Allow *allow, Slice key) {
    for (Py_ssize_t i = 0; i < allow->n; i++)
        if (allow->keys[i].n == key.n && memcmp(allow->keys[i].p, key.p, (size_t)key.n) == 0)
            return 1;
    return 0;
}

/* The allowlisted scalar attributes as sorted pieces (text in `text`), and how many were
 * dropped (keys in IDENTITY_KEYS excepted when `consumed`). DECLINE where the Python path
 * would reject or raise: a key or value ending in a backslash, a point tag naming the job or
 * the rank (the cardinality guard reads those from the resource). */
static int tag_pieces(const Attrs *attrs, const Allow *allow, int consumed, Buf *text,
                      Piece *pieces, Py_ssize_t *npieces, int64_t *dropped, int point) {
    *npieces = 0;
    *dropped = 0;
    for (Py_ssize_t i = 0; i < attrs->n; i++) {
        const Attr *attr = &attrs->items[i];
        int scalar = attr->type != V_NONE;
        if (!scalar || !allowed(allow, attr->key)) {
            int identity = 0;
            for (size_t k = 0; consumed && k < 3; k++)
                if (slice_eq(attr->key, IDENTITY_KEYS[k])) identity = 1;
            if (!identity) (*dropped)++;
            continue;
        }
        if (slice_ends(attr->key, '\\')) return DECLINE;
        if (point && (slice_eq(attr->key, JOB_ID) || slice_eq(attr->key, RANK))) return DECLINE;
        Buf value = {0};
        int got = tag_text(attr, &value);
        if (got == ERROR) {
            PyMem_Free(value.b);
            return ERROR;
        }
        Slice v = {value.b ? value.b : "", (Py_ssize_t)value.n};
        if (slice_ends(v, '\\')) {
            PyMem_Free(value.b);
            return DECLINE;
        }
        size_t off = text->n;
        int status = OK;
        if (v.n) {
            status = buf_put(text, ",", 1);
            if (status == OK) status = buf_escaped(text, attr->key, 1);
            if (status == OK) status = buf_put(text, "=", 1);
            if (status == OK) status = buf_escaped(text, v, 1);
        }
        PyMem_Free(value.b);
        if (status != OK) return status;
        Piece piece = {attr->key, off, text->n - off};
        Py_ssize_t j = *npieces; /* insertion sort by key: a handful of tags */
        while (j > 0 && slice_cmp(pieces[j - 1].key, piece.key) > 0) {
            pieces[j] = pieces[j - 1];
            j--;
        }
        pieces[j] = piece;
        (*npieces)++;
    }
    return OK;
}

static int attr_value_text(const Attrs *attrs, const char *key, Buf *buf, int *found) {
    *found = 0;
    for (Py_ssize_t i = 0; i < attrs->n; i++) {
        if (!slice_eq(attrs->items[i].key, key)) continue;
        int got = tag_text(&attrs->items[i], buf);
        if (got == ERROR) return ERROR;
        *found = got;
        return OK;
    }
    return OK;
}

static const Attr *find_attr(const Attrs *attrs, const char *key) {
    for (Py_ssize_t i = 0; i < attrs->n; i++)
        if (slice_eq(attrs->items[i].key, key)) return &attrs->items[i];
    return NULL;
}

/* _as_int for the cases decided here: an int, or a string of ASCII digits */
static int as_int(const Attr *attr, int64_t *out) {
    if (attr->type == V_INT) {
        *out = attr->i;
        return OK;
    }
    if (attr->type != V_STRING || attr->s.n < 1 || attr->s.n > 18) return DECLINE;
    int64_t v = 0;
    for (Py_ssize_t i = 0; i < attr->s.n; i++) {
        char c = attr->s.p[i];
        if (c < '0' || c > '9') return DECLINE;
        v = v * 10 + (c - '0');
    }
    *out = v;
    return OK;
}

/* _resource_problem() is None: job and rank present and valid; DECLINE otherwise */
static int resource_valid(const Attrs *attrs) {
    const Attr *job = find_attr(attrs, JOB_ID), *rank = find_attr(attrs, RANK);
    if (!job || !rank) return DECLINE;
    if (job->type == V_NONE || (job->type == V_STRING && job->s.n == 0)) return DECLINE;
    int64_t r, w;
    CHECK(as_int(rank, &r));
    if (r < 0) return DECLINE;
    const Attr *world = find_attr(attrs, WORLD_SIZE);
    if (world) {
        CHECK(as_int(world, &w));
        if (r >= w) return DECLINE;
    }
    return OK;
}

/* ---- the conversion ---------------------------------------------------------------------- */

typedef struct {
    size_t off, len, series_len; /* in Conv.out */
    int owner;                   /* the resource check that decides this line; -1: none */
    Py_ssize_t desc;             /* index in Conv.descs */
} Line;

typedef struct {
    PyObject *attributes; /* _scalar_attributes() of the resource */
    int64_t points;       /* its stepwatch.* points */
    int64_t dropped;      /* their point attributes dropped */
} Check;

typedef struct {
    Slice name;
    Py_ssize_t resource; /* index in Conv.jobs / Conv.ranks */
} Desc;

typedef struct {
    /* options */
    Allow allow;
    int has_max_duration;
    double max_duration_s;
    int has_bounds;
    int64_t earliest, latest;
    PyObject *resource_check;
    /* output */
    Buf out;
    Line *lines;
    Py_ssize_t nlines, caplines;
    Check *checks;
    Py_ssize_t nchecks, capchecks;
    Desc *descs;
    Py_ssize_t ndescs, capdescs;
    PyObject *jobs, *ranks; /* per resource: its job and rank tag text (the guard's budgets) */
    int64_t dropped;
    /* scratch */
    Attrs rattrs, pattrs;
    Buf rtext, ptext, scratch;
    Piece *rpieces, *ppieces;
    Py_ssize_t nrpieces, capr, capp;
} Conv;

static int grow(void **items, Py_ssize_t *cap, Py_ssize_t need, size_t size) {
    if (need <= *cap) return OK;
    Py_ssize_t n = *cap ? *cap : 16;
    while (n < need) n *= 2;
    void *p = PyMem_Realloc(*items, (size_t)n * size);
    if (!p) {
        PyErr_NoMemory();
        return ERROR;
    }
    *items = p;
    *cap = n;
    return OK;
}

typedef struct {
    Py_ssize_t resource;
    int check; /* -1: none yet */
    int valid; /* job/rank valid (resource_problem is None) */
    int64_t dropped;
} ResState;

enum { K_NONE, K_GAUGE, K_SUM, K_HISTOGRAM, K_EXPONENTIAL, K_SUMMARY };

typedef struct {
    Slice name, unit;
    int kind, monotonic, temporality;
    Rd data; /* the data message */
    int64_t points;
} Metric;

typedef struct {
    uint64_t start, time;
    int has_value, has_sum, has_min, has_max;
    double value, sum, min, max, zero_threshold;
    uint64_t count, zero_count;
    int64_t scale, offset;
    Rd counts; /* packed varints */
    int has_counts, has_negative, negative_counts;
} DataPoint;

static int scan_buckets(Rd rd, int64_t *offset, Rd *counts, int *has_counts) {
    uint32_t field, wire;
    int done;
    uint64_t v;
    for (;;) {
        CHECK(rd_tag(&rd, &field, &wire, &done));
        if (done) return OK;
        if (field == 1 && wire == 0) {
            CHECK(rd_varint(&rd, &v));
            if (v > 0xffffffffu) return DECLINE;
            uint32_t z = (uint32_t)v;
            *offset = (int32_t)((z >> 1) ^ (0u - (z & 1)));
        } else if (field == 2 && wire == 2 && !*has_counts) {
            CHECK(rd_len(&rd, counts));
            *has_counts = 1;
        } else {
            return DECLINE;
        }
    }
}

/* One data point's fields; `attrs` gets its attributes. */
static int scan_point(Conv *c, Rd rd, int kind, DataPoint *dp) {
    memset(dp, 0, sizeof *dp);
    c->pattrs.n = 0;
    uint32_t field, wire;
    int done;
    uint64_t v;
    int attr_field = kind == K_EXPONENTIAL ? 1 : kind == K_HISTOGRAM ? 9 : 7;
    for (;;) {
        CHECK(rd_tag(&rd, &field, &wire, &done));
        if (done) return OK;
        if (field == (uint32_t)attr_field && wire == 2) {
            Rd sub;
            CHECK(rd_len(&rd, &sub));
            CHECK(parse_keyvalue(sub, &c->pattrs));
        } else if (field == 2 && wire == 1) {
            CHECK(rd_fixed64(&rd, &dp->start));
        } else if (field == 3 && wire == 1) {
            CHECK(rd_fixed64(&rd, &dp->time));
        } else if (kind == K_GAUGE || kind == K_SUM) {
            if (field == 4 && wire == 1) {
                CHECK(rd_double(&rd, &dp->value));
                dp->has_value = 1;
            } else if (field == 6 && wire == 1) {
                CHECK(rd_fixed64(&rd, &v));
                dp->value = (double)(int64_t)v;
                dp->has_value = 1;
            } else if (field == 8 && wire == 0) {
                CHECK(rd_varint(&rd, &v)); /* flags */
            } else {
                return DECLINE; /* exemplars, unknown fields */
            }
        } else if (kind == K_EXPONENTIAL) {
            if (field == 4 && wire == 1) {
                CHECK(rd_fixed64(&rd, &dp->count));
            } else if (field == 5 && wire == 1) {
                CHECK(rd_double(&rd, &dp->sum));
                dp->has_sum = 1;
            } else if (field == 6 && wire == 0) {
                CHECK(rd_varint(&rd, &v));
                if (v > 0xffffffffu) return DECLINE;
                uint32_t z = (uint32_t)v;
                dp->scale = (int32_t)((z >> 1) ^ (0u - (z & 1)));
            } else if (field == 7 && wire == 1) {
                CHECK(rd_fixed64(&rd, &dp->zero_count));
            } else if (field == 8 && wire == 2 && !dp->has_counts) {
                Rd sub;
                CHECK(rd_len(&rd, &sub));
                int has = 0;
                CHECK(scan_buckets(sub, &dp->offset, &dp->counts, &has));
                dp->has_counts = 1;
                if (!has) dp->counts.p = dp->counts.end = NULL;
            } else if (field == 9 && wire == 2 && !dp->has_negative) {
                Rd sub, counts = {NULL, NULL};
                int64_t offset = 0;
                int has = 0;
                CHECK(rd_len(&rd, &sub));
                CHECK(scan_buckets(sub, &offset, &counts, &has));
                dp->has_negative = 1;
                while (has && counts.p < counts.end) { /* SDKs send an empty range as zeros */
                    CHECK(rd_varint(&counts, &v));
                    if (v) dp->negative_counts = 1;
                }
            } else if (field == 10 && wire == 0) {
                CHECK(rd_varint(&rd, &v)); /* flags */
            } else if (field == 12 && wire == 1) {
                CHECK(rd_double(&rd, &dp->min));
                dp->has_min = 1;
            } else if (field == 13 && wire == 1) {
                CHECK(rd_double(&rd, &dp->max));
                dp->has_max = 1;
            } else if (field == 14 && wire == 1) {
                CHECK(rd_double(&rd, &dp->zero_threshold));
            } else {
                return DECLINE;
            }
        } else {
            return DECLINE;
        }
    }
}

/* _rounded(): to DERIVED_BITS significant bits, clamped */
static int rounded(double value, int has_min, double minimum, int has_max, double maximum,
                   double *out) {
    int exponent;
    double mantissa = frexp(value, &exponent);
    double x = mantissa * (double)(1 << DERIVED_BITS);
    double r = round(x); /* Python's round(): half to even */
    if (fabs(x - r) == 0.5) r = 2.0 * round(x / 2.0);
    r = (double)(long long)r; /* an int in Python: no negative zero */
    value = ldexp(r, exponent - DERIVED_BITS);
    if (isinf(value)) return DECLINE; /* OverflowError in Python */
    if (has_min && minimum > value) value = minimum;
    if (has_max && maximum < value) value = maximum;
    *out = value;
    return OK;
}

/* _exponential_boundary(): 2.0 ** (index * 2.0 ** -scale), remembered (as the Python path's
 * lru_cache does; a window's buckets sit in a few octaves) */
#define BOUND_SLOTS 4096
static struct {
    int64_t scale, index;
    double value;
    int set;
} bound_cache[BOUND_SLOTS];

static double boundary(int64_t scale, int64_t index) {
    size_t slot = (size_t)(((uint64_t)index * 0x9E3779B97F4A7C15ULL + (uint64_t)scale) >> 52) &
                  (BOUND_SLOTS - 1);
    if (bound_cache[slot].set && bound_cache[slot].scale == scale &&
        bound_cache[slot].index == index)
        return bound_cache[slot].value;
    double value = pow(2.0, (double)index * pow(2.0, (double)-scale));
    bound_cache[slot].scale = scale;
    bound_cache[slot].index = index;
    bound_cache[slot].value = value;
    bound_cache[slot].set = 1;
    return value;
}

/* The fields of a positive-only exponential histogram (_compact_positive). */
static int exponential_fields(Conv *c, const DataPoint *dp, int duration, int shared_start,
                              Buf *f) {
    if (!dp->has_counts || dp->counts.p == dp->counts.end || dp->zero_count ||
        dp->zero_threshold != 0.0 || dp->negative_counts)
        return DECLINE; /* the general path */
    /* _histogram_head */
    int has_min = dp->has_min, has_max = dp->has_max;
    double minimum = dp->min, maximum = dp->max;
    if (dp->has_sum) {
        if (!isfinite(dp->sum) || (duration && dp->sum < 0)) return DECLINE;
        if (dp->count == 1) {
            if (!has_min) minimum = dp->sum, has_min = 1;
            if (!has_max) maximum = dp->sum, has_max = 1;
        }
    }
    if (has_min && (!isfinite(minimum) || (duration && minimum < 0))) return DECLINE;
    if (has_max && (!isfinite(maximum) || (duration && maximum < 0))) return DECLINE;
    if (has_min && has_max && minimum > maximum && dp->count > 0) return DECLINE;
    int64_t scale = dp->scale, offset = dp->offset;
    if (scale < -10 || scale > 20) return DECLINE;
    /* the counts, their total and the zero-run text */
    Buf *text = &c->scratch;
    text->n = 0;
    Rd rd = dp->counts;
    uint64_t total = 0, zeros = 0;
    Py_ssize_t length = 0;
    int first = 1;
    while (rd.p < rd.end) {
        uint64_t count;
        CHECK(rd_varint(&rd, &count));
        if (++length > MAX_BUCKETS) return DECLINE;
        if (total + count < total) return DECLINE; /* a Python int would not wrap: mismatch */
        total += count;
        if (!count) {
            zeros++;
            continue;
        }
        if (zeros) {
            CHECK(buf_str(text, first ? "" : ","));
            if (zeros == 1) {
                CHECK(buf_lit(text, "0"));
            } else if (zeros == 2) {
                CHECK(buf_lit(text, "0,0"));
            } else {
                CHECK(buf_put(text, "*", 1));
                CHECK(buf_u64(text, zeros));
            }
            first = 0;
            zeros = 0;
        }
        CHECK(buf_str(text, first ? "" : ","));
        CHECK(buf_u64(text, count));
        first = 0;
    }
    if (zeros) {
        CHECK(buf_str(text, first ? "" : ","));
        if (zeros == 1) {
            CHECK(buf_lit(text, "0"));
        } else if (zeros == 2) {
            CHECK(buf_lit(text, "0,0"));
        } else {
            CHECK(buf_put(text, "*", 1));
            CHECK(buf_u64(text, zeros));
        }
    }
    /* range_bounds: every bound 2**x with |x| <= 1000 is finite, normal and strictly above the
     * one before (ratio >= 2**(2**-20)); anything else the Python path decides */
    double step = pow(2.0, (double)-scale);
    if ((double)offset * step < -1000.0 || (double)(offset + length) * step > 1000.0)
        return DECLINE;
    if (total != dp->count) return DECLINE;
    CHECK(buf_lit(f, "count="));
    CHECK(buf_double(f, (double)dp->count));
    if (dp->has_sum) {
        CHECK(buf_lit(f, ",sum="));
        CHECK(buf_double(f, dp->sum));
    }
    if (has_min) {
        CHECK(buf_lit(f, ",min="));
        CHECK(buf_double(f, minimum));
    }
    if (has_max) {
        CHECK(buf_lit(f, ",max="));
        CHECK(buf_double(f, maximum));
    }
    if (total > 0) {
        static const double quantiles[2] = {0.50, 0.90};
        static const char *const names[2] = {",p50=", ",p90="};
        for (int q = 0; q < 2; q++) {
            double want = ceil(quantiles[q] * (double)total);
            if (want >= 18446744073709551616.0) return DECLINE;
            uint64_t rank = want < 1.0 ? 1 : (uint64_t)want;
            if (rank > total) return DECLINE; /* IndexError in the Python path */
            /* bisect_left over the cumulative counts */
            Rd again = dp->counts;
            uint64_t running = 0, count;
            int64_t index = 0;
            for (;; index++) {
                CHECK(rd_varint(&again, &count));
                running += count;
                if (running >= rank) break;
            }
            double value =
                (boundary(scale, offset + index) + boundary(scale, offset + index + 1)) / 2.0;
            if (has_min && minimum > value) value = minimum;
            if (has_max && maximum < value) value = maximum;
            CHECK(rounded(value, has_min, minimum, has_max, maximum, &value));
            CHECK(buf_str(f, names[q]));
            CHECK(buf_double(f, value));
        }
    }
    CHECK(buf_str(f, ",buckets=\"e"));
    CHECK(buf_i64(f, scale));
    CHECK(buf_put(f, ":", 1));
    CHECK(buf_i64(f, offset));
    CHECK(buf_put(f, ":", 1));
    CHECK(buf_put(f, text->b, text->n));
    CHECK(buf_put(f, "\"", 1));
    if (dp->start && !shared_start) {
        CHECK(buf_lit(f, ",start_time_unix_nano="));
        CHECK(buf_u64(f, dp->start));
        CHECK(buf_put(f, "i", 1));
    }
    /* _plausible */
    if (duration && c->has_max_duration) {
        double mean = dp->has_sum && dp->count ? dp->sum / (double)dp->count : 0.0;
        if (mean > c->max_duration_s || (has_max && maximum > c->max_duration_s))
            return DECLINE;
    }
    return OK;
}

static int number_fields(Conv *c, const DataPoint *dp, int duration, const char *field,
                         Buf *f) {
    if (!dp->has_value || !isfinite(dp->value)) return DECLINE;
    CHECK(buf_str(f, field));
    CHECK(buf_double(f, dp->value));
    if (dp->start) {
        CHECK(buf_lit(f, ",start_time_unix_nano="));
        CHECK(buf_u64(f, dp->start));
        CHECK(buf_put(f, "i", 1));
    }
    if (duration && c->has_max_duration && 0.0 > c->max_duration_s) return DECLINE;
    return OK;
}

static int add_line(Conv *c, Line line) {
    CHECK(grow((void **)&c->lines, &c->caplines, c->nlines + 1, sizeof(Line)));
    c->lines[c->nlines++] = line;
    return OK;
}

static int convert_metric(Conv *c, ResState *res, const Metric *m, int owner) {
    int duration = slice_eq(m->unit, "s") ||
                   (m->name.n >= 9 && memcmp(m->name.p + m->name.n - 9, ".duration", 9) == 0);
    int stepwatch = m->name.n >= 10 && memcmp(m->name.p, PREFIX, 10) == 0;
    int histogram = m->kind == K_EXPONENTIAL;
    int shared_start = histogram && stepwatch && !slice_eq(m->name, STEP_DURATION);
    CHECK(grow((void **)&c->descs, &c->capdescs, c->ndescs + 1, sizeof(Desc)));
    Py_ssize_t desc = c->ndescs++;
    c->descs[desc].name = m->name;
    c->descs[desc].resource = res->resource;
    Rd rd = m->data;
    uint32_t field, wire;
    int done;
    uint64_t v;
    for (;;) {
        CHECK(rd_tag(&rd, &field, &wire, &done));
        if (done) return OK;
        if (field != 1) { /* temporality, monotonic: read by scan_metric */
            if (wire == 0) CHECK(rd_varint(&rd, &v));
            continue;
        }
        Rd sub;
        CHECK(rd_len(&rd, &sub));
        DataPoint dp;
        CHECK(scan_point(c, sub, m->kind, &dp));
        if (dp.time == 0 || dp.time > MAX_TIME_UNIX_NANO || dp.start > MAX_TIME_UNIX_NANO)
            return DECLINE;
        if (c->has_bounds && !((int64_t)dp.time >= c->earliest && (int64_t)dp.time <= c->latest))
            return DECLINE;
        /* the point's tags */
        Py_ssize_t npieces;
        int64_t dropped;
        CHECK(grow((void **)&c->ppieces, &c->capp, c->pattrs.n + 1, sizeof(Piece)));
        c->ptext.n = 0;
        CHECK(tag_pieces(&c->pattrs, &c->allow, 0, &c->ptext, c->ppieces, &npieces, &dropped,
                         1));
        for (Py_ssize_t i = 0; i < npieces; i++) /* a point tag overrides a resource tag */
            for (Py_ssize_t j = 0; j < c->nrpieces; j++)
                if (slice_cmp(c->ppieces[i].key, c->rpieces[j].key) == 0) return DECLINE;
        Line line = {c->out.n, 0, 0, owner, desc};
        Buf *out = &c->out;
        CHECK(buf_escaped(out, m->name, 0));
        Py_ssize_t i = 0, j = 0; /* merge the sorted resource and point pieces */
        while (i < c->nrpieces || j < npieces) {
            int resource_first = j >= npieces ||
                                 (i < c->nrpieces &&
                                  slice_cmp(c->rpieces[i].key, c->ppieces[j].key) < 0);
            /* an empty value is a piece with no text (it still overrides, above); where every
             * piece is one, the text buffer was never allocated: no offset from NULL */
            const Piece *piece = resource_first ? &c->rpieces[i++] : &c->ppieces[j++];
            const Buf *text = resource_first ? &c->rtext : &c->ptext;
            if (piece->len) CHECK(buf_put(out, text->b + piece->off, piece->len));
        }
        line.series_len = out->n - line.off;
        CHECK(buf_put(out, " ", 1));
        if (m->kind == K_EXPONENTIAL) {
            CHECK(exponential_fields(c, &dp, duration, shared_start, out));
        } else {
            const char *name = m->kind == K_SUM && m->monotonic ? "counter=" : "gauge=";
            CHECK(number_fields(c, &dp, duration, name, out));
        }
        CHECK(buf_put(out, " ", 1));
        CHECK(buf_u64(out, dp.time));
        line.len = out->n - line.off;
        CHECK(add_line(c, line));
        c->dropped += dropped;
        if (owner >= 0) c->checks[owner].dropped += dropped;
    }
}

/* A metric's name, unit, kind and data message; its points counted. */
static int scan_metric(Rd rd, Metric *m) {
    memset(m, 0, sizeof *m);
    m->name.p = m->unit.p = "";
    uint32_t field, wire;
    int done;
    Slice ignored;
    for (;;) {
        CHECK(rd_tag(&rd, &field, &wire, &done));
        if (done) break;
        if (wire != 2) return DECLINE;
        if (field == 1) {
            CHECK(rd_string(&rd, &m->name));
        } else if (field == 2) {
            CHECK(rd_string(&rd, &ignored));
        } else if (field == 3) {
            CHECK(rd_string(&rd, &m->unit));
        } else if ((field == 5 || field == 7 || field == 9 || field == 10 || field == 11) &&
                   m->kind == K_NONE) {
            CHECK(rd_len(&rd, &m->data));
            m->kind = field == 5 ? K_GAUGE : field == 7 ? K_SUM : field == 9 ? K_HISTOGRAM
                                                        : field == 10 ? K_EXPONENTIAL
                                                                      : K_SUMMARY;
        } else {
            return DECLINE; /* two data members, metadata, unknown fields */
        }
    }
    if (m->kind == K_NONE) return OK;
    Rd data = m->data;
    uint64_t v;
    for (;;) {
        CHECK(rd_tag(&data, &field, &wire, &done));
        if (done) break;
        if (field == 1 && wire == 2) {
            Rd sub;
            CHECK(rd_len(&data, &sub));
            m->points++;
        } else if (field == 2 && wire == 0 && m->kind != K_GAUGE && m->kind != K_SUMMARY) {
            CHECK(rd_varint(&data, &v));
            if (v > 0x7fffffff) return DECLINE;
            m->temporality = (int)v;
        } else if (field == 3 && wire == 0 && m->kind == K_SUM) {
            CHECK(rd_varint(&data, &v));
            m->monotonic = v != 0;
        } else {
            return DECLINE;
        }
    }
    return OK;
}

static int scalar_attributes(const Attrs *attrs, PyObject **out) {
    PyObject *dict = PyDict_New();
    if (!dict) return ERROR;
    for (Py_ssize_t i = 0; i < attrs->n; i++) {
        Buf text = {0};
        int got = tag_text(&attrs->items[i], &text);
        PyObject *key = NULL, *value = NULL;
        int status = got == ERROR ? ERROR : OK;
        if (got == 1) {
            key = PyUnicode_DecodeUTF8(attrs->items[i].key.p, attrs->items[i].key.n, NULL);
            value = PyUnicode_DecodeUTF8(text.b ? text.b : "", (Py_ssize_t)text.n, NULL);
            if (!key || !value || PyDict_SetItem(dict, key, value) < 0) status = ERROR;
        }
        Py_XDECREF(key);
        Py_XDECREF(value);
        PyMem_Free(text.b);
        if (status != OK) {
            Py_DECREF(dict);
            return ERROR;
        }
    }
    *out = dict;
    return OK;
}

static int tag_object(const Attrs *attrs, const Allow *allow, const char *key, PyObject **out) {
    Buf text = {0};
    int found = 0;
    const Attr *attr = find_attr(attrs, key);
    if (attr && allowed(allow, attr->key)) {
        if (attr_value_text(attrs, key, &text, &found) != OK) {
            PyMem_Free(text.b);
            return ERROR;
        }
    }
    *out = PyUnicode_DecodeUTF8(text.b ? text.b : "", (Py_ssize_t)text.n, NULL);
    PyMem_Free(text.b);
    return *out ? OK : ERROR;
}

static int convert_resource(Conv *c, Rd rd) {
    uint32_t field, wire;
    int done;
    Rd resource = {NULL, NULL};
    Slice ignored;
    int seen_resource = 0;
    /* the resource first: scope_metrics may come before it on the wire */
    Rd scan = rd;
    for (;;) {
        CHECK(rd_tag(&scan, &field, &wire, &done));
        if (done) break;
        if (field == 1 && wire == 2 && !seen_resource) {
            CHECK(rd_len(&scan, &resource));
            seen_resource = 1;
        } else if (field == 2 && wire == 2) {
            Rd skipped; /* scope_metrics: read below */
            CHECK(rd_len(&scan, &skipped));
        } else if (field == 3 && wire == 2) {
            CHECK(rd_string(&scan, &ignored)); /* schema_url */
        } else {
            return DECLINE;
        }
    }
    c->rattrs.n = 0;
    if (seen_resource) {
        uint64_t v;
        for (;;) {
            CHECK(rd_tag(&resource, &field, &wire, &done));
            if (done) break;
            if (field == 1 && wire == 2) {
                Rd sub;
                CHECK(rd_len(&resource, &sub));
                CHECK(parse_keyvalue(sub, &c->rattrs));
            } else if (field == 2 && wire == 0) {
                CHECK(rd_varint(&resource, &v));
            } else {
                return DECLINE;
            }
        }
    }
    ResState res = {PyList_GET_SIZE(c->jobs), -1, resource_valid(&c->rattrs) == OK, 0};
    CHECK(grow((void **)&c->rpieces, &c->capr, c->rattrs.n + 1, sizeof(Piece)));
    c->rtext.n = 0;
    CHECK(tag_pieces(&c->rattrs, &c->allow, 1, &c->rtext, c->rpieces, &c->nrpieces, &res.dropped,
                     0));
    PyObject *job, *rank;
    CHECK(tag_object(&c->rattrs, &c->allow, JOB_ID, &job));
    int status = PyList_Append(c->jobs, job);
    Py_DECREF(job);
    if (status < 0) return ERROR;
    CHECK(tag_object(&c->rattrs, &c->allow, RANK, &rank));
    status = PyList_Append(c->ranks, rank);
    Py_DECREF(rank);
    if (status < 0) return ERROR;
    /* the scope_metrics */
    for (;;) {
        CHECK(rd_tag(&rd, &field, &wire, &done));
        if (done) return OK;
        Rd scope;
        CHECK(rd_len(&rd, &scope));
        if (field != 2) continue;
        for (;;) {
            CHECK(rd_tag(&scope, &field, &wire, &done));
            if (done) break;
            if (wire != 2) return DECLINE;
            Rd sub;
            CHECK(rd_len(&scope, &sub));
            if (field == 1) { /* InstrumentationScope: name, version, attributes, dropped */
                Attrs scope_attrs = {0};
                for (;;) {
                    int s = rd_tag(&sub, &field, &wire, &done);
                    if (s == OK && done) break;
                    if (s == OK) {
                        if ((field == 1 || field == 2) && wire == 2) {
                            s = rd_string(&sub, &ignored);
                        } else if (field == 3 && wire == 2) {
                            Rd kv;
                            s = rd_len(&sub, &kv);
                            if (s == OK) s = parse_keyvalue(kv, &scope_attrs);
                        } else if (field == 4 && wire == 0) {
                            uint64_t v;
                            s = rd_varint(&sub, &v);
                        } else {
                            s = DECLINE;
                        }
                    }
                    if (s != OK) {
                        PyMem_Free(scope_attrs.items);
                        return s;
                    }
                }
                PyMem_Free(scope_attrs.items);
            } else if (field == 2) {
                Metric m;
                CHECK(scan_metric(sub, &m));
                if (m.points == 0) continue;
                c->dropped += res.dropped * m.points;
                if (m.name.n == 0 || slice_ends(m.name, '\\')) return DECLINE;
                if (m.kind != K_GAUGE && m.kind != K_SUM && m.kind != K_EXPONENTIAL)
                    return DECLINE;
                if ((m.kind == K_EXPONENTIAL || m.monotonic) && m.temporality == 2)
                    return DECLINE; /* cumulative: the Python path keeps the state */
                int owner = -1;
                if (m.name.n >= 10 && memcmp(m.name.p, PREFIX, 10) == 0) {
                    if (!res.valid) return DECLINE;
                    if (c->resource_check != Py_None) {
                        if (res.check < 0) {
                            CHECK(grow((void **)&c->checks, &c->capchecks, c->nchecks + 1,
                                       sizeof(Check)));
                            Check *check = &c->checks[c->nchecks];
                            check->points = check->dropped = 0;
                            CHECK(scalar_attributes(&c->rattrs, &check->attributes));
                            res.check = (int)c->nchecks++;
                        }
                        owner = res.check;
                        c->checks[owner].points += m.points;
                    }
                }
                CHECK(convert_metric(c, &res, &m, owner));
            } else if (field != 3) {
                return DECLINE;
            } else if (!utf8_valid(sub.p, sub.end)) {
                return DECLINE;
            }
        }
    }
}

static int convert_request(Conv *c, Rd rd) {
    uint32_t field, wire;
    int done;
    for (;;) {
        CHECK(rd_tag(&rd, &field, &wire, &done));
        if (done) return OK;
        if (field != 1 || wire != 2) return DECLINE;
        Rd sub;
        CHECK(rd_len(&rd, &sub));
        CHECK(convert_resource(c, sub));
    }
}

/* Whether n bytes are all ASCII, eight at a time. */
static int is_ascii(const char *p, size_t n) {
    uint64_t any = 0, word;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        memcpy(&word, p + i, 8);
        any |= word;
    }
    for (; i < n; i++) any |= (unsigned char)p[i];
    return !(any & 0x8080808080808080ULL);
}

/* A str of a line: copied as is when ASCII (the common case), else decoded. */
static PyObject *line_text(const char *p, size_t n, int ascii) {
    if (!ascii) return PyUnicode_DecodeUTF8(p, (Py_ssize_t)n, NULL);
    PyObject *text = PyUnicode_New((Py_ssize_t)n, 127);
    if (text) memcpy(PyUnicode_1BYTE_DATA(text), p, n);
    return text;
}

/* hash() of the str of a line's series key (UTF-8, already validated): the key the Python
 * path's guard takes (CardinalityGuard.filter: hash(key)), so the two paths share one table
 * of series. The str is made and hashed through the public API: the interpreter's own hash of
 * a str, whatever it is on this version (3.13's headers no longer declare _Py_HashBytes, which
 * an implicit declaration truncated to 32 bits). */
static Py_hash_t series_hash(const char *p, size_t n, int ascii) {
    PyObject *text = line_text(p, n, ascii);
    if (!text) return -1;
    Py_hash_t h = PyObject_Hash(text);
    Py_DECREF(text);
    return h;
}

static int load_allowlist(PyObject *allowlist, Allow *allow) {
    PyObject *items = PySequence_Fast(allowlist, "allowlist: an iterable of str");
    if (!items) return ERROR;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(items);
    allow->keys = PyMem_Calloc((size_t)n + 1, sizeof(Slice));
    if (!allow->keys) {
        Py_DECREF(items);
        PyErr_NoMemory();
        return ERROR;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(items, i);
        if (!PyUnicode_Check(item)) continue;
        Py_ssize_t size;
        const char *text = PyUnicode_AsUTF8AndSize(item, &size);
        if (!text) { /* lone surrogates: matches no key read from the wire */
            PyErr_Clear();
            continue;
        }
        allow->keys[allow->n].p = text; /* kept alive by the allowlist */
        allow->keys[allow->n++].n = size;
    }
    Py_DECREF(items);
    return OK;
}

static void conv_free(Conv *c) {
    for (Py_ssize_t i = 0; i < c->nchecks; i++) Py_XDECREF(c->checks[i].attributes);
    PyMem_Free(c->allow.keys);
    PyMem_Free(c->out.b);
    PyMem_Free(c->lines);
    PyMem_Free(c->checks);
    PyMem_Free(c->descs);
    Py_XDECREF(c->jobs);
    Py_XDECREF(c->ranks);
    PyMem_Free(c->rattrs.items);
    PyMem_Free(c->pattrs.items);
    PyMem_Free(c->rtext.b);
    PyMem_Free(c->ptext.b);
    PyMem_Free(c->scratch.b);
    PyMem_Free(c->rpieces);
    PyMem_Free(c->ppieces);
}

/* The resource checks (in request order, as the Python path calls them), then the result. */
static PyObject *finish(Conv *c) {
    PyObject *rejected = PyDict_New(), *reasons = PyList_New(c->nchecks);
    PyObject *lines = NULL, *hashes = NULL, *descs = NULL, *index = NULL, *result = NULL;
    if (!rejected || !reasons) goto fail;
    for (Py_ssize_t i = 0; i < c->nchecks; i++) {
        PyObject *reason = PyObject_CallOneArg(c->resource_check, c->checks[i].attributes);
        if (!reason) goto fail;
        PyList_SET_ITEM(reasons, i, reason);
        if (reason == Py_None) continue;
        PyObject *count = PyDict_GetItemWithError(rejected, reason);
        if (!count && PyErr_Occurred()) goto fail;
        long long before = count ? PyLong_AsLongLong(count) : 0;
        PyObject *after = PyLong_FromLongLong(before + c->checks[i].points);
        if (!after || PyDict_SetItem(rejected, reason, after) < 0) {
            Py_XDECREF(after);
            goto fail;
        }
        Py_DECREF(after);
        c->dropped -= c->checks[i].dropped;
    }
    Py_ssize_t kept = 0;
    for (Py_ssize_t i = 0; i < c->nlines; i++)
        if (c->lines[i].owner < 0 || PyList_GET_ITEM(reasons, c->lines[i].owner) == Py_None)
            c->lines[kept++] = c->lines[i];
    lines = PyList_New(kept);
    hashes = PyBytes_FromStringAndSize(NULL, kept * (Py_ssize_t)sizeof(int64_t));
    index = PyBytes_FromStringAndSize(NULL, kept * (Py_ssize_t)sizeof(int32_t));
    descs = PyList_New(c->ndescs);
    if (!lines || !hashes || !index || !descs) goto fail;
    int64_t *hash_out = (int64_t *)PyBytes_AS_STRING(hashes);
    int32_t *index_out = (int32_t *)PyBytes_AS_STRING(index);
    for (Py_ssize_t i = 0; i < kept; i++) {
        const Line *line = &c->lines[i];
        const char *p = c->out.b + line->off;
        int ascii = is_ascii(p, line->len); /* the series key is the line's start */
        PyObject *text = line_text(p, line->len, ascii);
        if (!text) goto fail;
        PyList_SET_ITEM(lines, i, text);
        Py_hash_t h = series_hash(p, line->series_len, ascii);
        if (h == -1 && PyErr_Occurred()) goto fail;
        hash_out[i] = (int64_t)h;
        index_out[i] = (int32_t)line->desc;
    }
    for (Py_ssize_t i = 0; i < c->ndescs; i++) {
        const Desc *desc = &c->descs[i];
        PyObject *name = PyUnicode_DecodeUTF8(desc->name.p, desc->name.n, NULL);
        if (!name) goto fail;
        PyObject *item = PyTuple_Pack(3, PyList_GET_ITEM(c->jobs, desc->resource), name,
                                      PyList_GET_ITEM(c->ranks, desc->resource));
        Py_DECREF(name);
        if (!item) goto fail;
        PyList_SET_ITEM(descs, i, item);
    }
    result = Py_BuildValue("(OOOOOL)", lines, hashes, index, descs, rejected,
                           (long long)c->dropped);
fail:
    Py_XDECREF(rejected);
    Py_XDECREF(reasons);
    Py_XDECREF(lines);
    Py_XDECREF(hashes);
    Py_XDECREF(index);
    Py_XDECREF(descs);
    return result;
}

PyDoc_STRVAR(convert_doc,
             "convert(body, allowlist, max_duration_s, earliest, latest, resource_check)\n"
             "--\n\n"
             "Convert an ExportMetricsServiceRequest body (compact layout) to line protocol.\n\n"
             "max_duration_s: a float or None; earliest, latest: the accepted time_unix_nano\n"
             "(ints clipped to [-1, 2**63 - 1]) or None; resource_check: a callable or None.\n"
             "Returns None when the request is not handled here (the Python path converts\n"
             "it), else (lines, hashes, descs_index, descs, rejected, dropped_attributes):\n"
             "hashes is hash() of each line's series key (int64 each), descs_index the index\n"
             "(int32 each) of its (job, measurement, rank) in descs.");

static PyObject *fast_convert(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "convert() takes 6 arguments");
        return NULL;
    }
    Py_buffer body;
    if (PyObject_GetBuffer(args[0], &body, PyBUF_SIMPLE) < 0) return NULL;
    Conv c;
    memset(&c, 0, sizeof c);
    PyObject *result = NULL;
    int status = load_allowlist(args[1], &c.allow);
    if (status == OK && args[2] != Py_None) {
        c.has_max_duration = 1;
        c.max_duration_s = PyFloat_AsDouble(args[2]);
        if (c.max_duration_s == -1.0 && PyErr_Occurred()) status = ERROR;
    }
    if (status == OK && (args[3] != Py_None) != (args[4] != Py_None)) {
        PyErr_SetString(PyExc_TypeError, "earliest and latest: both None or both ints");
        status = ERROR;
    }
    if (status == OK && args[3] != Py_None) {
        c.has_bounds = 1;
        c.earliest = PyLong_AsLongLong(args[3]);
        c.latest = PyLong_AsLongLong(args[4]);
        if (PyErr_Occurred()) status = ERROR;
    }
    c.resource_check = args[5];
    c.jobs = PyList_New(0);
    c.ranks = PyList_New(0);
    if (!c.jobs || !c.ranks) status = ERROR;
    if (status == OK) {
        Rd rd = {(const uint8_t *)body.buf, (const uint8_t *)body.buf + body.len};
        status = convert_request(&c, rd);
    }
    if (status == OK) {
        result = finish(&c);
    } else if (status == DECLINE) {
        result = Py_NewRef(Py_None);
    }
    conv_free(&c);
    PyBuffer_Release(&body);
    return result;
}

PyDoc_STRVAR(unknown_doc,
             "unknown(series, hashes)\n--\n\n"
             "Indexes of the hashes (int64 each) that are not keys of the dict series.");

static PyObject *fast_unknown(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2 || !PyDict_Check(args[0]) || !PyBytes_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "unknown(series: dict, hashes: bytes)");
        return NULL;
    }
    PyObject *series = args[0];
    const int64_t *hashes = (const int64_t *)PyBytes_AS_STRING(args[1]);
    Py_ssize_t n = PyBytes_GET_SIZE(args[1]) / (Py_ssize_t)sizeof(int64_t);
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyLong_FromLongLong(hashes[i]);
        if (!key) goto fail;
        int found = PyDict_Contains(series, key);
        Py_DECREF(key);
        if (found < 0) goto fail;
        if (found) continue;
        PyObject *index = PyLong_FromSsize_t(i);
        if (!index) goto fail;
        int status = PyList_Append(out, index);
        Py_DECREF(index);
        if (status < 0) goto fail;
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

PyDoc_STRVAR(touch_doc,
             "touch(series, hashes, now, stale_before)\n--\n\n"
             "For each hash (int64 each) that is a key of the OrderedDict series, in order, whose\n"
             "entry.last_seen_s < stale_before: entry.last_seen_s = now and\n"
             "series.move_to_end(key). Entries refreshed since stale_before stay as they are\n"
             "(CardinalityGuard's refresh granularity).");

static PyObject *fast_touch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 4 || !PyDict_Check(args[0]) || !PyBytes_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError,
                        "touch(series: OrderedDict, hashes: bytes, now, stale_before)");
        return NULL;
    }
    PyObject *series = args[0], *now = args[2];
    double stale_before = PyFloat_AsDouble(args[3]);
    if (stale_before == -1.0 && PyErr_Occurred()) return NULL;
    const int64_t *hashes = (const int64_t *)PyBytes_AS_STRING(args[1]);
    Py_ssize_t n = PyBytes_GET_SIZE(args[1]) / (Py_ssize_t)sizeof(int64_t);
    PyObject *move = PyObject_GetAttrString(series, "move_to_end");
    PyObject *attr = PyUnicode_InternFromString("last_seen_s");
    if (!move || !attr) goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyLong_FromLongLong(hashes[i]);
        if (!key) goto fail;
        PyObject *entry = PyDict_GetItemWithError(series, key);
        if (!entry) {
            Py_DECREF(key);
            if (PyErr_Occurred()) goto fail;
            continue;
        }
        Py_INCREF(entry);
        PyObject *seen = PyObject_GetAttr(entry, attr);
        double last = seen ? PyFloat_AsDouble(seen) : -1.0;
        Py_XDECREF(seen);
        if (!seen || (last == -1.0 && PyErr_Occurred())) {
            Py_DECREF(entry);
            Py_DECREF(key);
            goto fail;
        }
        if (!(last < stale_before)) { /* refreshed recently: its place is close enough */
            Py_DECREF(entry);
            Py_DECREF(key);
            continue;
        }
        int status = PyObject_SetAttr(entry, attr, now);
        Py_DECREF(entry);
        PyObject *moved = status < 0 ? NULL : PyObject_CallOneArg(move, key);
        Py_DECREF(key);
        if (!moved) goto fail;
        Py_DECREF(moved);
    }
    Py_DECREF(move);
    Py_DECREF(attr);
    Py_RETURN_NONE;
fail:
    Py_XDECREF(move);
    Py_XDECREF(attr);
    return NULL;
}

PyDoc_STRVAR(format_float_doc,
             "format_float(x, /)\n--\n\nThe converter's text of a float: repr(x), by the C "
             "routine the converter uses (for the tests).");

static PyObject *fast_format_float(PyObject *self, PyObject *arg) {
    (void)self;
    double v = PyFloat_AsDouble(arg);
    if (v == -1.0 && PyErr_Occurred()) return NULL;
    Buf buf = {NULL, 0, 0};
    if (buf_double(&buf, v) != OK) {
        PyMem_Free(buf.b);
        return NULL;
    }
    PyObject *text = PyUnicode_FromStringAndSize(buf.b, (Py_ssize_t)buf.n);
    PyMem_Free(buf.b);
    return text;
}

static PyMethodDef methods[] = {
    {"format_float", fast_format_float, METH_O, format_float_doc},
    {"convert", (PyCFunction)(void (*)(void))fast_convert, METH_FASTCALL, convert_doc},
    {"unknown", (PyCFunction)(void (*)(void))fast_unknown, METH_FASTCALL, unknown_doc},
    {"touch", (PyCFunction)(void (*)(void))fast_touch, METH_FASTCALL, touch_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    "stepwatch.otel_bridge._fastpath",
    "OTLP metrics (protobuf wire format) to line protocol, the bridge's common path in C.",
    -1,
    methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC PyInit__fastpath(void) {
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    PyObject *constants = Py_BuildValue(
        "{s:s,s:s,s:s,s:s,s:s,s:(sss),s:K,s:i,s:i}", "JOB_ID", JOB_ID, "RANK", RANK,
        "WORLD_SIZE", WORLD_SIZE, "PREFIX", PREFIX, "STEP_DURATION", STEP_DURATION,
        "IDENTITY_KEYS", IDENTITY_KEYS[0], IDENTITY_KEYS[1], IDENTITY_KEYS[2],
        "MAX_TIME_UNIX_NANO", (unsigned long long)MAX_TIME_UNIX_NANO, "MAX_BUCKETS", MAX_BUCKETS,
        "DERIVED_BITS", DERIVED_BITS);
    if (!constants || PyModule_AddObject(m, "CONSTANTS", constants) < 0) {
        Py_XDECREF(constants);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
