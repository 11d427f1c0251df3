/* EngineGate: torch's autograd engine with a backward-start mark (included by fastrecord.c).
 *
 * Every backward torch runs from Python goes through torch.autograd.graph._engine_run_backward
 * (Tensor.backward, torch.autograd.backward and .grad), which looks up
 * ``Variable._execution_engine.run_backward`` at each call. _engine.py installs there an
 * instance of an _ImperativeEngine subclass whose ``run_backward`` (a class attribute; the gate
 * has no __get__, so it is not bound per call) is this gate: it calls the engine's own bound method with the same
 * arguments and, before that, on a backward that accumulates gradients (``.backward()``, not
 * ``autograd.grad``), calls the backward-start hooks armed since by a timed forward of the
 * step still open. A timed step's forward arms its state's hook here instead of registering a
 * tensor hook on its output: torch's side of a tensor hook (the tensor's and its node's C++
 * hooks, the node's Python object, the autograd engine taking the GIL and wrapping the
 * gradient to call it) was ~17-20 us of a timed step on the 1024-wide CPU bench, where
 * arming is a few stores and the gate's check one branch a backward (issue 15).
 *
 * The mark moves a little earlier: to the moment the backward is asked for, rather than when
 * its gradient reaches the model's output; the autograd engine's own start (its pass over the
 * graph) and the loss's backward are now in the backward phase.
 *
 * An arm is (hook, recorder, the recorder's step index then): it fires only while that step is
 * open (a forward under grad whose output no backward reached leaves an arm that the next
 * step's backward drops); the same hook armed again replaces its arm; a recorder of None (the
 * probe) fires at the next backward whatever the step. At most ENGINE_GATE_SLOTS hooks are
 * armed at once; arm() returns False beyond that (the caller registers the tensor hook). Hooks
 * are called with one argument (None, where a tensor hook gets the gradient); what they raise
 * is dropped (the auto-mode hooks report their own failures).
 *
 * The exposed wait ends here too (close_waits): after the engine returns, from any backward,
 * each registered last-gradient ClockStamp that is set (the model's last gradient came in this
 * backward; DDP has waited for its allreduces before returning) is reset and the time since
 * added to its recorder's pending wait (wait_ns, folded into the step's "communication" at its
 * end), as the optimizer's pre gate did at the next optimizer.step(). The wait now ends when
 * the backward returns: what the loop does between backward() and step() (gradient clipping,
 * unscaling, logging) is not counted as waiting for the peers, and an untimed step's pre gate
 * has nothing left to do (it leaves torch's loop: OptimizerGate.hide_pre). */

#define ENGINE_GATE_SLOTS 8

typedef struct {
    PyObject *hook;
    PyObject *recorder;
    long long step_index;
} EngineArm;

typedef struct {
    PyObject_HEAD
    PyObject *run; /* the engine's own run_backward (a bound method) */
    int armed;     /* arms[0:armed] are set */
    EngineArm arms[ENGINE_GATE_SLOTS];
    unsigned long long backwards; /* accumulating backwards seen */
    unsigned long long marks;     /* hooks called */
    unsigned long long dropped;   /* arms dropped as stale (their step had closed) */
    int closers;                  /* close_stamps[0:closers], close_recorders[0:closers] set */
    ClockStamp *close_stamps[ENGINE_GATE_SLOTS];
    RecorderCore *close_recorders[ENGINE_GATE_SLOTS];
    unsigned long long closed;    /* waits ended here */
} EngineGate;

static PyTypeObject EngineGateType;
static PyObject *str_accumulate_grad, *str_step_depth, *str_step_index_attr;

/* 1 when the call accumulates gradients (torch's run_backward: accumulate_grad, its seventh
 * parameter, True by default), 0 when not. */
