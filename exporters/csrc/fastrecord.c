/* stepwatch.exporters._fastrecord: the training thread's step and phase bookkeeping in C.
 *
 * The Python StepRecorder (exporters/src/stepwatch/exporters/_recorder.py) opens and closes
 * steps and adds phase time on the training thread, between the model's kernels. What costs
 * there is not the work, a few dict and list operations, but how many Python frames a step
 * enters: each runs with its code and data evicted from the CPU caches by the model. This
 * module gives the recorder the same operations without a Python frame:
 *
 * - RecorderCore: a base class holding the recorder's hot state in a C struct (the attributes
 *   keep their Python names, as member descriptors), with begin_step() and end_step() in C;
 * - StepContext and PhaseContext: the contexts monitor.step() and monitor.phase() return;
 * - ClockStamp: a callable that takes the time (auto mode's last-gradient hook);
 * - OptimizerGate, ForwardGate, BackwardStart: auto mode's hooks (_auto.py), steps timed or
 *   not, marked by the loop or by auto mode, on the auto-mode state's own attributes;
 *   anything unusual goes to the Python hooks;
 * - the class swap at each step's start (swap_forward_classes): the model's own class on a
 *   step whose phases are not timed;
 * - StepBuffer (stepbuffer.h): the finished steps, a deque to the export thread, plain C slots
 *   to a host-timed step's end (compact_end);
 * - EngineGate (enginegate.h): the autograd engine's run_backward, where a timed forward arms
 *   the backward-start hook instead of hooking its output.
 *
 * The C code takes the common case only: a step not already open (or, at its end, the
 * outermost one), a buffer with room, a clock that answers with an int, a device timer (if
 * any) whose mark() answers. Anything else (misuse, a full buffer, a clock or a mark() that
 * raises, a sampler that is not a plain PhaseSampler) is handed, before any state changes, to
 * the Python methods, which log and count it. With a device timer a step takes a mark at each
 * end, as the Python path does (issue 15: on an H100 the Python step boundary was most of what
 * device timing cost the training thread). So both paths leave the same records and counters; tests run the recorder's suite
 * on each (tests/exporters/test_fastrecord.py). configure() hands the module what it needs
 * from Python once at import.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <structmember.h>
#include <time.h>

/* Set by configure(): the Python slow paths and what the records refer to. */
static PyObject *py_begin_step;  /* the pure-Python StepRecorder.begin_step */
static PyObject *py_end_step;    /* the pure-Python StepRecorder.end_step */
static PyObject *unsampled;      /* _recorder.UNSAMPLED (compared by identity) */
static PyTypeObject *sampler_type; /* _sampling.PhaseSampler (exact type) */
/* Bumped by sampler_changed() whenever a PhaseSampler's stride is set (its property's setter):
 * a recorder's cached stride is good while its sampler and this number are the ones it read. */
static unsigned long long sampler_generation = 1;
static PyObject *perf_counter_ns;  /* time.perf_counter_ns: read with clock_gettime directly */

static PyObject *str_stride_value; /* "_stride": PhaseSampler's stride property's value */
static PyObject *str_stride, *str_on_step_end, *str_misuse, *str_append, *str_explicit;
static PyObject *str_now_ns, *str_mark, *str_record, *str_exc_info, *str_step_end_key, *str_step_end_msg;
static PyObject *str_wait_msg; /* a wait that could not be added to the step's phases */
static PyObject *str_clock_key, *str_clock_msg, *kwnames_explicit, *kwnames_explicit_now;
static PyObject *kwnames_exc_info;
static PyObject *str_class; /* "__class__" */
static PyObject *str_communication; /* "communication": the exposed wait's phase */
static PyObject *str_post_hooks; /* "_optimizer_step_post_hooks": torch's post-hook dict */
static PyObject *str_pre_hooks;  /* "_optimizer_step_pre_hooks": torch's pre-hook dict */
static PyObject *add_to(PyObject *phases, PyObject *name, PyObject *elapsed);

#define PHASE_SLOTS 4 /* the loop's phases a step keeps in plain ns (stepbuffer.h) */

#include "stepbuffer.h"

typedef struct {
    PyObject_HEAD
    Py_ssize_t step_depth;
    Py_ssize_t watchers;
    Py_ssize_t buffer_steps;
    long long step_start_ns;
    long long step_index;
    long long steps_recorded;
    long long buffer_dropped;
    long long kernel_skip;   /* step ends the kernel source asked not to be told of */
    long long wait_ns;       /* the exposed wait closed by an untimed step's optimizer pre-hook,
                              * added to phases_ns["communication"] at the step's end (do_end):
                              * the hook itself touches no dict (issue 15, cold memory) */
    char sampled;
    char explicit_steps;
    char auto_step_open;
    PyObject *phases_ns;     /* dict: phase name -> ns, the open step's */
    PyObject *sampled_ns;    /* dict: auto-mode phase name -> ns, the open sampled step's */
    PyObject *buffer;        /* collections.deque of finished steps */
    PyObject *sampler;       /* PhaseSampler */
    PyObject *device_timer;  /* DeviceTimer or None */
    PyObject *kernel_source; /* KernelSource or None */
    PyObject *device_phases; /* dict: phase name -> [(start mark, end mark)] */
    PyObject *device_sampled; /* dict like device_phases (a sampled step's auto phases), or NULL */
    PyObject *step_start_mark; /* the open step's device mark, or NULL */
    PyObject *boundary;      /* an auto step's end: (its now_ns, its end mark), or NULL */
    PyObject *clock_ns;      /* callable -> int */
    PyObject *forward_swaps; /* tuple of (model, untimed class, timed class), or NULL */
    PyObject *swaps_seen;    /* the forward_swaps tuple last read (a strong reference), or NULL */
    PyObject *stride_sampler; /* the sampler whose stride is cached (a strong reference), or NULL */
    long long stride_cached;  /* its stride at sampler_generation == stride_generation */
    unsigned long long stride_generation;
    PyObject *swap_one[3];   /* its one entry's items when it has one entry (borrowed: kept
                              * alive by swaps_seen), else NULLs: a step's begin then touches
                              * neither tuple, cold after the model's memory traffic */
    PyObject *hidden_pre;    /* the optimizer pre gate whose hook dict is out of torch's loop
                              * (untimed steps; OptimizerGate), or NULL: a timed step's begin
                              * puts the dict back */
    /* The loop's own phases (PhaseContext, host clock) of the open step, in plain ns: slot i
     * holds slot_names[i] (owned; the buffer's slot i names the same, set once), used by the
     * open step where slot_mask has bit i. Folded into phases_ns only where the step's end
     * takes the Python path (fold_slots); else copied into the step's buffer entry. */
    unsigned long long slot_mask;
    PyObject *slot_names[PHASE_SLOTS];
    long long slot_ns[PHASE_SLOTS];
    PyObject *weakrefs;
} RecorderCore;

static PyTypeObject RecorderCoreType;

/* ------------------------------------------------------------------ helpers */

/* The instance __dict__ of ``object`` (borrowed: the object keeps it), or NULL with no
 * exception set where it has none. PyObject_GenericGetDict is the public way in every
 * supported version; like the private _PyObject_GetDictPtr it replaces, it materialises a
 * managed dict once, and the object holds the new one. */
static PyObject *instance_dict(PyObject *object) {
    PyObject *dict = PyObject_GenericGetDict(object, NULL);
    if (dict == NULL) {
        PyErr_Clear();
        return NULL;
    }
    Py_DECREF(dict);
    return dict;
}

/* The clock's reading, or -1 with no exception set when it cannot be used here (the caller
 * then takes the Python path, which reads the clock again and reports what went wrong). */
/* time.perf_counter_ns() on Linux: CLOCK_MONOTONIC in ns, as CPython 3.11 reads it
 * (tests/exporters/test_fastrecord.py checks the two agree). */
static int monotonic_ns(long long *now) {
#if defined(__linux__)
    struct timespec ts;
    if (clock_gettime(CLOCK_MONOTONIC, &ts) == 0) {
        *now = (long long)ts.tv_sec * 1000000000LL + (long long)ts.tv_nsec;
        return 0;
    }
#endif
    (void)now;
    return -1;
}

