"""The compiled wrappers of libvmalloc's device, chunk pool and allocator classes, with the
Python they need (the statistics record, the framework hooks' device map).

It mirrors :mod:`vmalloc._lib`, the Cython declarations of the C++ headers, as RMM's
``pylibrmm`` mirrors ``librmm``: ``_lib/device/host_device.pxd`` declares the C++ class that
``_core/host_device.pyx`` wraps. Private: the classes are used through the package root
(``vmalloc.HostDevice``, ``vmalloc.VirtualAllocator``, ``vmalloc.Stats``, ...).
"""
