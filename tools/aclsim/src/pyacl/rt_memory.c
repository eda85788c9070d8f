/* acl.rt memory functions: malloc family, free, memset, memcpy, get_mem_info. */
#include "pyacl.h"

#include "acl/acl.h"

typedef aclError (*malloc_fn)(void **, size_t, aclrtMemMallocPolicy);

static PyObject *do_malloc(PyObject *args, malloc_fn fn)
{
    unsigned long long size;
    int policy;
    if (!PyArg_ParseTuple(args, "Ki", &size, &policy))
        return NULL;
    void *ptr = NULL;
    aclError ret;
    Py_BEGIN_ALLOW_THREADS
    ret = fn(&ptr, (size_t)size, (aclrtMemMallocPolicy)policy);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(Ni)", PyLong_FromVoidPtr(ptr), ret);
}

static PyObject *py_malloc(PyObject *self, PyObject *args) { (void)self; return do_malloc(args, aclrtMalloc); }
static PyObject *py_malloc_cached(PyObject *self, PyObject *args)
{
    (void)self;
    return do_malloc(args, aclrtMallocCached);
}
static PyObject *py_malloc_align32(PyObject *self, PyObject *args)
{
    (void)self;
    return do_malloc(args, aclrtMallocAlign32);
}

/* free and free_host: ret = f(ptr). */
static PyObject *do_free(PyObject *args, aclError (*fn)(void *))
{
    void *ptr;
    if (!PyArg_ParseTuple(args, "O&", pyacl_to_ptr, &ptr))
        return NULL;
    aclError ret;
    Py_BEGIN_ALLOW_THREADS
    ret = fn(ptr);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(ret);
}

static PyObject *py_free(PyObject *self, PyObject *args) { (void)self; return do_free(args, aclrtFree); }

static PyObject *py_memset(PyObject *self, PyObject *args)
{
    (void)self;
    void *ptr;
    unsigned long long max_size, count;
    int value;
    if (!PyArg_ParseTuple(args, "O&KiK", pyacl_to_ptr, &ptr, &max_size, &value, &count))
        return NULL;
    aclError ret;
    Py_BEGIN_ALLOW_THREADS
    ret = aclrtMemset(ptr, (size_t)max_size, value, (size_t)count);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(ret);
}

static PyObject *py_memset_async(PyObject *self, PyObject *args)
{
    (void)self;
    void *ptr, *stream;
    unsigned long long max_size, count;
    int value;
    if (!PyArg_ParseTuple(args, "O&KiKO&", pyacl_to_ptr, &ptr, &max_size, &value, &count, pyacl_to_ptr, &stream))
        return NULL;
    aclError ret;
    Py_BEGIN_ALLOW_THREADS
    ret = aclrtMemsetAsync(ptr, (size_t)max_size, value, (size_t)count, stream);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(ret);
}

static PyObject *py_memcpy(PyObject *self, PyObject *args)
{
    (void)self;
    void *dst, *src;
    unsigned long long dest_max, count;
    int kind;
    if (!PyArg_ParseTuple(args, "O&KO&Ki", pyacl_to_ptr, &dst, &dest_max, pyacl_to_ptr, &src, &count, &kind))
        return NULL;
    aclError ret;
    Py_BEGIN_ALLOW_THREADS
    ret = aclrtMemcpy(dst, (size_t)dest_max, src, (size_t)count, (aclrtMemcpyKind)kind);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(ret);
}

static PyObject *py_memcpy_async(PyObject *self, PyObject *args)
{
    (void)self;
    void *dst, *src, *stream;
    unsigned long long dest_max, count;
    int kind;
    if (!PyArg_ParseTuple(args, "O&KO&KiO&", pyacl_to_ptr, &dst, &dest_max, pyacl_to_ptr, &src, &count, &kind,
                          pyacl_to_ptr, &stream))
        return NULL;
    aclError ret;
    Py_BEGIN_ALLOW_THREADS
    ret = aclrtMemcpyAsync(dst, (size_t)dest_max, src, (size_t)count, (aclrtMemcpyKind)kind, stream);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(ret);
}

static PyObject *py_get_mem_info(PyObject *self, PyObject *args)
{
    (void)self;
    int attr;
    if (!PyArg_ParseTuple(args, "i", &attr))
        return NULL;
    size_t free_bytes = 0, total_bytes = 0;
    aclError ret;
    Py_BEGIN_ALLOW_THREADS
    ret = aclrtGetMemInfo((aclrtMemAttr)attr, &free_bytes, &total_bytes);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(KKi)", (unsigned long long)free_bytes,
                                              (unsigned long long)total_bytes, ret);
}

static PyObject *py_malloc_host(PyObject *self, PyObject *args)
{
    (void)self;
    unsigned long long size;
    if (!PyArg_ParseTuple(args, "K", &size))
        return NULL;
    void *ptr = NULL;
    aclError ret;
    Py_BEGIN_ALLOW_THREADS
    ret = aclrtMallocHost(&ptr, (size_t)size);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(Ni)", PyLong_FromVoidPtr(ptr), ret);
}

static PyObject *py_free_host(PyObject *self, PyObject *args)
{
    (void)self;
    return do_free(args, aclrtFreeHost);
}

PyMethodDef pyacl_rt_memory_methods[] = {
    {"malloc", py_malloc, METH_VARARGS, "dev_ptr, ret = acl.rt.malloc(size, policy)"},
    {"malloc_cached", py_malloc_cached, METH_VARARGS, "dev_ptr, ret = acl.rt.malloc_cached(size, policy)"},
    {"malloc_align32", py_malloc_align32, METH_VARARGS, "dev_ptr, ret = acl.rt.malloc_align32(size, policy)"},
    {"free", py_free, METH_VARARGS, "ret = acl.rt.free(dev_ptr)"},
    {"malloc_host", py_malloc_host, METH_VARARGS, "host_ptr, ret = acl.rt.malloc_host(size)"},
    {"free_host", py_free_host, METH_VARARGS, "ret = acl.rt.free_host(host_ptr)"},
    {"memset", py_memset, METH_VARARGS, "ret = acl.rt.memset(dev_ptr, max_size, value, count)"},
    {"memset_async", py_memset_async, METH_VARARGS,
     "ret = acl.rt.memset_async(dev_ptr, max_size, value, count, stream)"},
    {"memcpy", py_memcpy, METH_VARARGS, "ret = acl.rt.memcpy(dst, dest_max, src, count, kind)"},
    {"memcpy_async", py_memcpy_async, METH_VARARGS,
     "ret = acl.rt.memcpy_async(dst, dest_max, src, count, kind, stream)"},
    {"get_mem_info", py_get_mem_info, METH_VARARGS, "free, total, ret = acl.rt.get_mem_info(attr)"},
    {NULL, NULL, 0, NULL},
};