static int call_clock(PyObject *clock, long long *now) {
#if defined(__linux__)
    if (clock == perf_counter_ns && monotonic_ns(now) == 0) {
        return 0;
    }
#endif
    PyObject *value = PyObject_CallNoArgs(clock);
    if (value == NULL) {
        return -1;
    }
    int overflow = 0;
    long long result = PyLong_Check(value) ? PyLong_AsLongLongAndOverflow(value, &overflow) : -1;
    int usable = PyLong_Check(value) && !overflow && !(result == -1 && PyErr_Occurred());
    Py_DECREF(value);
    if (!usable) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError, "the clock did not answer with an int64");
        }
        return -1;
    }
    *now = result;
    return 0;
}

static int read_clock(RecorderCore *self, long long *now) {
    if (self->clock_ns == NULL) {
        return -1;
    }
    if (call_clock(self->clock_ns, now) < 0) {
        PyErr_Clear();
        return -1;
    }
    return 0;
}

/* now_ns argument: NULL or None -> read the clock; an int in range -> it. -1: Python path. */
static int resolve_now(RecorderCore *self, PyObject *now_ns, long long *now) {
    if (now_ns == NULL || now_ns == Py_None) {
        return read_clock(self, now);
    }
    if (!PyLong_CheckExact(now_ns)) {
        return -1;
    }
    int overflow = 0;
    long long value = PyLong_AsLongLongAndOverflow(now_ns, &overflow);
    if (overflow || (value == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return -1;
    }
    *now = value;
    return 0;
}

static uint64_t step_hash(uint64_t index) {
    /* _sampling.step_hash: splitmix64's finaliser, modulo 2**64. */
    uint64_t z = index + 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* Whether the step about to open is sampled: 1/0, or -1 (no exception) for the Python path. */
static int sampled_now(RecorderCore *self) {
    PyObject *sampler = self->sampler;
    if (sampler == NULL || self->step_index < 0) {
        return -1;
    }
    long long stride;
    if (sampler == self->stride_sampler && self->stride_generation == sampler_generation) {
        /* The stride read last time: neither the sampler nor its __dict__ is touched (cold
         * after the model's memory traffic, ~1.5 µs a step at 1024 wide; issue 15). */
        stride = self->stride_cached;
    } else {
        if (sampler_type == NULL || Py_TYPE(sampler) != sampler_type) {
            return -1;
        }
        /* The property's value is the plain attribute ``_stride``: its __dict__, no frame. */
        PyObject *dict = instance_dict(sampler);
        PyObject *stride_object =
            dict == NULL ? NULL : PyDict_GetItemWithError(dict, str_stride_value);
        if (stride_object != NULL) {
            Py_INCREF(stride_object);
        } else if (!PyErr_Occurred()) {
            stride_object = PyObject_GetAttr(sampler, str_stride);
        }
        if (stride_object == NULL) {
            PyErr_Clear();
            return -1;
        }
        int overflow = 0;
        stride = PyLong_CheckExact(stride_object)
                     ? PyLong_AsLongLongAndOverflow(stride_object, &overflow)
                     : -1;
        Py_DECREF(stride_object);
        if (overflow || stride < 1) {
            PyErr_Clear();
            return -1;
        }
        Py_INCREF(sampler);
        Py_XSETREF(self->stride_sampler, sampler);
        self->stride_cached = stride;
        self->stride_generation = sampler_generation;
    }
    if (stride == 1) {
        return 1;
    }
    return step_hash((uint64_t)self->step_index) % (uint64_t)stride == 0;
}

/* _fastrecord.sampler_changed(): a PhaseSampler's stride was set; recorders read it again. */
static PyObject *sampler_changed(PyObject *module, PyObject *unused) {
    (void)module;
    (void)unused;
    sampler_generation += 1;
    Py_RETURN_NONE;
}

static void restore_hidden_pre(RecorderCore *self); /* OptimizerGate, below */

/* Python's begin_step(explicit=..., now_ns=...) on this recorder. */
static PyObject *slow_begin(RecorderCore *self, int explicit_, PyObject *now_ns) {
    if (self->hidden_pre != NULL) {
        restore_hidden_pre(self); /* whatever this step is, its optimizer hooks run */
    }
    if (py_begin_step == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "_fastrecord.configure() was not called");
        return NULL;
    }
    PyObject *args[3] = {(PyObject *)self, explicit_ ? Py_True : Py_False, now_ns};
    int with_now = now_ns != NULL;
    return PyObject_Vectorcall(py_begin_step, args, 1,
                               with_now ? kwnames_explicit_now : kwnames_explicit);
}

static PyObject *slow_end(RecorderCore *self, int explicit_, PyObject *now_ns) {
    if (py_end_step == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "_fastrecord.configure() was not called");
        return NULL;
    }
    PyObject *args[3] = {(PyObject *)self, explicit_ ? Py_True : Py_False, now_ns};
    int with_now = now_ns != NULL;
    return PyObject_Vectorcall(py_end_step, args, 1,
                               with_now ? kwnames_explicit_now : kwnames_explicit);
}

/* self.misuse(key, message, exc_info=<the pending exception>); clears it. Never fails. */
static void report_misuse(PyObject *owner, PyObject *key, PyObject *message, int with_exception) {
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    if (with_exception && type != NULL) {
        PyErr_NormalizeException(&type, &value, &traceback);
        if (value != NULL && traceback != NULL) {
            PyException_SetTraceback(value, traceback);
        }
    }
    PyObject *exc_info = (with_exception && value != NULL) ? value : Py_False;
    PyObject *args[4] = {owner, key, message, exc_info};
    PyObject *result = PyObject_VectorcallMethod(str_misuse, args, 3, kwnames_exc_info);
    Py_XDECREF(result);
    PyErr_Clear();
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(traceback);
}

/* ------------------------------------------------------------------ begin / end */

/* device_timer.mark(): a new reference, or NULL with no exception set (the Python path then
 * calls it again and reports what went wrong). */
static PyObject *device_mark(RecorderCore *self) {
    PyObject *mark = PyObject_CallMethodNoArgs(self->device_timer, str_mark);
    if (mark == NULL) {
        PyErr_Clear();
    }
    return mark;
}

/* _sampling.swap_forward_classes(self.forward_swaps, sampled): each instrumented model gets the
 * class of a step whose phases are timed or of one whose are not, where it has one of the two
 * (any other class is someone else's and left alone). Never fails: a refused assignment leaves
 * the class as it was (the forward gate then handles the step, as before). */
static void swap_one_class(PyObject *model, PyObject *untimed, PyObject *timed, int sampled) {
    PyObject *target = sampled ? timed : untimed;
    PyObject *current = (PyObject *)Py_TYPE(model);
    if (current != target && (current == untimed || current == timed) &&
        PyObject_GenericSetAttr(model, str_class, target) < 0) {
        PyErr_Clear();
    }
}

static void swap_forward_classes(RecorderCore *self, int sampled) {
    PyObject *swaps = self->forward_swaps;
    if (swaps == NULL || !PyTuple_Check(swaps)) {
        return;
    }
    if (swaps != self->swaps_seen) {
        Py_INCREF(swaps);
        Py_XSETREF(self->swaps_seen, swaps);
        PyObject *entry = PyTuple_GET_SIZE(swaps) == 1 ? PyTuple_GET_ITEM(swaps, 0) : NULL;
        int one = entry != NULL && PyTuple_Check(entry) && PyTuple_GET_SIZE(entry) == 3;
        for (int i = 0; i < 3; i++) {
            self->swap_one[i] = one ? PyTuple_GET_ITEM(entry, i) : NULL;
        }
    }
    if (self->swap_one[0] != NULL) {
        swap_one_class(self->swap_one[0], self->swap_one[1], self->swap_one[2], sampled);
        return;
    }
    Py_ssize_t count = PyTuple_GET_SIZE(swaps);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *entry = PyTuple_GET_ITEM(swaps, i);
        if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 3) {
            continue;
        }
        swap_one_class(PyTuple_GET_ITEM(entry, 0), PyTuple_GET_ITEM(entry, 1),
                       PyTuple_GET_ITEM(entry, 2), sampled);
    }
}

