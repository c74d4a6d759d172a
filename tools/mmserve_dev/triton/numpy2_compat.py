"""NumPy 2 compatibility for the Python-backend stub of nvidia-pytriton 0.7.0 (Triton 2.51).

``PATCH`` is appended by ``mmserve_dev.triton.install.prepare_backend_dir`` to its copy of
``triton_python_backend_utils.py``.
"""

PATCH = r"""

# ---- mmserve: NumPy 2 compatibility for the Python-backend stub (appended by mmserve_dev.triton) ----
# The stub in nvidia-pytriton 0.7.0 (Triton 2.51) is built with a pybind11 older than 2.12, which reads
# a dtype's itemsize at NumPy 1's offset in PyArray_Descr. Under NumPy 2 that field holds the dtype's
# flags (0 for numeric dtypes), so without this patch (1) every input tensor's as_numpy() repeats its
# first element (and a TYPE_STRING input crashes the stub), and (2) an output built with
# pb_utils.Tensor(name, numpy_array) carries 0 bytes. The patch (a) hands pybind11 a copy of NumPy's
# C-API table whose PyArray_NewFromDescr recomputes the strides pybind11 got wrong, (b) builds numeric
# output tensors through DLPack, whose byte size the stub computes itself, and (c) serializes TYPE_STRING
# outputs into an array whose dtype pybind11 reads as 1 byte wide while the stub copies them.
def _mmserve_numpy2_compat():
    import ctypes
    import sys as _sys

    if int(np.__version__.split(".")[0]) < 2:
        return
    _i32 = np.dtype(np.int32)
    if (ctypes.c_int64.from_address(id(_i32) + 40).value != 4
            or ctypes.c_uint64.from_address(id(_i32) + 32).value != 0):
        print("mmserve numpy2 compat: unexpected PyArray_Descr layout; not patching", file=_sys.stderr)
        return

    import numpy.core.multiarray as _legacy_multiarray  # the module pybind11 < 2.12 takes the C-API from
    from numpy._core import _multiarray_umath

    # A private handle on the C API: ctypes.pythonapi's function objects are shared, and other
    # libraries (dill, tritonclient) set their argtypes to what suits them.
    pythonapi = ctypes.PyDLL(None)
    get_pointer = pythonapi.PyCapsule_GetPointer
    get_pointer.restype = ctypes.c_void_p
    get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    new_capsule = pythonapi.PyCapsule_New
    new_capsule.restype = ctypes.py_object
    new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

    n_slots = 300  # pybind11 uses slots up to 282 (PyArray_SetBaseObject)
    original = (ctypes.c_void_p * n_slots).from_address(get_pointer(_multiarray_umath._ARRAY_API, None))
    table = (ctypes.c_void_p * n_slots)(*original)
    ssize_p = ctypes.POINTER(ctypes.c_ssize_t)
    proto = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ssize_p, ssize_p,
             ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p)
    new_from_descr = ctypes.PYFUNCTYPE(*proto)(original[94])  # PyArray_NewFromDescr; keeps the GIL

    def patched_new_from_descr(subtype, descr, nd, dims, strides, data, flags, obj):
        if strides and nd > 0 and descr:
            real = ctypes.c_int64.from_address(descr + 40).value
            seen = ctypes.c_int32.from_address(descr + 32).value  # what pybind11 took for the itemsize
            if real != seen:
                expected, fixed, step_seen, step_real = [], [], seen, real
                for axis in range(nd - 1, -1, -1):
                    expected.append(step_seen)
                    fixed.append(step_real)
                    step_seen *= dims[axis]
                    step_real *= dims[axis]
                if [strides[axis] for axis in range(nd - 1, -1, -1)] == expected:
                    strides = (ctypes.c_ssize_t * nd)(*reversed(fixed))
        return new_from_descr(subtype, descr, nd, dims, strides, data, flags, obj)

    hook = ctypes.CFUNCTYPE(*proto)(patched_new_from_descr)
    table[94] = ctypes.cast(hook, ctypes.c_void_p).value
    _legacy_multiarray._ARRAY_API = new_capsule(ctypes.addressof(table), None, None)
    _mmserve_numpy2_compat.keep = (table, hook, new_from_descr)  # the table and the hook must live on

    # (c) TYPE_STRING outputs: the stub takes size * "itemsize" of what serialize_byte_tensor returns.
    import threading

    original_serialize = serialize_byte_tensor
    pending = threading.local()

    def serialize_byte_tensor_numpy2(input_tensor):
        flat = original_serialize(input_tensor)
        if not isinstance(flat, bytes):
            return flat
        dtype = np.dtype([("b", np.uint8)])  # a fresh descriptor object, private to this array
        arr = np.frombuffer(flat, dtype=np.uint8).copy().view(dtype)
        # pybind11 reads the low 32 bits of flags as the itemsize: make them 1 (NPY_ITEM_REFCOUNT, which a
        # structured dtype with one uint8 field tolerates); Tensor() resets them once the stub has copied.
        ctypes.c_uint64.from_address(id(dtype) + 32).value = 1
        if getattr(pending, "dtypes", None) is not None:
            pending.dtypes.append(dtype)
        return arr

    globals()["serialize_byte_tensor"] = serialize_byte_tensor_numpy2

    # The stub marks a consumed capsule "used_dlpack"; the producer's destructor expects the standard
    # "used_dltensor" and otherwise prints "PyCapsule_GetPointer called with incorrect name" per tensor.
    capsule_is_valid = pythonapi.PyCapsule_IsValid
    capsule_is_valid.restype = ctypes.c_int
    capsule_is_valid.argtypes = [ctypes.py_object, ctypes.c_char_p]
    capsule_set_name = pythonapi.PyCapsule_SetName
    capsule_set_name.restype = ctypes.c_int
    capsule_set_name.argtypes = [ctypes.py_object, ctypes.c_void_p]
    used_name = ctypes.create_string_buffer(b"used_dltensor")

    def _from_dlpack(c_tensor, name, obj):
        try:
            on_cpu = obj.__dlpack_device__()[0] in (1, 3)  # kDLCPU, kDLCUDAHost
        except Exception:
            on_cpu = False
        if not on_cpu:
            return c_tensor.from_dlpack(name, obj)
        capsule = obj.__dlpack__()
        tensor = c_tensor.from_dlpack(name, capsule)
        if capsule_is_valid(capsule, b"used_dlpack"):
            capsule_set_name(capsule, ctypes.addressof(used_name))
        return tensor

    _mmserve_numpy2_compat.keep += (used_name,)

    class _TensorMeta(type):
        def __instancecheck__(cls, obj):
            return isinstance(obj, cls._c_tensor)

        def __call__(cls, name, array):
            c_tensor = cls._c_tensor
            array = np.asarray(array)
            if array.dtype.kind == "U":
                array = array.astype(np.object_)
            if array.dtype.kind in "OS":
                pending.dtypes = []
                try:
                    return c_tensor(name, array)
                finally:
                    for dtype in pending.dtypes:
                        ctypes.c_uint64.from_address(id(dtype) + 32).value = 0
                    pending.dtypes = None
            # (b) numeric: through DLPack (the stub computes the byte size from shape and dtype).
            if not array.flags.c_contiguous:
                array = array.copy(order="C")
            return _from_dlpack(c_tensor, name, array)

    class _ModuleWithCompatTensor(type(_sys.modules[__name__])):
        def __setattr__(self, attr, value):
            if attr == "Tensor" and not isinstance(value, _TensorMeta):
                value = _TensorMeta("Tensor", (), {
                    "_c_tensor": value,
                    "from_dlpack": staticmethod(lambda name, obj, _c=value: _from_dlpack(_c, name, obj)),
                    "__doc__": value.__doc__,
                })
            super().__setattr__(attr, value)

    _sys.modules[__name__].__class__ = _ModuleWithCompatTensor

    try:  # self-test: pybind11 must take NumPy's C-API from the patched table (it does so on first use)
        import c_python_backend_utils
    except ImportError:  # not inside the stub
        return
    try:
        probe = np.arange(3, dtype=np.int32)
        if _from_dlpack(c_python_backend_utils.Tensor, "probe", probe).as_numpy().tolist() != [0, 1, 2]:
            print("mmserve numpy2 compat: self-test failed; tensors will be wrong", file=_sys.stderr)
    except Exception as exc:
        print(f"mmserve numpy2 compat: self-test error: {exc!r}", file=_sys.stderr)


_mmserve_numpy2_compat()
"""
