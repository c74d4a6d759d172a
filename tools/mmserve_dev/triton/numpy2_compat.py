"""NumPy 2 compatibility for the Python-backend stub of nvidia-pytriton 0.7.0 (Triton 2.51;
``mmserve.triton_seam``: NUMPY2_STUB).

Who needs it: the ``triton_python_backend_stub`` binaries shipped in the ``nvidia-pytriton`` 0.7.0
wheel (tritonserver 2.51.0) when the stub runs under NumPy >= 2. They are built with a pybind11 older
than 2.12, which reads a dtype's itemsize as the C ``int`` at NumPy 1's offset in ``PyArray_Descr``
(byte 32). NumPy 2 moved ``elsize`` to byte 40 (an ``npy_intp``) and put the 64-bit ``flags`` at
byte 32, so pybind11 sees the low half of the flags instead: 0 for every numeric dtype. NGC Triton
images (``nvcr.io/nvidia/tritonserver``) build their stubs with a newer pybind11 and need none of
this; under NumPy 1 ``install`` does nothing.

What goes wrong without it, and what each part fixes:

(a) Inputs: ``as_numpy()`` builds the array through pybind11, which computes C-contiguous strides
    from the itemsize it saw (0), so every element repeats the first one (a TYPE_STRING input, whose
    bytes arrive as such a uint8 array, crashes the stub). pybind11 < 2.12 takes NumPy's C API from
    the capsule ``numpy.core.multiarray._ARRAY_API`` on first use; ``install`` puts there a copy of
    the table whose slot 94, ``PyArray_NewFromDescr``, recomputes such strides with the real itemsize.
(b) Numeric outputs: ``pb_utils.Tensor(name, array)`` takes the byte size as size * itemsize seen,
    i.e. 0 bytes. They are built through DLPack instead, where the stub computes the size itself
    (the consumed capsule is renamed back to the standard ``used_dltensor``, see ``_from_dlpack``).
(c) TYPE_STRING outputs: the stub copies size * "itemsize" bytes of what ``serialize_byte_tensor``
    returns. The serialized bytes are returned as an array of a private one-field ``uint8``
    structured dtype whose flags are set to 1 (so pybind11 reads itemsize 1) while ``Tensor()`` runs,
    and reset to 0 afterwards.

How it is installed: ``mmserve_dev.triton.install.prepare_backend_dir`` copies this file as
``mmserve_numpy2_compat.py`` into its copy of the Python backend, next to
``triton_python_backend_utils.py`` (the stub puts that folder on ``sys.path``), and appends to that
copy of the utils a hook calling ``install(sys.modules[__name__])``. At its end ``install`` checks,
inside the stub, that a tensor round-trips and prints to stderr (the server log) when it does not.

This file must stay self-contained (standard library and NumPy only): the stub imports it by itself.
"""

from __future__ import annotations

import ctypes
import importlib
import sys
import threading
import types
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["install"]

# NumPy 2's PyArray_Descr: PyObject_HEAD, typeobj, kind/type/byteorder/_former_flags, type_num (int),
# then flags (npy_uint64) at 32 -- where NumPy 1 had elsize (int) -- and elsize (npy_intp) at 40.
_FLAGS_OFFSET = 32
_ELSIZE_OFFSET = 40
_API_SLOTS = 300  # pybind11 uses slots up to 282 (PyArray_SetBaseObject)
_NEW_FROM_DESCR_SLOT = 94  # PyArray_NewFromDescr
_DLPACK_CPU_DEVICES = (1, 3)  # kDLCPU, kDLCUDAHost

# PyArray_NewFromDescr(subtype, descr, nd, dims, strides, data, flags, obj)
_SSIZE_P = ctypes.POINTER(ctypes.c_ssize_t)
_NEW_FROM_DESCR_ARGS = (
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, _SSIZE_P, _SSIZE_P,
    ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
)  # fmt: skip
_NewFromDescrPy = ctypes.PYFUNCTYPE(*_NEW_FROM_DESCR_ARGS)  # calls NumPy's, keeping the GIL
_NewFromDescrHook = ctypes.CFUNCTYPE(*_NEW_FROM_DESCR_ARGS)  # what the patched table points to

