/* EventMarker: a CUDA timer's mark() without a Python frame (included by fastrecord.c).
 *
 * EventMarker(factory, pool=0)(): ``event = factory(); event.record(); return event``, where
 * factory is functools.partial(torch.Event, "cuda", enable_timing=True), whose record() with
 * no stream records on the current stream in C++ (_device.CudaEventTimer).
 *
 * With pool > 0 the marker keeps the events it made, up to pool of them, in a ring in the
 * order it handed them out, and records the oldest one again instead of making a new event
 * when nobody else holds it any more: its reference count is the ring's alone, so every step,
 * interval and boundary that held it is gone and no reader will time that use of it. A CUDA
 * event is created on its first record, a driver call that cost the training thread 5-21 us
 * more a mark than recording a kept one, between a step's kernels on an H200 (issue 15).
 * The oldest EVENT_MARKER_LOOK kept events are looked at, so one held for long (the last mark
 * of a monitor not in use) is passed over; where all are held, the ring grows (doubling, up
 * to pool), keeping the order; at its limit the oldest is handed over to its holders and a
 * new one takes its slot. A kept event that refuses to record again (a torch.Event keeps the
 * device of its first record, so the current device changed) is replaced by a new one; after
 * 64 refusals the pool retires and every mark makes its event, as without one. Stats: made
 * (events made), reused (marks on a kept event), refused, held (events kept now). Every call
 * runs under the GIL; factory() and record() may let another thread in, so the ring is read
 * afresh after each. */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *factory;
    PyObject **ring;   /* size slots, NULL where none kept yet */
    Py_ssize_t size;   /* 0 until the first event is kept */
    Py_ssize_t cursor; /* the oldest kept event's slot, or the next empty one */
    Py_ssize_t limit;  /* pool: the most events kept (0: none) */
    Py_ssize_t held;
    unsigned long long made;
    unsigned long long reused;
    unsigned long long refused;
} EventMarker;

#define EVENT_MARKER_FIRST_RING 16
#define EVENT_MARKER_LOOK 8 /* kept events looked at from the oldest on for one nobody holds */
#define EVENT_MARKER_REFUSALS 64 /* kept events that would not record again: the pool retires */

/* event recorded; the reference is returned, or dropped with NULL on an error */
static PyObject *marker_record(PyObject *event) {
    PyObject *recorded = PyObject_CallMethodNoArgs(event, str_record);
    if (recorded == NULL) {
        Py_DECREF(event);
        return NULL;
    }
    Py_DECREF(recorded);
    return event;
}

static void marker_advance(EventMarker *self) {
    if (++self->cursor >= self->size) {
        self->cursor = 0;
    }
}

/* The ring doubled (up to limit), its events in the order they were handed out from slot 0
 * and the cursor on the first new (empty) slot. False, and the ring unchanged, when no memory. */
static int marker_grow(EventMarker *self) {
    Py_ssize_t size = self->size == 0 ? EVENT_MARKER_FIRST_RING : self->size * 2;
    if (size > self->limit) {
        size = self->limit;
    }
    PyObject **ring = PyMem_Calloc((size_t)size, sizeof(PyObject *));
    if (ring == NULL) {
        return 0;
    }
    for (Py_ssize_t i = 0; i < self->size; i++) {
        ring[i] = self->ring[(self->cursor + i) % self->size];
    }
    PyMem_Free(self->ring);
    self->ring = ring;
    self->cursor = self->size;
    self->size = size;
    return 1;
}

/* A new, recorded event kept (the ring takes its own reference) in the cursor's slot: an
 * empty one, a grown ring's first new one, or at the limit the slot of a still-held event,
 * which is then its holders' alone. */
static void marker_keep(EventMarker *self, PyObject *event) {
    PyObject *old = NULL;
    if (self->size == 0 || self->ring[self->cursor] != NULL) {
        if (self->size < self->limit && marker_grow(self)) {
            /* the cursor is on an empty slot */
        } else if (self->size == 0) {
            return;
        } else {
            old = self->ring[self->cursor];
            self->held--;
        }
    }
    Py_INCREF(event);
    self->ring[self->cursor] = event;
    self->held++;
    marker_advance(self);
    Py_XDECREF(old); /* last: its destruction may run any code */
}

/* No more pooling: the ring's events are let go (each destroyed with its last holder). */
static void marker_retire(EventMarker *self) {
    PyObject **ring = self->ring;
    Py_ssize_t size = self->size;
    self->ring = NULL;
    self->size = self->cursor = self->held = self->limit = 0;
    for (Py_ssize_t i = 0; i < size; i++) {
        Py_XDECREF(ring[i]);
    }
    PyMem_Free(ring);
}

/* A kept event refused to record again (a torch.Event keeps the device of its first record:
 * marks moved to another device): the new event takes its slot, if the ring still has it
 * there, else is kept as any new one. After EVENT_MARKER_REFUSALS of them the pool retires. The
 * caller holds a reference to old. */
