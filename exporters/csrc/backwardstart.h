/* BackwardStart: the backward-start hook in C (included by fastrecord.c). */

/* ------------------------------------------------------------------ BackwardStart */

/* BackwardStart(state): _AutoState.backward_start without a Python frame, the tensor hook that
 * autograd calls when the gradient reaches the model's output (whatever its arguments): unless
 * the state is disabled or its backward already open, backward_start_ns = CLOCK_MONOTONIC (ns)
 * and in_backward = True; with a device timer (DeviceAutoState) backward_mark = a mark too (None
 * where the timer fails, reported). Returns None (the gradient is not replaced); never raises. */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *state;
    PyObject *device; /* DeviceAutoState's device timer: backward_mark too; or NULL */
} BackwardStart;

static PyObject *BackwardStart_vectorcall(PyObject *callable, PyObject *const *args,
                                          size_t nargsf, PyObject *kwnames) {
    (void)args;
    (void)nargsf;
    (void)kwnames;
    BackwardStart *self = (BackwardStart *)callable;
    PyObject *dict = state_dict(self->state);
    long long now;
    if (dict == NULL || dict_flag(dict, str_enabled) != 1 ||
        dict_flag(dict, str_in_backward) != 0 || monotonic_ns(&now) != 0) {
        Py_RETURN_NONE;
    }
    if (dict_set_ll(dict, str_backward_start_ns, now) < 0 ||
        PyDict_SetItem(dict, str_in_backward, Py_True) < 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    if (self->device != NULL) { /* DeviceAutoState.backward_start: the backward's start mark */
        PyObject *recorder = PyDict_GetItemWithError(dict, str_recorder); /* borrowed */
        PyObject *mark = recorder == NULL ? NULL : mark_or_report(self->device, recorder);
        if (PyDict_SetItem(dict, str_backward_mark, mark == NULL ? Py_None : mark) < 0) {
            PyErr_Clear();
        }
        Py_XDECREF(mark);
        PyErr_Clear();
    }
    Py_RETURN_NONE;
}

static PyObject *BackwardStart_call(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)args;
    (void)kwargs;
    return BackwardStart_vectorcall(self, NULL, 0, NULL);
}

static PyObject *BackwardStart_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *state, *device = NULL;
    if ((kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0) ||
        !PyArg_ParseTuple(args, "O|O:BackwardStart", &state, &device)) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError, "BackwardStart(state[, device])");
        }
        return NULL;
    }
    BackwardStart *self = (BackwardStart *)type->tp_alloc(type, 0);
    if (self != NULL) {
        self->vectorcall = BackwardStart_vectorcall;
        Py_INCREF(state);
        self->state = state;
        if (device != NULL && device != Py_None) {
            Py_INCREF(device);
            self->device = device;
        }
    }
    return (PyObject *)self;
}

static int BackwardStart_traverse(BackwardStart *self, visitproc visit, void *arg) {
    Py_VISIT(self->state);
    Py_VISIT(self->device);
    return 0;
}

static int BackwardStart_clear(BackwardStart *self) {
    Py_CLEAR(self->state);
    Py_CLEAR(self->device);
    return 0;
}

static void BackwardStart_dealloc(BackwardStart *self) {
    PyObject_GC_UnTrack(self);
    BackwardStart_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject BackwardStartType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "stepwatch.exporters._fastrecord.BackwardStart",
    .tp_basicsize = sizeof(BackwardStart),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "BackwardStart(state)(*anything): the state's backward opens now (see the comment).",
    .tp_new = BackwardStart_new,
    .tp_call = BackwardStart_call,
    .tp_vectorcall_offset = offsetof(BackwardStart, vectorcall),
    .tp_dealloc = (destructor)BackwardStart_dealloc,
    .tp_traverse = (traverseproc)BackwardStart_traverse,
    .tp_clear = (inquiry)BackwardStart_clear,
};
