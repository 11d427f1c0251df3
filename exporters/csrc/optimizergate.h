/* OptimizerGate: auto mode's optimizer step hooks in C (included by fastrecord.c). */

/* ------------------------------------------------------------------ OptimizerGate */

/* Auto mode's optimizer step hooks (_auto._AutoState.optimizer_pre / optimizer_post) with their
 * path for a step whose phases are not timed in C, so that such a step enters no Python frame
 * of stepwatch's in optimizer.step() (issue 15):
 *
 * - pre: the exposed wait since the last gradient's ClockStamp is added to the step's
 *   "communication" (add_phase_ns) and the stamp reset, as _AutoState._close_wait does;
 * - post: nothing when the loop marks its steps and no collective was timed.
 *
 * A sampled step, or anything else, calls the Python hook (slow). ``active`` is cleared when
 * the instrumentation is removed (the state's ``enabled``); a copy (copy.deepcopy of an
 * optimizer) is inert, as the state's copy is. */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    RecorderCore *recorder; /* NULL: inert */
    ClockStamp *stamp;      /* pre: the last-gradient stamp */
    PyObject *slow;         /* the Python hook */
    PyObject *comm_starts;  /* post: the state's list of issued collectives */
    PyObject *name;         /* pre: "communication" */
    PyObject *state;        /* the auto-mode state for a timed step's path, or NULL: slow */
    PyObject *device;       /* DeviceAutoState's device timer (marks, as its hooks take), or NULL */
    PyObject *partner;      /* post: the pre gate, which keeps the count of open calls; or NULL */
    long long calls;        /* pre: the optimizer's step() calls open (_opthooks), kept here and
                             * not in the state's __dict__: a dict the hook would touch on every
                             * step, cold after the optimizer's own pass over memory */
    /* pre, with hide_post(post): the post gate out of torch's loop on untimed steps (post_out) */
    PyObject *post_gate;    /* the partner post gate, or NULL: never hidden */
    PyObject *post_owner;   /* the one optimizer whose post hooks are hidden, or NULL */
    PyObject *post_real;    /* its post-hook dict, while post_out */
    PyObject *post_empty;   /* the empty dict of the same type standing in for it */
    char post_out;          /* the empty dict is installed */
    char post_never;        /* hiding given up (another optimizer, other hooks, a change) */
    char is_pre;
    char active;
    /* pre, with hide_pre(): itself out of torch's pre-hook loop on untimed steps, where the
     * autograd engine's gate ends the exposed wait (enginegate.h), as the post gate above */
    char pre_hideable;
    char pre_out;
    char pre_never;
    PyObject *pre_real;     /* the optimizer's pre-hook dict, while pre_out */
    PyObject *pre_empty;    /* its stand-in */
} OptimizerGate;

static PyTypeObject OptimizerGateType;

static PyObject *str_auto_key, *str_pre_failed;

/* The step boundary of auto steps at ``now`` (the post-hook's one clock read): this step's
 * end, the next one's start and the data phase's start. -1 with an exception set. */
static int auto_boundary(RecorderCore *recorder, PyObject *dict, long long now) {
    PyObject *now_object = PyLong_FromLongLong(now);
    if (now_object == NULL) {
        return -1;
    }
    PyObject *ended = do_end(recorder, 0, now_object);
    PyObject *begun = ended == NULL ? NULL : do_begin(recorder, 0, now_object);
    int failed = begun == NULL || PyDict_SetItem(dict, str_data_start_ns, now_object) < 0;
    Py_XDECREF(ended);
    Py_XDECREF(begun);
    Py_DECREF(now_object);
    return failed ? -1 : 0;
}

/* A step's optimizer hook in C, as _AutoState.optimizer_pre / optimizer_post do it: 1 done,
 * 0 not taken (the Python hook runs: anything unusual, nothing changed yet), -1 failed
 * part-way with an exception set (reported as the hook would). The pre-hook (a timed step)
 * opens the optimizer phase, ends an open backward and the exposed wait since the last
 * gradient; the post-hook (a timed step, or any auto step) closes the optimizer phase and, in
 * auto steps, marks the step boundary, where no collective was timed. */
