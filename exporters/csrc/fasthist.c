/* stepwatch.exporters._fasthist: ExponentialHistogram.record_many / record_weighted in C, and
 * exponential_point: one OTLP ExponentialHistogramDataPoint written as _otlp_protobuf writes it
 * (the same bytes; None, for the Python code to handle, on anything unusual).
 *
 * The export thread records every step, phase and kernel duration of a window into base-2
 * exponential histograms (_histogram.py). These two functions run the loops of
 * ExponentialHistogram.record_many and .record_weighted over a list or tuple of floats and
 * leave the histogram in exactly the state the Python loops leave it in: the same count,
 * zero count, bucket counts (same dict, same keys in the same insertion order), occupied range
 * and scale, and bit-for-bit the same sum, min and max. The arithmetic is the Python code's,
 * in the same order, on the same doubles: sum by sequential double addition (value * weight
 * rounded first), log() and floor() of the C library (what math.log and math.floor call), the
 * same boundary margin and, near a bucket boundary, map_to_index's exact decision (frexp,
 * pow(2, f) and ldexp, as lower_boundary computes it). Built with -ffp-contract=off, so no
 * fused multiply-add changes a rounding.
 *
 * Growing the occupied range without downscaling is done here (what _widen does then); a
 * value that needs a downscale calls the histogram's own _widen. Counts are accumulated per
 * bucket in a small array and written to the dict (in first-touch order) before _widen runs
 * and at the end. The fields are read and written in the instance dict
 * (PyObject_GenericGetDict: ExponentialHistogram has no slots or properties for them).
 *
 * What the C does not take, it leaves to the Python loop: each function returns
 * (refused, done), and values[done:] (weights[done:]) still have to be recorded by the Python
 * code. done stops at the first value that is not an exact float, the first weight that is not
 * an exact int (record_weighted reads all weights first and does nothing unless they all
 * are), a weight above 2**40, and done is 0 with nothing recorded when the histogram's state
 * is not the plain one (a min, max or sum that is not a float after an int was recorded, a
 * max_size above 65536). So the only exception raised is MemoryError, as in the Python loop.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MIN_SCALE (-10)
#define MAX_SCALE 20
#define MAX_SIZE_LIMIT 65536 /* a larger max_size: the Python loop */
#define STACK_SLOTS 511      /* pending counts on the stack up to max_size 256 */
#define INDEX_LIMIT (1LL << 40) /* |low|, |high| (a float's index is below 2**31 in size) */
#define MAX_WEIGHT (1LL << 40)  /* exact as a double; larger weights: the Python loop */
#define MAX_TOTAL_WEIGHT (1LL << 62)

#define UNSUPPORTED 0
#define SUPPORTED 1
#define FAILED (-1)

static double scale_factors[MAX_SCALE + 1]; /* _SCALE_FACTORS: ldexp(1 / log(2), scale) */
static double boundary_margin;              /* _BOUNDARY_MARGIN */
static double upper_margin;                 /* _UPPER_MARGIN = 1 - _BOUNDARY_MARGIN */

static PyObject *s_count, *s_sum, *s_min, *s_max, *s_zero_count, *s_counts, *s_scale, *s_low,
    *s_high, *s_max_size, *s_widen, *s_get;

/* ---- map_to_index, as _histogram.py computes it -------------------------------------------- */

/* Python's ``a >> k`` on a negative int: floor division by 2**k. */
static long long floor_shift(long long a, int k) {
    if (a >= 0) return a >> k;
    return -((-a - 1) >> k) - 1;
}

static long long floor_div(long long a, long long b) { /* b > 0 */
    long long q = a / b;
    if (a % b != 0 && a < 0) q -= 1;
    return q;
}

/* lower_boundary(index, scale) for scale > 0: ldexp(2.0 ** (fraction / 2**scale), whole). */
static double lower_boundary(long long index, int scale) {
    long long per = 1LL << scale;
    long long whole = floor_div(index, per);
    long long fraction = index - whole * per;
    double root = fraction == 0 ? 1.0 : pow(2.0, (double)fraction / (double)per);
    if (whole > INT_MAX) return HUGE_VAL;
    if (whole < INT_MIN) return 0.0;
    return ldexp(root, (int)whole); /* inf past the float range, as the Python returns */
}

/* map_to_index(value, scale) for a positive normal value. */
static long long map_to_index(double value, int scale) {
    int exponent;
    double mantissa = frexp(value, &exponent);
    long long ieee_exponent = (long long)exponent - 1;
    if (scale <= 0) {
        long long exact = mantissa == 0.5 ? 1 : 0;
        return floor_shift(ieee_exponent - exact, -scale);
    }
    if (mantissa == 0.5) return ieee_exponent * (1LL << scale) - 1;
    double position = log(value) * scale_factors[scale];
    double whole = floor(position);
    long long index = (long long)whole;
    double fraction = position - whole;
    if (boundary_margin < fraction && fraction < upper_margin) return index;
    if (value <= lower_boundary(index, scale))
        index -= 1;
    else if (value > lower_boundary(index + 1, scale))
        index += 1;
    return index;
}

/* ---- the histogram's state --------------------------------------------------------------- */

typedef struct {
    PyObject *self;
    PyObject *attrs;  /* strong: self.__dict__, where its fields live (no slots, no properties) */
    PyObject *counts; /* strong: self._counts */
    int scale;
    double factor;                  /* _SCALE_FACTORS[scale], 0.0 at scale <= 0 */
    long long low, high;            /* the occupied range, as the loop has it */
    long long self_low, self_high;  /* what self._low, self._high hold */
    long long max_size;
    PyObject *count0, *zero0;       /* strong: self._count, self._zero_count at the start */
    long long dcount, dzero;        /* added to them */
    double total, smallest, largest, min0, max0;
    /* Counts not yet in the dict: delta[index - base], slots in first-touch order. */
    long long *delta;
    Py_ssize_t *touched;
    Py_ssize_t ntouched, width;
    long long base;
    int have_base;
} State;

