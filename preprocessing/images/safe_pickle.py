"""Unpickling that can rebuild plain numpy arrays and nothing else.

A pickle is a program: loading one calls whatever callables it names. The
CIFAR-10 python version is a set of pickles, so :func:`load_arrays` admits
only the four globals numpy needs to rebuild an ordinary array
(``numpy.core.multiarray._reconstruct``, its numpy 2 name
``numpy._core.multiarray._reconstruct``, ``numpy.ndarray``, ``numpy.dtype``)
and resolves them to numpy's own objects without importing the named
module. Any other global (``os.system``, ``builtins.eval``, numpy's
protocol-5 ``_frombuffer``, ``_codecs.encode`` from Python 3 protocol-2
pickles of bytes) raises :class:`ImageFormatError` before anything is called.
"""
from __future__ import annotations

import io
import pickle
from typing import Any

import numpy as np

from preprocessing.images.errors import ImageFormatError, one_line

try:  # numpy >= 2 (1.26 has the alias too)
    from numpy._core.multiarray import _reconstruct
except ImportError:  # pragma: no cover - older numpy
    from numpy.core.multiarray import _reconstruct

_ADMITTED: dict[tuple[str, str], Any] = {
    ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
}


class _ArraysOnly(pickle.Unpickler):
    """An unpickler whose globals are :data:`_ADMITTED` only."""

    def __init__(self, data: bytes, name: str) -> None:
        super().__init__(io.BytesIO(data), encoding="bytes")
        self.name = name

    def find_class(self, module: str, name: str) -> Any:
        found = _ADMITTED.get((module, name))
        if found is None:
            raise ImageFormatError(
                f"{self.name}: expected a pickle of plain numpy arrays, lists and bytes, found "
                f"a reference to {one_line(module)}.{one_line(name)}; the pickle holds "
                f"something other than the expected arrays and was not executed")
        return found


def load_arrays(data: bytes, name: str) -> Any:
    """Unpickle ``data`` (``encoding="bytes"``) admitting plain numpy arrays only.

    Raises:
        ImageFormatError: the pickle names any other global, or is not a
            readable pickle at all; ``name`` heads the message.
    """
    try:
        return _ArraysOnly(data, name).load()
    except ImageFormatError:
        raise
    except Exception as exc:  # a malformed pickle can raise nearly any type
        raise ImageFormatError(f"{name}: expected a readable pickle, found a malformed one "
                               f"({type(exc).__name__}: {one_line(exc)})") from None
