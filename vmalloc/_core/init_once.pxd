# What every wrapper class's __init__ does. Each wrapper builds its C++ object in __cinit__, so
# that no half-built wrapper can exist (even one made with cls.__new__(cls)); __init__ is left
# to refuse a second call, which Python would otherwise ignore without a word, leaving a caller
# who meant to rebuild the object with the old one.

cdef inline int refuse_second_init(object obj, bint* init_called) except -1:
    if init_called[0]:
        name = type(obj).__name__
        raise RuntimeError(f"{name} is already initialized: __init__ cannot be called twice; "
                           f"create a new {name}")
    init_called[0] = True
    return 0
