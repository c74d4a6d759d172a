"""Unit tests of mmserve_dev.triton.numpy2_compat without a server.

``install`` is applied to a stand-in for the stub's ``triton_python_backend_utils`` module whose
``Tensor`` is a fake of the stub's C++ class: it records what the stub would receive (a DLPack
capsule, or an object array it serializes through the module and copies size * "itemsize" bytes of,
the itemsize being what pybind11 < 2.12 reads). The input direction calls the patched
``PyArray_NewFromDescr`` through the C-API table installed as ``numpy.core.multiarray._ARRAY_API``,
with the strides pybind11 computes. ``install`` replaces that process-wide capsule: every test that
installs restores it (the ``legacy_api`` fixture); the patched tables themselves are kept alive.
tests/test_triton_server.py checks the same dtypes through a real tritonserver.
"""

from __future__ import annotations

import ctypes
import importlib
import struct
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mmserve_dev.triton import numpy2_compat
from mmserve_dev.triton.install import TritonInstall, prepare_backend_dir

if int(np.__version__.split(".")[0]) < 2:  # pragma: no cover - the patch is a no-op under NumPy 1
    pytest.skip("numpy2_compat patches NumPy 2 only", allow_module_level=True)

# Every numeric dtype a Triton tensor can have (TYPE_BOOL .. TYPE_FP64).
NUMERIC = [np.bool_, np.uint8, np.uint16, np.uint32, np.uint64, np.int8, np.int16, np.int32, np.int64,
           np.float16, np.float32, np.float64]  # fmt: skip
NUMERIC_IDS = [np.dtype(t).name for t in NUMERIC]

_api = ctypes.PyDLL(None)  # private handle (ctypes.pythonapi's argtypes are shared)
_capsule_get_pointer = _api.PyCapsule_GetPointer
_capsule_get_pointer.restype = ctypes.c_void_p
_capsule_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_capsule_get_name = _api.PyCapsule_GetName
_capsule_get_name.restype = ctypes.c_char_p
_capsule_get_name.argtypes = [ctypes.py_object]
_capsule_set_name = _api.PyCapsule_SetName
_capsule_set_name.restype = ctypes.c_int
_capsule_set_name.argtypes = [ctypes.py_object, ctypes.c_void_p]
_incref = _api.Py_IncRef
_incref.argtypes = [ctypes.py_object]
_decref = _api.Py_DecRef
_decref.argtypes = [ctypes.c_void_p]
_USED_DLPACK = ctypes.create_string_buffer(b"used_dlpack")  # the name the stub gives consumed capsules


def values(dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
    """Distinct values (so a repeated first element shows) of ``dtype``."""
    n = int(np.prod(shape))
    if np.dtype(dtype) == np.bool_:
        return (np.arange(n) % 3 == 1).reshape(shape)
    return (np.arange(n) * 3 + 1).astype(dtype).reshape(shape)


def itemsize_seen_by_pybind11(dtype: np.dtype) -> int:
    """The C int at NumPy 1's elsize offset (NumPy 2's flags): pybind11 < 2.12's itemsize."""
    return ctypes.c_int32.from_address(id(dtype) + 32).value


def descr_flags(dtype: np.dtype) -> int:
    return ctypes.c_uint64.from_address(id(dtype) + 32).value


def c_strides(shape: tuple[int, ...], itemsize: int) -> list[int]:
    strides, step = [], itemsize
    for dim in reversed(shape):
        strides.append(step)
        step *= dim
    return strides[::-1]


# --------------------------------------------------------------------------------------------------
# The stand-in for triton_python_backend_utils and the stub's C++ Tensor


def triton_serialize_byte_tensor(input_tensor: np.ndarray) -> Any:
    """triton_python_backend_utils.serialize_byte_tensor (Triton 2.51), verbatim in behaviour."""
    if input_tensor.size == 0:
        return ()
    if (input_tensor.dtype == np.object_) or (input_tensor.dtype.type == np.bytes_):
        flattened_ls = []
        for obj in np.nditer(input_tensor, flags=["refs_ok"], order="C"):
            if input_tensor.dtype == np.object_:
                s = obj.item() if type(obj.item()) is bytes else str(obj.item()).encode("utf-8")
            else:
                s = obj.item()
            flattened_ls.append(struct.pack("<I", len(s)))
            flattened_ls.append(s)
        return b"".join(flattened_ls)
    return None


class _DLPackShim:
    """Lets np.from_dlpack consume a bare capsule, as the stub's C++ does."""

    def __init__(self, capsule: Any) -> None:
        self.capsule = capsule

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self.capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)


