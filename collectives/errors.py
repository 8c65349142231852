"""Errors of the all-reduce API, each a class a user can act on.

Every class carries ``exit_code = 2`` (a user error, see :mod:`engine.spmd`):
under ``mpidp`` it prints as one line instead of a traceback. An instance
raised identically on every rank (after the ranks compared their calls) has
``collective = True``, so only rank 0 prints it and the job exits cleanly;
otherwise the raising rank ends the whole job.
"""
from __future__ import annotations


class AllreduceError(ValueError):
    """Base class of the user errors raised by :func:`collectives.allreduce`."""

    exit_code = 2
    collective = False


class UnknownAlgorithm(AllreduceError):
    """An algorithm name that is not registered."""


class UnknownOp(AllreduceError):
    """A reduction other than ``sum``, ``max``, ``min``."""


class UnsupportedBuffer(AllreduceError, TypeError):
    """A buffer the all-reduce cannot reduce in place.

    Supported: contiguous 1-D numpy arrays and torch CPU tensors of float16,
    float32, float64, int32 or int64 in native byte order, and device arrays
    exposing ``__cuda_array_interface__`` (with CuPy installed).
    """


class AllreduceMismatch(AllreduceError, RuntimeError):
    """The ranks called the all-reduce with different buffers or arguments.

    Raised on every rank (``collective = True``) when the ranks compared their
    calls and disagree (first call of a signature), and on the rank that
    detects it when a message of another call arrives in the middle of an
    algorithm (then the job is ended from that rank).
    """

    def __init__(self, message: str, collective: bool = False) -> None:
        super().__init__(message)
        self.collective = collective


class PeerEnded(AllreduceError, RuntimeError):
    """A call every rank of a communicator must make was made on this rank
    after the program of a peer (on this node) had ended without making it
    (:func:`collectives.core.ended.wait_for_peers`)."""