static PyObject *do_begin(RecorderCore *self, int explicit_, PyObject *now_ns) {
    if (self->step_depth != 0 || (explicit_ && self->auto_step_open) ||
        self->device_timer == NULL) {
        return slow_begin(self, explicit_, now_ns);
    }
    int sampled = 1;
    if (self->watchers) {
        sampled = sampled_now(self);
        if (sampled < 0) {
            return slow_begin(self, explicit_, now_ns);
        }
    }
    long long now;
    if (resolve_now(self, now_ns, &now) < 0) {
        return slow_begin(self, explicit_, now_ns);
    }
    if (self->device_timer != Py_None) {
        /* After the clock, as in Python: the mark is the last thing the step boundary does. An
         * auto step that starts where the last one ended (the same now_ns) starts at its end
         * mark: one instant, one mark (one CUDA event fewer a step). */
        PyObject *boundary = self->boundary, *mark = NULL;
        self->boundary = NULL;
        if (boundary != NULL && !explicit_ && now_ns != NULL && now_ns != Py_None &&
            PyTuple_CheckExact(boundary) && PyTuple_GET_SIZE(boundary) == 2) {
            int same = PyObject_RichCompareBool(PyTuple_GET_ITEM(boundary, 0), now_ns, Py_EQ);
            if (same == 1) {
                mark = PyTuple_GET_ITEM(boundary, 1);
                Py_INCREF(mark);
            }
            PyErr_Clear();
        }
        Py_XDECREF(boundary);
        if (mark == NULL && (mark = device_mark(self)) == NULL) {
            return slow_begin(self, explicit_, now_ns);
        }
        Py_XSETREF(self->step_start_mark, mark);
    }
    if (explicit_) {
        self->explicit_steps = 1;
    } else {
        self->auto_step_open = 1;
    }
    self->step_depth = 1;
    self->step_start_ns = now;
    if (self->watchers) {
        self->sampled = (char)sampled;
        swap_forward_classes(self, sampled);
    }
    if (self->hidden_pre != NULL && (sampled || !explicit_)) {
        restore_hidden_pre(self);
    }
    Py_RETURN_NONE;
}

/* The step's DeviceMarks (start mark, end mark, device phases, sampled device phases or None)
 * with a fresh dict in *fresh_phases for the next step; or Py_None (no timer, or no start mark)
 * with *fresh_phases NULL. NULL with no exception set: take the Python path. */
static PyObject *device_record(RecorderCore *self, PyObject **fresh_phases) {
    *fresh_phases = NULL;
    if (self->device_timer == Py_None) {
        Py_RETURN_NONE;
    }
    if (self->device_phases == NULL || !PyDict_CheckExact(self->device_phases)) {
        return NULL;
    }
    PyObject *start = self->step_start_mark;
    if (start == NULL || start == Py_None) {
        /* Python drops the step's device phases too (no start mark: no device time). */
        *fresh_phases = PyDict_New();
        if (*fresh_phases == NULL) {
            PyErr_Clear();
            return NULL;
        }
        Py_RETURN_NONE;
    }
    PyObject *end = device_mark(self);
    if (end == NULL) {
        return NULL;
    }
    PyObject *sampled = Py_None;
    if (self->watchers && self->sampled && self->device_sampled != NULL) {
        sampled = self->device_sampled;
    }
    *fresh_phases = PyDict_New();
    PyObject *marks = *fresh_phases == NULL
                          ? NULL
                          : PyTuple_Pack(4, start, end, self->device_phases, sampled);
    Py_DECREF(end);
    if (marks == NULL) {
        Py_CLEAR(*fresh_phases);
        PyErr_Clear();
    }
    return marks;
}

/* What a kernel source's on_step_end returned, as step ends to skip: a positive int (as
 * StepRecorder._skip_count), anything else 0; an int too large for C, all of them. */