def fake_c_tensor_class(utils: types.ModuleType) -> type:
    class FakeCTensor:
        """c_python_backend_utils.Tensor as the stub (pybind11 < 2.12, NumPy 2) behaves."""

        def __init__(self, name: str, array: np.ndarray) -> None:
            # The stub serializes a BYTES tensor through the utils module and copies nbytes of it,
            # nbytes being size * the itemsize pybind11 reads.
            assert array.dtype.kind in "OS", array.dtype
            self.name = name
            self.array_in = array
            self.serialized = serialized = utils.serialize_byte_tensor(array)
            if isinstance(serialized, np.ndarray):
                self.flags_during_call: int | None = descr_flags(serialized.dtype)
                nbytes = serialized.size * itemsize_seen_by_pybind11(serialized.dtype)
                self.data = ctypes.string_at(serialized.__array_interface__["data"][0], nbytes)
            else:
                self.flags_during_call = None
                self.data = b""
            self.shape = array.shape
            self.dtype = array.dtype

        @classmethod
        def from_dlpack(cls, name: str, obj: Any) -> FakeCTensor:
            self = cls.__new__(cls)
            self.name = name
            self.received = obj
            if type(obj).__name__ == "PyCapsule":
                self.capsule = obj
                received = np.from_dlpack(_DLPackShim(obj))  # renames it "used_dltensor"
                _capsule_set_name(obj, ctypes.addressof(_USED_DLPACK))  # what the stub does
            else:
                received = np.from_dlpack(obj)
            self.was_c_contiguous = received.flags.c_contiguous
            self.values = received.copy()
            self.shape, self.dtype = received.shape, received.dtype
            return self

        def as_numpy(self) -> np.ndarray:
            return self.values

    return FakeCTensor


