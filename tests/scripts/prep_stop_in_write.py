"""Test program: ``mpidp ARGS...`` where rank 0 gets SIGTERM during prep's write phase.

The signal is raised inside a weak reference's callback while the image
file's attributes are written, where h5py's own clean-up runs Python: the
place where a handler that raises loses its exception (it is "unraisable").
tests/test_prep_images_hostile.py runs it under mpiexec.
"""
import signal
import sys
import weakref

from collectives.runtime import MPI
from preprocessing import h5format


def _interrupted(attrs, values, write=h5format.write_attributes):
    write(attrs, values)

    class Thing:
        pass

    thing = Thing()
    ref = weakref.ref(thing, lambda _: signal.raise_signal(signal.SIGTERM))
    del thing
    assert ref() is None


if MPI.COMM_WORLD.Get_rank() == 0:
    h5format.write_attributes = _interrupted

from engine.cli import console  # noqa: E402 - after the patch, as the command imports

sys.argv = ["mpidp", *sys.argv[1:]]
sys.exit(console())
