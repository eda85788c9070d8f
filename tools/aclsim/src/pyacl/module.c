/* Module `acl`: acl.init/finalize/get_soc_name plus the acl.rt, acl.util and acl.op submodules. */
#include "pyacl.h"

#include "acl/acl.h"

int pyacl_to_ptr(PyObject *obj, void *out)
{
    void *p = PyLong_AsVoidPtr(obj);
    if (p == NULL && PyErr_Occurred())
        return 0;
    *(void **)out = p;
    return 1;
}

static PyObject *py_init(PyObject *self, PyObject *args)
{
    (void)self;
    const char *config = NULL;
    if (!PyArg_ParseTuple(args, "|z", &config))
        return NULL;
    aclError ret;
    Py_BEGIN_ALLOW_THREADS
    ret = aclInit(config);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(ret);
}

static PyObject *py_finalize(PyObject *self, PyObject *args)
{
    (void)self, (void)args;
    aclError ret;
    Py_BEGIN_ALLOW_THREADS
    ret = aclFinalize();
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(ret);
}

/* pyACL returns the name as a str (None when the runtime has none). */
static PyObject *py_get_soc_name(PyObject *self, PyObject *args)
{
    (void)self, (void)args;
    const char *name = aclrtGetSocName();
    if (name == NULL)
        Py_RETURN_NONE;
    return PyUnicode_FromString(name);
}

static PyObject *py_op_set_model_dir(PyObject *self, PyObject *args)
{
    (void)self;
    const char *dir;
    if (!PyArg_ParseTuple(args, "s", &dir))
        return NULL;
    return PyLong_FromLong(aclopSetModelDir(dir));
}

static PyMethodDef op_methods[] = {
    {"set_model_dir", py_op_set_model_dir, METH_VARARGS, "ret = acl.op.set_model_dir(model_dir)"},
    {NULL, NULL, 0, NULL},
};

static PyMethodDef top_methods[] = {
    {"get_soc_name", py_get_soc_name, METH_NOARGS, "soc_name = acl.get_soc_name()"},
    {"init", py_init, METH_VARARGS, "ret = acl.init([config_path])"},
    {"finalize", py_finalize, METH_NOARGS, "ret = acl.finalize()"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef acl_module = {PyModuleDef_HEAD_INIT, "acl",
                                        "pyACL-compatible module of the simulated CANN runtime (aclsim)", -1,
                                        top_methods, NULL, NULL, NULL, NULL};

/* A submodule built from method tables, attached as acl.<name> and
 * registered as "acl.<name>" so `import acl.rt` works too. */
static int add_submodule(PyObject *parent, const char *name, PyMethodDef *const tables[])
{
    char qualified[32];
    PyOS_snprintf(qualified, sizeof qualified, "acl.%s", name);
    PyObject *sub = PyModule_New(qualified);
    if (sub == NULL)
        return -1;
    for (size_t i = 0; tables[i] != NULL; i++) {
        if (PyModule_AddFunctions(sub, tables[i]) != 0) {
            Py_DECREF(sub);
            return -1;
        }
    }
    if (PyDict_SetItemString(PyImport_GetModuleDict(), qualified, sub) != 0 ||
        PyModule_AddObject(parent, name, sub) != 0) {
        Py_DECREF(sub);
        return -1;
    }
    return 0;
}

PyMODINIT_FUNC PyInit_acl(void)
{
    PyObject *m = PyModule_Create(&acl_module);
    if (m == NULL)
        return NULL;
    PyMethodDef *const rt[] = {pyacl_rt_memory_methods, pyacl_rt_runtime_methods, NULL};
    PyMethodDef *const util[] = {pyacl_util_methods, NULL};
    PyMethodDef *const op[] = {op_methods, NULL};
    if (add_submodule(m, "rt", rt) != 0 || add_submodule(m, "util", util) != 0 ||
        add_submodule(m, "op", op) != 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
