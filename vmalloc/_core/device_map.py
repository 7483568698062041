"""The ``{device: allocator}`` argument of the framework hooks (vmalloc.cupy, vmalloc.torch)."""


def as_device_map(allocators, device_key=None):
    """``{ordinal: allocator}`` from one allocator (for its own device's ordinal) or a mapping.

    ``device_key`` turns a mapping's key into the ordinal (a framework's device objects);
    without it keys are kept as given. Raises TypeError for anything that is not a
    ``vmalloc.Allocator`` or a mapping of them.
    """
    from vmalloc._core.allocator import Allocator  # an extension module: import it when used

    if isinstance(allocators, Allocator):
        return {allocators.device.ordinal: allocators}
    if hasattr(allocators, "items"):
        result = {}
        for device, allocator in allocators.items():
            if not isinstance(allocator, Allocator):
                raise TypeError(f"allocator for device {device} must be a vmalloc.Allocator, "
                                f"got {type(allocator).__name__}")
            result[device if device_key is None else device_key(device)] = allocator
        return result
    raise TypeError(f"expected a vmalloc.Allocator or a {{device: Allocator}} mapping, "
                    f"got {type(allocators).__name__}")
