"""vmalloc.allocator_kinds, the one list of allocator kinds, and the size parsing every command
line shares (vmalloc.sizes)."""

import argparse
import importlib.util
import pathlib
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

import vmalloc
from vmalloc import allocator_kinds, bench, replay
from vmalloc.offload import SwapManager
from vmalloc.sizes import parse_optional_size, size_argument, size_list_argument

MiB = 1 << 20
NAMES = ("caching", "expandable-segments", "virtual", "virtual-packed")


def test_the_list():
    assert allocator_kinds.NAMES == NAMES
    assert tuple(allocator_kinds.KINDS) == NAMES
    assert [(k.class_name, dict(k.fixed), k.options) for k in allocator_kinds.KINDS.values()] == [
        ("CachingAllocator", {}, ("max_split_size", "policy")),
        ("CachingAllocator", {"expandable_segments": True}, ("max_split_size",)),
        ("VirtualAllocator", {"placement": "chunks"}, ("chunk_size", "steal_before_create")),
        ("VirtualAllocator", {"placement": "packed"},
         ("chunk_size", "steal_before_create", "remap_slack")),
    ]
    with pytest.raises(TypeError):
        allocator_kinds.KINDS["mine"] = None  # read-only: one list, changed in one place


def test_everyone_uses_the_list():
    assert replay.ALLOCATOR_KINDS is allocator_kinds.NAMES
    assert replay.ALLOCATOR_NAMES is allocator_kinds.NAMES
    conftest = pathlib.Path(__file__).resolve().parents[1] / "conftest.py"
    spec = importlib.util.spec_from_file_location("_conftest_copy", conftest)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert tuple(module.ALLOCATOR_KINDS) == NAMES
    assert not hasattr(bench, "ALLOCATORS")
    assert set(bench.DEFAULT_ALLOCATORS) <= set(NAMES)
    with pytest.raises(SystemExit):
        bench.main(["--allocator", "mine"])


@pytest.mark.parametrize("name", NAMES)
def test_make_builds_the_kind(name):
    dev = vmalloc.HostDevice(capacity="64MiB", backed=False)
    a = allocator_kinds.make(name, dev, budget="32MiB")
    assert type(a).__name__ == allocator_kinds.KINDS[name].class_name
    assert a.budget == 32 * MiB
    if name.startswith("virtual"):
        assert a.placement == ("packed" if name == "virtual-packed" else "chunks")
    else:
        assert a.expandable_segments is (name == "expandable-segments")
    assert bench.make_allocator(name, dev).name == a.name
    assert replay.make_allocator(name, dev).name == a.name


def test_one_allocator_factory_and_one_accounting_device_factory():
    # replay, bench and the simulator build through allocator_kinds' two factories.
    assert replay.make_allocator is allocator_kinds.make_allocator
    assert bench.make_allocator is allocator_kinds.make_allocator
    assert bench.make_device is allocator_kinds.accounting_device
    dev = allocator_kinds.accounting_device("64MiB", "4MiB")
    assert (type(dev), dev.backed, dev.capacity, dev.granularity) == (
        vmalloc.HostDevice, False, 64 * MiB, 4 * MiB)
    default = allocator_kinds.accounting_device()
    assert not default.backed and default.granularity == 2 * MiB
    # Comparison options that do not apply to the kind, or are None, are dropped; sizes parse.
    a = allocator_kinds.make_allocator("virtual", dev, chunk_size="8MiB", max_split_size="1MiB",
                                       policy=None)
    assert (a.placement, a.chunk_size) == ("chunks", 8 * MiB)
    built = []
    assert allocator_kinds.make_allocator(lambda d: built.append(d) or "mine", dev) == "mine"
    assert built == [dev]
    # Nothing else in the package builds allocators by kind or accounting devices itself.
    package = pathlib.Path(vmalloc.__file__).resolve().parent
    sources = [p for p in package.rglob("*.py") if p.name != "allocator_kinds.py"]
    built_here = re.compile(r'allocator_kinds\.make\(|(?<!")HostDevice\([^)]*backed\s*=\s*False')
    offenders = [str(p.relative_to(package)) for p in sources
                 if built_here.search(p.read_text())]
    assert offenders == []


def test_make_refuses_what_contradicts_the_kind():
    dev = vmalloc.HostDevice(backed=False)
    with pytest.raises(vmalloc.InvalidArgumentError,
                       match=r"^allocator 'virtual-packed' is VirtualAllocator with "
                             r"placement='packed'; got placement='chunks'$"):
        allocator_kinds.make("virtual-packed", dev, placement="chunks")
    with pytest.raises(vmalloc.InvalidArgumentError, match="expandable_segments=True"):
        allocator_kinds.make("expandable-segments", dev, expandable_segments=False)
    # Saying what the kind says anyway is fine.
    assert allocator_kinds.make("virtual", dev, placement="chunks").placement == "chunks"


