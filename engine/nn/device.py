"""Where a rank computes: the CPU, or one GPU per rank chosen by its node-local rank.

``mpidp train --device cuda`` runs one rank per GPU. Every rank learns its
rank among the ranks of its node from a shared-memory split of the
communicator (``MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)``, which works
under any launcher), the ranks of a node exchange the identities (UUIDs) of
the GPUs each of them can see, and every rank of the node computes the same
assignment: ranks that see few GPUs choose first, each takes the first GPU
it sees that no rank before it took. That covers the usual launches:

* ``mpiexec -n 4`` on a node with 4 GPUs: every rank sees all four, local
  rank i gets GPU i;
* ``srun --gpus-per-task=1 --gpu-bind=single:1`` (``jobs/common.sh``): every
  rank sees only its own GPU (``CUDA_VISIBLE_DEVICES``) and takes it;
* more ranks than GPUs on a node, or ranks bound to the same GPU: an error
  on every rank, naming the host and the counts, instead of ranks silently
  sharing a GPU.

The choice binds torch (``torch.cuda.set_device``) and, when installed, CuPy
and Numba's CUDA target to that GPU before anything allocates on it.
``--device cpu`` (the default) involves no communication and imports
nothing CUDA. What the engine needs from the GPUs (count, identities,
binding) is behind :class:`Inventory`, so tests exercise the selection with
a fake one on a machine without GPUs.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Protocol

import torch

from collectives import MPI
from engine.errors import ConfigError, MpidpError, agree

DEVICES = ("cpu", "cuda")


class DeviceError(MpidpError):
    """No usable GPU for this rank (none visible, or fewer GPUs than ranks on a node)."""


@dataclass(frozen=True)
class Placement:
    """The device of this rank and how it was chosen.

    ``host_buffer``: the flat all-reduce buffer lives in host memory as a
    numpy array (the CPU path); otherwise it is a tensor on ``device``.
    """

    device: torch.device
    local_rank: int = 0
    local_size: int = 1
    host: str = ""
    gpu_name: str | None = None
    host_buffer: bool = True

    def describe(self) -> str:
        if self.device.type == "cpu":
            return "cpu"
        return (f"{self.device} ({self.gpu_name}; local rank {self.local_rank} of "
                f"{self.local_size} on {self.host})")


class Inventory(Protocol):
    """The GPUs this process can see, and how to bind to one of them."""

    def visible(self) -> list[str]:
        """Identities (e.g. UUIDs) of the visible GPUs, in device-index order.

        Raises:
            DeviceError: no CUDA at all (a CPU build of torch, no driver).
        """

    def name(self, index: int) -> str:
        """A human-readable name of GPU ``index``."""

    def bind(self, index: int) -> None:
        """Make GPU ``index`` this process's current device (torch, CuPy, Numba)."""


def _visible_devices_note() -> str:
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    return "CUDA_VISIBLE_DEVICES is not set" if value is None else \
        f"CUDA_VISIBLE_DEVICES={value!r}"


class TorchCudaInventory:
    """:class:`Inventory` through torch.cuda (CuPy and Numba follow the binding)."""

    def visible(self) -> list[str]:
        if torch.version.cuda is None:
            raise DeviceError(
                f"--device cuda: this torch ({torch.__version__}) was built without CUDA; "
                "install a CUDA build of torch and the GPU extra (pip install "
                "'mpidp[cuda12]'; docs/gpus.md), or use --device cpu")
        if not torch.cuda.is_available():
            raise DeviceError(
                f"--device cuda: no CUDA GPU is visible on {socket.gethostname()} "
                f"({_visible_devices_note()}; torch {torch.__version__}, CUDA "
                f"{torch.version.cuda}); run on a GPU node (e.g. srun --gpus-per-task=1) "
                "or use --device cpu")
        return [self._identity(i) for i in range(torch.cuda.device_count())]

    @staticmethod
    def _identity(index: int) -> str:
        props = torch.cuda.get_device_properties(index)
        uuid = getattr(props, "uuid", None)
        if uuid is not None:
            return str(uuid)
        bus = [getattr(props, f"pci_{part}_id", None) for part in ("domain", "bus", "device")]
        if None not in bus:
            return "pci:{:04x}:{:02x}:{:02x}".format(*bus)
        return f"{props.name}#{index}"  # last resort: unique within this process only

    def name(self, index: int) -> str:
        return torch.cuda.get_device_name(index)

    def bind(self, index: int) -> None:
        torch.cuda.set_device(index)
        try:
            import cupy  # optional (the cuda extras): deferred, and absent on most machines
        except ImportError:
            pass
        else:
            cupy.cuda.Device(index).use()
        try:
            from numba import cuda  # optional (numba-cuda): deferred, imported only on GPUs
        except ImportError:
            return
        if cuda.is_available():
            cuda.select_device(index)


