"""Where cai2dlpack finds an object's interface: the same answer as Python's attribute lookup, whichever way
it is asked (a plain holder's instance dict is read directly; anything with hooks or type-level attributes
goes through getattr)."""
import functools
import sys

import numpy as np
import pytest

from cai_dlpack import DLPackShim, cai2dlpack, dlpack2cai
from support.cai_objects import register
from support.cuda_double import DEVICE


class Plain:
    pass


class Hooked:
    def __init__(self, iface):
        self.iface = iface

    def __getattr__(self, name):
        if name == "__array_interface__":
            return self.iface
        raise AttributeError(name)


class Slotted:
    __slots__ = ("__array_interface__",)


class TypeLevel:
    def __init__(self, iface):
        self.iface = iface

    @property
    def __array_interface__(self):
        return self.iface


def holder(kind, iface):
    if kind in (Hooked, TypeLevel):
        return kind(iface)
    made = kind()
    made.__array_interface__ = iface
    return made


@pytest.mark.parametrize("kind", [Plain, Hooked, Slotted, TypeLevel])
def test_every_way_of_holding_an_interface_is_read(kind):
    x = np.arange(6.0).reshape(2, 3)
    view = dlpack2cai(cai2dlpack(holder(kind, dict(x.__array_interface__))))
    assert view.__array_interface__["data"][0] == x.ctypes.data
    np.testing.assert_array_equal(np.asarray(view), x)


def test_an_instance_cai_wins_over_an_instance_array_interface(cudart):
    device, host = np.zeros(4, dtype=np.float32), np.zeros(3)
    register(cudart, device, DEVICE)
    both = Plain()
    both.__array_interface__ = dict(host.__array_interface__)
    both.__cuda_array_interface__ = dict(device.__array_interface__, version=3, stream=None)
    view = dlpack2cai(cai2dlpack(both))
    assert view.device == (2, 0) and view.shape == (4,)


def test_a_holder_that_loses_its_interface_is_refused():
    x = np.arange(3.0)
    made = holder(Plain, dict(x.__array_interface__))
    cai2dlpack(made)
    del made.__array_interface__
    for convert in (cai2dlpack, lambda o: DLPackShim(o).__dlpack__()):
        with pytest.raises(TypeError, match="Plain has neither __cuda_array_interface__ nor __array_interface__"):
            convert(made)


def uninterned(text):
    """An equal str that is not the interned one (setattr would intern it; a __dict__ store does not)."""
    made = "".join(list(text))
    assert made == text and made is not text
    return made


class Key(str):
    """A str subclass as an instance-dict key: equal to the name, never identical to it."""

    __hash__ = str.__hash__


@pytest.mark.parametrize("make_key", [uninterned, Key], ids=["an uninterned str", "a str subclass"])
@pytest.mark.parametrize("extra_attributes", [0, 8], ids=["a small dict", "a large dict"])
def test_instance_keys_that_are_not_the_interned_names_are_still_found(cudart, make_key, extra_attributes):
    device, host = np.zeros(4, dtype=np.float32), np.zeros(3)
    register(cudart, device, DEVICE)
    # A class of its own: instances of one class share their dicts' keys, which an earlier setattr would have
    # filled with the interned name.
    both = type("Fresh", (), {})()
    for i in range(extra_attributes):
        setattr(both, f"a{i}", i)
    both.__array_interface__ = dict(host.__array_interface__)
    both.__dict__[make_key("__cuda_array_interface__")] = dict(device.__array_interface__, version=3, stream=None)
    assert not any(key is sys.intern(str(key)) for key in both.__dict__ if key.startswith("__cuda"))
    view = dlpack2cai(cai2dlpack(both))
    assert view.device == (2, 0) and view.shape == (4,)  # the CAI, as getattr finds it, wins


