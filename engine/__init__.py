"""mpidp engine: the SPMD trainer, its command line and its run-time helpers."""
from engine._version import __version__

__all__ = ["__version__"]
