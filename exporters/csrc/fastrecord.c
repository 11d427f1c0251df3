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
 *
 * This file holds RecorderCore, the export thread's pass (host_values) and the module; each
 * other object is a header it includes where it stands, one translation unit (they share the
 * static helpers and types before them): stepbuffer.h, then after RecorderCore contexts.h
 * (StepContext, PhaseContext, PhaseLookup), stamps.h (ClockStamp; eventmarker.h; MarkStamp),
 * autostate.h (the auto-mode state's attributes), optimizergate.h, backwardstart.h,
 * enginegate.h, forwardgate.h, and exportwaiter.h after the module's configure().
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

#include "contexts.h"

#include "stamps.h"

#include "autostate.h"

#include "optimizergate.h"

#include "backwardstart.h"

/* ------------------------------------------------------------------ EngineGate */

#include "enginegate.h"

#include "forwardgate.h"

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

#include "exportwaiter.h"

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