static int engine_accumulates(PyObject *args, PyObject *kwargs) {
    PyObject *value = NULL;
    if (kwargs != NULL && PyDict_Check(kwargs)) {
        value = PyDict_GetItemWithError(kwargs, str_accumulate_grad); /* borrowed */
        if (value == NULL && PyErr_Occurred()) {
            PyErr_Clear();
        }
    }
    if (value == NULL && PyTuple_Check(args) && PyTuple_GET_SIZE(args) >= 7) {
        value = PyTuple_GET_ITEM(args, 6);
    }
    if (value == NULL || value == Py_True) {
        return 1;
    }
    if (value == Py_False) {
        return 0;
    }
    int truth = PyObject_IsTrue(value);
    if (truth < 0) {
        PyErr_Clear();
        return 1;
    }
    return truth;
}

/* The open step's index of ``recorder`` (a RecorderCore, or the Python StepRecorder), or -1
 * where no step is open or it cannot be read. */
static long long engine_open_step(PyObject *recorder) {
    if (PyObject_TypeCheck(recorder, &RecorderCoreType)) {
        RecorderCore *core = (RecorderCore *)recorder;
        return core->step_depth > 0 ? core->step_index : -1;
    }
    PyObject *depth = PyObject_GetAttr(recorder, str_step_depth);
    PyObject *index = depth == NULL ? NULL : PyObject_GetAttr(recorder, str_step_index_attr);
    long long open = -1;
    if (index != NULL && PyLong_Check(depth) && PyLong_Check(index) &&
        PyLong_AsLongLong(depth) > 0) {
        open = PyLong_AsLongLong(index);
    }
    Py_XDECREF(depth);
    Py_XDECREF(index);
    PyErr_Clear();
    return open;
}

/* Arm ``hook`` for ``recorder``'s open step: 1 armed, 0 not (no slot left, no step open), -1
 * with an exception set. */
static int engine_arm(EngineGate *self, PyObject *hook, PyObject *recorder) {
    long long index = 0;
    if (recorder != Py_None && (index = engine_open_step(recorder)) < 0) {
        return 0;
    }
    for (int i = 0; i < self->armed; i++) {
        EngineArm *arm = &self->arms[i];
        if (arm->hook == hook) {
            Py_INCREF(recorder);
            Py_SETREF(arm->recorder, recorder);
            arm->step_index = index;
            return 1;
        }
    }
    if (self->armed >= ENGINE_GATE_SLOTS) {
        return 0;
    }
    EngineArm *arm = &self->arms[self->armed++];
    Py_INCREF(hook);
    Py_INCREF(recorder);
    arm->hook = hook;
    arm->recorder = recorder;
    arm->step_index = index;
    return 1;
}

/* Every arm taken out, the current ones' hooks called (in the order armed). */
static void engine_fire(EngineGate *self) {
    EngineArm arms[ENGINE_GATE_SLOTS];
    int count = self->armed;
    memcpy(arms, self->arms, sizeof(EngineArm) * (size_t)count);
    self->armed = 0; /* taken out before any hook runs: a hook may start a backward itself */
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    for (int i = 0; i < count; i++) {
        EngineArm *arm = &arms[i];
        if (arm->recorder == Py_None || engine_open_step(arm->recorder) == arm->step_index) {
            self->marks++;
            PyObject *done = PyObject_CallOneArg(arm->hook, Py_None);
            Py_XDECREF(done);
            PyErr_Clear();
        } else {
            self->dropped++;
        }
        Py_DECREF(arm->hook);
        Py_DECREF(arm->recorder);
    }
    PyErr_Restore(type, value, traceback);
}

/* After the engine returned (or raised): each set stamp's wait ended now (see the top). */
static void engine_close_waits(EngineGate *self) {
    long long now = 0;
    for (int i = 0; i < self->closers; i++) {
        ClockStamp *stamp = self->close_stamps[i];
        long long last = stamp->ns;
        if (last == 0) {
            continue;
        }
        stamp->ns = 0;
        if (now == 0 && monotonic_ns(&now) != 0) {
            now = 0;
            continue; /* no clock: the wait is not counted */
        }
        if (now > last) {
            self->close_recorders[i]->wait_ns += now - last;
        }
        self->closed++;
    }
}

/* The call as torch's engine gets it: the arguments' tuple and dict go through as they came
 * (torch's run_backward takes them so, and _engine_run_backward calls it with *args and
 * **kwargs: no vectorcall, which would turn them into an array and back twice). */