static int optimizer_timed(OptimizerGate *self, RecorderCore *recorder) {
    PyObject *dict = state_dict(self->state);
    if (dict == NULL || dict_flag(dict, str_enabled) != 1) {
        return 0;
    }
    long long now;
    PyObject *mark = NULL; /* with a device timer: this hook's mark */
    int result = 1;
    if (self->is_pre) {
        int in_backward = dict_flag(dict, str_in_backward);
        long long backward_start = 0;
        PyObject *backward_mark = NULL; /* borrowed */
        if (self->stamp == NULL || in_backward < 0 ||
            (in_backward && dict_ll(dict, str_backward_start_ns, &backward_start) < 0) ||
            monotonic_ns(&now) != 0) {
            return 0;
        }
        if (self->device != NULL) {
            /* DeviceAutoState.optimizer_pre: the optimizer's start mark ends the backward and
             * the exposed wait on the device too. */
            if (in_backward &&
                (backward_mark = PyDict_GetItemWithError(dict, str_backward_mark)) == NULL) {
                PyErr_Clear();
                return 0;
            }
            Py_XINCREF(backward_mark);
            if ((mark = take_mark(self->device)) == NULL) {
                Py_XDECREF(backward_mark);
                return 0;
            }
            if (PyDict_SetItem(dict, str_optimizer_mark, mark) < 0) {
                Py_XDECREF(backward_mark);
                goto failed;
            }
        }
        if (dict_set_ll(dict, str_optimizer_start_ns, now) < 0) {
            Py_XDECREF(backward_mark);
            goto failed;
        }
        if (in_backward) {
            int failed = PyDict_SetItem(dict, str_in_backward, Py_False) < 0 ||
                         add_ns(recorder->sampled_ns, str_backward, now - backward_start) < 0 ||
                         device_interval(recorder, 1, str_backward, backward_mark, mark) < 0 ||
                         (mark != NULL && PyDict_SetItem(dict, str_backward_mark, Py_None) < 0);
            Py_XDECREF(backward_mark);
            if (failed) {
                goto failed;
            }
        }
        long long last = self->stamp->ns;
        if (last != 0) {
            self->stamp->ns = 0;
            if (device_interval(recorder, 0, self->name, stamp_mark(self->stamp), mark) < 0 ||
                (now > last && add_ns(recorder->phases_ns, self->name, now - last) < 0)) {
                goto failed;
            }
        }
        goto done;
    }
    if (self->comm_starts == NULL || !PyList_CheckExact(self->comm_starts) ||
        PyList_GET_SIZE(self->comm_starts) != 0) {
        return 0;
    }
    PyObject *start_object = PyDict_GetItemWithError(dict, str_optimizer_start_ns);
    long long start = 0;
    if (start_object == NULL || (start_object != Py_None && dict_ll(dict, str_optimizer_start_ns,
                                                                    &start) < 0) ||
        monotonic_ns(&now) != 0) {
        PyErr_Clear();
        return 0;
    }
    PyObject *optimizer_mark = NULL;
    if (self->device != NULL) {
        /* DeviceAutoState.optimizer_post: the optimizer phase on the device, and an auto step's
         * data phase starts at the new step's start mark. */
        optimizer_mark = PyDict_GetItemWithError(dict, str_optimizer_mark);
        if (optimizer_mark == NULL) {
            PyErr_Clear();
            return 0;
        }
        if (optimizer_mark != Py_None) {
            if ((mark = take_mark(self->device)) == NULL) {
                return 0;
            }
            Py_INCREF(optimizer_mark);
            int failed = device_interval(recorder, 1, str_optimizer, optimizer_mark, mark) < 0 ||
                         PyDict_SetItem(dict, str_optimizer_mark, Py_None) < 0;
            Py_DECREF(optimizer_mark);
            if (failed) {
                goto failed;
            }
        }
    }
    if (start_object != Py_None) {
        if (add_ns(recorder->sampled_ns, str_optimizer, now - start) < 0 ||
            PyDict_SetItem(dict, str_optimizer_start_ns, Py_None) < 0) {
            goto failed;
        }
    }
    if (!recorder->explicit_steps && recorder->step_depth > 0) {
        if (auto_boundary(recorder, dict, now) < 0) {
            goto failed;
        }
        if (self->device != NULL &&
            PyDict_SetItem(dict, str_data_mark, recorder->step_start_mark != NULL
                                                    ? recorder->step_start_mark
                                                    : Py_None) < 0) {
            goto failed;
        }
    }
    goto done;
failed:
    result = -1;
done:
    Py_XDECREF(mark);
    return result;
}

