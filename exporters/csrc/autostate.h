/* the auto-mode state's attributes, read and written in its __dict__ by the gates (included by fastrecord.c). */

/* ------------------------------------------------------------------ the state's attributes */

/* The auto-mode state (_auto._AutoState, exact type: no property, no __slots__) keeps the hooks'
 * variables as plain instance attributes; the gates' timed paths read and write them in its
 * __dict__ directly, as the Python methods do through attribute access. */
static PyObject *str_forward_depth, *str_forward_start_ns, *str_thread_id, *str_backward_hooks;
static PyObject *str_optimizer_start_ns, *str_backward_start_ns, *str_forward, *str_backward;
static PyObject *str_optimizer, *str_requires_grad, *str_backward_hooks_attr, *str_grad_fn;
static PyObject *str_register_hook_dict, *str_forward_post, *str_hook_output, *str_post_failed;
static PyObject *str_forward_failed, *str_enabled, *str_in_backward, *str_data_start_ns, *str_data;
/* DeviceAutoState's marks (_auto_device): the same attributes, read and written in C too. */
static PyObject *str_forward_mark, *str_backward_mark, *str_optimizer_mark, *str_data_mark;
static PyObject *str_mark_key, *str_mark_msg, *str_recorder, *str_nested_call;

/* The state's __dict__ (borrowed), or NULL (no exception) when it has none. */
static PyObject *state_dict(PyObject *state) {
    PyObject *dict = state == NULL ? NULL : instance_dict(state);
    return dict == NULL || !PyDict_CheckExact(dict) ? NULL : dict;
}

/* dict[name] as a truth value: 1/0, or -1 (no exception) when missing or not a bool. */
static int dict_flag(PyObject *dict, PyObject *name) {
    PyObject *value = PyDict_GetItemWithError(dict, name); /* borrowed */
    if (value == Py_True) {
        return 1;
    }
    if (value == Py_False) {
        return 0;
    }
    PyErr_Clear();
    return -1;
}

/* dict[name] as a C long long: 0, or -1 (no exception) when missing or not an exact int. */
static int dict_ll(PyObject *dict, PyObject *name, long long *out) {
    PyObject *value = PyDict_GetItemWithError(dict, name); /* borrowed */
    if (value == NULL || !PyLong_CheckExact(value)) {
        PyErr_Clear();
        return -1;
    }
    int overflow = 0;
    *out = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (overflow || (*out == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return -1;
    }
    return 0;
}

/* dict[name] = an int; -1 with an exception set. */
static int dict_set_ll(PyObject *dict, PyObject *name, long long value) {
    PyObject *number = PyLong_FromLongLong(value);
    if (number == NULL) {
        return -1;
    }
    int failed = PyDict_SetItem(dict, name, number);
    Py_DECREF(number);
    return failed;
}

/* add_to(phases, name, elapsed ns) for an elapsed time in C; -1 with an exception set. */
static int add_ns(PyObject *phases, PyObject *name, long long elapsed) {
    PyObject *number = PyLong_FromLongLong(elapsed);
    PyObject *added = number == NULL ? NULL : add_to(phases, name, number);
    Py_XDECREF(number);
    if (added == NULL) {
        return -1;
    }
    Py_DECREF(added);
    return 0;
}

/* A last-gradient stamp: a ClockStamp, or a MarkStamp (the same layout up to ``ns``). */
static int is_stamp(PyObject *object) {
    return PyObject_TypeCheck(object, &ClockStampType) || PyObject_TypeCheck(object, &MarkStampType);
}

/* The mark a MarkStamp took with its time (borrowed), or NULL for a ClockStamp. */
static PyObject *stamp_mark(ClockStamp *stamp) {
    return PyObject_TypeCheck((PyObject *)stamp, &MarkStampType) ? ((MarkStamp *)stamp)->mark
                                                                 : NULL;
}

/* device.mark() taken before anything changed: a new reference, or NULL with no exception set
 * (the Python hook then runs, takes it again and reports what went wrong). */
static PyObject *take_mark(PyObject *device) {
    PyObject *mark = PyObject_CallMethodNoArgs(device, str_mark);
    if (mark == NULL) {
        PyErr_Clear();
    }
    return mark;
}

/* device.mark() taken once the state has changed: a new reference, or NULL reported as the
 * Python hooks report it (misuse "device-mark"); that phase keeps its host time alone. */
static PyObject *mark_or_report(PyObject *device, PyObject *recorder) {
    PyObject *mark = PyObject_CallMethodNoArgs(device, str_mark);
    if (mark == NULL) {
        report_misuse(recorder, str_mark_key, str_mark_msg, 1);
    }
    return mark;
}

/* The open step's device interval (start, end) of phase ``name``: every step's (sampled 0,
 * add_device_phase) or a sampled step's auto phase (add_sampled_device_phase). Nothing where
 * either mark is missing. -1 with an exception set. */
static int device_interval(RecorderCore *recorder, int sampled, PyObject *name, PyObject *start,
                           PyObject *end) {
    if (start == NULL || end == NULL || start == Py_None || end == Py_None) {
        return 0;
    }
    PyObject *args[3] = {name, start, end};
    PyObject *done = sampled ? RecorderCore_add_sampled_device_phase(recorder, args, 3)
                             : RecorderCore_add_device_phase(recorder, args, 3);
    Py_XDECREF(done);
    return done == NULL ? -1 : 0;
}