/* self.<name> from the instance dict: a new reference, or NULL (FAILED with an exception
 * set, else not there: UNSUPPORTED; the Python loop then raises the AttributeError). */
static PyObject *get_attr(PyObject *attrs, PyObject *name) {
    PyObject *obj = PyDict_GetItemWithError(attrs, name);
    Py_XINCREF(obj);
    return obj;
}

#define MISSING (PyErr_Occurred() ? FAILED : UNSUPPORTED)

static int read_ll(PyObject *attrs, PyObject *name, long long limit, long long *out) {
    PyObject *obj = get_attr(attrs, name);
    if (!obj) return MISSING;
    int status = UNSUPPORTED;
    if (PyLong_CheckExact(obj)) {
        int overflow;
        long long value = PyLong_AsLongLongAndOverflow(obj, &overflow);
        if (value == -1 && PyErr_Occurred()) {
            status = FAILED;
        } else if (!overflow && value >= -limit && value <= limit) {
            *out = value;
            status = SUPPORTED;
        }
    }
    Py_DECREF(obj);
    return status;
}

/* The fields that change under _widen: counts, scale, low, high (st unchanged but for
 * counts unless all four are as the C reads them). */
static int load_range(State *st) {
    Py_CLEAR(st->counts);
    PyObject *counts = get_attr(st->attrs, s_counts);
    if (!counts) return MISSING;
    if (!PyDict_CheckExact(counts)) {
        Py_DECREF(counts);
        return UNSUPPORTED;
    }
    st->counts = counts;
    long long scale, low, high;
    int status = read_ll(st->attrs, s_scale, MAX_SCALE, &scale);
    if (status == SUPPORTED && scale < MIN_SCALE) status = UNSUPPORTED;
    if (status == SUPPORTED) status = read_ll(st->attrs, s_low, INDEX_LIMIT, &low);
    if (status == SUPPORTED) status = read_ll(st->attrs, s_high, INDEX_LIMIT, &high);
    if (status != SUPPORTED) return status;
    st->scale = (int)scale;
    st->factor = scale > 0 ? scale_factors[scale] : 0.0;
    st->low = st->self_low = low;
    st->high = st->self_high = high;
    return SUPPORTED;
}

static int read_float(PyObject *attrs, PyObject *name, double *out) {
    PyObject *obj = get_attr(attrs, name);
    if (!obj) return MISSING;
    int status = UNSUPPORTED;
    if (PyFloat_CheckExact(obj)) {
        *out = PyFloat_AS_DOUBLE(obj);
        status = SUPPORTED;
    }
    Py_DECREF(obj);
    return status;
}

static int read_int(PyObject *attrs, PyObject *name, PyObject **out) {
    PyObject *obj = get_attr(attrs, name);
    if (!obj) return MISSING;
    if (!PyLong_CheckExact(obj)) {
        Py_DECREF(obj);
        return UNSUPPORTED;
    }
    *out = obj;
    return SUPPORTED;
}

/* Everything record_many reads; SUPPORTED when it is the plain state the C handles. */
static int load(State *st) {
    int status;
    if ((status = load_range(st)) != SUPPORTED) return status;
    if ((status = read_ll(st->attrs, s_max_size, MAX_SIZE_LIMIT, &st->max_size)) != SUPPORTED)
        return status;
    if (st->max_size < 2) return UNSUPPORTED;
    if ((status = read_int(st->attrs, s_count, &st->count0)) != SUPPORTED) return status;
    if ((status = read_int(st->attrs, s_zero_count, &st->zero0)) != SUPPORTED) return status;
    if ((status = read_float(st->attrs, s_sum, &st->total)) != SUPPORTED) return status;
    if ((status = read_float(st->attrs, s_min, &st->min0)) != SUPPORTED) return status;
    if ((status = read_float(st->attrs, s_max, &st->max0)) != SUPPORTED) return status;
    st->smallest = st->min0;
    st->largest = st->max0;
    st->width = 2 * st->max_size - 1;
    return SUPPORTED;
}

/* counts[index] = counts.get(index, 0) + delta, on the dict (an int value in the common case). */
static int dict_add(PyObject *counts, long long index, long long delta) {
    PyObject *key = PyLong_FromLongLong(index);
    if (!key) return -1;
    PyObject *old = PyDict_GetItemWithError(counts, key); /* borrowed */
    PyObject *value = NULL;
    if (!old) {
        if (!PyErr_Occurred()) value = PyLong_FromLongLong(delta);
    } else {
        int overflow = 1;
        long long current = 0;
        if (PyLong_CheckExact(old)) current = PyLong_AsLongLongAndOverflow(old, &overflow);
        if (!overflow && current <= LLONG_MAX - delta) {
            value = PyLong_FromLongLong(current + delta);
        } else {
            PyErr_Clear(); /* AsLongLong's errors: none for an exact int */
            PyObject *add = PyLong_FromLongLong(delta);
            if (add) {
                value = PyNumber_Add(old, add);
                Py_DECREF(add);
            }
        }
    }
    int status = value ? PyDict_SetItem(counts, key, value) : -1;
    Py_XDECREF(value);
    Py_DECREF(key);
    return status;
}

/* The pending counts into the dict, new keys in the order the loop first met them. */
static int flush(State *st) {
    int status = 0;
    for (Py_ssize_t k = 0; k < st->ntouched; k++) {
        Py_ssize_t slot = st->touched[k];
        long long delta = st->delta[slot];
        st->delta[slot] = 0;
        if (status == 0 && dict_add(st->counts, st->base + slot, delta) < 0) status = -1;
    }
    st->ntouched = 0;
    st->have_base = 0;
    return status;
}

/* counts[index] += weight (pending). Every index between two flushes lies in one occupied
 * range, less than max_size wide, so 2 * max_size - 1 slots around the first one hold them. */
