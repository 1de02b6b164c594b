"""DLPack 1.4 as a consumer and a producer meet it: capsules and exchange tables carry version 1.4; a 1.x
producer's capsule of a newer minor version is read, one of a newer major is refused naming both versions; the
codes 1.4 added (kDLBcomplex, kDLTPU, kDLTPUHost, kDLAscend) are refused by name, since no array interface can
describe them (the README's "DLPack 1.4" section says why a refusal and not a view)."""
import numpy as np
import pytest

import cai_dlpack
from cai_dlpack import DLPackShim, UnsupportedArrayError, dlpack2cai
from support.dlpack_ctypes import MadeTensor, kDLCPU, read_capsule
from support.doors import EXCHANGE, AllocationRefused, allocate

kDLBcomplex = 18
NEW_DEVICES = {"kDLTPU": 19, "kDLTPUHost": 20, "kDLAscend": 21}


def test_capsules_and_the_exchange_table_carry_version_1_4():
    capsule = DLPackShim(np.arange(3.0)).__dlpack__(max_version=(1, 4))
    assert read_capsule(capsule)["version"] == (1, 4) == cai_dlpack.DLPACK_VERSION
    assert (EXCHANGE.major, EXCHANGE.minor) == (1, 4)


@pytest.mark.parametrize("minor", [4, 5, 99])
def test_a_capsule_of_a_1_x_producer_at_a_newer_minor_version_is_read(minor):
    base = np.arange(6, dtype=np.float32)
    made = MadeTensor(data=base.__array_interface__["data"][0], shape=(2, 3), version=(1, minor))
    view = dlpack2cai(made.capsule)
    assert view.__array_interface__["data"][0] == base.__array_interface__["data"][0]
    assert np.asarray(view).tolist() == base.reshape(2, 3).tolist()
    del view
    assert made.deleted == 1


@pytest.mark.parametrize("version", [(2, 0), (3, 7)])
def test_a_capsule_of_a_newer_major_version_is_refused_naming_both_versions(version):
    made = MadeTensor(data=np.zeros(2).__array_interface__["data"][0], shape=(2,), version=version)
    with pytest.raises(BufferError) as info:
        dlpack2cai(made.capsule)
    assert f"version {version[0]}.{version[1]}" in str(info.value)
    assert "DLPack 1.4" in str(info.value)
    assert made.deleted == 1


@pytest.mark.parametrize("versioned", [True, False])
def test_a_complex_bfloat16_tensor_is_refused_naming_kDLBcomplex(versioned):
    base = np.zeros(4, dtype=np.complex64)  # 8-byte items: room for a 4-byte complex bfloat16 each
    made = MadeTensor(data=base.__array_interface__["data"][0], dtype=(kDLBcomplex, 32, 1), shape=(4,),
                      versioned=versioned)
    with pytest.raises(UnsupportedArrayError, match=r"DLPack dtype kDLBcomplex \(code=18, bits=32, lanes=1\)"):
        dlpack2cai(made.capsule)
    assert made.deleted == 1


@pytest.mark.parametrize("name", NEW_DEVICES)
@pytest.mark.parametrize("versioned", [True, False])
def test_a_tpu_or_ascend_tensor_is_refused_naming_its_device(name, versioned):
    made = MadeTensor(data=0x7000_0000, device=(NEW_DEVICES[name], 0), shape=(3,), versioned=versioned)
    with pytest.raises(BufferError, match=rf"DLPack device type {NEW_DEVICES[name]} \({name}\) is neither CUDA"):
        dlpack2cai(made.capsule)
    assert made.deleted == 1


@pytest.mark.parametrize("name", NEW_DEVICES)
def test_a_copy_to_a_tpu_or_ascend_device_is_refused_naming_it(name):
    with pytest.raises(UnsupportedArrayError, match=rf"dl_device \({NEW_DEVICES[name]}, 0\) differs from the data's "
                                                    rf"device \(1, 0\); .* not to {name} from kDLCPU$"):
        DLPackShim(np.arange(3.0)).__dlpack__(max_version=(1, 4), dl_device=(NEW_DEVICES[name], 0))


@pytest.mark.parametrize("name", NEW_DEVICES)
def test_the_exchange_allocator_refuses_a_tpu_or_ascend_prototype_naming_it(name):
    with pytest.raises(AllocationRefused, match=rf"device type {NEW_DEVICES[name]} is not supported \({name}\)"):
        allocate((2, 32, 1), (4,), (NEW_DEVICES[name], 0))


@pytest.mark.parametrize("code, name", [(0, "kDLInt"), (1, "kDLUInt"), (2, "kDLFloat"), (18, "kDLBcomplex"),
                                        (19, "an unknown code")])  # one past the table: ASan reads its bound
def test_a_type_without_a_typestr_is_refused_naming_its_code(code, name):
    made = MadeTensor(data=np.zeros(2).__array_interface__["data"][0], dtype=(code, 7, 1), shape=(2,))
    with pytest.raises(UnsupportedArrayError, match=rf"DLPack dtype {name} \(code={code}, bits=7, lanes=1\)"):
        dlpack2cai(made.capsule)


def test_a_type_code_newer_than_1_4_is_refused_as_unknown():
    made = MadeTensor(data=np.zeros(2).__array_interface__["data"][0], dtype=(99, 8, 1), shape=(2,))
    with pytest.raises(UnsupportedArrayError, match=r"DLPack dtype an unknown code \(code=99, bits=8, lanes=1\)"):
        dlpack2cai(made.capsule)
    made = MadeTensor(data=0x7000_0000, device=(kDLCPU + 99, 0), shape=(3,))
    with pytest.raises(BufferError, match=r"device type 100 \(an unknown device type\)"):
        dlpack2cai(made.capsule)


@pytest.mark.parametrize("device_type", [22, 100])  # one past DLPack 1.4's last (kDLAscend, 21), and far past
def test_a_device_type_past_1_4_is_refused_as_unknown(device_type):
    made = MadeTensor(data=0x7000_0000, device=(device_type, 0), shape=(3,))
    with pytest.raises(BufferError, match=rf"device type {device_type} \(an unknown device type\)"):
        dlpack2cai(made.capsule)
