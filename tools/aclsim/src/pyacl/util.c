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

PyMethodDef pyacl_util_methods[] = {
    {"bytes_to_ptr", py_bytes_to_ptr, METH_VARARGS, "ptr = acl.util.bytes_to_ptr(data)"},
    {"ptr_to_bytes", py_ptr_to_bytes, METH_VARARGS, "data = acl.util.ptr_to_bytes(ptr, size)"},
    {NULL, NULL, 0, NULL},
};