# A private handle on the C API: ctypes.pythonapi's function objects are shared, and other libraries
# (dill, tritonclient) set their argtypes to what suits them.
_pythonapi = ctypes.PyDLL(None)
_capsule_get_pointer = _pythonapi.PyCapsule_GetPointer
_capsule_get_pointer.restype = ctypes.c_void_p
_capsule_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_capsule_new = _pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_capsule_is_valid = _pythonapi.PyCapsule_IsValid
_capsule_is_valid.restype = ctypes.c_int
_capsule_is_valid.argtypes = [ctypes.py_object, ctypes.c_char_p]
_capsule_set_name = _pythonapi.PyCapsule_SetName
_capsule_set_name.restype = ctypes.c_int
_capsule_set_name.argtypes = [ctypes.py_object, ctypes.c_void_p]

# PyCapsule_SetName keeps the pointer: the name must live as long as the capsules renamed to it.
_USED_DLTENSOR = ctypes.create_string_buffer(b"used_dltensor")

# What C code may still point to: the patched C-API tables and their hooks. Never released, even
# when the capsule is replaced again (a pybind11 module caches the table's address on first use).
_KEEP_ALIVE: list[object] = [_USED_DLTENSOR]


def install(utils: types.ModuleType) -> bool:
    """Patch ``utils`` (the stub's ``triton_python_backend_utils`` module) for NumPy 2.

    Call it while ``utils`` is being imported, before the stub sets ``utils.Tensor``. Returns True
    when the patch was applied; False under NumPy 1 (nothing to fix) or, with a message on stderr,
    when ``PyArray_Descr`` does not have the layout this patch expects.
    """
    if int(np.__version__.split(".")[0]) < 2:
        return False
    if not _descriptor_layout_ok():
        print("mmserve numpy2 compat: unexpected PyArray_Descr layout; not patching", file=sys.stderr)
        return False
    _install_array_api()  # (a)
    strings = _StringOutputs(utils.serialize_byte_tensor)
    utils.serialize_byte_tensor = strings.serialize  # type: ignore[attr-defined]  # (c)
    utils.__class__ = _module_class_wrapping_tensor(type(utils), strings)  # (b) and (c)
    _self_test()
    return True


# --------------------------------------------------------------------------------------------------
# Descriptor fields, read by address


def _descr_flags(descr: int) -> int:
    """NumPy 2's ``flags`` of the PyArray_Descr at ``descr``."""
    return ctypes.c_uint64.from_address(descr + _FLAGS_OFFSET).value


def _set_descr_flags(descr: int, value: int) -> None:
    ctypes.c_uint64.from_address(descr + _FLAGS_OFFSET).value = value


def _descr_elsize(descr: int) -> int:
    """NumPy 2's ``elsize`` of the PyArray_Descr at ``descr``: the real itemsize."""
    return ctypes.c_int64.from_address(descr + _ELSIZE_OFFSET).value


def _itemsize_seen_by_pybind11(descr: int) -> int:
    """The ``int`` at NumPy 1's elsize offset: what pybind11 < 2.12 takes for the itemsize."""
    return ctypes.c_int32.from_address(descr + _FLAGS_OFFSET).value


def _descriptor_layout_ok(probe: np.dtype[Any] | None = None) -> bool:
    """Whether ``probe`` (a numeric dtype; default int32) has the layout above: its itemsize at byte
    40 and zero flags at byte 32. Refuse to patch otherwise: the patch writes to these fields."""
    probe = np.dtype(np.int32) if probe is None else probe
    return _descr_elsize(id(probe)) == probe.itemsize and _descr_flags(id(probe)) == 0


# --------------------------------------------------------------------------------------------------
# (a) Inputs: a C-API table whose PyArray_NewFromDescr fixes the strides pybind11 got wrong


