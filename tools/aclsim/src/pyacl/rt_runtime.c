/* acl.rt device, stream and event functions. */
#include "pyacl.h"

#include "acl/acl.h"

/* Calls fn(arg) without the GIL and returns its error code as an int. */
#define CALL_RET(call)                  \
    do {                                \
        aclError ret_;                  \
        Py_BEGIN_ALLOW_THREADS          \
        ret_ = (call);                  \
        Py_END_ALLOW_THREADS            \
        return PyLong_FromLong(ret_);   \
    } while (0)

/* The functions taking one device id and returning ret. */
#define ONE_DEVICE(pyname, fn)                                           \
    static PyObject *pyname(PyObject *self, PyObject *args)              \
    {                                                                    \
        (void)self;                                                      \
        int id;                                                          \
        if (!PyArg_ParseTuple(args, "i", &id))                           \
            return NULL;                                                 \
        CALL_RET(fn(id));                                                \
    }

ONE_DEVICE(py_set_device, aclrtSetDevice)
ONE_DEVICE(py_reset_device, aclrtResetDevice)
ONE_DEVICE(py_reset_device_force, aclrtResetDeviceForce)

static PyObject *py_get_device(PyObject *self, PyObject *args)
{
    (void)self, (void)args;
    int32_t id = 0;
    aclError ret = aclrtGetDevice(&id);
    return Py_BuildValue("(ii)", (int)id, ret);
}

static PyObject *py_get_device_count(PyObject *self, PyObject *args)
{
    (void)self, (void)args;
    uint32_t count = 0;
    aclError ret = aclrtGetDeviceCount(&count);
    return Py_BuildValue("(Ii)", (unsigned int)count, ret);
}

static PyObject *py_synchronize_device(PyObject *self, PyObject *args)
{
    (void)self, (void)args;
    CALL_RET(aclrtSynchronizeDevice());
}

static PyObject *py_create_stream(PyObject *self, PyObject *args)
{
    (void)self, (void)args;
    aclrtStream stream = NULL;
    aclError ret = aclrtCreateStream(&stream);
    return Py_BuildValue("(Ni)", PyLong_FromVoidPtr(stream), ret);
}

/* The functions taking one handle (stream or event) and returning ret. */
#define ONE_HANDLE(pyname, fn)                                           \
    static PyObject *pyname(PyObject *self, PyObject *args)              \
    {                                                                    \
        (void)self;                                                      \
        void *handle;                                                    \
        if (!PyArg_ParseTuple(args, "O&", pyacl_to_ptr, &handle))        \
            return NULL;                                                 \
        CALL_RET(fn(handle));                                            \
    }

ONE_HANDLE(py_destroy_stream, aclrtDestroyStream)
ONE_HANDLE(py_destroy_stream_force, aclrtDestroyStreamForce)
ONE_HANDLE(py_synchronize_stream, aclrtSynchronizeStream)
ONE_HANDLE(py_synchronize_event, aclrtSynchronizeEvent)
ONE_HANDLE(py_destroy_event, aclrtDestroyEvent)

static PyObject *py_create_event(PyObject *self, PyObject *args)
{
    (void)self, (void)args;
    aclrtEvent event = NULL;
    aclError ret = aclrtCreateEvent(&event);
    return Py_BuildValue("(Ni)", PyLong_FromVoidPtr(event), ret);
}

static PyObject *py_record_event(PyObject *self, PyObject *args)
{
    (void)self;
    void *event, *stream;
    if (!PyArg_ParseTuple(args, "O&O&", pyacl_to_ptr, &event, pyacl_to_ptr, &stream))
        return NULL;
    CALL_RET(aclrtRecordEvent(event, stream));
}

static PyObject *py_stream_wait_event(PyObject *self, PyObject *args)
{
    (void)self;
    void *stream, *event;
    if (!PyArg_ParseTuple(args, "O&O&", pyacl_to_ptr, &stream, pyacl_to_ptr, &event))
        return NULL;
    CALL_RET(aclrtStreamWaitEvent(stream, event));
}

static PyObject *py_query_event_status(PyObject *self, PyObject *args)
{
    (void)self;
    void *event;
    if (!PyArg_ParseTuple(args, "O&", pyacl_to_ptr, &event))
        return NULL;
    aclrtEventRecordedStatus status = ACL_EVENT_RECORDED_STATUS_NOT_READY;
    aclError ret = aclrtQueryEventStatus(event, &status);
    return Py_BuildValue("(ii)", (int)status, ret);
}

static PyObject *py_query_event(PyObject *self, PyObject *args)
{
    (void)self;
    void *event;
    if (!PyArg_ParseTuple(args, "O&", pyacl_to_ptr, &event))
        return NULL;
    aclrtEventStatus status = ACL_EVENT_STATUS_NOT_READY;
    aclError ret = aclrtQueryEvent(event, &status);
    return Py_BuildValue("(ii)", (int)status, ret);
}

static PyObject *py_create_stream_with_config(PyObject *self, PyObject *args)
{
    (void)self;
    unsigned int priority, flag;
    if (!PyArg_ParseTuple(args, "II", &priority, &flag))
        return NULL;
    aclrtStream stream = NULL;
    aclError ret = aclrtCreateStreamWithConfig(&stream, priority, flag);
    return Py_BuildValue("(Ni)", PyLong_FromVoidPtr(stream), ret);
}

