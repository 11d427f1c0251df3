/* StepBuffer: the C recorder's finished steps, oldest first (included by fastrecord.c).
 *
 * The export thread reads it as it read the collections.deque it replaces: len(), truth,
 * buffer[i], popleft(), append(record), clear() and iteration, each record the tuple
 * (index, start_ns, end_ns, phases, device marks or None, auto-mode phases) of
 * _recorder.StepRecord. The difference is on the training thread (issue 15, cold memory): a
 * host-timed step's end (do_end) writes its numbers into the next slot of a ring of plain C
 * structs, with its phase dict (none when empty: the recorder keeps that one for the next
 * step) and its exposed wait not yet added to the phases. The tuple, its three ints, the
 * wait's fold into phases["communication"] and a fresh empty dict are made when the export
 * thread first reads the step, off the training step. At 1024 wide a step's record cost the
 * training thread ~3 us, every allocation a cache miss after the model's memory traffic;
 * one 64-byte slot written in order is about one.
 *
 * A phase of the loop's own (``monitor.phase()``, host clock) travels the same way: the recorder
 * adds its time to one of PHASE_SLOTS slots of plain ns (fastrecord.c: phase_slot_add), a name a
 * slot, and the step's end copies the used ones into the entry (slot_ns, slot_mask) with no
 * dict, int or allocation; the names are the buffer's (slot_names, set once) and the export
 * thread adds them to the record's phases.
 *
 * Memory: the ring doubles as needed and keeps its size (the most steps one window held),
 * except that a ring of more than 65,536 slots is freed once empty (a backlog after failed
 * exports). Every call runs under the GIL. */

typedef struct {
    PyObject *record; /* the record tuple, or NULL while compact */
    PyObject *phases; /* compact: the step's phase dict (owned), or NULL: an empty dict */
    PyObject *auto_;  /* compact: record[5], owned (None, UNSAMPLED or a sampled step's dict) */
    long long index;
    long long start;
    long long end;
    long long wait;   /* compact: ns to add to phases["communication"] (0: none) */
    unsigned long long slot_mask;     /* compact: the phase slots this step used */
    long long slot_ns[PHASE_SLOTS];   /* compact: their ns, to add to phases[slot_names[i]] */
} StepEntry;

typedef struct {
    PyObject_HEAD
    StepEntry *ring;
    Py_ssize_t capacity; /* 0 or a power of two */
    Py_ssize_t head;     /* the oldest entry's slot */
    Py_ssize_t count;
    PyObject *slot_names[PHASE_SLOTS]; /* the phase slots' names, each set once (owned) */
} StepBuffer;

static PyTypeObject StepBufferType;

#define STEP_BUFFER_KEEP 65536

static StepEntry *step_entry(StepBuffer *self, Py_ssize_t i) {
    return &self->ring[(self->head + i) & (self->capacity - 1)];
}

/* Room for one more entry: 0, or -1 with MemoryError set. */
static int step_buffer_reserve(StepBuffer *self) {
    if (self->count < self->capacity) {
        return 0;
    }
    Py_ssize_t capacity = self->capacity ? self->capacity * 2 : 64;
    if ((size_t)capacity > PY_SSIZE_T_MAX / sizeof(StepEntry)) {
        PyErr_NoMemory();
        return -1;
    }
    StepEntry *ring = PyMem_Malloc((size_t)capacity * sizeof(StepEntry));
    if (ring == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < self->count; i++) {
        ring[i] = *step_entry(self, i);
    }
    PyMem_Free(self->ring);
    self->ring = ring;
    self->capacity = capacity;
    self->head = 0;
    return 0;
}

static void step_entry_clear(StepEntry *entry) {
    Py_CLEAR(entry->record);
    Py_CLEAR(entry->phases);
    Py_CLEAR(entry->auto_);
}

/* The entry's record tuple, made (once) from its compact parts: a new reference, or NULL with
 * an exception set (the entry is left as it was). */