static long long skip_count(PyObject *told) {
    if (!PyLong_CheckExact(told)) {
        return 0;
    }
    int overflow = 0;
    long long skip = PyLong_AsLongLongAndOverflow(told, &overflow);
    if (overflow > 0) {
        return LLONG_MAX;
    }
    if (skip == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return skip > 0 ? skip : 0;
}

/* The pending exposed wait (wait_ns) into phases_ns["communication"], where the optimizer
 * pre-hook used to add it; 0 or -1 with an exception set (the wait is kept for the next try). */
static int fold_wait(RecorderCore *self) {
    long long wait = self->wait_ns;
    if (wait == 0) {
        return 0;
    }
    if (self->phases_ns == NULL || str_communication == NULL) {
        PyErr_SetString(PyExc_AttributeError, "the recorder has no phase dict");
        return -1;
    }
    PyObject *number = PyLong_FromLongLong(wait);
    PyObject *added = number == NULL ? NULL : add_to(self->phases_ns, str_communication, number);
    Py_XDECREF(number);
    if (added == NULL) {
        return -1;
    }
    Py_DECREF(added);
    self->wait_ns = 0;
    return 0;
}

/* The phase slots the open step used into phases_ns (where the Python path takes the step, or
 * the buffer's names differ); 0 or -1 with an exception set (what is left stays for the next
 * try). */
static int fold_slots(RecorderCore *self) {
    for (int i = 0; i < PHASE_SLOTS; i++) {
        unsigned long long bit = 1ULL << i;
        if (!(self->slot_mask & bit)) {
            continue;
        }
        if (self->phases_ns == NULL || self->slot_names[i] == NULL) {
            PyErr_SetString(PyExc_AttributeError, "the recorder has no phase dict");
            return -1;
        }
        PyObject *number = PyLong_FromLongLong(self->slot_ns[i]);
        PyObject *added =
            number == NULL ? NULL : add_to(self->phases_ns, self->slot_names[i], number);
        Py_XDECREF(number);
        if (added == NULL) {
            return -1;
        }
        Py_DECREF(added);
        self->slot_mask &= ~bit;
    }
    return 0;
}

/* ``elapsed`` ns of the loop's phase ``name`` (a PhaseContext's own str) into its slot: 1, or
 * 0 where it has none and none is free (the caller adds it to phases_ns). A free slot takes the
 * name for good, in the recorder and in its StepBuffer. */
static int phase_slot_add(RecorderCore *self, PyObject *name, long long elapsed) {
    for (int i = 0; i < PHASE_SLOTS; i++) {
        PyObject *held = self->slot_names[i];
        unsigned long long bit = 1ULL << i;
        if (held == name) {
            self->slot_ns[i] = (self->slot_mask & bit) ? self->slot_ns[i] + elapsed : elapsed;
            self->slot_mask |= bit;
            return 1;
        }
        if (held != NULL) {
            continue;
        }
        PyObject *buffer = self->buffer;
        if (buffer == NULL || Py_TYPE(buffer) != &StepBufferType || !PyUnicode_CheckExact(name)) {
            return 0;
        }
        StepBuffer *steps = (StepBuffer *)buffer;
        if (steps->slot_names[i] != NULL && steps->slot_names[i] != name) {
            return 0;
        }
        if (steps->slot_names[i] == NULL) {
            Py_INCREF(name);
            steps->slot_names[i] = name;
        }
        Py_INCREF(name);
        self->slot_names[i] = name;
        self->slot_ns[i] = elapsed;
        self->slot_mask |= bit;
        return 1;
    }
    return 0;
}

/* What follows a step's end once it is buffered: the recorder's counts and the kernel source
 * told (or not, as it asked). */
static void step_ended(RecorderCore *self, long long index) {
    self->step_index = index + 1;
    self->steps_recorded += 1;
    if (self->kernel_source != Py_None) {
        if (self->kernel_skip > 0) {
            self->kernel_skip -= 1; /* the source asked not to be told of this one */
        } else {
            PyObject *number = PyLong_FromLongLong(index);
            PyObject *told = number == NULL
                                 ? NULL
                                 : PyObject_CallMethodOneArg(self->kernel_source,
                                                             str_on_step_end, number);
            Py_XDECREF(number);
            if (told == NULL) {
                report_misuse((PyObject *)self, str_step_end_key, str_step_end_msg, 1);
            } else {
                self->kernel_skip = skip_count(told);
                Py_DECREF(told);
            }
        }
    }
}

/* A host-timed step's end into the StepBuffer's next slot (stepbuffer.h): its numbers, its
 * phase dict when it has phases (an empty one stays for the next step), the exposed wait not
 * yet folded, its auto-mode phases; no tuple, int or dict made. NULL with no exception set
 * when not taken (the general path then runs, nothing changed). */
static PyObject *compact_end(RecorderCore *self, PyObject *now_ns) {
    StepBuffer *buffer = (StepBuffer *)self->buffer;
    PyObject *phases = self->phases_ns;
    if (buffer->count >= self->buffer_steps || !PyDict_CheckExact(phases) ||
        (self->watchers && unsampled == NULL)) {
        return NULL;
    }
    long long end;
    if (resolve_now(self, now_ns, &end) < 0) {
        return NULL;
    }
    if (self->slot_mask) {
        /* The buffer names the slots as the recorder does (another buffer put in place: the
         * slots' time goes into the phase dict this once, and it takes their names). */
        StepBuffer *steps = (StepBuffer *)self->buffer;
        int same = 1;
        for (int i = 0; i < PHASE_SLOTS; i++) {
            if ((self->slot_mask & (1ULL << i)) && steps->slot_names[i] != self->slot_names[i]) {
                same = 0;
                if (steps->slot_names[i] == NULL) {
                    Py_INCREF(self->slot_names[i]);
                    steps->slot_names[i] = self->slot_names[i];
                }
            }
        }
        if (!same && fold_slots(self) < 0) {
            PyErr_Clear();
            return NULL;
        }
    }
    int swap_sampled = self->watchers && self->sampled;
    PyObject *fresh = NULL, *fresh_sampled = NULL;
    if (PyDict_GET_SIZE(phases) != 0 && (fresh = PyDict_New()) == NULL) {
        PyErr_Clear();
        return NULL;
    }
    if (swap_sampled && (fresh_sampled = PyDict_New()) == NULL) {
        Py_XDECREF(fresh);
        PyErr_Clear();
        return NULL;
    }
    StepEntry *entry = step_buffer_push(buffer);
    if (entry == NULL) {
        Py_XDECREF(fresh);
        Py_XDECREF(fresh_sampled);
        PyErr_Clear();
        return NULL;
    }
    long long index = self->step_index;
    entry->index = index;
    entry->start = self->step_start_ns;
    entry->end = end;
    entry->wait = self->wait_ns;
    self->wait_ns = 0;
    unsigned long long used = self->slot_mask;
    if (used) {
        entry->slot_mask = used;
        for (int i = 0; i < PHASE_SLOTS; i++) {
            entry->slot_ns[i] = self->slot_ns[i];
        }
        self->slot_mask = 0;
    }
    if (fresh != NULL) {
        entry->phases = phases; /* the recorder's reference, handed over */
        self->phases_ns = fresh;
    }
    if (swap_sampled) {
        entry->auto_ = self->sampled_ns;
        self->sampled_ns = fresh_sampled;
    } else {
        entry->auto_ = self->watchers ? unsampled : Py_None;
        Py_INCREF(entry->auto_);
    }
    /* Committed: the step is in the buffer. */
    self->step_depth = 0;
    self->auto_step_open = 0;
    step_ended(self, index);
    Py_RETURN_NONE;
}

static PyObject *do_end(RecorderCore *self, int explicit_, PyObject *now_ns) {
    if (self->step_depth == 1 && self->device_timer == Py_None && self->buffer != NULL &&
        Py_TYPE(self->buffer) == &StepBufferType && self->phases_ns != NULL &&
        self->sampled_ns != NULL && self->kernel_source != NULL) {
        PyObject *done = compact_end(self, now_ns);
        if (done != NULL) {
            return done;
        }
    }
    if (fold_wait(self) < 0 || fold_slots(self) < 0) {
        /* Never raised into the loop: reported, and what is left kept for the next step's end. */
        report_misuse((PyObject *)self, str_step_end_key, str_wait_msg, 1);
    }
    if (self->step_depth != 1 || self->device_timer == NULL || self->buffer == NULL ||
        self->phases_ns == NULL || self->sampled_ns == NULL || self->kernel_source == NULL) {
        return slow_end(self, explicit_, now_ns);
    }
    Py_ssize_t queued = PyObject_Length(self->buffer);
    if (queued < 0) {
        PyErr_Clear();
        return slow_end(self, explicit_, now_ns);
    }
    if (queued >= self->buffer_steps) {
        return slow_end(self, explicit_, now_ns);  /* counts and logs the dropped step */
    }
    long long end;
    if (resolve_now(self, now_ns, &end) < 0) {
        return slow_end(self, explicit_, now_ns);
    }
    PyObject *fresh_device = NULL;
    PyObject *device = device_record(self, &fresh_device);
    if (device == NULL) {
        return slow_end(self, explicit_, now_ns);
    }
    PyObject *fresh = PyDict_New();
    PyObject *fresh_sampled = NULL;
    PyObject *auto_phases = Py_None;
    int swap_sampled = self->watchers && self->sampled;
    if (fresh != NULL && swap_sampled) {
        fresh_sampled = PyDict_New();
        if (fresh_sampled == NULL) {
            Py_CLEAR(fresh);
        }
    }
    long long index = self->step_index;
    PyObject *record = NULL;
    if (fresh != NULL) {
        PyObject *phases = self->phases_ns;
        if (self->watchers) {
            auto_phases = swap_sampled ? self->sampled_ns : unsampled;
        }
        record = PyTuple_New(6);
        PyObject *numbers[3] = {PyLong_FromLongLong(index), PyLong_FromLongLong(self->step_start_ns),
                                PyLong_FromLongLong(end)};
        if (record == NULL || numbers[0] == NULL || numbers[1] == NULL || numbers[2] == NULL) {
            Py_CLEAR(record);
            for (int i = 0; i < 3; i++) {
                Py_XDECREF(numbers[i]);
            }
        } else {
            PyObject *last = auto_phases == NULL ? Py_None : auto_phases;
            PyTuple_SET_ITEM(record, 0, numbers[0]);
            PyTuple_SET_ITEM(record, 1, numbers[1]);
            PyTuple_SET_ITEM(record, 2, numbers[2]);
            Py_INCREF(phases);
            PyTuple_SET_ITEM(record, 3, phases);
            Py_INCREF(device);
            PyTuple_SET_ITEM(record, 4, device);
            Py_INCREF(last);
            PyTuple_SET_ITEM(record, 5, last);
        }
    }
    PyObject *end_mark = NULL; /* the step's end mark: the next auto step's start mark too */
    if (PyTuple_Check(device) && PyTuple_GET_SIZE(device) == 4) {
        end_mark = PyTuple_GET_ITEM(device, 1);
        Py_INCREF(end_mark);
    }
    Py_DECREF(device);
    if (record == NULL) {
        Py_XDECREF(fresh);
        Py_XDECREF(fresh_sampled);
        Py_XDECREF(fresh_device);
        Py_XDECREF(end_mark);
        PyErr_Clear();
        return slow_end(self, explicit_, now_ns);
    }
    PyObject *appended = PyObject_CallMethodOneArg(self->buffer, str_append, record);
    Py_DECREF(record);
    if (appended == NULL) {
        Py_DECREF(fresh);
        Py_XDECREF(fresh_sampled);
        Py_XDECREF(fresh_device);
        Py_XDECREF(end_mark);
        PyErr_Clear();
        return slow_end(self, explicit_, now_ns);
    }
    Py_DECREF(appended);
    /* Committed: the step is in the buffer. */
    self->step_depth = 0;
    self->auto_step_open = 0;
    Py_SETREF(self->phases_ns, fresh);
    if (fresh_device != NULL) {
        Py_SETREF(self->device_phases, fresh_device);
        Py_CLEAR(self->device_sampled);
        Py_CLEAR(self->step_start_mark);
        PyObject *boundary = NULL; /* as StepRecorder.end_step: an auto end at a given now_ns */
        if (end_mark != NULL && !explicit_ && now_ns != NULL && now_ns != Py_None) {
            boundary = PyTuple_Pack(2, now_ns, end_mark);
            if (boundary == NULL) {
                PyErr_Clear();
            }
        }
        Py_XSETREF(self->boundary, boundary);
    }
    Py_XDECREF(end_mark);
    if (swap_sampled) {
        Py_SETREF(self->sampled_ns, fresh_sampled);
    }
    step_ended(self, index);
    (void)explicit_;
    Py_RETURN_NONE;
}

static int parse_step_args(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                           int *explicit_, PyObject **now_ns) {
    if (nargs != 0) {
        PyErr_SetString(PyExc_TypeError, "begin_step()/end_step() take keyword arguments only");
        return -1;
    }
    int have_explicit = 0;
    *now_ns = NULL;
    Py_ssize_t count = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, i);
        PyObject *value = args[i];
        if (PyUnicode_Compare(name, str_explicit) == 0) {
            int truth = PyObject_IsTrue(value);
            if (truth < 0) {
                return -1;
            }
            *explicit_ = truth;
            have_explicit = 1;
        } else if (PyUnicode_Compare(name, str_now_ns) == 0) {
            *now_ns = value;
        } else {
            PyErr_Format(PyExc_TypeError, "unexpected keyword argument %R", name);
            return -1;
        }
    }
    if (!have_explicit) {
        PyErr_SetString(PyExc_TypeError, "missing keyword argument 'explicit'");
        return -1;
    }
    return 0;
}

