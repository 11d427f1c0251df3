/* ForwardGate: the instrumented model's forward in C (included by fastrecord.c). */

/* ------------------------------------------------------------------ ForwardGate */

/* The instrumented model's ``forward`` (_forward's class swap) with the path of a step whose
 * phases are not timed in C: there it calls the original forward directly, so such a step
 * enters no Python frame of stepwatch's in the forward (issue 15). Everything else goes to the
 * Python wrapper (slow): another instance of the class, a removed instrumentation, a timed
 * step, a step whose backward is still open, or a last gradient already come (gradients
 * accumulate: the wrapper ends that wait). A descriptor: the class attribute binds to the
 * instance as a function does; functools.update_wrapper fills its __dict__ (__wrapped__ keeps
 * inspect.signature and _stack's code lookup on the original). */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *target;       /* the instrumented model */
    PyObject *state;        /* _auto._AutoState: its enabled and in_backward */
    RecorderCore *recorder;
    ClockStamp *stamp;      /* the last-gradient stamp */
    PyObject *forward;      /* the original forward (a function) */
    PyObject *slow;         /* the Python wrapper (a function) */
    PyObject *dict;
    /* A timed step's path (set by time_in_c(); NULL: the Python wrapper times it): */
    PyObject *tensor_type;  /* torch.Tensor */
    PyObject *grad_enabled; /* torch.is_grad_enabled */
    PyObject *has_torch_function; /* torch.overrides.has_torch_function_unary */
    PyObject *hook_dict_type; /* _forward.HookDict */
    PyObject *hook_key;     /* the state's key in an output's tensor-hook dict */
    PyObject *hook;         /* the backward-start hook (the state's bound backward_start) */
    PyObject *device;       /* DeviceAutoState's device timer (its forward and data marks), or NULL */
    EngineGate *engine;     /* where the backward-start hook is armed (enginegate.h), or NULL:
                             * a tensor hook on the output */
} ForwardGate;

/* attribute ``name`` of ``object`` as a truth value; -1 with an exception set. Read from the
 * instance's __dict__ when it is there (the state's plain attributes: no type lookup). */
static int attribute_true(PyObject *object, PyObject *name) {
    PyObject *dict = instance_dict(object);
    if (dict != NULL) {
        PyObject *found = PyDict_GetItemWithError(dict, name); /* borrowed */
        if (found != NULL) {
            return PyObject_IsTrue(found);
        }
        if (PyErr_Occurred()) {
            return -1;
        }
    }
    PyObject *value = PyObject_GetAttr(object, name);
    if (value == NULL) {
        return -1;
    }
    int truth = PyObject_IsTrue(value);
    Py_DECREF(value);
    return truth;
}

/* The output's backward-start hook, as _AutoState.hook_output registers it on a plain tensor
 * (the output's tensor-hook dict, registered on its node when new): 1 done, 0 for the Python
 * hook_output to decide (not a plain tensor, a tensor subclass with torch functions), -1 with
 * an exception set. */