static int add(State *st, long long index, long long weight) {
    long long slot;
    if (!st->have_base) {
        st->base = index - (st->max_size - 1);
        st->have_base = 1;
    }
    slot = index - st->base;
    if (slot < 0 || slot >= st->width) { /* not reached: the range bound above */
        if (flush(st) < 0) return -1;
        st->base = index - (st->max_size - 1);
        st->have_base = 1;
        slot = st->max_size - 1;
    }
    if (st->delta[slot] == 0) st->touched[st->ntouched++] = (Py_ssize_t)slot;
    st->delta[slot] += weight;
    return 0;
}

static int set_ll(PyObject *attrs, PyObject *name, long long value) {
    PyObject *obj = PyLong_FromLongLong(value);
    if (!obj) return -1;
    int status = PyDict_SetItem(attrs, name, obj);
    Py_DECREF(obj);
    return status;
}

static int set_double(PyObject *attrs, PyObject *name, double value) {
    PyObject *obj = PyFloat_FromDouble(value);
    if (!obj) return -1;
    int status = PyDict_SetItem(attrs, name, obj);
    Py_DECREF(obj);
    return status;
}

static int set_sum(PyObject *attrs, PyObject *name, PyObject *start, long long delta) {
    PyObject *add_obj = PyLong_FromLongLong(delta);
    if (!add_obj) return -1;
    PyObject *obj = PyNumber_Add(start, add_obj);
    Py_DECREF(add_obj);
    if (!obj) return -1;
    int status = PyDict_SetItem(attrs, name, obj);
    Py_DECREF(obj);
    return status;
}

static int store_range(State *st) {
    if (st->low != st->self_low) {
        if (set_ll(st->attrs, s_low, st->low) < 0) return -1;
        st->self_low = st->low;
    }
    if (st->high != st->self_high) {
        if (set_ll(st->attrs, s_high, st->high) < 0) return -1;
        st->self_high = st->high;
    }
    return 0;
}

/* The running state back into the histogram: what record_many's ``finally`` does. Keeps an
 * exception already set (failed): the state is still written, as the Python loop's is. */
static int store(State *st, int failed) {
    PyObject *type = NULL, *value = NULL, *traceback = NULL;
    if (failed) PyErr_Fetch(&type, &value, &traceback);
    int status = 0;
    if (st->counts && flush(st) < 0) status = -1;
    if (status == 0) status = store_range(st);
    if (status == 0 && st->dcount) status = set_sum(st->attrs, s_count, st->count0, st->dcount);
    if (status == 0 && st->dcount) status = set_double(st->attrs, s_sum, st->total);
    if (status == 0 && memcmp(&st->smallest, &st->min0, sizeof(double)) != 0)
        status = set_double(st->attrs, s_min, st->smallest);
    if (status == 0 && memcmp(&st->largest, &st->max0, sizeof(double)) != 0)
        status = set_double(st->attrs, s_max, st->largest);
    if (status == 0 && st->dzero) status = set_sum(st->attrs, s_zero_count, st->zero0, st->dzero);
    if (failed) {
        if (status < 0) PyErr_Clear();
        PyErr_Restore(type, value, traceback);
        return -1;
    }
    return status;
}

/* An index outside [low, high]: _widen's work. Returns SUPPORTED (recorded, go on),
 * UNSUPPORTED (recorded; the state after _widen is not one the C reads: stop after this value)
 * or FAILED. */
static int widen_add(State *st, long long index, long long weight) {
    if (PyDict_GET_SIZE(st->counts) == 0 && st->ntouched == 0) {
        st->low = st->high = index;
        return add(st, index, weight) < 0 ? FAILED : SUPPORTED;
    }
    long long low = index < st->low ? index : st->low;
    long long high = index > st->high ? index : st->high;
    if (high - low + 1 <= st->max_size) { /* _downscale_needed would return 0 */
        st->low = low;
        st->high = high;
        return add(st, index, weight) < 0 ? FAILED : SUPPORTED;
    }
    /* A downscale: the histogram's own _widen, on its up-to-date state. */
    if (flush(st) < 0 || store_range(st) < 0) return FAILED;
    PyObject *index_obj = PyLong_FromLongLong(index);
    if (!index_obj) return FAILED;
    PyObject *widened = PyObject_CallMethodOneArg(st->self, s_widen, index_obj);
    Py_DECREF(index_obj);
    if (!widened) return FAILED;
    int status = load_range(st);
    long long new_index = 0;
    if (status == SUPPORTED && PyLong_CheckExact(widened)) {
        int overflow;
        new_index = PyLong_AsLongLongAndOverflow(widened, &overflow);
        if (overflow || new_index < -INDEX_LIMIT || new_index > INDEX_LIMIT) status = UNSUPPORTED;
    } else if (status == SUPPORTED) {
        status = UNSUPPORTED;
    }
    if (status == SUPPORTED) {
        Py_DECREF(widened);
        return add(st, new_index, weight) < 0 ? FAILED : SUPPORTED;
    }
    if (status == UNSUPPORTED) { /* self._counts[index] = self._counts.get(index, 0) + weight */
        PyObject *counts = PyObject_GetAttr(st->self, s_counts); /* as _widen left it */
        PyObject *old = NULL, *sum = NULL, *weight_obj = PyLong_FromLongLong(weight);
        PyObject *zero = PyLong_FromLong(0);
        if (counts && weight_obj && zero)
            old = PyObject_CallMethodObjArgs(counts, s_get, widened, zero, NULL);
        if (old) sum = PyNumber_Add(old, weight_obj);
        if (!sum || PyObject_SetItem(counts, widened, sum) < 0) status = FAILED;
        Py_XDECREF(counts);
        Py_XDECREF(old);
        Py_XDECREF(sum);
        Py_XDECREF(weight_obj);
        Py_XDECREF(zero);
    }
    Py_DECREF(widened);
    return status;
}

