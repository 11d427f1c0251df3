/* StepContext, PhaseContext, PhaseLookup: the contexts monitor.step() and monitor.phase()
 * return, and phase()'s body (included by fastrecord.c). */

/* ------------------------------------------------------------------ StepContext */

typedef struct {
    PyObject_HEAD
    RecorderCore *recorder;
} StepContext;

static int StepContext_init(StepContext *self, PyObject *args, PyObject *kwargs) {
    PyObject *recorder;
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0) {
        PyErr_SetString(PyExc_TypeError, "StepContext(recorder)");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "O!:StepContext", &RecorderCoreType, &recorder)) {
        return -1;
    }
    Py_INCREF(recorder);
    Py_XSETREF(self->recorder, (RecorderCore *)recorder);
    return 0;
}

static PyObject *StepContext_enter(StepContext *self, PyObject *unused) {
    (void)unused;
    if (self->recorder == NULL) {
        Py_RETURN_NONE;
    }
    return do_begin(self->recorder, 1, NULL);
}

static PyObject *StepContext_exit(StepContext *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)args;
    (void)nargs;
    if (self->recorder == NULL) {
        Py_RETURN_NONE;
    }
    PyObject *result = do_end(self->recorder, 1, NULL);
    if (result == NULL) {
        return NULL;
    }
    Py_DECREF(result);
    Py_RETURN_FALSE;
}

/* monitor.step() itself (the monitor binds its context as ``step``): returns the context. */
static PyObject *StepContext_call(StepContext *self, PyObject *args, PyObject *kwargs) {
    if (PyTuple_GET_SIZE(args) != 0 || (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0)) {
        PyErr_SetString(PyExc_TypeError, "step() takes no arguments");
        return NULL;
    }
    Py_INCREF(self);
    return (PyObject *)self;
}

static int StepContext_traverse(StepContext *self, visitproc visit, void *arg) {
    Py_VISIT(self->recorder);
    return 0;
}

static int StepContext_clear(StepContext *self) {
    Py_CLEAR(self->recorder);
    return 0;
}

static void StepContext_dealloc(StepContext *self) {
    PyObject_GC_UnTrack(self);
    StepContext_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef StepContext_methods[] = {
    {"__enter__", (PyCFunction)StepContext_enter, METH_NOARGS, "Open a step."},
    {"__exit__", (PyCFunction)(void (*)(void))StepContext_exit, METH_FASTCALL,
     "Close the step and buffer it."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject StepContextType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "stepwatch.exporters._fastrecord.StepContext",
    .tp_basicsize = sizeof(StepContext),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The context monitor.step() returns (reusable); calling it returns it.",
    .tp_new = PyType_GenericNew,
    .tp_call = (ternaryfunc)StepContext_call,
    .tp_init = (initproc)StepContext_init,
    .tp_dealloc = (destructor)StepContext_dealloc,
    .tp_traverse = (traverseproc)StepContext_traverse,
    .tp_clear = (inquiry)StepContext_clear,
    .tp_methods = StepContext_methods,
};

/* ------------------------------------------------------------------ PhaseContext */

typedef struct {
    PyObject_HEAD
    RecorderCore *recorder;
    PyObject *name;
    PyObject *clock_ns;
    PyObject *device;     /* DeviceTimer or None */
    PyObject *start_mark; /* device mark at entry, or None */
    Py_ssize_t depth;
    long long start_ns;
} PhaseContext;

static int PhaseContext_init(PhaseContext *self, PyObject *args, PyObject *kwargs) {
    PyObject *recorder, *name;
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0) {
        PyErr_SetString(PyExc_TypeError, "PhaseContext(recorder, name)");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "O!U:PhaseContext", &RecorderCoreType, &recorder, &name)) {
        return -1;
    }
    RecorderCore *core = (RecorderCore *)recorder;
    if (core->clock_ns == NULL || core->device_timer == NULL) {
        PyErr_SetString(PyExc_ValueError, "the recorder is not initialised");
        return -1;
    }
    Py_INCREF(recorder);
    Py_XSETREF(self->recorder, core);
    Py_INCREF(name);
    Py_XSETREF(self->name, name);
    Py_INCREF(core->clock_ns);
    Py_XSETREF(self->clock_ns, core->clock_ns);
    Py_INCREF(core->device_timer);
    Py_XSETREF(self->device, core->device_timer);
    Py_INCREF(Py_None);
    Py_XSETREF(self->start_mark, Py_None);
    self->depth = 0;
    self->start_ns = 0;
    return 0;
}

/* The clock's int reading; NULL with an exception set when it raises or is not an int. */
static int phase_clock(PhaseContext *self, long long *now) {
    return call_clock(self->clock_ns, now);
}