def _fixed_strides(dims: Sequence[int], strides: Sequence[int], seen: int, real: int) -> list[int] | None:
    """The C-contiguous strides for itemsize ``real`` when ``strides`` are the C-contiguous strides
    for itemsize ``seen`` (what pybind11 computed), else None (leave them alone)."""
    nd = len(dims)
    expected, fixed, step_seen, step_real = [], [], seen, real
    for axis in range(nd - 1, -1, -1):
        expected.append(step_seen)
        fixed.append(step_real)
        step_seen *= dims[axis]
        step_real *= dims[axis]
    if [strides[axis] for axis in range(nd - 1, -1, -1)] != expected:
        return None
    return fixed[::-1]


def _install_array_api() -> None:
    """Install a patched copy of NumPy's C-API table as ``numpy.core.multiarray._ARRAY_API``, the
    capsule pybind11 < 2.12 takes the C API from (``numpy._core``'s own stays untouched)."""
    legacy_multiarray = importlib.import_module("numpy.core.multiarray")
    multiarray_umath = importlib.import_module("numpy._core._multiarray_umath")
    original = (ctypes.c_void_p * _API_SLOTS).from_address(_capsule_get_pointer(multiarray_umath._ARRAY_API, None))
    table = (ctypes.c_void_p * _API_SLOTS)(*original)
    numpy_new_from_descr = original[_NEW_FROM_DESCR_SLOT]
    if not numpy_new_from_descr:
        raise RuntimeError("NumPy's C-API table has no PyArray_NewFromDescr")
    new_from_descr = _NewFromDescrPy(numpy_new_from_descr)

    def patched_new_from_descr(
        subtype: int | None,
        descr: int | None,
        nd: int,
        dims: Any,  # ctypes pointers: indexable
        strides: Any,
        data: int | None,
        flags: int,
        obj: int | None,
    ) -> int | None:
        if strides and nd > 0 and descr:
            real = _descr_elsize(descr)
            seen = _itemsize_seen_by_pybind11(descr)
            if real != seen:
                fixed = _fixed_strides([dims[i] for i in range(nd)], [strides[i] for i in range(nd)], seen, real)
                if fixed is not None:
                    strides = (ctypes.c_ssize_t * nd)(*fixed)
        result: int | None = new_from_descr(subtype, descr, nd, dims, strides, data, flags, obj)
        return result

    hook = _NewFromDescrHook(patched_new_from_descr)
    table[_NEW_FROM_DESCR_SLOT] = ctypes.cast(hook, ctypes.c_void_p).value
    _KEEP_ALIVE.extend((table, hook, new_from_descr))  # the table and the hook must live on
    capsule = _capsule_new(ctypes.addressof(table), None, None)
    legacy_multiarray._ARRAY_API = capsule  # type: ignore[attr-defined]


# --------------------------------------------------------------------------------------------------
# (b) Numeric outputs through DLPack


def _from_dlpack(c_tensor: Any, name: str, obj: Any) -> Any:
    """``c_tensor.from_dlpack(name, obj)``; for a CPU tensor, through a capsule renamed afterwards.

    The stub marks a consumed capsule "used_dlpack"; the producer's destructor expects the standard
    "used_dltensor" and otherwise prints "PyCapsule_GetPointer called with incorrect name" per tensor.
    """
    try:
        on_cpu = obj.__dlpack_device__()[0] in _DLPACK_CPU_DEVICES
    except Exception:  # noqa: BLE001 - no (usable) __dlpack_device__: let the stub decide
        on_cpu = False
    if not on_cpu:
        return c_tensor.from_dlpack(name, obj)
    capsule = obj.__dlpack__()
    tensor = c_tensor.from_dlpack(name, capsule)
    if _capsule_is_valid(capsule, b"used_dlpack"):
        _capsule_set_name(capsule, ctypes.addressof(_USED_DLTENSOR))
    return tensor


# --------------------------------------------------------------------------------------------------
# (c) TYPE_STRING outputs: serialized into an array whose itemsize pybind11 reads as 1