/* ---- the loops -------------------------------------------------------------------------- */

static PyObject *result(Py_ssize_t refused, Py_ssize_t done) {
    PyObject *a = PyLong_FromSsize_t(refused), *b = PyLong_FromSsize_t(done);
    PyObject *pair = a && b ? PyTuple_Pack(2, a, b) : NULL;
    Py_XDECREF(a);
    Py_XDECREF(b);
    return pair;
}

/* Shared by both functions; weights NULL: record_many (weight 1, the inline index). */
static PyObject *run(PyObject *self, PyObject *values, PyObject *weights) {
    State st;
    memset(&st, 0, sizeof st);
    st.self = self;
    long long stack_delta[STACK_SLOTS];
    Py_ssize_t stack_touched[STACK_SLOTS];
    PyObject *out = NULL;
    Py_ssize_t refused = 0, i = 0;
    int status;
    st.attrs = PyObject_GenericGetDict(self, NULL);
    if (!st.attrs) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) goto done;
        PyErr_Clear(); /* no __dict__: not an ExponentialHistogram the C knows */
        out = result(0, 0);
        goto done;
    }
    status = load(&st);
    if (status == FAILED) goto done;
    if (status == UNSUPPORTED) {
        out = result(0, 0);
        goto done;
    }
    if (st.width <= STACK_SLOTS) {
        st.delta = stack_delta;
        st.touched = stack_touched;
        memset(stack_delta, 0, (size_t)st.width * sizeof(long long));
    } else {
        st.delta = PyMem_Calloc((size_t)st.width, sizeof(long long));
        st.touched = PyMem_Malloc((size_t)st.width * sizeof(Py_ssize_t));
        if (!st.delta || !st.touched) {
            PyErr_NoMemory();
            goto done;
        }
    }
    for (;; i++) {
        Py_ssize_t size = PySequence_Fast_GET_SIZE(values); /* re-read: _widen runs Python */
        if (weights && PySequence_Fast_GET_SIZE(weights) < size)
            size = PySequence_Fast_GET_SIZE(weights);
        if (i >= size) break;
        long long weight = 1;
        if (weights) {
            PyObject *w = PySequence_Fast_GET_ITEM(weights, i);
            if (!PyLong_CheckExact(w)) break;
            int overflow;
            weight = PyLong_AsLongLongAndOverflow(w, &overflow);
            if (overflow > 0 || weight > MAX_WEIGHT) break;
            if (overflow < 0 || weight <= 0) continue; /* ``if weight <= 0: continue`` */
        }
        PyObject *item = PySequence_Fast_GET_ITEM(values, i);
        if (!PyFloat_CheckExact(item)) break;
        double value = PyFloat_AS_DOUBLE(item);
        if (!(value >= 0.0 && value != HUGE_VAL)) { /* also NaN */
            refused++;
            continue;
        }
        if (st.dcount > MAX_TOTAL_WEIGHT - weight) break;
        st.dcount += weight;
        if (weights)
            st.total += value * (double)weight;
        else
            st.total += value;
        if (value < st.smallest) st.smallest = value;
        if (value > st.largest) st.largest = value;
        if (value < DBL_MIN) {
            st.dzero += weight;
            continue;
        }
        long long index;
        if (weights || st.factor == 0.0) {
            index = map_to_index(value, st.scale);
        } else { /* record_many's inline index */
            double position = log(value) * st.factor;
            double whole = floor(position);
            double fraction = position - whole;
            index = (long long)whole;
            if (!(boundary_margin < fraction && fraction < upper_margin))
                index = map_to_index(value, st.scale);
        }
        if (st.low <= index && index <= st.high) {
            if (add(&st, index, weight) < 0) goto failed;
            continue;
        }
        status = widen_add(&st, index, weight);
        if (status == FAILED) goto failed;
        if (status == UNSUPPORTED) {
            i++;
            break;
        }
    }
    if (store(&st, 0) == 0) out = result(refused, i);
    goto done;
failed:
    store(&st, 1);
done:
    if (st.delta && st.delta != stack_delta) PyMem_Free(st.delta);
    if (st.touched && st.touched != stack_touched) PyMem_Free(st.touched);
    Py_XDECREF(st.attrs);
    Py_XDECREF(st.counts);
    Py_XDECREF(st.count0);
    Py_XDECREF(st.zero0);
    return out;
}

static int is_sequence(PyObject *obj) { return PyList_CheckExact(obj) || PyTuple_CheckExact(obj); }

PyDoc_STRVAR(record_many_doc,
             "record_many(histogram, values, /) -> (refused, done)\n\n"
             "ExponentialHistogram.record_many's loop over values[:done] (a list or tuple); "
             "values[done:] are left to the Python loop.");

static PyObject *fast_record_many(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "record_many takes 2 arguments");
        return NULL;
    }
    if (!is_sequence(args[1])) return result(0, 0);
    return run(args[0], args[1], NULL);
}

PyDoc_STRVAR(record_weighted_doc,
             "record_weighted(histogram, values, weights, /) -> (refused, done)\n\n"
             "ExponentialHistogram.record_weighted's loop over values[:done], weights[:done] "
             "(lists or tuples of equal length, every weight an int); the rest is left to the "
             "Python loop.");

static PyObject *fast_record_weighted(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "record_weighted takes 3 arguments");
        return NULL;
    }
    PyObject *values = args[1], *weights = args[2];
    if (!is_sequence(values) || !is_sequence(weights) ||
        PySequence_Fast_GET_SIZE(values) != PySequence_Fast_GET_SIZE(weights))
        return result(0, 0);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(weights);
    for (Py_ssize_t k = 0; k < n; k++) /* the Python's all(weight == 1) needs exact ints */
        if (!PyLong_CheckExact(PySequence_Fast_GET_ITEM(weights, k))) return result(0, 0);
    return run(args[0], values, weights);
}