static PyObject *PhaseContext_enter(PhaseContext *self, PyObject *unused) {
    (void)unused;
    if (self->recorder == NULL) {
        Py_RETURN_NONE;
    }
    if (self->depth == 0) {
        long long now;
        if (phase_clock(self, &now) < 0) {
            report_misuse((PyObject *)self->recorder, str_clock_key, str_clock_msg, 0);
            Py_RETURN_NONE;
        }
        self->start_ns = now;
        if (self->device != Py_None) {
            PyObject *mark = PyObject_CallMethodNoArgs(self->device, str_mark);
            if (mark == NULL) {
                report_misuse((PyObject *)self->recorder, str_clock_key, str_clock_msg, 0);
                Py_RETURN_NONE;
            }
            Py_SETREF(self->start_mark, mark);
        }
    }
    self->depth += 1;
    Py_RETURN_NONE;
}

static int add_device_interval(PhaseContext *self) {
    RecorderCore *recorder = self->recorder;
    if (recorder->device_phases == NULL || !PyDict_Check(recorder->device_phases)) {
        PyErr_SetString(PyExc_TypeError, "the recorder's device phases are not a dict");
        return -1;
    }
    PyObject *mark = PyObject_CallMethodNoArgs(self->device, str_mark);
    if (mark == NULL) {
        return -1;
    }
    PyObject *interval = PyTuple_Pack(2, self->start_mark, mark);
    Py_DECREF(mark);
    if (interval == NULL) {
        return -1;
    }
    PyObject *empty = PyList_New(0);
    PyObject *intervals =
        empty == NULL ? NULL : PyDict_SetDefault(recorder->device_phases, self->name, empty);
    Py_XDECREF(empty);
    int failed = intervals == NULL || PyList_Append(intervals, interval) < 0;
    Py_DECREF(interval);
    if (failed) {
        return -1;
    }
    Py_INCREF(Py_None);
    Py_SETREF(self->start_mark, Py_None);
    return 0;
}

static PyObject *PhaseContext_exit(PhaseContext *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)args;
    (void)nargs;
    if (self->recorder == NULL || self->depth <= 0) {
        Py_RETURN_FALSE;
    }
    self->depth -= 1;
    if (self->depth == 0) {
        long long now;
        int failed = phase_clock(self, &now) < 0;
        if (!failed && self->device == Py_None &&
            phase_slot_add(self->recorder, self->name, now - self->start_ns)) {
            Py_RETURN_FALSE; /* in a slot: no int, no dict (stepbuffer.h) */
        }
        if (!failed) {
            PyObject *elapsed = PyLong_FromLongLong(now - self->start_ns);
            PyObject *done =
                elapsed == NULL ? NULL : add_to(self->recorder->phases_ns, self->name, elapsed);
            Py_XDECREF(elapsed);
            failed = done == NULL;
            Py_XDECREF(done);
        }
        if (!failed && self->device != Py_None && self->start_mark != Py_None) {
            failed = add_device_interval(self) < 0;
        }
        if (failed) {
            report_misuse((PyObject *)self->recorder, str_clock_key, str_clock_msg, 0);
        }
    }
    Py_RETURN_FALSE;
}

static int PhaseContext_traverse(PhaseContext *self, visitproc visit, void *arg) {
    Py_VISIT(self->recorder);
    Py_VISIT(self->clock_ns);
    Py_VISIT(self->device);
    Py_VISIT(self->start_mark);
    return 0;
}

static int PhaseContext_clear(PhaseContext *self) {
    Py_CLEAR(self->recorder);
    Py_CLEAR(self->name);
    Py_CLEAR(self->clock_ns);
    Py_CLEAR(self->device);
    Py_CLEAR(self->start_mark);
    return 0;
}

