# include/vmalloc/trace/pickle_reader.hpp: the restricted unpickler of PyTorch snapshots (plain
# data only, no Python objects built).
from libc.stdint cimport uint64_t
from libcpp cimport bool
from libcpp.string cimport string
from libcpp.string_view cimport string_view
from libcpp.vector cimport vector


cdef extern from "vmalloc/trace/pickle_reader.hpp" namespace "vmalloc::trace_parse" nogil:
    cdef enum Word:
        w_allocator_settings

    cdef enum PickleKind "vmalloc::trace_parse::PickleValue::Kind":
        k_none "vmalloc::trace_parse::PickleValue::none"
        k_boolean "vmalloc::trace_parse::PickleValue::boolean"
        k_integer "vmalloc::trace_parse::PickleValue::integer"
        k_big_unsigned "vmalloc::trace_parse::PickleValue::big_unsigned"
        k_big_integer "vmalloc::trace_parse::PickleValue::big_integer"
        k_floating "vmalloc::trace_parse::PickleValue::floating"
        k_str "vmalloc::trace_parse::PickleValue::str"
        k_bytes "vmalloc::trace_parse::PickleValue::bytes"
        k_bytearray "vmalloc::trace_parse::PickleValue::bytearray"
        k_list "vmalloc::trace_parse::PickleValue::list"
        k_tuple "vmalloc::trace_parse::PickleValue::tuple"
        k_dict "vmalloc::trace_parse::PickleValue::dict"
        k_set "vmalloc::trace_parse::PickleValue::set"
        k_frozenset "vmalloc::trace_parse::PickleValue::frozenset"

    cdef cppclass PickleValue:
        uint64_t v
        PickleKind kind

    cdef enum class PickleStatus "vmalloc::trace_parse::PickleReader::Status":
        more "vmalloc::trace_parse::PickleReader::Status::more"
        done "vmalloc::trace_parse::PickleReader::Status::done"
        bail "vmalloc::trace_parse::PickleReader::Status::bail"
        error "vmalloc::trace_parse::PickleReader::Status::error"

    # Calls that allocate are "except +": a std::bad_alloc becomes a MemoryError.
    cdef cppclass PickleReader:
        PickleReader(uint64_t limit) except +
        PickleStatus feed(const char* data, size_t n) except +
        PickleStatus finish() except +
        const string& error()
        const PickleValue& root()
        string_view blob(const PickleValue& v)
        bool values(const PickleValue& c, vector[PickleValue]& out) except +
        const PickleValue* find(const PickleValue& d, Word word)
        bool compact(const PickleValue& v)
        void clear()
        uint64_t memory()