/* Hiding the post gate (issue 15, cold memory). On a step whose phases are not timed, in a
 * loop that marks its steps, with no collective timed, the post gate has nothing to do; yet
 * torch calling it at all (its loop over the post hooks, the call) costs ~1.4-1.7 us at 1024
 * wide. So where the optimizer's post-hook dict holds the post gate alone, the pre gate of such
 * a step installs an empty dict of the same type in its place (``_optimizer_step_post_hooks``:
 * torch reads it after the step, so this call's loop already sees it), and puts the dict back
 * at the first step that needs it. While hidden, the pre gate keeps no count (no post gate
 * takes it back). A hook registered meanwhile went into the empty dict: that dict becomes the
 * optimizer's, the post gate first in it, and hiding stops (the hook's handle refers to it);
 * so does a dict someone else installed, another optimizer, or a post-hook dict with other
 * hooks. */
/* One of torch's hook dicts on ``owner`` (``attr``) holding ``gate`` alone, out of torch's
 * loop: the stand-in (an empty dict of its type) installed in its place (1), or not (0, with
 * *never set where hiding must stop). */
static int stand_in_install(PyObject *owner, PyObject *attr, PyObject *gate, PyObject **real,
                            PyObject **empty, char *out, char *never) {
    PyObject *hooks = PyObject_GetAttr(owner, attr);
    if (hooks == NULL) {
        PyErr_Clear();
        *never = 1;
        return 0;
    }
    PyObject *key = NULL, *value = NULL;
    Py_ssize_t position = 0;
    int alone = PyDict_Check(hooks) && PyDict_GET_SIZE(hooks) == 1 &&
                PyDict_Next(hooks, &position, &key, &value) && value == gate;
    if (!alone) {
        Py_DECREF(hooks);
        *never = 1;
        return 0;
    }
    if (*empty == NULL) {
        *empty = PyObject_CallNoArgs((PyObject *)Py_TYPE(hooks));
    }
    if (*empty == NULL || !PyDict_Check(*empty) || PyDict_GET_SIZE(*empty) != 0 ||
        PyObject_SetAttr(owner, attr, *empty) < 0) {
        PyErr_Clear();
        Py_DECREF(hooks);
        *never = 1;
        return 0;
    }
    Py_XSETREF(*real, hooks);
    *out = 1;
    return 1;
}

/* The dict back in place of its stand-in. A hook registered meanwhile went into the stand-in:
 * that dict becomes the owner's, ``gate`` put back first in it, and hiding stops (the hook's
 * handle refers to it); so does a dict someone else installed. */
