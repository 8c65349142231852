"""The all-reduce algorithms, one module each; importing this package registers them.

Registration order is the order of :func:`collectives.names` and of the
benchmark's table.
"""
from collectives.algorithms import naive, recursive_doubling, ring, rabenseifner, native  # noqa: F401