@pytest.mark.parametrize("name", ["mine", "Virtual", "", None, ["virtual"]])
def test_unknown_names_are_refused_with_the_list(name):
    with pytest.raises(vmalloc.InvalidArgumentError) as error:
        allocator_kinds.get(name)
    assert str(error.value) == (f"unknown allocator {name!r}; choose from caching, "
                                "expandable-segments, virtual, virtual-packed")


#: Which comparison option applies to which kind, written out independently of the module.
APPLIES = {
    "chunk_size": {"virtual", "virtual-packed"},
    "steal_before_create": {"virtual", "virtual-packed"},
    "remap_slack": {"virtual-packed"},
    "max_split_size": {"caching", "expandable-segments"},
    "policy": {"caching"},
}
PARSED = {"chunk_size": ("4MiB", 4 * MiB), "steal_before_create": (1, True),
          "remap_slack": ("0.25", 0.25), "max_split_size": (64 * MiB, 64 * MiB),
          "policy": ("cupy", "cupy")}


@given(name=st.sampled_from(NAMES),
       given_options=st.dictionaries(st.sampled_from(sorted(PARSED)), st.booleans()))
def test_applicable_keeps_exactly_the_options_of_the_kind(name, given_options):
    # given_options: option -> whether it is given a value (else None).
    options = {k: (PARSED[k][0] if has else None) for k, has in given_options.items()}
    expected = {k: PARSED[k][1] for k, has in given_options.items()
                if has and name in APPLIES[k]}
    assert allocator_kinds.get(name).applicable(**options) == expected


def test_applicable_refuses_unknown_options_and_bad_values():
    kind = allocator_kinds.get("virtual")
    with pytest.raises(vmalloc.InvalidArgumentError, match="unknown allocator option 'budget'"):
        kind.applicable(budget="1GiB")
    with pytest.raises(vmalloc.InvalidArgumentError, match="chunk_size '2 lumps' is not a size"):
        kind.applicable(chunk_size="2 lumps")


# ---- sizes ------------------------------------------------------------------------------------

def test_parse_optional_size():
    assert parse_optional_size(None, "budget", "no budget") == 0
    assert parse_optional_size("1.5KiB", "budget", "no budget") == 1536
    with pytest.raises(vmalloc.InvalidArgumentError) as error:
        parse_optional_size("0MiB", "budget", "no budget")
    assert str(error.value) == "budget must be positive (None for no budget), got 0"
    with pytest.raises(vmalloc.InvalidArgumentError, match="host_capacity must not be negative"):
        parse_optional_size(-1, "host_capacity", "no limit")


def test_the_wrappers_share_the_message():
    dev = vmalloc.HostDevice(backed=False)
    for make, what, none in (
            (lambda: vmalloc.VirtualAllocator(dev, budget=0), "budget", "no budget"),
            (lambda: vmalloc.VirtualAllocator(dev, placement="packed", reservation_size=0),
             "reservation_size", "1 GiB"),
            (lambda: vmalloc.CachingAllocator(dev, budget="0B"), "budget", "no budget"),
            (lambda: SwapManager(vmalloc.CachingAllocator(dev), host_capacity=0),
             "host_capacity", "no limit")):
        with pytest.raises(vmalloc.InvalidArgumentError) as error:
            make()
        assert str(error.value) == f"{what} must be positive (None for {none}), got 0"


def test_size_argument_is_an_argparse_type():
    assert size_argument("40MB") == 40_000_000
    with pytest.raises(argparse.ArgumentTypeError,
                       match=r"^size '4 parsecs' is not a size: write bytes"):
        size_argument("4 parsecs")


@given(st.lists(st.integers(1, 1 << 50), min_size=1, max_size=8))
def test_size_list_argument_reads_back_what_is_written(sizes):
    assert size_list_argument(",".join(map(str, sizes))) == sizes
    assert size_list_argument(" , ".join(f"{n}B" for n in sizes) + ",") == sizes


@pytest.mark.parametrize("text", ["", ",", "4KiB,0", "0"])
def test_size_list_argument_needs_positive_sizes(text):
    with pytest.raises(argparse.ArgumentTypeError) as error:
        size_list_argument(text)
    assert str(error.value) == (f"{text!r} is not a list of positive sizes such as "
                                "'4KiB,3MiB'")