@pytest.fixture
def legacy_api(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """numpy.core.multiarray, its _ARRAY_API restored after the test."""
    legacy = importlib.import_module("numpy.core.multiarray")
    monkeypatch.setattr(legacy, "_ARRAY_API", legacy._ARRAY_API)
    return legacy


@pytest.fixture
def utils(legacy_api: types.ModuleType) -> types.ModuleType:
    """A patched stand-in for triton_python_backend_utils, its Tensor set as the stub sets it."""
    module = types.ModuleType("fake_triton_python_backend_utils")
    module.np = np
    module.serialize_byte_tensor = triton_serialize_byte_tensor
    assert numpy2_compat.install(module) is True
    module.Tensor = fake_c_tensor_class(module)
    return module


# --------------------------------------------------------------------------------------------------
# What install changes process-wide


def test_install_replaces_the_legacy_capsule_only(legacy_api: types.ModuleType) -> None:
    umath = importlib.import_module("numpy._core._multiarray_umath")
    before_legacy, before_umath = legacy_api._ARRAY_API, umath._ARRAY_API
    module = types.ModuleType("m")
    module.serialize_byte_tensor = triton_serialize_byte_tensor
    assert numpy2_compat.install(module)
    assert legacy_api._ARRAY_API is not before_legacy
    assert umath._ARRAY_API is before_umath
    new = _capsule_get_pointer(legacy_api._ARRAY_API, None)
    old = _capsule_get_pointer(before_umath, None)
    assert new != old
    new_table = (ctypes.c_void_p * 300).from_address(new)
    old_table = (ctypes.c_void_p * 300).from_address(old)
    assert [i for i in range(300) if new_table[i] != old_table[i]] == [94]


# --------------------------------------------------------------------------------------------------
# Outputs: pb_utils.Tensor(name, array)


@pytest.mark.parametrize("dtype", NUMERIC, ids=NUMERIC_IDS)
def test_numeric_output_goes_through_dlpack(utils: types.ModuleType, dtype: Any) -> None:
    array = values(dtype, (3, 4))
    tensor = utils.Tensor("OUT", array)
    assert isinstance(tensor, utils.Tensor)
    assert type(tensor.received).__name__ == "PyCapsule"  # not the array: the stub sizes it itself
    assert tensor.name == "OUT"
    assert tensor.dtype == np.dtype(dtype) and tensor.shape == (3, 4)
    assert tensor.was_c_contiguous
    np.testing.assert_array_equal(tensor.values, array)
    # Renamed back from the stub's "used_dlpack": the producer's destructor stays quiet.
    assert _capsule_get_name(tensor.capsule) == b"used_dltensor"


@pytest.mark.parametrize("dtype", NUMERIC, ids=NUMERIC_IDS)
def test_non_contiguous_output_is_made_contiguous(utils: types.ModuleType, dtype: Any) -> None:
    array = values(dtype, (3, 4))[::-1].T  # as the live test's model sends
    assert not array.flags.c_contiguous
    tensor = utils.Tensor("OUT", array)
    assert tensor.was_c_contiguous and tensor.shape == (4, 3)
    np.testing.assert_array_equal(tensor.values, array)


def test_output_from_lists_and_scalars(utils: types.ModuleType) -> None:
    tensor = utils.Tensor("OUT", [[1.5, 2.5]])
    assert tensor.dtype == np.float64
    np.testing.assert_array_equal(tensor.values, [[1.5, 2.5]])
    tensor = utils.Tensor("OUT", np.int32(7))
    assert tensor.shape == () and tensor.values == 7


@pytest.mark.parametrize(
    "array",
    [
        np.array([b"hello", "wörld".encode(), b"", b"x" * 1000], dtype=object),
        np.array([[b"a", b"bc"], [b"def", b""]], dtype=object),
        np.array([b"ab", b"c", b"def"]),  # bytes_ (S3)
        np.array(["é", "xyz", ""]),  # str_ (U3): sent as UTF-8
        np.array([["a", "bb", "ccc"], ["d", "ee", "fff"]], dtype=object).T,  # not C-contiguous
    ],
    ids=["object", "object-2d", "bytes", "str", "object-transposed"],
)
def test_string_output(utils: types.ModuleType, array: np.ndarray) -> None:
    tensor = utils.Tensor("OUT", array)
    assert isinstance(tensor, utils.Tensor)
    assert tensor.shape == array.shape
    expected = triton_serialize_byte_tensor(array.astype(object) if array.dtype.kind == "U" else array)
    assert tensor.dtype.kind == ("O" if array.dtype.kind == "U" else array.dtype.kind)
    # The stub copied all of it: pybind11 read an itemsize of 1 while Tensor() ran ...
    assert tensor.flags_during_call == 1
    assert tensor.data == expected
    # ... and the flags are cleared once it returned.
    assert descr_flags(tensor.serialized.dtype) == 0
    assert tensor.serialized.dtype.itemsize == 1
    assert tensor.serialized.tobytes() == expected


def test_empty_string_output(utils: types.ModuleType) -> None:
    tensor = utils.Tensor("OUT", np.array([], dtype=object))
    assert tensor.serialized == () and tensor.data == b"" and tensor.shape == (0,)


def test_serialize_outside_tensor_keeps_the_bytes(utils: types.ModuleType) -> None:
    flat = utils.serialize_byte_tensor(np.array([b"ab"], dtype=object))
    assert flat.tobytes() == b"\x02\x00\x00\x00ab"
    assert utils.serialize_byte_tensor(np.array([1, 2])) is None
    assert utils.serialize_byte_tensor(np.array([], dtype=object)) == ()


def test_tensor_class_wrapper(utils: types.ModuleType) -> None:
    c_tensor = utils.Tensor._c_tensor
    assert utils.Tensor is not c_tensor and utils.Tensor.__doc__ == c_tensor.__doc__
    assert isinstance(c_tensor.from_dlpack("x", np.arange(2)), utils.Tensor)
    assert not isinstance(np.arange(2), utils.Tensor)
    # Tensor.from_dlpack: a CPU array goes through a capsule renamed afterwards.
    tensor = utils.Tensor.from_dlpack("x", np.arange(5, dtype=np.int16))
    assert _capsule_get_name(tensor.capsule) == b"used_dltensor"
    np.testing.assert_array_equal(tensor.values, np.arange(5, dtype=np.int16))
    # Setting Tensor again wraps the new class; an already wrapped one is kept as it is.
    wrapped = utils.Tensor
    utils.Tensor = wrapped
    assert utils.Tensor is wrapped
    other = fake_c_tensor_class(utils)
    utils.Tensor = other
    assert utils.Tensor._c_tensor is other


def test_from_dlpack_passes_non_cpu_objects_through() -> None:
    class OnDevice:
        def __dlpack_device__(self) -> tuple[int, int]:
            return (2, 0)  # kDLCUDA

    class Recorder:
        @staticmethod
        def from_dlpack(name: str, obj: Any) -> Any:
            return (name, obj)

    obj = OnDevice()
    assert numpy2_compat._from_dlpack(Recorder, "x", obj) == ("x", obj)
    no_device = object()  # no __dlpack_device__: passed on as it is
    assert numpy2_compat._from_dlpack(Recorder, "x", no_device) == ("x", no_device)


# --------------------------------------------------------------------------------------------------
# Inputs: PyArray_NewFromDescr through the C-API table pybind11 < 2.12 takes


def new_from_descr(
    capsule: Any, dtype: np.dtype, shape: tuple[int, ...], strides: list[int], data: np.ndarray
) -> tuple[np.ndarray, tuple[int, ...]]:
    """PyArray_NewFromDescr from the C-API table in ``capsule``, called as pybind11 calls it (GIL
    held) over ``data``'s buffer: a copy of the array it made, and that array's strides."""
    table = (ctypes.c_void_p * 300).from_address(_capsule_get_pointer(capsule, None))
    ssize_p = ctypes.POINTER(ctypes.c_ssize_t)
    fn = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ssize_p, ssize_p,
                           ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p)(table[94] or 0)  # fmt: skip
    nd = len(shape)
    _incref(dtype)  # PyArray_NewFromDescr steals a reference to the descriptor
    result = fn(id(np.ndarray), id(dtype), nd, (ctypes.c_ssize_t * nd)(*shape), (ctypes.c_ssize_t * nd)(*strides),
                data.__array_interface__["data"][0], 0, None)  # fmt: skip
    assert result, "PyArray_NewFromDescr failed"
    array = ctypes.cast(result, ctypes.py_object).value  # a new reference of its own ...
    _decref(result)  # ... so drop the one the call returned
    return array.copy(), array.strides