class _StringOutputs:
    """The patched ``serialize_byte_tensor`` and the ``Tensor()`` call around it, for one module."""

    def __init__(self, serialize: Callable[[Any], Any]) -> None:
        self._serialize = serialize
        self._pending = threading.local()  # the dtypes to reset after this thread's Tensor() call

    def serialize(self, input_tensor: Any) -> Any:
        """Triton's ``serialize_byte_tensor``, returning the bytes as a one-byte-wide array."""
        flat = self._serialize(input_tensor)
        if not isinstance(flat, bytes):
            return flat
        dtype = np.dtype([("b", np.uint8)])  # a fresh descriptor object, private to this array
        arr = np.frombuffer(flat, dtype=np.uint8).copy().view(dtype)
        # pybind11 reads the low 32 bits of flags as the itemsize: make them 1 (NPY_ITEM_REFCOUNT, which
        # a structured dtype with one uint8 field tolerates); tensor() resets them once the stub has copied.
        _set_descr_flags(id(dtype), 1)
        if getattr(self._pending, "dtypes", None) is not None:
            self._pending.dtypes.append(dtype)
        return arr

    def tensor(self, c_tensor: Any, name: str, array: np.ndarray[Any, Any]) -> Any:
        """``c_tensor(name, array)`` for an object or bytes array (the stub calls ``serialize``)."""
        self._pending.dtypes = []
        try:
            return c_tensor(name, array)
        finally:
            for dtype in self._pending.dtypes:
                _set_descr_flags(id(dtype), 0)
            self._pending.dtypes = None


# --------------------------------------------------------------------------------------------------
# pb_utils.Tensor: the stub's C++ class, wrapped when the stub sets it on the module


class _TensorMeta(type):
    """The metaclass of the ``Tensor`` that replaces ``c_python_backend_utils.Tensor`` in ``utils``:
    its instances are the C++ class's, built as (b) or (c) requires."""

    _c_tensor: Any
    _strings: _StringOutputs

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, cls._c_tensor)

    def __call__(cls, name: str, array: Any) -> Any:
        c_tensor = cls._c_tensor
        array = np.asarray(array)
        if array.dtype.kind == "U":
            array = array.astype(np.object_)
        if array.dtype.kind in "OS":
            return cls._strings.tensor(c_tensor, name, array)
        # (b) numeric: through DLPack (the stub computes the byte size from shape and dtype).
        if not array.flags.c_contiguous:
            array = array.copy(order="C")
        return _from_dlpack(c_tensor, name, array)


def _wrap_tensor(c_tensor: Any, strings: _StringOutputs) -> _TensorMeta:
    return _TensorMeta(
        "Tensor",
        (),
        {
            "_c_tensor": c_tensor,
            "_strings": strings,
            "from_dlpack": staticmethod(lambda name, obj: _from_dlpack(c_tensor, name, obj)),
            "__doc__": c_tensor.__doc__,
        },
    )


def _module_class_wrapping_tensor(base: type[types.ModuleType], strings: _StringOutputs) -> type[types.ModuleType]:
    """A module class whose instances wrap whatever is assigned to their ``Tensor`` attribute (the
    stub sets ``utils.Tensor = c_python_backend_utils.Tensor`` after importing ``utils``)."""

    class _ModuleWithCompatTensor(base):  # type: ignore[valid-type,misc]
        def __setattr__(self, attr: str, value: Any) -> None:
            if attr == "Tensor" and not isinstance(value, _TensorMeta):
                value = _wrap_tensor(value, strings)
            super().__setattr__(attr, value)

    return _ModuleWithCompatTensor


# --------------------------------------------------------------------------------------------------
# Self-test inside the stub


def _self_test() -> None:
    """Inside the stub: pybind11 must take NumPy's C API from the patched table (it does so on first
    use); a tensor built through DLPack must read back through as_numpy()."""
    try:
        import c_python_backend_utils
    except ImportError:  # not inside the stub
        return
    try:
        probe = np.arange(3, dtype=np.int32)
        if _from_dlpack(c_python_backend_utils.Tensor, "probe", probe).as_numpy().tolist() != [0, 1, 2]:
            print("mmserve numpy2 compat: self-test failed; tensors will be wrong", file=sys.stderr)
    except Exception as exc:  # noqa: BLE001 - a failed self-test is reported, never fatal
        print(f"mmserve numpy2 compat: self-test error: {exc!r}", file=sys.stderr)
