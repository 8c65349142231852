"""Unpickling that rebuilds plain numpy arrays from bytes they carry, and nothing else.

A pickle is a program: loading one calls whatever callables it names, and
numpy's own callables will build an array over any buffer with any strides
(``numpy.ndarray``) or hand over memory nobody filled (``_reconstruct``
without the BUILD that gives the array its contents). So :func:`load_arrays`
runs no numpy code on the pickle's say-so: the globals numpy's pickles name
resolve to stand-ins of this module, and an array exists only once its
bytes, all of them, are in the pickle:

* ``numpy.core.multiarray._reconstruct`` (numpy 2: ``numpy._core.multiarray``;
  how protocols 2 to 4 pickle an array) gives a pending array; its BUILD
  state (shape, dtype, order, bytes) must follow, once, with exactly
  ``prod(shape) * itemsize`` bytes. An array left without one is refused.
* ``numpy.core.numeric._frombuffer`` (numpy 2: ``numpy._core.numeric``; how
  protocol 5 pickles an array in-band) must carry exactly as many bytes as
  its shape and dtype need. Out-of-band buffers (``buffer_callback``) are
  refused: the bytes are not in the file.
* ``numpy.dtype`` admits integer types only (uint8 pixels, integer labels).
* ``numpy.ndarray`` may only be named as ``_reconstruct``'s subtype; calling
  it (an array over a buffer with strides the file chooses) is refused.

Any other global (``os.system``, ``builtins.eval``, ``_codecs.encode`` from
Python 3 protocol-2 pickles of bytes) and BUILD on anything but these
stand-ins raise :class:`ImageFormatError` before anything is called.

The unpickler is Python's own pure-Python one (``pickle._Unpickler``), whose
counted strings are read before they are kept and whose memo is a dict, so
a length or memo index the file claims costs memory only if the file holds
it (the C unpickler allocates a claimed length first, and grows its memo
array to a claimed index). Four changes serve the same end: BYTEARRAY8
keeps the bytes it read instead of allocating its claimed length; memo
indices stay below 2**32; a dict or set holds at most :data:`MAX_ENTRIES`
entries (integers that collide in a hash table would make building a large
one take quadratic time; a batch is a dict of four); and a pickle runs at
most :data:`MAX_OPCODES` opcodes (a one-byte opcode can make a new empty
list of 56 bytes, so a file at the size bound could otherwise fill
gigabytes with them).
"""
from __future__ import annotations

import io
import math
import pickle
import struct
from typing import Any

import numpy as np

from preprocessing.images.errors import ImageFormatError, one_line, printable

#: dtypes a CIFAR-10 pickle may give its arrays: uint8 pixels, integer labels.
DTYPES = frozenset({"u1", "i1", "u2", "i2", "u4", "i4", "u8", "i8", "B", "b"})
#: Byte orders a dtype's state may name.
BYTE_ORDERS = frozenset({"|", "<", ">", "="})
#: The most dimensions an admitted array may have (pixel rows are 2-D).
MAX_NDIM = 2
#: The most entries a dict or set of the pickle may hold.
MAX_ENTRIES = 64
#: Memo indices are below this (the C unpickler's own limit is the address space).
MEMO_LIMIT = 1 << 32
#: The most opcodes a pickle may run: each makes at most one object, so this
#: bounds the memory of small objects (an official batch runs about 20,000:
#: a label and a file name per image).
MAX_OPCODES = 250_000


def _refuse(name: str, found: str) -> ImageFormatError:
    return ImageFormatError(f"{name}: expected a pickle of plain numpy arrays, lists and "
                            f"bytes, found {found}; the pickle holds something other than "
                            f"the expected arrays and was not executed")


def _text(value: object) -> str | None:
    """``value`` as str when it is str or bytes (Python 2's str), else None."""
    if isinstance(value, bytes):
        return value.decode("latin-1")
    return value if isinstance(value, str) else None


class _DType:
    """Stands for ``numpy.dtype(spec, align, copy)``: an integer type only."""

    def __init__(self, spec: object, align: object = False, copy: object = True) -> None:
        text = _text(spec)
        if text is None or text.lstrip("<>|=") not in DTYPES:
            raise ImageFormatError(f"a dtype {one_line(repr(spec))[:40]}, not an integer type")
        self.dtype = np.dtype(text)

    def __setstate__(self, state: object) -> None:
        """numpy's dtype state: ``(version, byte order, None, None, None, -1, -1, 0)``."""
        if (not isinstance(state, tuple) or len(state) not in (8, 9)
                or _text(state[1]) not in BYTE_ORDERS or state[2:5] != (None, None, None)
                or state[5:8] != (-1, -1, 0)):
            raise ImageFormatError(f"a dtype state {one_line(repr(state))[:80]}, not that of "
                                   f"an integer type")
        order = _text(state[1])
        if order in "<>" and self.dtype.itemsize > 1:
            self.dtype = self.dtype.newbyteorder(order)


