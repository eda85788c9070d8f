/* acl.util: conversions between Python buffers and raw pointers. */
#include "pyacl.h"

/* The address of a bytes-like object's data, valid while the object lives
 * unchanged (as in pyACL, the caller keeps the object alive). */
static PyObject *py_bytes_to_ptr(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *obj;
    if (!PyArg_ParseTuple(args, "O", &obj))
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_SIMPLE) != 0)
        return NULL;
    void *ptr = view.buf;
    PyBuffer_Release(&view);
    return PyLong_FromVoidPtr(ptr);
}

static PyObject *py_ptr_to_bytes(PyObject *self, PyObject *args)
{
    (void)self;
    void *ptr;
    Py_ssize_t size;
    if (!PyArg_ParseTuple(args, "O&n", pyacl_to_ptr, &ptr, &size))
        return NULL;
    if (ptr == NULL || size < 0) {
        PyErr_SetString(PyExc_ValueError, "ptr_to_bytes needs a non-NULL pointer and a size >= 0");
        return NULL;
    }
    return PyBytes_FromStringAndSize(ptr, size);
}

/* pyACL's numpy helpers. numpy is imported on first use, so the module
 * works without it; its C API is not needed, only the Python one. */
static PyObject *import_numpy(const char *caller)
{
    PyObject *np = PyImport_ImportModule("numpy");
    if (np == NULL)
        PyErr_Format(PyExc_ImportError, "acl.util.%s needs numpy", caller);
    return np;
}

/* The data address of a numpy array (a C-contiguous one: pyACL hands it to
 * memcpy calls as one flat buffer). */
static PyObject *py_numpy_to_ptr(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *array;
    if (!PyArg_ParseTuple(args, "O", &array))
        return NULL;
    PyObject *np = import_numpy("numpy_to_ptr");
    if (np == NULL)
        return NULL;
    Py_DECREF(np);
    Py_buffer view;
    if (PyObject_GetBuffer(array, &view, PyBUF_C_CONTIGUOUS) != 0)
        return NULL;
    void *ptr = view.buf;
    PyBuffer_Release(&view);
    return PyLong_FromVoidPtr(ptr);
}

/* NumPy type numbers pyACL documents for ptr_to_numpy, as dtype codes. */
static const char *dtype_of_type_number(long type)
{
    static const char *const codes[] = {"?", "b", "B", "h", "H", "i", "I", "l", "L", "q", "Q", "f", "d"};
    if (type >= 0 && type < (long)(sizeof(codes) / sizeof(codes[0])))
        return codes[type];
    return type == 23 ? "e" : NULL; /* NPY_HALF */
}

/* A numpy array over memory at ptr (no copy: writes go to that memory, as in
 * pyACL). */
static PyObject *py_ptr_to_numpy(PyObject *self, PyObject *args)
{
    (void)self;
    void *ptr;
    PyObject *shape;
    long type;
    if (!PyArg_ParseTuple(args, "O&Ol", pyacl_to_ptr, &ptr, &shape, &type))
        return NULL;
    const char *code = dtype_of_type_number(type);
    if (ptr == NULL || code == NULL) {
        PyErr_SetString(PyExc_ValueError, "ptr_to_numpy needs a non-NULL pointer and a numpy type number");
        return NULL;
    }
    PyObject *np = import_numpy("ptr_to_numpy");
    if (np == NULL)
        return NULL;
    PyObject *result = NULL, *dtype = NULL, *count = NULL, *flat = NULL, *memory = NULL;
    dtype = PyObject_CallMethod(np, "dtype", "s", code);
    count = dtype ? PyObject_CallMethod(np, "prod", "(O)", shape) : NULL;
    Py_ssize_t items = count ? PyNumber_AsSsize_t(count, PyExc_OverflowError) : -1;
    PyObject *itemsize = dtype ? PyObject_GetAttrString(dtype, "itemsize") : NULL;
    Py_ssize_t width = itemsize ? PyLong_AsSsize_t(itemsize) : -1;
    Py_XDECREF(itemsize);
    if (items >= 0 && width > 0 && !PyErr_Occurred()) {
        memory = PyMemoryView_FromMemory(ptr, items * width, PyBUF_WRITE);
        flat = memory ? PyObject_CallMethod(np, "frombuffer", "OO", memory, dtype) : NULL;
        result = flat ? PyObject_CallMethod(flat, "reshape", "(O)", shape) : NULL;
    }
    Py_XDECREF(flat);
    Py_XDECREF(memory);
    Py_XDECREF(count);
    Py_XDECREF(dtype);
    Py_DECREF(np);
    return result;
}

PyMethodDef pyacl_util_methods[] = {
    {"numpy_to_ptr", py_numpy_to_ptr, METH_VARARGS, "ptr = acl.util.numpy_to_ptr(array)"},
    {"ptr_to_numpy", py_ptr_to_numpy, METH_VARARGS, "array = acl.util.ptr_to_numpy(ptr, shape, numpy_type_number)"},
    {"bytes_to_ptr", py_bytes_to_ptr, METH_VARARGS, "ptr = acl.util.bytes_to_ptr(data)"},
    {"ptr_to_bytes", py_ptr_to_bytes, METH_VARARGS, "data = acl.util.ptr_to_bytes(ptr, size)"},
    {NULL, NULL, 0, NULL},
};