static PyObject *step_entry_record(StepBuffer *buffer, StepEntry *entry) {
    if (entry->record != NULL) {
        Py_INCREF(entry->record);
        return entry->record;
    }
    PyObject *numbers[3] = {PyLong_FromLongLong(entry->index), PyLong_FromLongLong(entry->start),
                            PyLong_FromLongLong(entry->end)};
    PyObject *phases = entry->phases;
    if (phases == NULL) {
        phases = PyDict_New();
    } else {
        Py_INCREF(phases);
    }
    PyObject *record = PyTuple_New(6);
    if (numbers[0] == NULL || numbers[1] == NULL || numbers[2] == NULL || phases == NULL ||
        record == NULL) {
        goto failed;
    }
    if (entry->wait != 0) { /* the exposed wait, where the optimizer pre-hook kept it */
        PyObject *wait = PyLong_FromLongLong(entry->wait);
        PyObject *added = wait == NULL ? NULL : add_to(phases, str_communication, wait);
        Py_XDECREF(wait);
        if (added == NULL) {
            goto failed;
        }
        Py_DECREF(added);
        entry->wait = 0;
    }
    for (int i = 0; i < PHASE_SLOTS; i++) { /* the loop's phases, where the recorder kept them */
        unsigned long long bit = 1ULL << i;
        if (!(entry->slot_mask & bit)) {
            continue;
        }
        PyObject *name = buffer->slot_names[i];
        PyObject *ns = name == NULL ? NULL : PyLong_FromLongLong(entry->slot_ns[i]);
        PyObject *added = ns == NULL ? NULL : add_to(phases, name, ns);
        Py_XDECREF(ns);
        if (added == NULL) {
            if (!PyErr_Occurred()) {
                PyErr_SetString(PyExc_RuntimeError, "a phase slot without its name");
            }
            goto failed;
        }
        Py_DECREF(added);
        entry->slot_mask &= ~bit;
    }
    for (int i = 0; i < 3; i++) {
        PyTuple_SET_ITEM(record, i, numbers[i]);
    }
    PyTuple_SET_ITEM(record, 3, phases);
    Py_INCREF(Py_None);
    PyTuple_SET_ITEM(record, 4, Py_None);
    PyObject *last = entry->auto_ != NULL ? entry->auto_ : Py_None;
    Py_INCREF(last);
    PyTuple_SET_ITEM(record, 5, last);
    Py_CLEAR(entry->phases);
    Py_CLEAR(entry->auto_);
    Py_INCREF(record);
    entry->record = record;
    return record;
failed:
    for (int i = 0; i < 3; i++) {
        Py_XDECREF(numbers[i]);
    }
    Py_XDECREF(phases);
    Py_XDECREF(record);
    return NULL;
}

/* The next slot, filled by the recorder (do_end): NULL with MemoryError set. */
static StepEntry *step_buffer_push(StepBuffer *self) {
    if (step_buffer_reserve(self) < 0) {
        return NULL;
    }
    StepEntry *entry = step_entry(self, self->count);
    memset(entry, 0, sizeof(*entry));
    self->count += 1;
    return entry;
}

static void step_buffer_shrink(StepBuffer *self) {
    if (self->count == 0 && self->capacity > STEP_BUFFER_KEEP) {
        PyMem_Free(self->ring);
        self->ring = NULL;
        self->capacity = 0;
        self->head = 0;
    }
}

static PyObject *StepBuffer_append(StepBuffer *self, PyObject *record) {
    StepEntry *entry = step_buffer_push(self);
    if (entry == NULL) {
        return NULL;
    }
    Py_INCREF(record);
    entry->record = record;
    Py_RETURN_NONE;
}

static PyObject *StepBuffer_popleft(StepBuffer *self, PyObject *unused) {
    (void)unused;
    if (self->count == 0) {
        PyErr_SetString(PyExc_IndexError, "pop from an empty StepBuffer");
        return NULL;
    }
    StepEntry *entry = step_entry(self, 0);
    PyObject *record = step_entry_record(self, entry);
    if (record == NULL) {
        return NULL;
    }
    step_entry_clear(entry);
    self->head = (self->head + 1) & (self->capacity - 1);
    self->count -= 1;
    step_buffer_shrink(self);
    return record;
}