/* ---- one ExponentialHistogramDataPoint, as _otlp_protobuf._exponential_point writes it ------ */

static PyObject *p_exemplars, *p_start_time_unix_nano, *p_time_unix_nano, *p_count, *p_sum, *p_scale, *p_zero_count, *p_positive, *p_negative, *p_flags, *p_min, *p_max, *p_bucket_counts, *p_offset; /* point attribute names */

/* A growable byte buffer on the stack, spilling to the heap. */
typedef struct {
    unsigned char *data;
    Py_ssize_t size, capacity;
    unsigned char stack[1024];
} Buffer;

static int buffer_reserve(Buffer *b, Py_ssize_t extra) {
    if (b->size + extra <= b->capacity) return 0;
    Py_ssize_t capacity = (b->capacity + extra) * 2;
    unsigned char *grown;
    if (b->data == b->stack) {
        grown = PyMem_Malloc((size_t)capacity);
        if (grown) memcpy(grown, b->data, (size_t)b->size);
    } else {
        grown = PyMem_Realloc(b->data, (size_t)capacity);
    }
    if (!grown) {
        PyErr_NoMemory();
        return -1;
    }
    b->data = grown;
    b->capacity = capacity;
    return 0;
}

static int put_byte(Buffer *b, unsigned char byte) {
    if (buffer_reserve(b, 1)) return -1;
    b->data[b->size++] = byte;
    return 0;
}

static int put_varint(Buffer *b, uint64_t value) {
    if (buffer_reserve(b, 10)) return -1;
    while (value > 0x7F) {
        b->data[b->size++] = (unsigned char)((value & 0x7F) | 0x80);
        value >>= 7;
    }
    b->data[b->size++] = (unsigned char)value;
    return 0;
}

static int put_fixed64(Buffer *b, unsigned char tag, uint64_t value) {
    if (buffer_reserve(b, 9)) return -1;
    b->data[b->size++] = tag;
    for (int k = 0; k < 8; k++) b->data[b->size++] = (unsigned char)(value >> (8 * k));
    return 0;
}

static int put_double(Buffer *b, unsigned char tag, double value) {
    uint64_t bits;
    memcpy(&bits, &value, sizeof bits);
    return put_fixed64(b, tag, bits);
}

static int put_bytes(Buffer *b, const unsigned char *bytes, Py_ssize_t n) {
    if (buffer_reserve(b, n)) return -1;
    memcpy(b->data + b->size, bytes, (size_t)n);
    b->size += n;
    return 0;
}

/* sint32's zigzag, as the Python's (value << 1) ^ (value >> 31) on an int32. */
static uint64_t zigzag32(long long value) {
    uint32_t bits = (uint32_t)value;
    return (uint64_t)((bits << 1) ^ (value < 0 ? 0xFFFFFFFFu : 0u));
}

/* An attribute as an exact int in [low, high]: 1 with *out set, 0 when it is not one. */
static int exact_int(PyObject *obj, PyObject *name, long long low, unsigned long long high,
                     unsigned long long *out, int *negative) {
    PyObject *value = PyObject_GetAttr(obj, name);
    if (!value) return -1;
    int ok = 0;
    if (PyLong_CheckExact(value)) {
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
        if (!overflow && !(v == -1 && PyErr_Occurred()) && v >= low &&
            (v < 0 || (unsigned long long)v <= high)) {
            *out = (unsigned long long)v;
            *negative = v < 0;
            ok = 1;
        } else if (overflow > 0 && low >= 0) {
            PyErr_Clear();
            unsigned long long u = PyLong_AsUnsignedLongLong(value);
            if (!(u == (unsigned long long)-1 && PyErr_Occurred()) && u <= high) {
                *out = u;
                *negative = 0;
                ok = 1;
            }
        }
        PyErr_Clear();
    }
    Py_DECREF(value);
    return ok;
}

/* An optional double attribute: 1 set (*out), 2 None, 0 not an exact float or int. */
static int optional_double(PyObject *obj, PyObject *name, double *out) {
    PyObject *value = PyObject_GetAttr(obj, name);
    if (!value) return -1;
    int result = 0;
    if (value == Py_None) {
        result = 2;
    } else if (PyFloat_CheckExact(value)) {
        *out = PyFloat_AS_DOUBLE(value);
        result = 1;
    } else if (PyLong_CheckExact(value)) {
        double d = PyLong_AsDouble(value);
        if (!(d == -1.0 && PyErr_Occurred())) {
            *out = d;
            result = 1;
        }
        PyErr_Clear();
    }
    Py_DECREF(value);
    return result;
}

#define INT32_LOW (-2147483648LL)
#define INT32_HIGH 2147483647ULL
#define UINT64_HIGH 18446744073709551615ULL

