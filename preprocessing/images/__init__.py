"""Readers for the official image data sets: MNIST (idx files) and CIFAR-10.

Each reader takes the path of the files as distributed and returns one
:class:`ImageSet` per split (``"train"``, ``"test"``): uint8 images
``[N, C, H, W]``, uint8 labels ``[N]`` and the sha256 of every file read.
Every problem with the files is one :class:`ImageFormatError` line naming the
file; nothing is downloaded and nothing is written. Turning the sets into
HDF5 is the caller's job (``mpidp prep``).
"""
from preprocessing.images.cifar10 import read_cifar10
from preprocessing.images.errors import ImageFormatError
from preprocessing.images.imageset import ImageSet
from preprocessing.images.mnist import read_mnist

__all__ = ["ImageFormatError", "ImageSet", "read_cifar10", "read_mnist"]