static PyObject *EngineGate_call(PyObject *callable, PyObject *args, PyObject *kwargs) {
    EngineGate *self = (EngineGate *)callable;
    if (self->run == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "EngineGate is not initialised");
        return NULL;
    }
    if (self->armed && engine_accumulates(args, kwargs)) {
        self->backwards++;
        engine_fire(self);
    }
    PyObject *result = PyObject_Call(self->run, args, kwargs);
    if (self->closers) {
        engine_close_waits(self);
    }
    return result;
}

/* EngineGate(run): run is the engine's own run_backward */
static PyObject *EngineGate_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *run;
    if ((kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0) ||
        !PyArg_ParseTuple(args, "O:EngineGate", &run)) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError, "EngineGate(run_backward)");
        }
        return NULL;
    }
    if (!PyCallable_Check(run)) {
        PyErr_SetString(PyExc_TypeError, "EngineGate: run_backward must be callable");
        return NULL;
    }
    EngineGate *self = (EngineGate *)type->tp_alloc(type, 0);
    if (self != NULL) {
        Py_INCREF(run);
        self->run = run;
    }
    return (PyObject *)self;
}

static int EngineGate_traverse(EngineGate *self, visitproc visit, void *arg) {
    Py_VISIT(self->run);
    for (int i = 0; i < self->closers; i++) {
        Py_VISIT(self->close_stamps[i]);
        Py_VISIT(self->close_recorders[i]);
    }
    for (int i = 0; i < self->armed; i++) {
        Py_VISIT(self->arms[i].hook);
        Py_VISIT(self->arms[i].recorder);
    }
    return 0;
}

static void engine_disarm_all(EngineGate *self) {
    int count = self->armed;
    self->armed = 0;
    for (int i = 0; i < count; i++) {
        Py_CLEAR(self->arms[i].hook);
        Py_CLEAR(self->arms[i].recorder);
    }
}

static void engine_unclose_all(EngineGate *self) {
    int count = self->closers;
    self->closers = 0;
    for (int i = 0; i < count; i++) {
        Py_CLEAR(self->close_stamps[i]);
        Py_CLEAR(self->close_recorders[i]);
    }
}

static int EngineGate_clear(EngineGate *self) {
    Py_CLEAR(self->run);
    engine_unclose_all(self);
    engine_disarm_all(self);
    return 0;
}

static void EngineGate_dealloc(EngineGate *self) {
    PyObject_GC_UnTrack(self);
    EngineGate_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *EngineGate_arm(EngineGate *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyCallable_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "arm(hook, recorder)");
        return NULL;
    }
    int armed = engine_arm(self, args[0], args[1]);
    if (armed < 0) {
        return NULL;
    }
    return PyBool_FromLong(armed);
}

/* disarm(hook): its arm removed, if any (True when there was one) */
static PyObject *EngineGate_disarm(EngineGate *self, PyObject *hook) {
    for (int i = 0; i < self->armed; i++) {
        if (self->arms[i].hook == hook) {
            PyObject *old_hook = self->arms[i].hook, *old_recorder = self->arms[i].recorder;
            self->armed--;
            for (int j = i; j < self->armed; j++) {
                self->arms[j] = self->arms[j + 1];
            }
            Py_DECREF(old_hook);
            Py_DECREF(old_recorder);
            Py_RETURN_TRUE;
        }
    }
    Py_RETURN_FALSE;
}

/* close_waits(stamp, recorder): the wait since ``stamp`` ends when a backward returns (the top);
 * False when no slot is left. The same stamp again takes the new recorder. */