@pytest.mark.parametrize("dtype", NUMERIC, ids=NUMERIC_IDS)
@pytest.mark.parametrize("shape", [(5,), (3, 4), (2, 3, 2)], ids=["1d", "2d", "3d"])
def test_input_strides_are_fixed(
    legacy_api: types.ModuleType, utils: types.ModuleType, dtype: Any, shape: tuple[int, ...]
) -> None:
    dt = np.dtype(dtype)
    data = values(dt, shape)
    seen = itemsize_seen_by_pybind11(dt)
    assert seen == 0  # the bug: numeric flags are 0
    wrong = c_strides(shape, seen)
    # The original table gives what the unpatched stub's as_numpy() gives: the first element repeated.
    umath = importlib.import_module("numpy._core._multiarray_umath")
    broken, broken_strides = new_from_descr(umath._ARRAY_API, dt, shape, wrong, data)
    assert list(broken_strides) == wrong and (broken == data.flat[0]).all()
    # The patched one (installed by the utils fixture) recomputes them with the real itemsize.
    fixed, fixed_strides = new_from_descr(legacy_api._ARRAY_API, dt, shape, wrong, data)
    assert list(fixed_strides) == c_strides(shape, dt.itemsize) == list(data.strides)
    np.testing.assert_array_equal(fixed, data)
    assert fixed.dtype == dt


