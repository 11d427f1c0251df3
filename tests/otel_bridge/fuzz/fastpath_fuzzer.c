/* libFuzzer harness for the bridge's C fast path (otel_bridge/csrc/fastpath.c), which reads
 * OTLP protobuf request bodies straight off the network.
 *
 * The extension's source is compiled into this program with libFuzzer's coverage and the
 * sanitizers (ASan + UBSan; scripts/ci_sanitizers.sh, bench/fastpath_fuzz.sh) and registered
 * as the built-in module ``stepwatch.otel_bridge._fastpath``, so the bridge's own Python code
 * (``_fast.convert``) runs it rather than an installed build. Each input goes to
 * tests/otel_bridge/fuzz/oracle.py's ``check``: the fast path on the body, and where it
 * handles it, the Python path on the same body, which must agree. Anything it raises (a
 * disagreement, an exception out of the C code) aborts with the input saved; so do the
 * sanitizers' findings. Run with PYTHONMALLOC=malloc, so that the extension's PyMem buffers are
 * ASan's heap, the repository on PYTHONPATH and FUZZ_SITE naming the virtualenv's
 * site-packages (added as a site directory: its .pth files make the editable installs).
 */
#include "fastpath.c"

#include <stdio.h>
#include <stdlib.h>

static PyObject *check; /* oracle.check */

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void fail(const char *what) {
    fprintf(stderr, "fastpath_fuzzer: %s\n", what);
    if (PyErr_Occurred()) PyErr_Print();
    abort();
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    if (PyImport_AppendInittab("stepwatch.otel_bridge._fastpath", PyInit__fastpath) < 0)
        fail("cannot register the extension");
    Py_InitializeEx(0);
    if (PyRun_SimpleString("import os, site\n"
                           "if os.environ.get('FUZZ_SITE'): site.addsitedir(os.environ['FUZZ_SITE'])\n"))
        fail("cannot add FUZZ_SITE");
    PyObject *fast = PyImport_ImportModule("stepwatch.otel_bridge._fastpath");
    PyObject *spec = fast ? PyObject_GetAttrString(fast, "__spec__") : NULL;
    PyObject *origin = spec ? PyObject_GetAttrString(spec, "origin") : NULL;
    if (!origin || !PyUnicode_Check(origin) || PyUnicode_CompareWithASCIIString(origin, "built-in"))
        fail("stepwatch.otel_bridge._fastpath is not this program's instrumented build");
    Py_DECREF(origin);
    Py_DECREF(spec);
    Py_DECREF(fast);
    PyObject *oracle = PyImport_ImportModule("tests.otel_bridge.fuzz.oracle");
    check = oracle ? PyObject_GetAttrString(oracle, "check") : NULL;
    if (!check) fail("cannot import tests.otel_bridge.fuzz.oracle (PYTHONPATH, FUZZ_SITE?)");
    Py_DECREF(oracle);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    PyObject *input = PyBytes_FromStringAndSize((const char *)data, (Py_ssize_t)size);
    if (!input) fail("out of memory");
    PyObject *handled = PyObject_CallOneArg(check, input);
    Py_DECREF(input);
    if (!handled) fail("the oracle's check failed");
    Py_DECREF(handled);
    return 0;
}
