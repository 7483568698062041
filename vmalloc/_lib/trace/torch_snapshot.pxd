# include/vmalloc/trace/torch_snapshot.hpp: a PyTorch memory snapshot's history and segments
# read in C++, and one device's records and counters.
from libc.stdint cimport int64_t, uint32_t, uint64_t
from libcpp cimport bool
from libcpp.string cimport string
from libcpp.utility cimport pair
from libcpp.vector cimport vector

from vmalloc._lib.trace.pickle_reader cimport PickleReader
from vmalloc._lib.trace.replay cimport TraceEvent


cdef extern from "vmalloc/trace/torch_snapshot.hpp" namespace "vmalloc::trace_parse" nogil:
    cdef cppclass SnapshotDevice:
        uint64_t entries, records
        vector[pair[uint32_t, uint64_t]] actions, skipped
        uint64_t segments
        int64_t segment_bytes
        vector[TraceEvent] live, untouched
        uint64_t untouched_bytes

    cdef cppclass HistoryDevice "vmalloc::trace_parse::SnapshotHistory::Device":
        bool is_list
        uint64_t length

    cdef cppclass SnapshotHistory:
        bool build(PickleReader& pickle) except +
        vector[HistoryDevice] devices
        vector[string] actions
        bool select(size_t index, SnapshotDevice& out) except +
        void records(const SnapshotDevice& device, size_t first, size_t n,
                     vector[TraceEvent]& out) except +
