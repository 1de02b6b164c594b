"""cai2dlpack finds the interface Python's getattr would (the CUDA one first, then the host one), over the ways a
class can hold each (a property, a data or non-data descriptor, a slot, the instance dict, a class attribute,
__getattr__) and getters that change the type or the instance before they answer. Every getter that changes the
type's host interface and then says it has no CUDA one is checked; of the other 1,728 combinations a seeded
sample of 150 (the whole product takes a minute and a half)."""
import itertools
import random

import numpy as np
import pytest

from cai_dlpack import cai2dlpack
from support.dlpack_ctypes import read_capsule

HOST_A = np.arange(4.0)
HOST_B = np.arange(3, dtype=np.float32)
DEV = np.zeros(64, dtype=np.uint8)


def cai_dict():
    return {"shape": (2,), "typestr": "<f4", "data": (DEV.ctypes.data, False), "version": 3, "strides": None}


def ai_a():
    return dict(HOST_A.__array_interface__)


def ai_b():
    return dict(HOST_B.__array_interface__)


CAI_KINDS = ["none", "prop_ok", "prop_ae", "datadesc_ok", "datadesc_ae", "nondata_ok", "nondata_ae", "slot", "classattr"]
MUTATIONS = ["none", "add_type_ai", "del_type_ai", "add_inst_ai", "del_inst_ai", "del_type_cai"]
AI_TYPE = ["none", "prop", "classattr"]
AI_INST = [False, True]
HOOK = ["none", "ai", "cai"]


def make(cai_kind, mutation, ai_type, ai_inst, cai_inst, hook):
    ns = {}

    def mutate(self):
        cls = type(self)
        if mutation == "add_type_ai":
            cls.__array_interface__ = property(lambda s: ai_b())
        elif mutation == "del_type_ai" and "__array_interface__" in cls.__dict__:
            delattr(cls, "__array_interface__")
        elif mutation == "add_inst_ai" and hasattr(self, "__dict__"):
            self.__dict__["__array_interface__"] = ai_b()
        elif mutation == "del_inst_ai" and hasattr(self, "__dict__"):
            self.__dict__.pop("__array_interface__", None)
        elif mutation == "del_type_cai" and "__cuda_array_interface__" in cls.__dict__:
            delattr(cls, "__cuda_array_interface__")

    if cai_kind in ("prop_ok", "prop_ae"):
        def getter(self):
            mutate(self)
            if cai_kind == "prop_ae":
                raise AttributeError("none here")
            return cai_dict()
        ns["__cuda_array_interface__"] = property(getter)
    elif cai_kind in ("datadesc_ok", "datadesc_ae", "nondata_ok", "nondata_ae"):
        class Desc:
            def __get__(self, obj, typ=None):
                if obj is None:
                    return self
                mutate(obj)
                if cai_kind in ("datadesc_ae", "nondata_ae"):
                    raise AttributeError("none here")
                return cai_dict()
        if not cai_kind.startswith("nondata"):
            Desc.__set__ = lambda self, obj, value: None
        ns["__cuda_array_interface__"] = Desc()
    elif cai_kind == "slot":
        ns["__slots__"] = ("__cuda_array_interface__", "__dict__")
    elif cai_kind == "classattr":
        ns["__cuda_array_interface__"] = cai_dict()
    if ai_type == "prop":
        ns["__array_interface__"] = property(lambda s: ai_a())
    elif ai_type == "classattr":
        ns["__array_interface__"] = ai_a()
    if hook != "none":
        def __getattr__(self, name, hook=hook):
            if hook == "ai" and name == "__array_interface__":
                return ai_b()
            if hook == "cai" and name == "__cuda_array_interface__":
                return cai_dict()
            raise AttributeError(name)
        ns["__getattr__"] = __getattr__
    cls = type("P", (), ns)
    obj = cls()
    if ai_inst:
        obj.__dict__["__array_interface__"] = ai_a()
    if cai_inst:
        obj.__dict__["__cuda_array_interface__"] = cai_dict()
    return cls, obj


def reference(obj):
    try:
        return "cai", obj.__cuda_array_interface__["data"][0]
    except AttributeError:
        pass
    try:
        return "ai", obj.__array_interface__["data"][0]
    except AttributeError:
        return "none", None


def actual(obj):
    try:
        f = read_capsule(cai2dlpack(obj))
    except TypeError as e:
        if "neither" in str(e):
            return "none", None
        raise
    return ("cai" if f["device"][0] == 2 else "ai"), f["data"]


ALL_CASES = list(itertools.product(CAI_KINDS, MUTATIONS, AI_TYPE, AI_INST, [False, True], HOOK))
CHANGING = [c for c in ALL_CASES if c[0].endswith("_ae") and c[1] in ("add_type_ai", "del_type_ai")]
CASES = CHANGING + random.Random(35).sample([c for c in ALL_CASES if c not in CHANGING], 150)


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_lookup_matches_getattr(cudart, case):
    cudart.add_region(DEV.ctypes.data, DEV.nbytes, 2, 0)
    _, expect_obj = make(*case)
    _, obj = make(*case)
    expected = reference(expect_obj)
    got = actual(obj)
    assert got == expected