static PyObject *EngineGate_close_waits(EngineGate *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyObject_TypeCheck(args[0], &ClockStampType) ||
        !PyObject_TypeCheck(args[1], &RecorderCoreType)) {
        PyErr_SetString(PyExc_TypeError, "close_waits(ClockStamp, RecorderCore)");
        return NULL;
    }
    ClockStamp *stamp = (ClockStamp *)args[0];
    RecorderCore *recorder = (RecorderCore *)args[1];
    int slot = 0;
    while (slot < self->closers && self->close_stamps[slot] != stamp) {
        slot++;
    }
    if (slot == self->closers) {
        if (self->closers >= ENGINE_GATE_SLOTS) {
            Py_RETURN_FALSE;
        }
        Py_INCREF(stamp);
        self->close_stamps[slot] = stamp;
        self->close_recorders[slot] = NULL;
        self->closers++;
    }
    Py_INCREF(recorder);
    Py_XSETREF(self->close_recorders[slot], recorder);
    Py_RETURN_TRUE;
}

/* unclose(stamp): its waits no longer end here (True when they did) */
static PyObject *EngineGate_unclose(EngineGate *self, PyObject *stamp) {
    for (int i = 0; i < self->closers; i++) {
        if ((PyObject *)self->close_stamps[i] == stamp) {
            ClockStamp *old_stamp = self->close_stamps[i];
            RecorderCore *old_recorder = self->close_recorders[i];
            self->closers--;
            for (int j = i; j < self->closers; j++) {
                self->close_stamps[j] = self->close_stamps[j + 1];
                self->close_recorders[j] = self->close_recorders[j + 1];
            }
            Py_DECREF(old_stamp);
            Py_DECREF(old_recorder);
            Py_RETURN_TRUE;
        }
    }
    Py_RETURN_FALSE;
}

static PyObject *EngineGate_get_closing(EngineGate *self, void *closure) {
    (void)closure;
    return PyLong_FromLong(self->closers);
}

static PyObject *EngineGate_get_armed(EngineGate *self, void *closure) {
    (void)closure;
    return PyLong_FromLong(self->armed);
}

static PyMethodDef EngineGate_methods[] = {
    {"arm", (PyCFunction)(void (*)(void))EngineGate_arm, METH_FASTCALL,
     "arm(hook, recorder) -> bool: hook(None) at the next accumulating backward of the "
     "recorder's open step (recorder None: the next one)."},
    {"disarm", (PyCFunction)EngineGate_disarm, METH_O,
     "disarm(hook) -> bool: its arm removed, if any."},
    {"close_waits", (PyCFunction)(void (*)(void))EngineGate_close_waits, METH_FASTCALL,
     "close_waits(stamp, recorder) -> bool: the exposed wait since the ClockStamp ends when a "
     "backward returns, into the recorder's pending wait (False: no slot left)."},
    {"unclose", (PyCFunction)EngineGate_unclose, METH_O,
     "unclose(stamp) -> bool: its waits no longer end here."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef EngineGate_members[] = {
    {"run", T_OBJECT, offsetof(EngineGate, run), READONLY, "The engine's own run_backward."},
    {"backwards", T_ULONGLONG, offsetof(EngineGate, backwards), READONLY,
     "Accumulating backwards that found an arm."},
    {"marks", T_ULONGLONG, offsetof(EngineGate, marks), READONLY, "Hooks called."},
    {"dropped", T_ULONGLONG, offsetof(EngineGate, dropped), READONLY,
     "Arms dropped as stale (their step had closed)."},
    {"closed", T_ULONGLONG, offsetof(EngineGate, closed), READONLY,
     "Exposed waits ended when a backward returned (close_waits)."},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef EngineGate_getset[] = {
    {"armed", (getter)EngineGate_get_armed, NULL, "Hooks armed now.", NULL},
    {"closing", (getter)EngineGate_get_closing, NULL, "Stamps whose waits end here.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject EngineGateType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "stepwatch.exporters._fastrecord.EngineGate",
    .tp_basicsize = sizeof(EngineGate),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "EngineGate(run_backward): run_backward with armed backward-start hooks called "
              "first (see the comment).",
    .tp_new = EngineGate_new,
    .tp_call = EngineGate_call,
    .tp_dealloc = (destructor)EngineGate_dealloc,
    .tp_traverse = (traverseproc)EngineGate_traverse,
    .tp_clear = (inquiry)EngineGate_clear,
    .tp_methods = EngineGate_methods,
    .tp_members = EngineGate_members,
    .tp_getset = EngineGate_getset,
};
