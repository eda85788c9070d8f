/* The sim's pyACL-compatible `acl` extension module. Like the real pyACL it
 * is linked against libascendcl.so and calls aclrt* by name, so the calls go
 * through the dynamic linker and an LD_PRELOADed aclrtMalloc wins.
 * Conventions follow pyACL: pointers and handles are Python ints, results
 * come first and the error code last (`ptr, ret = acl.rt.malloc(size, policy)`). */
#ifndef ACLSIM_PYACL_H
#define ACLSIM_PYACL_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* "O&" converter: a Python int (0 for NULL) to a void *. */
int pyacl_to_ptr(PyObject *obj, void *out);

extern PyMethodDef pyacl_rt_memory_methods[];
extern PyMethodDef pyacl_rt_runtime_methods[];
extern PyMethodDef pyacl_util_methods[];

#endif
