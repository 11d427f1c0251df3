/* ExportWaiter: the export thread's wait between exports, without the GIL (included by fastrecord.c). */

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