class ExplodingKey:
    """An instance-dict key that hashes as the interface's name and raises when compared with it."""

    def __init__(self, name):
        self.name = name

    def __hash__(self):
        return hash(self.name)

    def __eq__(self, other):
        raise LookupError(f"{self.name} cannot be compared")


@pytest.mark.parametrize("name", ["__cuda_array_interface__", "__array_interface__"])
@pytest.mark.parametrize("extra_attributes", [0, 8], ids=["a small dict", "a large dict"])
def test_an_instance_dict_lookup_that_raises_passes_the_error_on(name, extra_attributes):
    """The instance dict holds a key whose comparison with the name raises: getattr raises that error, and so
    does the conversion (nothing is read past it, and no error is left behind a result)."""
    made = type("Fresh", (), {})()
    for i in range(extra_attributes):
        setattr(made, f"a{i}", i)
    made.__dict__[ExplodingKey(name)] = 1
    with pytest.raises(LookupError, match="cannot be compared"):
        getattr(made, name)
    with pytest.raises(LookupError, match="cannot be compared"):
        cai2dlpack(made)


@pytest.mark.parametrize("extra_attributes", [0, 3, 8])
def test_other_instance_attributes_do_not_hide_the_interface(extra_attributes):
    x = np.arange(5.0)
    made = Plain()
    for i in range(extra_attributes):
        setattr(made, f"a{i}", i)
    made.__array_interface__ = dict(x.__array_interface__)
    assert np.asarray(dlpack2cai(cai2dlpack(made))).tolist() == x.tolist()
    del made.__array_interface__
    with pytest.raises(TypeError, match="neither __cuda_array_interface__ nor __array_interface__"):
        cai2dlpack(made)


class PropertyProducer:
    """Both interfaces as properties; the CUDA one says it has none (AttributeError) or fails otherwise."""

    def __init__(self, iface, cuda_error):
        self.iface, self.cuda_error = iface, cuda_error

    @property
    def __cuda_array_interface__(self):
        raise self.cuda_error

    @property
    def __array_interface__(self):
        return self.iface


def test_a_cuda_interface_property_raising_attribute_error_reads_the_array_interface():
    x = np.arange(6.0).reshape(2, 3)
    obj = PropertyProducer(dict(x.__array_interface__), AttributeError("host memory"))
    for capsule in (cai2dlpack(obj), DLPackShim(obj).__dlpack__()):
        np.testing.assert_array_equal(np.asarray(dlpack2cai(capsule)), x)


def test_a_cuda_interface_property_raising_another_error_passes_it_on():
    x = np.arange(6.0)
    obj = PropertyProducer(dict(x.__array_interface__), RuntimeError("producer failed"))
    with pytest.raises(RuntimeError, match="producer failed"):
        cai2dlpack(obj)


def producer_that_moves_to_the_host(decorator, before, after):
    """A class whose CUDA interface (a data or a non-data descriptor) changes the type's host interface, as a
    producer that moved its data to the host would, and then says it has no device data."""

    class Moving:
        __array_interface__ = property(lambda self: dict(before.__array_interface__))

        @decorator
        def __cuda_array_interface__(self):
            type(self).__array_interface__ = property(lambda s: dict(after.__array_interface__))
            raise AttributeError("the data is on the host now")

    return Moving()


@pytest.mark.parametrize("decorator", [property, functools.cached_property], ids=["property", "cached_property"])
def test_the_host_interface_is_the_one_getattr_finds_after_the_cuda_one_ran(decorator):
    before, after = np.arange(4.0), np.arange(3, dtype=np.float32)
    reference = producer_that_moves_to_the_host(decorator, before, after)
    with pytest.raises(AttributeError):
        reference.__cuda_array_interface__
    assert reference.__array_interface__["data"][0] == after.ctypes.data  # Python's lookup order
    view = dlpack2cai(cai2dlpack(producer_that_moves_to_the_host(decorator, before, after)))
    assert view.__array_interface__["data"][0] == after.ctypes.data
    assert view.__array_interface__["typestr"] == "<f4"