/* Buckets field ``tag`` (positive 8, negative 9): 1 written (or empty), 0 unsupported. */
static int put_buckets(Buffer *b, PyObject *point, PyObject *name, unsigned char tag) {
    PyObject *buckets = PyObject_GetAttr(point, name);
    if (!buckets) return -1;
    int status = 0;
    PyObject *counts = PyObject_GetAttr(buckets, p_bucket_counts);
    if (!counts) goto done_error;
    if (!PyList_CheckExact(counts) && !PyTuple_CheckExact(counts)) goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(counts);
    if (n == 0) {
        status = 1;
        goto done;
    }
    unsigned long long offset_bits;
    int negative;
    int got = exact_int(buckets, p_offset, INT32_LOW, INT32_HIGH, &offset_bits, &negative);
    if (got < 0) goto done_error;
    if (!got) goto done;
    long long offset = (long long)offset_bits;
    /* packed varints of the counts (each one byte below 0x80, as bytes(counts)) */
    Buffer packed = {.data = NULL, .size = 0, .capacity = 1024};
    packed.data = packed.stack;
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *item = PySequence_Fast_GET_ITEM(counts, k);
        if (!PyLong_CheckExact(item)) goto packed_unsupported;
        int overflow = 0;
        long long c = PyLong_AsLongLongAndOverflow(item, &overflow);
        if (overflow || c < 0) { /* negative: the Python raises (bytes() or _varint's 10) */
            PyErr_Clear();
            goto packed_unsupported;
        }
        if (put_varint(&packed, (uint64_t)c)) goto packed_error;
    }
    Buffer body = {.data = NULL, .size = 0, .capacity = 1024};
    body.data = body.stack;
    if ((offset && (put_byte(&body, 0x08) || put_varint(&body, zigzag32(offset)))) ||
        put_byte(&body, 0x12) || put_varint(&body, (uint64_t)packed.size) ||
        put_bytes(&body, packed.data, packed.size) || put_byte(b, tag) ||
        put_varint(b, (uint64_t)body.size) || put_bytes(b, body.data, body.size)) {
        if (body.data != body.stack) PyMem_Free(body.data);
        goto packed_error;
    }
    if (body.data != body.stack) PyMem_Free(body.data);
    if (packed.data != packed.stack) PyMem_Free(packed.data);
    status = 1;
    goto done;
packed_unsupported:
    if (packed.data != packed.stack) PyMem_Free(packed.data);
    goto done;
packed_error:
    if (packed.data != packed.stack) PyMem_Free(packed.data);
done_error:
    status = -1;
done:
    Py_XDECREF(counts);
    Py_DECREF(buckets);
    return status;
}

PyDoc_STRVAR(exponential_point_doc,
             "exponential_point(point, attributes) -> bytes | None\n\n"
             "The data point as a length-delimited field 1 (0x0a, its length, its body), the "
             "bytes _otlp_protobuf._exponential_point and _length_delimited write; "
             "``attributes`` is the point's encoded attributes. None for anything the Python "
             "code handles differently (exemplars, a value out of range or of another type): "
             "the caller runs the Python code then.");

static PyObject *fast_exponential_point(PyObject *module, PyObject *const *args,
                                        Py_ssize_t nargs) {
    (void)module;
    if (nargs != 2 || !PyBytes_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "exponential_point takes a point and bytes");
        return NULL;
    }
    PyObject *point = args[0];
    PyObject *result = NULL;
    Buffer body = {.data = NULL, .size = 0, .capacity = 1024};
    body.data = body.stack;
    PyObject *exemplars = PyObject_GetAttr(point, p_exemplars);
    if (!exemplars) return NULL;
    int has_exemplars = PyObject_IsTrue(exemplars);
    Py_DECREF(exemplars);
    if (has_exemplars < 0) return NULL;
    if (has_exemplars) Py_RETURN_NONE;
    if (put_bytes(&body, (const unsigned char *)PyBytes_AS_STRING(args[1]),
                  PyBytes_GET_SIZE(args[1])))
        goto error;
    PyObject *fixed[] = {p_start_time_unix_nano, p_time_unix_nano, p_count};
    static const unsigned char fixed_tags[] = {0x11, 0x19, 0x21};
    for (int k = 0; k < 3; k++) {
        unsigned long long value;
        int negative;
        int got = exact_int(point, fixed[k], 0, UINT64_HIGH, &value, &negative);
        if (got < 0) goto error;
        if (!got) goto unsupported;
        if (value && put_fixed64(&body, fixed_tags[k], value)) goto error;
    }
    double number;
    int got = optional_double(point, p_sum, &number);
    if (got < 0) goto error;
    if (!got) goto unsupported;
    if (got == 1 && put_double(&body, 0x29, number)) goto error;
    unsigned long long scale_bits;
    int negative;
    got = exact_int(point, p_scale, INT32_LOW, INT32_HIGH, &scale_bits, &negative);
    if (got < 0) goto error;
    if (!got) goto unsupported;
    long long scale = (long long)scale_bits;
    if (scale && (put_byte(&body, 0x30) || put_varint(&body, zigzag32(scale)))) goto error;
    unsigned long long zero_count;
    got = exact_int(point, p_zero_count, 0, UINT64_HIGH, &zero_count, &negative);
    if (got < 0) goto error;
    if (!got) goto unsupported;
    if (zero_count && put_fixed64(&body, 0x39, zero_count)) goto error;
    got = put_buckets(&body, point, p_positive, 0x42);
    if (got < 0) goto error;
    if (!got) goto unsupported;
    got = put_buckets(&body, point, p_negative, 0x4a);
    if (got < 0) goto error;
    if (!got) goto unsupported;
    unsigned long long flags;
    got = exact_int(point, p_flags, 0, 4294967295ULL, &flags, &negative);
    if (got < 0) goto error;
    if (!got) goto unsupported;
    if (flags && (put_byte(&body, 0x50) || put_varint(&body, flags))) goto error;
    got = optional_double(point, p_min, &number);
    if (got < 0) goto error;
    if (!got) goto unsupported;
    if (got == 1 && put_double(&body, 0x61, number)) goto error;
    got = optional_double(point, p_max, &number);
    if (got < 0) goto error;
    if (!got) goto unsupported;
    if (got == 1 && put_double(&body, 0x69, number)) goto error;
    {
        unsigned char head[11];
        Py_ssize_t used = 0;
        head[used++] = 0x0a;
        uint64_t length = (uint64_t)body.size;
        while (length > 0x7F) {
            head[used++] = (unsigned char)((length & 0x7F) | 0x80);
            length >>= 7;
        }
        head[used++] = (unsigned char)length;
        result = PyBytes_FromStringAndSize(NULL, used + body.size);
        if (result) {
            memcpy(PyBytes_AS_STRING(result), head, (size_t)used);
            memcpy(PyBytes_AS_STRING(result) + used, body.data, (size_t)body.size);
        }
    }
    if (body.data != body.stack) PyMem_Free(body.data);
    return result;