static int hook_output_fast(ForwardGate *self, PyObject *dict, PyObject *output) {
    PyObject *enabled = PyObject_CallNoArgs(self->grad_enabled);
    if (enabled == NULL) {
        return -1;
    }
    int grad = PyObject_IsTrue(enabled);
    Py_DECREF(enabled);
    if (grad <= 0) {
        return grad < 0 ? -1 : 1;
    }
    if ((PyObject *)Py_TYPE(output) != self->tensor_type) {
        return 0;
    }
    PyObject *value = PyObject_GetAttr(output, str_requires_grad);
    if (value == NULL) {
        return -1;
    }
    int requires_grad = PyObject_IsTrue(value);
    Py_DECREF(value);
    if (requires_grad <= 0) {
        return requires_grad < 0 ? -1 : 1;
    }
    if (self->engine != NULL) { /* the next backward marks the start (enginegate.h) */
        int armed = engine_arm(self->engine, self->hook, (PyObject *)self->recorder);
        if (armed != 0) {
            return armed;
        }
    }
    value = PyObject_CallOneArg(self->has_torch_function, output);
    if (value == NULL) {
        return -1;
    }
    int overridden = PyObject_IsTrue(value);
    Py_DECREF(value);
    if (overridden != 0) {
        return overridden < 0 ? -1 : 0;
    }
    PyObject *hooks = PyObject_GetAttr(output, str_backward_hooks_attr);
    if (hooks == NULL) {
        return -1;
    }
    if (hooks == Py_None) {
        Py_DECREF(hooks);
        hooks = PyObject_CallNoArgs(self->hook_dict_type);
        if (hooks == NULL || PyObject_SetAttr(output, str_backward_hooks_attr, hooks) < 0) {
            Py_XDECREF(hooks);
            return -1;
        }
        PyObject *node = PyObject_GetAttr(output, str_grad_fn);
        if (node == NULL) {
            Py_DECREF(hooks);
            return -1;
        }
        if (node != Py_None) {
            PyObject *done = PyObject_CallMethodOneArg(node, str_register_hook_dict, output);
            Py_DECREF(node);
            if (done == NULL) {
                Py_DECREF(hooks);
                return -1;
            }
            Py_DECREF(done);
        } else {
            Py_DECREF(node);
        }
    }
    int failed = PyObject_SetItem(hooks, self->hook_key, self->hook) < 0 ||
                 PyDict_SetItem(dict, str_backward_hooks, hooks) < 0;
    Py_DECREF(hooks);
    return failed ? -1 : 1;
}

/* The Python forward_post(model, args, output) (None for a forward that raised, whose
 * exception is kept): a timed forward the C path does not close itself. */
static PyObject *forward_post_slow(ForwardGate *self, PyObject *const *args, Py_ssize_t nargs,
                                   PyObject *output) {
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyObject *positional = PyTuple_New(nargs - 1);
    if (positional != NULL) {
        for (Py_ssize_t i = 1; i < nargs; i++) {
            Py_INCREF(args[i]);
            PyTuple_SET_ITEM(positional, i - 1, args[i]);
        }
        PyObject *call[4] = {self->state, self->target, positional, output == NULL ? Py_None
                                                                                   : output};
        PyObject *done = PyObject_VectorcallMethod(str_forward_post, call, 4, NULL);
        Py_XDECREF(done);
        Py_DECREF(positional);
    }
    PyErr_Clear(); /* forward_post never raises; a failure here is the wrapper's to report */
    PyErr_Restore(type, value, traceback);
    return output;
}

/* A timed step's forward in C, as the Python wrapper does it (an auto step's data phase, the
 * forward phase, the output's backward-start hook): NULL with no exception set when not taken
 * (anything unusual: the wrapper runs, nothing changed yet), else the forward's result. */