def assign(views: list[list[str]], host: str = "this node") -> list[int]:
    """Every local rank's GPU index, from what each local rank sees (pure function).

    Args:
        views: ``views[r]`` lists the identities of the GPUs local rank r sees,
            in its own device-index order.
        host: for messages.

    Returns:
        ``index[r]``: the device index (in rank r's own numbering) of its GPU;
        no GPU is given to two ranks.

    Raises:
        DeviceError: a rank sees no GPU, or not every rank can get its own.
    """
    distinct = sorted(set().union(*views)) if views else []
    for r, seen in enumerate(views):
        if not seen:
            raise DeviceError(f"--device cuda: local rank {r} on {host} sees no GPU "
                              "(its CUDA_VISIBLE_DEVICES is empty?); give every rank a GPU "
                              "or use --device cpu")
    if len(distinct) < len(views):
        raise DeviceError(
            f"--device cuda: {len(views)} ranks on {host} but only {len(distinct)} GPU(s) "
            "among them; launch one rank per GPU (at most "
            f"{len(distinct)} per node: mpiexec -n <GPUs>, or srun --ntasks-per-node="
            f"{len(distinct)} --gpus-per-task=1)")
    taken: set[str] = set()
    index = [-1] * len(views)
    for r in sorted(range(len(views)), key=lambda r: (len(views[r]), r)):
        free = [i for i, gpu in enumerate(views[r]) if gpu not in taken]
        if not free:
            # The greedy choice can block a rank that a different choice would
            # serve ([B, C], [A, B], [A, B]): look for any complete assignment.
            matched = _matching(views)
            if matched is not None:
                return matched
            raise DeviceError(
                f"--device cuda: local rank {r} on {host} sees only GPU(s) {views[r]}, "
                "all taken by other ranks of the node; bind one distinct GPU per rank "
                "(srun --gpus-per-task=1 --gpu-bind=single:1) or let every rank see all GPUs")
        index[r] = free[0]
        taken.add(views[r][free[0]])
    return index


def _matching(views: list[list[str]]) -> list[int] | None:
    """A distinct GPU for every rank (augmenting paths, Kuhn's method), as device
    indices in each rank's own numbering; None if no such assignment exists."""
    owner: dict[str, int] = {}  # GPU identity -> rank holding it

    def place(r: int, visited: set[str]) -> bool:
        for gpu in views[r]:
            if gpu in visited:
                continue
            visited.add(gpu)
            if gpu not in owner or place(owner[gpu], visited):
                owner[gpu] = r
                return True
        return False

    if not all(place(r, set()) for r in range(len(views))):
        return None
    index = [-1] * len(views)
    for gpu, r in owner.items():
        index[r] = views[r].index(gpu)
    return index


def node_split(comm: "MPI.Intracomm") -> "MPI.Intracomm":
    """Collective: the ranks of ``comm`` that share this node's memory (free it after use)."""
    return comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())


def select(kind: str, comm: "MPI.Intracomm | None",
           inventory: Inventory | None = None) -> Placement:
    """This rank's :class:`Placement` for ``--device kind``.

    Collective over ``comm`` for ``"cuda"`` (every rank must call it with the
    same ``kind``); local and communication-free for ``"cpu"``.

    Raises:
        ConfigError: an unknown kind.
        DeviceError: (collective, on every rank) some rank has no GPU of its own.
    """
    if kind not in DEVICES:
        raise ConfigError(f"--device {kind!r}: choose one of {', '.join(DEVICES)}",
                          collective=True)
    if kind == "cpu":
        return Placement(torch.device("cpu"))
    inventory = TorchCudaInventory() if inventory is None else inventory
    host = socket.gethostname()
    error: MpidpError | None = None
    visible: list[str] = []
    try:
        visible = inventory.visible()
    except DeviceError as exc:
        error = exc
    node = node_split(comm)
    try:
        local_rank, local_size = node.Get_rank(), node.Get_size()
        views = node.allgather(None if error else visible)
    finally:
        node.Free()
    index = -1
    if error is None and None not in views:
        try:
            index = assign(views, host)[local_rank]
        except DeviceError as exc:
            error = exc
    agree(comm, error)
    if index < 0:  # another rank of this node has no CUDA: it raised, the agreement too
        raise DeviceError("--device cuda: a rank of this node has no usable GPU",
                          collective=True)
    inventory.bind(index)
    return Placement(torch.device("cuda", index), local_rank, local_size, host,
                     inventory.name(index), host_buffer=False)