static void stand_in_restore(PyObject *owner, PyObject *attr, PyObject *gate, PyObject **real_slot,
                             PyObject **empty_slot, char *out, char *never) {
    if (!*out) {
        return;
    }
    *out = 0;
    PyObject *empty = *empty_slot, *real = *real_slot;
    PyObject *current = owner == NULL ? NULL : PyObject_GetAttr(owner, attr);
    if (current == NULL) {
        PyErr_Clear();
        *never = 1;
    } else if (current != empty) {
        *never = 1; /* someone else's dict now: theirs stays */
    } else if (PyDict_GET_SIZE(empty) == 0) {
        if (PyObject_SetAttr(owner, attr, real) < 0) {
            PyErr_Clear();
            *never = 1;
        }
    } else {
        /* Hooks registered while hidden: keep their dict (their handles refer to it), with the
         * gate put back first, as it was registered before them. */
        PyObject *key = NULL, *value = NULL, *gate_key = NULL;
        Py_ssize_t position = 0;
        while (real != NULL && PyDict_Next(real, &position, &key, &value)) {
            if (value == gate) {
                gate_key = key;
                break;
            }
        }
        PyObject *done = NULL;
        if (gate_key != NULL && PyObject_SetItem(empty, gate_key, gate) == 0) {
            done = PyObject_CallMethod(empty, "move_to_end", "OO", gate_key, Py_False);
            if (done == NULL && PyErr_ExceptionMatches(PyExc_AttributeError)) {
                PyErr_Clear(); /* a plain dict: the gate runs last, still runs */
                done = Py_None;
                Py_INCREF(done);
            }
        }
        Py_XDECREF(done);
        PyErr_Clear();
        *never = 1;
        Py_CLEAR(*empty_slot); /* the owner's dict now */
    }
    Py_XDECREF(current);
    Py_CLEAR(*real_slot);
}

static void hidden_post_restore(OptimizerGate *self) {
    stand_in_restore(self->post_owner, str_post_hooks, self->post_gate, &self->post_real,
                     &self->post_empty, &self->post_out, &self->post_never);
}

/* Hiding the pre gate (issue 15). Where the autograd engine's gate ends the exposed wait when
 * the backward returns (EngineGate.close_waits), an untimed step's pre gate finds nothing to
 * do, but torch's loop calling it still costs ~1.1-1.6 us at 1024 wide. So the pre gate of such
 * a step, its post gate already out, puts a stand-in in place of the pre-hook dict as well, and
 * names itself to the recorder (hidden_pre): the begin of the next step that needs the optimizer
 * hooks (a timed one, an auto one) puts the dict back, before the optimizer is called. A wait
 * the pre gate still finds (a backward that did not pass the engine's gate) stops the hiding. */
static void hidden_pre_restore(OptimizerGate *self) {
    stand_in_restore(self->post_owner, str_pre_hooks, (PyObject *)self, &self->pre_real,
                     &self->pre_empty, &self->pre_out, &self->pre_never);
    RecorderCore *recorder = self->recorder;
    if (recorder != NULL && recorder->hidden_pre == (PyObject *)self) {
        Py_CLEAR(recorder->hidden_pre);
    }
}

/* At a step's begin (no backward runs then): a last-gradient stamp still set is a wait the
 * engine's gate did not end (a backward that did not pass it); it is dropped, not counted up to
 * this step's optimizer, and the pre gate stays in torch's loop from now on. */
static void restore_hidden_pre(RecorderCore *self) {
    PyObject *gate = self->hidden_pre;
    self->hidden_pre = NULL;
    if (gate != NULL && PyObject_TypeCheck(gate, &OptimizerGateType)) {
        OptimizerGate *pre = (OptimizerGate *)gate;
        if (pre->stamp != NULL && pre->stamp->ns != 0) {
            pre->stamp->ns = 0;
            pre->pre_never = 1;
        }
        hidden_pre_restore(pre);
    }
    Py_XDECREF(gate);
}

/* On an untimed step whose post gate is out (``hidden``): the pre gate out too, where it may. */
static void hide_pre(OptimizerGate *self, RecorderCore *recorder) {
    if (!self->pre_hideable || self->pre_out || self->pre_never || self->post_owner == NULL ||
        (recorder->hidden_pre != NULL && recorder->hidden_pre != (PyObject *)self)) {
        return;
    }
    if (stand_in_install(self->post_owner, str_pre_hooks, (PyObject *)self, &self->pre_real,
                         &self->pre_empty, &self->pre_out, &self->pre_never)) {
        Py_INCREF(self);
        Py_XSETREF(recorder->hidden_pre, (PyObject *)self);
    }
}