static PyObject *forward_timed(ForwardGate *self, PyObject *const *args, size_t nargsf,
                               PyObject *kwnames) {
    RecorderCore *recorder = self->recorder;
    PyObject *dict = state_dict(self->state);
    long long depth = 0, start;
    if (self->hook == NULL || dict == NULL || dict_flag(dict, str_enabled) != 1 ||
        dict_flag(dict, str_in_backward) != 0 || dict_ll(dict, str_forward_depth, &depth) < 0 ||
        depth != 0 || monotonic_ns(&start) != 0) {
        return NULL;
    }
    /* With a device timer (DeviceAutoState.forward_pre): the forward's start mark, which also
     * ends an auto step's data phase on the device (from the step's start mark). */
    PyObject *mark = NULL, *data_mark = NULL;
    if (self->device != NULL) {
        data_mark = PyDict_GetItemWithError(dict, str_data_mark);
        if (data_mark == NULL) {
            PyErr_Clear();
            return NULL;
        }
        Py_INCREF(data_mark);
        if ((mark = take_mark(self->device)) == NULL) {
            Py_DECREF(data_mark);
            return NULL;
        }
    }
    int failed = 0;
    if (!recorder->explicit_steps) { /* an auto step: its data phase ends here */
        PyObject *data_start = PyDict_GetItemWithError(dict, str_data_start_ns);
        long long data_ns = 0;
        if (data_start == NULL ||
            (data_start != Py_None && dict_ll(dict, str_data_start_ns, &data_ns) < 0)) {
            failed = 1;
        } else if (data_start != Py_None &&
                   (add_ns(recorder->sampled_ns, str_data, start - data_ns) < 0 ||
                    PyDict_SetItem(dict, str_data_start_ns, Py_None) < 0 ||
                    device_interval(recorder, 1, str_data, data_mark, mark) < 0)) {
            failed = 1;
        }
    }
    Py_XDECREF(data_mark);
    PyObject *thread = failed ? NULL : PyLong_FromUnsignedLong(PyThread_get_thread_ident());
    failed = thread == NULL ||
             (mark != NULL && (PyDict_SetItem(dict, str_data_mark, Py_None) < 0 ||
                               PyDict_SetItem(dict, str_forward_mark, mark) < 0)) ||
             dict_set_ll(dict, str_forward_depth, 1) < 0 ||
             dict_set_ll(dict, str_forward_start_ns, start) < 0 ||
             PyDict_SetItem(dict, str_thread_id, thread) < 0;
    Py_XDECREF(thread);
    if (failed) {
        PyErr_Clear();
        Py_XDECREF(mark);
        return NULL; /* the wrapper opens the phase again from the start */
    }
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *output = PyObject_Vectorcall(self->forward, args, nargsf, kwnames);
    if (output == NULL || dict_ll(dict, str_forward_depth, &depth) < 0 || depth != 1 ||
        state_dict(self->state) != dict || dict_flag(dict, str_enabled) != 1) {
        Py_XDECREF(mark);
        return forward_post_slow(self, args, nargs, output); /* it closes forward_mark too */
    }
    if (mark != NULL) { /* DeviceAutoState.forward_post: the forward on the device */
        PyObject *end_mark = mark_or_report(self->device, (PyObject *)recorder);
        failed = device_interval(recorder, 1, str_forward, mark, end_mark) < 0 ||
                 PyDict_SetItem(dict, str_forward_mark, Py_None) < 0;
        Py_XDECREF(end_mark);
        Py_DECREF(mark);
        if (failed) {
            report_misuse((PyObject *)recorder, str_auto_key, str_forward_failed, 1);
        }
    }
    long long end;
    int hooked = 0;
    if (monotonic_ns(&end) != 0 || dict_set_ll(dict, str_forward_depth, 0) < 0 ||
        add_ns(recorder->sampled_ns, str_forward, end - start) < 0 ||
        (hooked = hook_output_fast(self, dict, output)) < 0) {
        report_misuse((PyObject *)recorder, str_auto_key, str_forward_failed, 1);
        return output;
    }
    if (hooked == 0) { /* the Python hook_output decides (and never raises) */
        PyObject *done = PyObject_CallMethodOneArg(self->state, str_hook_output, output);
        if (done == NULL) {
            report_misuse((PyObject *)recorder, str_auto_key, str_forward_failed, 1);
        }
        Py_XDECREF(done);
    }
    return output;
}