unsupported:
    if (body.data != body.stack) PyMem_Free(body.data);
    Py_RETURN_NONE;
error:
    if (body.data != body.stack) PyMem_Free(body.data);
    return NULL;
}

/* ---- self_time: kernels._summary.self_time_events' loop ------------------------------------- */

/* Nested CPU ops -> one event per op with its self time, plus the top-level ops: the Python
 * function's result, element for element (the same names, the same ints, the same order: the
 * Python sorts are stable, so ties keep the input's order, and the threads come in their first
 * appearance's order). The export thread reads a profiler cycle's ~1,000 ops with it, ~1.1 us an
 * op in Python (docs/exporters.md). None (the Python runs) on anything unusual: a span that is
 * not a 4-tuple, a start, end or thread that is not an int within 64 bits. */

typedef struct {
    long long start, end;
    Py_ssize_t order;
    Py_ssize_t group;
    PyObject *name; /* borrowed: the spans hold it */
} Span;

typedef struct {
    long long start, duration;
    Py_ssize_t sequence;
    PyObject *name;
} Own;

static int span_compare(const void *a, const void *b) {
    const Span *x = a, *y = b;
    if (x->group != y->group) return x->group < y->group ? -1 : 1;
    if (x->start != y->start) return x->start < y->start ? -1 : 1;
    if (x->end != y->end) return x->end > y->end ? -1 : 1; /* key -end */
    return x->order < y->order ? -1 : (x->order > y->order);
}

static int own_compare(const void *a, const void *b) {
    const Own *x = a, *y = b;
    if (x->start != y->start) return x->start < y->start ? -1 : 1;
    return x->sequence < y->sequence ? -1 : (x->sequence > y->sequence);
}

static int exact_ll(PyObject *value, long long *out) {
    if (!PyLong_CheckExact(value)) return 0;
    int overflow = 0;
    long long result = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (overflow || (result == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return 0;
    }
    *out = result;
    return 1;
}

static PyObject *event_list(PyTypeObject *type, Own *events, Py_ssize_t n, PyObject *zero) {
    qsort(events, (size_t)n, sizeof(Own), own_compare);
    PyObject *list = PyList_New(n);
    if (!list) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *event = type->tp_alloc(type, 4);
        PyObject *start = PyLong_FromLongLong(events[i].start);
        PyObject *duration = PyLong_FromLongLong(events[i].duration);
        if (!event || !start || !duration) {
            Py_XDECREF(event);
            Py_XDECREF(start);
            Py_XDECREF(duration);
            Py_DECREF(list);
            return NULL;
        }
        Py_INCREF(events[i].name);
        PyTuple_SET_ITEM(event, 0, events[i].name);
        PyTuple_SET_ITEM(event, 1, start);
        PyTuple_SET_ITEM(event, 2, duration);
        Py_INCREF(zero);
        PyTuple_SET_ITEM(event, 3, zero);
        PyList_SET_ITEM(list, i, event);
    }
    return list;
}

PyDoc_STRVAR(self_time_doc,
             "self_time(spans, event_type, /) -> (own, top) | None\n\n"
             "kernels._summary.self_time_events on a list or tuple of (name, start_ns, end_ns, "
             "thread) tuples, its events made as event_type (a 4-field tuple subclass); None "
             "where the Python must do it.");

static PyObject *fast_self_time(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "self_time(spans, event_type) takes two arguments");
        return NULL;
    }
    PyObject *spans = args[0];
    if (!PyType_Check(args[1]) || !PyType_IsSubtype((PyTypeObject *)args[1], &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "self_time: event_type must be a tuple subclass");
        return NULL;
    }
    PyTypeObject *type = (PyTypeObject *)args[1];
    if (!PyList_CheckExact(spans) && !PyTuple_CheckExact(spans)) Py_RETURN_NONE;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(spans);
    PyObject **items = PySequence_Fast_ITEMS(spans);
    Span *sorted = PyMem_Malloc(sizeof(Span) * (size_t)(n > 0 ? n : 1));
    Own *own = PyMem_Malloc(sizeof(Own) * (size_t)(n > 0 ? n : 1));
    Own *top = PyMem_Malloc(sizeof(Own) * (size_t)(n > 0 ? n : 1));
    Py_ssize_t *stack = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(n > 0 ? n : 1));
    long long *children = PyMem_Malloc(sizeof(long long) * (size_t)(n > 0 ? n : 1));
    long long *threads = PyMem_Malloc(sizeof(long long) * (size_t)(n > 0 ? n : 1));
    PyObject *result = NULL, *own_list = NULL, *top_list = NULL, *zero = NULL;
    if (!sorted || !own || !top || !stack || !children || !threads) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t groups = 0, last_group = -1;
    long long last_thread = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = items[i];
        long long start, end, thread;
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 4 ||
            !exact_ll(PyTuple_GET_ITEM(item, 1), &start) ||
            !exact_ll(PyTuple_GET_ITEM(item, 2), &end) ||
            !exact_ll(PyTuple_GET_ITEM(item, 3), &thread)) {
            result = Py_None;
            Py_INCREF(result);
            goto done;
        }
        Py_ssize_t group = -1;
        if (last_group >= 0 && thread == last_thread) {
            group = last_group; /* the usual case: one thread, or runs of one */
        } else {
            for (Py_ssize_t g = 0; g < groups; g++) {
                if (threads[g] == thread) {
                    group = g;
                    break;
                }
            }
            if (group < 0) {
                threads[groups] = thread;
                group = groups++;
            }
        }
        last_group = group;
        last_thread = thread;
        sorted[i].start = start;
        sorted[i].end = end > start ? end : start;
        sorted[i].order = i;
        sorted[i].group = group;
        sorted[i].name = PyTuple_GET_ITEM(item, 0);
    }
    qsort(sorted, (size_t)n, sizeof(Span), span_compare);
    Py_ssize_t owned = 0, tops = 0, depth = 0;
    for (Py_ssize_t i = 0; i <= n; i++) {
        int new_group = i == n || (i > 0 && sorted[i].group != sorted[i - 1].group);
        /* Finish what ends before this span starts (everything, at a thread's end). */
        while (depth > 0 && (new_group || sorted[stack[depth - 1]].end <= sorted[i].start)) {
            depth--;
            Span *done_span = &sorted[stack[depth]];
            long long self = done_span->end - done_span->start - children[depth];
            own[owned].start = done_span->start;
            own[owned].duration = self > 0 ? self : 0;
            own[owned].sequence = owned;
            own[owned].name = done_span->name;
            owned++;
        }
        if (i == n) break;
        Span *span = &sorted[i];
        if (depth > 0) {
            long long parent_end = sorted[stack[depth - 1]].end;
            children[depth - 1] += (span->end < parent_end ? span->end : parent_end) - span->start;
        } else {
            top[tops].start = span->start;
            top[tops].duration = span->end - span->start;
            top[tops].sequence = tops;
            top[tops].name = span->name;
            tops++;
        }
        stack[depth] = i;
        children[depth] = 0;
        depth++;
    }
    zero = PyLong_FromLong(0);
    if (!zero) goto done;
    own_list = event_list(type, own, owned, zero);
    top_list = own_list ? event_list(type, top, tops, zero) : NULL;
    if (own_list && top_list) result = PyTuple_Pack(2, own_list, top_list);