/* 1 when the post gate is out of this call's loop (see above), 0 otherwise. */
static int hidden_post(OptimizerGate *self, RecorderCore *recorder, PyObject *const *args,
                       Py_ssize_t nargs) {
    if (self->post_gate == NULL || self->post_never) {
        return 0;
    }
    PyObject *optimizer = nargs >= 1 ? args[0] : NULL;
    OptimizerGate *post = (OptimizerGate *)self->post_gate;
    int idle = !recorder->sampled && recorder->explicit_steps && self->calls == 0 &&
               optimizer != NULL && post->comm_starts != NULL &&
               PyList_CheckExact(post->comm_starts) && PyList_GET_SIZE(post->comm_starts) == 0;
    if (!idle) {
        hidden_post_restore(self);
        return 0;
    }
    if (self->post_out) {
        if (optimizer == self->post_owner) {
            return 1;
        }
        hidden_post_restore(self); /* a second optimizer: not worth telling apart */
        self->post_never = 1;
        return 0;
    }
    if (self->post_owner != NULL && optimizer != self->post_owner) {
        self->post_never = 1; /* a second optimizer: not worth telling apart */
        return 0;
    }
    if (!stand_in_install(optimizer, str_post_hooks, self->post_gate, &self->post_real,
                          &self->post_empty, &self->post_out, &self->post_never)) {
        return 0;
    }
    if (self->post_owner == NULL) {
        Py_INCREF(optimizer);
        self->post_owner = optimizer;
    }
    return 1;
}

/* _opthooks.outer_pre / outer_post on the count of open step() calls the pre gate keeps
 * (``calls``; a post gate reaches it through ``partner``): 1 when this hook is the outermost
 * call's (it acts), 0 when a nested call's (nothing to do). The state's
 * ``nested_call(optimizer)`` is asked only with calls already open. A post gate without a
 * partner keeps no count and acts. */
static int outermost_call(OptimizerGate *self, PyObject *const *args, Py_ssize_t nargs) {
    OptimizerGate *owner = self->is_pre ? self : (OptimizerGate *)self->partner;
    if (owner == NULL) {
        return 1;
    }
    long long calls = owner->calls;
    if (self->is_pre) {
        if (calls > 0 && nargs >= 1) {
            PyObject *dict = state_dict(self->state);
            PyObject *check = dict == NULL ? NULL : PyDict_GetItemWithError(dict, str_nested_call);
            PyObject *answer = check == NULL ? NULL : PyObject_CallOneArg(check, args[0]);
            int is_nested = answer == NULL ? 0 : PyObject_IsTrue(answer);
            Py_XDECREF(answer);
            PyErr_Clear();
            if (is_nested == 1) {
                owner->calls = calls + 1;
                return 0;
            }
        }
        owner->calls = 1;
        return 1;
    }
    if (calls > 1) {
        owner->calls = calls - 1;
        return 0;
    }
    owner->calls = 0;
    return 1;
}