static PyObject *StepBuffer_clear_method(StepBuffer *self, PyObject *unused) {
    (void)unused;
    /* One entry at a time, each out of the ring before its references go (a finaliser that
     * runs meanwhile sees a consistent buffer). */
    while (self->count > 0) {
        StepEntry entry = *step_entry(self, 0);
        self->head = (self->head + 1) & (self->capacity - 1);
        self->count -= 1;
        step_entry_clear(&entry);
    }
    step_buffer_shrink(self);
    Py_RETURN_NONE;
}

static Py_ssize_t StepBuffer_length(StepBuffer *self) {
    return self->count;
}

static PyObject *StepBuffer_item(StepBuffer *self, Py_ssize_t i) {
    if (i < 0 || i >= self->count) {
        PyErr_SetString(PyExc_IndexError, "StepBuffer index out of range");
        return NULL;
    }
    return step_entry_record(self, step_entry(self, i));
}

static PyObject *StepBuffer_iter(StepBuffer *self) {
    /* A snapshot, as the records are now (a deque's iterator would refuse a change). */
    PyObject *records = PyList_New(self->count);
    if (records == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(records); i++) {
        PyObject *record = step_entry_record(self, step_entry(self, i));
        if (record == NULL) {
            Py_DECREF(records);
            return NULL;
        }
        PyList_SET_ITEM(records, i, record);
    }
    PyObject *iterator = PyObject_GetIter(records);
    Py_DECREF(records);
    return iterator;
}

static int StepBuffer_traverse(StepBuffer *self, visitproc visit, void *arg) {
    for (Py_ssize_t i = 0; i < self->count; i++) {
        StepEntry *entry = step_entry(self, i);
        Py_VISIT(entry->record);
        Py_VISIT(entry->phases);
        Py_VISIT(entry->auto_);
    }
    return 0;
}

static int StepBuffer_clear(StepBuffer *self) {
    PyObject *done = StepBuffer_clear_method(self, NULL);
    Py_XDECREF(done);
    return 0;
}

static void StepBuffer_dealloc(StepBuffer *self) {
    PyObject_GC_UnTrack(self);
    StepBuffer_clear(self);
    PyMem_Free(self->ring);
    for (int i = 0; i < PHASE_SLOTS; i++) {
        Py_CLEAR(self->slot_names[i]);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *StepBuffer_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    if (PyTuple_GET_SIZE(args) != 0 || (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0)) {
        PyErr_SetString(PyExc_TypeError, "StepBuffer() takes no arguments");
        return NULL;
    }
    return type->tp_alloc(type, 0);
}

static PyObject *StepBuffer_repr(StepBuffer *self) {
    return PyUnicode_FromFormat("<StepBuffer of %zd steps>", self->count);
}

static PyMethodDef StepBuffer_methods[] = {
    {"append", (PyCFunction)StepBuffer_append, METH_O, "append(record): add a finished step."},
    {"popleft", (PyCFunction)StepBuffer_popleft, METH_NOARGS,
     "popleft(): remove and return the oldest step's record."},
    {"clear", (PyCFunction)StepBuffer_clear_method, METH_NOARGS, "clear(): drop every step."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods StepBuffer_as_sequence = {
    .sq_length = (lenfunc)StepBuffer_length,
    .sq_item = (ssizeargfunc)StepBuffer_item,
};

static PyTypeObject StepBufferType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "stepwatch.exporters._fastrecord.StepBuffer",
    .tp_basicsize = sizeof(StepBuffer),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The C recorder's finished steps, oldest first: a deque of StepRecord tuples to "
              "its readers, made from compact slots as they are first read.",
    .tp_new = StepBuffer_new,
    .tp_dealloc = (destructor)StepBuffer_dealloc,
    .tp_traverse = (traverseproc)StepBuffer_traverse,
    .tp_clear = (inquiry)StepBuffer_clear,
    .tp_iter = (getiterfunc)StepBuffer_iter,
    .tp_repr = (reprfunc)StepBuffer_repr,
    .tp_as_sequence = &StepBuffer_as_sequence,
    .tp_methods = StepBuffer_methods,
};
