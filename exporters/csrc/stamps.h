/* ClockStamp, MarkStamp: the last gradient's time (and device mark), taken without a
 * Python frame; EventMarker (eventmarker.h) before MarkStamp (included by fastrecord.c). */

/* ------------------------------------------------------------------ ClockStamp */

/* A callable that takes the time when called, whatever its arguments: the last parameter's
 * post-accumulate-grad hook in auto mode (_auto.py), called by autograd on every step. It
 * enters no Python frame: the exposed collective wait is then timed on every step for a
 * clock read, while the other auto phases may be sampled. ``ns`` is CLOCK_MONOTONIC in ns,
 * what time.perf_counter_ns() reads on Linux, and 0 until called or after being reset; it
 * stays 0 where that clock cannot be read (the Python code then uses its own stamp). */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    long long ns;
} ClockStamp;

static PyObject *ClockStamp_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                                       PyObject *kwnames) {
    (void)args;
    (void)nargsf;
    (void)kwnames;
    long long now;
    ((ClockStamp *)callable)->ns = monotonic_ns(&now) == 0 ? now : 0;
    Py_RETURN_NONE;
}

static PyObject *ClockStamp_call(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)args;
    (void)kwargs;
    return ClockStamp_vectorcall(self, NULL, 0, NULL);
}

static PyObject *ClockStamp_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    if (PyTuple_GET_SIZE(args) != 0 || (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0)) {
        PyErr_SetString(PyExc_TypeError, "ClockStamp() takes no arguments");
        return NULL;
    }
    ClockStamp *self = (ClockStamp *)type->tp_alloc(type, 0);
    if (self != NULL) {
        self->vectorcall = ClockStamp_vectorcall;
        self->ns = 0;
    }
    return (PyObject *)self;
}

static PyMemberDef ClockStamp_members[] = {
    {"ns", T_LONGLONG, offsetof(ClockStamp, ns), 0,
     "CLOCK_MONOTONIC (ns) at the last call; 0 before it or once reset"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject ClockStampType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "stepwatch.exporters._fastrecord.ClockStamp",
    .tp_basicsize = sizeof(ClockStamp),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "Called with anything: ns = CLOCK_MONOTONIC in ns, without a Python frame.",
    .tp_new = ClockStamp_new,
    .tp_call = ClockStamp_call,
    .tp_vectorcall_offset = offsetof(ClockStamp, vectorcall),
    .tp_members = ClockStamp_members,
};

/* ------------------------------------------------------------------ EventMarker, MarkStamp */

#include "eventmarker.h"

/* MarkStamp(device_timer): ClockStamp with a device mark. Called with anything (autograd's
 * post-accumulate-grad hook, on its device thread): ``mark = device_timer.mark()``, then
 * ``ns`` = CLOCK_MONOTONIC; a mark that fails is None (the wait keeps its host time), a clock
 * that fails leaves ns 0. Never raises. (_auto_device.DeviceStamp in Python, for other
 * clocks.) */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    long long ns;
    PyObject *mark;
    PyObject *device;
} MarkStamp;

static PyObject *MarkStamp_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                                      PyObject *kwnames) {
    (void)args;
    (void)nargsf;
    (void)kwnames;
    MarkStamp *self = (MarkStamp *)callable;
    PyObject *mark = PyObject_CallMethodNoArgs(self->device, str_mark);
    if (mark == NULL) {
        PyErr_Clear();
        Py_INCREF(Py_None);
        mark = Py_None;
    }
    long long now;
    Py_XSETREF(self->mark, mark);
    self->ns = monotonic_ns(&now) == 0 ? now : 0;
    Py_RETURN_NONE;
}

static PyObject *MarkStamp_call(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)args;
    (void)kwargs;
    return MarkStamp_vectorcall(self, NULL, 0, NULL);
}

static PyObject *MarkStamp_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *device;
    if ((kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0) ||
        !PyArg_ParseTuple(args, "O:MarkStamp", &device)) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError, "MarkStamp(device_timer)");
        }
        return NULL;
    }
    MarkStamp *self = (MarkStamp *)type->tp_alloc(type, 0);
    if (self != NULL) {
        self->vectorcall = MarkStamp_vectorcall;
        self->ns = 0;
        Py_INCREF(Py_None);
        self->mark = Py_None;
        Py_INCREF(device);
        self->device = device;
    }
    return (PyObject *)self;
}

static int MarkStamp_traverse(MarkStamp *self, visitproc visit, void *arg) {
    Py_VISIT(self->mark);
    Py_VISIT(self->device);
    return 0;
}

static int MarkStamp_clear(MarkStamp *self) {
    Py_CLEAR(self->mark);
    Py_CLEAR(self->device);
    return 0;
}

static void MarkStamp_dealloc(MarkStamp *self) {
    PyObject_GC_UnTrack(self);
    MarkStamp_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef MarkStamp_members[] = {
    {"ns", T_LONGLONG, offsetof(MarkStamp, ns), 0,
     "CLOCK_MONOTONIC (ns) at the last call; 0 before it, once reset, or when it failed"},
    {"mark", T_OBJECT, offsetof(MarkStamp, mark), 0, "The device mark of the last call, or None"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject MarkStampType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "stepwatch.exporters._fastrecord.MarkStamp",
    .tp_basicsize = sizeof(MarkStamp),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Called with anything: mark = device_timer.mark(), ns = CLOCK_MONOTONIC (ns).",
    .tp_new = MarkStamp_new,
    .tp_call = MarkStamp_call,
    .tp_vectorcall_offset = offsetof(MarkStamp, vectorcall),
    .tp_dealloc = (destructor)MarkStamp_dealloc,
    .tp_traverse = (traverseproc)MarkStamp_traverse,
    .tp_clear = (inquiry)MarkStamp_clear,
    .tp_members = MarkStamp_members,
};
