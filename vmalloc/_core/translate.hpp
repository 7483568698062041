// Turns the C++ exception being handled into the matching Python exception of vmalloc.errors.
// Used by every Cython module as `except +vmalloc_raise_py_error`.
#pragma once

#include <Python.h>

#include <exception>
#include <new>

#include "vmalloc/base/errors.hpp"

namespace vmalloc_py {

// Raises errors.<name>(message, *extra) with extra given as a Py_BuildValue format.
inline void raise_named(const char* name, PyObject* args) {
  if (args == nullptr) return;  // Py_BuildValue failed and set an error
  PyObject* module = PyImport_ImportModule("vmalloc.errors");
  if (module == nullptr) {
    Py_DECREF(args);
    return;
  }
  PyObject* type = PyObject_GetAttrString(module, name);
  Py_DECREF(module);
  if (type == nullptr) {
    Py_DECREF(args);
    return;
  }
  PyObject* instance = PyObject_Call(type, args, nullptr);
  Py_DECREF(args);
  if (instance != nullptr) {
    PyErr_SetObject(type, instance);
    Py_DECREF(instance);
  }
  Py_DECREF(type);
}

}  // namespace vmalloc_py

inline void vmalloc_raise_py_error() {
  try {
    throw;
  } catch (const vmalloc::OutOfMemory& e) {
    vmalloc_py::raise_named("OutOfMemoryError",
                            Py_BuildValue("(sns)", e.what(), static_cast<Py_ssize_t>(e.requested()),
                                          e.state().c_str()));
  } catch (const vmalloc::InvalidPointer& e) {
    vmalloc_py::raise_named("InvalidPointerError", Py_BuildValue("(s)", e.what()));
  } catch (const vmalloc::InvalidArgument& e) {
    vmalloc_py::raise_named("InvalidArgumentError", Py_BuildValue("(s)", e.what()));
  } catch (const vmalloc::DeviceError& e) {
    vmalloc_py::raise_named("DeviceError",
                            Py_BuildValue("(ssi)", e.what(), e.call().c_str(), e.code()));
  } catch (const vmalloc::Error& e) {
    vmalloc_py::raise_named("VmallocError", Py_BuildValue("(s)", e.what()));
  } catch (const std::bad_alloc&) {
    PyErr_NoMemory();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  } catch (...) {
    PyErr_SetString(PyExc_RuntimeError, "vmalloc: unknown C++ exception");
  }
}