static PyObject *OptimizerGate_vectorcall(PyObject *callable, PyObject *const *args,
                                          size_t nargsf, PyObject *kwnames) {
    OptimizerGate *self = (OptimizerGate *)callable;
    RecorderCore *recorder = self->recorder;
    if (!self->active || recorder == NULL) {
        Py_RETURN_NONE;
    }
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    int hidden = self->is_pre && hidden_post(self, recorder, args, nargs);
    if (!hidden && !outermost_call(self, args, nargs)) {
        Py_RETURN_NONE;
    }
    if (recorder->sampled || (!self->is_pre && !recorder->explicit_steps)) {
        int done = optimizer_timed(self, recorder);
        if (done == 1) {
            Py_RETURN_NONE;
        }
        if (done < 0) {
            report_misuse((PyObject *)recorder, str_auto_key,
                          self->is_pre ? str_pre_failed : str_post_failed, 1);
            Py_RETURN_NONE;
        }
        return PyObject_Vectorcall(self->slow, args, nargsf, kwnames);
    }
    if (self->is_pre) {
        if (self->stamp == NULL) {
            return PyObject_Vectorcall(self->slow, args, nargsf, kwnames);
        }
        long long last = self->stamp->ns;
        if (last == 0) {
            if (hidden) {
                hide_pre(self, recorder);
            }
            Py_RETURN_NONE;
        }
        self->pre_never = 1; /* a wait left for this gate: it stays in torch's loop */
        long long now;
        /* With a device timer (DeviceAutoState._close_wait) the wait ends at a mark too. */
        PyObject *end = NULL;
        if ((self->device != NULL && (end = take_mark(self->device)) == NULL) ||
            monotonic_ns(&now) != 0) {
            Py_XDECREF(end);
            return PyObject_Vectorcall(self->slow, args, nargsf, kwnames);
        }
        self->stamp->ns = 0;
        if (end == NULL) {
            /* The host clock's wait: kept in the recorder's struct, into the phase dict at the
             * step's end (fold_wait), so that this hook touches no dict or int object. */
            if (now > last) {
                recorder->wait_ns += now - last;
            }
        } else if (device_interval(recorder, 0, self->name, stamp_mark(self->stamp), end) < 0 ||
                   (now > last && add_ns(recorder->phases_ns, self->name, now - last) < 0)) {
            report_misuse((PyObject *)recorder, str_auto_key, str_pre_failed, 1);
        }
        Py_XDECREF(end);
        Py_RETURN_NONE;
    }
    if (!recorder->sampled && recorder->explicit_steps && self->comm_starts != NULL &&
        PyList_CheckExact(self->comm_starts) && PyList_GET_SIZE(self->comm_starts) == 0) {
        Py_RETURN_NONE;
    }
    return PyObject_Vectorcall(self->slow, args, nargsf, kwnames);
}

static PyObject *OptimizerGate_call(PyObject *self, PyObject *args, PyObject *kwargs) {
    return PyVectorcall_Call(self, args, kwargs);
}

/* OptimizerGate(kind, recorder, slow, stamp_or_comm_starts[, state[, device[, partner]]]): kind
 * "pre" (a ClockStamp; a MarkStamp with a device) or "post" (the list of issued collectives;
 * ``partner``: the pre gate, which keeps the count of open step() calls). */
static PyObject *OptimizerGate_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    const char *kind;
    PyObject *recorder, *slow, *extra, *state = NULL, *device = NULL, *partner = NULL;
    if ((kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0) ||
        !PyArg_ParseTuple(args, "sO!OO|OOO:OptimizerGate", &kind, &RecorderCoreType, &recorder,
                          &slow, &extra, &state, &device, &partner)) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError, "OptimizerGate(kind, recorder, slow, extra)");
        }
        return NULL;
    }
    int is_pre = strcmp(kind, "pre") == 0;
    if (!is_pre && strcmp(kind, "post") != 0) {
        PyErr_SetString(PyExc_ValueError, "kind must be 'pre' or 'post'");
        return NULL;
    }
    if (device == Py_None) {
        device = NULL;
    }
    if (partner == Py_None) {
        partner = NULL;
    }
    if (partner != NULL && (is_pre || !PyObject_TypeCheck(partner, &OptimizerGateType) ||
                            !((OptimizerGate *)partner)->is_pre)) {
        PyErr_SetString(PyExc_TypeError, "a post gate's partner is its pre gate");
        return NULL;
    }
    if (is_pre ? !(device == NULL ? PyObject_TypeCheck(extra, &ClockStampType)
                                  : PyObject_TypeCheck(extra, &MarkStampType))
               : !PyList_CheckExact(extra)) {
        PyErr_SetString(PyExc_TypeError,
                        is_pre ? "a pre gate needs the ClockStamp (a MarkStamp with a device)"
                               : "a post gate needs the list of collectives");
        return NULL;
    }
    if (device != NULL && (state == NULL || state == Py_None)) {
        PyErr_SetString(PyExc_TypeError, "a gate with a device timer needs the state");
        return NULL;
    }
    if (!PyCallable_Check(slow)) {
        PyErr_SetString(PyExc_TypeError, "slow must be callable");
        return NULL;
    }
    OptimizerGate *self = (OptimizerGate *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->vectorcall = OptimizerGate_vectorcall;
    self->is_pre = (char)is_pre;
    self->active = 1;
    if (state != NULL && state != Py_None) {
        Py_INCREF(state);
        self->state = state;
    }
    Py_XINCREF(device);
    self->device = device;
    Py_XINCREF(partner);
    self->partner = partner;
    Py_INCREF(recorder);
    self->recorder = (RecorderCore *)recorder;
    Py_INCREF(slow);
    self->slow = slow;
    Py_INCREF(extra);
    if (is_pre) {
        self->stamp = (ClockStamp *)extra;
        self->name = PyUnicode_InternFromString("communication");
        if (self->name == NULL) {
            Py_DECREF(self);
            return NULL;
        }
    } else {
        self->comm_starts = extra;
    }
    return (PyObject *)self;
}