static PyObject *ForwardGate_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                                        PyObject *kwnames) {
    ForwardGate *self = (ForwardGate *)callable;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (self->forward == NULL || self->slow == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "ForwardGate is not initialised");
        return NULL;
    }
    if (nargs < 1 || args[0] != self->target || self->recorder == NULL || self->stamp == NULL) {
        return PyObject_Vectorcall(self->slow, args, nargsf, kwnames);
    }
    RecorderCore *recorder = self->recorder;
    if (recorder->step_depth && recorder->sampled && self->stamp->ns == 0) {
        PyObject *output = forward_timed(self, args, nargsf, kwnames);
        if (output != NULL || PyErr_Occurred()) {
            return output;
        }
    }
    if (recorder->step_depth && !recorder->sampled && self->stamp->ns == 0) {
        int enabled = attribute_true(self->state, str_enabled);
        int in_backward = enabled == 1 ? attribute_true(self->state, str_in_backward) : 0;
        if (enabled < 0 || in_backward < 0) {
            PyErr_Clear();  /* the wrapper decides (and never raises) */
        } else if (enabled == 1 && in_backward == 0) {
            return PyObject_Vectorcall(self->forward, args, nargsf, kwnames);
        }
    }
    return PyObject_Vectorcall(self->slow, args, nargsf, kwnames);
}

static PyObject *ForwardGate_call(PyObject *self, PyObject *args, PyObject *kwargs) {
    return PyVectorcall_Call(self, args, kwargs);
}

static PyObject *ForwardGate_get(PyObject *self, PyObject *instance, PyObject *owner) {
    (void)owner;
    if (instance == NULL || instance == Py_None) {
        Py_INCREF(self);
        return self;
    }
    return PyMethod_New(self, instance);
}

/* ForwardGate(target, state, recorder, stamp, forward, slow) */
static PyObject *ForwardGate_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *target, *state, *recorder, *stamp, *forward, *slow;
    if ((kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0) ||
        !PyArg_ParseTuple(args, "OOO!OOO:ForwardGate", &target, &state, &RecorderCoreType,
                          &recorder, &stamp, &forward, &slow)) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError,
                            "ForwardGate(target, state, recorder, stamp, forward, slow)");
        }
        return NULL;
    }
    if (!PyCallable_Check(forward) || !PyCallable_Check(slow)) {
        PyErr_SetString(PyExc_TypeError, "forward and slow must be callable");
        return NULL;
    }
    if (!is_stamp(stamp)) {
        PyErr_SetString(PyExc_TypeError, "stamp must be a ClockStamp or a MarkStamp");
        return NULL;
    }
    ForwardGate *self = (ForwardGate *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->vectorcall = ForwardGate_vectorcall;
    PyObject *fields[6] = {target, state, recorder, stamp, forward, slow};
    for (int i = 0; i < 6; i++) {
        Py_INCREF(fields[i]);
    }
    self->target = target;
    self->state = state;
    self->recorder = (RecorderCore *)recorder;
    self->stamp = (ClockStamp *)stamp;
    self->forward = forward;
    self->slow = slow;
    return (PyObject *)self;
}

static int ForwardGate_traverse(ForwardGate *self, visitproc visit, void *arg) {
    Py_VISIT(self->target);
    Py_VISIT(self->state);
    Py_VISIT(self->recorder);
    Py_VISIT(self->stamp);
    Py_VISIT(self->forward);
    Py_VISIT(self->slow);
    Py_VISIT(self->dict);
    Py_VISIT(self->tensor_type);
    Py_VISIT(self->grad_enabled);
    Py_VISIT(self->has_torch_function);
    Py_VISIT(self->hook_dict_type);
    Py_VISIT(self->hook_key);
    Py_VISIT(self->hook);
    Py_VISIT(self->device);
    Py_VISIT(self->engine);
    return 0;
}

static int ForwardGate_clear(ForwardGate *self) {
    Py_CLEAR(self->target);
    Py_CLEAR(self->state);
    Py_CLEAR(self->recorder);
    Py_CLEAR(self->stamp);
    Py_CLEAR(self->forward);
    Py_CLEAR(self->slow);
    Py_CLEAR(self->dict);
    Py_CLEAR(self->tensor_type);
    Py_CLEAR(self->grad_enabled);
    Py_CLEAR(self->has_torch_function);
    Py_CLEAR(self->hook_dict_type);
    Py_CLEAR(self->hook_key);
    Py_CLEAR(self->hook);
    Py_CLEAR(self->device);
    Py_CLEAR(self->engine);
    return 0;
}