@pytest.mark.parametrize("dtype", NUMERIC, ids=NUMERIC_IDS)
def test_input_correct_strides_are_left_alone(
    legacy_api: types.ModuleType, utils: types.ModuleType, dtype: Any
) -> None:
    dt = np.dtype(dtype)
    data = values(dt, (3, 4))
    cases = {  # strides that are not pybind11's wrong ones: C order, Fortran order, broadcast rows
        "C": (data.shape, data.strides, data),
        "F": (data.T.shape, data.T.strides, data.T),
        "broadcast": (data.shape, (0, dt.itemsize), np.broadcast_to(data[0], data.shape)),
    }
    for name, (shape, strides, expected) in cases.items():
        got, got_strides = new_from_descr(legacy_api._ARRAY_API, dt, shape, list(strides), data)
        assert got_strides == strides, name
        np.testing.assert_array_equal(got, expected, err_msg=name)


def test_fixed_strides() -> None:
    assert numpy2_compat._fixed_strides([3, 4], [0, 0], 0, 8) == [32, 8]
    assert numpy2_compat._fixed_strides([2, 3, 2], [6, 2, 1], 1, 4) == [24, 8, 4]
    assert numpy2_compat._fixed_strides([3, 4], [32, 8], 0, 8) is None
    assert numpy2_compat._fixed_strides([3], [8], 0, 8) is None


# --------------------------------------------------------------------------------------------------
# When install refuses, and the self-test


def test_layout_check() -> None:
    for dtype in NUMERIC:
        assert numpy2_compat._descriptor_layout_ok(np.dtype(dtype))
    assert numpy2_compat._descriptor_layout_ok()
    # A layout where byte 32 is not all-zero flags (here: the object dtype's) is refused.
    assert not numpy2_compat._descriptor_layout_ok(np.dtype(object))


def _untouched_install(legacy: types.ModuleType, capsys: pytest.CaptureFixture[str]) -> str:
    before = legacy._ARRAY_API
    module = types.ModuleType("m")
    module.serialize_byte_tensor = triton_serialize_byte_tensor
    assert numpy2_compat.install(module) is False
    assert legacy._ARRAY_API is before
    assert module.serialize_byte_tensor is triton_serialize_byte_tensor
    assert type(module) is types.ModuleType
    return capsys.readouterr().err