static PyObject *RecorderCore_begin_step(RecorderCore *self, PyObject *const *args,
                                         Py_ssize_t nargs, PyObject *kwnames) {
    int explicit_ = 0;
    PyObject *now_ns;
    if (parse_step_args(args, nargs, kwnames, &explicit_, &now_ns) < 0) {
        return NULL;
    }
    return do_begin(self, explicit_, now_ns);
}

static PyObject *RecorderCore_end_step(RecorderCore *self, PyObject *const *args,
                                       Py_ssize_t nargs, PyObject *kwnames) {
    int explicit_ = 0;
    PyObject *now_ns;
    if (parse_step_args(args, nargs, kwnames, &explicit_, &now_ns) < 0) {
        return NULL;
    }
    return do_end(self, explicit_, now_ns);
}

/* add_phase_ns(name, elapsed_ns) / add_sampled_phase_ns: phases[name] = phases.get(name, 0) + ns */
static PyObject *add_to(PyObject *phases, PyObject *name, PyObject *elapsed) {
    if (phases == NULL) {
        PyErr_SetString(PyExc_AttributeError, "the recorder has no phase dict");
        return NULL;
    }
    PyObject *current = PyDict_GetItemWithError(phases, name);
    if (current == NULL && PyErr_Occurred()) {
        return NULL;
    }
    PyObject *total;
    if (current == NULL) {
        Py_INCREF(elapsed);
        total = elapsed;
        /* Python's phases.get(name, 0) + elapsed: 0 + elapsed is elapsed for an int. */
        if (!PyLong_CheckExact(elapsed)) {
            Py_DECREF(total);
            PyObject *zero = PyLong_FromLong(0);
            if (zero == NULL) {
                return NULL;
            }
            total = PyNumber_Add(zero, elapsed);
            Py_DECREF(zero);
        }
    } else {
        total = PyNumber_Add(current, elapsed);
    }
    if (total == NULL) {
        return NULL;
    }
    int failed = PyDict_SetItem(phases, name, total);
    Py_DECREF(total);
    if (failed) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *RecorderCore_add_phase_ns(RecorderCore *self, PyObject *const *args,
                                           Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "add_phase_ns(name, elapsed_ns)");
        return NULL;
    }
    return add_to(self->phases_ns, args[0], args[1]);
}

static PyObject *RecorderCore_add_sampled_phase_ns(RecorderCore *self, PyObject *const *args,
                                                   Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "add_sampled_phase_ns(name, elapsed_ns)");
        return NULL;
    }
    return add_to(self->sampled_ns, args[0], args[1]);
}

/* (start, end) appended to intervals[name], the list made when missing. */
static int append_interval(PyObject *intervals, PyObject *name, PyObject *start, PyObject *end) {
    PyObject *list = PyDict_GetItemWithError(intervals, name);
    if (list == NULL) {
        if (PyErr_Occurred()) {
            return -1;
        }
        PyObject *fresh = PyList_New(0);
        if (fresh == NULL) {
            return -1;
        }
        int failed = PyDict_SetItem(intervals, name, fresh);
        Py_DECREF(fresh);
        if (failed) {
            return -1;
        }
        list = fresh; /* borrowed: the dict holds it */
    }
    PyObject *pair = PyTuple_Pack(2, start, end);
    if (pair == NULL) {
        return -1;
    }
    int failed = PyList_Check(list) ? PyList_Append(list, pair)
                                    : (PyErr_SetString(PyExc_TypeError, "not a list"), -1);
    Py_DECREF(pair);
    return failed;
}