static void ForwardGate_dealloc(ForwardGate *self) {
    PyObject_GC_UnTrack(self);
    ForwardGate_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* time_in_c(tensor_type, grad_enabled, has_torch_function, hook_dict_type, hook_key, hook[,
 * device[, engine]]): what a timed step's path in C needs (see forward_timed); ``device``: the
 * device timer of a DeviceAutoState (its marks), None or left out for the host clock alone;
 * ``engine``: the EngineGate where the hook is armed, None or left out for a tensor hook. */
static PyObject *ForwardGate_time_in_c(ForwardGate *self, PyObject *const *args,
                                       Py_ssize_t nargs) {
    if (nargs < 6 || nargs > 8) {
        PyErr_SetString(PyExc_TypeError, "time_in_c(tensor_type, grad_enabled, "
                                         "has_torch_function, hook_dict_type, hook_key, hook"
                                         "[, device[, engine]])");
        return NULL;
    }
    if (nargs == 8 && args[7] != Py_None) {
        if (!PyObject_TypeCheck(args[7], &EngineGateType)) {
            PyErr_SetString(PyExc_TypeError, "time_in_c: engine must be an EngineGate");
            return NULL;
        }
        Py_INCREF(args[7]);
        Py_XSETREF(self->engine, (EngineGate *)args[7]);
    }
    if (nargs >= 7 && args[6] != Py_None) {
        if (!PyObject_TypeCheck((PyObject *)self->stamp, &MarkStampType)) {
            PyErr_SetString(PyExc_TypeError, "time_in_c: a device needs the gate's MarkStamp");
            return NULL;
        }
        Py_INCREF(args[6]);
        Py_XSETREF(self->device, args[6]);
    }
    if (!PyType_Check(args[0]) || !PyType_Check(args[3]) || !PyCallable_Check(args[1]) ||
        !PyCallable_Check(args[2]) || !PyCallable_Check(args[5])) {
        PyErr_SetString(PyExc_TypeError, "time_in_c: two types and three callables expected");
        return NULL;
    }
    PyObject **fields[6] = {&self->tensor_type, &self->grad_enabled, &self->has_torch_function,
                            &self->hook_dict_type, &self->hook_key, &self->hook};
    for (int i = 0; i < 6; i++) {
        Py_INCREF(args[i]);
        Py_XSETREF(*fields[i], args[i]);
    }
    Py_RETURN_NONE;
}

static PyMethodDef ForwardGate_methods[] = {
    {"time_in_c", (PyCFunction)(void (*)(void))ForwardGate_time_in_c, METH_FASTCALL,
     "time_in_c(tensor_type, grad_enabled, has_torch_function, hook_dict_type, hook_key, hook"
     "[, device[, engine]]): a timed step's forward in C too."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef ForwardGate_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ForwardGateType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "stepwatch.exporters._fastrecord.ForwardGate",
    .tp_basicsize = sizeof(ForwardGate),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_HAVE_GC |
                Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_doc = "The instrumented model's forward: an untimed step's path in C (see the comment).",
    .tp_new = ForwardGate_new,
    .tp_call = ForwardGate_call,
    .tp_vectorcall_offset = offsetof(ForwardGate, vectorcall),
    .tp_descr_get = ForwardGate_get,
    .tp_dictoffset = offsetof(ForwardGate, dict),
    .tp_getset = ForwardGate_getset,
    .tp_methods = ForwardGate_methods,
    .tp_dealloc = (destructor)ForwardGate_dealloc,
    .tp_traverse = (traverseproc)ForwardGate_traverse,
    .tp_clear = (inquiry)ForwardGate_clear,
};