static void PhaseContext_dealloc(PhaseContext *self) {
    PyObject_GC_UnTrack(self);
    PhaseContext_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef PhaseContext_methods[] = {
    {"__enter__", (PyCFunction)PhaseContext_enter, METH_NOARGS, "Start timing the phase."},
    {"__exit__", (PyCFunction)(void (*)(void))PhaseContext_exit, METH_FASTCALL,
     "Add the phase's time to the step."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef PhaseContext_members[] = {
    {"_depth", T_PYSSIZET, offsetof(PhaseContext, depth), READONLY, "Nesting depth."},
    {"_start_ns", T_LONGLONG, offsetof(PhaseContext, start_ns), READONLY, "Entry time."},
    {"_name", T_OBJECT, offsetof(PhaseContext, name), READONLY, "The phase's name."},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject PhaseContextType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "stepwatch.exporters._fastrecord.PhaseContext",
    .tp_basicsize = sizeof(PhaseContext),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The context monitor.phase(name) returns (reusable, re-entrant).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)PhaseContext_init,
    .tp_dealloc = (destructor)PhaseContext_dealloc,
    .tp_traverse = (traverseproc)PhaseContext_traverse,
    .tp_clear = (inquiry)PhaseContext_clear,
    .tp_methods = PhaseContext_methods,
    .tp_members = PhaseContext_members,
};

/* ------------------------------------------------------------------ PhaseLookup */

/* monitor.phase(name): the context already made for ``name``, else the recorder's
 * new_phase_context(name) (which validates, caps and remembers it). */
#define PHASE_CACHE 4

/* The names last looked up and their contexts (strong references), compared by identity: a
 * loop's phase names are constants of its code, the same objects every step, and a name's
 * context never changes once made (phase_contexts only grows). A hit touches neither the dict
 * nor the name, which are cold after the model's memory traffic (issue 15). */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *contexts; /* dict: name -> context (the recorder's phase_contexts) */
    PyObject *recorder;
    PyObject *cached_names[PHASE_CACHE];
    PyObject *cached_contexts[PHASE_CACHE];
    unsigned int cache_next; /* the slot the next miss fills */
} PhaseLookup;

static void phase_cache_clear(PhaseLookup *self) {
    for (int i = 0; i < PHASE_CACHE; i++) {
        Py_CLEAR(self->cached_names[i]);
        Py_CLEAR(self->cached_contexts[i]);
    }
    self->cache_next = 0;
}

static PyObject *str_new_phase_context;

static int PhaseLookup_init(PhaseLookup *self, PyObject *args, PyObject *kwargs) {
    PyObject *recorder, *contexts;
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0) {
        PyErr_SetString(PyExc_TypeError, "PhaseLookup(recorder, contexts)");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "OO!:PhaseLookup", &recorder, &PyDict_Type, &contexts)) {
        return -1;
    }
    Py_INCREF(recorder);
    Py_XSETREF(self->recorder, recorder);
    Py_INCREF(contexts);
    Py_XSETREF(self->contexts, contexts);
    phase_cache_clear(self);
    return 0;
}

static PyObject *PhaseLookup_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                                        PyObject *kwnames) {
    PhaseLookup *self = (PhaseLookup *)callable;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs != 1 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames) != 0)) {
        PyErr_SetString(PyExc_TypeError, "phase(name) takes one argument");
        return NULL;
    }
    PyObject *name = args[0];
    for (int i = 0; i < PHASE_CACHE; i++) {
        if (self->cached_names[i] == name) {
            PyObject *cached = self->cached_contexts[i];
            Py_INCREF(cached);
            return cached;
        }
    }
    if (self->contexts != NULL && PyUnicode_CheckExact(name)) {
        PyObject *context = PyDict_GetItemWithError(self->contexts, name);
        if (context != NULL) {
            unsigned int slot = self->cache_next % PHASE_CACHE;
            self->cache_next = slot + 1;
            Py_INCREF(name);
            Py_XSETREF(self->cached_names[slot], name);
            Py_INCREF(context);
            Py_XSETREF(self->cached_contexts[slot], context);
            Py_INCREF(context);
            return context;
        }
        PyErr_Clear();
    }
    if (self->recorder == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "PhaseLookup is not initialised");
        return NULL;
    }
    return PyObject_CallMethodOneArg(self->recorder, str_new_phase_context, name);
}

static PyObject *PhaseLookup_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    (void)args;
    (void)kwargs;
    PhaseLookup *self = (PhaseLookup *)type->tp_alloc(type, 0);
    if (self != NULL) {
        self->vectorcall = PhaseLookup_vectorcall;
    }
    return (PyObject *)self;
}

static int PhaseLookup_traverse(PhaseLookup *self, visitproc visit, void *arg) {
    Py_VISIT(self->contexts);
    Py_VISIT(self->recorder);
    for (int i = 0; i < PHASE_CACHE; i++) {
        Py_VISIT(self->cached_names[i]);
        Py_VISIT(self->cached_contexts[i]);
    }
    return 0;
}

static int PhaseLookup_clear(PhaseLookup *self) {
    Py_CLEAR(self->contexts);
    Py_CLEAR(self->recorder);
    phase_cache_clear(self);
    return 0;
}

static void PhaseLookup_dealloc(PhaseLookup *self) {
    PyObject_GC_UnTrack(self);
    PhaseLookup_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *PhaseLookup_call(PyObject *self, PyObject *args, PyObject *kwargs) {
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0) {
        PyErr_SetString(PyExc_TypeError, "phase(name) takes one argument");
        return NULL;
    }
    return PhaseLookup_vectorcall(self, &PyTuple_GET_ITEM(args, 0),
                                  (size_t)PyTuple_GET_SIZE(args), NULL);
}

static PyTypeObject PhaseLookupType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "stepwatch.exporters._fastrecord.PhaseLookup",
    .tp_basicsize = sizeof(PhaseLookup),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "monitor.phase(name) without a Python frame: the phase's context.",
    .tp_new = PhaseLookup_new,
    .tp_init = (initproc)PhaseLookup_init,
    .tp_dealloc = (destructor)PhaseLookup_dealloc,
    .tp_traverse = (traverseproc)PhaseLookup_traverse,
    .tp_clear = (inquiry)PhaseLookup_clear,
    .tp_call = PhaseLookup_call,
    .tp_vectorcall_offset = offsetof(PhaseLookup, vectorcall),
};