static void marker_replace(EventMarker *self, Py_ssize_t slot, PyObject *old, PyObject *event) {
    if (slot < self->size && self->ring[slot] == old) {
        Py_INCREF(event);
        self->ring[slot] = event;
        Py_DECREF(old);
    } else if (self->limit > 0) {
        marker_keep(self, event);
    }
    if (self->refused >= EVENT_MARKER_REFUSALS) {
        marker_retire(self);
    }
}

static PyObject *EventMarker_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                                        PyObject *kwnames) {
    (void)args;
    if (PyVectorcall_NARGS(nargsf) != 0 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames) != 0)) {
        PyErr_SetString(PyExc_TypeError, "mark() takes no arguments");
        return NULL;
    }
    EventMarker *self = (EventMarker *)callable;
    PyObject *refused = NULL; /* a kept event that would not record again (owned) */
    Py_ssize_t refused_slot = 0;
    Py_ssize_t look = self->size < EVENT_MARKER_LOOK ? self->size : EVENT_MARKER_LOOK;
    for (Py_ssize_t i = 0, slot = self->cursor; i < look; i++) {
        PyObject *kept = self->ring[slot];
        if (kept == NULL) {
            break; /* a grown ring's new slots, from the cursor on: fill them */
        }
        Py_ssize_t at = slot;
        if (++slot >= self->size) {
            slot = 0;
        }
        if (Py_REFCNT(kept) == 1) {
            Py_INCREF(kept); /* no other mark takes it while it records */
            self->cursor = slot;
            PyObject *recorded = PyObject_CallMethodNoArgs(kept, str_record);
            if (recorded != NULL) {
                Py_DECREF(recorded);
                self->reused++;
                return kept;
            }
            PyErr_Clear(); /* a new event instead, in its slot; its error if that fails too */
            self->refused++;
            refused = kept;
            refused_slot = at;
            break;
        }
    }
    PyObject *event = PyObject_CallNoArgs(self->factory);
    if (event == NULL || (event = marker_record(event)) == NULL) {
        Py_XDECREF(refused);
        return NULL;
    }
    self->made++;
    if (refused != NULL) {
        marker_replace(self, refused_slot, refused, event);
        Py_DECREF(refused); /* last: its destruction may run any code */
    } else if (self->limit > 0) {
        marker_keep(self, event);
    }
    return event;
}

static PyObject *EventMarker_call(PyObject *self, PyObject *args, PyObject *kwargs) {
    if (PyTuple_GET_SIZE(args) != 0 || (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0)) {
        PyErr_SetString(PyExc_TypeError, "mark() takes no arguments");
        return NULL;
    }
    return EventMarker_vectorcall(self, NULL, 0, NULL);
}

static PyObject *EventMarker_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"factory", "pool", NULL};
    PyObject *factory;
    Py_ssize_t pool = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|n:EventMarker", keywords, &factory, &pool)) {
        return NULL;
    }
    if (pool < 0) {
        PyErr_SetString(PyExc_ValueError, "EventMarker: pool must be >= 0");
        return NULL;
    }
    EventMarker *self = (EventMarker *)type->tp_alloc(type, 0);
    if (self != NULL) {
        self->vectorcall = EventMarker_vectorcall;
        Py_INCREF(factory);
        self->factory = factory;
        self->limit = pool;
    }
    return (PyObject *)self;
}

static int EventMarker_traverse(EventMarker *self, visitproc visit, void *arg) {
    Py_VISIT(self->factory);
    for (Py_ssize_t i = 0; i < self->size; i++) {
        Py_VISIT(self->ring[i]);
    }
    return 0;
}

static int EventMarker_clear(EventMarker *self) {
    marker_retire(self);
    Py_CLEAR(self->factory);
    return 0;
}

static void EventMarker_dealloc(EventMarker *self) {
    PyObject_GC_UnTrack(self);
    EventMarker_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef EventMarker_members[] = {
    {"pool", T_PYSSIZET, offsetof(EventMarker, limit), READONLY, "The most events kept."},
    {"held", T_PYSSIZET, offsetof(EventMarker, held), READONLY, "Events kept now."},
    {"made", T_ULONGLONG, offsetof(EventMarker, made), READONLY, "Events made."},
    {"reused", T_ULONGLONG, offsetof(EventMarker, reused), READONLY,
     "Marks recorded on a kept event nobody else held."},
    {"refused", T_ULONGLONG, offsetof(EventMarker, refused), READONLY,
     "Kept events that would not record again (replaced by new ones)."},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject EventMarkerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "stepwatch.exporters._fastrecord.EventMarker",
    .tp_basicsize = sizeof(EventMarker),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "EventMarker(factory, pool=0)(): factory() recorded (its record()) and returned; "
              "with a pool, the oldest of up to pool kept events that nobody else holds, "
              "recorded again.",
    .tp_new = EventMarker_new,
    .tp_call = EventMarker_call,
    .tp_vectorcall_offset = offsetof(EventMarker, vectorcall),
    .tp_dealloc = (destructor)EventMarker_dealloc,
    .tp_traverse = (traverseproc)EventMarker_traverse,
    .tp_clear = (inquiry)EventMarker_clear,
    .tp_members = EventMarker_members,
};