def test_refuses_on_unexpected_layout(
    legacy_api: types.ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(numpy2_compat, "_descriptor_layout_ok", lambda: False)
    assert "unexpected PyArray_Descr layout; not patching" in _untouched_install(legacy_api, capsys)


def test_numpy1_is_left_alone(
    legacy_api: types.ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(numpy2_compat.np, "__version__", "1.26.4")
    assert _untouched_install(legacy_api, capsys) == ""


@pytest.mark.parametrize("outcome", ["ok", "wrong", "error"])
def test_self_test_inside_the_stub(
    legacy_api: types.ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], outcome: str
) -> None:
    stub = types.ModuleType("c_python_backend_utils")
    fake = fake_c_tensor_class(stub)
    if outcome == "wrong":
        fake.as_numpy = lambda self: np.zeros(3, np.int32)
    elif outcome == "error":
        fake.from_dlpack = classmethod(lambda cls, name, obj: 1 / 0)
    stub.Tensor = fake
    monkeypatch.setitem(sys.modules, "c_python_backend_utils", stub)
    module = types.ModuleType("m")
    module.serialize_byte_tensor = triton_serialize_byte_tensor
    assert numpy2_compat.install(module)
    err = capsys.readouterr().err
    expected = {"ok": "", "wrong": "self-test failed", "error": "self-test error: ZeroDivisionError"}[outcome]
    assert expected in err and (err == "") == (outcome == "ok")


# --------------------------------------------------------------------------------------------------
# How prepare_backend_dir installs it


_IMPORTED_COPIES: list[Any] = []


def fake_triton_install(root: Path) -> TritonInstall:
    backend = root / "backends" / "python"
    stubs = root / "python_backend_stubs"
    version = "{}.{}".format(*sys.version_info[:2])
    (stubs / version).mkdir(parents=True)
    backend.mkdir(parents=True)
    (backend / "libtriton_python.so").write_bytes(b"\x7fELF")
    (backend / "triton_python_backend_utils.py").write_text(
        "import numpy as np\n\n\ndef serialize_byte_tensor(input_tensor):\n    return b'x'\n"
    )
    (stubs / version / "triton_python_backend_stub").write_bytes(b"\x7fELF")
    return TritonInstall(root, root / "bin" / "tritonserver", backend, stubs, root / "libs")


def test_prepare_backend_dir_installs_the_module(
    tmp_path: Path, legacy_api: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    install = fake_triton_install(tmp_path / "triton")
    target = prepare_backend_dir(tmp_path / "cache", install) / "python"
    assert (target / "mmserve_numpy2_compat.py").read_bytes() == Path(numpy2_compat.__file__).read_bytes()
    utils_source = (target / "triton_python_backend_utils.py").read_text()
    assert utils_source.startswith((install.python_backend_dir / "triton_python_backend_utils.py").read_text())
    assert "_mmserve_numpy2_compat.install(_mmserve_sys.modules[__name__])" in utils_source
    stamp = (target / ".mmserve-source").read_text()

    # The hook works as the stub runs it: the backend folder on sys.path, the utils imported by name.
    before = legacy_api._ARRAY_API
    monkeypatch.syspath_prepend(str(target))
    try:
        utils = importlib.import_module("triton_python_backend_utils")
        assert utils.__file__ == str(target / "triton_python_backend_utils.py")
        assert legacy_api._ARRAY_API is not before
        assert utils.serialize_byte_tensor(np.array([b"a"], dtype=object)).dtype.itemsize == 1
        utils.Tensor = fake_c_tensor_class(utils)
        assert type(utils.Tensor).__name__ == "_TensorMeta"  # the copy's class, not numpy2_compat's
        assert type(utils.Tensor).__module__ == "mmserve_numpy2_compat"
    finally:
        for name in ("triton_python_backend_utils", "mmserve_numpy2_compat"):
            _IMPORTED_COPIES.append(sys.modules.pop(name, None))  # its patched table must live on

    # Reused while unchanged; redone when the module's source changes; no hook without numpy2_compat.
    assert prepare_backend_dir(tmp_path / "cache", install) / "python" == target
    assert (target / ".mmserve-source").read_text() == stamp
    (target / "mmserve_numpy2_compat.py").unlink()
    prepare_backend_dir(tmp_path / "cache", install)
    assert (target / "mmserve_numpy2_compat.py").is_file()
    with monkeypatch.context() as m:
        m.setattr(Path, "read_text", _with_edited_module(Path.read_text))
        prepare_backend_dir(tmp_path / "cache", install)
    assert (target / ".mmserve-source").read_text() != stamp
    assert (target / "mmserve_numpy2_compat.py").read_text().endswith("# edited\n")
    prepare_backend_dir(tmp_path / "cache", install, numpy2_compat=False)
    assert not (target / "mmserve_numpy2_compat.py").exists()
    assert (target / "triton_python_backend_utils.py").read_text() == (
        install.python_backend_dir / "triton_python_backend_utils.py"
    ).read_text()


def _with_edited_module(read_text: Any) -> Any:
    """Path.read_text, returning numpy2_compat.py's source with a line added."""

    def patched(self: Path, *args: Any, **kwargs: Any) -> str:
        text = read_text(self, *args, **kwargs)
        return text + "# edited\n" if self == Path(numpy2_compat.__file__) else text

    return patched
