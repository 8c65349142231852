"""Generic kernels written with torch ops: any device.

The fallback where a device has no kernel of its own (any op on a device no
other back-end serves; ``clip_groups`` on GPUs, see
:data:`kernels.registry.GENERIC_ON_GPU`), what ``backend="torch"``
(``mpidp train --kernels torch``) selects, and the reference the other
back-ends are tested against. The kernels run on whatever device the tensors
are on.
"""