def _array_from(name: str, data: object, dtype: object, shape: object,
                fortran: bool) -> np.ndarray:
    """The array of ``shape`` and ``dtype`` over ``data``, which must hold
    exactly its bytes (never a view beyond them, never a copy)."""
    if not isinstance(dtype, _DType):
        raise _refuse(name, f"an array whose dtype is {type(dtype).__name__}")
    if (not isinstance(shape, tuple) or len(shape) > MAX_NDIM
            or not all(type(n) is int and n >= 0 for n in shape)):
        raise _refuse(name, f"an array whose shape is {one_line(repr(shape))[:60]}")
    if not isinstance(data, (bytes, bytearray)):
        raise _refuse(name, f"an array whose contents are {type(data).__name__}, not bytes")
    needed = math.prod(shape) * dtype.dtype.itemsize
    if len(data) != needed:
        raise ImageFormatError(
            f"{name}: an array claims shape {shape} of {dtype.dtype} ({needed:,} bytes) but "
            f"carries {len(data):,} bytes; refused (a pickle's array must hold its own bytes)")
    return np.frombuffer(data, dtype=dtype.dtype).reshape(shape, order="F" if fortran else "C")


class _Pending:
    """What ``_reconstruct`` returns: an array that exists once BUILD gives it
    its state ``(version, shape, dtype, is_fortran, bytes)``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.value: np.ndarray | None = None

    def __setstate__(self, state: object) -> None:
        if self.value is not None:
            raise _refuse(self.name, "an array given its contents twice")
        if not isinstance(state, tuple) or len(state) not in (4, 5):
            raise _refuse(self.name, "an array state that is not numpy's")
        shape, dtype, fortran, data = state[-4:]
        if (len(state) == 5 and state[0] != 1) or type(fortran) is not bool:
            raise _refuse(self.name, "an array state that is not numpy's")
        self.value = _array_from(self.name, data, dtype, shape, fortran)


def _ndarray_called(*args: object) -> None:
    """``numpy.ndarray`` named as a callable: never run."""
    raise ImageFormatError(
        "a call of numpy.ndarray (an array over a buffer, with a shape and strides the "
        "file chooses); numpy's own pickles never make one")


class _Budget(dict):
    """A dispatch table that refuses its lookup number ``limit + 1``: the
    unpickler looks up every opcode it runs."""

    def __init__(self, table: dict, limit: int, name: str) -> None:
        super().__init__(table)
        self.left, self.name = limit, name

    def __getitem__(self, code: int):
        self.left -= 1
        if self.left < 0:
            raise _refuse(self.name, f"more than {MAX_OPCODES:,} pickle opcodes (an official "
                          f"batch runs about 20,000)")
        return dict.__getitem__(self, code)


class _ArraysOnly(pickle._Unpickler):
    """Python's pure-Python unpickler with the stand-ins of the module docstring."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, data: bytes | bytearray, name: str) -> None:
        super().__init__(io.BytesIO(data), encoding="bytes")
        self.name = name
        self.dispatch = _Budget(type(self).dispatch, MAX_OPCODES, name)
        self.pending: list[_Pending] = []
        self.globals = {
            ("numpy.core.multiarray", "_reconstruct"): self._reconstruct,
            ("numpy._core.multiarray", "_reconstruct"): self._reconstruct,
            ("numpy.core.numeric", "_frombuffer"): self._frombuffer,
            ("numpy._core.numeric", "_frombuffer"): self._frombuffer,
            ("numpy", "ndarray"): _ndarray_called,
            ("numpy", "dtype"): _DType,
        }

    def find_class(self, module: str, name: str) -> Any:
        found = self.globals.get((module, name))
        if found is None:
            raise _refuse(self.name, f"a reference to {printable(module)}.{printable(name)}")
        return found

    def persistent_load(self, pid: object) -> Any:
        raise _refuse(self.name, "a persistent reference")

    def _reconstruct(self, subtype: object, shape: object, dtype: object) -> _Pending:
        if subtype is not _ndarray_called:
            raise _refuse(self.name, f"an array of subtype {type(subtype).__name__}")
        pending = _Pending(self.name)
        self.pending.append(pending)
        return pending

    def _frombuffer(self, data: object, dtype: object, shape: object,
                    order: object) -> np.ndarray:
        if order not in ("C", "F"):
            raise _refuse(self.name, f"an array of order {one_line(repr(order))[:20]}")
        return _array_from(self.name, data, dtype, shape, order == "F")

    def load_build(self) -> None:
        state = self.stack.pop()
        target = self.stack[-1]
        if type(target) not in (_Pending, _DType):
            raise _refuse(self.name, f"a BUILD of {type(target).__name__}")
        target.__setstate__(state)

    def load_out_of_band(self) -> None:
        raise ImageFormatError(
            f"{self.name}: expected a pickle that holds its arrays' bytes, found out-of-band "
            f"buffers (protocol 5 with buffer_callback); pickle the arrays in-band "
            f"(pickle.dumps(batch, protocol=5) without buffer_callback)")

    def load_bytearray8(self) -> None:
        (size,) = struct.unpack("<Q", self.read(8))
        data = self.read(size)
        if len(data) != size:
            raise _refuse(self.name, f"a byte array of {size:,} bytes cut short at "
                          f"{len(data):,}")
        self.append(bytearray(data))

    def load_put(self) -> None:
        index = int(self.readline()[:-1])
        if not 0 <= index < MEMO_LIMIT:
            raise _refuse(self.name, f"a memo index of {index}")
        self.memo[index] = self.stack[-1]

    def _room(self, target: object, adding: int) -> None:
        """Refuse growing ``target`` (a dict or set) past :data:`MAX_ENTRIES`."""
        if isinstance(target, (dict, set, frozenset)) and len(target) + adding > MAX_ENTRIES:
            raise _refuse(self.name, f"a dict or set of more than {MAX_ENTRIES} entries")

    def _marked(self) -> object:
        """The object just below the open MARK (what SETITEMS and ADDITEMS fill)."""
        below = self.metastack[-1] if self.metastack else []
        return below[-1] if below else None

    def load_dict(self) -> None:
        self._room({}, len(self.stack) // 2)
        pickle._Unpickler.load_dict(self)

    def load_setitem(self) -> None:
        self._room(self.stack[-3] if len(self.stack) > 2 else None, 1)
        pickle._Unpickler.load_setitem(self)

    def load_setitems(self) -> None:
        self._room(self._marked(), len(self.stack) // 2)
        pickle._Unpickler.load_setitems(self)

    def load_additems(self) -> None:
        self._room(self._marked(), len(self.stack))
        pickle._Unpickler.load_additems(self)

    def load_frozenset(self) -> None:
        self._room(frozenset(), len(self.stack))
        pickle._Unpickler.load_frozenset(self)

    for _code, _load in ((pickle.BUILD, load_build), (pickle.NEXT_BUFFER, load_out_of_band),
                         (pickle.READONLY_BUFFER, load_out_of_band),
                         (pickle.BYTEARRAY8, load_bytearray8), (pickle.PUT, load_put),
                         (pickle.DICT, load_dict), (pickle.SETITEM, load_setitem),
                         (pickle.SETITEMS, load_setitems), (pickle.ADDITEMS, load_additems),
                         (pickle.FROZENSET, load_frozenset)):
        dispatch[_code[0]] = _load
    del _code, _load

    def resolved(self, value: object) -> object:
        """``value`` with every array in it (at the top, in a dict's values or a
        list's items) as a numpy array.

        Raises:
            ImageFormatError: an array was never given its contents.
        """
        if any(p.value is None for p in self.pending):
            raise ImageFormatError(
                f"{self.name}: expected every array of the pickle to carry its bytes, found "
                f"one reconstructed without them (no BUILD state: its memory was never "
                f"filled); refused")

        def one(item: object) -> object:
            return item.value if isinstance(item, _Pending) else item

        if isinstance(value, dict):
            return {key: (list(map(one, item)) if isinstance(item, list) else one(item))
                    for key, item in value.items()}
        return one(value)


def load_arrays(data: bytes | bytearray, name: str) -> Any:
    """Unpickle ``data`` (``encoding="bytes"``) admitting plain numpy arrays only.

    Returns:
        The unpickled object, every array in it (at the top, in a dict's values
        or a list's items) a numpy array over the pickle's own bytes.

    Raises:
        ImageFormatError: the pickle names any other global, builds an array
            the module docstring refuses, or is not a readable pickle at all;
            ``name`` heads the message.
    """
    unpickler = _ArraysOnly(data, name)
    try:
        return unpickler.resolved(unpickler.load())
    except ImageFormatError as exc:
        text = str(exc)
        raise (exc if text.startswith(f"{name}: ") else _refuse(name, text)) from None
    except Exception as exc:  # a malformed pickle can raise nearly any type
        raise ImageFormatError(f"{name}: expected a readable pickle, found a malformed one "
                               f"({type(exc).__name__}: {printable(one_line(exc), 200)})") from None
