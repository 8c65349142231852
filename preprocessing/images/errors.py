"""The one error the image readers raise, and where the official files come from.

Every :class:`ImageFormatError` message is one line: it names the file (for a
member of a tar archive, ``archive:member``), says what was expected and what
was found, and, when files are missing, where the official ones come from.
Nothing is ever downloaded: the user fetches the files and passes their path.
"""
from __future__ import annotations

from preprocessing.errors import PrepError

MNIST_SOURCE = (
    "the official files are at http://yann.lecun.com/exdb/mnist/ "
    "(train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, "
    "t10k-images-idx3-ubyte.gz, t10k-labels-idx1-ubyte.gz); mpidp downloads nothing"
)
CIFAR10_SOURCE = (
    "the official files are at https://www.cs.toronto.edu/~kriz/cifar.html "
    '("CIFAR-10 binary version", cifar-10-binary.tar.gz); mpidp downloads nothing'
)


class ImageFormatError(PrepError):
    """A missing, unreadable or malformed image file: one line, exit code 2.

    Takes ``message`` and the keyword ``collective`` like
    :class:`~preprocessing.errors.PrepError`; newlines in ``message`` (from a
    path or an exception text) are folded into spaces so the line stays one.
    """

    def __init__(self, message: str, *, collective: bool = False) -> None:
        super().__init__(one_line(message), collective=collective)


def one_line(text: object) -> str:
    """``str(text)`` with every run of whitespace (newlines included) as one space."""
    return " ".join(str(text).split())


def printable(text: object, limit: int = 100) -> str:
    """``str(text)`` safe to print from a hostile file: characters other than
    printable ASCII as ``\\xNN`` (no terminal escape sequences), at most
    ``limit`` characters (then ``...``)."""
    shown = "".join(c if c.isascii() and c.isprintable() else ascii(c)[1:-1]
                    for c in str(text)[:limit])
    return shown + ("..." if len(str(text)) > limit else "")