/* add_device_phase(name, start_mark, end_mark): the open step's device interval (every step). */
static PyObject *RecorderCore_add_device_phase(RecorderCore *self, PyObject *const *args,
                                               Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "add_device_phase(name, start_mark, end_mark)");
        return NULL;
    }
    if (self->device_phases == NULL || !PyDict_Check(self->device_phases)) {
        PyErr_SetString(PyExc_TypeError, "the recorder's device phases are not a dict");
        return NULL;
    }
    if (append_interval(self->device_phases, args[0], args[1], args[2]) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* add_sampled_device_phase(name, start_mark, end_mark): an auto-mode phase of a sampled step. */
static PyObject *RecorderCore_add_sampled_device_phase(RecorderCore *self, PyObject *const *args,
                                                       Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "add_sampled_device_phase(name, start_mark, end_mark)");
        return NULL;
    }
    if (self->device_sampled == NULL || self->device_sampled == Py_None) {
        PyObject *fresh = PyDict_New();
        if (fresh == NULL) {
            return NULL;
        }
        Py_XSETREF(self->device_sampled, fresh);
    }
    if (!PyDict_Check(self->device_sampled)) {
        PyErr_SetString(PyExc_TypeError, "the recorder's sampled device phases are not a dict");
        return NULL;
    }
    if (append_interval(self->device_sampled, args[0], args[1], args[2]) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static int RecorderCore_traverse(RecorderCore *self, visitproc visit, void *arg) {
    /* A Python subclass's type is visited by subtype_traverse. */
    Py_VISIT(self->phases_ns);
    Py_VISIT(self->sampled_ns);
    Py_VISIT(self->buffer);
    Py_VISIT(self->sampler);
    Py_VISIT(self->device_timer);
    Py_VISIT(self->kernel_source);
    Py_VISIT(self->device_phases);
    Py_VISIT(self->device_sampled);
    Py_VISIT(self->step_start_mark);
    Py_VISIT(self->boundary);
    Py_VISIT(self->clock_ns);
    Py_VISIT(self->forward_swaps);
    Py_VISIT(self->swaps_seen);
    Py_VISIT(self->hidden_pre);
    Py_VISIT(self->stride_sampler);
    return 0;
}

static int RecorderCore_clear(RecorderCore *self) {
    Py_CLEAR(self->phases_ns);
    Py_CLEAR(self->sampled_ns);
    Py_CLEAR(self->buffer);
    Py_CLEAR(self->sampler);
    Py_CLEAR(self->device_timer);
    Py_CLEAR(self->kernel_source);
    Py_CLEAR(self->device_phases);
    Py_CLEAR(self->device_sampled);
    Py_CLEAR(self->step_start_mark);
    Py_CLEAR(self->boundary);
    Py_CLEAR(self->clock_ns);
    Py_CLEAR(self->forward_swaps);
    Py_CLEAR(self->swaps_seen);
    Py_CLEAR(self->hidden_pre);
    self->slot_mask = 0;
    for (int i = 0; i < PHASE_SLOTS; i++) {
        Py_CLEAR(self->slot_names[i]);
    }
    Py_CLEAR(self->stride_sampler);
    self->swap_one[0] = self->swap_one[1] = self->swap_one[2] = NULL;
    return 0;
}

static void RecorderCore_dealloc(RecorderCore *self) {
    PyTypeObject *type = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    if (self->weakrefs != NULL) {
        PyObject_ClearWeakRefs((PyObject *)self);
    }
    RecorderCore_clear(self);
    /* A Python subclass's instance: subtype_dealloc drops the type's reference. */
    type->tp_free((PyObject *)self);
}

static PyObject *RecorderCore_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    (void)args;
    (void)kwargs;
    RecorderCore *self = (RecorderCore *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->sampled = 1;
    self->buffer_steps = PY_SSIZE_T_MAX;
    Py_INCREF(Py_None);
    self->device_timer = Py_None;
    Py_INCREF(Py_None);
    self->kernel_source = Py_None;
    self->forward_swaps = PyTuple_New(0);
    if (self->forward_swaps == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

#define MEMBER(name, type, field, doc) {name, type, offsetof(RecorderCore, field), 0, doc}

static PyMemberDef RecorderCore_members[] = {
    MEMBER("step_depth", T_PYSSIZET, step_depth, "Open steps (positive while one is open)."),
    MEMBER("watchers", T_PYSSIZET, watchers, "Auto-mode instrumentations installed."),
    MEMBER("_buffer_steps", T_PYSSIZET, buffer_steps, "Most steps waiting for export."),
    MEMBER("_step_start_ns", T_LONGLONG, step_start_ns, "Start of the open (or last) step."),
    MEMBER("_step_index", T_LONGLONG, step_index, "Index of the open (or next) step."),
    MEMBER("steps_recorded", T_LONGLONG, steps_recorded, "Steps finished and buffered."),
    MEMBER("buffer_dropped", T_LONGLONG, buffer_dropped, "Steps dropped: the buffer was full."),
    MEMBER("_kernel_skip", T_LONGLONG, kernel_skip, "Step ends the kernel source skips."),
    MEMBER("_wait_ns", T_LONGLONG, wait_ns,
           "Exposed wait (ns) of the open step not yet in _phases_ns['communication']."),
    MEMBER("sampled", T_BOOL, sampled, "Auto mode times this step's phases."),
    MEMBER("explicit_steps", T_BOOL, explicit_steps, "The loop marks steps with step()."),
    MEMBER("_auto_step_open", T_BOOL, auto_step_open, "Auto mode opened the open step."),
    MEMBER("_phases_ns", T_OBJECT_EX, phases_ns, "Phase name -> ns of the open step."),
    MEMBER("_sampled_ns", T_OBJECT_EX, sampled_ns, "Auto-mode phases of the open step."),
    MEMBER("buffer", T_OBJECT_EX, buffer, "Finished steps, oldest first."),
    MEMBER("sampler", T_OBJECT_EX, sampler, "Which steps auto mode times."),
    MEMBER("device_timer", T_OBJECT_EX, device_timer, "Device timing, or None."),
    MEMBER("_kernel_source", T_OBJECT_EX, kernel_source, "Told each finished step, or None."),
    MEMBER("_device_phases", T_OBJECT_EX, device_phases, "Device marks of the open step."),
    MEMBER("_device_sampled", T_OBJECT, device_sampled,
           "Device marks of the open sampled step's auto phases, or None."),
    MEMBER("_step_start_mark", T_OBJECT, step_start_mark, "The open step's device mark, or None."),
    MEMBER("_boundary", T_OBJECT, boundary, "An auto step's end: (now_ns, end mark), or None."),
    MEMBER("clock_ns", T_OBJECT_EX, clock_ns, "The monotonic clock (ns)."),
    MEMBER("forward_swaps", T_OBJECT_EX, forward_swaps,
           "(model, untimed class, timed class) per instrumented model: swapped at each begin."),
    {NULL, 0, 0, 0, NULL},
};

static PyMethodDef RecorderCore_methods[] = {
    {"begin_step", (PyCFunction)(void (*)(void))RecorderCore_begin_step,
     METH_FASTCALL | METH_KEYWORDS,
     "begin_step(*, explicit, now_ns=None): open a step (C; unusual cases in Python)."},
    {"end_step", (PyCFunction)(void (*)(void))RecorderCore_end_step,
     METH_FASTCALL | METH_KEYWORDS,
     "end_step(*, explicit, now_ns=None): close a step and buffer it (C; unusual in Python)."},
    {"add_phase_ns", (PyCFunction)(void (*)(void))RecorderCore_add_phase_ns, METH_FASTCALL,
     "add_phase_ns(name, elapsed_ns): add to a phase of the current (or next) step."},
    {"add_sampled_phase_ns", (PyCFunction)(void (*)(void))RecorderCore_add_sampled_phase_ns,
     METH_FASTCALL, "add_sampled_phase_ns(name, elapsed_ns): add to an auto-mode phase."},
    {"add_device_phase", (PyCFunction)(void (*)(void))RecorderCore_add_device_phase,
     METH_FASTCALL, "add_device_phase(name, start_mark, end_mark): a device interval."},
    {"add_sampled_device_phase",
     (PyCFunction)(void (*)(void))RecorderCore_add_sampled_device_phase, METH_FASTCALL,
     "add_sampled_device_phase(name, start_mark, end_mark): a sampled step's device interval."},
    {NULL, NULL, 0, NULL},
};

/* _phase_slots: {name: ns} of the open step's phases held in slots (not yet in _phases_ns). */
static PyObject *RecorderCore_get_phase_slots(RecorderCore *self, void *closure) {
    (void)closure;
    PyObject *slots = PyDict_New();
    for (int i = 0; slots != NULL && i < PHASE_SLOTS; i++) {
        if (!(self->slot_mask & (1ULL << i)) || self->slot_names[i] == NULL) {
            continue;
        }
        PyObject *ns = PyLong_FromLongLong(self->slot_ns[i]);
        if (ns == NULL || PyDict_SetItem(slots, self->slot_names[i], ns) < 0) {
            Py_CLEAR(slots);
        }
        Py_XDECREF(ns);
    }
    return slots;
}

static PyGetSetDef RecorderCore_getset[] = {
    {"_phase_slots", (getter)RecorderCore_get_phase_slots, NULL,
     "The open step's loop phases (name -> ns) held in slots, not yet in _phases_ns.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject RecorderCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "stepwatch.exporters._fastrecord.RecorderCore",
    .tp_basicsize = sizeof(RecorderCore),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The step recorder's hot state and step boundary in C (see the module).",
    .tp_new = RecorderCore_new,
    .tp_dealloc = (destructor)RecorderCore_dealloc,
    .tp_traverse = (traverseproc)RecorderCore_traverse,
    .tp_clear = (inquiry)RecorderCore_clear,
    .tp_members = RecorderCore_members,
    .tp_methods = RecorderCore_methods,
    .tp_getset = RecorderCore_getset,
    .tp_weaklistoffset = offsetof(RecorderCore, weakrefs),
};

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

/* ------------------------------------------------------------------ EngineGate */

#include "enginegate.h"

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

/* ------------------------------------------------------------------ host_values */

/* The export thread's pass over a batch of finished steps (_recorder.window_values) for steps
 * without device marks: (durations s, {phase: [s]}, [sampled auto phases], watched), the
 * same floats as the Python loop ((end - start) * 1e-9 and ns * 1e-9 of exact ints), or
 * None when a record carries device marks or is not a plain record (the Python loop then
 * takes the whole batch). */
static PyObject *host_values(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 2 || !PyList_Check(args[0]) || !PyLong_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "host_values(records: list, carry: int)");
        return NULL;
    }
    PyObject *records = args[0];
    long long watched = PyLong_AsLongLong(args[1]);
    if (watched == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(records);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *record = PyList_GET_ITEM(records, i);
        if (!PyTuple_CheckExact(record) || PyTuple_GET_SIZE(record) != 6 ||
            PyTuple_GET_ITEM(record, 4) != Py_None ||
            !PyLong_CheckExact(PyTuple_GET_ITEM(record, 1)) ||
            !PyLong_CheckExact(PyTuple_GET_ITEM(record, 2)) ||
            !PyDict_CheckExact(PyTuple_GET_ITEM(record, 3))) {
            Py_RETURN_NONE;
        }
    }
    PyObject *durations = PyList_New(n);
    PyObject *phases = PyDict_New();
    PyObject *sampled = PyList_New(0);
    if (durations == NULL || phases == NULL || sampled == NULL) {
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *record = PyList_GET_ITEM(records, i);
        PyObject *auto_phases = PyTuple_GET_ITEM(record, 5);
        if (auto_phases != Py_None) {
            watched += 1;
            if (auto_phases != unsampled && PyList_Append(sampled, auto_phases) < 0) {
                goto fail;
            }
        }
        PyObject *elapsed =
            PyNumber_Subtract(PyTuple_GET_ITEM(record, 2), PyTuple_GET_ITEM(record, 1));
        if (elapsed == NULL) {
            goto fail;
        }
        double seconds = PyLong_AsDouble(elapsed);
        Py_DECREF(elapsed);
        if (seconds == -1.0 && PyErr_Occurred()) {
            goto fail;
        }
        PyObject *value = PyFloat_FromDouble(seconds * 1e-9);
        if (value == NULL) {
            goto fail;
        }
        PyList_SET_ITEM(durations, i, value);
        PyObject *step_phases = PyTuple_GET_ITEM(record, 3);
        Py_ssize_t position = 0;
        PyObject *name, *ns;
        while (PyDict_Next(step_phases, &position, &name, &ns)) {
            double phase_ns = PyLong_CheckExact(ns) ? PyLong_AsDouble(ns) : PyFloat_AsDouble(ns);
            if (phase_ns == -1.0 && PyErr_Occurred()) {
                goto fail;
            }
            PyObject *values = PyDict_GetItemWithError(phases, name);
            if (values == NULL) {
                if (PyErr_Occurred()) {
                    goto fail;
                }
                values = PyList_New(0);
                if (values == NULL) {
                    goto fail;
                }
                int stored = PyDict_SetItem(phases, name, values);
                Py_DECREF(values); /* the dict holds it */
                if (stored < 0) {
                    goto fail;
                }
            }
            PyObject *phase_value = PyFloat_FromDouble(phase_ns * 1e-9);
            if (phase_value == NULL) {
                goto fail;
            }
            int appended = PyList_Append(values, phase_value);
            Py_DECREF(phase_value);
            if (appended < 0) {
                goto fail;
            }
        }
    }
    return Py_BuildValue("(NNNL)", durations, phases, sampled, watched);
fail:
    Py_XDECREF(durations);
    Py_XDECREF(phases);
    Py_XDECREF(sampled);
    return NULL;
}

/* ------------------------------------------------------------------ module */

static PyObject *configure(PyObject *module, PyObject *args) {
    (void)module;
    PyObject *begin, *end, *marker, *sampler_class, *clock;
    if (!PyArg_ParseTuple(args, "OOOO!O:configure", &begin, &end, &marker, &PyType_Type,
                          &sampler_class, &clock)) {
        return NULL;
    }
    Py_INCREF(clock);
    Py_XSETREF(perf_counter_ns, clock);
    Py_INCREF(begin);
    Py_XSETREF(py_begin_step, begin);
    Py_INCREF(end);
    Py_XSETREF(py_end_step, end);
    Py_INCREF(marker);
    Py_XSETREF(unsampled, marker);
    Py_INCREF(sampler_class);
    Py_XSETREF(sampler_type, (PyTypeObject *)sampler_class);
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ ExportWaiter
 * The export thread's wait between two exports, without the GIL (_cadence.py). Between
 * windows the thread looks at the step count once a probe (1 s) to export early when a rank
 * stalls; in Python each look takes the GIL, which costs the export thread ~35 us in a DDP job
 * and ~130 us in a loop that rarely releases it, and forces the training thread to hand it over
 * (docs/exporters.md, "One budget off the training step"). Here the looks read the recorder's
 * counter with the GIL released, and the thread takes the GIL back only when the wait ends:
 * its time is up, the count has stood still for quiet_s since it last moved (a stall), or
 * wake() was called (close). Linux only (a monotonic condition variable); elsewhere the
 * Python loop runs. */
#if defined(__linux__)
#include <pthread.h>
#include <unistd.h>

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mutex;
    pthread_cond_t cond;
    pid_t pid;  /* the process that made it: a forked child never locks the mutex */
    int woken;
    int ready;
} ExportWaiter;

static PyObject *ExportWaiter_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    if ((args != NULL && PyTuple_GET_SIZE(args) != 0) ||
        (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0)) {
        PyErr_SetString(PyExc_TypeError, "ExportWaiter() takes no arguments");
        return NULL;
    }
    ExportWaiter *self = (ExportWaiter *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    pthread_condattr_t attr;
    if (pthread_condattr_init(&attr) != 0) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    int failed = pthread_condattr_setclock(&attr, CLOCK_MONOTONIC) != 0 ||
                 pthread_cond_init(&self->cond, &attr) != 0;
    pthread_condattr_destroy(&attr);
    if (failed || pthread_mutex_init(&self->mutex, NULL) != 0) {
        if (!failed) {
            pthread_cond_destroy(&self->cond);
        }
        Py_DECREF(self);
        PyErr_SetString(PyExc_OSError, "ExportWaiter: no monotonic condition variable");
        return NULL;
    }
    self->ready = 1;
    self->pid = getpid();
    return (PyObject *)self;
}

static void ExportWaiter_dealloc(ExportWaiter *self) {
    if (self->ready) {
        pthread_cond_destroy(&self->cond);
        pthread_mutex_destroy(&self->mutex);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* wait(recorder, timeout_s, probe_s, quiet_s, armed, steps, changed_s)
 *   -> (steps, changed_s, reason): reason 0 time up, 1 quiet (a stall), 2 woken. */
static PyObject *ExportWaiter_wait(ExportWaiter *self, PyObject *args) {
    PyObject *recorder;
    double timeout_s, probe_s, quiet_s, changed_s;
    int armed;
    long long steps;
    if (!PyArg_ParseTuple(args, "O!dddpLd", &RecorderCoreType, &recorder, &timeout_s, &probe_s,
                          &quiet_s, &armed, &steps, &changed_s)) {
        return NULL;
    }
    if (!(probe_s > 0.0)) {
        PyErr_SetString(PyExc_ValueError, "probe_s must be positive");
        return NULL;
    }
    if (getpid() != self->pid) {  /* a forked child: its copy of the mutex may be locked */
        return Py_BuildValue("(Ldi)", steps, changed_s, 2);
    }
    RecorderCore *core = (RecorderCore *)recorder;
    int reason = 0;
    Py_INCREF(recorder);
    Py_BEGIN_ALLOW_THREADS
    double now = now_s();
    double deadline = now + timeout_s;
    pthread_mutex_lock(&self->mutex);
    while (!self->woken && now < deadline) {
        double next = now + probe_s < deadline ? now + probe_s : deadline;
        struct timespec until;
        until.tv_sec = (time_t)next;
        until.tv_nsec = (long)((next - (double)until.tv_sec) * 1e9);
        if (until.tv_nsec >= 1000000000L) {
            until.tv_sec += 1;
            until.tv_nsec -= 1000000000L;
        }
        while (!self->woken && pthread_cond_timedwait(&self->cond, &self->mutex, &until) == 0) {
        }
        now = now_s();
        if (self->woken) {
            break;
        }
        /* Written by the training thread under the GIL; an aligned 64-bit load. */
        long long seen = __atomic_load_n(&core->steps_recorded, __ATOMIC_RELAXED);
        if (seen != steps) {
            steps = seen;
            changed_s = now;
            armed = 1;
        } else if (armed && steps > 0 && now - changed_s >= quiet_s) {
            reason = 1;
            break;
        }
    }
    if (self->woken) {
        reason = 2;
    }
    pthread_mutex_unlock(&self->mutex);
    Py_END_ALLOW_THREADS
    Py_DECREF(recorder);
    return Py_BuildValue("(Ldi)", steps, changed_s, reason);
}

static PyObject *ExportWaiter_wake(ExportWaiter *self, PyObject *unused) {
    (void)unused;
    if (getpid() != self->pid) {
        /* A forked child (a monitor closed at its exit): no thread waits here, and the mutex
         * may have been copied locked by the parent's export thread. */
        self->woken = 1;
        Py_RETURN_NONE;
    }
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->mutex);
    self->woken = 1;
    pthread_cond_broadcast(&self->cond);
    pthread_mutex_unlock(&self->mutex);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef ExportWaiter_methods[] = {
    {"wait", (PyCFunction)ExportWaiter_wait, METH_VARARGS,
     "wait(recorder, timeout_s, probe_s, quiet_s, armed, steps, changed_s) -> (steps, "
     "changed_s, reason): sleep without the GIL, looking at recorder.steps_recorded every "
     "probe_s; reason 0 time up, 1 the count still for quiet_s since it moved (armed: it "
     "moved since the last early export), 2 woken."},
    {"wake", (PyCFunction)ExportWaiter_wake, METH_NOARGS,
     "End every wait, now and later (close)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ExportWaiterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "stepwatch.exporters._fastrecord.ExportWaiter",
    .tp_basicsize = sizeof(ExportWaiter),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The export thread's wait between exports, its looks at the step count without "
              "the GIL.",
    .tp_new = ExportWaiter_new,
    .tp_dealloc = (destructor)ExportWaiter_dealloc,
    .tp_methods = ExportWaiter_methods,
};
#endif

static PyMethodDef module_methods[] = {
    {"host_values", (PyCFunction)(void (*)(void))host_values, METH_FASTCALL,
     "host_values(records, carry): window_values' pass for steps without device marks."},
    {"sampler_changed", sampler_changed, METH_NOARGS,
     "sampler_changed(): a PhaseSampler's stride was set (recorders read it again)."},
    {"configure", configure, METH_VARARGS,
     "configure(begin_step, end_step, UNSAMPLED, PhaseSampler, time.perf_counter_ns): what the "
     "C code needs from Python (its slow paths, the marker, the sampler's class, the clock "
     "it may read directly)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "stepwatch.exporters._fastrecord",
    .m_doc = "The step recorder's step boundary and phase contexts in C (_recorder.py).",
    .m_size = -1,
    .m_methods = module_methods,
};

static int intern(PyObject **target, const char *text) {
    *target = PyUnicode_InternFromString(text);
    return *target == NULL ? -1 : 0;
}

PyMODINIT_FUNC PyInit__fastrecord(void) {
    if (intern(&str_stride, "stride") || intern(&str_stride_value, "_stride") || intern(&str_on_step_end, "on_step_end") ||
        intern(&str_misuse, "misuse") || intern(&str_append, "append") ||
        intern(&str_explicit, "explicit") || intern(&str_now_ns, "now_ns") ||
        intern(&str_mark, "mark") || intern(&str_record, "record") || intern(&str_exc_info, "exc_info") ||
        intern(&str_step_end_key, "step-end") ||
        intern(&str_step_end_msg, "recording a step failed; step ignored") ||
        intern(&str_wait_msg, "the exposed wait could not be added to the step's phases; "
                              "kept for the next step") ||
        intern(&str_clock_key, "clock") || intern(&str_auto_key, "auto") ||
        intern(&str_enabled, "enabled") || intern(&str_in_backward, "in_backward") ||
        intern(&str_pre_failed, "auto-mode optimizer pre-hook failed") || intern(&str_new_phase_context, "new_phase_context") ||
        intern(&str_class, "__class__") || intern(&str_communication, "communication") ||
        intern(&str_post_hooks, "_optimizer_step_post_hooks") ||
        intern(&str_pre_hooks, "_optimizer_step_pre_hooks") || intern(&str_forward_depth, "forward_depth") ||
        intern(&str_forward_start_ns, "forward_start_ns") || intern(&str_thread_id, "thread_id") ||
        intern(&str_backward_hooks, "backward_hooks") ||
        intern(&str_optimizer_start_ns, "optimizer_start_ns") ||
        intern(&str_backward_start_ns, "backward_start_ns") || intern(&str_forward, "forward") ||
        intern(&str_backward, "backward") || intern(&str_optimizer, "optimizer") ||
        intern(&str_requires_grad, "requires_grad") ||
        intern(&str_backward_hooks_attr, "_backward_hooks") || intern(&str_grad_fn, "grad_fn") ||
        intern(&str_register_hook_dict, "_register_hook_dict") ||
        intern(&str_forward_post, "forward_post") || intern(&str_hook_output, "hook_output") ||
        intern(&str_post_failed, "auto-mode optimizer hook failed") ||
        intern(&str_forward_failed, "auto-mode forward hook failed") ||
        intern(&str_data_start_ns, "data_start_ns") || intern(&str_data, "data") ||
        intern(&str_forward_mark, "forward_mark") || intern(&str_backward_mark, "backward_mark") ||
        intern(&str_optimizer_mark, "optimizer_mark") || intern(&str_data_mark, "data_mark") ||
        intern(&str_mark_key, "device-mark") ||
        intern(&str_mark_msg, "device timer mark() raised") || intern(&str_recorder, "recorder") ||
        intern(&str_nested_call, "nested_call") ||
        intern(&str_accumulate_grad, "accumulate_grad") ||
        intern(&str_step_depth, "step_depth") || intern(&str_step_index_attr, "_step_index") ||
        intern(&str_clock_msg, "the clock raised in phase(); phase ignored")) {
        return NULL;
    }
    kwnames_explicit = PyTuple_Pack(1, str_explicit);
    kwnames_explicit_now = PyTuple_Pack(2, str_explicit, str_now_ns);
    kwnames_exc_info = PyTuple_Pack(1, str_exc_info);
    if (kwnames_explicit == NULL || kwnames_explicit_now == NULL || kwnames_exc_info == NULL) {
        return NULL;
    }
    if (PyType_Ready(&RecorderCoreType) < 0 || PyType_Ready(&StepContextType) < 0 ||
        PyType_Ready(&PhaseContextType) < 0 || PyType_Ready(&PhaseLookupType) < 0 ||
        PyType_Ready(&ClockStampType) < 0 || PyType_Ready(&EventMarkerType) < 0 ||
        PyType_Ready(&MarkStampType) < 0 || PyType_Ready(&OptimizerGateType) < 0 ||
        PyType_Ready(&ForwardGateType) < 0 || PyType_Ready(&BackwardStartType) < 0 ||
        PyType_Ready(&StepBufferType) < 0 || PyType_Ready(&EngineGateType) < 0) {
        return NULL;
    }
#if defined(__linux__)
    if (PyType_Ready(&ExportWaiterType) < 0) {
        return NULL;
    }
#endif
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL) {
        return NULL;
    }
    if (PyModule_AddType(module, &RecorderCoreType) < 0 ||
        PyModule_AddType(module, &StepContextType) < 0 ||
        PyModule_AddType(module, &PhaseContextType) < 0 ||
        PyModule_AddType(module, &PhaseLookupType) < 0 ||
        PyModule_AddType(module, &ClockStampType) < 0 ||
        PyModule_AddType(module, &EventMarkerType) < 0 ||
        PyModule_AddType(module, &MarkStampType) < 0 ||
        PyModule_AddType(module, &OptimizerGateType) < 0 ||
        PyModule_AddType(module, &ForwardGateType) < 0 ||
        PyModule_AddType(module, &BackwardStartType) < 0 ||
        PyModule_AddType(module, &StepBufferType) < 0 ||
        PyModule_AddType(module, &EngineGateType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
#if defined(__linux__)
    if (PyModule_AddType(module, &ExportWaiterType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
#endif
    return module;
}