static int OptimizerGate_traverse(OptimizerGate *self, visitproc visit, void *arg) {
    Py_VISIT(self->recorder);
    Py_VISIT(self->stamp);
    Py_VISIT(self->slow);
    Py_VISIT(self->comm_starts);
    Py_VISIT(self->state);
    Py_VISIT(self->device);
    Py_VISIT(self->partner);
    Py_VISIT(self->post_gate);
    Py_VISIT(self->post_owner);
    Py_VISIT(self->post_real);
    Py_VISIT(self->post_empty);
    Py_VISIT(self->pre_real);
    Py_VISIT(self->pre_empty);
    return 0;
}

static int OptimizerGate_clear(OptimizerGate *self) {
    Py_CLEAR(self->recorder);
    Py_CLEAR(self->stamp);
    Py_CLEAR(self->slow);
    Py_CLEAR(self->comm_starts);
    Py_CLEAR(self->name);
    Py_CLEAR(self->state);
    Py_CLEAR(self->device);
    Py_CLEAR(self->partner);
    Py_CLEAR(self->post_gate);
    Py_CLEAR(self->post_owner);
    Py_CLEAR(self->post_real);
    Py_CLEAR(self->post_empty);
    self->post_out = 0;
    Py_CLEAR(self->pre_real);
    Py_CLEAR(self->pre_empty);
    self->pre_out = 0;
    return 0;
}

static void OptimizerGate_dealloc(OptimizerGate *self) {
    PyObject_GC_UnTrack(self);
    OptimizerGate_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* A copy is inert (no recorder): the copy of an instrumented optimizer is not instrumented. */
static PyObject *OptimizerGate_copy(OptimizerGate *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)args;
    (void)nargs;
    OptimizerGate *copy = (OptimizerGate *)OptimizerGateType.tp_alloc(&OptimizerGateType, 0);
    if (copy != NULL) {
        copy->vectorcall = OptimizerGate_vectorcall;
        copy->is_pre = self->is_pre;
        copy->active = 0;
    }
    return (PyObject *)copy;
}

/* pre.hide_post(post): let this pre gate hide ``post`` on untimed steps (above). */
static PyObject *OptimizerGate_hide_post(OptimizerGate *self, PyObject *post) {
    if (!self->is_pre || !PyObject_TypeCheck(post, &OptimizerGateType) ||
        ((OptimizerGate *)post)->is_pre || ((OptimizerGate *)post)->partner != (PyObject *)self) {
        PyErr_SetString(PyExc_TypeError, "hide_post: a pre gate hides its own post gate");
        return NULL;
    }
    hidden_post_restore(self);
    Py_INCREF(post);
    Py_XSETREF(self->post_gate, post);
    self->post_never = 0;
    Py_RETURN_NONE;
}

/* pre.hide_pre(): the autograd engine's gate ends the exposed wait (EngineGate.close_waits), so
 * this pre gate may leave torch's loop on untimed steps (above). */