/* create_event_with_flag and create_event_ex_with_flag: event, ret = f(flag). */
#define EVENT_WITH_FLAG(pyname, fn)                                      \
    static PyObject *pyname(PyObject *self, PyObject *args)              \
    {                                                                    \
        (void)self;                                                      \
        unsigned int flag;                                               \
        if (!PyArg_ParseTuple(args, "I", &flag))                         \
            return NULL;                                                 \
        aclrtEvent event = NULL;                                         \
        aclError ret = fn(&event, flag);                                 \
        return Py_BuildValue("(Ni)", PyLong_FromVoidPtr(event), ret);    \
    }

EVENT_WITH_FLAG(py_create_event_with_flag, aclrtCreateEventWithFlag)
EVENT_WITH_FLAG(py_create_event_ex_with_flag, aclrtCreateEventExWithFlag)

static PyObject *py_event_elapsed_time(PyObject *self, PyObject *args)
{
    (void)self;
    void *start, *end;
    if (!PyArg_ParseTuple(args, "O&O&", pyacl_to_ptr, &start, pyacl_to_ptr, &end))
        return NULL;
    float ms = 0.0f;
    aclError ret;
    Py_BEGIN_ALLOW_THREADS
    ret = aclrtEventElapsedTime(&ms, start, end);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(di)", (double)ms, ret);
}

static PyObject *py_create_context(PyObject *self, PyObject *args)
{
    (void)self;
    int id;
    if (!PyArg_ParseTuple(args, "i", &id))
        return NULL;
    aclrtContext context = NULL;
    aclError ret;
    Py_BEGIN_ALLOW_THREADS
    ret = aclrtCreateContext(&context, id);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(Ni)", PyLong_FromVoidPtr(context), ret);
}

static PyObject *py_get_context(PyObject *self, PyObject *args)
{
    (void)self;
    (void)args;
    aclrtContext context = NULL;
    aclError ret = aclrtGetCurrentContext(&context);
    return Py_BuildValue("(Ni)", PyLong_FromVoidPtr(context), ret);
}

ONE_HANDLE(py_destroy_context, aclrtDestroyContext)
ONE_HANDLE(py_set_context, aclrtSetCurrentContext)

PyMethodDef pyacl_rt_runtime_methods[] = {
    {"set_device", py_set_device, METH_VARARGS, "ret = acl.rt.set_device(device_id)"},
    {"reset_device", py_reset_device, METH_VARARGS, "ret = acl.rt.reset_device(device_id)"},
    {"reset_device_force", py_reset_device_force, METH_VARARGS, "ret = acl.rt.reset_device_force(device_id)"},
    {"get_device", py_get_device, METH_NOARGS, "device_id, ret = acl.rt.get_device()"},
    {"get_device_count", py_get_device_count, METH_NOARGS, "count, ret = acl.rt.get_device_count()"},
    {"synchronize_device", py_synchronize_device, METH_NOARGS, "ret = acl.rt.synchronize_device()"},
    {"create_stream", py_create_stream, METH_NOARGS, "stream, ret = acl.rt.create_stream()"},
    {"destroy_stream", py_destroy_stream, METH_VARARGS, "ret = acl.rt.destroy_stream(stream)"},
    {"destroy_stream_force", py_destroy_stream_force, METH_VARARGS, "ret = acl.rt.destroy_stream_force(stream)"},
    {"synchronize_stream", py_synchronize_stream, METH_VARARGS, "ret = acl.rt.synchronize_stream(stream)"},
    {"create_event", py_create_event, METH_NOARGS, "event, ret = acl.rt.create_event()"},
    {"record_event", py_record_event, METH_VARARGS, "ret = acl.rt.record_event(event, stream)"},
    {"stream_wait_event", py_stream_wait_event, METH_VARARGS, "ret = acl.rt.stream_wait_event(stream, event)"},
    {"query_event_status", py_query_event_status, METH_VARARGS, "status, ret = acl.rt.query_event_status(event)"},
    {"query_event", py_query_event, METH_VARARGS, "status, ret = acl.rt.query_event(event)"},
    {"synchronize_event", py_synchronize_event, METH_VARARGS, "ret = acl.rt.synchronize_event(event)"},
    {"destroy_event", py_destroy_event, METH_VARARGS, "ret = acl.rt.destroy_event(event)"},
    {"create_stream_with_config", py_create_stream_with_config, METH_VARARGS,
     "stream, ret = acl.rt.create_stream_with_config(priority, flag)"},
    {"create_event_with_flag", py_create_event_with_flag, METH_VARARGS,
     "event, ret = acl.rt.create_event_with_flag(flag)"},
    {"create_event_ex_with_flag", py_create_event_ex_with_flag, METH_VARARGS,
     "event, ret = acl.rt.create_event_ex_with_flag(flag)"},
    {"event_elapsed_time", py_event_elapsed_time, METH_VARARGS,
     "ms, ret = acl.rt.event_elapsed_time(start_event, end_event)"},
    {"create_context", py_create_context, METH_VARARGS, "context, ret = acl.rt.create_context(device_id)"},
    {"destroy_context", py_destroy_context, METH_VARARGS, "ret = acl.rt.destroy_context(context)"},
    {"set_context", py_set_context, METH_VARARGS, "ret = acl.rt.set_context(context)"},
    {"get_context", py_get_context, METH_NOARGS, "context, ret = acl.rt.get_context()"},
    {NULL, NULL, 0, NULL},
};