done:
    Py_XDECREF(own_list);
    Py_XDECREF(top_list);
    Py_XDECREF(zero);
    PyMem_Free(sorted);
    PyMem_Free(own);
    PyMem_Free(top);
    PyMem_Free(stack);
    PyMem_Free(children);
    PyMem_Free(threads);
    return result;
}

static PyMethodDef methods[] = {
    {"record_many", (PyCFunction)(void (*)(void))fast_record_many, METH_FASTCALL,
     record_many_doc},
    {"record_weighted", (PyCFunction)(void (*)(void))fast_record_weighted, METH_FASTCALL,
     record_weighted_doc},
    {"exponential_point", (PyCFunction)(void (*)(void))fast_exponential_point, METH_FASTCALL,
     exponential_point_doc},
    {"self_time", (PyCFunction)(void (*)(void))fast_self_time, METH_FASTCALL, self_time_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    "stepwatch.exporters._fasthist",
    "ExponentialHistogram.record_many and record_weighted in C: the Python loops' exact "
    "results.",
    -1,
    methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

static int intern(PyObject **slot, const char *name) {
    *slot = PyUnicode_InternFromString(name);
    return *slot ? 0 : -1;
}

static int add_float(PyObject *m, const char *name, double value) {
    PyObject *obj = PyFloat_FromDouble(value);
    if (!obj) return -1;
    int status = PyModule_AddObjectRef(m, name, obj);
    Py_DECREF(obj);
    return status;
}

PyMODINIT_FUNC PyInit__fasthist(void) {
    /* The Python module's constants, computed at run time as it computes them (math.log is
     * the C library's log); _histogram.py compares them with its own before using the C. */
    volatile double two = 2.0, margin = 1e-5;
    double inverse_ln2 = 1.0 / log(two);
    for (int scale = 1; scale <= MAX_SCALE; scale++)
        scale_factors[scale] = ldexp(inverse_ln2, scale);
    boundary_margin = margin;
    upper_margin = 1.0 - boundary_margin;
    static const struct {
        PyObject **slot;
        const char *name;
    } names[] = {
        {&s_count, "_count"},  {&s_sum, "_sum"},
        {&s_min, "_min"},      {&s_max, "_max"},
        {&s_zero_count, "_zero_count"}, {&s_counts, "_counts"},
        {&s_scale, "_scale"},  {&s_low, "_low"},
        {&s_high, "_high"},    {&s_max_size, "_max_size"},
        {&s_widen, "_widen"},  {&s_get, "get"},
        /* the OTLP data point's attributes (exponential_point) */
        {&p_exemplars, "exemplars"}, {&p_start_time_unix_nano, "start_time_unix_nano"},
        {&p_time_unix_nano, "time_unix_nano"}, {&p_count, "count"},
        {&p_sum, "sum"},       {&p_scale, "scale"},
        {&p_zero_count, "zero_count"}, {&p_positive, "positive"},
        {&p_negative, "negative"}, {&p_flags, "flags"},
        {&p_min, "min"},       {&p_max, "max"},
        {&p_bucket_counts, "bucket_counts"}, {&p_offset, "offset"},
    };
    for (size_t k = 0; k < sizeof names / sizeof names[0]; k++)
        if (intern(names[k].slot, names[k].name) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    PyObject *factors = PyDict_New();
    if (!factors) goto error;
    for (int scale = 1; scale <= MAX_SCALE; scale++) {
        PyObject *key = PyLong_FromLong(scale);
        PyObject *value = PyFloat_FromDouble(scale_factors[scale]);
        int status = key && value ? PyDict_SetItem(factors, key, value) : -1;
        Py_XDECREF(key);
        Py_XDECREF(value);
        if (status < 0) {
            Py_DECREF(factors);
            goto error;
        }
    }
    int added = PyModule_AddObjectRef(m, "SCALE_FACTORS", factors);
    Py_DECREF(factors);
    if (added < 0) goto error;
    if (add_float(m, "BOUNDARY_MARGIN", boundary_margin) < 0 ||
        add_float(m, "UPPER_MARGIN", upper_margin) < 0 ||
        add_float(m, "MIN_NORMAL", DBL_MIN) < 0 ||
        PyModule_AddIntConstant(m, "MIN_SCALE", MIN_SCALE) < 0 ||
        PyModule_AddIntConstant(m, "MAX_SCALE", MAX_SCALE) < 0)
        goto error;
    return m;
error:
    Py_DECREF(m);
    return NULL;
}