static PyObject *OptimizerGate_hide_pre(OptimizerGate *self, PyObject *unused) {
    (void)unused;
    if (!self->is_pre || self->device != NULL) {
        PyErr_SetString(PyExc_TypeError, "hide_pre: a pre gate on the host clock only");
        return NULL;
    }
    self->pre_hideable = 1;
    self->pre_never = 0;
    Py_RETURN_NONE;
}

static PyObject *OptimizerGate_get_active(OptimizerGate *self, void *closure) {
    (void)closure;
    return PyBool_FromLong(self->active);
}

/* Cleared when the instrumentation is removed: a hidden post gate's dict goes back first. */
static int OptimizerGate_set_active(OptimizerGate *self, PyObject *value, void *closure) {
    (void)closure;
    int truth = value == NULL ? -1 : PyObject_IsTrue(value);
    if (truth < 0) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError, "active cannot be deleted");
        }
        return -1;
    }
    if (!truth) {
        hidden_pre_restore(self);
        self->pre_never = 1;
        hidden_post_restore(self);
        self->post_never = 1;
        Py_CLEAR(self->post_owner); /* the optimizer is not held past the instrumentation */
        Py_CLEAR(self->post_empty);
    }
    self->active = (char)truth;
    return 0;
}

static PyObject *OptimizerGate_get_post_hidden(OptimizerGate *self, void *closure) {
    (void)closure;
    return PyBool_FromLong(self->post_out);
}

static PyObject *OptimizerGate_get_pre_hidden(OptimizerGate *self, void *closure) {
    (void)closure;
    return PyBool_FromLong(self->pre_out);
}

static PyGetSetDef OptimizerGate_getset[] = {
    {"active", (getter)OptimizerGate_get_active, (setter)OptimizerGate_set_active,
     "False once the instrumentation is removed: the gate does nothing", NULL},
    {"post_hidden", (getter)OptimizerGate_get_post_hidden, NULL,
     "A pre gate's post gate is out of torch's post-hook loop now (untimed steps)", NULL},
    {"pre_hidden", (getter)OptimizerGate_get_pre_hidden, NULL,
     "A pre gate is out of torch's pre-hook loop now (untimed steps; hide_pre)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef OptimizerGate_methods[] = {
    {"hide_post", (PyCFunction)OptimizerGate_hide_post, METH_O,
     "hide_post(post): hide this pre gate's post gate from torch on untimed steps."},
    {"hide_pre", (PyCFunction)OptimizerGate_hide_pre, METH_NOARGS,
     "hide_pre(): let this pre gate leave torch's loop on untimed steps (the engine's gate "
     "ends the exposed wait)."},
    {"__copy__", (PyCFunction)(void (*)(void))OptimizerGate_copy, METH_FASTCALL,
     "An inert gate."},
    {"__deepcopy__", (PyCFunction)(void (*)(void))OptimizerGate_copy, METH_FASTCALL,
     "An inert gate."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef OptimizerGate_members[] = {
    {"slow", T_OBJECT, offsetof(OptimizerGate, slow), READONLY, "The Python hook"},
    {"calls", T_LONGLONG, offsetof(OptimizerGate, calls), 0,
     "A pre gate's count of its optimizer's open step() calls (_opthooks)"},
    {"partner", T_OBJECT, offsetof(OptimizerGate, partner), READONLY,
     "A post gate's pre gate (the count's keeper), or None"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject OptimizerGateType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "stepwatch.exporters._fastrecord.OptimizerGate",
    .tp_basicsize = sizeof(OptimizerGate),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "An auto-mode optimizer hook whose untimed-step path is C (see the comment).",
    .tp_new = OptimizerGate_new,
    .tp_call = OptimizerGate_call,
    .tp_vectorcall_offset = offsetof(OptimizerGate, vectorcall),
    .tp_dealloc = (destructor)OptimizerGate_dealloc,
    .tp_traverse = (traverseproc)OptimizerGate_traverse,
    .tp_clear = (inquiry)OptimizerGate_clear,
    .tp_methods = OptimizerGate_methods,
    .tp_members = OptimizerGate_members,
    .tp_getset = OptimizerGate_getset,
};
